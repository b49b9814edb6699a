"""A writer that dies inside its transaction leaves nothing behind, and its retry lands once.

The atomicity tests of ``test_commit.py`` raise an exception from Python at each statement: the
transaction is rolled back by the client. Here the client gets no say:

* **PostgreSQL, connection killed**: a ``commit_turn`` runs in a thread, paused inside its
  transaction (after a given INSERT, or right before COMMIT) by an engine event; another
  connection ends its backend with ``pg_terminate_backend``; released, the commit fails with a
  driver error naming the termination, and the server has rolled the transaction back.
* **Process killed (SQLite and PostgreSQL)**: the writer is a separate process (``spawn``),
  paused in the same places, and killed with SIGKILL: no rollback, no close, no cleanup. SQLite
  recovers from its WAL on the next open; PostgreSQL sees the socket close and aborts.

Each time: the tables equal, row for row, what they were before; ``PRAGMA integrity_check`` is
``ok`` on SQLite; :func:`fsm.store.audit.check` finds nothing; the conversation is not left
locked (the next writer proceeds at once); the same commit retried succeeds, and a second retry
writes nothing (idempotency).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from bench import soak
from fsm.store import ConversationStore, audit
from fsm.store.errors import CommitOutcomeUnknownError, StoreUnavailableError
from tests.helpers.store import make_turn, stepwise

TABLES = (
    "fsm_conversations",
    "fsm_messages",
    "fsm_tool_calls",
    "fsm_attempts",
    "fsm_attempt_calls",
)
CALLS = [
    ("call_a", "add", '{"a": 2, "b": 3}'),
    ("", "noop", "{}"),
    ("call_a", "add", '{"a": 2, "b": 3}'),
]
RESULTS = ["5", "none", "5 again"]
#: where the writer is paused: after its first write (SQLite: the INSERT of the assistant
#: message; PostgreSQL, which writes the whole turn in one statement: the conversation's lock),
#: after its last INSERT (the results), or at COMMIT (every row written, the commit not yet sent)
PAUSE_POINTS = ["first_insert", "last_insert", "commit"]


def _writes(engine: sa.Engine, statement: str) -> bool:
    """Whether ``statement`` is one of the writes of a commit that :func:`add_pause` counts:
    SQLite's three INSERTs (assistant message, calls, results); PostgreSQL's lock and its one
    INSERT of the turn (``WITH written_calls AS (INSERT ...) INSERT ...``)."""
    text = statement.lstrip().upper()
    if engine.dialect.name == "postgresql":
        return text.startswith(("INSERT", "WITH")) or text.endswith("FOR UPDATE")
    return text.startswith("INSERT")


def _inserts(engine: sa.Engine) -> int:
    return 2 if engine.dialect.name == "postgresql" else 3


TIMEOUT = 20.0


def dump(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, ordered: equal dumps mean an identical store."""
    with engine.connect() as conn:
        return {
            table: sorted(
                tuple(repr(v) for v in row)
                for row in conn.execute(sa.text(f"SELECT * FROM {table}"))
            )
            for table in TABLES
        }


def the_turn() -> Any:
    return make_turn(CALLS, content="three calls", response_id="resp-killed")


def seed(store: ConversationStore) -> str:
    conv = store.create_conversation("conv-fault")
    store.append(conv, [{"role": "user", "content": "add twice"}])
    store.commit_turn(conv, make_turn(response_id="resp-before"), ["sunny"])
    other = store.create_conversation("conv-other")
    store.append(other, [{"role": "user", "content": "untouched"}])
    return conv


def add_pause(engine: sa.Engine, point: str, on_pause: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``on_pause(dbapi_connection)`` at ``point`` of the next commit; returns a remover."""
    inserts = {"n": 0}
    writes = _inserts(engine)
    target = 1 if point == "first_insert" else writes

    def after(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _writes(engine, statement):
            inserts["n"] += 1
            if inserts["n"] == target:
                on_pause(conn.connection.dbapi_connection)

    def at_commit(conn: Any) -> None:
        if inserts["n"] == writes:
            on_pause(conn.connection.dbapi_connection)

    if point == "commit":
        event.listen(engine, "after_cursor_execute", after)  # counts only
        event.listen(engine, "commit", at_commit)
        target = -1
    else:
        event.listen(engine, "after_cursor_execute", after)

    def remove() -> None:
        event.remove(engine, "after_cursor_execute", after)
        if point == "commit":
            event.remove(engine, "commit", at_commit)

    return remove


def _chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and its causes, outermost first."""
    found = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def assert_recovered(store: ConversationStore, conv: str, before: dict[str, Any]) -> None:
    """Nothing of the dead commit is left, the store is sound, and the retry lands once."""
    fresh = sa.create_engine(store.engine.url, poolclass=sa.pool.NullPool)
    try:
        assert dump(fresh) == before
        if fresh.dialect.name == "sqlite":
            with fresh.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalars().all() == ["ok"]
        assert list(audit.check(fresh)) == []
    finally:
        fresh.dispose()
    length = len(store.history(conv))
    started = time.monotonic()
    retry = store.commit_turn(conv, the_turn(), RESULTS, expected_seq=length)
    # the conversation was not left locked: no wait for a lock timeout
    assert time.monotonic() - started < 5
    assert retry.created and retry.seq == length
    again = store.commit_turn(conv, the_turn(), RESULTS)
    assert not again.created and again.seq == retry.seq
    history = store.history(conv)
    assert len(history) == length + 1 + len(CALLS)
    assert history[length:] == retry.messages
    assert [m["tool_call_id"] for m in history[length + 1 :]] == [c[0] for c in CALLS]
    assert [m["content"] for m in history[length + 1 :]] == RESULTS
    assert list(audit.check(store.engine)) == []


# -- PostgreSQL: the backend is terminated while the transaction is open -----------------------
@pytest.mark.parametrize(
    "engine_name", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_postgres_connection_terminated_mid_transaction(db_url: sa.URL, point: str) -> None:
    with stepwise(db_url) as store:
        _terminated_mid_transaction(store, point)


def _committing(
    store: ConversationStore, conv: str, name: str | None = None
) -> tuple[threading.Thread, dict[str, Any]]:
    """A started thread (named ``name``) committing the test's turn to ``conv``, and where it
    leaves what the commit returned (``value``) or raised (``error``)."""
    outcome: dict[str, Any] = {}

    def writer() -> None:
        try:
            outcome["value"] = store.commit_turn(conv, the_turn(), RESULTS)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=writer, name=name)
    thread.start()
    return thread, outcome


def _terminated_mid_transaction(store: ConversationStore, point: str) -> None:
    conv = seed(store)
    before = dump(store.engine)
    paused, release = threading.Event(), threading.Event()
    backend: dict[str, int] = {}

    def on_pause(dbapi_connection: Any) -> None:
        if threading.current_thread().name != "doomed-writer":
            return
        backend["pid"] = dbapi_connection.info.backend_pid
        paused.set()
        release.wait(TIMEOUT)

    remove = add_pause(store.engine, point, on_pause)
    thread, outcome = _committing(store, conv, name="doomed-writer")
    try:
        assert paused.wait(TIMEOUT), "the writer never reached its pause point"
        # autocommit: pg_stat_activity is a snapshot per transaction
        watcher = sa.create_engine(
            store.engine.url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT"
        )
        try:
            with watcher.connect() as conn:
                state = conn.execute(
                    sa.text("SELECT state FROM pg_stat_activity WHERE pid = :pid"), backend
                ).scalar_one()
                assert state == "idle in transaction"
        finally:
            watcher.dispose()
        _terminate(store.engine.url, backend["pid"])
    finally:
        release.set()
        thread.join(TIMEOUT)
        remove()
    assert not thread.is_alive()
    error = outcome.get("error")
    assert error is not None, f"the commit succeeded on a terminated connection: {outcome}"
    if point == "first_insert":
        # a statement before COMMIT failed: nothing was written, and the error says so
        assert isinstance(error, StoreUnavailableError), repr(error)
        assert not isinstance(error, CommitOutcomeUnknownError), repr(error)
        assert error.retryable and "nothing was written" in str(error), str(error)
    else:
        # the first thing sent on the dead connection was COMMIT: the client cannot know
        # whether the server committed before it went
        assert isinstance(error, CommitOutcomeUnknownError), repr(error)
    text = " ".join(str(e) for e in _chain(error)).lower()
    assert "terminat" in text or "closed" in text, text
    assert_recovered(store, conv, before)


# -- both engines: the writing process is killed with SIGKILL ----------------------------------
def _doomed_child(url: str, conv: str, point: str, ready: Any, backend: Any) -> None:
    """Commit the turn, pause inside the transaction, tell the parent, and wait to be killed."""
    store = stepwise(url)

    def on_pause(dbapi_connection: Any) -> None:
        if store.engine.dialect.name == "postgresql":
            backend.value = dbapi_connection.info.backend_pid
        ready.set()
        time.sleep(TIMEOUT * 3)  # killed long before
        os._exit(3)

    add_pause(store.engine, point, on_pause)
    store.commit_turn(conv, the_turn(), RESULTS)
    os._exit(4)  # never reached: the pause does not return


@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_writer_process_killed_mid_transaction(
    store: ConversationStore, db_url: sa.URL, point: str
) -> None:
    conv = seed(store)
    before = dump(store.engine)
    store.engine.dispose()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    backend = ctx.Value("q", 0)
    url = db_url.render_as_string(hide_password=False)
    child = ctx.Process(target=_doomed_child, args=(url, conv, point, ready, backend))
    child.start()
    try:
        assert ready.wait(TIMEOUT * 2), f"the child never paused (exit code {child.exitcode})"
        if db_url.get_backend_name() == "sqlite":
            # the child holds the write lock: its rows are in the database file's WAL or cache
            probe = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
            try:
                with probe.connect() as conn:
                    conn.exec_driver_sql("PRAGMA busy_timeout=0")
                    with pytest.raises(sa.exc.OperationalError, match="locked"):
                        conn.exec_driver_sql("BEGIN IMMEDIATE")
            finally:
                probe.dispose()
        if db_url.get_backend_name() == "postgresql":
            assert backend.value
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(TIMEOUT)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == -signal.SIGKILL
    if db_url.get_backend_name() == "postgresql":
        # the server aborts the dead client's transaction when it sees the socket close
        waiter = sa.create_engine(db_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        try:
            deadline = time.monotonic() + TIMEOUT
            with waiter.connect() as conn:
                while conn.execute(
                    sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": backend.value},
                ).scalar_one():
                    assert time.monotonic() < deadline, "the dead client's transaction stayed"
                    time.sleep(0.02)
        finally:
            waiter.dispose()
    assert_recovered(store, conv, before)


# -- both engines: a writer killed under load, the others carry on ----------------------------
def _load_child(
    url: str, shared: str, private: str, proc: int, rounds: int | None, queue: Any
) -> None:
    code = 0
    try:
        queue.put(soak.worker(url, shared, private, proc, rounds=rounds))
    except BaseException as exc:
        queue.put(f"{type(exc).__name__}: {exc}")
        code = 1
    finally:
        queue.close()
        queue.join_thread()
        os._exit(code)


def test_writer_killed_under_load(store: ConversationStore, db_url: sa.URL) -> None:
    """Three writers run the soak's load while a fourth, on the same conversations, is killed
    with SIGKILL at a random moment: the three finish (no lock is left held), every turn they
    got acknowledged is stored once, the dead writer's turns are whole or absent, and the store
    checks clean."""
    shared = store.create_conversation("shared")
    store.append(shared, [{"role": "system", "content": "load"}])
    privates = [store.create_conversation(f"private-{p}") for p in range(4)]
    url = db_url.render_as_string(hide_password=False)
    store.engine.dispose()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    victim = ctx.Process(target=_load_child, args=(url, shared, privates[3], 3, None, queue))
    victim.start()
    survivors = [
        ctx.Process(target=_load_child, args=(url, shared, privates[p], p, 12, queue))
        for p in range(3)
    ]
    for process in survivors:
        process.start()
    time.sleep(random.uniform(0.3, 0.8))
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    victim.join(TIMEOUT)
    reports = [queue.get(timeout=60) for _ in survivors]
    for process in survivors:
        process.join(TIMEOUT)
    assert victim.exitcode == -signal.SIGKILL, "the victim finished before it was killed"
    assert all(isinstance(r, soak.Report) for r in reports), reports
    acked = {(c, rid): seq for r in reports for c, rid, seq in r.acked}
    assert len(acked) == 3 * 12 * 2
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT conversation_id, response_id, seq FROM fsm_messages WHERE role = 'assistant'"
            )
        ).all()
        if db_url.get_backend_name() == "sqlite":
            assert conn.exec_driver_sql("PRAGMA integrity_check").scalars().all() == ["ok"]
        for conv in [shared, *privates]:
            seqs = conn.execute(
                sa.text("SELECT seq FROM fsm_messages WHERE conversation_id = :c ORDER BY seq"),
                {"c": conv},
            ).scalars()
            assert list(seqs) == list(range(len(store.history(conv))))
    stored = collections.Counter((c, rid) for c, rid, _seq in rows)
    assert [k for k, n in stored.items() if n > 1] == []
    assert {(c, rid): seq for c, rid, seq in rows if (c, rid) in acked} == acked
    strangers = [k for k in stored if k not in acked]
    assert all("-p3-" in rid for _c, rid in strangers), strangers
    assert list(audit.check(store.engine)) == []
    # the dead writer's conversation takes new writes at once
    assert store.commit_turn(privates[3], make_turn(response_id="after"), ["ok"]).created


# -- PostgreSQL: the commit that is one query ---------------------------------------------------
def _terminate(url: sa.URL, pid: int) -> None:
    killer = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with killer.connect() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
            deadline = time.monotonic() + TIMEOUT
            while conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            ).scalar_one():
                assert time.monotonic() < deadline, "the backend did not go away"
                time.sleep(0.02)
    finally:
        killer.dispose()


@pytest.mark.parametrize(
    "engine_name", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_a_pooled_connection_the_server_closed_fails_before_anything_is_sent(
    store: ConversationStore, db_url: sa.URL
) -> None:
    """The commit's common case is one query that the server commits as it ends: a connection
    lost during it leaves the outcome unknown. A pooled connection whose backend the server
    ended while it was idle (a restart, a failover, an administrator) is seen before anything
    is sent (the socket has the server's notice): the transaction then begins with its own
    round trip, which fails first, so the error is the known one (nothing was written), and the
    next commit goes through."""
    conv = seed(store)
    before = dump(store.engine)
    with store.engine.connect() as conn:  # the pool's one idle connection
        pid = conn.connection.dbapi_connection.info.backend_pid
    _terminate(db_url, pid)
    with pytest.raises(StoreUnavailableError) as lost:
        store.commit_turn(conv, the_turn(), RESULTS)
    assert not isinstance(lost.value, CommitOutcomeUnknownError), repr(lost.value)
    assert "nothing was written" in str(lost.value)
    assert_recovered(store, conv, before)


@pytest.mark.parametrize(
    "engine_name", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_a_commit_terminated_while_its_query_waits_on_the_server(
    store: ConversationStore, db_url: sa.URL
) -> None:
    """The one query waits on the server for the conversation's lock (another session holds
    it); its backend is ended there: the client cannot know whether the server committed
    (CommitOutcomeUnknownError, retryable), nothing was written, and the retry lands once."""
    conv = seed(store)
    before = dump(store.engine)
    holder = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with holder.connect() as conn:
            conn.execute(
                sa.text("SELECT id FROM fsm_conversations WHERE id = :c FOR UPDATE"), {"c": conv}
            )
            thread, outcome = _committing(store, conv)
            watcher = sa.create_engine(
                db_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT"
            )
            try:
                with watcher.connect() as watch:
                    deadline = time.monotonic() + TIMEOUT
                    pid = None
                    while pid is None:
                        assert time.monotonic() < deadline, "the commit never waited"
                        pid = watch.execute(
                            sa.text(
                                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = "
                                "'Lock' AND query LIKE 'SET LOCAL enable_seqscan = off;%'"
                            )
                        ).scalar()
                        time.sleep(0.02)
            finally:
                watcher.dispose()
            _terminate(db_url, pid)
            thread.join(TIMEOUT)
            conn.rollback()
    finally:
        holder.dispose()
    error = outcome.get("error")
    assert isinstance(error, CommitOutcomeUnknownError), repr(outcome)
    assert error.retryable
    assert_recovered(store, conv, before)
