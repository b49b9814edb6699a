"""The tests' one set of helpers (tests and the fuzz harnesses import them): where the recorded
corpus is and how to reach it, builders for small hand-written streams in the shape providers
send, cutting bytes into pieces, and the tests' own JSON oracle. The store tests' helpers (a turn
built by the real parser, message checks, PostgreSQL schemas) are in :mod:`tests.helpers.store`.

The corpus is read in place from ``../shared/corpus`` beside the checkout (never copied into the
project). Without it the corpus tests skip with a reason; with ``FSM_REQUIRE_CORPUS=1`` (set by
``.ci/run``) a missing corpus is an error instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

# -- the recorded corpus -----------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(os.environ.get("FSM_CORPUS_DIR", REPO.parent / "shared" / "corpus"))


def repo_env() -> dict[str, str]:
    """The environment for a child Python that imports this checkout (``fsm`` and ``tests``)."""
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def child_json(code: str, *args: str, timeout: float) -> Any:
    """Run ``code`` in a fresh Python (``python -c code *args``, in the checkout, with
    :func:`repo_env`); it must exit 0, and its last output line is JSON: return it parsed."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=repo_env(),
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def require_recording(path: Path, what: str = "recording") -> Path:
    """``path``, a file under ``../shared`` (a recording of another corpus, read in place); skips
    (or fails, under FSM_REQUIRE_CORPUS=1) when it is not there, like :func:`require_corpus`."""
    if path.is_file():
        return path
    message = f"the {what} {path.name} is not at {path.parent} (check out shared/ beside fsm)"
    if os.environ.get("FSM_REQUIRE_CORPUS") == "1":
        pytest.fail(message + "; FSM_REQUIRE_CORPUS=1 makes this an error")
    pytest.skip(message)


#: the recordings of the Responses API and Anthropic Messages streams, read in place
SHARED = Path(os.environ.get("FSM_SHARED_DIR", REPO.parent / "shared"))
FORMAT_CORPORA = {
    "responses": SHARED / "corpus-responses",
    "anthropic": SHARED / "corpus-anthropic",
}


def recordings_of(folder: Path) -> list[Path]:
    """Every ``.sse`` file of ``folder`` (a corpus under ``../shared``), to parametrize a test
    with; without any, one placeholder path that :func:`require_recording` skips with its
    reason."""
    return sorted(folder.glob("*.sse")) or [folder / "(none).sse"]


def corpus_params() -> list[Any]:
    """Parametrize values for every corpus file; one skipping placeholder without the corpus."""
    files = corpus_files()
    if files:
        return files
    return [pytest.param(None, id="no-corpus")]


def need(name: str | None) -> str:
    """The corpus file's name; skips (or fails under FSM_REQUIRE_CORPUS=1) without the corpus."""
    if name is None:
        require_corpus()
    assert name is not None
    return name


@cache
def corpus_bytes(name: str) -> bytes:
    """The bytes of one recorded stream (``provider/file.sse``), read once."""
    return (CORPUS / name).read_bytes()


# -- the manual's tools ------------------------------------------------------------------------


def require_docs() -> None:
    """Skip (or fail, under FSM_REQUIRE_DOCS=1, as .ci/run's manual step sets) without the
    manual's tools (the ``docs`` extra: Sphinx, docutils, MyST)."""
    import importlib.util

    for module in ("docutils", "sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            message = f"needs the manual's tools ({module}): pip install -e '.[docs]'"
            if os.environ.get("FSM_REQUIRE_DOCS") == "1":
                pytest.fail(message + "; FSM_REQUIRE_DOCS=1 makes this an error")
            pytest.skip(message, allow_module_level=True)


def docs_extension() -> Any:
    """docs/_ext/fsmdocs.py, the manual's generated pages (:func:`require_docs` first)."""
    require_docs()
    ext = REPO / "docs" / "_ext"
    sys.path.insert(0, str(ext))
    try:
        import fsmdocs
    finally:
        sys.path.remove(str(ext))
    return fsmdocs


# -- cutting bytes -----------------------------------------------------------------------------


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """Cut ``data`` at ``points`` (taken modulo ``len(data) + 1``; repeats give empty pieces)."""
    at = sorted(p % (len(data) + 1) for p in points)
    return [data[a:b] for a, b in zip([0, *at], [*at, len(data)], strict=True)]


def bytewise(data: bytes) -> list[bytes]:
    """``data`` one byte a piece."""
    return [data[i : i + 1] for i in range(len(data))]


# -- building streams --------------------------------------------------------------------------


def tc(
    index: Any = None,
    id: Any = None,
    name: Any = None,
    args: Any = None,
    type: Any = None,
    *,
    omit_index: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """One ``tool_calls[]`` entry; ``None`` fields are left out (``omit_index`` drops index).

    Values are not checked, so tests can put wrong types anywhere; ``extra`` adds fields."""
    entry: dict[str, Any] = {}
    if index is not None and not omit_index:
        entry["index"] = index
    if id is not None:
        entry["id"] = id
    if type is not None:
        entry["type"] = type
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    if function:
        entry["function"] = function
    entry.update(extra)
    return entry


def entry(
    index: Any = 0, id: Any = None, name: Any = None, args: Any = None, **extra: Any
) -> dict[str, Any]:
    """:func:`tc` with index 0 by default (positional: index, id, name, args)."""
    return tc(index, id, name, args, **extra)


def chunk(
    *tool_calls: dict[str, Any],
    content: str | None = None,
    finish: str | None = None,
    choice: int = 0,
    **delta_extra: Any,
) -> dict[str, Any]:
    delta: dict[str, Any] = dict(delta_extra)
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = list(tool_calls)
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "test-model",
        "choices": [{"index": choice, "delta": delta, "finish_reason": finish}],
    }


def sse(*chunks: dict[str, Any] | str, done: bool = True) -> bytes:
    """SSE bytes: each chunk as ``data: <json>`` plus a blank line; a str is sent raw."""
    out = []
    for c in chunks:
        out.append(c if isinstance(c, str) else "data: " + json.dumps(c) + "\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def strict_json(text: str) -> bool:
    """The tests' own oracle (independent of fsm.toolcall.is_json): RFC 8259 JSON (no
    NaN/Infinity), or empty / JSON whitespace only."""
    if not text.strip(" \t\r\n"):
        return True

    def reject(constant: str) -> Any:
        raise ValueError(constant)

    try:
        json.loads(text, parse_constant=reject)
    except (ValueError, RecursionError):
        return False
    return True


def require_framework(module: str, extra: str) -> Any:
    """Import and return a framework's module (``"agents"``, ``"pydantic_ai"``, ...) for an
    integration test; skip without it, naming the extra that brings it, or fail under
    ``FSM_REQUIRE_FRAMEWORKS=1`` (set by .ci/run's frameworks step, which installs them all)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"needs {module} ({exc}): pip install -e '.[{extra}]'"
        if os.environ.get("FSM_REQUIRE_FRAMEWORKS") == "1":
            pytest.fail(message + "; FSM_REQUIRE_FRAMEWORKS=1 makes this an error")
        pytest.skip(message, allow_module_level=True)


def mypy_cache() -> list[str]:
    """mypy's options for a cache shared by the mypy runs of one test worker (one directory per
    interpreter and xdist worker, in the system's temporary directory): the first run checks the
    SDKs' stubs, the later ones reuse them (mypy checks each cached file against the source, so
    an edited fsm is checked again)."""
    import hashlib
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    venv = hashlib.sha256(sys.executable.encode()).hexdigest()[:12]
    return ["--cache-dir", str(Path(tempfile.gettempdir()) / "fsm-tests-mypy" / f"{venv}-{worker}")]
