"""Shared fixtures: where the real recorded corpus lives, and how to reach it.

The corpus is read in place from ``../shared/corpus`` beside the checkout (never copied into the
project). Without it the corpus tests skip with a reason; with ``FSM_REQUIRE_CORPUS=1`` (set by
``.ci/run``) a missing corpus is an error instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("FSM_CORPUS_DIR", REPO.parent / "shared" / "corpus"))


def corpus_available() -> bool:
    return (CORPUS / "expected.json").is_file()


def corpus_files() -> list[str]:
    """Relative paths of every recorded stream (``provider/file.sse``), sorted; ``[]`` without
    the corpus."""
    if not corpus_available():
        return []
    return sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.glob("*/*.sse"))


def corpus_expected() -> dict[str, Any]:
    if not corpus_available():
        return {}
    data: dict[str, Any] = json.loads((CORPUS / "expected.json").read_text())
    return data


def require_corpus() -> None:
    """Skip (or fail, under FSM_REQUIRE_CORPUS=1) when the corpus is not there."""
    if corpus_available():
        return
    message = f"the recorded corpus is not at {CORPUS} (set FSM_CORPUS_DIR or check out shared/)"
    if os.environ.get("FSM_REQUIRE_CORPUS") == "1":
        pytest.fail(message + "; FSM_REQUIRE_CORPUS=1 makes this an error")
    pytest.skip(message)


@pytest.fixture
def corpus_dir() -> Path:
    require_corpus()
    return CORPUS


def corpus_params() -> list[Any]:
    """Parametrize values for every corpus file; one skipping placeholder without the corpus."""
    files = corpus_files()
    if files:
        return files
    return [pytest.param(None, id="no-corpus")]
