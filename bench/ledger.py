"""Benchmark: the tool ledger's cost per turn against ``commit_turn`` (issue 27 item 6).

Run from the repository root::

    python bench/ledger.py                       # SQLite (a temporary file), 150 turns each
    python bench/ledger.py --url postgresql+psycopg://postgres@127.0.0.1/test   # own schema
    python bench/ledger.py --turns 300 --json    # one JSON object on stdout
    python bench/ledger.py --url postgresql+psycopg://postgres@127.0.0.1/test --write-md

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

Where the time goes (``steps``): each store call of the two paths timed on its own over one
more round (``append``, ``begin``, ``started``, ``commit``; ``append``, ``commit_turn``), split
into the time inside the driver's statements (SQLAlchemy's ``before_cursor_execute`` to
``after_cursor_execute``) and the rest (fsm's and SQLAlchemy's Python, the pool, the
transaction's ``COMMIT``). ``--write-md`` runs SQLite and, with ``--url``, PostgreSQL and
writes the "## Tool ledger" section of BENCHMARKS.md: the figures, and the agent loop's default
they decide (issue 31: the ledger by default once a ledger turn costs at most 2x a plain
commit, on every engine: one default for every store).

``--writers N`` (say 16) measures how each path scales: N writer processes (and then one), each
running its turns on conversations of its own, started together; turns/s over the wall time
from the start to the last writer's end, each turn's latency (p50, p99), and the scaling
(turns/s with N writers over turns/s with one). The ledger scales no worse than ``commit_turn``
when its scaling is at least ``commit_turn``'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
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

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # imported as bench.ledger (the tests)
    sys.path.insert(0, str(HERE))

from mdsection import replace_section  # noqa: E402

from fsm.api import parse_file  # noqa: E402
from fsm.replay import EXAMPLES_DIR  # noqa: E402
from fsm.store import ConversationStore, upgrade  # noqa: E402
from fsm.store.ledger import Outcome  # noqa: E402

BENCHMARKS = HERE.parent / "BENCHMARKS.md"
SECTION = "## Tool ledger"
#: the agent loop uses the ledger by default once a ledger turn costs at most this many plain
#: commits on every engine (issue 31)
DEFAULT_BOUND = 2.0

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


class _Clock:
    """The time inside the driver's statements while it is attached to an engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine, self.inside, self._at = engine, 0.0, 0.0

    def __enter__(self) -> _Clock:
        event.listen(self.engine, "before_cursor_execute", self._before)
        event.listen(self.engine, "after_cursor_execute", self._after)
        return self

    def __exit__(self, *_exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._before)
        event.remove(self.engine, "after_cursor_execute", self._after)

    def _before(self, *_args: Any) -> None:
        self._at = time.perf_counter()

    def _after(self, *_args: Any) -> None:
        self.inside += time.perf_counter() - self._at


def steps(store: ConversationStore, turns: int) -> dict[str, dict[str, float]]:
    """Each store call of a ledger turn and of a plain turn, timed on its own over ``turns``
    turns: ms per call, and ms of it inside the driver's statements."""
    totals: dict[str, list[float]] = {}

    def timed(name: str, clock: _Clock, call: Any, *args: Any, **kwargs: Any) -> Any:
        inside, started = clock.inside, time.perf_counter()
        result = call(*args, **kwargs)
        spent = totals.setdefault(name, [0.0, 0.0])
        spent[0] += time.perf_counter() - started
        spent[1] += clock.inside - inside
        return result

    cids = [store.create_conversation() for _ in range(2 * turns)]
    with _Clock(store.engine) as clock:
        for i in range(turns):
            cid = cids[i]
            timed("ledger: append", clock, store.append, cid, [USER])
            pending = timed("ledger: begin", clock, store.begin, cid, TURN, start=0)
            with store.heartbeat(pending):
                pending = timed(
                    "ledger: started", clock, store.started, pending, 1,
                    recording=Outcome(0, result=RESULTS[0]),
                )  # fmt: skip
                timed(
                    "ledger: commit", clock, store.commit, pending,
                    recording=Outcome(1, result=RESULTS[1]),
                )  # fmt: skip
            cid = cids[turns + i]
            timed("commit_turn: append", clock, store.append, cid, [USER])
            timed("commit_turn: commit_turn", clock, store.commit_turn, cid, TURN, RESULTS)
    return {
        name: {"ms": round(wall / turns * 1000, 3), "driver_ms": round(inside / turns * 1000, 3)}
        for name, (wall, inside) in totals.items()
    }


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
        out["steps"] = steps(store, turns)
        return out


# -- BENCHMARKS.md -------------------------------------------------------------------------------
def default_verdict(results: list[dict[str, Any]]) -> str:
    """The agent loop's default the figures decide (see :data:`DEFAULT_BOUND`)."""
    above = [r for r in results if r["ratio"] > DEFAULT_BOUND]
    if not above:
        return (
            f"Every engine is within {DEFAULT_BOUND:g}x: the agent loop's default can be the "
            "ledger."
        )
    names = ", ".join(f"{_ENGINES[r['engine']]} {r['ratio']:.2f}x" for r in above)
    return (
        f"Above {DEFAULT_BOUND:g}x: {names}. The agent loop's default stays `ledger=False` on "
        "every engine (one default for every store: a loop that moves from SQLite to "
        "PostgreSQL keeps its behaviour); pass `ledger=True` for tools with side effects. "
        "Priced: a ledger turn is durable at each step (the pending turn before the first tool, "
        "each outcome before the next tool starts, then the commit: 4 transactions with the "
        "user's message against `commit_turn`'s 2), and the steps above show where the time "
        "goes: on SQLite each transaction takes the database's write lock and commits to the "
        "WAL, and most of each step is Python (fsm's and SQLAlchemy's), not the driver."
    )


_ENGINES = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}


def render_md(results: list[dict[str, Any]], argv: list[str], rounds: int) -> str:
    """The "## Tool ledger" section of BENCHMARKS.md."""
    lines = [
        SECTION,
        "",
        f"Generated by `python bench/ledger.py {' '.join(argv)}` on "
        f"{datetime.date.today().isoformat()}. Do not edit by hand: rerun the script (it "
        "replaces this section only).",
        "",
        "One writer, one process: a turn of two tool calls stored by `commit_turn` (the plain "
        "agent loop: the user's message, then the turn with its results), by the ledger as "
        "`run_agent_loop(ledger=True)` does (the user's message, `begin` with the first call "
        "started, each outcome recorded with the next start, the last with the commit), and by "
        "the ledger with every step its own transaction. Median of "
        f"{rounds} rounds, the paths alternating; ratios are over `commit_turn`'s time.",
        "",
        "| engine | path | ms/turn | transactions | statements | / commit_turn |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        base = r["commit_turn"]["ms_per_turn"]
        for path in PATHS:
            m = r[path]
            lines.append(
                f"| {_ENGINES[r['engine']]} | {path} | {m['ms_per_turn']:.2f} | "
                f"{m['transactions_per_turn']} | {m['statements_per_turn']} | "
                f"{m['ms_per_turn'] / base:.2f} |"
            )
    lines += [
        "",
        "Where the time goes: each store call timed on its own over one more round (ms per "
        "call; in the driver: inside its statements, the rest is Python, the pool and the "
        "transaction's COMMIT).",
        "",
        "| engine | call | ms | in the driver |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        for name, m in r["steps"].items():
            lines.append(
                f"| {_ENGINES[r['engine']]} | {name} | {m['ms']:.3f} | {m['driver_ms']:.3f} |"
            )
    return "\n".join([*lines, "", default_verdict(results), ""])


# -- many writers ------------------------------------------------------------------------------
def _writer(url: str, path: str, turns: int, barrier: Any, queue: Any) -> None:
    """One writer process: ``turns`` turns of ``path`` on conversations of its own, timed."""
    with ConversationStore(url) as store:
        cids = [store.create_conversation() for _ in range(turns)]
        PATHS[path](store, store.create_conversation())  # warm: statements compiled
        barrier.wait()
        latencies, errors = [], 0
        for cid in cids:
            started = time.perf_counter()
            try:
                PATHS[path](store, cid)
            except Exception as exc:  # a typed store error under contention: counted, named
                errors += 1
                print(f"{path}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            latencies.append(time.perf_counter() - started)
        queue.put((latencies, errors))


def _writers(url: str, path: str, writers: int, turns: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(writers + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(url, path, turns, barrier, queue)) for _ in range(writers)
    ]
    for proc in procs:
        proc.start()
    barrier.wait()
    started = time.perf_counter()
    results = [queue.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - started
    for proc in procs:
        proc.join()
    latencies = sorted(x for lat, _ in results for x in lat)
    done = len(latencies)

    def at(q: float) -> float:
        return round(latencies[min(done - 1, int(q * done))] * 1000, 2) if done else float("nan")

    return {
        "turns_per_s": round(done / wall, 1),
        "p50_ms": at(0.50),
        "p99_ms": at(0.99),
        "errors": sum(e for _, e in results),
    }


def scaling(url: str, writers: int, turns: int) -> dict[str, Any]:
    """Each of commit_turn and the ledger with ``writers`` writer processes and with one."""
    out: dict[str, Any] = {"engine": sa.make_url(url).get_backend_name(), "writers": writers}
    for path in ("commit_turn", "ledger"):
        one = _writers(url, path, 1, turns)
        many = _writers(url, path, writers, turns)
        out[path] = {
            "one": one,
            "many": many,
            "scaling": round(many["turns_per_s"] / one["turns_per_s"], 2),
        }
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
    parser.add_argument(
        "--write-md",
        action="store_true",
        help=f"SQLite and (with a PostgreSQL --url) PostgreSQL, written as the '{SECTION}' "
        f"section of {BENCHMARKS.name}",
    )
    parser.add_argument(
        "--writers", type=int, default=0, help="measure scaling with this many writer processes"
    )
    args = parser.parse_args(argv)

    def run(url: str) -> dict[str, Any]:
        if args.writers:
            return scaling(url, args.writers, args.turns)
        return measure(url, args.turns, args.rounds)

    postgres = bool(args.url) and sa.make_url(args.url).get_backend_name() == "postgresql"
    if args.write_md:
        if args.writers:
            parser.error("--write-md measures one writer: drop --writers")
        results = [_on_sqlite(None, run)] + ([_on_postgres(args.url, run)] if postgres else [])
        for result in results:
            _print(result)
        shown = [f"--turns {args.turns}", f"--rounds {args.rounds}", "--write-md"]
        if postgres:
            shown.insert(0, "--url URL")
        replace_section(BENCHMARKS, SECTION, render_md(results, shown, args.rounds))
        print(f"wrote the '{SECTION}' section of {BENCHMARKS}")
        return 0
    result = _on_postgres(args.url, run) if postgres else _on_sqlite(args.url, run)
    if args.json:
        print(json.dumps(result))
        return 0
    if args.writers:
        print(
            f"{result['engine']}, {args.writers} writer processes vs one, {args.turns} turns each"
        )
        for path in ("commit_turn", "ledger"):
            r = result[path]
            for n, key in ((1, "one"), (args.writers, "many")):
                m = r[key]
                print(
                    f"  {path:12} {n:3} writers {m['turns_per_s']:9.1f} turns/s  p50 "
                    f"{m['p50_ms']:7.2f} ms  p99 {m['p99_ms']:8.2f} ms  errors {m['errors']}"
                )
            print(f"  {path:12} scaling {r['scaling']:.2f}")
        return 0
    _print(result)
    return 0


def _on_sqlite(url: str | None, run: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = url or f"sqlite:///{Path(tmp) / 'bench.db'}"
        upgrade(url)
        return dict(run(url))


def _on_postgres(server: str, run: Any) -> dict[str, Any]:
    with _schema(server) as url:
        return dict(run(url))


def _print(result: dict[str, Any]) -> None:
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
    for name, m in result["steps"].items():
        print(f"  {name:26} {m['ms']:7.3f} ms, in the driver {m['driver_ms']:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
