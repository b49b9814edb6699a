"""The floor of store writes: fsm's commit of a turn against the same rows written with no library.

One turn is what ``bench/store.py`` commits: an assistant message with 3 tool calls and their 3
results. fsm writes it as 7 rows (4 in ``messages``, 3 in ``tool_calls``); the *floor* writes
the very same 7 rows, into fsm's own tables (so the database checks the same constraints), with
the bare driver and nothing else:

* PostgreSQL: psycopg 3, one durable transaction per turn (``synchronous_commit`` as the server
  has it), all statements in one pipeline (``conn.pipeline()``: one round trip), the next
  ``seq`` kept in Python;
* SQLite: the ``sqlite3`` module, one transaction per turn, WAL and ``synchronous=NORMAL`` with
  foreign keys on (fsm's settings, so the same durability and the same checks).

Measured in the same run, on the same database, interleaved (each round runs one pass of every
contender, the figure is the best pass): fsm's ``ConversationStore.commit_turn``, the floor,
and the peers of ``bench/store.py`` (openai-agents ``SQLAlchemySession``, LangChain
``SQLChatMessageHistory``; their code and items are imported from there, not copied).

Then throughput under concurrency: 16 writer threads, each committing turns to a conversation
drawn at random from 16 (writers collide on conversations all the time) or from 1,000 (they
seldom do). Threads: a web service shares one store (one engine, one pool) between its request
threads, and that sharing (the pool, the locks) is what this measures; the database's own work
runs outside the GIL (PostgreSQL in its server processes, SQLite in C with the GIL released).
The floor runs at the same concurrency with one connection per thread and the least locking
that stays correct: on PostgreSQL a lock per conversation held in Python around its transaction
(the next seq is kept there too), on SQLite one lock around each transaction (SQLite has one
writer at a time anyway). And 16 writer *processes* (forked), each with its own store (or bare
connection) and a conversation of its own (so the floor keeps its seq in Python): what many
worker processes of a service do. Reported: turns per second and the 99th percentile of a
commit's latency.

Also reported: the round trips of one fsm commit, counted on the wire (``bench/roundtrips.py``),
where a commit's time goes (this process's CPU, and the rest, waiting on the database), and
issue 31's goals with the figure each was measured at.

Usage::

    python bench/floor.py [--turns 200] [--rounds 5] [--postgres URL]
    python bench/floor.py --postgres URL --write-md   # (re)writes "## Floor: store writes"
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import store as bench_store  # noqa: E402  (bench/store.py: the turn, the peers, the report)
from roundtrips import round_trips  # noqa: E402

from fsm.parser import Turn  # noqa: E402
from fsm.store import ConversationStore, upgrade  # noqa: E402

SECTION = "## Floor: store writes"
RESULTS = bench_store.RESULTS
WRITERS = 16
CONVERSATION_POOLS = (16, 1000)
FLOOR = "floor"
FSM = "fsm"
AGENTS = bench_store.AGENTS
LANGCHAIN = bench_store.LANGCHAIN

# -- the rows, exactly as fsm writes them ------------------------------------------------------
ASSISTANT_COLUMNS = (
    "conversation_id, seq, role, content, refusal, reasoning, model, response_id, choice, "
    "finish_reason, usage, idempotency_key, n_calls, slots_left, prev_seq, prev_slots_left, "
    "block_end_seq"
)
CALL_COLUMNS = (
    "conversation_id, assistant_seq, position, assistant_n_calls, call_id, provider_index, "
    "type, name, arguments, raw_arguments, repaired, state"
)
RESULT_COLUMNS = (
    "conversation_id, seq, role, content, content_parts, tool_call_id, name, assistant_seq, "
    "call_position, slots_left, prev_seq, prev_slots_left"
)


def _insert(table: str, columns: str, mark: str) -> str:
    n = len(columns.split(","))
    return f"INSERT INTO {table} ({columns}) VALUES ({', '.join([mark] * n)})"


Rows = tuple[tuple[Any, ...], list[tuple[Any, ...]], list[tuple[Any, ...]]]


def floor_rows(conversation_id: str, seq: int, turn: Turn, results: list[str]) -> Rows:
    """The assistant row, the call rows and the result rows of ``turn`` at ``seq``: the values
    fsm stores for it (plain ASCII text is stored as it is; no usage, no idempotency key)."""
    calls = turn.tool_calls
    n = len(calls)
    assistant = (
        conversation_id,
        seq,
        "assistant",
        turn.content,
        turn.refusal,
        turn.reasoning,
        turn.model,
        turn.response_id or None,
        turn.index,
        turn.finish_reason,
        None,
        None,
        n,
        n,
        seq - 1 if seq else None,
        0 if seq else None,
        seq + n if n else None,
    )
    call_rows = [
        (conversation_id, seq, p, n, c.id, c.index, c.type, c.name, c.arguments, None, False,
         "finished")
        for p, c in enumerate(calls)
    ]  # fmt: skip
    result_rows = [
        (conversation_id, seq + 1 + p, "tool", results[p], None, c.id, None, seq, p, n - 1 - p,
         seq + p, n - p)
        for p, c in enumerate(calls)
    ]  # fmt: skip
    return assistant, call_rows, result_rows


class PostgresFloor:
    """The same rows with psycopg: one pipelined, durable transaction per turn."""

    A = _insert("fsm_messages", ASSISTANT_COLUMNS, "%s")
    C = _insert("fsm_tool_calls", CALL_COLUMNS, "%s")
    R = _insert("fsm_messages", RESULT_COLUMNS, "%s")

    def __init__(self, url: sa.URL) -> None:
        import psycopg

        args = {"host": url.host, "port": url.port, "user": url.username, "dbname": url.database}
        args.update({key: str(value) for key, value in url.query.items()})  # options=...
        self.conn = psycopg.connect(password=url.password, autocommit=True, **args)

    def commit(self, conversation_id: str, seq: int, turn: Turn) -> None:
        assistant, calls, results = floor_rows(conversation_id, seq, turn, RESULTS)
        conn = self.conn
        with conn.pipeline(), conn.transaction():
            cur = conn.cursor()
            cur.execute(self.A, assistant)
            cur.executemany(self.C, calls)
            cur.executemany(self.R, results)

    def create(self, ids: list[str]) -> None:
        with self.conn.transaction():
            self.conn.cursor().executemany(
                "INSERT INTO fsm_conversations (id) VALUES (%s)", [(i,) for i in ids]
            )

    def close(self) -> None:
        self.conn.close()


class SqliteFloor:
    """The same rows with sqlite3: one transaction per turn, fsm's pragmas."""

    A = _insert("fsm_messages", ASSISTANT_COLUMNS, "?")
    C = _insert("fsm_tool_calls", CALL_COLUMNS, "?")
    R = _insert("fsm_messages", RESULT_COLUMNS, "?")

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        for pragma in (
            "PRAGMA foreign_keys=ON",
            "PRAGMA busy_timeout=30000",
            "PRAGMA journal_mode=WAL",
            "PRAGMA synchronous=NORMAL",
        ):
            self.conn.execute(pragma)

    def commit(self, conversation_id: str, seq: int, turn: Turn) -> None:
        assistant, calls, results = floor_rows(conversation_id, seq, turn, RESULTS)
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(self.A, assistant)
            conn.executemany(self.C, calls)
            conn.executemany(self.R, results)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def create(self, ids: list[str]) -> None:
        self.conn.execute("BEGIN")
        self.conn.executemany("INSERT INTO fsm_conversations (id) VALUES (?)", [(i,) for i in ids])
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


# -- one writer: passes ---------------------------------------------------------------------
@dataclass
class Engine:
    """One database under test: how to open fsm and the floor on it, and the peers' URLs."""

    name: str
    url: sa.URL
    floor: Callable[[], PostgresFloor | SqliteFloor]
    agents_url: str
    langchain_url: sa.URL


@dataclass
class SingleRun:
    engine: str
    #: seconds per turn, best pass of each contender (a str: why a peer was skipped)
    best: dict[str, float | str] = field(default_factory=dict)
    #: statements fsm sends for one commit (COMMIT included)
    statements: list[str] = field(default_factory=list)
    #: PostgreSQL: round trips of one commit, counted on the wire (the floor's: 1)
    round_trips: int | None = None
    #: this process's CPU seconds per turn in the best pass of fsm and of the floor: the rest
    #: of a commit's time is spent waiting on the database (its work, the round trips)
    cpu: dict[str, float] = field(default_factory=dict)


def _turns(tag: str, n: int) -> list[Turn]:
    return [bench_store.make_turn(3, f"{tag}-{i}") for i in range(n)]


def fsm_statements(store: ConversationStore) -> list[str]:
    """The statements (queries) one commit of fsm sends, in order, COMMIT last when one is
    sent (PostgreSQL's one-query commit is committed by the server as it ends)."""
    seen: list[str] = []

    def before(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        seen.append(" ".join(statement.split())[:72])

    def at_commit(c: Any) -> None:
        info = getattr(c.connection.driver_connection, "info", None)  # psycopg's
        if info is not None and info.transaction_status.name == "IDLE":
            return  # nothing open: no COMMIT goes out
        seen.append("COMMIT")

    conv = store.create_conversation()
    event.listen(store.engine, "before_cursor_execute", before)
    event.listen(store.engine, "commit", at_commit)
    try:
        store.commit_turn(conv, bench_store.make_turn(3, "count"), RESULTS)
    finally:
        event.remove(store.engine, "before_cursor_execute", before)
        event.remove(store.engine, "commit", at_commit)
    return seen


def fsm_round_trips(store: ConversationStore) -> int | None:
    """PostgreSQL: the round trips of one commit, counted on the wire (``None`` on SQLite,
    which runs in the process)."""
    if store.dialect != "postgresql":
        return None
    conv = store.create_conversation()
    with round_trips(store.engine) as counted:
        store.commit_turn(conv, bench_store.make_turn(3, "trips"), RESULTS)
    return counted.total


class AgentsWriter:
    """openai-agents' ``SQLAlchemySession``, one session per pass, on its own event loop."""

    def __init__(self, url: str) -> None:
        from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
        from sqlalchemy.ext.asyncio import create_async_engine

        self._session = SQLAlchemySession
        self.engine = create_async_engine(url)
        if self.engine.dialect.name == "sqlite":
            bench_store._like_fsm_on_sqlite(self.engine.sync_engine)
        self.runner = asyncio.Runner()

    def run_pass(self, tag: str, turns: int) -> float:
        session = self._session(uuid.uuid4().hex, engine=self.engine, create_tables=True)
        items = [bench_store.agents_turn_items(f"{tag}-{i}") for i in range(turns)]

        async def go() -> float:
            await session.add_items([{"role": "user", "content": "warm up"}])
            start = time.perf_counter()
            for batch in items:
                await session.add_items(batch)
            return (time.perf_counter() - start) / turns

        return self.runner.run(go())

    def close(self) -> None:
        self.runner.run(self.engine.dispose())
        self.runner.close()


class LangchainWriter:
    """LangChain's ``SQLChatMessageHistory``, one history per pass."""

    def __init__(self, url: sa.URL) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # langchain-community's sunset notice
            from langchain_community.chat_message_histories import SQLChatMessageHistory
        self._history = SQLChatMessageHistory
        self.engine = sa.create_engine(url)
        if self.engine.dialect.name == "sqlite":
            bench_store._like_fsm_on_sqlite(self.engine)
        self.table = f"lc_floor_{uuid.uuid4().hex[:8]}"

    def run_pass(self, tag: str, turns: int) -> float:
        history = self._history(uuid.uuid4().hex, table_name=self.table, connection=self.engine)
        batches = [bench_store.langchain_turn_messages(f"{tag}-{i}") for i in range(turns)]
        history.add_messages(batches[0][:1])  # warm up (creates the table)
        start = time.perf_counter()
        for batch in batches:
            history.add_messages(batch)
        return (time.perf_counter() - start) / turns

    def close(self) -> None:
        self.engine.dispose()


def single_writer(engine: Engine, turns: int, rounds: int, *, peers_too: bool = True) -> SingleRun:
    """Best-of-``rounds`` seconds per turn of fsm, the floor and the peers, interleaved."""
    run = SingleRun(engine.name)
    samples: dict[str, list[float]] = {FSM: [], FLOOR: []}
    store = ConversationStore(engine.url)
    floor = engine.floor()
    peers: dict[str, Any] = {}
    makers: list[tuple[str, Callable[[], Any]]] = [
        (AGENTS, lambda: AgentsWriter(engine.agents_url)),
        (LANGCHAIN, lambda: LangchainWriter(engine.langchain_url)),
    ]
    for name, make in makers if peers_too else []:
        try:
            peers[name] = make()
            samples[name] = []
        except ImportError as exc:
            run.best[name] = f"{type(exc).__name__}: {exc}"
    try:
        run.statements = fsm_statements(store)
        run.round_trips = fsm_round_trips(store)

        cpus: dict[str, list[float]] = {FSM: [], FLOOR: []}

        def fsm_pass(tag: str) -> float:
            conv = store.create_conversation()
            store.append(conv, [{"role": "user", "content": "warm up"}])
            prepared = _turns(tag, turns)
            start, cpu = time.perf_counter(), time.process_time()
            for turn in prepared:
                store.commit_turn(conv, turn, RESULTS)
            cpus[FSM].append((time.process_time() - cpu) / turns)
            return (time.perf_counter() - start) / turns

        def floor_pass(tag: str) -> float:
            conv = uuid.uuid4().hex
            floor.create([conv])
            prepared = _turns(tag, turns)
            start, cpu = time.perf_counter(), time.process_time()
            seq = 0
            for turn in prepared:
                floor.commit(conv, seq, turn)
                seq += 1 + len(turn.tool_calls)
            cpus[FLOOR].append((time.process_time() - cpu) / turns)
            return (time.perf_counter() - start) / turns

        passes: list[tuple[str, Callable[[str], float]]] = [(FSM, fsm_pass), (FLOOR, floor_pass)]
        passes += [
            (name, lambda tag, peer=peer: peer.run_pass(tag, turns)) for name, peer in peers.items()
        ]
        for r in range(rounds):
            order = passes[r % len(passes) :] + passes[: r % len(passes)]
            for name, fn in order:
                samples[name].append(fn(f"{name}-r{r}"))
        for name, got in samples.items():
            run.best[name] = min(got)
        for name, spent in cpus.items():  # the CPU of the best pass
            run.cpu[name] = spent[samples[name].index(min(samples[name]))]
    finally:
        store.close()
        floor.close()
        for peer in peers.values():
            peer.close()
    return run


# -- sixteen writers --------------------------------------------------------------------------
@dataclass
class Throughput:
    turns_per_s: float
    p50_s: float
    p99_s: float


@dataclass
class ConcurrentRun:
    engine: str
    conversations: int
    fsm: Throughput
    floor: Throughput
    #: writer processes, each on a conversation of its own (else threads sharing one store)
    processes: bool = False


def drive(
    writers: int, turns_each: int, conversations: int, commit: Callable[[int, int, Turn], None]
) -> Throughput:
    """``writers`` threads, each committing ``turns_each`` turns to conversations drawn at
    random (seeded) from ``conversations``; turns per second over the whole run, latencies."""
    prepared = [_turns(f"w{w}-{uuid.uuid4().hex[:6]}", turns_each) for w in range(writers)]
    picks = [
        [random.Random(w).randrange(conversations) for _ in range(turns_each)]
        for w in range(writers)
    ]
    latencies: list[list[float]] = [[] for _ in range(writers)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(writers + 1)

    def writer(w: int) -> None:
        barrier.wait()
        try:
            for turn, c in zip(prepared[w], picks[w], strict=True):
                start = time.perf_counter()
                commit(w, c, turn)
                latencies[w].append(time.perf_counter() - start)
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return throughput(latencies, elapsed)


def throughput(latencies: list[list[float]], elapsed: float) -> Throughput:
    """Turns per second over ``elapsed`` and the median and 99th percentile latency of the
    writers' ``latencies``."""
    flat = sorted(x for lat in latencies for x in lat)
    return Throughput(
        len(flat) / elapsed,
        statistics.median(flat),
        flat[min(len(flat) - 1, round(0.99 * (len(flat) - 1)))],
    )


def concurrent(engine: Engine, conversations: int, turns_each: int) -> ConcurrentRun:
    """fsm (one store shared by the threads) and the floor (a connection per thread)."""
    with ConversationStore(engine.url) as store:
        convs = [store.create_conversation() for _ in range(conversations)]
        store.commit_turn(convs[0], bench_store.make_turn(3, "warm"), RESULTS)

        def fsm_commit(_w: int, c: int, turn: Turn) -> None:
            store.commit_turn(convs[c], turn, RESULTS)

        ours = drive(WRITERS, turns_each, conversations, fsm_commit)

    floors = [engine.floor() for _ in range(WRITERS)]
    try:
        ids = [uuid.uuid4().hex for _ in range(conversations)]
        floors[0].create(ids)
        seqs = [0] * conversations
        sqlite = isinstance(floors[0], SqliteFloor)
        one = threading.Lock()
        locks = [one] * conversations if sqlite else [threading.Lock() for _ in ids]

        def floor_commit(w: int, c: int, turn: Turn) -> None:
            with locks[c]:
                floors[w].commit(ids[c], seqs[c], turn)
                seqs[c] += 1 + len(turn.tool_calls)

        theirs = drive(WRITERS, turns_each, conversations, floor_commit)
    finally:
        for floor in floors:
            floor.close()
    return ConcurrentRun(engine.name, conversations, ours, theirs)


# -- sixteen writer processes -----------------------------------------------------------------
@contextmanager
def _writer_of(engine: Engine, which: str) -> Iterator[Callable[[Turn], None]]:
    """How one writer process commits a turn to a conversation of its own: fsm's store, or
    the floor's bare connection keeping the next seq in Python."""
    if which == FSM:
        with ConversationStore(engine.url) as store:
            conv = store.create_conversation()
            yield lambda turn: store.commit_turn(conv, turn, RESULTS)
        return
    floor = engine.floor()
    try:
        conv, seq = uuid.uuid4().hex, [0]
        floor.create([conv])

        def commit(turn: Turn) -> None:
            floor.commit(conv, seq[0], turn)
            seq[0] += 1 + len(turn.tool_calls)

        yield commit
    finally:
        floor.close()


def _process_writer(engine: Engine, which: str, turns_each: int, barrier: Any, queue: Any) -> None:
    """One writer process: its own conversation (so the floor may keep the seq in Python), its
    own store or connection, ``turns_each`` turns timed one by one after the start barrier."""
    latencies: list[float] = []
    try:
        prepared = _turns(f"{which}-{uuid.uuid4().hex[:8]}", turns_each + 1)
        with _writer_of(engine, which) as commit:
            commit(prepared[0])  # warm: statements compiled, connection open
            barrier.wait()
            for turn in prepared[1:]:
                start = time.perf_counter()
                commit(turn)
                latencies.append(time.perf_counter() - start)
        queue.put(latencies)
    except BaseException as exc:  # reported by the parent
        queue.put(f"{type(exc).__name__}: {exc}")
        raise


def processes(engine: Engine, turns_each: int) -> ConcurrentRun:
    """:data:`WRITERS` writer processes, each on a conversation of its own, fsm then the floor:
    turns per second from the start barrier to the last writer's end, and latencies."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    found: dict[str, Throughput] = {}
    for which in (FSM, FLOOR):
        barrier, queue = ctx.Barrier(WRITERS + 1), ctx.Queue()
        procs = [
            ctx.Process(target=_process_writer, args=(engine, which, turns_each, barrier, queue))
            for _ in range(WRITERS)
        ]
        for proc in procs:
            proc.start()
        barrier.wait(timeout=300)
        start = time.perf_counter()
        got = [queue.get(timeout=600) for _ in procs]
        elapsed = time.perf_counter() - start
        for proc in procs:
            proc.join()
        failed = [g for g in got if isinstance(g, str)]
        if failed:
            raise RuntimeError(f"{which} writer failed: {failed[0]}")
        found[which] = throughput(got, elapsed)
    return ConcurrentRun(engine.name, WRITERS, found[FSM], found[FLOOR], processes=True)


# -- engines ----------------------------------------------------------------------------------
@contextmanager
def engines(tmp: Path, postgres: str | None) -> Iterator[tuple[list[Engine], str | None]]:
    """The SQLite engine (a file in ``tmp``) and, with ``postgres``, a throwaway schema."""
    path = tmp / "fsm.db"
    sqlite_url = sa.make_url(f"sqlite:///{path}")
    upgrade(sqlite_url)
    found = [
        Engine(
            "SQLite",
            sqlite_url,
            lambda: SqliteFloor(path),
            f"sqlite+aiosqlite:///{tmp / 'agents.db'}",
            sa.make_url(f"sqlite:///{tmp / 'langchain.db'}"),
        )
    ]
    if not postgres:
        yield found, None
        return
    pg_url, version, drop = bench_store._postgres_schema(postgres)
    try:
        upgrade(pg_url)
        found.append(
            Engine(
                "PostgreSQL",
                pg_url,
                lambda: PostgresFloor(pg_url),
                pg_url.render_as_string(hide_password=False),
                pg_url,
            )
        )
        yield found, version
    finally:
        drop()


# -- report -----------------------------------------------------------------------------------
def time_split(run: SingleRun) -> str:
    """Where a commit's time goes: this process's CPU, and the rest (waiting on the database:
    its work and the round trips), for fsm and the floor."""
    parts = []
    for name in (FSM, FLOOR):
        wall, cpu = run.best[name], run.cpu.get(name)
        if isinstance(wall, float) and cpu is not None:
            parts.append(
                f"{name} {_ms(wall)} = {_ms(cpu)} CPU in the process + "
                f"{_ms(max(0.0, wall - cpu))} waiting on the database"
            )
    trips = "" if run.round_trips is None else f" (fsm: {run.round_trips} round trips, floor: 1)"
    return f"{run.engine}: " + "; ".join(parts) + trips


def goals(singles: list[SingleRun], concurrents: list[ConcurrentRun]) -> list[str]:
    """Issue 31's goals, each with the figure measured and whether it is met."""
    lines: list[str] = []

    def say(goal: str, figure: str, met: bool, priced: str | None = None) -> None:
        """``priced``: why the goal is out of reach when the floor itself misses it."""
        why = f"; priced: {priced}" if priced and not met else ""
        lines.append(f"{'met' if met else 'NOT met'}: {goal}: {figure}{why}")

    for run in singles:
        ours, floor = run.best[FSM], run.best[FLOOR]
        assert isinstance(ours, float) and isinstance(floor, float)
        limit = 2.0 if run.engine == "PostgreSQL" else 10.0
        say(
            f"{run.engine} commit <= {limit:g}x the floor",
            f"{ours / floor:.2f}x",
            ours <= limit * floor,
        )
        theirs = run.best.get(LANGCHAIN)
        if run.engine == "PostgreSQL" and isinstance(theirs, float):
            say(
                "PostgreSQL commit faster than LangChain's SQLChatMessageHistory",
                f"{_ms(ours)} vs {_ms(theirs)} (the floor: {_ms(floor)})",
                ours < theirs,
                "LangChain's commit is faster than the floor itself (the same rows with fsm's "
                "keys, checks and deferred triggers, written by the bare driver in one round "
                "trip): no store that enforces them can beat it"
                if theirs < floor
                else None,
            )
    for got in concurrents:
        if not got.processes:
            continue
        share = got.fsm.turns_per_s / got.floor.turns_per_s
        if got.engine == "PostgreSQL":
            say(
                f"PostgreSQL, {WRITERS} writer processes, >= 0.5 of the floor",
                f"{share:.2f}",
                share >= 0.5,
            )
        else:
            say(
                f"SQLite, {WRITERS} writer processes, >= 0.25 of the floor and p99 <= 50 ms",
                f"{share:.2f}, p99 {_ms(got.fsm.p99_s)} (the floor's p99: {_ms(got.floor.p99_s)})",
                share >= 0.25 and got.fsm.p99_s <= 0.050,
                f"the floor's own p99 is above 50 ms here ({WRITERS} runnable processes on "
                f"{os.cpu_count()} cores take turns on the CPU)"
                if got.floor.p99_s > 0.050 and share >= 0.25
                else None,
            )
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _ratio(ours: float, theirs: float | str | None) -> str:
    return f"{ours / theirs:.2f}" if isinstance(theirs, float) else "-"


def _cell(value: float | str | None) -> str:
    return _ms(value) if isinstance(value, float) else "skipped"


def single_table(runs: list[SingleRun]) -> list[str]:
    lines = [
        "| engine | fsm | floor | fsm/floor | openai-agents | fsm/openai-agents | langchain "
        "| fsm/langchain | fsm statements | fsm round trips |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        ours = run.best[FSM]
        assert isinstance(ours, float)
        cells = [run.engine, _ms(ours), _cell(run.best[FLOOR]), _ratio(ours, run.best[FLOOR])]
        for name in (AGENTS, LANGCHAIN):
            cells += [_cell(run.best.get(name)), _ratio(ours, run.best.get(name))]
        cells.append(str(len(run.statements)))
        cells.append("-" if run.round_trips is None else str(run.round_trips))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def concurrent_table(runs: list[ConcurrentRun]) -> list[str]:
    lines = [
        "| engine | writers | conversations | fsm turns/s | fsm p99 | floor turns/s | floor p99 "
        "| fsm/floor turns/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        writers = f"{WRITERS} processes" if run.processes else f"{WRITERS} threads"
        conversations = "one each" if run.processes else f"{run.conversations:,}"
        lines.append(
            f"| {run.engine} | {writers} | {conversations} | {run.fsm.turns_per_s:,.0f} | "
            f"{_ms(run.fsm.p99_s)} | {run.floor.turns_per_s:,.0f} | {_ms(run.floor.p99_s)} | "
            f"{run.fsm.turns_per_s / run.floor.turns_per_s:.2f} |"
        )
    return lines


def render_md(
    singles: list[SingleRun],
    concurrents: list[ConcurrentRun],
    args: argparse.Namespace,
    elapsed: float,
    loads: tuple[str, str],
    pg_version: str | None,
) -> str:
    shown = ["--write-md"] + (["--postgres URL"] if args.postgres else [])
    if args.turns != 200:
        shown.insert(0, f"--turns {args.turns}")
    if args.rounds != 5:
        shown.insert(0, f"--rounds {args.rounds}")
    lines = [
        SECTION,
        "",
        f"Generated by `python bench/floor.py {' '.join(shown)}` on "
        f"{datetime.date.today().isoformat()} in {elapsed:.0f} s. Do not edit by hand: rerun "
        "the script (it replaces this section only).",
        "",
        "Committing one turn (an assistant message with 3 tool calls and their 3 results: 7 "
        "rows, 4 in `messages` and 3 in `tool_calls`), one writer, per turn, best of "
        f"{args.rounds} interleaved passes of {args.turns} turns. The **floor** writes the same "
        "7 rows into fsm's own tables (the database checks the same keys and constraints) with "
        "the bare driver: psycopg, one durable transaction per turn in one pipeline (one round "
        "trip), the next seq kept in Python; sqlite3, one transaction per turn, WAL, "
        "`synchronous=NORMAL`, foreign keys on (fsm's settings). Ratios are fsm's time over the "
        "other's: above 1, fsm is slower. *fsm statements*: the queries one commit sends, "
        "COMMIT included when one is sent (on PostgreSQL the common case is one query of three "
        "statements, which the server commits as it ends).",
        "",
        *single_table(singles),
        "",
    ]
    for run in singles:
        lines.append(f"fsm's statements on {run.engine}: " + "; ".join(
            f"`{s}`" for s in run.statements) + ".")  # fmt: skip
        lines.append("")
    lines += [
        "Where a commit's time goes (CPU of this process, the rest waiting on the database):",
        "",
    ]
    lines += [f"- {time_split(run)}" for run in singles]
    lines.append("")
    lines += [
        f"Under concurrency: {WRITERS} writer threads, {args.concurrent_turns} turns each, each "
        "turn to a conversation drawn at random from 16 (writers collide on conversations "
        "all the time) or from 1,000 (they seldom do); one `ConversationStore` shared by the "
        "threads (one engine, one pool, as a threaded web service has), and the floor with a "
        "connection per thread and the least locking that stays correct (PostgreSQL: a lock "
        "per conversation held around its transaction; SQLite: one lock around each "
        "transaction, as SQLite has one writer at a time). The *processes* rows: 16 forked "
        "writer processes, each with its own store (the floor: its own connection) and a "
        "conversation of its own, as the worker processes of a service.",
        "",
        *concurrent_table(concurrents),
        "",
        "The goals of issue 31, as measured by this run:",
        "",
        *[f"- {line}" for line in goals(singles, concurrents)],
        "",
        f"Machine: {bench_store._cpu()}, {os.cpu_count()} cores; CPython "
        f"{platform.python_version()}; SQLite {sqlite3.sqlite_version}"
        + (f", PostgreSQL {pg_version} (local server)" if pg_version else "")
        + f"; load average (1, 5, 15 min) {loads[0]} at the start, {loads[1]} at the end.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=200, help="turns per pass (one writer)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved passes per contender")
    parser.add_argument("--concurrent-turns", type=int, default=50, help="turns per writer thread")
    parser.add_argument("--postgres", default=os.environ.get("FSM_TEST_POSTGRES_URL"))
    parser.add_argument("--no-concurrency", action="store_true")
    parser.add_argument("--no-peers", action="store_true", help="fsm and the floor only")
    parser.add_argument(
        "--write-md", action="store_true", help=f"write the '{SECTION}' section of BENCHMARKS.md"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_start = bench_store._load()
    singles: list[SingleRun] = []
    concurrents: list[ConcurrentRun] = []
    with tempfile.TemporaryDirectory() as tmp, engines(Path(tmp), args.postgres) as (found, pg):
        for engine in found:
            run = single_writer(engine, args.turns, args.rounds, peers_too=not args.no_peers)
            singles.append(run)
            print(f"{engine.name}: one writer, per turn")
            for name, value in run.best.items():
                ratio = _ratio(run.best[FSM], value) if name != FSM else ""  # type: ignore[arg-type]
                print(f"  {name:14} {_cell(value):>10}  fsm/{name} {ratio}")
            print(f"  fsm statements: {len(run.statements)}: {run.statements}")
            if run.round_trips is not None:
                print(f"  fsm round trips per commit: {run.round_trips} (the floor's: 1)")
            print(f"  where the time goes: {time_split(run)}")
        if not args.no_concurrency:
            for engine in found:
                runs = [
                    concurrent(engine, pool, args.concurrent_turns) for pool in CONVERSATION_POOLS
                ]
                runs.append(processes(engine, args.concurrent_turns))
                for got in runs:
                    concurrents.append(got)
                    where = (
                        f"{WRITERS} writer processes, a conversation each"
                        if got.processes
                        else f"{WRITERS} writer threads on {got.conversations} conversations"
                    )
                    print(
                        f"{engine.name}, {where}: fsm "
                        f"{got.fsm.turns_per_s:,.0f} turns/s p50 {_ms(got.fsm.p50_s)} p99 "
                        f"{_ms(got.fsm.p99_s)}; floor {got.floor.turns_per_s:,.0f} turns/s p50 "
                        f"{_ms(got.floor.p50_s)} p99 {_ms(got.floor.p99_s)}; fsm/floor "
                        f"{got.fsm.turns_per_s / got.floor.turns_per_s:.2f}"
                    )
    elapsed = time.perf_counter() - started
    load_end = bench_store._load()
    print("goals:")
    for line in goals(singles, concurrents):
        print(f"  {line}")
    print(f"load average {load_start} at the start, {load_end} at the end; {elapsed:.0f} s")
    if args.write_md:
        section = render_md(singles, concurrents, args, elapsed, (load_start, load_end), pg)
        bench_store.write_md(section, heading=SECTION)
        print(f"wrote the '{SECTION}' section of {bench_store.BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
