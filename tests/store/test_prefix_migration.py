"""Migration 0009 (issue 29, item 3): fsm's tables, indexes, constraints and sequences take the
``fsm_`` prefix. A store of fsm 0.3.0 (revision 0008) with data upgrades with every row kept
and ``fsm audit check`` clean, on both engines (PostgreSQL hash-partitioned too, with
``$FSM_TEST_PG_PARTITIONS``); the downgrade gives the 0.3.0 names back."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import ConversationStore
from fsm.store.migrate import alembic_config, current_revision, downgrade, upgrade
from fsm.store.models import TABLES
from tests.helpers.store import make_turn, pg_partitions

REPO = Path(__file__).resolve().parents[2]
OLD = "0008_ledger_leases"
#: the order of each table's rows
KEYS = {
    "conversations": "id",
    "messages": "conversation_id, seq",
    "tool_calls": "conversation_id, assistant_seq, position",
    "attempts": "conversation_id, id",
    "attempt_calls": "conversation_id, attempt_id, position",
    "pending_turns": "conversation_id, id",
    "tool_executions": "conversation_id, pending_id, position",
}


def _revision() -> ModuleType:
    path = REPO / "migrations" / "versions" / "0009_fsm_prefix.py"
    spec = importlib.util.spec_from_file_location("fsm_revision_0009", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine(url: sa.URL) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def _rows(url: sa.URL, prefix: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return {
                table: [
                    tuple(row)
                    for row in conn.execute(
                        sa.text(f"SELECT * FROM {prefix}{table} ORDER BY {key}")
                    )
                ]
                for table, key in KEYS.items()
            }
    finally:
        engine.dispose()


def _names(url: sa.URL) -> set[str]:
    """Every table, index, sequence and constraint name of the database (its schema)."""
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                names = set(
                    conn.exec_driver_sql(
                        "SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
                    ).scalars()
                )
                for sql in conn.exec_driver_sql(
                    "SELECT sql FROM sqlite_master WHERE type = 'table'"
                ).scalars():
                    names |= set(re.findall(r"CONSTRAINT (\w+)", sql))
                return names
            return set(
                conn.exec_driver_sql(
                    "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
                    " UNION SELECT k.conname FROM pg_constraint k JOIN pg_class c"
                    " ON c.oid = k.conrelid WHERE c.relnamespace = current_schema()::regnamespace"
                ).scalars()
            )
    finally:
        engine.dispose()


def _fill(url: sa.URL) -> None:
    """A store's worth of everything: turns with calls and results, plain messages, an attempt
    with its calls, a committed and a pending turn of the ledger."""
    with ConversationStore(url) as store:
        for n in range(3):
            cid = store.create_conversation(f"c{n}", metadata={"n": n})
            store.append(cid, [{"role": "user", "content": f"question {n}"}])
            turn = make_turn(
                [("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "f", "{}")]
            )
            store.commit_turn(cid, turn, {"call_a": "sunny", "call_b": "ok"})
            store.record_attempt(cid, make_turn([("x", "f", '{"a"')], finish_reason="length"))
        pending = store.begin("c0", make_turn([("p", "f", "{}")]))
        store.started(pending, 0)
        store.create_conversation("c3")
        store.append("c3", [{"role": "user", "content": "go"}])
        done = store.begin("c3", make_turn([("q", "g", "{}")]))
        done = store.started(done, 0)
        done = store.succeeded(done, 0, "fine")
        store.commit(done)


def test_names_map_both_ways() -> None:
    revision = _revision()
    assert revision.forward("messages") == "fsm_messages"
    assert revision.forward("ix_messages_stats") == "ix_fsm_messages_stats"
    assert (
        revision.forward("fk_pending_turns_conversation_id_conversations")
        == "fk_fsm_pending_turns_conversation_id_fsm_conversations"
    )
    assert revision.forward("ix_attempt_calls_attempt_id_position") == (
        "ix_fsm_attempt_calls_attempt_id_position"
    )
    assert revision.forward("attempts_id_seq") == "fsm_attempts_id_seq"
    assert revision.forward("tool_calls_p3") == "fsm_tool_calls_p3"
    # a host's names are not fsm's
    for name in ("orders", "messages_archive_idx", "ix_orders_messages", "message", "fsm_x"):
        assert revision.forward(name) == name or name.startswith("messages_")
    assert revision.forward("orders") == "orders"
    assert revision.forward("ix_orders_messages") == "ix_orders_messages"
    for name in ("messages", "ck_tool_calls_tool_call_state", "pk_attempt_calls", "orders"):
        assert revision.backward(revision.forward(name)) == name
    assert (
        len(revision.forward("uq_tool_calls_conversation_id_assistant_seq_position_call_id")) < 63
    )


def test_a_0_3_0_store_with_data_upgrades_and_checks_clean(empty_url: sa.URL) -> None:
    upgrade(
        empty_url, partitions=pg_partitions() if empty_url.get_backend_name() != "sqlite" else None
    )
    _fill(empty_url)
    at_head = _rows(empty_url, "fsm_")
    assert all(at_head[t] for t in KEYS), {t: len(r) for t, r in at_head.items()}
    # the store as fsm 0.3.0 left it: revision 0008, its names
    downgrade(empty_url, OLD)
    assert current_revision(empty_url) == OLD
    old_names = _names(empty_url)
    assert {"messages", "conversations", "pk_messages", "ix_messages_stats"} <= old_names
    assert not {n for n in old_names if "fsm_" in n and "alembic" not in n}, old_names
    assert _rows(empty_url, "") == at_head

    upgrade(empty_url)
    assert _rows(empty_url, "fsm_") == at_head
    new_names = _names(empty_url)
    assert set(TABLES) <= new_names and not {"messages", "conversations"} & new_names
    ours = {n for n in new_names if "alembic" not in n}
    unprefixed = {n for n in ours if not re.match(r"^((pk|uq|ck|fk|ix)_)?fsm_", n)}
    assert not unprefixed, unprefixed
    command.check(alembic_config(empty_url))  # the models' schema, no drift
    url = empty_url.render_as_string(hide_password=False)
    checked = CliRunner().invoke(cli, ["audit", "check", "--db", url])
    assert checked.exit_code == 0, checked.output
    with ConversationStore(empty_url) as store:
        assert store.history("c1")[0] == {"role": "user", "content": "question 1"}
        store.append("c1", [{"role": "user", "content": "after the upgrade"}])
        assert len(store.attempts("c2")) == 1
        new = store.create_conversation()
        store.append(new, [{"role": "user", "content": "new"}])  # identity sequences renamed


def test_the_upgrade_keeps_rows_only_sqlite_could_hold(empty_url: sa.URL) -> None:
    """SQLite copies each table: a row written with the checks off (which ``fsm audit check``
    reports) is kept as it is, not refused by the copy."""
    if empty_url.get_backend_name() != "sqlite":
        pytest.skip("SQLite's table copy")
    upgrade(empty_url, OLD)
    engine = _engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("PRAGMA ignore_check_constraints = ON")
            conn.exec_driver_sql("INSERT INTO conversations (id) VALUES ('bad')")
            conn.exec_driver_sql(
                "INSERT INTO messages (conversation_id, seq, role, content, n_calls, slots_left)"
                " VALUES ('bad', 0, 'user', NULL, 0, 0)"
            )
    finally:
        engine.dispose()
    upgrade(empty_url)
    engine = _engine(empty_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM fsm_messages").scalar_one() == 1
    finally:
        engine.dispose()
    url = empty_url.render_as_string(hide_password=False)
    checked = CliRunner().invoke(cli, ["audit", "check", "--db", url])
    assert checked.exit_code == 1 and "missing_content" in checked.output, checked.output
