"""Benchmark of the audit queries on a store of a million tool calls (SQLite and PostgreSQL).

For each engine: seed the store with ``bench/seed.py`` (or reuse one with ``--sqlite-db`` /
``--postgres-db``), open it read-only (``fsm.store.audit.open_readonly``), and time:

* the first page (100 rows) of every filtered ``tool_calls()`` / ``failures()`` query, warm,
  median of 5 (target: < 100 ms);
* ``stats()``, median and best of 5 after a warm-up (target: < 1 s); it reads the token columns
  of migration 0006 through ``ix_fsm_messages_stats`` (the plan is printed);
* ``check()`` of the whole store, best of 2, as calls per second (target: > 200,000/s).

Usage::

    python bench/audit.py                                  # SQLite in a temporary directory
    python bench/audit.py --postgres postgresql+psycopg://postgres@localhost/test
    python bench/audit.py --calls 200000 --skip-sqlite --postgres ...
    python bench/audit.py --sqlite-db big.db --postgres-db URL --write-md   # reuse seeded stores
                                                   # and (re)write "## Audit stats" in BENCHMARKS.md

A PostgreSQL run seeds a throwaway schema and drops it afterwards (unless ``--keep``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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
from mdsection import replace_section

from fsm.store import audit
from fsm.store.engine import display_url, normalize_url

HERE = Path(__file__).resolve().parent
PAGE = 100
BENCHMARKS = HERE.parent / "BENCHMARKS.md"
SECTION = "## Audit stats"
STATS_RUNS = 5


def _seed_module() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_seed", HERE / "seed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` runs after one warm-up, and the last result."""
    result = fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), result


def queries(engine: sa.Engine) -> list[tuple[str, Callable[[], object]]]:
    with engine.connect() as conn:
        conversation = conn.execute(
            sa.text("SELECT id FROM fsm_conversations ORDER BY id LIMIT 1 OFFSET 1000")
        ).scalar()
    page: dict[str, Any] = {"limit": PAGE}

    def calls(**filters: Any) -> Callable[[], object]:
        return lambda: list(audit.tool_calls(engine, **page, **filters))

    def failed(**filters: Any) -> Callable[[], object]:
        return lambda: list(audit.failures(engine, **page, **filters))

    day = {"since": "2026-11-20", "until": "2026-11-21"}
    return [
        ("calls: no filter", calls()),
        ("calls: --tool get_weather", calls(name="get_weather")),
        ("calls: --tool delete_account (rare)", calls(name="delete_account")),
        ("calls: --model qwen3-max", calls(model="qwen3-max")),
        ("calls: --since/--until (1 day)", calls(**day)),
        ("calls: --conversation", calls(conversation=conversation)),
        ("calls: --state truncated", calls(state="truncated")),
        ("calls: --tool + --arg city=Paris", calls(name="get_weather", args=[("city", "Paris")])),
        ("calls: --arg units=metric (only)", calls(args=[("units", "metric")])),
        ("calls: --args-contains Paris (only)", calls(args_contains="Paris")),
        ("calls: --tool, page 20 (--after cursor)", _page_after(engine, 19)),
        ("failures: no filter", failed()),
        ("failures: --model llama", failed(model="llama-3.3-70b-versatile")),
        ("failures: --reason content_filter", failed(reason="content_filter")),
        ("failures: --counts", lambda: audit.failure_counts(engine)),
    ]


def _page_after(engine: sa.Engine, pages: int) -> Callable[[], object]:
    """The page after ``pages`` full pages of one tool, read with the cursor of the last."""
    after = None
    for _ in range(pages):
        after = list(audit.tool_calls(engine, name="get_weather", limit=PAGE, after=after))[-1].key
    return lambda: list(audit.tool_calls(engine, name="get_weather", limit=PAGE, after=after))


def bench(url: sa.URL, label: str) -> dict[str, float]:
    engine = audit.open_readonly(url)
    results: dict[str, float] = {}
    try:
        print(f"\n{label}: {display_url(url)}")
        for name, fn in queries(engine):
            seconds, rows = timed(fn, 5)
            count = len(rows) if isinstance(rows, list) else 0
            flag = "" if seconds < 0.1 else "   (over 100 ms)"
            print(f"  {name:42s} {seconds * 1000:8.1f} ms  ({count} rows){flag}")
            results[name] = seconds
        result: Any = audit.stats(engine)  # warm-up
        samples = []
        cpu = []  # this process's CPU time: the whole work on SQLite, load or not
        for _ in range(STATS_RUNS):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = audit.stats(engine)
            samples.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        results["stats_cpu"] = min(cpu)
        seconds = statistics.median(samples)
        results["stats"] = seconds
        results["stats_best"] = min(samples)
        totals = getattr(result, "totals", None)
        print(
            f"  {'stats()':42s} {seconds * 1000:8.1f} ms (best {min(samples) * 1000:.1f} ms,"
            f" client CPU {min(cpu) * 1000:.0f} ms)"
            f"{'' if seconds < 1 else '   (over 1 s)'}"
        )
        print("  stats() turns query plan: " + _stats_plan(engine))
        with engine.connect() as conn:
            calls = int(conn.execute(sa.text("SELECT count(*) FROM fsm_tool_calls")).scalar_one())
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            violations = sum(1 for _ in audit.check(engine))
            best = min(best, time.perf_counter() - start)
        results["check_s"] = best
        results["check_calls_per_s"] = calls / best
        print(
            f"  {'check()':42s} {best:8.2f} s   {calls / best:,.0f} calls/s "
            f"({calls:,} calls, {violations} violations)"
        )
        if totals is not None:
            print(f"  (store: {totals.turns:,} turns, {totals.calls:,} calls)")
    finally:
        engine.dispose()
    return results


def _stats_plan(engine: sa.Engine) -> str:
    """The plan of stats()'s grouped scan of the assistant messages (it should read
    ``ix_fsm_messages_stats`` alone)."""
    from fsm.store.audit.read import _MESSAGES
    from fsm.store.audit.summary import _ASSISTANT, _turns_query

    m = _MESSAGES.alias("m")
    with engine.connect() as conn:
        query = _turns_query(conn, m, [m.c.role == _ASSISTANT])
        sql = str(query.compile(conn, compile_kwargs={"literal_binds": True}))
        if conn.dialect.name == "sqlite":
            return " / ".join(str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
        lines = [str(r[0]).strip() for r in conn.exec_driver_sql(f"EXPLAIN {sql}")]
        return " / ".join(line.split("  (cost")[0] for line in lines if "cost" in line)


def render_md(runs: list[tuple[str, dict[str, float]]], argv: list[str], load: str) -> str:
    """The ``## Audit stats`` section of BENCHMARKS.md."""
    lines = [
        SECTION,
        "",
        f"Generated by `python bench/audit.py {' '.join(argv)}` on "
        f"{datetime.date.today().isoformat()}. Do not edit by hand: rerun the script (it "
        "replaces this section only).",
        "",
        "`fsm audit stats` (`fsm.store.audit.stats()`) and `fsm audit check` on a store of "
        "1,000,000 tool calls seeded by `bench/seed.py` (about 2.5M messages, 1.05M assistant "
        f"turns, 30 days, 5 models). stats(): median of {STATS_RUNS} after a warm-up, target "
        "< 1 s. It reads the integer token columns the store writes with each message "
        "(migration 0006, which backfills older rows) through the partial index "
        "`ix_fsm_messages_stats` alone: on SQLite `(model, substr(created_at, 1, 10), n_calls, "
        "tokens...)`, grouped in index order with no sort; on PostgreSQL `(model, created_at) "
        "INCLUDE (n_calls, tokens...)`, an index-only scan aggregated by hash (it needs the "
        "visibility map the seed's `VACUUM` sets, as autovacuum does after a load). "
        "Client CPU: the best CPU time of this process per stats() (on SQLite the whole work, "
        "which load on the machine does not inflate; on PostgreSQL the work is the server's). "
        "check(): best of 2, as calls per second.",
        "",
        "| engine | stats() median | stats() best | stats() client CPU | check() "
        "| check() calls/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in runs:
        lines.append(
            f"| {label} | {r['stats'] * 1000:.0f} ms | {r['stats_best'] * 1000:.0f} ms "
            f"| {r['stats_cpu'] * 1000:.0f} ms "
            f"| {r['check_s']:.1f} s | {r['check_calls_per_s']:,.0f} |"
        )
    lines += ["", f"Machine: {os.cpu_count()} cores; load average {load} during the run.", ""]
    return "\n".join(lines)


def write_md(section: str, path: Path = BENCHMARKS) -> None:
    """Replace the ``## Audit stats`` section of ``path`` (or append it)."""
    replace_section(path, SECTION, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="tool calls to seed")
    parser.add_argument("--postgres", default=os.environ.get("FSM_TEST_POSTGRES_URL"))
    parser.add_argument("--sqlite-db", help="a seeded SQLite store to reuse (path)")
    parser.add_argument("--postgres-db", help="a seeded PostgreSQL store to reuse (URL)")
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep what was seeded")
    parser.add_argument(
        "--write-md", action="store_true", help=f"write '{SECTION}' in {BENCHMARKS.name}"
    )
    args = parser.parse_args(argv)
    runs: list[tuple[str, dict[str, float]]] = []
    seed = _seed_module()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(f"{os.cpu_count()} CPUs, load average {load:.2f} at start")

    if not args.skip_sqlite:
        if args.sqlite_db:
            runs.append(
                ("SQLite", bench(sa.make_url(f"sqlite:///{args.sqlite_db}"), "SQLite (reused)"))
            )
        else:
            directory = tempfile.mkdtemp(prefix="fsm-audit-bench-")
            url = sa.make_url(f"sqlite:///{Path(directory) / 'audit.db'}")
            report = seed.seed(url, args.calls)
            print("seeded " + report.summary())
            try:
                runs.append(("SQLite", bench(url, "SQLite")))
            finally:
                if not args.keep:
                    for suffix in ("", "-wal", "-shm"):
                        Path(f"{url.database}{suffix}").unlink(missing_ok=True)
                    Path(directory).rmdir()
    if args.postgres_db:
        runs.append(("PostgreSQL", bench(normalize_url(args.postgres_db), "PostgreSQL (reused)")))
    elif args.postgres:
        server = normalize_url(args.postgres)
        schema = f"fsm_audit_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        url = server.update_query_dict({"options": f"-csearch_path={schema}"})
        try:
            report = seed.seed(url, args.calls)
            print("seeded " + report.summary())
            runs.append(("PostgreSQL", bench(url, "PostgreSQL")))
        finally:
            if args.keep:
                print(f"kept schema {schema}")
            else:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    else:
        print("PostgreSQL: skipped (pass --postgres URL or set FSM_TEST_POSTGRES_URL)")
    if args.write_md and runs:
        end_load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        shown = ["--write-md"] + (["--calls", str(args.calls)] if args.calls != 1_000_000 else [])
        if args.sqlite_db:
            shown.append("--sqlite-db DB")
        if args.postgres_db:
            shown.append("--postgres-db URL")
        elif args.postgres:
            shown.append("--postgres URL")
        write_md(render_md(runs, shown, f"{load:.2f} at the start, {end_load} at the end"))
        print(f"wrote the '{SECTION}' section of {BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
