"""The token columns of ``messages`` (migration 0006): written with each committed turn from its
usage, backfilled by the migration for the rows written before it (the same values), and read by
``stats()`` through ``ix_fsm_messages_stats`` alone."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from fsm.api import parse_file
from fsm.store import ConversationStore
from fsm.store import audit as A
from fsm.store.migrate import current_revision, downgrade, head_revision, upgrade
from fsm.store.models import STATS_INDEX, TOKEN_MAX
from fsm.store.plans import usage_columns
from tests.helpers import CORPUS, corpus_files, require_corpus

COLUMNS = ("prompt_tokens", "completion_tokens", "total_tokens", "usage_unreadable")
NONE = dict.fromkeys(COLUMNS)


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, NONE),
        (
            {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            {**NONE, "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        ),
        (
            {"prompt_tokens": 0, "total_tokens": TOKEN_MAX},
            {**NONE, "prompt_tokens": 0, "total_tokens": TOKEN_MAX},
        ),
        ({"prompt_tokens": 0}, {**NONE, "prompt_tokens": 0}),
        # not counted: a string, a fraction, a bool, negative, beyond the bound, a nested value
        ({"prompt_tokens": "12", "completion_tokens": 3}, {**NONE, "completion_tokens": 3}),
        ({"prompt_tokens": 2.0, "total_tokens": True}, NONE),
        ({"prompt_tokens": -1, "total_tokens": TOKEN_MAX + 1}, NONE),
        ({"prompt_tokens": 10**30, "completion_tokens": {"n": 1}}, NONE),
        ({}, NONE),
        # not a JSON object: unreadable
        ([1, 2], {**NONE, "usage_unreadable": 1}),
        ("x", {**NONE, "usage_unreadable": 1}),
        (5, {**NONE, "usage_unreadable": 1}),
    ],
)
def test_usage_columns(usage: Any, expected: dict[str, int | None]) -> None:
    assert usage_columns(usage) == expected


def _corpus_turns() -> list[tuple[str, Any]]:
    """The complete first turns of the recorded streams that carry a usage."""
    require_corpus()
    found = []
    for name in corpus_files():
        result = parse_file(CORPUS / name)
        if result.complete and result.turns and result.turn(0).usage is not None:
            found.append((name, result.turn(0)))
    assert len(found) >= 10, "the corpus has streams with usage"
    return found


def _stats(url: sa.URL) -> A.Stats:
    engine = A.open_readonly(url)
    try:
        return A.stats(engine)
    finally:
        engine.dispose()


def _columns(url: sa.URL) -> dict[tuple[str, int], tuple[Any, ...]]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f"SELECT conversation_id, seq, {', '.join(COLUMNS)} FROM fsm_messages"
                    " WHERE role = 'assistant' ORDER BY conversation_id, seq"
                )
            ).all()
    finally:
        engine.dispose()
    return {(row[0], row[1]): tuple(row[2:]) for row in rows}


def test_commit_writes_the_columns_and_the_backfill_computes_the_same(
    empty_url: sa.URL,
) -> None:
    """Real recordings: each turn's columns are its usage's counts; rows written before the
    migration (the columns dropped by a downgrade) get the same columns from its backfill."""
    turns = _corpus_turns()
    upgrade(empty_url)
    with ConversationStore(empty_url) as store:
        for number, (_name, turn) in enumerate(turns):
            conversation = store.create_conversation(f"c{number:03}")
            store.append(conversation, [{"role": "user", "content": "go"}])
            store.commit_turn(conversation, turn, [f"result {i}" for i in turn.tool_calls])
    written = _columns(empty_url)
    expected = {
        (f"c{number:03}", 1): tuple(usage_columns(turn.usage)[c] for c in COLUMNS)
        for number, (_name, turn) in enumerate(turns)
    }
    assert written == expected
    assert any(v[0] for v in written.values()) and any(v[1] for v in written.values())
    totals = _stats(empty_url).totals
    assert totals is not None
    assert totals.prompt_tokens == sum(v[0] or 0 for v in written.values())
    assert totals.completion_tokens == sum(v[1] or 0 for v in written.values())

    downgrade(empty_url, "0005_tool_ledger")
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    try:
        # before 0009_fsm_prefix the table had its unprefixed name
        columns = {c["name"] for c in sa.inspect(engine).get_columns("messages")}
    finally:
        engine.dispose()
    assert not columns & set(COLUMNS)
    upgrade(empty_url)  # the backfill (0006), then the later revisions
    assert current_revision(empty_url) == head_revision()
    assert _columns(empty_url) == written
    assert _stats(empty_url).totals == totals


@pytest.mark.serial  # VACUUM marks the pages all-visible only when no other snapshot is older
def test_stats_reads_the_index_alone(db_url: sa.URL, engine_name: str) -> None:
    """Unfiltered, the turns query of stats() is a scan of ix_fsm_messages_stats: on SQLite with no
    sort (the index is in group order); on PostgreSQL an index-only scan."""
    from fsm.store.audit.read import MESSAGES
    from fsm.store.audit.summary import _turns_query

    with ConversationStore(db_url) as store:
        store.create_conversation("c")
        store.append("c", [{"role": "user", "content": "go"}])
        store.append("c", [{"role": "assistant", "content": "ok"}])
    m = MESSAGES.alias("m")
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    if engine_name == "postgresql":  # an index-only scan needs the visibility map
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM fsm_messages")
    with engine.begin() as conn:
        query = _turns_query(conn, m, [m.c.role == "assistant"])
        sql = str(query.compile(conn, compile_kwargs={"literal_binds": True}))
        if engine_name == "sqlite":
            plan = " | ".join(
                str(row[-1]) for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}")
            )
            assert f"USING INDEX {STATS_INDEX}" in plan, plan
            assert "TEMP B-TREE" not in plan, plan
        else:
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")
            plan = " | ".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {sql}"))
            assert f"Index Only Scan using {STATS_INDEX}" in plan, plan
    engine.dispose()
