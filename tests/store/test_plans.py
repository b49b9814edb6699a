"""The filtered audit queries use indexes: their query plans on a seeded store.

A store of 30,000 tool calls (and many attempts) is seeded once per engine with
``bench/seed.py`` (SQLite left un-analyzed, as fsm's stores are; PostgreSQL analyzed, as
autovacuum would): enough rows for the planners to prefer an index where one serves. Each query
of ``fsm.store.audit`` is run once with its statements recorded, then each recorded statement is
explained with the same parameters (SQLite ``EXPLAIN QUERY PLAN``, PostgreSQL ``EXPLAIN``). The
plan must read the big tables through the expected index and never scan one of them whole. This
is a plan test, not a timing test (``bench/audit.py`` times the same queries on a million
calls).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from fsm.store import audit as A
from tests.helpers.store import pg_schema_url, postgres_server

REPO = Path(__file__).resolve().parents[2]
CALLS = 30_000
ENGINES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
#: aliases the audit queries give the big tables (SQLite plans name the alias)
ALIASES = {
    "t",
    "m",
    "ac",
    "at",
    "fsm_messages",
    "fsm_tool_calls",
    "fsm_attempts",
    "fsm_attempt_calls",
}


def _seed_module() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_seed", REPO / "bench" / "seed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=ENGINES)
def seeded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    seed = _seed_module()
    if request.param == "sqlite":
        url = sa.make_url(f"sqlite:///{tmp_path_factory.mktemp('plans') / 'seeded.db'}")
        seed.seed(url, CALLS, attempt_rate=0.3)
        engine = A.open_readonly(url)
        yield engine
        engine.dispose()
        return
    url, drop = pg_schema_url(postgres_server())
    try:
        seed.seed(url, CALLS, attempt_rate=0.3)
        engine = A.open_readonly(url)
        yield engine
        engine.dispose()
    finally:
        drop()


def recorded(engine: sa.Engine, run: Callable[[], object]) -> list[tuple[str, Any]]:
    """The statements ``run`` executes, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return [(s, p) for s, p in seen if s.lstrip().upper().startswith(("SELECT", "WITH"))]


def plan(engine: sa.Engine, statement: str, parameters: Any) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
            return "\n".join(row[3] for row in rows)
        rows = conn.exec_driver_sql(f"EXPLAIN {statement}", parameters)
        return "\n".join(row[0] for row in rows)


def full_scans(engine: sa.Engine, text: str) -> list[str]:
    """Lines of a plan that read a big table whole."""
    if engine.dialect.name == "sqlite":
        return [
            line
            for line in text.splitlines()
            if (m := re.fullmatch(r"\s*SCAN (\w+)", line)) and m.group(1) in ALIASES
        ]
    return [
        line
        for line in text.splitlines()
        if re.search(r"Seq Scan on (messages|tool_calls|attempts|attempt_calls)\b", line)
    ]


def assert_plans(
    engine: sa.Engine, run: Callable[[], object], *indexes: str, sqlite: tuple[str, ...] = ()
) -> str:
    """Every query ``run`` makes scans no big table whole and uses ``indexes`` (and, on SQLite,
    whose planner has no statistics to weigh, also the ``sqlite`` ones). PostgreSQL may pick
    another index for the small attempt tables, by its statistics: the test only asks it to
    use one."""
    plans = [plan(engine, s, p) for s, p in recorded(engine, run)]
    assert plans, "no query recorded"
    text = "\n---\n".join(plans)
    assert not full_scans(engine, text), text
    wanted = [*indexes, *(sqlite if engine.dialect.name == "sqlite" else ())]
    for index in wanted:  # "a|b": either index
        names = index.split("|")
        if engine.dialect.name == "sqlite":
            names = [
                {"pk_fsm_tool_calls": "sqlite_autoindex_fsm_tool_calls_1"}.get(n, n) for n in names
            ]
        assert any(name in text for name in names), f"{index} not used:\n{text}"
    return text


def first_conversation(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT min(id) FROM fsm_conversations")).scalar())


NAME_INDEX = "ix_fsm_tool_calls_name_conversation_id_assistant_seq_position"
#: (label, filters, index of the history part, SQLite's index of the attempts part)
CALL_QUERIES: list[tuple[str, dict[str, Any], str, str]] = [
    ("tool", {"name": "get_weather"}, NAME_INDEX, "ix_fsm_attempt_calls_name"),
    # a handful of rows: PostgreSQL may as well sort them after the plain name index
    (
        "rare tool",
        {"name": "delete_account"},
        "ix_fsm_tool_calls_name",
        "ix_fsm_attempt_calls_name",
    ),
    (
        "model",
        {"model": "qwen3-max"},
        "ix_fsm_messages_model_conversation_id_seq",
        "ix_fsm_attempts_model",
    ),
    (
        "time range",
        {"since": "2026-11-20T12:00:00", "until": "2026-11-20T13:00:00"},
        "ix_fsm_messages_created_at",
        "ix_fsm_attempts_created_at",
    ),
    # the name index, whole or not: the arguments are checked on the calls it leads to
    (
        "tool and arguments",
        {"name": "get_weather", "args": [("city", "Paris")]},
        "ix_fsm_tool_calls_name",
        "",
    ),
    ("no filter: key order", {}, "pk_fsm_tool_calls", "ix_fsm_attempts_conversation_id_at_seq_id"),
]


@pytest.mark.parametrize(
    ("label", "filters", "index", "attempts_index"), CALL_QUERIES, ids=[q[0] for q in CALL_QUERIES]
)
def test_tool_calls_first_page_uses_indexes(
    seeded: sa.Engine, label: str, filters: dict[str, Any], index: str, attempts_index: str
) -> None:
    rows: list[Any] = []
    sqlite = (attempts_index,) if attempts_index else ()
    text = assert_plans(
        seeded, lambda: rows.extend(A.tool_calls(seeded, limit=50, **filters)), index, sqlite=sqlite
    )
    assert rows, label
    if "key order" in label and seeded.dialect.name == "sqlite":  # no sort of the table
        history = text.split("MATERIALIZE hk")[1].split("SCAN hk")[0]
        assert "TEMP B-TREE" not in history, text


def test_state_of_attempts_uses_indexes(seeded: sa.Engine) -> None:
    rows = []
    assert_plans(
        seeded,
        lambda: rows.extend(A.tool_calls(seeded, state="truncated", limit=50)),
        sqlite=("ix_fsm_attempt_calls_state",),
    )
    assert rows and {r.state for r in rows} == {"truncated"}


def test_arguments_alone_read_history_in_key_order(seeded: sa.Engine) -> None:
    """A JSON path cannot be indexed: without another filter, history is read in key order
    (the primary key) until the page is full. (PostgreSQL, which guesses such a filter rare,
    reads the table whole when the page is a large share of what it expects to match; the page
    here is small. The calls of attempts are small tables read whole by an argument filter
    alone.)"""
    rows: list[Any] = []

    def run() -> None:
        rows.extend(A.tool_calls(seeded, args=[("units", "metric")], source="history", limit=5))

    text = assert_plans(seeded, run, "pk_fsm_tool_calls")
    assert len(rows) == 5
    if seeded.dialect.name == "sqlite":
        assert "TEMP B-TREE" not in text.split("MATERIALIZE hk")[1].split("SCAN hk")[0], text


def test_tool_calls_of_one_conversation_use_its_key(seeded: sa.Engine) -> None:
    conversation = first_conversation(seeded)
    rows = list(A.tool_calls(seeded, conversation=conversation))
    assert rows
    # the primary key, or the unique key that starts with it
    keys = "pk_fsm_tool_calls|uq_fsm_tool_calls_call"
    assert_plans(seeded, lambda: list(A.tool_calls(seeded, conversation=conversation)), keys)


def test_the_next_page_seeks_past_the_cursor(seeded: sa.Engine) -> None:
    [last] = list(A.tool_calls(seeded, name="get_weather", limit=1, offset=200, source="history"))
    text = assert_plans(
        seeded,
        lambda: list(A.tool_calls(seeded, name="get_weather", limit=50, after=last.key)),
        "ix_fsm_tool_calls_name_conversation_id_assistant_seq_position",
    )
    if seeded.dialect.name == "sqlite":
        assert "(name=? AND (conversation_id,assistant_seq,position)>(?,?,?))" in text, text


@pytest.mark.parametrize(
    ("filters", "index"),
    [
        ({"model": "llama-3.3-70b-versatile"}, "ix_fsm_attempts_model"),
        ({"reason": "content_filter"}, "ix_fsm_attempt_calls_reason"),
        ({"name": "send_email"}, "ix_fsm_attempt_calls_name"),
        ({"since": "2026-11-20", "until": "2026-11-21"}, "ix_fsm_attempts_created_at"),
    ],
)
def test_failures_first_page_uses_indexes(
    seeded: sa.Engine, filters: dict[str, Any], index: str
) -> None:
    rows: list[Any] = []
    assert_plans(
        seeded, lambda: rows.extend(A.failures(seeded, limit=50, **filters)), sqlite=(index,)
    )
    assert rows
