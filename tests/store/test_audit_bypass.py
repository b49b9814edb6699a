"""``fsm audit`` on databases edited with the store's enforcement switched off (issue 10).

A database refuses every write that breaks the history contract, on every connection that
keeps its defaults. Some switches turn that off for a session (SQLite ``PRAGMA
foreign_keys=OFF`` / ``PRAGMA ignore_check_constraints=ON``, PostgreSQL ``SET
session_replication_role = replica``, ``DISABLE TRIGGER ALL``, a constraint added back ``NOT
VALID``), and the rows written that way are never checked again. These tests commit such rows
with raw SQL (``tests/store/corrupt.py`` and the builders below) and show that:

* ``check()`` reports each with the right kind, never raises, never calls the store clean, and
  ``fsm audit check`` exits 1 with one line per violation (never 70);
* a wrong-typed value (text, real, blob) in every integer column of SQLite is an
  ``invalid_type`` violation, and the later stages of the check read past it;
* the audit reads (``calls --arg``, ``--args-contains``, ``stats``) survive any committed value:
  arguments ``jsonb`` cannot hold, usage that is not a usable token count;
* values the codec stored marked (U+0000, lone surrogates) are shown decoded in every output.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click.testing
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm import parse
from fsm.cli.main import cli
from fsm.store import ConversationStore
from fsm.store import audit as A
from fsm.store.audit import calls as audit_calls
from fsm.store.audit import integrity
from fsm.store.engine import create_engine
from fsm.store.migrate import downgrade, upgrade
from fsm.store.models import TOKEN_COLUMNS, Base
from fsm.store.plans import usage_columns
from tests.helpers import chunk, sse, tc
from tests.helpers.store import make_turn
from tests.store.corrupt import CORRUPTIONS, Corruption, seed

# -- fixtures and helpers --------------------------------------------------------------------
#: run a test on one engine only (the other has no such switch, or refuses the value outright)
SQLITE = pytest.mark.parametrize("engine_name", ["sqlite"], indirect=True)
POSTGRES = pytest.mark.parametrize(
    "engine_name", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)


@pytest.fixture
def own_url(engine_name: str, request: pytest.FixtureRequest) -> sa.URL:
    """A database at head with no data that a test may break for good (SQLite: the test's
    copy; PostgreSQL: a schema of its own, dropped afterwards)."""
    if engine_name == "sqlite":
        url: sa.URL = request.getfixturevalue("db_url")
        return url
    empty: sa.URL = request.getfixturevalue("empty_url")
    upgrade(empty)
    return empty


def text(url: sa.URL) -> str:
    return url.render_as_string(hide_password=False)


def violations(url: sa.URL, **kwargs: Any) -> list[A.Violation]:
    engine = A.open_readonly(url)
    try:
        return list(A.check(engine, **kwargs))
    finally:
        engine.dispose()


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args))


def assert_cli_reports(url: sa.URL, kinds: set[str]) -> list[dict[str, Any]]:
    """``fsm audit check`` exits 1, prints a table whose first line is the header, and as JSON
    lines one violation per line, some of a kind in ``kinds``."""
    table = run("audit", "check", "--db", text(url))
    assert table.exit_code == 1, (table.exit_code, table.stdout, table.stderr)
    assert table.stdout.splitlines()[0].split() == ["conversation_id", "seq", "kind", "detail"]
    assert "violation(s)" in table.stderr.splitlines()[-1]
    assert "Traceback" not in table.stdout + table.stderr
    lines = run("audit", "check", "--db", text(url), "--nl")
    assert lines.exit_code == 1
    rows = [json.loads(line) for line in lines.stdout.splitlines()]
    assert rows and all(r["kind"] in A.VIOLATION_KINDS and r["detail"] for r in rows)
    assert {r["kind"] for r in rows} & kinds, rows
    return rows


@contextmanager
def sqlite_raw(
    url: sa.URL, *, foreign_keys: bool = True, ignore_checks: bool = False
) -> Iterator[sa.Connection]:
    """A SQLite connection with enforcement switched off as asked, in a transaction that
    commits."""
    engine = create_engine(url, foreign_keys=foreign_keys)
    try:
        with engine.connect() as conn:
            if ignore_checks:
                conn.exec_driver_sql("PRAGMA ignore_check_constraints=ON")
            if conn.in_transaction():
                conn.commit()
            with conn.begin():
                yield conn
    finally:
        engine.dispose()


@contextmanager
def rolled_back(url: sa.URL) -> Iterator[sa.Connection]:
    """A connection with every foreign key and check off (SQLite: both pragmas; PostgreSQL:
    the replica role and every check dropped, which check() reports as ``unenforced``), in a
    transaction that is rolled back."""
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, foreign_keys=False)
    else:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if url.get_backend_name() == "sqlite":
                conn.exec_driver_sql("PRAGMA ignore_check_constraints=ON")
                if conn.in_transaction():
                    conn.commit()
            transaction = conn.begin()
            try:
                if url.get_backend_name() == "postgresql":
                    conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
                    checks = conn.execute(
                        sa.text(
                            "SELECT conrelid::regclass::text, conname FROM pg_constraint "
                            "WHERE contype = 'c' AND conrelid = ANY(CAST(:t AS regclass[]))"
                        ),
                        {"t": list(TABLES)},
                    ).all()
                    for table, name in checks:
                        conn.exec_driver_sql(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
                yield conn
            finally:
                transaction.rollback()
    finally:
        engine.dispose()


TABLES = (
    "fsm_conversations",
    "fsm_messages",
    "fsm_tool_calls",
    "fsm_attempts",
    "fsm_attempt_calls",
)


def fill(url: sa.URL) -> None:
    """The conversation of tests/store/corrupt.py, plus a failed attempt with one call."""
    seed(url)
    with ConversationStore(url) as store:
        cut = parse(sse(chunk(tc(0, "w", "get_weather", '{"ci')), chunk(finish="length")))
        store.record_attempt("corrupt", cut)


# -- every bypass switch -----------------------------------------------------------------------
def _corruption_params() -> list[Any]:
    params = []
    for name, corruption in CORRUPTIONS.items():
        marks = [pytest.mark.postgres] if corruption.engine == "postgresql" else []
        params.append(pytest.param(corruption.engine, name, id=name, marks=marks))
    return params


@pytest.mark.parametrize(("engine_name", "name"), _corruption_params(), indirect=["engine_name"])
def test_every_bypass_is_reported_with_its_kind(own_url: sa.URL, name: str) -> None:
    corruption: Corruption = CORRUPTIONS[name]
    assert violations(own_url) == []
    conversation = corruption.build(own_url)
    found = violations(own_url)
    assert {v.kind for v in found} & corruption.kinds, (corruption.rule, found)
    assert conversation in {v.conversation_id for v in found}
    assert all(v.kind in A.VIOLATION_KINDS and v.detail for v in found)
    # the same, one batch per conversation and with two workers
    assert violations(own_url, batch_size=1, workers=2) == found
    assert_cli_reports(own_url, set(corruption.kinds))


@SQLITE
def test_sqlite_foreign_keys_off_orphan_rows(own_url: sa.URL) -> None:
    fill(own_url)
    with sqlite_raw(own_url, foreign_keys=False) as conn:
        conn.exec_driver_sql("DELETE FROM fsm_conversations")  # no cascade with the keys off
    found = {(v.kind, v.conversation_id) for v in violations(own_url)}
    assert ("orphan_row", "corrupt") in found
    assert_cli_reports(own_url, {"orphan_row"})


@POSTGRES
def test_postgres_replica_role_skips_cascades(own_url: sa.URL) -> None:
    fill(own_url)
    engine = sa.create_engine(own_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            conn.exec_driver_sql("DELETE FROM fsm_conversations")  # ON DELETE CASCADE is a trigger
    finally:
        engine.dispose()
    found = {(v.kind, v.conversation_id) for v in violations(own_url)}
    assert ("orphan_row", "corrupt") in found and ("orphan_row", None) not in found
    assert_cli_reports(own_url, {"orphan_row"})


@POSTGRES  # SQLite cannot drop a primary key without rebuilding its table
def test_postgres_dropped_keys_let_duplicates_in(own_url: sa.URL) -> None:
    fill(own_url)
    engine = sa.create_engine(own_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            for table, key in (
                ("fsm_attempt_calls", "pk_fsm_attempt_calls"),
                ("fsm_tool_calls", "pk_fsm_tool_calls"),
                (
                    "fsm_tool_calls",
                    "uq_fsm_tool_calls_call",
                ),
            ):
                conn.exec_driver_sql(f"ALTER TABLE {table} DROP CONSTRAINT {key} CASCADE")
            conn.exec_driver_sql("INSERT INTO fsm_attempt_calls SELECT * FROM fsm_attempt_calls")
            conn.exec_driver_sql(
                "INSERT INTO fsm_tool_calls SELECT * FROM fsm_tool_calls WHERE position = 0"
            )
    finally:
        engine.dispose()
    found = [v for v in violations(own_url) if v.kind == "duplicate_key"]
    assert {v.detail.split(" rows share")[0] for v in found} == {
        "2 fsm_attempt_calls",
        "2 fsm_tool_calls",
    }, found
    assert_cli_reports(own_url, {"duplicate_key"})


def test_a_schema_that_no_longer_enforces_is_reported(own_url: sa.URL, engine_name: str) -> None:
    """Clean rows, but the database lost part of its enforcement: later writes would not be
    refused, and the check says so (kind unenforced), naming what is missing."""
    fill(own_url)
    if engine_name == "sqlite":
        statements = ["DROP INDEX ix_fsm_messages_conversation_id_idempotency_key"]
        expected = {"ix_fsm_messages_conversation_id_idempotency_key"}
    else:
        statements = [
            "ALTER TABLE fsm_tool_calls DISABLE TRIGGER ALL",
            "ALTER TABLE fsm_tool_calls DROP CONSTRAINT ck_fsm_tool_calls_name",
            "ALTER TABLE fsm_tool_calls DROP CONSTRAINT ck_fsm_tool_calls_arguments",
            "ALTER TABLE fsm_tool_calls ADD CONSTRAINT ck_fsm_tool_calls_arguments CHECK "
            "(btrim(arguments, E' \\t\\r\\n') = '' OR fsm_json_valid(arguments)) NOT VALID",
        ]
        expected = {"ck_fsm_tool_calls_name", "ck_fsm_tool_calls_arguments", "ENABLE TRIGGER ALL"}
    engine = create_engine(own_url, foreign_keys=False)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()
    found = violations(own_url)
    assert {v.kind for v in found} == {"unenforced"}, found
    for word in expected:
        assert any(word in v.detail for v in found), (word, found)
    assert_cli_reports(own_url, {"unenforced"})


# -- wrong types in every integer column ---------------------------------------------------------
#: where each table's row sits in the conversation of ``fill``.
ROW = {
    "fsm_conversations": "id = 'corrupt'",
    "fsm_messages": "conversation_id = 'corrupt' AND seq = 1",
    "fsm_tool_calls": "conversation_id = 'corrupt' AND assistant_seq = 1 AND position = 0",
    "fsm_attempts": "conversation_id = 'corrupt'",
    "fsm_attempt_calls": "position = 0",
}
HOSTILE = {"text": "'5x'", "real": "0.5", "huge": "1e300", "blob": "X'00'"}


def _integer_columns() -> list[tuple[str, str]]:
    out = []
    for table in TABLES:
        for column in Base.metadata.tables[table].columns:
            if not isinstance(column.type, sa.Integer | sa.Boolean):
                continue
            if table == "fsm_attempts" and column.name == "id":
                continue  # INTEGER PRIMARY KEY: SQLite itself refuses anything but an integer
            out.append((table, column.name))
    return out


INTEGER_COLUMNS = _integer_columns()


@pytest.mark.parametrize("value", HOSTILE, ids=list(HOSTILE))
@pytest.mark.parametrize(
    ("table", "column"), INTEGER_COLUMNS, ids=[f"{t}.{c}" for t, c in INTEGER_COLUMNS]
)
@SQLITE
def test_sqlite_a_wrong_type_in_every_integer_column_is_reported(
    own_url: sa.URL, table: str, column: str, value: str
) -> None:
    fill(own_url)
    with rolled_back(own_url) as conn:
        rowid = conn.exec_driver_sql(f"SELECT rowid FROM {table} WHERE {ROW[table]}").scalar()
        conn.exec_driver_sql(
            f"UPDATE {table} SET {column} = {HOSTILE[value]} WHERE rowid = {rowid}"
        )
        stored = conn.exec_driver_sql(f"SELECT typeof({column}) FROM {table} WHERE rowid = {rowid}")
        assert stored.scalar() in ("text", "real", "blob")
        found = list(A.check(conn, batch_size=1))  # every stage runs on the broken row
    typed = [v for v in found if v.kind == "invalid_type"]
    assert any(f"{column} is " in v.detail for v in typed), found
    assert all(v.kind in A.VIOLATION_KINDS for v in found)
    assert all(v.seq is None or type(v.seq) is int for v in found)
    assert all(v.conversation_id is None or isinstance(v.conversation_id, str) for v in found)


@pytest.mark.parametrize(
    ("table", "column"), INTEGER_COLUMNS, ids=[f"{t}.{c}" for t, c in INTEGER_COLUMNS]
)
@POSTGRES
def test_postgres_integer_columns_refuse_wrong_types_and_extremes_do_not_overflow(
    own_url: sa.URL, table: str, column: str
) -> None:
    fill(own_url)
    boolean = isinstance(Base.metadata.tables[table].columns[column].type, sa.Boolean)
    for value in HOSTILE.values():
        # the column's type refuses the value, or casts it (0.5 is rounded): never stored as is
        with rolled_back(own_url) as conn:
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql(
                        f"UPDATE {table} SET {column} = {value} WHERE {ROW[table]}"
                    )
            except sa.exc.DBAPIError:
                continue
            stored = conn.exec_driver_sql(f"SELECT {column} FROM {table}").scalars().all()
            assert all(type(v) in (int, bool) for v in stored if v is not None), stored
    if boolean:
        return
    for extreme in (2**31 - 1, -(2**31)):
        with rolled_back(own_url) as conn:
            conn.exec_driver_sql(f"UPDATE {table} SET {column} = {extreme} WHERE {ROW[table]}")
            found = [  # no "integer out of range"; the checks dropped by rolled_back aside
                v for v in A.check(conn, batch_size=1) if v.kind != "unenforced"
            ]
        # a choice, a provider's index, an attempt's seq and a positive position may be anything
        free = column in ("choice", "provider_index", "at_seq") or (
            table == "fsm_attempt_calls" and column == "position" and extreme > 0
        )
        assert bool(found) != free, (table, column, extreme, found)
        assert all(v.kind in A.VIOLATION_KINDS for v in found)


@SQLITE
def test_sqlite_the_issue_rows_with_foreign_keys_on(own_url: sa.URL) -> None:
    """Issue 10: on fsm's own engine (foreign keys on) but with the checks ignored, a text seq,
    a real position and 1e300 stored an unanswered call, gaps and forks, and the check then
    crashed or called the store clean."""
    fill(own_url)
    call = (
        "INSERT INTO fsm_tool_calls (conversation_id, assistant_seq, position, assistant_n_calls,"
        " call_id, type, name, arguments, repaired, state) VALUES"
    )
    message = (
        "INSERT INTO fsm_messages (conversation_id, seq, role, content, n_calls, slots_left,"
        " prev_seq, prev_slots_left, created_at) VALUES"
    )
    with sqlite_raw(own_url, ignore_checks=True) as conn:
        conn.exec_driver_sql(
            f"{call} ('corrupt', 1, 0.5, 2, 'extra', 'function', 'f', '{{}}', 0, 'finished')"
        )
        conn.exec_driver_sql(
            f"{message} ('corrupt', '5x', 'user', 'fork', 0, 0, 4, 0, CURRENT_TIMESTAMP)"
        )
        conn.exec_driver_sql(
            f"{message} ('corrupt', 1e300, 'user', 'far', 0, 0, 4, 0, CURRENT_TIMESTAMP)"
        )
    found = violations(own_url)
    kinds = {v.kind for v in found}
    assert "invalid_type" in kinds and len([v for v in found if v.kind == "invalid_type"]) >= 3
    rows = assert_cli_reports(own_url, {"invalid_type"})
    assert len(rows) == len(found)


@SQLITE
def test_sqlite_wrong_types_everywhere_at_once(own_url: sa.URL) -> None:
    """Every integer column of every table broken in one committed store: the command still
    reports them all (one line each) and exits 1."""
    fill(own_url)
    with sqlite_raw(own_url, foreign_keys=False, ignore_checks=True) as conn:
        for i, (table, column) in enumerate(INTEGER_COLUMNS):
            value = list(HOSTILE.values())[i % len(HOSTILE)]
            conn.exec_driver_sql(f"UPDATE {table} SET {column} = {value} WHERE {ROW[table]}")
        conn.exec_driver_sql("UPDATE fsm_messages SET conversation_id = X'ff' WHERE seq = 4")
        conn.exec_driver_sql("UPDATE fsm_messages SET usage = 'not json' WHERE seq = 2")
        conn.exec_driver_sql("UPDATE fsm_attempts SET anomalies = '[' , created_at = 5")
    found = violations(own_url)
    assert len([v for v in found if v.kind == "invalid_type"]) >= 5
    assert_cli_reports(own_url, {"invalid_type"})
    for command in (("calls",), ("failures",), ("failures", "--counts"), ("stats", "--by", "day")):
        for fmt in ("--json", "--csv", "--table"):
            result = run("audit", *command, "--db", text(own_url), fmt)
            assert result.exit_code == 0, (command, fmt, result.stderr)


# -- the row checks, one case each -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("statement", "kind"),
    [
        ("UPDATE fsm_tool_calls SET name = '' WHERE position = 0", "invalid_name"),
        ("UPDATE fsm_tool_calls SET name = ' \t' WHERE position = 0", "invalid_name"),
        ("UPDATE fsm_tool_calls SET arguments = '{\"a\":' WHERE position = 0", "invalid_arguments"),
        ("UPDATE fsm_tool_calls SET arguments = 'NaN' WHERE position = 0", "invalid_arguments"),
        ("UPDATE fsm_messages SET content = NULL WHERE seq = 0", "missing_content"),
        ("UPDATE fsm_messages SET content = NULL WHERE seq = 2", "missing_content"),
        ("UPDATE fsm_messages SET content_parts = '[]' WHERE seq = 0", "invalid_row"),
        ("UPDATE fsm_attempt_calls SET position = -1", "invalid_row"),
        ("UPDATE fsm_attempt_calls SET state = 'lost'", "invalid_row"),
    ],
)
def test_each_check_of_the_models_is_reported(own_url: sa.URL, statement: str, kind: str) -> None:
    fill(own_url)
    with rolled_back(own_url) as conn:
        conn.exec_driver_sql(statement)
        found = list(A.check(conn))
    assert kind in {v.kind for v in found}, found


def test_every_check_of_the_models_is_verified() -> None:
    """A check added to the models is verified by check(): as a row check (with a kind of its
    own or invalid_row) unless a structural scan covers it."""
    names = {
        str(c.name)
        for table in TABLES
        for c in Base.metadata.tables[table].constraints
        if isinstance(c, sa.CheckConstraint)
    }
    structural = set(integrity._STRUCTURAL_CHECKS)
    assert structural <= names
    for table in TABLES:
        for dialect in ("sqlite", "postgresql"):
            rules = {r.name for r in integrity._model_rules(Base.metadata.tables[table], dialect)}
            assert rules.isdisjoint(structural)
    assert set(integrity._CHECK_KINDS) <= names
    assert set(integrity._CHECK_KINDS.values()) <= set(A.VIOLATION_KINDS)


def test_the_types_terms_are_the_models_types_check() -> None:
    """The per-column terms that say which column has the wrong type are the terms of each
    table's SQLite types check."""
    for table in TABLES:
        # 0006's token columns and 0007's format columns pin their types in checks of their own
        # (SQLite cannot change ck_<table>_types without rebuilding the table); the ledger's two
        # 0007 columns (pending_turns.format, .provider_items, neither a key nor a count) are
        # type-checked by fsm audit check only
        constraints = [
            c for c in Base.metadata.tables[table].constraints if isinstance(c, sa.CheckConstraint)
        ]
        checks = [
            c
            for c in constraints
            if str(c.name) in (f"ck_{table}_types", f"ck_{table}_format_types")
        ]
        assert f"ck_{table}_types" in {str(c.name) for c in checks}
        own_names = {f"ck_{table}_{column}" for column in (*TOKEN_COLUMNS, "usage_unreadable")}
        own = {
            str(c.name): str(c.sqltext)
            for c in constraints
            if str(c.name) in own_names
            and getattr(getattr(c, "_ddl_if", None), "dialect", None) == "sqlite"
        }
        terms = set()
        for column, ok in integrity._sqlite_type_terms(Base.metadata.tables[table]):
            if table == "fsm_pending_turns" and column in ("format", "provider_items"):
                continue
            if f"ck_{table}_{column}" in own:
                assert f"typeof({column}) = 'integer'" in own[f"ck_{table}_{column}"]
            else:
                terms.add(ok)
        assert set().union(*(_top_level_terms(str(c.sqltext)) for c in checks)) == terms


def _top_level_terms(sql: str) -> set[str]:
    terms, depth, start = set(), 0, 0
    i = 0
    while i < len(sql):
        ch = sql[i]
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and sql.startswith(" AND ", i):
            terms.add(sql[start:i])
            start = i + 5
        i += 1
    terms.add(sql[start:])
    return terms


# -- audit reads survive any committed value ---------------------------------------------------
HOSTILE_ARGUMENTS = [
    '{"a": "\\ud83d", "b": 1}',  # a lone surrogate escape: valid JSON, not jsonb
    '{"a": 1e1000000, "b": 1}',  # beyond numeric
    '{"a": "\\u0000", "b": 1}',  # jsonb cannot hold it
    '{"a": 1e-100000, "b": 1}',
    "[" * 100 + "]" * 100,  # deep (the parser limits the depth)
]


def _commit_calls(url: sa.URL, arguments: list[str]) -> None:
    with ConversationStore(url) as store:
        store.create_conversation("h")
        store.append("h", [{"role": "user", "content": "go"}])
        calls = [(f"id{i}", "f", args) for i, args in enumerate(arguments)]
        calls += [("good", "f", '{"a": 1, "b": 1}'), ("text", "f", '{"a": "x", "b": 2}')]
        store.commit_turn("h", make_turn(calls, response_id="r-h"), ["ok"] * len(calls))
        cut = parse(sse(chunk(tc(0, "w", "f", '{"a": "\\ud83d')), chunk(finish="length")))
        store.record_attempt("h", cut)


def _call_ids(**filters: Any) -> Any:
    def ids(url: sa.URL) -> list[str]:
        engine = A.open_readonly(url)
        try:
            return [c.call_id for c in A.tool_calls(engine, **filters, limit=None)]
        finally:
            engine.dispose()

    return ids


def test_arg_filters_survive_arguments_jsonb_cannot_hold(own_url: sa.URL) -> None:
    _commit_calls(own_url, HOSTILE_ARGUMENTS)
    assert _call_ids(args=[("a", 1)])(own_url) == ["good"]
    assert _call_ids(args=[("a", "x")])(own_url) == ["text"]
    # the other keys of a document that holds such a value still match
    matched = _call_ids(args=[("b", 1)])(own_url)
    assert "good" in matched and {"id0", "id1", "id2"} & set(matched)
    assert _call_ids(args=[("a", "\ud83d")])(own_url) == []
    assert _call_ids(args_contains="1e1000000")(own_url) == ["id1"]
    assert _call_ids(args_contains="\\ud83d")(own_url) == ["id0", "w"]
    assert _call_ids(args_contains="\x00")(own_url) == []  # nothing stored holds one
    result = run("audit", "calls", "--db", text(own_url), "--arg", "a=1", "--nl")
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["call_id"] for line in result.stdout.splitlines()] == ["good"]
    table = run("audit", "calls", "--db", text(own_url), "--args-contains", "e1000000")
    assert table.exit_code == 0 and table.stdout.splitlines()[0].startswith("conversation_id")


@POSTGRES  # SQLite has json_valid
def test_arg_filters_before_migration_0003(
    own_url: sa.URL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without fsm_try_jsonb (a schema before 0003), the cast is guarded instead."""
    _commit_calls(own_url, HOSTILE_ARGUMENTS)
    monkeypatch.setattr(audit_calls, "pg_function", lambda conn, signature: False)
    assert _call_ids(args=[("a", 1)])(own_url) == ["good"]
    assert "good" in _call_ids(args=[("b", 1)])(own_url)


@contextmanager
def before_token_columns(url: sa.URL) -> Iterator[None]:
    """The database at revision 0005 (before the token columns of ``messages``) inside, and
    upgraded to head again after (which backfills the columns from the usage stored)."""
    downgrade(url, "0005_tool_ledger")
    yield
    upgrade(url)


USAGES = {
    "malformed": "'{\"prompt_tokens\": 3'",
    "infinity": '\'{"prompt_tokens": Infinity, "completion_tokens": 2}\'',
    "string count": '\'{"prompt_tokens": "12", "completion_tokens": 2}\'',
    "huge": '\'{"prompt_tokens": 1e400, "completion_tokens": 2}\'',
    "beyond numeric": '\'{"prompt_tokens": 1e1000000, "completion_tokens": 2}\'',
    "long integer": "'{\"prompt_tokens\": 123456789012345678901234567890}'",
    "negative": '\'{"prompt_tokens": -5, "completion_tokens": 2}\'',
    "fraction": '\'{"prompt_tokens": 2.5, "completion_tokens": 2}\'',
    "not an object": "'[1, 2]'",
    "a string": "'\"x\"'",
    "NUL escape": '\'{"x": "\\u0000", "prompt_tokens": 7, "completion_tokens": 2}\'',
    "lone surrogate": '\'{"x": "\\ud83d", "prompt_tokens": 7, "completion_tokens": 2}\'',
    "deep": '\'{"x": ' + "[" * 6000 + "]" * 6000 + ', "prompt_tokens": 7}\'',
}
#: not JSON: only SQLite (its checks off) can store them; PostgreSQL's json type refuses them
SQLITE_ONLY = {"malformed", "infinity"}


def test_stats_survive_any_usage(own_url: sa.URL, engine_name: str) -> None:
    usages = {k: v for k, v in USAGES.items() if engine_name == "sqlite" or k not in SQLITE_ONLY}
    with ConversationStore(own_url) as store:
        for i in range(len(usages) + 1):
            store.create_conversation(f"u{i}")
            store.append(f"u{i}", [{"role": "user", "content": "go"}])
            store.append(f"u{i}", [{"role": "assistant", "content": "ok"}])
    good = '\'{"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}\''
    # revision 0005 below: the tables before migration 0009 (no fsm_ prefix)
    statements = ["UPDATE messages SET model = 'm' WHERE role = 'assistant'"]
    statements += [f"UPDATE messages SET usage = {good} WHERE conversation_id = 'u0' AND seq = 1"]
    statements += [
        f"UPDATE messages SET usage = {value} WHERE conversation_id = 'u{i + 1}' AND seq = 1"
        for i, value in enumerate(usages.values())
    ]
    # stats() reads the token columns the store writes with each message: usage stored before
    # migration 0006 is read by its backfill, which must survive any usage as stats() did
    with before_token_columns(own_url):
        if engine_name == "sqlite":
            with sqlite_raw(own_url, ignore_checks=True) as conn:
                for statement in statements:
                    conn.exec_driver_sql(statement)
        else:
            engine = sa.create_engine(own_url, poolclass=sa.pool.NullPool)
            try:
                with engine.begin() as conn:
                    for statement in statements:
                        conn.exec_driver_sql(statement)
            finally:
                engine.dispose()
    engine = A.open_readonly(own_url)
    try:
        result = A.stats(engine)
        only = A.stats(engine, model="m")  # filtered: one query, not the halves
    finally:
        engine.dispose()
    # counted: the good usage (10, 5, 15); the completion tokens (2) of every usage whose
    # prompt count is unusable; the 7 prompt tokens of the usages that hold an escape jsonb
    # cannot take (read past it); totals given, or prompt + completion when both are counts.
    # The deep one is not read (SQLite's JSON functions stop at depth 2,000; PostgreSQL reads
    # no usage of 10,000 characters or more)
    sqlite = engine_name == "sqlite"
    for stat in (result, only):
        assert stat.totals is not None
        assert stat.totals.turns == len(usages) + 1
        expected = (24, 19, 33)
        assert (
            stat.totals.prompt_tokens,
            stat.totals.completion_tokens,
            stat.totals.total_tokens,
        ) == expected
        # not JSON objects read: malformed and Infinity (SQLite only), too deep, an array, a
        # string
        assert stat.unreadable_usage == (5 if sqlite else 3)
    cli_result = run("audit", "stats", "--db", text(own_url))
    assert cli_result.exit_code == 0, cli_result.stderr
    assert cli_result.stdout.splitlines()[0] == "tools:"
    assert "note: " in cli_result.stderr and "not counted" in cli_result.stderr
    document = json.loads(run("audit", "stats", "--db", text(own_url), "--json").stdout)
    assert document["totals"]["unreadable_usage"] == result.unreadable_usage


def test_a_string_token_count_is_not_counted(own_url: sa.URL) -> None:
    """SQLite's sum() reads '12' as 12; the audit counts integers only, on both engines."""
    with ConversationStore(own_url) as store:
        store.create_conversation("s")
        store.append("s", [{"role": "user", "content": "go"}])
        store.append("s", [{"role": "assistant", "content": "ok"}])
    with before_token_columns(own_url):  # read by the backfill of migration 0006
        engine = sa.create_engine(own_url, poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    'UPDATE messages SET usage = \'{"prompt_tokens": "12", "completion_tokens"'
                    ": 3}' WHERE seq = 1"
                )
        finally:
            engine.dispose()
    # written now, the same usage gets the same columns
    assert usage_columns({"prompt_tokens": "12", "completion_tokens": 3}) == {
        "prompt_tokens": None,
        "completion_tokens": 3,
        "total_tokens": None,
        "usage_unreadable": None,
    }
    engine = A.open_readonly(own_url)
    try:
        totals = A.stats(engine).totals
    finally:
        engine.dispose()
    assert totals is not None
    assert (totals.prompt_tokens, totals.completion_tokens, totals.total_tokens) == (0, 3, 0)


# -- marked values are shown decoded -------------------------------------------------------------
def test_values_stored_marked_are_shown_decoded(own_url: sa.URL) -> None:
    odd_id, odd_name = "call\x00\ud83d", "tool\x00"
    with ConversationStore(own_url) as store:
        store.create_conversation("m")
        store.append("m", [{"role": "user", "content": "go"}])
        turn = make_turn([(odd_id, "f", '{"a": 1}')], response_id="r-m", model="model\x00x")
        store.commit_turn("m", turn, ["result\x00"])
        cut = parse(sse(chunk(tc(0, "w", odd_name, '{"a": "\x00')), chunk(finish="length")))
        store.record_attempt("m", cut)
    engine = A.open_readonly(own_url)
    try:
        calls = list(A.tool_calls(engine))
        failed = list(A.failures(engine))
        counts = A.failure_counts(engine)
        summary = A.stats(engine)
        assert list(A.check(engine)) == []
    finally:
        engine.dispose()
    committed = [c for c in calls if c.attempt_id is None]
    assert [(c.call_id, c.model, c.result) for c in committed] == [
        (odd_id, "model\x00x", "result\x00")
    ]
    assert [(f.name, f.arguments) for f in failed] == [(odd_name, '{"a": "\x00')]
    assert [c.model for c in counts] == ["test-model"]
    assert {t.name for t in summary.tools} == {"f", odd_name}
    assert {m.model for m in summary.models} >= {"model\x00x"}
    as_json = run("audit", "calls", "--db", text(own_url), "--json")
    assert as_json.exit_code == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert odd_id in [r["call_id"] for r in rows]
    assert "\\ud83d" in as_json.stdout and "\ufdd0" not in as_json.stdout
    for fmt in ("--table", "--csv", "--tsv", "--nl"):
        result = run("audit", "calls", "--db", text(own_url), fmt)
        assert result.exit_code == 0, (fmt, result.stderr)
        assert "\ufdd0" not in result.stdout
    failures = run("audit", "failures", "--db", text(own_url), "--nl")
    assert json.loads(failures.stdout.splitlines()[0])["name"] == odd_name
    stats = run("audit", "stats", "--db", text(own_url), "--json")
    assert stats.exit_code == 0 and "\ufdd0" not in stats.stdout


def test_a_mismatch_of_marked_ids_is_shown_decoded(own_url: sa.URL) -> None:
    with ConversationStore(own_url) as store:
        store.create_conversation("m")
        store.append("m", [{"role": "user", "content": "go"}])
        store.commit_turn("m", make_turn([("id\x00", "f", "{}")], response_id="r"), ["ok"])
    with rolled_back(own_url) as conn:
        conn.execute(
            sa.text("UPDATE fsm_messages SET tool_call_id = :v WHERE seq = 2"),
            {"v": "\ufdd0other\\0"},  # the codec's form of "other\x00"
        )
        [found] = [v for v in A.check(conn) if v.kind != "unenforced"]
    assert found.kind == "result_id_mismatch"
    assert "'other\\x00'" in found.detail and "'id\\x00'" in found.detail
    assert "\ufdd0" not in found.detail


# -- the command's errors --------------------------------------------------------------------------
def test_check_exits_3_with_one_line_when_the_store_cannot_be_read(tmp_path: Any) -> None:
    result = run("audit", "check", "--db", f"sqlite:///{tmp_path / 'missing.db'}")
    assert result.exit_code == 3  # EXIT_STORE: no such database, as in every command (issue 12)
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.stderr


def test_history_of_a_broken_store_is_one_line(own_url: sa.URL, engine_name: str) -> None:
    corruption = CORRUPTIONS[
        "sqlite_foreign_keys_off_missing_result"
        if engine_name == "sqlite"
        else "postgresql_replica_missing_result"
    ]
    conversation = corruption.build(own_url)
    result = run("history", "--db", text(own_url), conversation)
    assert result.exit_code not in (0, 70), (result.exit_code, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "fsm audit check" in line


def test_the_check_command_lists_every_kind() -> None:
    from fsm.cli.audit import audit

    help_text = audit.commands["check"].help or ""
    assert all(kind in help_text.split() for kind in A.VIOLATION_KINDS)


@POSTGRES
def test_the_guard_functions_never_run_in_a_parallel_worker(own_url: sa.URL) -> None:
    """fsm_try_jsonb and fsm_json_valid catch errors in an exception block, a subtransaction,
    which a parallel worker cannot start ("cannot start subtransactions during a parallel
    operation"): they are declared PARALLEL UNSAFE (RESTRICTED is not enough: the leader is in
    parallel mode too), so even with parallel plans forced on a big table, the queries that use
    them get no parallel plan and never fail for the whole store."""
    _commit_calls(own_url, HOSTILE_ARGUMENTS)
    engine = sa.create_engine(own_url, poolclass=sa.pool.NullPool)
    forced = (
        "SET parallel_setup_cost = 0",
        "SET parallel_tuple_cost = 0",
        "SET min_parallel_table_scan_size = 0",
        "SET max_parallel_workers_per_gather = 2",
        "SET parallel_leader_participation = off",
    )
    try:
        with engine.connect() as conn:
            for statement in forced:
                conn.exec_driver_sql(statement)
            parallel = conn.exec_driver_sql(
                "SELECT proname FROM pg_proc WHERE proname IN ('fsm_try_jsonb', 'fsm_json_valid')"
                " AND proparallel <> 'u'"
            ).all()
            assert parallel == []
            conn.exec_driver_sql("SELECT count(fsm_try_jsonb(arguments)) FROM fsm_tool_calls").all()
            assert [c.call_id for c in A.tool_calls(conn, args=[("a", 1)])] == ["good"]
            conn.exec_driver_sql(
                "ALTER TABLE fsm_tool_calls DROP CONSTRAINT ck_fsm_tool_calls_arguments"
            )
            conn.exec_driver_sql("UPDATE fsm_tool_calls SET arguments = '{' WHERE call_id = 'good'")
            kinds = {v.kind for v in A.check(conn)}  # the arguments rule: fsm_json_valid
            assert {"invalid_arguments", "unenforced"} <= kinds
            conn.rollback()
    finally:
        engine.dispose()
