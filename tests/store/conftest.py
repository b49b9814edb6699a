"""Fixtures of the store tests: a fresh database at head on each engine.

SQLite always runs (a file in the test's tmp_path). PostgreSQL runs when
``FSM_TEST_POSTGRES_URL`` is set (e.g. ``postgresql+psycopg://postgres@127.0.0.1:5432/test``);
tests work in uniquely-named schemas (selected through ``search_path``, dropped afterwards) and
start from empty tables, so they are independent. With ``FSM_REQUIRE_POSTGRES=1`` a missing or unreachable server is a
failure instead of a skip.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from openai.types.chat import ChatCompletionMessageParam
from pydantic import TypeAdapter

from fsm import parse
from fsm.parser import Turn
from fsm.store import ConversationStore
from fsm.store.engine import normalize_url
from fsm.store.migrate import upgrade

ENGINES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def _postgres_server() -> sa.URL:
    """The PostgreSQL server to test against, or a skip / failure with the reason."""
    required = os.environ.get("FSM_REQUIRE_POSTGRES") == "1"
    raw = os.environ.get("FSM_TEST_POSTGRES_URL")
    if not raw:
        reason = (
            "FSM_TEST_POSTGRES_URL is not set (e.g. postgresql+psycopg://postgres@localhost/test)"
        )
        if required:
            pytest.fail(f"{reason}; FSM_REQUIRE_POSTGRES=1 makes this an error")
        pytest.skip(reason)
    url = normalize_url(raw)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        reason = (
            f"PostgreSQL at {url.render_as_string(hide_password=True)} is unreachable: {exc.orig}"
        )
        if required:
            pytest.fail(f"{reason}; FSM_REQUIRE_POSTGRES=1 makes this an error")
        pytest.skip(reason)
    finally:
        engine.dispose()
    return url


def _pg_schema_url(server: sa.URL) -> tuple[sa.URL, Callable[[], None]]:
    """A new, empty schema on ``server``: its URL and a function that drops it."""
    schema = f"fsm_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    # synchronous_commit=off: commits do not wait for the WAL flush (tests need no durability
    # across a server crash, and the suite runs several times faster on slow disks)
    options = f"-csearch_path={schema} -csynchronous_commit=off"
    return server.update_query_dict({"options": options}), drop


@pytest.fixture(params=ENGINES)
def engine_name(request: pytest.FixtureRequest) -> str:
    """Each test using a database runs once per engine."""
    name: str = request.param
    return name


@pytest.fixture
def empty_url(engine_name: str, tmp_path: Path) -> Iterator[sa.URL]:
    """A URL of an empty database (no tables at all): a new file, or a new schema."""
    if engine_name == "sqlite":
        yield sa.make_url(f"sqlite:///{tmp_path / 'empty.db'}")
        return
    url, drop = _pg_schema_url(_postgres_server())
    try:
        yield url
    finally:
        drop()


@pytest.fixture(scope="session")
def _sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "head.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _postgres_at_head() -> Iterator[sa.URL]:
    url, drop = _pg_schema_url(_postgres_server())
    upgrade(url)
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def db_url(engine_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> sa.URL:
    """A URL of a fresh database at head, with no data.

    SQLite: a copy of a database migrated once per session. PostgreSQL: one schema migrated
    once per session, emptied before each test (``DELETE``), which is much faster than
    migrating a new schema for every test; the migration tests use :func:`empty_url`.
    """
    if engine_name == "sqlite":
        path = tmp_path / "store.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_at_head"), path)
        return sa.make_url(f"sqlite:///{path}")
    url: sa.URL = request.getfixturevalue("_postgres_at_head")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            # every table hangs off conversations with ON DELETE CASCADE; much faster than
            # TRUNCATE on tables this small
            conn.execute(sa.text("DELETE FROM conversations"))
    finally:
        engine.dispose()
    return url


@pytest.fixture
def store(db_url: sa.URL) -> Iterator[ConversationStore]:
    """A store on a fresh database, on each engine."""
    with ConversationStore(db_url) as opened:
        yield opened


def make_turn(
    calls: Sequence[tuple[str, str, str]] = (("call_1", "get_weather", '{"city": "Paris"}'),),
    *,
    content: str | None = None,
    response_id: str | None = "chatcmpl-1",
    finish_reason: str = "tool_calls",
    choice: int = 0,
    model: str = "test-model",
) -> Turn:
    """A turn parsed by the real parser from synthetic chunks: ``calls`` are (id, name, args)."""
    chunks: list[dict[str, Any]] = []

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": choice, "delta": delta, "finish_reason": finish}],
        }
        if response_id is not None:
            body["id"] = response_id
        return body

    if content is not None:
        chunks.append(chunk({"role": "assistant", "content": content}))
    for index, (call_id, name, arguments) in enumerate(calls):
        header = {"index": index, "id": call_id, "type": "function", "function": {"name": name}}
        chunks.append(chunk({"tool_calls": [header]}))
        half = len(arguments) // 2
        for part in (arguments[:half], arguments[half:]):
            if part:
                fragment = {"index": index, "function": {"arguments": part}}
                chunks.append(chunk({"tool_calls": [fragment]}))
    chunks.append(chunk({}, finish_reason))
    return parse(chunks).turn(choice)


OPENAI_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])


def assert_openai_accepts(messages: list[dict[str, Any]]) -> None:
    """Validate against the openai SDK's request types (iterables validate lazily: drain them)."""
    for message in OPENAI_MESSAGES.validate_python(messages):
        for key in ("tool_calls", "content"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                list(value)


def assert_blocks_whole(messages: list[dict[str, Any]]) -> None:
    """Every assistant message with N tool calls is followed by exactly its N results, in call
    order, and no tool message appears anywhere else."""
    i = 0
    while i < len(messages):
        message = messages[i]
        assert message["role"] != "tool", f"tool message outside a block at {i}"
        calls = message.get("tool_calls") or []
        results = messages[i + 1 : i + 1 + len(calls)]
        assert [r["role"] for r in results] == ["tool"] * len(calls), f"split block at {i}"
        assert [r["tool_call_id"] for r in results] == [c["id"] for c in calls]
        i += 1 + len(calls)
