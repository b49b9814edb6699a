"""The store tests' helpers: a turn built by the real parser, checks that messages are whole
blocks the openai SDK accepts, and PostgreSQL schemas to test in.

Kept apart from :mod:`tests.helpers` (which fuzz imports) so that importing the stream builders
does not load SQLAlchemy, pydantic and the openai SDK.
"""

from __future__ import annotations

import os
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
from fsm.store import ConversationStore, create_engine
from fsm.store.deadline import DEFAULT_TIMEOUT
from fsm.store.engine import normalize_url

# -- PostgreSQL --------------------------------------------------------------------------------


def postgres_server() -> sa.URL:
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


def pg_partitions() -> int | None:
    """``$FSM_TEST_PG_PARTITIONS``: the number of hash partitions of the PostgreSQL database the
    store tests share (``fsm db upgrade --partitions N``), or ``None`` (unpartitioned)."""
    raw = os.environ.get("FSM_TEST_PG_PARTITIONS")
    return int(raw) if raw else None


def pg_constraint(store: ConversationStore, name: str) -> str:
    """The fsm constraint or index a PostgreSQL error names. On a partitioned database a key or
    unique index is violated in a partition (``messages_p2_pkey``), whose index is attached to
    the parent's (``pk_fsm_messages``), and a foreign key referencing a partitioned table is checked
    by one internal constraint per partition (``messages_..._fkey2``), whose ``conparentid``
    leads to the declared one (``fk_fsm_messages_prev``); any other name is returned as it is."""
    with store.engine.connect() as conn:
        parent = conn.execute(
            sa.text(
                "SELECT p.relname FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid"
                " JOIN pg_class p ON p.oid = i.inhparent"
                " WHERE c.relkind = 'i' AND c.relname = :name"
                " AND c.relnamespace = current_schema()::regnamespace"
            ),
            {"name": name},
        ).scalar()
        declared = conn.execute(
            sa.text(
                "WITH RECURSIVE up AS (SELECT oid, conname, conparentid FROM pg_constraint"
                " WHERE conname = :name AND connamespace = current_schema()::regnamespace"
                " UNION ALL SELECT c.oid, c.conname, c.conparentid FROM pg_constraint c"
                " JOIN up ON c.oid = up.conparentid)"
                " SELECT conname FROM up WHERE conparentid = 0 LIMIT 1"
            ),
            {"name": name},
        ).scalar()
    return str(parent or declared or name)


def pg_schema_url(server: sa.URL) -> tuple[sa.URL, Callable[[], None]]:
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


# -- turns and messages ----------------------------------------------------------------------


def stepwise(url: sa.URL | str, timeout: float | None = None) -> ConversationStore:
    """A store whose commits go statement by statement on PostgreSQL (``BEGIN`` with the
    settings, the lock, the turn, ``COMMIT``), as on an engine created with
    ``one_query=False``: the fault tests inject between those statements (a default store's
    commit is one query that the server commits as it ends). ``timeout``: the engine's
    server-side deadline and the store's (``None``: no server-side deadline, the store's
    default). Elsewhere than PostgreSQL, a default store."""
    url = sa.make_url(url)
    if url.get_backend_name() != "postgresql":
        return ConversationStore(url)
    engine = create_engine(url, one_query=False, timeout=timeout)
    return ConversationStore(engine=engine, timeout=DEFAULT_TIMEOUT if timeout is None else timeout)


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


# -- raw rows (the history contract's tables) -------------------------------------------------

Row = dict[str, Any]


def user_row(conv: str, seq: int, *, prev_slots_left: int = 0) -> Row:
    return {
        "conversation_id": conv,
        "seq": seq,
        "role": "user",
        "content": "raw",
        "n_calls": 0,
        "slots_left": 0,
        "prev_seq": seq - 1 if seq else None,
        "prev_slots_left": prev_slots_left if seq else None,
        "tool_call_id": None,
        "assistant_seq": None,
        "call_position": None,
        "block_end_seq": None,
    }


def assistant_row(conv: str, seq: int, n_calls: int) -> Row:
    return {
        **user_row(conv, seq),
        "role": "assistant",
        "content": None,
        "n_calls": n_calls,
        "slots_left": n_calls,
        "block_end_seq": seq + n_calls if n_calls else None,
    }


def result_row(
    conv: str, seq: int, assistant_seq: int, position: int, n_calls: int, call_id: str
) -> Row:
    return {
        **user_row(conv, seq),
        "role": "tool",
        "content": "result",
        "slots_left": n_calls - 1 - position,
        "prev_slots_left": n_calls - position,
        "tool_call_id": call_id,
        "assistant_seq": assistant_seq,
        "call_position": position,
    }


def call_row(
    conv: str,
    assistant_seq: int,
    position: int,
    n_calls: int,
    call_id: str,
    state: str = "finished",
) -> Row:
    return {
        "conversation_id": conv,
        "assistant_seq": assistant_seq,
        "position": position,
        "assistant_n_calls": n_calls,
        "call_id": call_id,
        "type": "function",
        "name": "f",
        "arguments": "{}",
        "raw_arguments": None,
        "repaired": False,
        "state": state,
    }


def dump(store: ConversationStore) -> dict[str, list[Any]]:
    """conversations, messages and tool_calls, every row in key order."""
    with store.engine.connect() as conn:
        return {
            table: [
                tuple(row) for row in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY {key}"))
            ]
            for table, key in (
                ("fsm_conversations", "id"),
                ("fsm_messages", "conversation_id, seq"),
                ("fsm_tool_calls", "conversation_id, assistant_seq, position"),
            )
        }


def empty_database(engine_name: str, path: Path) -> Iterator[sa.URL]:
    """Yield the URL of an empty database (no tables at all): the SQLite file ``path``, or a new
    PostgreSQL schema (dropped afterwards). For fixtures: ``yield from empty_database(...)``."""
    if engine_name == "sqlite":
        yield sa.make_url(f"sqlite:///{path}")
        return
    url, drop = pg_schema_url(postgres_server())
    try:
        yield url
    finally:
        drop()
