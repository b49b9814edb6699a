"""Benchmark of the conversation store: commit throughput and history() of a long conversation.

Measures, on SQLite (files in a temporary directory) and on PostgreSQL (when ``--postgres URL``
or ``$FSM_TEST_POSTGRES_URL`` names a server; a throwaway schema is used and dropped):

* write: the time to commit a turn of one assistant message with 3 tool calls and their 3
  results (each commit its own transaction, one writer; best of 3 passes), and turns per second;
* read: ``history()`` of a 10,000-message conversation, by the sync store and by the asyncio
  store (``AsyncConversationStore``, aiosqlite / psycopg async), against its **floor**, measured
  in the same run on the same rows: the bare driver (``sqlite3``, ``psycopg``) running the same
  two SELECTs (messages, then tool calls, in one transaction: REPEATABLE READ on PostgreSQL, as
  fsm's reads) and turning the rows into the same Python dicts with the least code (checked
  equal to fsm's output before timing). fsm and the floor are timed interleaved, best of
  several reads each; the ratio is fsm's time over the floor's (target: <= 1.5, issue 31).

Side by side with two peers, when they are importable, on the same work:

* openai-agents' ``SQLAlchemySession`` (``pip install openai-agents aiosqlite greenlet``): the 7
  items of a turn (assistant message, 3 ``function_call``, 3 ``function_call_output``) added
  with one ``add_items`` call; ``get_items()`` of a 10,000-item session;
* LangChain's ``SQLChatMessageHistory`` (``pip install langchain-community``): a turn is one
  ``AIMessage`` with 3 ``tool_calls`` and 3 ``ToolMessage`` with the matching ``tool_call_id``,
  added with one ``add_messages`` call; ``.messages`` of a 10,000-message history.

A peer that is not importable is skipped, and the script says why. Each peer gets its own
SQLite file, and on PostgreSQL its own tables in the throwaway schema (LangChain's under a
unique ``table_name``); on SQLite the peers' engines get fsm's settings (WAL,
``synchronous=NORMAL``, foreign keys on), so the same durability is compared. Ratios are
fsm's time over the peer's time: above 1, fsm is slower. Neither peer checks anything: each
stores one JSON blob per item, and the script shows it storing a tool result whose call id
points at nothing, which fsm refuses. The ratio is the price of an enforced, relational history.

Usage::

    python bench/store.py [--turns 300] [--postgres postgresql+psycopg://postgres@localhost/test]
    python bench/store.py --postgres URL --write-md   # also (re)writes "## Store" in BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from mdsection import replace_section
from roundtrips import round_trips
from sqlalchemy import event

from fsm import parse
from fsm.parser import Turn
from fsm.store import ConversationStore, upgrade
from fsm.store.engine import normalize_url
from fsm.store.errors import StoreError

HISTORY_MESSAGES = 10_000
READS = 5
FLOOR_READS = 11  # fsm's read and the floor's, interleaved: the best of each
WRITE_PASSES = 3  # the write figure is the best pass (damps other load on the machine)
RESULTS = ["sunny, 18 C", "rain, 11 C", "snow, -2 C"]
BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
SECTION = "## Store"
AGENTS = "openai-agents"
LANGCHAIN = "langchain"
PEERS = (AGENTS, LANGCHAIN)
PEER_LABELS = {
    AGENTS: "openai-agents `SQLAlchemySession`",
    LANGCHAIN: "LangChain `SQLChatMessageHistory`",
}


class PeerUnavailable(Exception):
    """The peer (or a driver it needs) cannot be imported; the message says why."""


@dataclass
class Figures:
    write_s: float  # seconds per turn
    read_s: float  # seconds for the 10,000-message read
    orphan: str = ""  # what happened to a tool result whose call id points at nothing
    #: fsm only: the best read, the async store's best read and the floor's best read (the bare
    #: driver's SELECTs of the same rows and the dicts built from them), interleaved
    best_read_s: float | None = None
    async_read_s: float | None = None
    floor_read_s: float | None = None
    async_floor_s: float | None = None  # the same floor through the asyncio driver
    #: fsm only: the asyncio store's write (best pass, seconds per turn) and, on PostgreSQL,
    #: the round trips of one of its commits on the wire
    async_write_s: float | None = None
    async_round_trips: int | None = None
    async_statements: int | None = None  # the statements of one asyncio commit


@dataclass
class EngineRun:
    engine: str
    fsm: Figures
    peers: dict[str, Figures | str] = field(default_factory=dict)  # a str: why it was skipped


# -- fsm -------------------------------------------------------------------------------------


def make_turn(n: int, response_id: str) -> Turn:
    """A complete turn with ``n`` tool calls, parsed by the real parser."""
    chunks: list[dict[str, Any]] = []
    for index in range(n):
        call = {
            "index": index,
            "id": f"call_{response_id}_{index}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "City {index}"}}'},
        }
        chunks.append(
            {"id": response_id, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
        )
    chunks.append(
        {"id": response_id, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    )
    return parse(chunks).turn(0)


def timed(fn: Callable[[], object], repeat: int = READS) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_fsm(url: sa.URL, turns: int) -> Figures:
    upgrade(url)
    with ConversationStore(url) as store:
        passes = []
        for p in range(WRITE_PASSES):
            conv = store.create_conversation()
            prepared = [make_turn(3, f"p{p}r{i}") for i in range(turns)]
            start = time.perf_counter()
            for turn in prepared:
                store.commit_turn(conv, turn, RESULTS)
            passes.append((time.perf_counter() - start) / turns)
        write_s = min(passes)

        long = store.create_conversation()
        block = 0
        while store.next_seq(long) < HISTORY_MESSAGES - 8:
            store.append(long, [{"role": "user", "content": f"question {i}"} for i in range(96)])
            store.commit_turn(long, make_turn(3, f"h{block}"), RESULTS)
            block += 1
        rest = HISTORY_MESSAGES - store.next_seq(long)
        store.append(long, [{"role": "user", "content": "q"} for _ in range(rest)])
        assert len(store.history(long)) == HISTORY_MESSAGES
        read_s = timed(lambda: store.history(long))
        floor = floor_reader(url, long)
        assert floor() == store.history(long), "the floor does not build fsm's messages"
        best_read_s, floor_read_s = interleaved(lambda: store.history(long), floor)
        async_read_s, async_floor_s, async_write_s, async_trips, async_statements = bench_fsm_async(
            url, long, floor, turns
        )

        orphan = store.create_conversation()
        try:
            store.append(orphan, [{"role": "tool", "tool_call_id": "call_nowhere", "content": "x"}])
            refused = "stored"
        except StoreError as exc:
            refused = f"refused ({type(exc).__name__})"
    return Figures(
        write_s,
        read_s,
        refused,
        best_read_s,
        async_read_s,
        floor_read_s,
        async_floor_s,
        async_write_s,
        async_trips,
        async_statements,
    )


def interleaved(ours: Callable[[], object], floor: Callable[[], object]) -> tuple[float, float]:
    """The best of :data:`FLOOR_READS` runs of each, one after the other (so load on the
    machine hits both alike)."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(FLOOR_READS):
        for fn, samples in ((ours, a), (floor, b)):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return min(a), min(b)


def bench_fsm_async(
    url: sa.URL, conversation: str, floor: Callable[[], object], turns: int
) -> tuple[float, float, float, int | None, int]:
    """The best ``AsyncConversationStore.history()`` of the same conversation and the best of
    its asyncio floor (:func:`async_floor_reader`), interleaved; then the asyncio store's write
    as :func:`bench_fsm` times the sync store's, the statements of one of its commits and (on
    PostgreSQL) that commit's round trips."""
    from fsm.store.aio import AsyncConversationStore

    async def write(store: AsyncConversationStore) -> tuple[float, int | None, int]:
        passes = []
        for p in range(WRITE_PASSES):
            conv = await store.create_conversation()
            prepared = [make_turn(3, f"async-p{p}r{i}") for i in range(turns)]
            start = time.perf_counter()
            for turn in prepared:
                await store.commit_turn(conv, turn, RESULTS)
            passes.append((time.perf_counter() - start) / turns)
        trips, statements = None, 0

        def counted_statement(*_args: Any) -> None:
            nonlocal statements
            statements += 1

        event.listen(store.engine.sync_engine, "before_cursor_execute", counted_statement)
        try:
            if store.dialect == "postgresql":
                with round_trips(store.engine) as counted:
                    await store.commit_turn(conv, make_turn(3, "async-trips"), RESULTS)
                trips = counted.total
            else:
                await store.commit_turn(conv, make_turn(3, "async-trips"), RESULTS)
        finally:
            event.remove(store.engine.sync_engine, "before_cursor_execute", counted_statement)
        return min(passes), trips, statements

    async def run() -> tuple[float, float, float, int | None, int]:
        async_floor = await async_floor_reader(url, conversation)
        try:
            async with AsyncConversationStore(url) as store:
                expected = floor()
                assert await store.history(conversation) == expected
                assert await async_floor.read() == expected
                best = best_floor = float("inf")
                for _ in range(FLOOR_READS):
                    start = time.perf_counter()
                    await store.history(conversation)
                    best = min(best, time.perf_counter() - start)
                    start = time.perf_counter()
                    await async_floor.read()
                    best_floor = min(best_floor, time.perf_counter() - start)
                return (best, best_floor, *await write(store))
        finally:
            await async_floor.close()

    return asyncio.run(run())


# -- the floor -------------------------------------------------------------------------------

FLOOR_MESSAGES = (
    "SELECT seq, role, content, content_parts, name, refusal, tool_call_id, n_calls"
    " FROM fsm_messages WHERE conversation_id = {p} ORDER BY seq"
)
FLOOR_CALLS = (
    "SELECT assistant_seq, call_id, type, name, arguments FROM fsm_tool_calls"
    " WHERE conversation_id = {p} ORDER BY assistant_seq, position"
)


def floor_messages(rows: list[Any], calls: list[Any], loads: Callable[[Any], Any] | None) -> Any:
    """The messages fsm's ``history()`` returns, built from the rows with the least code (no
    check, no decoding of fsm's marked text: real values need none). ``loads``: how content
    parts are parsed (``None``: the driver already parsed them)."""
    messages: list[dict[str, Any]] = []
    calls_of: dict[int, list[dict[str, Any]]] = {}
    for seq, role, content, parts, name, refusal, tool_call_id, n_calls in rows:
        if role == "tool":
            message: dict[str, Any] = {
                "role": role,
                "tool_call_id": tool_call_id,
                "content": content,
            }
        else:
            message = {"role": role, "content": content}
            if name is not None:
                message["name"] = name
            if refusal is not None:
                message["refusal"] = refusal
            if n_calls:
                calls_of[seq] = message["tool_calls"] = []
        if parts is not None:
            message["content"] = loads(parts) if loads is not None else parts
        messages.append(message)
    for assistant_seq, call_id, kind, name, arguments in calls:
        calls_of[assistant_seq].append(
            {"id": call_id, "type": kind, "function": {"name": name, "arguments": arguments}}
        )
    return messages


@dataclass
class AsyncFloor:
    """The asyncio floor: ``read()`` the history, ``close()`` the connection."""

    read: Callable[[], Any]
    close: Callable[[], Any]


async def async_floor_reader(url: sa.URL, conversation: str) -> AsyncFloor:
    """The floor of the asyncio store: the same SELECTs and dicts through the asyncio driver
    the store uses (aiosqlite, psycopg's ``AsyncConnection``)."""
    if url.get_backend_name() == "sqlite":
        import aiosqlite

        lite = await aiosqlite.connect(str(url.database), isolation_level=None)
        messages_sql, calls_sql = FLOOR_MESSAGES.format(p="?"), FLOOR_CALLS.format(p="?")

        async def read_sqlite() -> Any:
            await lite.execute("BEGIN")
            try:
                rows = await (await lite.execute(messages_sql, (conversation,))).fetchall()
                calls = await (await lite.execute(calls_sql, (conversation,))).fetchall()
            finally:
                await lite.execute("COMMIT")
            return floor_messages(list(rows), list(calls), json.loads)

        return AsyncFloor(read_sqlite, lite.close)
    import psycopg

    pg = await psycopg.AsyncConnection.connect(**_pg_connect_args(url))
    await pg.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
    messages_sql, calls_sql = FLOOR_MESSAGES.format(p="%s"), FLOOR_CALLS.format(p="%s")

    async def read_postgres() -> Any:
        async with pg.transaction(), pg.cursor() as cursor:
            rows = await (await cursor.execute(messages_sql, (conversation,))).fetchall()
            calls = await (await cursor.execute(calls_sql, (conversation,))).fetchall()
        return floor_messages(rows, calls, None)

    return AsyncFloor(read_postgres, pg.close)


def _pg_connect_args(url: sa.URL) -> dict[str, Any]:
    return {
        "host": url.host,
        "port": url.port,
        "user": url.username,
        "password": url.password,
        "dbname": url.database,
        "options": str(url.query.get("options", "")),
    }


def floor_reader(url: sa.URL, conversation: str) -> Callable[[], Any]:
    """The floor of ``history(conversation)``: the bare driver's two SELECTs in one read
    transaction, and :func:`floor_messages`."""
    if url.get_backend_name() == "sqlite":
        sqlite = sqlite3.connect(str(url.database), isolation_level=None)
        messages_sql = FLOOR_MESSAGES.format(p="?")
        calls_sql = FLOOR_CALLS.format(p="?")

        def read_sqlite() -> Any:
            sqlite.execute("BEGIN")
            try:
                rows = sqlite.execute(messages_sql, (conversation,)).fetchall()
                calls = sqlite.execute(calls_sql, (conversation,)).fetchall()
            finally:
                sqlite.execute("COMMIT")
            return floor_messages(rows, calls, json.loads)

        return read_sqlite
    import psycopg

    pg = psycopg.connect(**_pg_connect_args(url))
    pg.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    messages_sql = FLOOR_MESSAGES.format(p="%s")
    calls_sql = FLOOR_CALLS.format(p="%s")

    def read_postgres() -> Any:
        with pg.transaction(), pg.cursor() as cursor:
            rows = cursor.execute(messages_sql, (conversation,)).fetchall()
            calls = cursor.execute(calls_sql, (conversation,)).fetchall()
        return floor_messages(rows, calls, None)  # psycopg parses json itself

    return read_postgres


# -- peers -----------------------------------------------------------------------------------


def _like_fsm_on_sqlite(engine: sa.Engine) -> None:
    """Give a peer's SQLite engine fsm's per-connection settings (same durability)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()


def agents_turn_items(tag: str) -> list[Any]:
    """openai-agents' items of one turn: the assistant message, 3 ``function_call``, 3
    ``function_call_output`` (the same calls and results as :func:`make_turn` and RESULTS)."""
    calls = [
        {
            "type": "function_call",
            "call_id": f"call_{tag}_{i}",
            "name": "get_weather",
            "arguments": f'{{"city": "City {i}"}}',
        }
        for i in range(3)
    ]
    outputs = [
        {"type": "function_call_output", "call_id": f"call_{tag}_{i}", "output": RESULTS[i]}
        for i in range(3)
    ]
    return [{"role": "assistant", "content": ""}, *calls, *outputs]


def langchain_turn_messages(tag: str) -> list[Any]:
    """LangChain's messages of one turn: an ``AIMessage`` with 3 ``tool_calls`` and the 3
    ``ToolMessage`` answering them (needs langchain-core)."""
    from langchain_core.messages import AIMessage, ToolMessage

    calls = [
        {"name": "get_weather", "args": {"city": f"City {i}"}, "id": f"call_{tag}_{i}"}
        for i in range(3)
    ]
    results: list[Any] = [
        ToolMessage(content=RESULTS[i], tool_call_id=f"call_{tag}_{i}") for i in range(3)
    ]
    return [AIMessage(content="", tool_calls=calls), *results]


def bench_agents(url: str, turns: int) -> Figures:
    """openai-agents' SQLAlchemySession on the same work."""
    try:
        from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(url)
    except ImportError as exc:
        raise PeerUnavailable(f"{type(exc).__name__}: {exc}") from exc
    if engine.dialect.name == "sqlite":
        _like_fsm_on_sqlite(engine.sync_engine)

    def session() -> Any:
        return SQLAlchemySession(uuid.uuid4().hex, engine=engine, create_tables=True)

    async def run() -> Figures:
        try:
            passes = []
            for p in range(WRITE_PASSES):
                writer = session()
                prepared = [agents_turn_items(f"p{p}r{i}") for i in range(turns)]
                start = time.perf_counter()
                for items in prepared:
                    await writer.add_items(items)
                passes.append((time.perf_counter() - start) / turns)
            write_s = min(passes)

            long = session()
            block = 0
            while (HISTORY_MESSAGES - 100 * block) >= 100:
                user: list[Any] = [{"role": "user", "content": f"question {i}"} for i in range(93)]
                await long.add_items(user + agents_turn_items(f"h{block}"))
                block += 1
            samples = []
            for _ in range(READS):
                begin = time.perf_counter()
                got = await long.get_items()
                samples.append(time.perf_counter() - begin)
            assert len(got) == HISTORY_MESSAGES, len(got)

            orphan = session()
            await orphan.add_items(
                [{"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}]
            )
            stored = await orphan.get_items()
            verdict = "stored" if len(stored) == 1 else f"{len(stored)} items back"
            return Figures(write_s, statistics.median(samples), verdict)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(run())
    except ImportError as exc:  # a driver (aiosqlite, greenlet) imported on first connect
        raise PeerUnavailable(f"{type(exc).__name__}: {exc}") from exc


def bench_langchain(url: sa.URL, turns: int) -> Figures:
    """LangChain's SQLChatMessageHistory on the same work."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # langchain-community's sunset notice
            from langchain_community.chat_message_histories import SQLChatMessageHistory
            from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    except ImportError as exc:
        raise PeerUnavailable(f"{type(exc).__name__}: {exc}") from exc
    engine = sa.create_engine(url)
    if engine.dialect.name == "sqlite":
        _like_fsm_on_sqlite(engine)
    table = f"lc_bench_{uuid.uuid4().hex[:8]}"

    def history() -> Any:
        return SQLChatMessageHistory(uuid.uuid4().hex, table_name=table, connection=engine)

    try:
        passes = []
        for p in range(WRITE_PASSES):
            writer = history()
            prepared = [langchain_turn_messages(f"p{p}r{i}") for i in range(turns)]
            start = time.perf_counter()
            for messages in prepared:
                writer.add_messages(messages)
            passes.append((time.perf_counter() - start) / turns)
        write_s = min(passes)

        long = history()
        for block in range(HISTORY_MESSAGES // 100):
            user: list[BaseMessage] = [HumanMessage(content=f"question {i}") for i in range(96)]
            long.add_messages(user + langchain_turn_messages(f"h{block}"))
        assert len(long.messages) == HISTORY_MESSAGES
        read_s = timed(lambda: long.messages)

        orphan = history()
        orphan.add_messages([ToolMessage(content="x", tool_call_id="call_nowhere")])
        back = orphan.messages
        ok = len(back) == 1 and getattr(back[0], "tool_call_id", None) == "call_nowhere"
        return Figures(write_s, read_s, "stored" if ok else f"{len(back)} messages back")
    except ImportError as exc:  # a driver imported on first connect
        raise PeerUnavailable(f"{type(exc).__name__}: {exc}") from exc
    finally:
        engine.dispose()


def run_peer(run: EngineRun, name: str, fn: Callable[[], Figures]) -> None:
    try:
        run.peers[name] = fn()
    except PeerUnavailable as exc:
        run.peers[name] = str(exc)


# -- PostgreSQL ------------------------------------------------------------------------------


def _postgres_schema(server: str) -> tuple[sa.URL, str, Callable[[], None]]:
    base = normalize_url(server)
    schema = f"fsm_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        version = str(conn.execute(sa.text("SHOW server_version")).scalar()).split()[0]

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))

    return base.update_query_dict({"options": f"-csearch_path={schema}"}), version, drop


# -- report ----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"


def _write(f: Figures) -> str:
    return f"{_ms(f.write_s)}/turn ({1 / f.write_s:,.0f} turns/s)"


def _async_write(f: Figures) -> str:
    assert f.async_write_s is not None
    trips = "" if f.async_round_trips is None else f", {f.async_round_trips} round trip(s)"
    return (
        f"{_ms(f.async_write_s)}/turn ({1 / f.async_write_s:,.0f} turns/s, "
        f"{f.async_statements} statements{trips})"
    )


def report(run: EngineRun) -> None:
    print(f"{run.engine}:")
    print(f"  fsm  write (1 assistant + 3 calls + 3 results): {_write(run.fsm)}")
    if run.fsm.async_write_s is not None:
        print(f"  fsm  write, asyncio store: {_async_write(run.fsm)}")
    print(f"  fsm  history() of {HISTORY_MESSAGES:,} messages: {_ms(run.fsm.read_s)}")
    f = run.fsm
    if f.best_read_s and f.async_read_s and f.floor_read_s:
        print(
            f"  floor (bare driver SELECTs + dicts): {_ms(f.floor_read_s)}; best fsm "
            f"{_ms(f.best_read_s)} -> fsm/floor {f.best_read_s / f.floor_read_s:.2f}"
        )
    if f.async_read_s and f.async_floor_s:
        print(
            f"  asyncio floor: {_ms(f.async_floor_s)}; fsm async {_ms(f.async_read_s)} "
            f"-> fsm/floor {f.async_read_s / f.async_floor_s:.2f}"
        )
    for name in PEERS:
        peer = run.peers.get(name)
        if isinstance(peer, str):
            print(f"  {name}: skipped, not importable ({peer})")
        elif peer is not None:
            print(
                f"  {name}  write: {_write(peer)}"
                f"  -> fsm/peer write time {run.fsm.write_s / peer.write_s:.2f}"
            )
            print(
                f"  {name}  read {HISTORY_MESSAGES:,}: {_ms(peer.read_s)}"
                f"  -> fsm/peer read time {run.fsm.read_s / peer.read_s:.2f}"
            )
    orphans = [f"fsm {run.fsm.orphan}"] + [
        f"{name} {peer.orphan}" for name, peer in run.peers.items() if isinstance(peer, Figures)
    ]
    print(f"  a tool result whose call id points at nothing: {', '.join(orphans)}")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def render_md(
    runs: list[EngineRun],
    turns: int,
    elapsed: float,
    loads: tuple[str, str],
    pg_version: str | None,
    argv: list[str],
) -> str:
    header = ["engine", "workload", "fsm"]
    for name in PEERS:
        header += [name, f"fsm/{name}"]
    lines = [
        SECTION,
        "",
        f"Generated by `python bench/store.py {' '.join(argv)}` on "
        f"{datetime.date.today().isoformat()} in {elapsed:.0f} s. Do not edit by hand: rerun "
        "the script (it replaces this section only).",
        "",
        f"fsm's `ConversationStore` side by side with {PEER_LABELS[AGENTS]} and "
        f"{PEER_LABELS[LANGCHAIN]}, same items: write = one turn (an assistant message with 3 "
        f"tool calls and their 3 results) committed in one transaction, one writer, best of "
        f"{WRITE_PASSES} passes of {turns} turns; read = the whole {HISTORY_MESSAGES:,}-message history (`history()`, "
        f"`get_items()`, `.messages`), median of {READS}. Ratios are fsm's time over the peer's: "
        "above 1, fsm is slower. On SQLite every library gets WAL, `synchronous=NORMAL` and "
        "foreign keys on, each its own file.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    for run in runs:
        for workload in ("write", "read"):
            if workload == "write":
                label = "write, per turn"
                cells = [_ms(run.fsm.write_s)]
            else:
                label = f"read {HISTORY_MESSAGES:,} messages"
                cells = [_ms(run.fsm.read_s)]
            for name in PEERS:
                peer = run.peers.get(name)
                if not isinstance(peer, Figures):
                    cells += ["skipped", "-"]
                    continue
                ours = run.fsm.write_s if workload == "write" else run.fsm.read_s
                theirs = peer.write_s if workload == "write" else peer.read_s
                cells += [_ms(theirs), f"{ours / theirs:.2f}"]
            lines.append("| " + " | ".join([run.engine, label, *cells]) + " |")
        if run.fsm.async_write_s is not None:
            trips = run.fsm.async_round_trips
            label = "write, per turn, asyncio store" + (
                "" if trips is None else f" ({trips} round trip{'s' if trips != 1 else ''})"
            )
            cells = [_ms(run.fsm.async_write_s)] + ["-", "-"] * len(PEERS)
            lines.append("| " + " | ".join([run.engine, label, *cells]) + " |")
    lines.append("")
    lines += async_write_note(runs)
    lines += floor_table(runs)
    orphan = runs[0]
    verdicts = [f"fsm {orphan.fsm.orphan}"] + [
        f"{name} {peer.orphan}" for name, peer in orphan.peers.items() if isinstance(peer, Figures)
    ]
    lines.append(
        "Neither peer enforces anything: each keeps one JSON blob per item, with no link "
        "between a call and its result. Given a tool result whose call id points at nothing: "
        f"{', '.join(verdicts)}. Where fsm is slower, that is the price of an enforced, "
        "relational history (byte-exact calls, each result tied to its call, all-or-nothing "
        "turns, sequence checks)."
    )
    skipped = [
        f"{name} on {run.engine} ({peer})"
        for run in runs
        for name, peer in run.peers.items()
        if isinstance(peer, str)
    ]
    if skipped:
        lines += ["", f"Skipped, not importable: {'; '.join(skipped)}."]
    engines = f"SQLite {sqlite3.sqlite_version}"
    if pg_version:
        engines += f", PostgreSQL {pg_version} (local server)"
    packages = ", ".join(
        f"{dist} {_version(dist)}"
        for dist in (
            "fsm-toolcalls",
            "SQLAlchemy",
            "psycopg",
            "aiosqlite",
            "openai-agents",
            "langchain-community",
            "langchain-core",
        )
    )
    lines += [
        "",
        f"Machine: {_cpu()}, {os.cpu_count()} cores; CPython {platform.python_version()} "
        f"({platform.platform()}); {engines}; load average (1, 5, 15 min) {loads[0]} at the "
        f"start, {loads[1]} at the end. Packages: {packages}.",
    ]
    return "\n".join(lines) + "\n"


def async_write_note(runs: list[EngineRun]) -> list[str]:
    """Why the asyncio store's write costs more than the sync store's where it does (SQLite:
    aiosqlite runs each driver call in its thread), or nothing (the lines, a blank line last)."""
    slow = [
        run
        for run in runs
        if run.engine == "SQLite" and run.fsm.async_write_s and run.fsm.async_statements
        if run.fsm.async_write_s > 1.5 * run.fsm.write_s
    ]
    if not slow:
        return []
    f = slow[0].fsm
    assert f.async_write_s is not None
    agents = slow[0].peers.get(AGENTS)
    peer = (
        f"; {PEER_LABELS[AGENTS]}, asyncio on aiosqlite too, takes {_ms(agents.write_s)}"
        if isinstance(agents, Figures)
        else ""
    )
    return [
        f"The asyncio store's write on SQLite ({_ms(f.async_write_s)} per turn against the sync "
        f"store's {_ms(f.write_s)}{peer}): priced. aiosqlite runs every call of the driver in its "
        "own thread, each call a trip through the event loop, and SQLAlchemy's asyncio "
        "adaptation makes three or four calls per statement (a cursor, execute, the rows, "
        f"close): {f.async_statements} statements per commit (`BEGIN IMMEDIATE` included), then "
        "the COMMIT and the pool's reset, about 18 trips where the sync store makes none. The "
        "same rows and checks; PostgreSQL's asyncio commit is one round trip, as the sync "
        "store's.",
        "",
    ]


def floor_table(runs: list[EngineRun]) -> list[str]:
    """The history reads against their floor (the lines of the Markdown, a blank line last)."""
    lines = [
        f"`history()` of the same {HISTORY_MESSAGES:,} messages against its floor, measured in "
        "the same run: the bare driver (`sqlite3`, `psycopg`) running the same two SELECTs "
        "(messages, then tool calls; in one REPEATABLE READ transaction on PostgreSQL, as fsm's "
        "reads) and building the same dicts with the least code (no check; checked equal to "
        f"fsm's output). Best of {FLOOR_READS} reads each, interleaved; target fsm/floor <= 1.5 (issue 31). "
        "fsm checks what it reads (dense seqs, whole tool blocks, each result answering its "
        "call, finished calls with JSON arguments, value types) and decodes marked text; the "
        "asyncio store runs the same code through `run_sync` and is "
        "compared with the floor through the same asyncio driver (aiosqlite, psycopg's "
        "`AsyncConnection`).",
        "",
        "| engine | store | fsm | floor | fsm/floor |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        f = run.fsm
        if f.floor_read_s is None:
            continue
        for label, value, floor in (
            ("sync", f.best_read_s, f.floor_read_s),
            ("asyncio", f.async_read_s, f.async_floor_s),
        ):
            if value is None or floor is None:
                continue
            lines.append(
                f"| {run.engine} | {label} | {_ms(value)} | {_ms(floor)} | {value / floor:.2f} |"
            )
    slow = [
        run
        for run in runs
        if run.fsm.async_read_s and run.fsm.async_floor_s and run.fsm.best_read_s
        if run.fsm.async_read_s > 1.5 * run.fsm.async_floor_s
    ]
    if slow:
        added = ", ".join(
            f"{run.engine} +{_ms(run.fsm.async_read_s - run.fsm.best_read_s)}" for run in slow
        )
        why = [
            f"Above the target, the asyncio store ({', '.join(run.engine for run in slow)}): "
            "priced. It runs the sync store's reading (the same SELECTs, checks and decoding) in "
            "a greenlet through SQLAlchemy's asyncio adaptation of the driver, which switches to "
            "the event loop for each call of the driver; that costs over the sync store's same "
            f"read: {added}."
        ]
        if any(run.engine == "SQLite" for run in slow):
            why.append(
                "On SQLite each call is also a trip to aiosqlite's thread: four per statement "
                "(the cursor, execute, fetchall, close) where the floor's bare aiosqlite takes "
                "two, about 13 trips per read against the floor's 6."
            )
        lines += ["", " ".join(why)]
    return [*lines, ""]


def write_md(section: str, path: Path = BENCHMARKS, heading: str = SECTION) -> None:
    """Replace the ``heading`` section (by default ``## Store``) of ``path`` (or append it); the
    rest stays byte-identical."""
    replace_section(path, heading, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--postgres", default=os.environ.get("FSM_TEST_POSTGRES_URL"))
    parser.add_argument(
        "--write-md",
        action="store_true",
        help=f"write the results as the '{SECTION}' section of {BENCHMARKS.name}",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_start = _load()
    print(f"load average at the start: {load_start}")

    runs: list[EngineRun] = []
    with tempfile.TemporaryDirectory() as tmp:
        run = EngineRun(
            "SQLite", bench_fsm(sa.make_url(f"sqlite:///{Path(tmp) / 'fsm.db'}"), args.turns)
        )
        agents_db = Path(tmp) / "agents.db"
        run_peer(run, AGENTS, lambda: bench_agents(f"sqlite+aiosqlite:///{agents_db}", args.turns))
        lc_url = sa.make_url(f"sqlite:///{Path(tmp) / 'langchain.db'}")
        run_peer(run, LANGCHAIN, lambda: bench_langchain(lc_url, args.turns))
        report(run)
        runs.append(run)
    pg_version = None
    if args.postgres:
        pg_url, pg_version, drop = _postgres_schema(args.postgres)
        try:
            run = EngineRun("PostgreSQL", bench_fsm(pg_url, args.turns))
            # psycopg 3 serves asyncio too (and, unlike asyncpg, takes the search_path option)
            pg_str = pg_url.render_as_string(hide_password=False)
            run_peer(run, AGENTS, lambda: bench_agents(pg_str, args.turns))
            run_peer(run, LANGCHAIN, lambda: bench_langchain(pg_url, args.turns))
            report(run)
            runs.append(run)
        finally:
            drop()
    else:
        print("PostgreSQL: skipped (pass --postgres URL or set FSM_TEST_POSTGRES_URL)")
    load_end = _load()
    elapsed = time.perf_counter() - started
    print(f"load average at the end: {load_end}; total {elapsed:.0f} s")
    if args.write_md:
        shown = ["--write-md"] + (["--postgres URL"] if args.postgres else [])
        if args.turns != 300:
            shown.insert(0, f"--turns {args.turns}")
        section = render_md(runs, args.turns, elapsed, (load_start, load_end), pg_version, shown)
        write_md(section)
        print(f"wrote the '{SECTION}' section of {BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
