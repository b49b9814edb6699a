"""Benchmark: what the recording proxy's writes add to a conversation's latency (issue 30).

Run from the repository root::

    python bench/proxy.py                       # SQLite (a temporary file), 20 conversations
    python bench/proxy.py --url postgresql+psycopg://postgres@127.0.0.1/test   # own schema
    python bench/proxy.py --json                # one JSON object on stdout

Each conversation is the demo's: a request, a response with two tool calls (pending in the
ledger), the request carrying their results, the final answer. Through the async store, one
conversation at a time, the upstream an in-memory iterator of the demo recordings' events, so
only the proxy's own work is timed:

* **tool-call response, last piece**: how long the piece that ends a tool-call response waits
  before it is forwarded (``begin`` with the first call started, the second ``started``, the
  lease released: 3 transactions);
* **final answer, last piece**: the same for a final answer (``commit_turn``);
* **record_request closing the turn**: the request with the results, before it goes upstream
  (read the pending turn, ``claim``, the outcomes, ``commit``, the next seq).

Every other piece is forwarded as soon as the parser has read it. The figures are medians in
milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fsm.integrations.proxy import record_request, record_stream
from fsm.replay import EXAMPLES_DIR, split_events
from fsm.store import upgrade
from fsm.store.aio import AsyncConversationStore

FIRST = split_events((EXAMPLES_DIR / "parallel_add_multiply.sse").read_bytes())
FINAL = split_events((EXAMPLES_DIR / "final_answer.sse").read_bytes())
USER = {"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}


async def _upstream(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


async def _slowest_piece(
    store: AsyncConversationStore, cid: str, events: list[bytes], seq: int
) -> float:
    """The longest wait for one forwarded piece of the response, in ms."""
    pieces = record_stream(_upstream(events), store, cid, expected_seq=seq)
    waits = []
    while True:
        started = time.perf_counter()
        try:
            await anext(pieces)
        except StopAsyncIteration:
            break
        waits.append((time.perf_counter() - started) * 1000)
    return max(waits)


async def measure(url: str, conversations: int) -> dict[str, Any]:
    tool, final, close = [], [], []
    async with AsyncConversationStore(url) as store:
        for n in range(conversations):
            cid = f"bench-proxy-{time.time_ns()}-{n}"
            seq = await record_request(store, cid, [USER])
            tool.append(await _slowest_piece(store, cid, FIRST, seq))
            pending = await store.pending(cid)
            assert pending is not None
            answered = [USER, pending.to_message()] + [
                {"role": "tool", "tool_call_id": c.id, "content": "1"} for c in pending.calls
            ]
            started = time.perf_counter()
            seq = await record_request(store, cid, answered)
            close.append((time.perf_counter() - started) * 1000)
            final.append(await _slowest_piece(store, cid, FINAL, seq))
    return {
        "engine": sa.make_url(url).get_backend_name(),
        "conversations": conversations,
        "tool_call_last_piece_ms": round(statistics.median(tool), 1),
        "final_answer_last_piece_ms": round(statistics.median(final), 1),
        "record_request_close_ms": round(statistics.median(close), 1),
    }


@contextmanager
def _schema(server: str) -> Iterator[str]:
    """A new schema on the PostgreSQL ``server``, at head, dropped afterwards: its URL."""
    schema = f"fsm_bench_proxy_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = sa.make_url(server).update_query_dict({"options": f"-csearch_path={schema}"})
        rendered = url.render_as_string(hide_password=False)
        upgrade(rendered)
        yield rendered
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a database URL (default: a temporary SQLite file)")
    parser.add_argument("--conversations", type=int, default=20, help="default 20")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.url and sa.make_url(args.url).get_backend_name() == "postgresql":
            with _schema(args.url) as url:
                result = asyncio.run(measure(url, args.conversations))
        else:
            url = args.url or f"sqlite:///{Path(tmp) / 'bench.db'}"
            upgrade(url)
            result = asyncio.run(measure(url, args.conversations))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['engine']}, {result['conversations']} conversations, medians:")
    print(f"  tool-call response, last piece  {result['tool_call_last_piece_ms']:7.1f} ms")
    print(f"  final answer, last piece        {result['final_answer_last_piece_ms']:7.1f} ms")
    print(f"  record_request closing the turn {result['record_request_close_ms']:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
