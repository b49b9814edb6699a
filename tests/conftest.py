"""Shared fixtures. The helpers themselves (corpus access, stream builders) live in
``tests/helpers.py``; tests import them from there, never from this file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import CORPUS, require_corpus


@pytest.fixture
def corpus_dir() -> Path:
    require_corpus()
    return CORPUS
