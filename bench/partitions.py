"""At what size fsm's hash partitions pay their way, and what JIT cost the store's reads.

For each size (``--calls``) and partition count (``--partitions``, 0: unpartitioned) a new
schema is created on the server (``fsm db upgrade --partitions N``), seeded with
``bench/seed.py``, and timed with the store's own calls, median of ``--reps`` runs each:

* ``list_conversations(limit=100)``: with fsm's settings (``jit = off`` in every transaction of
  the store) and with JIT on as before (a second ``SET LOCAL jit = on`` after fsm's);
* ``history(conversation)`` of a random conversation;
* ``commit_turn`` of a one-call turn to a new conversation.

Usage::

    python bench/partitions.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        --calls 20000,200000 --partitions 0,16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fsm import parse
from fsm.store import ConversationStore, upgrade
from fsm.store.engine import normalize_url

HERE = Path(__file__).resolve().parent


def _seed_module() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_seed", HERE / "seed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _turn(n: int) -> Any:
    """A complete one-call turn, parsed by the real parser."""
    call = {
        "index": 0,
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    chunks = [
        {"id": f"r{n}", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
        {"id": f"r{n}", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    return parse(chunks).turn(0)


def _median_ms(run: Callable[[], object], reps: int) -> float:
    run()  # warm: connections, plans
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure(server: sa.URL, calls: int, partitions: int, reps: int) -> dict[str, Any]:
    schema = f"fsm_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = server.update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        upgrade(url, partitions=partitions or None)
        _seed_module().seed(url, calls)
        with ConversationStore(url) as store:
            convs = [c.id for c in store.list_conversations(limit=None)]
            rng = random.Random(0)
            row: dict[str, Any] = {"calls": calls, "partitions": partitions}
            row["conversations"] = len(convs)
            row["list_jit_off_ms"] = _median_ms(lambda: store.list_conversations(limit=100), reps)

            def jit_on(connection: Any) -> None:
                connection.exec_driver_sql("SET LOCAL jit = on")

            sa.event.listen(store.engine, "begin", jit_on)
            try:
                row["list_jit_on_ms"] = _median_ms(
                    lambda: store.list_conversations(limit=100), reps
                )
            finally:
                sa.event.remove(store.engine, "begin", jit_on)
            row["history_ms"] = _median_ms(lambda: store.history(rng.choice(convs)), reps)
            counter = iter(range(10**9))

            def commit() -> None:
                n = next(counter)
                conv = store.create_conversation(f"bench-{n}")
                store.commit_turn(conv, _turn(n), ["ok"])

            row["commit_ms"] = _median_ms(commit, reps)
        return row
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", default=os.environ.get("FSM_TEST_POSTGRES_URL"), metavar="URL")
    parser.add_argument("--calls", default="20000,200000", help="sizes, comma-separated")
    parser.add_argument("--partitions", default="0,16", help="partition counts (0: none)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if not args.db:
        parser.error("give --db (a PostgreSQL server URL) or set FSM_TEST_POSTGRES_URL")
    server = normalize_url(args.db)
    columns = (
        "calls",
        "partitions",
        "conversations",
        "list_jit_off_ms",
        "list_jit_on_ms",
        "history_ms",
        "commit_ms",
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for calls in (int(c) for c in args.calls.split(",")):
        for partitions in (int(p) for p in args.partitions.split(",")):
            row = measure(server, calls, partitions, args.reps)
            cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
