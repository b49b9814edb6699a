"""The write path: the plans of a commit's foreign-key checks on PostgreSQL stay index probes as
tables grow; SQLite writers of one process take turns; a commit's statements.

A commit runs some 18 foreign-key checks; PostgreSQL caches a generic plan for each, per
session. A plan made after the tables were analyzed while tiny is a sequential scan, and it is
kept as the tables grow (a bulk load, until autovacuum analyzes them again). fsm's write
transactions turn sequential scans off (``SET LOCAL enable_seqscan = off``,
:data:`fsm.store.engine._POSTGRES_WRITE_TRANSACTION`), so each cached plan is an index probe
whatever the statistics said. Shown here with ``auto_explain``, which reports the plans of the
checks (nested statements) to the client: the same session, the same scenario, once through
fsm (index probes) and once through a bare connection (sequential scans of the grown table).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from bench.roundtrips import round_trips
from fsm.store import ConversationStore, audit, create_engine, upgrade
from tests.helpers.store import empty_database, make_turn, pg_partitions

GROWN = 20_000
TABLES = ("fsm_conversations", "fsm_messages", "fsm_tool_calls")
AUTO_EXPLAIN = (
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_level = notice",
    "SET auto_explain.log_nested_statements = on",
)


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[sa.URL]:
    for url in empty_database("postgresql", tmp_path / "unused.db"):
        upgrade(url, partitions=pg_partitions())
        yield url


def _connect(url: sa.URL) -> psycopg.Connection[Any]:
    args = {"host": url.host, "port": url.port, "user": url.username, "dbname": url.database}
    args.update({key: str(value) for key, value in url.query.items()})
    return psycopg.connect(password=url.password, autocommit=True, **args)


def _explain(conn: psycopg.Connection[Any], notices: list[str]) -> None:
    """Report the plans of every statement run on ``conn`` from now on, nested ones too."""
    for setting in AUTO_EXPLAIN:
        conn.execute(setting)
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))


def _seq_scans(notices: list[str]) -> set[str]:
    return set(
        re.findall(
            r"Seq Scan on (fsm_(?:messages|tool_calls|conversations)\w*)", "\n".join(notices)
        )
    )


def _bare_turn(conn: psycopg.Connection[Any], seq: int) -> None:
    """One turn of one call, written by hand in one transaction, as a bare client would."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO fsm_messages (conversation_id, seq, role, n_calls, slots_left, prev_seq,"
            " prev_slots_left, block_end_seq) VALUES ('bare', %s, 'assistant', 1, 1, %s, %s, %s)",
            (seq, seq - 1 if seq else None, 0 if seq else None, seq + 1),
        )
        conn.execute(
            "INSERT INTO fsm_tool_calls (conversation_id, assistant_seq, position, assistant_n_calls,"
            " call_id, type, name, arguments, repaired, state) VALUES ('bare', %s, 0, 1, 'c',"
            " 'function', 'f', '{}', false, 'finished')",
            (seq,),
        )
        conn.execute(
            "INSERT INTO fsm_messages (conversation_id, seq, role, content, tool_call_id,"
            " assistant_seq, call_position, slots_left, prev_seq, prev_slots_left) VALUES"
            " ('bare', %s, 'tool', 'ok', 'c', %s, 0, 0, %s, 1)",
            (seq + 1, seq, seq),
        )


@pytest.mark.postgres
@pytest.mark.serial  # other sessions' DDL can reset the plan cache of the control session
def test_foreign_key_checks_stay_index_probes_on_a_grown_table(pg_url: sa.URL) -> None:
    with _connect(pg_url) as admin, _connect(pg_url) as bare:
        relations = admin.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema() AND c.relkind = 'r'"
        ).fetchall()
        for (table,) in relations:  # autovacuum would analyze the grown tables: not here
            admin.execute(f'ALTER TABLE "{table}" SET (autovacuum_enabled = false)')
        admin.execute("INSERT INTO fsm_conversations (id) VALUES ('bare'), ('grown')")
        with ConversationStore(pg_url) as store:
            conv = store.create_conversation()
            for i in range(2):
                store.commit_turn(conv, make_turn(response_id=f"tiny-{i}"), ["ok"])
            for table in TABLES:  # analyzed while tiny, as autovacuum does early on
                admin.execute(f"ANALYZE {table}")
            # the checks' plans are made now, from the tiny statistics, and cached: past the
            # 5 custom plans PostgreSQL settles on a generic one
            for i in range(8):
                store.commit_turn(conv, make_turn(response_id=f"small-{i}"), ["ok"])
            for turn in range(8):
                _bare_turn(bare, 2 * turn)
            # the growth goes to both conversations (on a partitioned database each check
            # reads the partition of its own conversation)
            admin.execute(
                "INSERT INTO fsm_messages (conversation_id, seq, role, content, prev_seq,"
                " prev_slots_left) SELECT 'grown', g, 'user', 'x', CASE WHEN g > 0 THEN g - 1"
                f" END, CASE WHEN g > 0 THEN 0 END FROM generate_series(0, {GROWN - 1}) g"
            )
            admin.execute(
                "INSERT INTO fsm_messages (conversation_id, seq, role, content, prev_seq,"
                " prev_slots_left) SELECT 'bare', g, 'user', 'x', g - 1, 0"
                f" FROM generate_series(16, {16 + GROWN - 1}) g"
            )
            ours: list[str] = []
            with store.engine.connect() as conn:  # the store's one pooled session
                raw = conn.connection.driver_connection
                assert isinstance(raw, psycopg.Connection)
                conn.rollback()
                _explain(raw, ours)
                raw.commit()  # the settings are the session's (a rollback would undo them)
            store.commit_turn(conv, make_turn(response_id="grown"), ["ok"])
        assert ours and not _seq_scans(ours), ours
        assert sum("Index" in n and "Scan" in n for n in ours) >= 4, ours
        if pg_partitions():
            return  # the control below is shown on one table (partitions plan their own way)
        # the same, by a bare session with PostgreSQL's defaults: its cached checks read the
        # grown table from end to end
        theirs: list[str] = []
        _explain(bare, theirs)
        _bare_turn(bare, 16 + GROWN)
        assert any(t.startswith("fsm_messages") for t in _seq_scans(theirs)), theirs


def test_a_commit_is_few_statements(store: ConversationStore) -> None:
    """PostgreSQL: one statement, the transaction's settings, the lock, the query and the INSERT
    sent as one query that the server commits as it ends; SQLite: BEGIN IMMEDIATE, one query,
    one INSERT per table, COMMIT (bench/floor.py's figures)."""
    conv = store.create_conversation()
    seen: list[str] = []
    whole: list[str] = []

    def before(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        seen.append(statement.split(None, 1)[0].upper())
        whole.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", before)
    try:
        store.commit_turn(conv, make_turn(response_id="few"), ["ok"])
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", before)
    if store.dialect == "postgresql":
        # no BEGIN and no COMMIT: the settings (local to the statement's implicit transaction),
        # the conversation's lock, then the reading with the insert, each its own statement
        assert seen == ["SET"], seen
        parts = whole[0].split("; ")
        assert parts[0] == "SET LOCAL enable_seqscan = off", parts
        assert all(p.startswith("SET LOCAL ") for p in parts[:-2]), parts
        assert parts[-2].endswith("FOR UPDATE") and f"'{conv}'" in parts[-2], parts[-2]
        assert parts[-1].startswith("WITH st (x, p, a, s, l, sl, e)"), parts[-1][:80]
    else:
        assert seen == ["BEGIN", "SELECT", "INSERT", "INSERT", "INSERT"], seen
    assert store.history(conv)[-1]["content"] == "ok"


def test_sqlite_binds_a_turn_s_rows_before_begin_immediate(store: ConversationStore) -> None:
    """SQLite: under the write lock only the state query and the inserts run; each table's
    rows arrive bound (driver SQL, no compiling or bind processing under the lock), the calls
    and the results in one ``executemany`` each, and what is stored is what the turn says."""
    if store.dialect != "sqlite":
        pytest.skip("SQLite's write lock")
    conv = store.create_conversation()
    store.append(conv, [{"role": "user", "content": "pay and email"}])
    calls = (("call_a", "pay", '{"invoice": 1}'), ("call_b", "email", '{"to": "x@y"}'))
    seen: list[tuple[str, bool, bool]] = []

    def before(_c: Any, _cur: Any, statement: str, _p: Any, context: Any, many: bool) -> None:
        seen.append((statement.split(None, 1)[0].upper(), context.compiled is None, many))

    sa.event.listen(store.engine, "before_cursor_execute", before)
    try:
        parts = [{"type": "text", "text": "sent"}]
        done = store.commit_turn(
            conv, make_turn(calls, response_id="b1"), ["paid", {"content": parts}]
        )
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", before)
    assert seen[1][0] == "SELECT" and seen[2:] == [
        ("INSERT", True, False),  # the assistant message
        ("INSERT", True, True),  # the calls
        ("INSERT", True, True),  # the results
    ], seen
    assert done.seq == 1 and store.history(conv)[1:] == done.messages
    assert done.messages[2]["content"] == parts
    assert list(audit.check(store.engine)) == []


def test_the_checked_insert_moves_exactly_the_columns_that_move_with_the_seq() -> None:
    """PostgreSQL's commit binds a turn's rows as built for seq 1 and moves
    ``writes.SEQ_COLUMNS`` to the conversation's next seq in SQL: those are exactly the columns
    whose values differ between the rows built at two seqs, by the difference of the seqs, and
    a turn at seq 0 differs from that only by its assistant message's predecessor (none)."""
    from fsm.store import core, plans, writes

    turn = make_turn((("call_a", "pay", '{"invoice": 1}'), ("call_b", "email", '{"to": "x@y"}')))
    plan = plans.plan_turn(turn, ["paid", "sent"])

    def rows(seq: int) -> list[dict[str, Any]]:
        message, calls, results = core.turn_rows("c", plan, seq, "k")
        return [message, *calls, *results]

    # writes.at_seq (SQLite's rows bound before the lock) moves them the same way
    for seq in (0, 1, 2, 8):
        for built, want in zip(rows(1), rows(seq), strict=True):
            columns = tuple(built)
            moved = writes.at_seq(columns, tuple(built.values()), seq)
            assert moved == tuple(want[c] for c in columns), (seq, columns)
    base, later, first = rows(1), rows(8), rows(0)
    for one, other, at_zero in zip(base, later, first, strict=True):
        moved = {c for c in one if one[c] != other[c]}
        assert moved <= writes.SEQ_COLUMNS, moved
        assert all(other[c] == one[c] + 7 for c in moved)
        assert {c for c in one if c in writes.SEQ_COLUMNS and one[c] is not None} <= moved
        shifted = {c: (v - 1 if c in moved else v) for c, v in one.items()}
        if one is base[0]:  # the assistant message: no predecessor at seq 0
            shifted |= {"prev_seq": None, "prev_slots_left": None}
        assert at_zero == shifted


def test_the_write_statements_stay_within_psycopg_s_statement_cache(
    store: ConversationStore,
) -> None:
    """psycopg caches its conversion of a statement (``%(name)s`` to ``$1``) only up to 4,096
    bytes and 50 parameters (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH`` and
    ``..._PARAMS``) and parses a longer one again at every execution, which costs more than
    a round trip: every statement of a commit, of the ledger's begin and of its commit stays
    within both, as psycopg receives it, with room for the longest schema name PostgreSQL
    takes (63 characters, quoted, before each table)."""
    from fsm.store.ledger import Outcome

    if store.dialect != "postgresql":
        pytest.skip("psycopg's statement cache")
    calls = (("call_a", "pay", '{"invoice": 1}'), ("call_b", "email", '{"to": "x@y"}'))
    seen: list[tuple[str, int]] = []

    def before(_c: Any, _cur: Any, statement: str, params: Any, *_a: Any) -> None:
        seen.append((statement, len(params) if isinstance(params, dict) else 0))

    conv = store.create_conversation()
    sa.event.listen(store.engine, "before_cursor_execute", before)
    try:
        turn = make_turn(calls, content="x", response_id="cache")
        store.commit_turn(conv, turn, ["a", "b"], idempotency_key="k")
        store.commit_turn(conv, make_turn(calls, response_id="cache2"), ["a", "b"])
        pending = store.begin(conv, make_turn(calls, response_id="cache3"), start=0)
        pending = store.started(pending, 1, recording=Outcome(0, result="a"))
        store.commit(pending, recording=Outcome(1, result="b"))
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", before)
    assert any(params == 0 for _, params in seen)  # the commits' one queries, bound in text
    for statement, params in seen:
        if params == 0:
            continue  # sent without parameters: psycopg converts (and caches) nothing
        tables = len(re.findall(r"(?:FROM|INTO|JOIN) fsm_", statement))
        room = tables * (63 + 3)
        assert len(statement.encode()) + room <= 4096, (len(statement), tables, statement[:80])
        assert params <= 50, (params, statement[:80])


#: a query whose transaction's settings come first (after a read, the connection's isolation
#: level, which SQLAlchemy set back to the session's, comes as SET TRANSACTION)
_SETTINGS_FIRST = r'"(SET TRANSACTION ISOLATION LEVEL READ COMMITTED; )?SET LOCAL enable_seq'


def test_postgres_round_trips(store: ConversationStore) -> None:
    """Counted on the wire (libpq's trace): a commit is 1 round trip (one query: the
    transaction's settings, the lock, the state with the insert; committed by the server as it
    ends); its retry that finds the turn stored 7 (the query writes nothing, then the commit
    reads the stored turn statement by statement); a read 4 (BEGIN with its settings, two
    SELECTs, COMMIT); the ledger's begin 1 and its commit 1; psycopg sends no BEGIN of its
    own."""
    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL round trips")
    conv = store.create_conversation()
    with round_trips(store.engine) as commit:
        store.commit_turn(conv, make_turn(response_id="trips"), ["ok"])
    assert commit.total == 1, commit.trace
    assert re.match(_SETTINGS_FIRST, commit.trace[0]), commit.trace
    with round_trips(store.engine) as retry:
        assert not store.commit_turn(conv, make_turn(response_id="trips"), ["ok"]).created
    # then BEGIN, the lock, the state, the stored turn (two SELECTs), COMMIT
    assert retry.total == 1 + 6, retry.trace
    with round_trips(store.engine) as read:
        store.history(conv)
    assert read.total == 4, read.trace
    assert read.trace[0].startswith('"BEGIN ISOLATION LEVEL REPEATABLE READ; SET LOCAL'), read.trace
    # the tool ledger: begin is one query (the settings, the lock, the reading with the
    # insert); the commit that records the last outcome one query (the settings, the lock of
    # the conversation and the turn, one statement for the rest, only while the turn is the
    # holder's)
    from fsm.store.ledger import Outcome

    with round_trips(store.engine) as begin:
        pending = store.begin(conv, make_turn(response_id="ledger"), start=0)
    assert begin.total == 1, begin.trace
    assert re.match(_SETTINGS_FIRST, begin.trace[0]), begin.trace
    with round_trips(store.engine) as commit:
        done = store.commit(pending, recording=Outcome(0, result="sunny"))
    assert commit.total == 1, commit.trace
    assert done.created and store.history(conv)[-1]["content"] == "sunny"


def test_postgres_one_query_takes_the_engine_s_modes_or_is_turned_off(
    store: ConversationStore,
) -> None:
    """An engine at another isolation level sends it first in the one query (``SET
    TRANSACTION``: the query's implicit transaction runs at it); ``create_engine(...,
    one_query=False)`` commits statement by statement (4 round trips, ``BEGIN`` first), where a
    connection lost before ``COMMIT`` is a known outcome."""
    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL round trips")
    url = store.engine.url.render_as_string(hide_password=False)
    conv = store.create_conversation()
    with ConversationStore(engine=create_engine(url, isolation_level="SERIALIZABLE")) as strict:
        with round_trips(strict.engine) as commit:
            strict.commit_turn(conv, make_turn(response_id="serializable"), ["ok"])
        assert commit.total == 1, commit.trace
        assert commit.trace[0].startswith('"SET TRANSACTION ISOLATION LEVEL SERIALIZABLE; SET')
    with ConversationStore(engine=create_engine(url, one_query=False)) as stepwise:
        with round_trips(stepwise.engine) as commit:
            stepwise.commit_turn(conv, make_turn(response_id="stepwise"), ["ok"])
        assert commit.total == 4, commit.trace
        assert commit.trace[0].startswith('"BEGIN; SET LOCAL'), commit.trace
        with round_trips(stepwise.engine) as begin:
            stepwise.begin(conv, make_turn(response_id="stepwise-ledger"))
        assert begin.total == 4, begin.trace
    assert [m.get("content") for m in store.history(conv) if m["role"] == "tool"] == ["ok", "ok"]


def test_postgres_one_query_on_a_socket_past_descriptor_1023(store: ConversationStore) -> None:
    """A busy service holds many files: a connection whose socket is past descriptor 1023
    (which ``select()`` cannot watch) still commits in one round trip."""
    import resource

    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL round trips")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the process may open {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        url = store.engine.url.render_as_string(hide_password=False)
        with ConversationStore(url) as busy:
            conv = busy.create_conversation()
            with busy.engine.connect() as conn:
                assert conn.connection.driver_connection.pgconn.socket > 1023
            with round_trips(busy.engine) as commit:
                busy.commit_turn(conv, make_turn(response_id="many-files"), ["ok"])
            assert commit.total == 1, commit.trace
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_sqlite_writers_of_a_process_take_turns(tmp_path: Path) -> None:
    """A thread waits for the file's write lock of this process (at most ``busy_timeout``:
    then StoreBusyError, retryable); 16 threads on one file all land, in order."""
    import threading

    from fsm.store import store as store_module
    from fsm.store.errors import StoreBusyError

    url = sa.make_url(f"sqlite:///{tmp_path / 'turns.db'}")
    upgrade(url)
    with ConversationStore(url, busy_timeout=0.2) as store:
        conv = store.create_conversation()
        lock = store_module._sqlite_writer_lock(url)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with lock:
                held.set()
                release.wait(5)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5)
        try:
            with pytest.raises(StoreBusyError) as busy:
                store.append(conv, [{"role": "user", "content": "late"}])
            assert busy.value.retryable
        finally:
            release.set()
            holder.join()
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:
                for j in range(5):
                    store.commit_turn(conv, make_turn(response_id=f"t{i}-{j}"), [f"{i}-{j}"])
            except BaseException as exc:
                errors.append(exc)

        with ConversationStore(url) as patient:
            store = patient
            threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            assert len(patient.history(conv)) == 16 * 5 * 2


@pytest.mark.parametrize("host", [False, True], ids=["own engine", "host engine"])
def test_sqlite_writer_waits_for_another_process_lock(tmp_path: Path, host: bool) -> None:
    """Another process's write lock (here a bare sqlite3 connection, which takes no lock of
    this process): the store's BEGIN IMMEDIATE polls with a short jittered backoff, lands once
    the lock is released, raises the retryable StoreBusyError when it is held past
    ``busy_timeout``; the connection's busy timeout (for its reads) is back afterwards. The
    same through a host's engine given to configure_engine (no error hook of the store's)."""
    import sqlite3
    import threading

    from fsm.store import configure_engine
    from fsm.store.errors import StoreBusyError

    path = tmp_path / "other.db"
    url = sa.make_url(f"sqlite:///{path}")
    upgrade(url)
    engine = configure_engine(sa.create_engine(url), busy_timeout=0.5) if host else None
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        with (
            ConversationStore(engine=engine) if host else ConversationStore(url, busy_timeout=0.5)
        ) as store:
            conv = store.create_conversation()
            other.execute("BEGIN IMMEDIATE")
            started = time.monotonic()
            with pytest.raises(StoreBusyError) as busy:
                store.append(conv, [{"role": "user", "content": "never"}])
            assert busy.value.retryable
            assert time.monotonic() - started >= 0.45  # waited its busy timeout first
            releaser = threading.Timer(0.2, lambda: other.execute("COMMIT"))
            other.execute("COMMIT")
            other.execute("BEGIN IMMEDIATE")
            releaser.start()
            try:
                store.append(conv, [{"role": "user", "content": "after the lock"}])
            finally:
                releaser.join()
            assert [m["content"] for m in store.history(conv)] == ["after the lock"]
            with store.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 500
    finally:
        other.close()
        if engine is not None:
            engine.dispose()
