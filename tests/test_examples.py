"""Every example of the manual and the README runs as it stands (issue 25).

The examples are files, ``docs/examples/*.py``: the pages include them (``literalinclude``) and
the README carries a copy of one (checked equal), so what a reader copies is what runs here.
Each runs as a complete program (a ``test_*.py`` example as a pytest module, with fsm's
plugin) in a fresh directory; the slow run runs each twice there (the second run meets the
first one's files). An
example that talks to a model says in its docstring which ``fsm replay`` to start; it gets that
server (``ReplayServer(repeat=True)``, what the command runs) and nothing but the environment
the command prints.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsm.cli.replay import replay_environment
from fsm.replay import ReplayServer, demo_script
from tests.helpers import REPO

DOCS = REPO / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
#: what an example imports that the test environment may lack, by the package to skip on
_OPTIONAL = ("fastapi", "anthropic", "aiosqlite", "httpx", "openai", "mcp", "opentelemetry")

#: the conftest of a pytest-module example: the plugin is loaded by its entry point, or here
#: when the installed fsm predates it
_PLUGIN_CONFTEST = (
    "def pytest_configure(config):\n"
    "    if not config.pluginmanager.has_plugin('fsm'):\n"
    "        config.pluginmanager.import_plugin('fsm.pytest_plugin')\n"
)


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _replay_format(path: Path) -> str | None:
    """The ``fsm replay [--format F]`` the example's docstring says to start, if any."""
    match = re.search(r"``fsm replay(?: --format (\w+))?``", _docstring(path))
    if match is None:
        return None
    return match.group(1) or "chat"


def _needs(path: Path) -> list[str]:
    text = path.read_text()
    needs = [name for name in _OPTIONAL if re.search(rf"^(import|from) {name}\b", text, re.M)]
    if "AsyncConversationStore(" in text:
        needs.append("aiosqlite")
    return needs


def _env() -> dict[str, str]:
    drop = ("FSM_DB_URL", "FSM_DB", "OPENAI_", "ANTHROPIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_there_are_examples_and_each_says_how_to_run() -> None:
    assert len(EXAMPLES) >= 12
    for path in EXAMPLES:
        doc = _docstring(path)
        assert doc, f"{path.name}: no docstring saying what it shows and how to run it"
        assert "python" in doc or "pytest" in doc, f"{path.name}: how to run it?"
        talks = re.search(r"\b(OpenAI|Anthropic|AsyncOpenAI)\(|OPENAI_BASE_URL", path.read_text())
        if talks and not path.name.startswith("test_"):
            assert _replay_format(path), f"{path.name} talks to a model: which fsm replay?"


def _run(path: Path, tmp_path: Path, runs: int) -> None:
    for name in _needs(path):
        pytest.importorskip(name)
    env = _env()
    command = [sys.executable, str(path)]
    if path.name.startswith("test_"):
        (tmp_path / "conftest.py").write_text(_PLUGIN_CONFTEST)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
        command += ["--rootdir", str(tmp_path), "-c", os.devnull]
    fmt = _replay_format(path)
    server = ReplayServer(demo_script(format=fmt or "chat"), repeat=True)  # type: ignore[arg-type]
    with server:
        if fmt is not None:
            env |= replay_environment(server.base_url, server.url)
        for run in range(1, runs + 1):
            done = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
            )
            assert done.returncode == 0, f"run {run}:\n{done.stdout}\n{done.stderr}"
            assert "Traceback" not in done.stderr
            if path.name.startswith("test_"):  # its test ran, and was not skipped
                assert re.search(r"\b[1-9]\d* passed\b", done.stdout), done.stdout
    assert server.failures == []
    if fmt is not None:
        assert len(server.requests) >= runs  # every run talked to the model


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_as_it_stands(path: Path, tmp_path: Path) -> None:
    _run(path, tmp_path, runs=1)


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_again_in_the_same_directory(path: Path, tmp_path: Path) -> None:
    """A reader runs an example twice: the second run meets the first one's files
    (``chat.db``, ``fsm.db``, ``effects.jsonl``) and must pass too."""
    _run(path, tmp_path, runs=2)


# -- the pages include the files, so page and test cannot drift ---------------------------------


def _pages() -> list[Path]:
    return [p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "drafts" not in p.parts]


def test_every_example_is_shown_by_a_page() -> None:
    shown = set()
    for page in _pages():
        for target in re.findall(r"```\{literalinclude\} (\S+)", page.read_text()):
            resolved = (page.parent / target).resolve()
            assert resolved.is_file(), f"{page}: includes {target}, which does not exist"
            shown.add(resolved)
    assert {p.resolve() for p in EXAMPLES} <= shown, "an example no page shows"


def test_no_page_has_a_python_example_of_its_own() -> None:
    """Python on a page is an included file; a fragment that cannot run alone (a few lines of
    your own module) is a ``{code-block}`` with a caption that says so."""
    for page in _pages():
        assert "```python" not in page.read_text(), f"{page}: make it a docs/examples file"
        assert "```py\n" not in page.read_text(), page


# -- the FastAPI service: errors are HTTP errors, an old schema stops the start-up -------------


def _load_fastapi_example(monkeypatch: pytest.MonkeyPatch, db: str, base_url: str) -> Any:
    pytest.importorskip("fastapi")
    pytest.importorskip("aiosqlite")
    monkeypatch.setenv("FSM_DB_URL", db)
    monkeypatch.setenv("OPENAI_BASE_URL", base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "test")
    monkeypatch.setenv("OPENAI_MAX_RETRIES", "0")
    spec = importlib.util.spec_from_file_location("fastapi_app", DOCS / "examples/fastapi_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fastapi_example_refuses_to_start_on_an_old_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the endpoint answered HTTP 200 with an empty body until the database was
    migrated. Now the start-up (the lifespan) fails with SchemaNotAtHeadError naming the
    command that fixes it, so no request is ever answered by a service that cannot store."""
    from fsm.store import upgrade
    from fsm.store.errors import SchemaNotAtHeadError

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0006_token_columns")
    app = _load_fastapi_example(monkeypatch, url, "http://127.0.0.1:9/v1")

    async def start() -> None:
        async with app.lifespan(app.app):
            pass

    with pytest.raises(SchemaNotAtHeadError, match="fsm db upgrade"):
        asyncio.run(start())


def test_fastapi_example_never_answers_an_empty_200(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the store refuses before anything is sent (a conversation id longer than 255
    characters) is an HTTP 422 saying why; a turn the provider fails (HTTP 500) is a 200 whose
    event stream ends with the error. Either way the conversation holds no half turn."""
    import httpx

    from fsm.replay import EXAMPLES_DIR, ReplayTurn

    script = [ReplayTurn(EXAMPLES_DIR / "parallel_add_multiply.sse", status=500)]
    with ReplayServer(script) as server:
        app = _load_fastapi_example(monkeypatch, f"sqlite:///{tmp_path / 's.db'}", server.base_url)

        async def post() -> tuple[httpx.Response, httpx.Response, list[Any]]:
            async with app.lifespan(app.app):
                app.app.state.client = app.AsyncOpenAI(max_retries=0)
                transport = httpx.ASGITransport(app=app.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                    refused = await http.post(
                        f"/conversations/{'x' * 300}/messages", json={"content": "x"}
                    )
                    failed = await http.post("/conversations/c1/messages", json={"content": "x"})
                history = await app.app.state.store.history("c1")
            return refused, failed, history

        refused, failed, history = asyncio.run(post())
    assert refused.status_code == 422, refused.text
    assert "InvalidConversationIdError" in refused.json()["detail"]
    assert failed.status_code == 200
    assert failed.text.rstrip().splitlines()[-1].startswith('data: {"error": ')
    assert [m["role"] for m in history] == ["user"]
