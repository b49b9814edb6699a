"""Soak test of the conversation store: a mixed load from several processes, then a full check.

Each process, until the time is up (or for a number of rounds), repeats a round of:

* a turn committed to the conversation **shared** by all processes, optimistically: read
  ``next_seq``, commit with ``expected_seq``, retry on :class:`~fsm.store.ConflictError` (and on
  :class:`~fsm.store.StoreBusyError`, SQLite's lock timeout);
* a turn committed to the process's **private** conversation (0 to 3 tool calls, empty and
  repeated call ids included);
* now and then: an idempotent retry of a committed turn (a lost acknowledgement: it must write
  nothing and return the stored turn), a user message appended to the shared conversation, an
  incomplete turn (truncated arguments) that ``commit_turn`` refuses and that is recorded as an
  attempt instead, and a read of the shared history (a window, then all of it).

Every process reports what it got acknowledged (conversation, response id, seq). Afterwards the
store is verified: each acknowledged turn is present exactly once at its seq, nothing that was
not acknowledged is present (no refused turn, no duplicate), seqs are dense, every attempt is
there, and :func:`fsm.store.audit.check` finds no violation. Prints turns/s, the conflict rate,
retries and the p50 / p99 latency of a commit.

Usage::

    python bench/soak.py --db sqlite:///soak.db --seconds 60 --procs 4
    python bench/soak.py --db postgresql+psycopg://postgres@localhost/test --seconds 60 --scratch

``--scratch`` works in a throwaway schema (PostgreSQL) or temporary file (SQLite; also the
default when ``--db`` is omitted), dropped afterwards. Otherwise the run's conversations (named
``soak-<run>-...``) stay in the database given; it must be at the current schema revision
(``fsm db upgrade --db URL``). Exits 1 if the verification finds anything.

``tests/store/test_load.py`` runs the same workload for a fixed number of rounds.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from fsm import parse
from fsm.errors import IncompleteTurnError
from fsm.parser import Turn
from fsm.store import ConflictError, ConversationStore, StoreBusyError, audit, upgrade
from fsm.store.engine import normalize_url

__all__ = ["Report", "Summary", "run", "verify", "worker"]


def build_turn(
    response_id: str, n_calls: int, *, complete: bool = True, model: str = "soak-model"
) -> Turn:
    """A turn parsed by the real parser: ``n_calls`` calls (ids ``""`` and repeated ones among
    them); ``complete=False`` cuts the last call's arguments (finish reason ``length``)."""
    chunks: list[dict[str, Any]] = [
        {
            "id": response_id,
            "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": response_id}}],
        }
    ]
    for index in range(n_calls):
        call_id = ("" if index == 1 else "call_dup") if index else f"call_{response_id}"
        arguments = f'{{"turn": "{response_id}", "k": {index}}}'
        if not complete and index == n_calls - 1:
            arguments = arguments[:-3]
        header = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": f"tool{index}", "arguments": arguments},
        }
        chunks.append(
            {
                "id": response_id,
                "model": model,
                "choices": [{"index": 0, "delta": {"tool_calls": [header]}}],
            }
        )
    finish = "tool_calls" if n_calls else "stop"
    chunks.append(
        {
            "id": response_id,
            "model": model,
            "choices": [
                {"index": 0, "delta": {}, "finish_reason": finish if complete else "length"}
            ],
        }
    )
    return parse(chunks).turn(0)


@dataclass
class Report:
    """What one process did and got acknowledged."""

    proc: int
    acked: list[tuple[str, str, int]] = field(default_factory=list)  # (conv, response id, seq)
    appended: dict[str, int] = field(default_factory=dict)  # conv -> user messages acknowledged
    refused: list[str] = field(default_factory=list)  # response ids of incomplete turns
    attempts: int = 0
    commits: int = 0  # acknowledged commit_turn calls that wrote (created)
    conflicts: int = 0
    busy: int = 0
    retries: int = 0  # idempotent retries (created=False, as they must be)
    reads: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds per successful commit_turn
    errors: list[str] = field(default_factory=list)


def _commit_shared(
    store: ConversationStore, conv: str, turn: Turn, results: list[str], report: Report
) -> int:
    while True:
        seq = store.next_seq(conv)
        started = time.perf_counter()
        try:
            committed = store.commit_turn(conv, turn, results, expected_seq=seq)
        except ConflictError:
            report.conflicts += 1
            continue
        except StoreBusyError:
            report.busy += 1
            continue
        report.latencies.append(time.perf_counter() - started)
        if not committed.created:
            raise AssertionError(f"{turn.response_id}: first commit returned created=False")
        return committed.seq


def worker(
    url: str,
    shared: str,
    private: str,
    proc: int,
    *,
    rounds: int | None = None,
    deadline: float | None = None,
) -> Report:
    """One process's load: ``rounds`` rounds, or rounds until ``time.time() >= deadline``."""
    report = Report(proc)
    with ConversationStore(url) as store:
        expected = store.next_seq(private)
        i = 0
        while (rounds is None or i < rounds) and (deadline is None or time.time() < deadline):
            n_calls = i % 4
            rid = f"s-p{proc}-t{i}"
            turn = build_turn(rid, n_calls)
            results = [f"{rid} r{k}" for k in range(n_calls)]
            seq = _commit_shared(store, shared, turn, results, report)
            report.acked.append((shared, rid, seq))
            report.commits += 1
            if i % 3 == 0:  # the acknowledgement was lost: retry, without expected_seq
                again = store.commit_turn(shared, turn, results)
                if again.created or again.seq != seq:
                    raise AssertionError(f"{rid}: retry wrote again ({again.seq} vs {seq})")
                report.retries += 1

            rid = f"v-p{proc}-t{i}"
            turn = build_turn(rid, (i + 1) % 4)
            results = [f"{rid} r{k}" for k in range((i + 1) % 4)]
            started = time.perf_counter()
            committed = store.commit_turn(private, turn, results, expected_seq=expected)
            report.latencies.append(time.perf_counter() - started)
            if not committed.created or committed.seq != expected:
                raise AssertionError(f"{rid}: private commit at {committed.seq}, not {expected}")
            report.acked.append((private, rid, expected))
            report.commits += 1
            expected = committed.next_seq

            if i % 5 == 2:  # an incomplete turn: refused, recorded as an attempt
                rid = f"x-p{proc}-t{i}"
                broken = build_turn(rid, 2, complete=False)
                try:
                    store.commit_turn(shared, broken, ["a", "b"])
                except IncompleteTurnError:
                    report.refused.append(rid)
                else:
                    raise AssertionError(f"{rid}: an incomplete turn was committed")
                store.record_attempt(shared, broken)
                report.attempts += 1
            if i % 4 == 1:
                store.append(shared, [{"role": "user", "content": f"p{proc} after t{i}"}])
                report.appended[shared] = report.appended.get(shared, 0) + 1
            if i % 2 == 0:
                window = store.history(shared, last=5)
                if window and window[0]["role"] == "tool":
                    raise AssertionError("a window starts inside a tool block")
                report.reads += 1
            if i % 10 == 0:
                _check_blocks(store.history(shared))
                report.reads += 1
            i += 1
    return report


def _check_blocks(messages: Sequence[dict[str, Any]]) -> None:
    i = 0
    while i < len(messages):
        calls = messages[i].get("tool_calls") or []
        if messages[i]["role"] == "tool":
            raise AssertionError(f"a tool message outside its block at {i}")
        ids = [m.get("tool_call_id") for m in messages[i + 1 : i + 1 + len(calls)]]
        if ids != [c["id"] for c in calls]:
            raise AssertionError(f"the block at {i} is split: {ids}")
        i += 1 + len(calls)


def _child(
    url: str, shared: str, private: str, proc: int, kwargs: dict[str, Any], barrier: Any, queue: Any
) -> None:
    code = 0
    try:
        seconds = kwargs.pop("seconds", None)
        barrier.wait()
        deadline = None if seconds is None else time.time() + seconds
        queue.put(worker(url, shared, private, proc, deadline=deadline, **kwargs))
    except BaseException:
        report = Report(proc)
        report.errors.append(traceback.format_exc())
        queue.put(report)
        code = 1
    finally:
        queue.close()
        queue.join_thread()
        os._exit(code)


@dataclass
class Summary:
    """The figures of a run."""

    procs: int
    seconds: float
    turns: int
    conflicts: int
    busy: int
    retries: int
    attempts: int
    reads: int
    p50_ms: float
    p99_ms: float
    problems: list[str]

    @property
    def turns_per_second(self) -> float:
        return self.turns / self.seconds if self.seconds else 0.0

    @property
    def conflict_rate(self) -> float:
        """Conflicts per commit attempt on the shared conversation."""
        shared = self.turns / 2
        return self.conflicts / (shared + self.conflicts) if shared + self.conflicts else 0.0

    def lines(self) -> list[str]:
        return [
            f"{self.procs} processes, {self.seconds:.1f} s: {self.turns} turns committed, "
            f"{self.turns_per_second:.1f} turns/s",
            f"conflicts: {self.conflicts} ({self.conflict_rate:.1%} of shared commit attempts), "
            f"busy: {self.busy}, idempotent retries: {self.retries}, attempts recorded: "
            f"{self.attempts}, reads: {self.reads}",
            f"commit latency: p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms",
            "verification: " + ("OK" if not self.problems else f"{len(self.problems)} problem(s)"),
            *(f"  - {p}" for p in self.problems[:20]),
        ]


def run(
    url: str,
    procs: int,
    *,
    rounds: int | None = None,
    seconds: float | None = None,
    start_method: str = "spawn",
    run_id: str | None = None,
) -> Summary:
    """Run the load from ``procs`` processes and verify the store; the store must be at head."""
    run_id = run_id or uuid.uuid4().hex[:8]
    with ConversationStore(url) as store:
        shared = store.create_conversation(f"soak-{run_id}-shared")
        store.append(shared, [{"role": "system", "content": "soak"}])
        privates = [store.create_conversation(f"soak-{run_id}-p{p}") for p in range(procs)]
    ctx: Any = multiprocessing.get_context(start_method)
    barrier = ctx.Barrier(procs + 1)
    queue = ctx.Queue()
    kwargs = {"rounds": rounds, "seconds": seconds}
    processes = [
        ctx.Process(target=_child, args=(url, shared, privates[p], p, kwargs, barrier, queue))
        for p in range(procs)
    ]
    for process in processes:
        process.start()
    barrier.wait(timeout=120)  # every child is up and connected: go
    started = time.time()
    reports: list[Report] = [queue.get(timeout=(seconds or 0) + 600) for _ in processes]
    elapsed = time.time() - started
    for process in processes:
        process.join(timeout=30)
    problems = [e for r in reports for e in r.errors]
    problems += [f"process {p.pid} exited with {p.exitcode}" for p in processes if p.exitcode]
    if not problems:
        problems += verify(url, shared, privates, reports)
    latencies = sorted(x for r in reports for x in r.latencies) or [0.0]
    return Summary(
        procs=procs,
        seconds=elapsed,
        turns=sum(r.commits for r in reports),
        conflicts=sum(r.conflicts for r in reports),
        busy=sum(r.busy for r in reports),
        retries=sum(r.retries for r in reports),
        attempts=sum(r.attempts for r in reports),
        reads=sum(r.reads for r in reports),
        p50_ms=statistics.median(latencies) * 1000,
        p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
        problems=problems,
    )


def verify(url: str, shared: str, privates: Sequence[str], reports: Sequence[Report]) -> list[str]:
    """Everything acknowledged is stored exactly once, nothing else is, and the store is sound."""
    problems: list[str] = []
    convs = [shared, *privates]
    acked = collections.Counter((c, rid, seq) for r in reports for c, rid, seq in r.acked)
    problems += [f"acknowledged twice: {k}" for k, n in acked.items() if n > 1]
    engine = sa.create_engine(normalize_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            stored = collections.Counter(
                (c, rid, seq)
                for c, rid, seq in conn.execute(
                    sa.text(
                        "SELECT conversation_id, response_id, seq FROM fsm_messages "
                        "WHERE role = 'assistant' AND conversation_id IN :convs"
                    ).bindparams(sa.bindparam("convs", expanding=True)),
                    {"convs": convs},
                )
            )
            problems += [f"acknowledged but missing: {k}" for k in acked if k not in stored]
            problems += [f"stored {n} times: {k}" for k, n in stored.items() if n > 1]
            problems += [f"stored but never acknowledged: {k}" for k in stored if k not in acked]
            refused = {rid for r in reports for rid in r.refused}
            problems += [f"a refused turn is in history: {k}" for k in stored if k[1] in refused]
            for conv in convs:
                seqs = (
                    conn.execute(
                        sa.text(
                            "SELECT seq FROM fsm_messages WHERE conversation_id = :c ORDER BY seq"
                        ),
                        {"c": conv},
                    )
                    .scalars()
                    .all()
                )
                if seqs != list(range(len(seqs))):
                    problems.append(f"{conv}: seqs are not dense from 0")
            users = conn.execute(
                sa.text(
                    "SELECT count(*) FROM fsm_messages WHERE conversation_id = :c AND role = 'user'"
                ),
                {"c": shared},
            ).scalar_one()
            appended = sum(r.appended.get(shared, 0) for r in reports)
            if users != appended:
                problems.append(f"{users} user messages stored, {appended} acknowledged")
            attempts = conn.execute(
                sa.text("SELECT count(*) FROM fsm_attempts WHERE conversation_id = :c"),
                {"c": shared},
            ).scalar_one()
            if attempts != sum(r.attempts for r in reports):
                problems.append(
                    f"{attempts} attempts stored, {sum(r.attempts for r in reports)} recorded"
                )
        problems += [
            f"audit: {v.kind} {v.conversation_id} {v.seq}: {v.detail}" for v in audit.check(engine)
        ]
    finally:
        engine.dispose()
    with ConversationStore(url) as store:
        _check_blocks(store.history(shared))
    return problems


@contextmanager
def _scratch(url: str | None) -> Iterator[str]:
    """A throwaway database at head: a schema on PostgreSQL, a temporary file on SQLite."""
    if url is None or normalize_url(url).get_backend_name() == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            scratch = f"sqlite:///{Path(tmp) / 'soak.db'}"
            upgrade(scratch)
            yield scratch
        return
    server = normalize_url(url)
    schema = f"fsm_soak_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        scoped = server.update_query_dict({"options": f"-csearch_path={schema}"})
        rendered = scoped.render_as_string(hide_password=False)
        upgrade(rendered)
        yield rendered
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", help="database URL (default: a temporary SQLite file)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--scratch", action="store_true", help="use a throwaway schema / file")
    args = parser.parse_args(argv)

    @contextmanager
    def given(url: str) -> Iterator[str]:
        yield url

    target = _scratch(args.db) if args.scratch or args.db is None else given(args.db)
    with target as url:
        shown = sa.make_url(normalize_url(url)).render_as_string(hide_password=True)
        print(f"soak: {args.procs} processes for {args.seconds:g} s on {shown}", flush=True)
        summary = run(url, args.procs, seconds=args.seconds)
    for line in summary.lines():
        print(line)
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
