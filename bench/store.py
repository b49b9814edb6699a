"""Benchmark of the conversation store: commit throughput and history() of a long conversation.

Measures, on SQLite (a file in a temporary directory) and on PostgreSQL (when ``--postgres URL``
or ``$FSM_TEST_POSTGRES_URL`` names a server; a throwaway schema is used and dropped):

* commit throughput: turns per second for a turn of one assistant message with 3 tool calls and
  their 3 results (each commit its own transaction, one writer);
* ``history()`` of a 10,000-message conversation (median of several reads).

If ``openai-agents`` is installed (``pip install openai-agents aiosqlite greenlet``), its
``SQLAlchemySession`` is measured on the same work (the 7 items of a turn added with one
``add_items`` call, and ``get_items()`` of a 10,000-item session) and the ratios are printed.
Otherwise only fsm's figures are printed, and the script says so. The peer stores one JSON blob
per item and checks nothing: the ratio is the price of an enforced, relational history.

Usage::

    python bench/store.py [--turns 300] [--postgres postgresql+psycopg://postgres@localhost/test]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fsm import parse
from fsm.parser import Turn
from fsm.store import ConversationStore, upgrade
from fsm.store.engine import normalize_url

HISTORY_MESSAGES = 10_000


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


def timed(fn: Callable[[], object], repeat: int = 5) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_fsm(url: sa.URL, turns: int) -> dict[str, float]:
    upgrade(url)
    with ConversationStore(url) as store:
        conv = store.create_conversation()
        prepared = [make_turn(3, f"r{i}") for i in range(turns)]
        results = ["sunny, 18 C", "rain, 11 C", "snow, -2 C"]
        start = time.perf_counter()
        for turn in prepared:
            store.commit_turn(conv, turn, results)
        commit_rate = turns / (time.perf_counter() - start)

        long = store.create_conversation()
        block = 0
        while store.next_seq(long) < HISTORY_MESSAGES - 8:
            store.append(long, [{"role": "user", "content": f"question {i}"} for i in range(96)])
            store.commit_turn(long, make_turn(3, f"h{block}"), results)
            block += 1
        rest = HISTORY_MESSAGES - store.next_seq(long)
        store.append(long, [{"role": "user", "content": "q"} for _ in range(rest)])
        assert len(store.history(long)) == HISTORY_MESSAGES
        history_s = timed(lambda: store.history(long))
    return {"commit_turns_per_s": commit_rate, "history_10k_s": history_s}


def bench_agents(url: str, turns: int) -> dict[str, float] | None:
    """openai-agents' SQLAlchemySession on the same work, or None if it is not installed."""
    try:
        from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
    except ImportError:
        return None

    async def run() -> dict[str, float]:
        session = SQLAlchemySession.from_url(uuid.uuid4().hex, url=url, create_tables=True)
        items: list[Any] = [
            {
                "type": "function_call",
                "call_id": f"c{i}",
                "name": "get_weather",
                "arguments": '{"city": "x"}',
            }
            for i in range(3)
        ]
        items = [{"role": "assistant", "content": ""}, *items] + [
            {"type": "function_call_output", "call_id": f"c{i}", "output": "sunny"}
            for i in range(3)
        ]
        start = time.perf_counter()
        for _ in range(turns):
            await session.add_items(items)
        rate = turns / (time.perf_counter() - start)
        long = SQLAlchemySession.from_url(uuid.uuid4().hex, url=url, create_tables=True)
        batch: list[Any] = [{"role": "user", "content": "q"}] * 1000
        for _ in range(HISTORY_MESSAGES // 1000):
            await long.add_items(batch)
        samples = []
        for _ in range(5):
            begin = time.perf_counter()
            got = await long.get_items()
            samples.append(time.perf_counter() - begin)
        assert len(got) == HISTORY_MESSAGES
        return {"commit_turns_per_s": rate, "history_10k_s": statistics.median(samples)}

    return asyncio.run(run())


def _postgres_schema(server: str) -> tuple[sa.URL, Callable[[], None]]:
    base = normalize_url(server)
    schema = f"fsm_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))

    return base.update_query_dict({"options": f"-csearch_path={schema}"}), drop


def report(engine: str, ours: dict[str, float], peer: dict[str, float] | None) -> None:
    print(f"{engine}:")
    print(
        f"  commit (1 assistant + 3 calls + 3 results): {ours['commit_turns_per_s']:8.0f} turns/s"
    )
    print(
        f"  history() of {HISTORY_MESSAGES:,} messages:        {ours['history_10k_s'] * 1000:8.1f} ms"
    )
    if peer is not None:
        print(
            f"  openai-agents SQLAlchemySession:            {peer['commit_turns_per_s']:8.0f} turns/s"
            f"  -> fsm/peer throughput {ours['commit_turns_per_s'] / peer['commit_turns_per_s']:.2f}"
        )
        print(
            f"  openai-agents get_items() of {HISTORY_MESSAGES:,} items:  "
            f"{peer['history_10k_s'] * 1000:8.1f} ms"
            f"  -> fsm/peer time {ours['history_10k_s'] / peer['history_10k_s']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--postgres", default=os.environ.get("FSM_TEST_POSTGRES_URL"))
    args = parser.parse_args(argv)

    agents_missing = False
    with tempfile.TemporaryDirectory() as tmp:
        url = sa.make_url(f"sqlite:///{Path(tmp) / 'bench.db'}")
        ours = bench_fsm(url, args.turns)
        peer = bench_agents(f"sqlite+aiosqlite:///{Path(tmp) / 'agents.db'}", args.turns)
        agents_missing = peer is None
        report("SQLite", ours, peer)
    if args.postgres:
        pg_url, drop = _postgres_schema(args.postgres)
        try:
            ours = bench_fsm(pg_url, args.turns)
            peer = None
            if not agents_missing:
                # psycopg 3 serves asyncio too (and, unlike asyncpg, takes the search_path option)
                peer = bench_agents(pg_url.render_as_string(hide_password=False), args.turns)
            report("PostgreSQL", ours, peer)
        finally:
            drop()
    else:
        print("PostgreSQL: skipped (pass --postgres URL or set FSM_TEST_POSTGRES_URL)")
    if agents_missing:
        print(
            "openai-agents is not installed: fsm's figures only (pip install openai-agents for ratios)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
