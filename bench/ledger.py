"""Benchmark: the tool ledger's cost per turn against ``commit_turn`` (issue 27 item 6).

Run from the repository root::

    python bench/ledger.py                       # SQLite (a temporary file), 150 turns each
    python bench/ledger.py --url postgresql+psycopg://postgres@127.0.0.1/test   # own schema
    python bench/ledger.py --turns 300 --json    # one JSON object on stdout

One writer, one process, the two paths alternating by round on conversations of their own, the
same turn (two tool calls, as the demo's ``add`` and ``multiply``) and the same results:

* **commit_turn**: ``append`` the user message, then ``commit_turn(turn, results)`` (the plain
  agent loop: the tools run between the stream and the commit, with nothing stored meanwhile);
* **ledger**: ``append``, then what ``run_agent_loop(ledger=True)`` does: ``begin`` with the
  first call started, the heartbeat around the tools, each outcome recorded with the next
  call's ``started``, the last with the ``commit`` (4 transactions for 2 calls);
* **ledger_steps**: the same with every step its own transaction (``begin``, ``started`` and
  ``succeeded`` per call, ``commit``: 6 transactions), as a caller of the plain steps does.

The tools do nothing (their time is not the store's). ``ms/turn`` is the wall time of a round
divided by its turns; the figure is the median of ``--rounds`` rounds. ``transactions/turn``
and ``statements/turn`` count one turn's transactions and statements (``append`` included),
from the engine's events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from fsm.api import parse_file
from fsm.replay import EXAMPLES_DIR
from fsm.store import ConversationStore, upgrade
from fsm.store.ledger import Outcome

TURN = parse_file(EXAMPLES_DIR / "parallel_add_multiply.sse").turn(0)
RESULTS = ["6912", "408"]
USER = {"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}


def _plain(store: ConversationStore, cid: str) -> None:
    store.append(cid, [USER])
    store.commit_turn(cid, TURN, RESULTS)


def _ledger(store: ConversationStore, cid: str) -> None:
    """As the agent loop runs a turn: begin with the first call started, each outcome
    recorded with the next start, the last with the commit."""
    store.append(cid, [USER])
    pending = store.begin(cid, TURN, start=0)
    with store.heartbeat(pending):
        owed = None
        for position, result in enumerate(RESULTS):
            if position:
                pending = store.started(pending, position, recording=owed)
            owed = Outcome(position, result=result)
        store.commit(pending, recording=owed)


def _ledger_steps(store: ConversationStore, cid: str) -> None:
    """Every step in a transaction of its own (begin, started, succeeded, ..., commit)."""
    store.append(cid, [USER])
    pending = store.begin(cid, TURN)
    with store.heartbeat(pending):
        for position, result in enumerate(RESULTS):
            pending = store.started(pending, position)
            pending = store.succeeded(pending, position, result)
    store.commit(pending)


PATHS = {"commit_turn": _plain, "ledger": _ledger, "ledger_steps": _ledger_steps}


def _round(store: ConversationStore, path: str, turns: int, tag: str) -> float:
    cids = [store.create_conversation() for _ in range(turns)]
    run = PATHS[path]
    started = time.perf_counter()
    for cid in cids:
        run(store, cid)
    return (time.perf_counter() - started) / turns * 1000


def _counts(store: ConversationStore, path: str) -> tuple[int, int]:
    """The write transactions and the statements of one turn."""
    cid = store.create_conversation()
    count = {"begin": 0, "statements": 0}

    def begun(_conn: Any) -> None:
        count["begin"] += 1

    def statement(*_args: Any) -> None:
        count["statements"] += 1

    event.listen(store.engine, "begin", begun)
    event.listen(store.engine, "before_cursor_execute", statement)
    try:
        PATHS[path](store, cid)
    finally:
        event.remove(store.engine, "begin", begun)
        event.remove(store.engine, "before_cursor_execute", statement)
    return count["begin"], count["statements"]


def measure(url: str, turns: int, rounds: int) -> dict[str, Any]:
    with ConversationStore(url) as store:
        for path in PATHS:  # warm-up
            _round(store, path, 5, "warm")
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for r in range(rounds):
            for path in PATHS:
                times[path].append(_round(store, path, turns, f"r{r}"))
        out: dict[str, Any] = {"engine": sa.make_url(url).get_backend_name(), "turns": turns}
        for path in PATHS:
            transactions, statements = _counts(store, path)
            out[path] = {
                "ms_per_turn": round(statistics.median(times[path]), 3),
                "transactions_per_turn": transactions,
                "statements_per_turn": statements,
            }
        base = out["commit_turn"]["ms_per_turn"]
        out["ratio"] = round(out["ledger"]["ms_per_turn"] / base, 2)
        out["ratio_steps"] = round(out["ledger_steps"]["ms_per_turn"] / base, 2)
        return out


@contextmanager
def _schema(server: str) -> Iterator[str]:
    """A new schema on the PostgreSQL ``server``, at head, dropped afterwards: its URL."""
    schema = f"fsm_bench_ledger_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = (
            sa.make_url(server)
            .update_query_dict({"options": f"-csearch_path={schema}"})
            .render_as_string(hide_password=False)
        )
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a database URL (default: a temporary SQLite file)")
    parser.add_argument("--turns", type=int, default=150, help="turns per round (default 150)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per path (default 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.url and sa.make_url(args.url).get_backend_name() == "postgresql":
            with _schema(args.url) as url:
                result = measure(url, args.turns, args.rounds)
        else:
            url = args.url or f"sqlite:///{Path(tmp) / 'bench.db'}"
            result = measure(url, args.turns, args.rounds)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['engine']}, one writer, {result['turns']} turns per round (2 calls each)")
    for path in PATHS:
        r = result[path]
        print(
            f"  {path:12} {r['ms_per_turn']:8.2f} ms/turn  "
            f"{r['transactions_per_turn']} transactions, {r['statements_per_turn']} statements/turn"
        )
    print(
        f"  ledger / commit_turn: {result['ratio']:.2f}x "
        f"(every step its own transaction: {result['ratio_steps']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
