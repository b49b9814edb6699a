"""AsyncConversationStore: the sync store's behaviour, awaited, on SQLite (aiosqlite) and
PostgreSQL (psycopg async): commits, idempotent retries, conflicts, attempts, the corpus
round-trip, deletion, and several tasks committing to one conversation at once."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from fsm.api import parse_file
from fsm.errors import IncompleteTurnError
from fsm.store import (
    ConflictError,
    ConversationExistsError,
    ConversationNotFoundError,
    ConversationStore,
    IdempotencyMismatchError,
    InvalidMessageError,
    ResultsError,
    SchemaNotAtHeadError,
    StoreBusyError,
)
from fsm.store.aio import AsyncConversationStore, async_url, sync_url
from fsm.store.migrate import upgrade
from tests.helpers import CORPUS, corpus_expected, require_corpus
from tests.helpers.store import assert_blocks_whole, assert_openai_accepts, make_turn

T = TypeVar("T")

TWO_CALLS = [("call_a", "add", '{"a": 2, "b": 3}'), ("call_m", "multiply", '{"a": 2, "b": 3}')]
USER = {"role": "user", "content": "What is 2+3 and 2*3?"}


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test body on a fresh event loop, bounded in time."""

    async def bounded() -> T:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


@pytest.fixture
def url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


@pytest.fixture
def sync_store(db_url: sa.URL) -> Iterator[ConversationStore]:
    """The sync store on the same database: what the async store wrote, read the other way."""
    with ConversationStore(db_url) as opened:
        yield opened


def test_urls() -> None:
    assert async_url("sqlite:///a.db").drivername == "sqlite+aiosqlite"
    assert sync_url("sqlite+aiosqlite:///a.db").drivername == "sqlite"
    assert async_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert sync_url("postgresql+psycopg_async://u@h/d").drivername == "postgresql+psycopg"


def test_commit_turn_and_history(url: str, sync_store: ConversationStore) -> None:
    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation("conv-1")
            assert await store.append(conv, [USER]) == 1
            turn = make_turn(TWO_CALLS, content="Let me compute.")
            committed = await store.commit_turn(
                conv, turn, ["5", {"content": "6", "tool_call_id": "call_m"}]
            )
            assert committed.created and committed.seq == 1 and committed.next_seq == 4
            history = await store.history(conv)
            assert history == [USER, *committed.messages]
            assert history[1] == turn.to_message()
            assert await store.next_seq(conv) == 4
            # 2 would split the block: the whole block instead (issue 12)
            assert await store.history(conv, last=2) == committed.messages
            assert await store.history(conv, last=3) == committed.messages
            final = make_turn([], content="5 and 6.", finish_reason="stop", response_id="r2")
            await store.commit_turn(conv, final)
            assert_blocks_whole(await store.history(conv))
            assert_openai_accepts(await store.history(conv))

    run(body())
    # the sync store reads exactly what the async one wrote
    history = sync_store.history("conv-1")
    assert len(history) == 5 and history[2:4] == [
        {"role": "tool", "tool_call_id": "call_a", "content": "5"},
        {"role": "tool", "tool_call_id": "call_m", "content": "6"},
    ]


def test_idempotent_retry(url: str) -> None:
    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation()
            await store.append(conv, [USER])
            turn = make_turn(TWO_CALLS)
            first = await store.commit_turn(conv, turn, ["5", "6"])
            again = await store.commit_turn(conv, turn, ["other", "results"], expected_seq=1)
            assert first.created and not again.created
            assert again.messages == first.messages  # the stored results win
            assert len(await store.history(conv)) == 4
            keyed = make_turn([("c", "f", "{}")], response_id=None)
            await store.commit_turn(conv, keyed, ["x"], idempotency_key="k1")
            assert not (await store.commit_turn(conv, keyed, ["x"], idempotency_key="k1")).created
            other = make_turn([("d", "g", "{}")], response_id=None)
            with pytest.raises(IdempotencyMismatchError):
                await store.commit_turn(conv, other, ["y"], idempotency_key="k1")
            assert len(await store.history(conv)) == 6

    run(body())


def test_stale_expected_seq_is_a_conflict(url: str, sync_store: ConversationStore) -> None:
    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation("c")
            seq = await store.next_seq(conv)
            sync_store.append(conv, [USER])  # another writer goes first
            with pytest.raises(ConflictError) as caught:
                await store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"], expected_seq=seq)
            assert caught.value.retryable
            assert (caught.value.expected_seq, caught.value.actual_seq) == (0, 1)
            with pytest.raises(ConflictError):
                await store.append(conv, [USER], expected_seq=0)
            assert await store.history(conv) == [USER]
            await store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"], expected_seq=1)
            assert len(await store.history(conv)) == 4

    run(body())


def test_incomplete_turn_becomes_an_attempt(url: str) -> None:
    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation()
            await store.append(conv, [USER])
            cut = make_turn(TWO_CALLS, finish_reason="length")
            with pytest.raises(IncompleteTurnError):
                await store.commit_turn(conv, cut, ["5", "6"])
            with pytest.raises(ResultsError):
                await store.commit_turn(conv, make_turn(TWO_CALLS), ["5"])
            with pytest.raises(InvalidMessageError):
                await store.append(conv, [{"role": "tool", "content": "x", "tool_call_id": "a"}])
            (attempt_id,) = await store.record_attempt(conv, cut)
            (attempt,) = await store.attempts(conv)
            assert attempt["id"] == attempt_id and attempt["at_seq"] == 1
            assert attempt["finish_reason"] == "length" and not attempt["complete"]
            assert [(c["name"], c["state"], c["reason"]) for c in attempt["tool_calls"]] == [
                ("add", "truncated", "length"),
                ("multiply", "truncated", "length"),
            ]
            assert await store.history(conv) == [USER]

    run(body())


def test_conversation_lifecycle(url: str, sync_store: ConversationStore) -> None:
    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation("life", metadata={"user": "u1"})
            with pytest.raises(ConversationExistsError):
                await store.create_conversation("life")
            assert await store.create_conversation("life", exist_ok=True) == "life"
            await store.append(conv, [USER])
            await store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"])
            await store.record_attempt(conv, make_turn(TWO_CALLS, finish_reason="length"))
            assert await store.delete_conversation(conv)
            assert not await store.delete_conversation(conv)
            for read in (store.history, store.attempts, store.next_seq):
                with pytest.raises(ConversationNotFoundError):
                    await read(conv)
            with pytest.raises(ConversationNotFoundError):
                await store.append(conv, [USER])

    run(body())
    with sync_store.engine.connect() as conn:
        for table in (
            "fsm_conversations",
            "fsm_messages",
            "fsm_tool_calls",
            "fsm_attempts",
            "fsm_attempt_calls",
        ):
            assert conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar() == 0


def test_history_round_trips_every_complete_corpus_turn(url: str) -> None:
    require_corpus()
    expected = corpus_expected()

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation("corpus")
            written: list[dict[str, Any]] = []
            committed = attempted = 0
            for name in sorted(expected):
                result = parse_file(CORPUS / name)
                question = {"role": "user", "content": f"replay {name}"}
                await store.append(conv, [question])
                written.append(question)
                for turn in result.turns:
                    results = [f"{c.name} #{p}" for p, c in enumerate(turn.tool_calls)]
                    if not turn.complete:
                        await store.record_attempt(conv, turn)
                        attempted += 1
                        continue
                    stored = await store.commit_turn(conv, turn, results)
                    assert stored.messages[0] == turn.to_message(), name
                    written.extend(stored.messages)
                    committed += 1
            assert committed >= 40 and attempted >= 1
            history = await store.history(conv)
            assert history == written
            assert len(await store.attempts(conv)) == attempted
            assert_blocks_whole(history)

    run(body())


def test_a_database_not_at_head_is_an_error(empty_url: sa.URL) -> None:
    if empty_url.get_backend_name() == "sqlite":
        upgrade(empty_url, "0002")  # a new or empty SQLite file gets the schema by itself

    async def body() -> None:
        store = AsyncConversationStore(empty_url)
        try:
            with pytest.raises(SchemaNotAtHeadError, match="fsm db upgrade"):
                await store.create_conversation()
        finally:
            await store.close()
        async with AsyncConversationStore(empty_url, auto_upgrade=True) as upgraded:
            conv = await upgraded.create_conversation()
            assert await upgraded.history(conv) == []

    run(body())


# -- concurrency ---------------------------------------------------------------------------------
TASKS = 6
TURNS = 5


async def _writer(
    store: AsyncConversationStore, conv: str, task: int, optimistic: bool, start: asyncio.Event
) -> int:
    conflicts = 0
    await start.wait()
    for i in range(TURNS):
        calls = [(f"p{task}t{i}c{k}", f"tool{k}", f'{{"p": {task}, "t": {i}}}') for k in range(2)]
        turn = make_turn(calls, response_id=f"p{task}-t{i}")
        results = [f"p{task}t{i}r{k}" for k in range(2)]
        if optimistic:
            while True:
                seq = await store.next_seq(conv)
                try:
                    await store.commit_turn(conv, turn, results, expected_seq=seq)
                    break
                except ConflictError:
                    conflicts += 1
                    await asyncio.sleep(0)
        else:
            await store.commit_turn(conv, turn, results)
        # a retry after a lost acknowledgement: must write nothing
        assert not (await store.commit_turn(conv, turn, results)).created
        await store.append(conv, [{"role": "user", "content": f"p{task} after t{i}"}])
    return conflicts


@pytest.mark.parametrize("optimistic", [False, True], ids=["locking", "expected_seq"])
def test_concurrent_tasks(url: str, sync_store: ConversationStore, optimistic: bool) -> None:
    async def body() -> list[int]:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation("shared")
            start = asyncio.Event()
            tasks = [
                asyncio.create_task(_writer(store, conv, t, optimistic, start))
                for t in range(TASKS)
            ]
            await asyncio.sleep(0)
            start.set()
            return await asyncio.gather(*tasks)

    conflicts = run(body())
    assert len(conflicts) == TASKS
    if optimistic:
        assert sum(conflicts) > 0  # the tasks really raced: stale writers were turned away
    history = sync_store.history("shared")
    assert len(history) == TASKS * TURNS * 4
    assert_blocks_whole(history)
    with sync_store.engine.connect() as conn:
        seqs = [
            row[0]
            for row in conn.execute(
                sa.text(
                    "SELECT seq FROM fsm_messages WHERE conversation_id = 'shared' ORDER BY seq"
                )
            )
        ]
    assert seqs == list(range(len(history)))  # dense, no gaps, no duplicates
    seen: dict[int, list[int]] = {t: [] for t in range(TASKS)}
    for at, message in enumerate(history):
        calls = message.get("tool_calls")
        if not calls:
            continue
        match = re.fullmatch(r"p(\d+)t(\d+)c0", calls[0]["id"])
        assert match is not None
        task, turn = int(match[1]), int(match[2])
        seen[task].append(turn)
        assert [m["content"] for m in history[at + 1 : at + 3]] == [
            f"p{task}t{turn}r{k}" for k in range(2)
        ]
    assert seen == {t: list(range(TURNS)) for t in range(TASKS)}


def test_cancelled_write_leaves_nothing(url: str) -> None:
    """A task cancelled while its commit waits for the lock writes nothing, and the store stays
    usable."""

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            conv = await store.create_conversation()
            await store.append(conv, [USER])
            tasks = [
                asyncio.create_task(
                    store.commit_turn(conv, make_turn(TWO_CALLS, response_id=f"r{i}"), ["5", "6"])
                )
                for i in range(4)
            ]
            await asyncio.sleep(0)
            tasks[-1].cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            history = await store.history(conv)
            committed = [d for d in done if not isinstance(d, BaseException)]
            assert len(history) == 1 + 3 * len(committed)
            assert_blocks_whole(history)

    run(body())


def test_a_cancel_that_meets_the_lock_handed_over_is_not_lost(db_url: sa.URL) -> None:
    """SQLite: a writer cancelled in the very loop step its turn at the store's lock comes is
    cancelled, and the lock passes on (with ``asyncio.wait_for`` on Python 3.11 the cancellation
    was lost there: a heartbeat, cancelled just so, ran on forever)."""
    if db_url.get_backend_name() != "sqlite":
        pytest.skip("the in-process writers' lock is SQLite's")

    async def body() -> None:
        async with AsyncConversationStore(db_url) as store:
            cid = await store.create_conversation()
            lock = store._writers  # the lock the store's writers take in turn
            await lock.acquire()
            writer = asyncio.create_task(store.append(cid, [USER]))
            for _ in range(5):  # the writer now waits for the lock
                await asyncio.sleep(0)
            lock.release()  # its turn comes ...
            await asyncio.sleep(0)  # ... is handed to it ...
            writer.cancel()  # ... and it is cancelled before it runs again
            with pytest.raises(asyncio.CancelledError):
                await writer
            assert await store.history(cid) == []
            assert await store.append(cid, [USER]) == 1  # the lock was not kept

    run(body())


def test_a_writer_that_waits_too_long_gets_a_retryable_busy_error(db_url: sa.URL) -> None:
    """SQLite: the wait happens in aiosqlite's thread, then the same typed error as the sync
    store's (PostgreSQL writers wait on a row lock instead)."""
    if db_url.get_backend_name() != "sqlite":
        pytest.skip("SQLite's database-wide write lock; PostgreSQL writers wait on a row lock")
    blocker = sa.create_engine(db_url, poolclass=sa.pool.NullPool)

    async def body() -> None:
        async with AsyncConversationStore(db_url, busy_timeout=0.2) as store:
            cid = await store.create_conversation()
            with blocker.connect() as conn:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
                ticks = 0

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        await asyncio.sleep(0.01)
                        ticks += 1

                ticker = asyncio.create_task(tick())
                with pytest.raises(StoreBusyError) as caught:
                    await store.append(cid, [USER])
                ticker.cancel()
                assert caught.value.retryable
                assert ticks >= 5  # the event loop kept running while the writer waited
                conn.rollback()
            assert await store.append(cid, [USER]) == 1

    try:
        run(body())
    finally:
        blocker.dispose()


def test_postgres_writes_are_one_round_trip(url: str) -> None:
    """PostgreSQL, counted on the wire (libpq's trace): the asyncio store's commit is one
    query, as the sync store's (the settings, the lock, the reading with the insert; committed
    by the server as it ends), on every SQLAlchemy it supports, with psycopg 3.1.9 or later
    (which cancels the server's query when its task is cancelled; before, 4 round trips: see
    ``fsm.store.engine_config``); its retry that finds the turn stored reads it statement by
    statement (7); the ledger's begin and its commit one each; an engine created with
    ``one_query=False`` commits statement by statement (4)."""
    import psycopg

    from bench.roundtrips import round_trips
    from fsm.store.engine import create_async_engine
    from fsm.store.engine_config import at_once_engines
    from fsm.store.ledger import Outcome

    if not url.startswith("postgresql"):
        pytest.skip("PostgreSQL round trips")
    release = tuple(int(part) for part in re.findall(r"\d+", psycopg.__version__)[:3])
    one_query = release >= (3, 1, 9)

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            assert (store.engine.sync_engine in at_once_engines) is one_query
            conv = await store.create_conversation()
            turn = make_turn(TWO_CALLS, response_id="trips")
            with round_trips(store.engine) as commit:
                done = await store.commit_turn(conv, turn, ["5", "6"])
            assert done.created and commit.total == (1 if one_query else 4), commit.trace
            first = '"SET LOCAL enable_seqscan = off' if one_query else '"BEGIN; SET LOCAL'
            assert commit.trace[0].startswith(first), commit.trace
            with round_trips(store.engine) as retry:
                again = await store.commit_turn(conv, turn, ["5", "6"])
            assert not again.created and again.messages == done.messages
            assert retry.total == (7 if one_query else 6), retry.trace
            with round_trips(store.engine) as begin:
                pending = await store.begin(conv, make_turn(response_id="ledger"), start=0)
            assert begin.total == (1 if one_query else 4), begin.trace
            with round_trips(store.engine) as ledger_commit:
                committed = await store.commit(pending, recording=Outcome(0, result="sunny"))
            assert committed.created, ledger_commit.trace
            assert ledger_commit.total == (1 if one_query else 4), ledger_commit.trace
            history = await store.history(conv)
            assert [m.get("content") for m in history if m["role"] == "tool"] == ["5", "6", "sunny"]
        engine = create_async_engine(url, one_query=False)
        try:
            async with AsyncConversationStore(engine=engine) as stepwise:
                with round_trips(stepwise.engine) as commit:
                    await stepwise.commit_turn(conv, make_turn(response_id="stepwise"), ["ok"])
                assert commit.total == 4, commit.trace
                assert commit.trace[0].startswith('"BEGIN; SET LOCAL'), commit.trace
        finally:
            await engine.dispose()

    run(body())


def test_postgres_a_commit_cancelled_while_it_waits_for_the_lock_writes_nothing(
    url: str, sync_store: ConversationStore
) -> None:
    """PostgreSQL: a task cancelled while its commit waits on the server for the
    conversation's lock (another writer holds it) writes nothing: its one query is cancelled
    on the server by psycopg (3.1.9 and later; with an older psycopg the asyncio store writes
    statement by statement, and the cancelled transaction's connection is dropped). The store
    stays usable, and the retry lands once."""
    if not url.startswith("postgresql"):
        pytest.skip("a wait on the server for a row lock is PostgreSQL's")
    conv = sync_store.create_conversation()
    holder = sync_store.engine.connect()
    lock = holder.begin()
    holder.execute(
        sa.text("SELECT id FROM fsm_conversations WHERE id = :c FOR UPDATE"), {"c": conv}
    )
    holder_pid = holder.exec_driver_sql("SELECT pg_backend_pid()").scalar()

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            turn = make_turn(TWO_CALLS, response_id="cancelled")
            task = asyncio.create_task(store.commit_turn(conv, turn, ["5", "6"]))
            for _ in range(500):  # until the query waits for the lock on the server
                await asyncio.sleep(0.01)
                waiting = sync_store.engine.connect()
                try:
                    found = waiting.execute(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE :holder = ANY(pg_blocking_pids(pid))"
                        ),
                        {"holder": holder_pid},
                    ).scalar()
                finally:
                    waiting.close()
                if found:
                    break
            else:
                pytest.fail("the commit never waited for the lock")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            lock.rollback()
            assert await store.history(conv) == []
            assert (await store.commit_turn(conv, turn, ["5", "6"])).created
            assert not (await store.commit_turn(conv, turn, ["5", "6"])).created
            assert len(await store.history(conv)) == 3

    try:
        run(body())
    finally:
        if lock.is_active:
            lock.rollback()
        holder.close()
