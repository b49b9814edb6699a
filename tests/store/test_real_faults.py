"""Real faults, no mocks: the database dies, the network black-holes or resets, the disk fills,
the file rots; every error is typed, no turn is lost or half written, and the store recovers.

* **PostgreSQL crash at every statement of a commit**: a private cluster of the test's own
  (:class:`~tests.helpers.faults.PrivatePostgres`) is killed with SIGKILL (postmaster and
  backends) from an engine event right before each statement of a ``commit_turn``, COMMIT
  included; while it is down calls fail with ``StoreUnavailableError``; it restarts (crash
  recovery); the same call retried with the same idempotency key lands exactly once.
* **Black hole** (:class:`~tests.helpers.faults.Proxy`): the route goes silent in the middle of
  a transaction, or with COMMIT in flight, or before the connection is made: the call raises
  within the deadline, the server frees the conversation's lock, a second writer goes through.
* **Reset**: every connection gets an RST mid-transaction or at COMMIT.
* **Disk full** (SQLite): a small tmpfs, or ``RLIMIT_FSIZE`` in a subprocess with SIGXFSZ
  ignored: ``StorageFullError``, every committed turn whole, writes work again once there is room.
* **Rotten file** (SQLite): 4 KiB of flipped bytes in a copy of a store: ``fsm audit check``
  reports ``corrupt`` (exit 7), reads that touch the damage raise ``DatabaseCorruptError``;
  (PostgreSQL): a page of an index file overwritten while the server is stopped: amcheck in
  ``fsm audit check`` reports it.
* **Unusable file** (SQLite): a file that is not a database, a read-only file or folder
  (``chattr +i`` as root, whom permission bits do not stop; ``chmod`` otherwise): a one-line
  typed error naming the path, in ``history``, ``audit`` and ``ingest``.

Each test adds a row to the results table (:data:`RESULTS`): fault, engine, faults injected,
errors by type, turns lost, half turns, untyped errors, seconds to recover or to raise. With
``FSM_FAULT_RESULTS=path`` the table is written there as Markdown when the module ends.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from fsm.store import ConversationStore, audit
from fsm.store.errors import (
    CommitOutcomeUnknownError,
    DatabaseCorruptError,
    StorageFullError,
    StoreError,
    StoreUnavailableError,
)
from fsm.store.migrate import upgrade
from tests.helpers import repo_env
from tests.helpers.faults import (
    PrivatePostgres,
    Proxy,
    flip_bytes,
    postgres_unavailable,
    small_disk,
)
from tests.helpers.store import make_turn, stepwise

CALLS = [("call_a", "add", '{"a": 2, "b": 3}'), ("call_b", "mul", '{"a": 4, "b": 5}')]
TOOL_RESULTS = ["5", "20"]
#: the deadline of the stores under a network fault (seconds)
DEADLINE = 2.0

#: real faults (a black-holed network, a full disk, a server of its own killed), timed against
#: deadlines: CI runs them in one process, alone (pytest -n 0 -m serial)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


# -- the results table ---------------------------------------------------------------------------
@dataclass
class Outcome:
    """One row of the results table."""

    fault: str
    engine: str
    injected: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    half: int = 0
    untyped: int = 0
    #: seconds from the fault to the typed error
    raised: list[float] = field(default_factory=list)
    #: seconds from the fault's end (restart, route back, room again) to the next success
    recovered: list[float] = field(default_factory=list)

    def error(self, exc: BaseException) -> None:
        self.errors[type(exc).__name__] += 1
        if not isinstance(exc, StoreError):
            self.untyped += 1

    def row(self) -> str:
        errors = ", ".join(f"{name} {n}" for name, n in sorted(self.errors.items())) or "none"
        raised = f"{max(self.raised):.2f}" if self.raised else "-"
        recovered = f"{max(self.recovered):.2f}" if self.recovered else "-"
        return (
            f"| {self.fault} | {self.engine} | {self.injected} | {errors} | {self.lost} | "
            f"{self.half} | {self.untyped} | {raised} | {recovered} |"
        )


RESULTS: list[Outcome] = []


@pytest.fixture(scope="module", autouse=True)
def _results_table() -> Iterator[None]:
    yield
    target = os.environ.get("FSM_FAULT_RESULTS")
    if target and RESULTS:
        lines = [
            "| fault | engine | faults injected | errors by type | turns lost | half turns | "
            "untyped errors | seconds to raise (worst) | seconds to recover (worst) |",
            "|---|---|---|---|---|---|---|---|---|",
            *(o.row() for o in RESULTS),
        ]
        Path(target).write_text("\n".join(lines) + "\n")


@pytest.fixture
def outcome() -> Callable[[str, str], Outcome]:
    """``outcome(fault, engine)``: a new row of the results table (a failing test's row is
    kept too: the table shows what happened)."""

    def make(fault: str, engine: str) -> Outcome:
        RESULTS.append(Outcome(fault, engine))
        return RESULTS[-1]

    return make


# -- what every fault test checks afterwards -----------------------------------------------------
def turns_by_key(engine: sa.Engine, conv: str) -> collections.Counter[str]:
    """How many assistant messages of ``conv`` each idempotency key / response id has."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT coalesce(idempotency_key, response_id) FROM fsm_messages "
                "WHERE role = 'assistant' AND conversation_id = :conv"
            ),
            {"conv": conv},
        ).scalars()
        return collections.Counter(str(r) for r in rows)


def half_turns(store: ConversationStore, conversations: list[str]) -> int:
    """Assistant messages with calls whose results are not all there (the audit's check also
    reports them; this counts them per turn for the table)."""
    half = 0
    for conv in conversations:
        history = store.history(conv)
        for i, message in enumerate(history):
            calls = message.get("tool_calls") or []
            if message["role"] == "assistant" and calls:
                ids = [m.get("tool_call_id") for m in history[i + 1 : i + 1 + len(calls)]]
                half += ids != [c["id"] for c in calls]
    return half


def assert_clean(engine: sa.Engine) -> None:
    violations = list(audit.check(engine))
    assert violations == [], violations


# -- the private PostgreSQL cluster --------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivatePostgres]:
    reason = postgres_unavailable()
    if reason is not None:
        if os.environ.get("FSM_REQUIRE_POSTGRES"):
            pytest.fail(f"FSM_REQUIRE_POSTGRES is set but {reason}")
        pytest.skip(reason)
    with PrivatePostgres() as pg:
        upgrade(pg.url)
        yield pg


@pytest.fixture
def pg(cluster: PrivatePostgres) -> Iterator[PrivatePostgres]:
    """The private cluster, running (a test that crashed it without restarting gets it back)."""
    if cluster.postmaster_pid() is None:
        cluster.start()
    yield cluster
    if cluster.postmaster_pid() is None:
        cluster.start()


def statements_of_a_commit(store: ConversationStore, conv: str) -> list[str]:
    """The statements one ``commit_turn`` of the test's turn sends, in order (``COMMIT`` last)."""
    seen: list[str] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(" ".join(statement.split())[:60])

    def at_commit(_conn: Any) -> None:
        seen.append("COMMIT")

    event.listen(store.engine, "before_cursor_execute", before)
    event.listen(store.engine, "commit", at_commit)
    try:
        store.commit_turn(conv, make_turn(CALLS, response_id="resp-count"), TOOL_RESULTS)
    finally:
        event.remove(store.engine, "before_cursor_execute", before)
        event.remove(store.engine, "commit", at_commit)
    return seen


@contextlib.contextmanager
def at_statement(engine: sa.Engine, n: int, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` right before the ``n``-th statement (1-based) of the next transactions
    on ``engine``, COMMIT counting as the statement after the last one (once)."""
    count = {"n": 0, "done": False}

    def step() -> None:
        count["n"] += 1
        if count["n"] == n and not count["done"]:
            count["done"] = True
            action()

    def before(*_args: Any) -> None:
        step()

    def at_commit(_conn: Any) -> None:
        step()

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "commit", at_commit)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "commit", at_commit)


def test_postgres_killed_at_every_statement_of_a_commit(
    pg: PrivatePostgres, outcome: Callable[[str, str], Outcome]
) -> None:
    result = outcome("server SIGKILL at each statement of a commit, restart", "postgresql")
    with stepwise(pg.url, timeout=10) as store:
        conv = store.create_conversation()
        store.append(conv, [{"role": "user", "content": "add and multiply"}])
        statements = statements_of_a_commit(store, conv)
        assert statements[-1] == "COMMIT" and len(statements) >= 4, statements
        for n, statement in enumerate(statements, start=1):
            key = f"turn-{n}"
            turn = make_turn(CALLS, response_id=key)
            with at_statement(store.engine, n, pg.crash):
                started = time.monotonic()
                with pytest.raises(StoreError) as failed:
                    store.commit_turn(conv, turn, TOOL_RESULTS)
            result.injected += 1
            result.error(failed.value)
            result.raised.append(time.monotonic() - started)
            if statement == "COMMIT":
                assert isinstance(failed.value, CommitOutcomeUnknownError), (n, failed.value)
            else:
                # a statement before COMMIT failed: nothing was written, and the error says so
                assert isinstance(failed.value, StoreUnavailableError), (n, failed.value)
                assert not isinstance(failed.value, CommitOutcomeUnknownError), (n, statement)
            assert failed.value.retryable
            # while the server is down: refused, typed, retryable, at once
            with pytest.raises(StoreUnavailableError) as down:
                store.commit_turn(conv, turn, TOOL_RESULTS)
            assert not isinstance(down.value, CommitOutcomeUnknownError)
            result.error(down.value)
            pg.start()
            restarted = time.monotonic()
            committed = None
            for _attempt in range(50):  # the pool's old connections fail once, typed
                try:
                    committed = store.commit_turn(conv, turn, TOOL_RESULTS)
                    break
                except StoreUnavailableError as exc:
                    result.error(exc)
                    time.sleep(0.05)
            assert committed is not None, pg.log()[-2000:]
            result.recovered.append(time.monotonic() - restarted)
            # the killed server had not committed it (COMMIT was never sent): written now, once
            assert committed.created, (n, statement)
            again = store.commit_turn(conv, turn, TOOL_RESULTS)
            assert not again.created and again.seq == committed.seq
        counts = turns_by_key(store.engine, conv)
        keys = [f"turn-{n}" for n in range(1, len(statements) + 1)]
        result.lost = sum(1 for k in keys if counts[k] == 0)
        assert result.lost == 0 and all(counts[k] == 1 for k in keys), counts
        result.half = half_turns(store, [conv])
        assert result.half == 0
        assert_clean(store.engine)
    assert result.untyped == 0


# -- the network: a proxy that black-holes and resets --------------------------------------------
@pytest.fixture
def proxy(pg: PrivatePostgres) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", pg.port) as opened:
        yield opened


def backends_in_transaction(url: str) -> int:
    """Sessions of other clients that are inside a transaction on the server."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                        "AND state LIKE 'idle in transaction%'"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize("where", ["mid-transaction", "at COMMIT"])
def test_black_hole_raises_within_the_deadline_and_frees_the_lock(
    pg: PrivatePostgres, proxy: Proxy, where: str, outcome: Callable[[str, str], Outcome]
) -> None:
    result = outcome(f"network black hole {where}", "postgresql")
    with (
        stepwise(proxy.url(pg.url), timeout=DEADLINE) as victim,
        ConversationStore(pg.url, timeout=10) as other,
    ):
        conv = victim.create_conversation()
        victim.append(conv, [{"role": "user", "content": "go"}])
        statements = statements_of_a_commit(victim, conv)
        # mid-transaction: after the conversation's lock is taken (the first INSERT)
        n = (
            len(statements)
            if where == "at COMMIT"
            else next(i for i, s in enumerate(statements, 1) if s.startswith(("INSERT", "WITH")))
        )
        turn = make_turn(CALLS, response_id=f"hole-{where}")
        with at_statement(victim.engine, n, proxy.blackhole):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as failed:
                victim.commit_turn(conv, turn, TOOL_RESULTS)
        raised = time.monotonic() - started
        result.injected += 1
        result.error(failed.value)
        result.raised.append(raised)
        assert raised < DEADLINE + 1.5, raised
        assert isinstance(failed.value, CommitOutcomeUnknownError) == (where == "at COMMIT")
        # a second writer of the same conversation is not stuck behind the lost session: the
        # server ends it (idle_in_transaction_session_timeout) and frees its lock
        started = time.monotonic()
        written = other.commit_turn(conv, make_turn(CALLS, response_id="second-writer"), ["1", "2"])
        waited = time.monotonic() - started
        assert written.created and waited < DEADLINE + 3, waited
        assert backends_in_transaction(pg.url) == 0
        # the route comes back: the same call, same key, lands exactly once
        proxy.forward()
        started = time.monotonic()
        retried = victim.commit_turn(conv, turn, TOOL_RESULTS)
        result.recovered.append(time.monotonic() - started)
        assert retried.created and retried.seq == written.next_seq
        assert not victim.commit_turn(conv, turn, TOOL_RESULTS).created
        counts = turns_by_key(other.engine, conv)
        assert counts[f"hole-{where}"] == 1 and counts["second-writer"] == 1
        result.half = half_turns(other, [conv])
        assert result.half == 0
        assert_clean(other.engine)
    assert result.untyped == 0


@pytest.mark.parametrize("where", ["mid-transaction", "at COMMIT", "the one query"])
def test_async_store_black_hole_and_crash(
    pg: PrivatePostgres, proxy: Proxy, where: str, outcome: Callable[[str, str], Outcome]
) -> None:
    """The asyncio store under the same faults: a black hole raises within the deadline (the
    event loop is never blocked: a ticker runs meanwhile), a server crash raises at once; both
    typed, and the retry with the same key lands once. Mid-transaction and at COMMIT on
    engines whose commits go statement by statement (``one_query=False``); "the one query": a
    default engine's commit, one query the server commits as it ends (its outcome is unknown
    once sent, as at COMMIT)."""
    import asyncio

    from fsm.store.aio import AsyncConversationStore
    from fsm.store.engine import create_async_engine
    from fsm.store.engine_config import at_once_engines

    result = outcome(f"async store: black hole, then server SIGKILL, {where}", "postgresql")
    one_query = where == "the one query"

    async def scenario() -> None:
        victim_engine = create_async_engine(
            proxy.url(pg.url), timeout=DEADLINE, one_query=one_query
        )
        direct_engine = create_async_engine(pg.url, timeout=10, one_query=one_query)
        if one_query and victim_engine.sync_engine not in at_once_engines:
            pytest.skip("this psycopg sends no one query from asyncio (before 3.1.9)")
        async with (
            AsyncConversationStore(engine=victim_engine, timeout=DEADLINE) as victim,
            AsyncConversationStore(engine=direct_engine, timeout=10) as direct,
            contextlib.AsyncExitStack() as engines,
        ):
            engines.push_async_callback(victim_engine.dispose)
            engines.push_async_callback(direct_engine.dispose)
            conv = await victim.create_conversation()
            with stepwise(pg.url, timeout=10) as sync_store:  # the async store's statements
                statements = statements_of_a_commit(sync_store, conv)
            n = {"at COMMIT": len(statements), "mid-transaction": 3, "the one query": 1}[where]
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.1)
                    ticks += 1

            ticking = asyncio.create_task(ticker())
            turn = make_turn(CALLS, response_id=f"async-hole-{where}")
            with at_statement(victim.engine.sync_engine, n, proxy.blackhole):
                started = time.monotonic()
                with pytest.raises(StoreUnavailableError) as failed:
                    await victim.commit_turn(conv, turn, TOOL_RESULTS)
            raised = time.monotonic() - started
            ticking.cancel()
            result.injected += 1
            result.error(failed.value)
            result.raised.append(raised)
            assert raised < DEADLINE + 1.5 and ticks >= 10, (raised, ticks)
            assert isinstance(failed.value, CommitOutcomeUnknownError) == (
                where != "mid-transaction"
            )
            proxy.forward()
            # the server crashes at the same point of the retry
            crash_turn = make_turn(CALLS, response_id=f"async-crash-{where}")
            with (
                at_statement(direct.engine.sync_engine, n, pg.crash),
                pytest.raises(StoreUnavailableError) as crashed,
            ):
                await direct.commit_turn(conv, crash_turn, TOOL_RESULTS)
            result.injected += 1
            result.error(crashed.value)
            assert isinstance(crashed.value, CommitOutcomeUnknownError) == (
                where != "mid-transaction"
            )
            pg.start()
            restarted = time.monotonic()
            for retry in (turn, crash_turn):
                for _attempt in range(50):
                    try:
                        assert (await direct.commit_turn(conv, retry, TOOL_RESULTS)).created
                        break
                    except StoreUnavailableError as exc:
                        result.error(exc)
                        await asyncio.sleep(0.05)
                else:
                    pytest.fail("the async store did not recover")
                assert not (await direct.commit_turn(conv, retry, TOOL_RESULTS)).created
            result.recovered.append(time.monotonic() - restarted)

    asyncio.run(scenario())
    with ConversationStore(pg.url) as store:
        conv_ids = [
            str(c)
            for c in store.engine.connect()
            .execute(
                sa.text("SELECT conversation_id FROM fsm_messages WHERE response_id = :r"),
                {"r": f"async-hole-{where}"},
            )
            .scalars()
        ]
        assert len(conv_ids) == 1
        counts = turns_by_key(store.engine, conv_ids[0])
        assert counts[f"async-hole-{where}"] == 1 and counts[f"async-crash-{where}"] == 1
        result.half = half_turns(store, conv_ids)
        assert result.half == 0
        assert_clean(store.engine)
    assert result.untyped == 0


@pytest.mark.parametrize("shape", ["one query", "statement by statement"])
def test_commit_stored_but_its_answer_lost(
    pg: PrivatePostgres, proxy: Proxy, shape: str, outcome: Callable[[str, str], Outcome]
) -> None:
    """The other side of an unknown outcome: COMMIT (or the one query of a commit, which the
    server commits as it ends) reaches the server and is committed, its answer is lost
    (replies black-holed). The client cannot tell this from one that never arrived:
    CommitOutcomeUnknownError; the retry with the same key finds the stored turn and writes
    nothing (``created=False``): exactly one turn."""
    result = outcome(f"answer to COMMIT lost (COMMIT stored), {shape}", "postgresql")
    victim = (
        ConversationStore(proxy.url(pg.url), timeout=DEADLINE)
        if shape == "one query"
        else stepwise(proxy.url(pg.url), timeout=DEADLINE)
    )
    with victim as store, ConversationStore(pg.url, timeout=10) as direct:
        conv = store.create_conversation()
        statements = statements_of_a_commit(store, conv)
        if shape == "one query":
            assert (
                statements[0].startswith("SET LOCAL enable_seqscan = off; ")
                and len(statements) == 2
            )
        n = 1 if shape == "one query" else len(statements)
        turn = make_turn(CALLS, response_id="answer-lost")
        with at_statement(store.engine, n, proxy.blackhole_replies):
            started = time.monotonic()
            with pytest.raises(CommitOutcomeUnknownError) as failed:
                store.commit_turn(conv, turn, TOOL_RESULTS)
        result.injected += 1
        result.error(failed.value)
        result.raised.append(time.monotonic() - started)
        assert turns_by_key(direct.engine, conv)["answer-lost"] == 1  # it was committed
        proxy.forward()
        started = time.monotonic()
        retried = store.commit_turn(conv, turn, TOOL_RESULTS)
        result.recovered.append(time.monotonic() - started)
        assert not retried.created  # the stored copy, not a second turn
        counts = turns_by_key(direct.engine, conv)
        result.lost = int(counts["answer-lost"] == 0)
        assert counts["answer-lost"] == 1
        result.half = half_turns(direct, [conv])
        assert result.half == 0
        assert_clean(direct.engine)
    assert result.untyped == 0


def test_black_hole_before_connecting_raises_within_the_connect_timeout(
    pg: PrivatePostgres, proxy: Proxy, outcome: Callable[[str, str], Outcome]
) -> None:
    result = outcome("network black hole before connect", "postgresql")
    with ConversationStore(proxy.url(pg.url), timeout=DEADLINE) as store:
        conv = store.create_conversation()
        store.engine.dispose()  # the next call connects anew
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as failed:
            store.commit_turn(conv, make_turn(CALLS, response_id="never"), TOOL_RESULTS)
        raised = time.monotonic() - started
        result.injected += 1
        result.error(failed.value)
        result.raised.append(raised)
        assert not isinstance(failed.value, CommitOutcomeUnknownError)
        assert raised < DEADLINE + 1.5, raised
        proxy.forward()
        started = time.monotonic()
        assert store.commit_turn(conv, make_turn(CALLS, response_id="never"), TOOL_RESULTS).created
        result.recovered.append(time.monotonic() - started)
    assert result.untyped == 0


@pytest.mark.parametrize("where", ["mid-transaction", "at COMMIT"])
def test_reset_connection(
    pg: PrivatePostgres, proxy: Proxy, where: str, outcome: Callable[[str, str], Outcome]
) -> None:
    result = outcome(f"connection reset (RST) {where}", "postgresql")
    with stepwise(proxy.url(pg.url), timeout=DEADLINE) as store:
        conv = store.create_conversation()
        statements = statements_of_a_commit(store, conv)
        n = len(statements) if where == "at COMMIT" else 2
        turn = make_turn(CALLS, response_id=f"reset-{where}")
        with at_statement(store.engine, n, proxy.reset):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as failed:
                store.commit_turn(conv, turn, TOOL_RESULTS)
        result.injected += 1
        result.error(failed.value)
        result.raised.append(time.monotonic() - started)
        assert time.monotonic() - started < 1.0
        assert isinstance(failed.value, CommitOutcomeUnknownError) == (where == "at COMMIT")
        started = time.monotonic()
        retried = store.commit_turn(conv, turn, TOOL_RESULTS)
        result.recovered.append(time.monotonic() - started)
        assert retried.created
        assert turns_by_key(store.engine, conv)[f"reset-{where}"] == 1
        assert_clean(store.engine)
    assert result.untyped == 0


# -- SQLite: the disk fills ----------------------------------------------------------------------
def fill(url: str, prefix: str) -> tuple[list[str], str, str]:
    """Commit turns (each with its own conversation) until the store is full; the acknowledged
    turns' conversations, the error's type name and message."""
    store = ConversationStore(url)
    acked: list[str] = []
    try:
        for i in range(100_000):
            try:
                conv = store.create_conversation(f"{prefix}-{i}")
                store.append(conv, [{"role": "user", "content": "x" * 2000}])
                store.commit_turn(
                    conv,
                    make_turn(CALLS, response_id=f"{prefix}-{i}", content="y" * 2000),
                    TOOL_RESULTS,
                )
                acked.append(conv)
            except Exception as exc:
                return acked, type(exc).__name__, str(exc)
        return acked, "", "never full"
    finally:
        store.close()


def _rlimit_child(url: str, limit: int, queue: Any) -> None:
    """In a subprocess: cap the file size at ``limit``, fill, lift the cap, write again."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    acked, error, message = fill(url, "rl")
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    started = time.monotonic()
    after = fill_one(url, "rl-after")
    queue.put((acked, error, message, after, time.monotonic() - started))


def fill_one(url: str, conv: str) -> str:
    with ConversationStore(url) as store:
        store.create_conversation(conv)
        store.commit_turn(conv, make_turn(CALLS, response_id=conv), TOOL_RESULTS)
    return conv


def check_full_store(url: str, acked: list[str], error: str, message: str, result: Outcome) -> None:
    assert error == StorageFullError.__name__, (error, message)
    assert acked, "the disk was full before the first turn"
    with ConversationStore(url) as store:
        for conv in acked:
            history = store.history(conv)
            assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool"], conv
        result.lost = len(acked) - sum(1 for c in acked if len(store.history(c)) == 2 + len(CALLS))
        convs = [
            str(c)
            for c in store.engine.connect()
            .execute(sa.text("SELECT id FROM fsm_conversations"))
            .scalars()
        ]
        result.half = half_turns(store, convs)
        assert result.lost == 0 and result.half == 0
        assert_clean(store.engine)
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_sqlite_disk_full_rlimit(tmp_path: Path, outcome: Callable[[str, str], Outcome]) -> None:
    result = outcome("disk full (RLIMIT_FSIZE), then room again", "sqlite")
    url = f"sqlite:///{tmp_path / 'full.db'}"
    upgrade(url)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_rlimit_child, args=(url, 256 * 1024, queue))
    child.start()
    acked, error, message, after, recovered = queue.get(timeout=120)
    child.join(30)
    result.injected += 1
    result.errors[error] += 1
    result.untyped += error != StorageFullError.__name__
    result.recovered.append(recovered)
    check_full_store(url, acked, error, message, result)
    with ConversationStore(url) as store:
        assert len(store.history(after)) == 1 + len(CALLS)
    assert result.untyped == 0


def test_sqlite_disk_full_tmpfs(outcome: Callable[[str, str], Outcome]) -> None:
    # 576 KiB: the schema at head (with the tool ledger of revision 0005) and the ballast leave
    # room for the first turns
    with small_disk(576) as disk:
        if disk is None:
            pytest.skip("mounting a tmpfs is not allowed here (the RLIMIT_FSIZE test covers it)")
        result = outcome("disk full (tmpfs), then room again", "sqlite")
        ballast = disk / "ballast"
        url = f"sqlite:///{disk / 'full.db'}"
        upgrade(url)
        ballast.write_bytes(b"\0" * 200 * 1024)
        acked, error, message = fill(url, "fs")
        result.injected += 1
        result.errors[error] += 1
        result.untyped += error != StorageFullError.__name__
        check_full_store(url, acked, error, message, result)
        ballast.unlink()  # room again
        started = time.monotonic()
        after = fill_one(url, "fs-after")
        result.recovered.append(time.monotonic() - started)
        with ConversationStore(url) as store:
            assert len(store.history(after)) == 1 + len(CALLS)
        assert result.untyped == 0


# -- SQLite: the file rots -----------------------------------------------------------------------
def fsm_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``fsm`` command in a child process of this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=repo_env(),
        check=False,
    )


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of 60 conversations, checkpointed into its main file."""
    path = tmp_path_factory.mktemp("rot") / "healthy.db"
    with ConversationStore(f"sqlite:///{path}", auto_upgrade=True) as store:
        for i in range(60):
            conv = store.create_conversation(f"c{i:02d}")
            store.append(conv, [{"role": "user", "content": "x" * 300}])
            store.commit_turn(conv, make_turn(CALLS, response_id=f"r{i}"), TOOL_RESULTS)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def rotten_copy(healthy: Path, tmp_path: Path, table: str) -> tuple[Path, int]:
    """A copy of ``healthy`` with the 4 KiB root page of ``table`` flipped; its page number."""
    with sqlite3.connect(healthy) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)
        ).fetchone()[0]
    copy = tmp_path / "rotten.db"
    shutil.copyfile(healthy, copy)
    flip_bytes(copy, (root - 1) * page_size, 4096)
    return copy, root


def test_rotten_file_is_found_by_the_check_and_the_reads(
    healthy: Path, tmp_path: Path, outcome: Callable[[str, str], Outcome]
) -> None:
    result = outcome("4 KiB flipped in a table's root page", "sqlite")
    assert fsm_cli("audit", "check", "--db", f"sqlite:///{healthy}").returncode == 0
    copy, root = rotten_copy(healthy, tmp_path, "fsm_messages")
    result.injected += 1
    url = f"sqlite:///{copy}"
    started = time.monotonic()
    checked = fsm_cli("audit", "check", "--nl", "--db", url)
    result.raised.append(time.monotonic() - started)
    assert checked.returncode == 7, checked
    found = [json.loads(line) for line in checked.stdout.splitlines()]
    assert found and {v["kind"] for v in found} == {"corrupt"}, found
    details = " ".join(v["detail"] for v in found)
    assert f"Page {root}" in details or "malformed" in details, details
    result.errors["corrupt violation"] += 1
    deep = fsm_cli("audit", "check", "--deep", "--db", url)
    assert deep.returncode == 7, deep
    for command in (["history", "--db", url, "c07"], ["audit", "calls", "--db", url]):
        done = fsm_cli(*command)
        assert done.returncode == 7, (command, done)
        assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr, done.stderr
        assert "corrupt" in done.stderr, done.stderr
        result.errors["DatabaseCorruptError"] += 1
    with (
        ConversationStore(url) as store,
        pytest.raises(DatabaseCorruptError),
    ):
        store.history("c07")


def test_a_page_that_rots_midway_through_a_read_is_typed(tmp_path: Path) -> None:
    """history() fetches the driver's rows itself; SQLite steps the statement while fetching,
    so a damaged page met after the first row raises there: still DatabaseCorruptError, not
    the driver's sqlite3.DatabaseError."""
    path = tmp_path / "long.db"
    with ConversationStore(f"sqlite:///{path}", auto_upgrade=True) as store:
        conv = store.create_conversation("long")
        store.append(conv, [{"role": "user", "content": f"{i} " + "x" * 300} for i in range(600)])
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        leaves = [
            page
            for (page,) in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = 'fsm_messages' AND pagetype = 'leaf' "
                "ORDER BY pageno"
            )
        ]
    assert len(leaves) > 10, leaves
    # a leaf near the end of the history: the first rows read fine, then the damage
    flip_bytes(path, (leaves[-3] - 1) * page_size + 8, page_size - 8)
    with ConversationStore(f"sqlite:///{path}") as store:
        with pytest.raises(DatabaseCorruptError):
            store.history("long")
        assert len(store.history("long", last=2)) == 2  # the rows before the damage read on


def test_the_check_sees_a_damaged_index(healthy: Path, tmp_path: Path) -> None:
    """Damage only an index (the rows are intact): quick_check and integrity_check see it."""
    with sqlite3.connect(healthy) as conn:
        index = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'fsm_messages' "
            "ORDER BY name LIMIT 1"
        ).fetchone()[0]
    copy, _root = rotten_copy(healthy, tmp_path, index)
    for flags in ([], ["--deep"]):
        done = fsm_cli("audit", "check", *flags, "--db", f"sqlite:///{copy}")
        assert done.returncode == 7, (flags, done)
        assert "corrupt" in done.stdout


# -- SQLite: a file that is not a database, a read-only file or folder ---------------------------
def ingest_args(url: str, stream: Path) -> list[str]:
    return [
        "ingest",
        "--db",
        url,
        "--conversation",
        "c1",
        str(stream),
        "--results",
        str(stream.with_suffix(".json")),
    ]


def write_stream(folder: Path) -> Path:
    from tests.helpers import chunk, entry, sse

    stream = folder / "turn.sse"
    stream.write_bytes(
        sse(
            chunk(entry(0, "call_a", "add", '{"a": 1}')),
            chunk(finish="tool_calls"),
        )
    )
    stream.with_suffix(".json").write_text('["1"]')
    return stream


def assert_file_error(done: subprocess.CompletedProcess[str], path: Path, what: str) -> None:
    assert done.returncode not in (0, 1, 70), done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert str(path) in lines[0] and what in lines[0], lines[0]


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"this is a text file, not a database\n" * 200)
    url = f"sqlite:///{path}"
    stream = write_stream(tmp_path)
    for command in (
        ["history", "--db", url, "c1"],
        ["audit", "calls", "--db", url],
        ingest_args(url, stream),
    ):
        assert_file_error(fsm_cli(*command), path, "not a SQLite database")
    assert_file_error(fsm_cli("audit", "check", "--db", url), path, "not a SQLite database")
    assert path.read_bytes().startswith(b"this is a text file")  # never overwritten


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` (a file or a folder) made read-only for real: ``chattr +i`` when the test runs
    as root (root ignores permission bits; an immutable inode refuses even root), else
    ``chmod a-w``."""
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        if chattr is None:
            pytest.skip("running as root without chattr: permission bits do not bind root")
        done = subprocess.run([chattr, "+i", str(path)], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not allowed here: {done.stderr.decode().strip()}")
        try:
            yield
        finally:
            subprocess.run([chattr, "-i", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(mode & ~0o222)
        try:
            yield
        finally:
            path.chmod(mode)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_file_or_folder(tmp_path: Path, healthy: Path, what: str) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    path = folder / "chat.db"
    shutil.copyfile(healthy, path)
    before = path.read_bytes()
    stream = write_stream(tmp_path)
    url = f"sqlite:///{path}"
    with read_only(path if what == "file" else folder):
        done = fsm_cli(*ingest_args(url, stream))
        assert_file_error(done, path, "read-only" if what == "file" else "")
        # reading still works where SQLite can read (a read-only file in a writable folder)
        if what == "file":
            shown = fsm_cli("history", "--db", url, "c07")
            assert shown.returncode == 0 or "read-only" in shown.stderr, shown
    assert path.read_bytes() == before


# -- PostgreSQL: amcheck in the check ------------------------------------------------------------
def test_postgres_check_says_when_amcheck_is_missing(pg: PrivatePostgres) -> None:
    engine = sa.create_engine(pg.url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("DROP EXTENSION IF EXISTS amcheck")
        done = fsm_cli("audit", "check", "--db", pg.url)
        assert done.returncode == 0, done
        assert "amcheck extension is not installed" in done.stderr, done.stderr
    finally:
        engine.dispose()


@pytest.mark.slow
def test_postgres_check_finds_a_damaged_index_with_amcheck(
    pg: PrivatePostgres, outcome: Callable[[str, str], Outcome]
) -> None:
    """A database of its own, filled, amcheck installed: clean; then the server is stopped, a
    page of an fsm index is overwritten on disk, the server started: the check reports it."""
    result = outcome("4 KiB flipped in an index file", "postgresql")
    admin = sa.create_engine(pg.url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    url = pg.url.rsplit("/", 1)[0] + "/rot"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql("DROP DATABASE IF EXISTS rot")
            conn.exec_driver_sql("CREATE DATABASE rot")
        upgrade(url)
        with ConversationStore(url) as store:
            for i in range(300):
                conv = store.create_conversation(f"c{i:03d}")
                store.commit_turn(conv, make_turn(CALLS, response_id=f"r{i}"), TOOL_RESULTS)
        rot = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        try:
            with rot.connect() as conn:
                conn.exec_driver_sql("CREATE EXTENSION amcheck")
                index, file, blocks = conn.execute(
                    sa.text(
                        "SELECT c.relname, pg_relation_filepath(c.oid), "
                        "pg_relation_size(c.oid) / current_setting('block_size')::int "
                        "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                        "WHERE i.indrelid = 'fsm_messages'::regclass AND i.indisprimary"
                    )
                ).one()
        finally:
            rot.dispose()
        assert blocks >= 2
        for flags in ([], ["--deep"]):
            done = fsm_cli("audit", "check", *flags, "--db", url)
            assert done.returncode == 0 and "amcheck" not in done.stderr, done
        pg.stop()
        flip_bytes(pg.data / file, 8192 + 64, 4096)  # block 1 (block 0 is the metapage)
        pg.start()
        result.injected += 1
        started = time.monotonic()
        done = fsm_cli("audit", "check", "--nl", "--db", url)
        result.raised.append(time.monotonic() - started)
        assert done.returncode == 7, done
        found = [json.loads(line) for line in done.stdout.splitlines()]
        assert [v["kind"] for v in found] == ["corrupt"], found
        assert index in found[0]["detail"], found
        result.errors["corrupt violation"] += 1
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql("DROP DATABASE IF EXISTS rot WITH (FORCE)")
        admin.dispose()
