"""``fsm audit calls`` shows each call's execution in the tool ledger (issue 14): its state,
duration and number of starts for a turn run through the ledger, nothing for a turn committed
with ``commit_turn``; through the Python function and the CLI, on both engines."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import timedelta
from typing import Any

import click.testing
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import ConversationStore
from fsm.store import audit as A
from fsm.store.codec import as_utc
from fsm.store.models import ToolExecution
from tests.helpers.store import make_turn

LEDGER_CALLS = (
    ("call_a", "pay", '{"invoice": 1}'),
    ("call_b", "email", '{"to": "x@y"}'),
)
EXECUTION_COLUMNS = ["execution", "duration_ms", "starts"]


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args))


def _seed(store: ConversationStore) -> None:
    """c1: a turn through the ledger, call_b started twice (a claim after a crash) and failed;
    c2: the same kind of turn committed with ``commit_turn``."""
    store.create_conversation("c1")
    store.append("c1", [{"role": "user", "content": "pay and tell"}])
    first = store.begin("c1", make_turn(LEDGER_CALLS))
    first = store.started(first, 0)
    first = store.succeeded(first, 0, "paid")
    first = store.started(first, 1)
    store.release(first)  # the owner crashed, as its lease's end would show
    seen = store.pending("c1")
    assert seen is not None
    resumed = store.claim(seen)
    resumed = store.started(resumed, 1)
    resumed = store.failed(resumed, 1, "SMTP down")
    assert store.commit(resumed).created
    store.create_conversation("c2")
    store.append("c2", [{"role": "user", "content": "weather"}])
    store.commit_turn("c2", make_turn(response_id="chatcmpl-2"), ["sunny"])


def _expected_durations(url: sa.URL) -> dict[int, float]:
    """finished_at - started_at of c1's executions, in ms, as the database holds them."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    ToolExecution.position, ToolExecution.started_at, ToolExecution.finished_at
                ).where(ToolExecution.conversation_id == "c1")
            ).all()
    finally:
        engine.dispose()
    durations = {}
    for position, started, finished in rows:
        start, end = as_utc(started), as_utc(finished)
        assert start is not None and end is not None and end >= start
        durations[position] = (end - start) / timedelta(milliseconds=1)
    return durations


def _executions(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (r["conversation_id"], r["position"], r["call_id"], r["execution"], r["starts"])
        for r in rows
    ]


EXPECTED = [
    ("c1", 0, "call_a", "succeeded", 1),
    ("c1", 1, "call_b", "failed", 2),
    ("c2", 0, "call_1", None, None),
]


def test_tool_calls_show_the_ledger_execution(store: ConversationStore, db_url: sa.URL) -> None:
    _seed(store)
    engine = A.open_readonly(db_url)
    try:
        rows = list(A.tool_calls(engine))
        assert _executions([r.as_dict() for r in rows]) == EXPECTED
        durations = _expected_durations(db_url)
        assert [r.duration_ms for r in rows] == [durations[0], durations[1], None]
        assert all(isinstance(r.duration_ms, float) for r in rows[:2])
        # the columns come after the existing ones, in this order
        assert list(rows[0].as_dict())[-3:] == EXECUTION_COLUMNS
        # filters and pages still work with the joined executions
        assert [r.call_id for r in A.tool_calls(engine, name="email")] == ["call_b"]
        [first] = A.tool_calls(engine, limit=1)
        after = [r.call_id for r in A.tool_calls(engine, after=first.key)]
        assert after == ["call_b", "call_1"]
        assert [r.execution for r in A.tool_calls(engine, conversation="c2")] == [None]
        assert list(A.tool_calls(engine, source="attempts")) == []
    finally:
        engine.dispose()


def test_the_cli_shows_the_execution_in_every_format(
    store: ConversationStore, db_url: sa.URL
) -> None:
    _seed(store)
    url = db_url.render_as_string(hide_password=False)
    as_json = run("audit", "calls", "--db", url, "--json")
    assert as_json.exit_code == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert _executions(rows) == EXPECTED
    durations = _expected_durations(db_url)
    assert [r["duration_ms"] for r in rows] == [durations[0], durations[1], None]

    lines = run("audit", "calls", "--db", url, "--nl").stdout.splitlines()
    assert _executions([json.loads(line) for line in lines]) == EXPECTED

    table = run("audit", "calls", "--db", url)
    assert table.exit_code == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert header[-3:] == EXECUTION_COLUMNS

    for flag, delimiter in (("--csv", ","), ("--tsv", "\t")):
        out = run("audit", "calls", "--db", url, flag)
        assert out.exit_code == 0, out.stderr
        read = list(csv.DictReader(io.StringIO(out.stdout), delimiter=delimiter))
        assert [(r["execution"], r["starts"]) for r in read] == [
            ("succeeded", "1"),
            ("failed", "2"),
            ("", ""),
        ]

    picked = run("audit", "calls", "--db", url, "--json", "--columns", "call_id,execution,starts")
    assert picked.exit_code == 0, picked.stderr
    assert json.loads(picked.stdout) == [
        {"call_id": "call_a", "execution": "succeeded", "starts": 1},
        {"call_id": "call_b", "execution": "failed", "starts": 2},
        {"call_id": "call_1", "execution": None, "starts": None},
    ]


def test_the_execution_join_reads_the_ledger_through_its_keys(
    store: ConversationStore, db_url: sa.URL
) -> None:
    """SQLite's plan of the listing looks the pending turn and its execution up by key (a
    SEARCH), never scanning either table (PostgreSQL's plans are weighed by row counts, and
    the seeded plan tests cover the big tables)."""
    _seed(store)
    if db_url.get_backend_name() != "sqlite":
        pytest.skip("a SQLite plan: PostgreSQL's depend on its statistics")
    engine = A.open_readonly(db_url)
    seen: list[tuple[str, Any]] = []

    def record(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        assert len(list(A.tool_calls(engine))) == 3
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
        plans = []
        with engine.connect() as conn:
            for statement, parameters in seen:
                if "pending_turns" in statement:
                    plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
                    plans.append("\n".join(str(row[-1]) for row in plan))
        engine.dispose()
    assert plans
    for text in plans:
        index = (
            r"SEARCH pt USING (COVERING )?INDEX ix_fsm_pending_turns_conversation_id_committed_seq"
        )
        assert re.search(index, text), text
        assert "SEARCH te" in text, text
        assert "SCAN pt" not in text and "SCAN te" not in text, text
