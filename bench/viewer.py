"""Benchmark of the audit viewer (``fsm audit serve``) on a store of a million tool calls.

For each engine: seed the store with ``bench/seed.py`` (or reuse one: ``--sqlite-db PATH``,
``--postgres-db URL``), open it read-only, and render every page through
:class:`fsm.web.App` (the whole request: routing, queries, HTML or JSON; no socket), warm,
best of ``--repeat`` (target: < 200 ms a page). ``/stats``, ``/check`` and the counts of
``/failures`` scan the whole store: the viewer keeps their result for reloads, so they are
timed twice: the first visit (cold, once) and a reload. Then memory while paging: 300 pages of
``/calls`` and of ``/`` followed by their next-page cursors, the process's resident memory
after the 20th page and after the last.

Usage::

    python bench/viewer.py --sqlite-db big.db --postgres-db postgresql+psycopg://postgres@localhost/big
    python bench/viewer.py --postgres postgresql+psycopg://postgres@localhost/test  # seeds both
    python bench/viewer.py --sqlite-db big.db --postgres-db URL --write-md   # BENCHMARKS.md

Without ``--sqlite-db`` a SQLite store is seeded in a temporary directory (minutes); with
``--postgres`` (a server URL) and no ``--postgres-db`` a throwaway database is created, seeded
and dropped. ``--write-md`` replaces the "## Audit viewer" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from mdsection import replace_section

from fsm.store import audit
from fsm.store.engine import display_url, normalize_url
from fsm.web import App
from fsm.web.html import path_of

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent / "BENCHMARKS.md"
SECTION = "## Audit viewer"
TARGET_MS = 200.0


def _seed_module() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_seed", HERE / "seed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rss_mb() -> float:
    """The process's anonymous resident memory now (Linux ``RssAnon``: the heap, not the pages
    of the database file SQLite maps; else the peak RSS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
        raise ValueError("no RssAnon")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _get(app: App, target: str) -> Any:
    response = app.respond("GET", target, {})
    if response.status != 200:
        raise RuntimeError(f"{target}: {response.status} {response.body[:300]!r}")
    return response


def _body(app: App, target: str) -> bytes:
    return bytes(_get(app, target).body)


def _body(app: App, target: str) -> bytes:
    return bytes(_get(app, target).body)


def _json(app: App, target: str) -> Any:
    sep = "&" if "?" in target else "?"
    return json.loads(_get(app, f"{target}{sep}format=json").body)


def _after(app: App, path: str, pages: int) -> str:
    """The target of page ``pages + 1`` of a listing, reached through its cursors."""
    target = path
    for _ in range(pages):
        cursor = _json(app, target)["next"]
        if cursor is None:
            break
        target = f"{path}?after={cursor}"
    return target


def targets(app: App, engine: sa.Engine) -> list[tuple[str, str]]:
    """The pages timed: (label, target)."""
    with engine.connect() as conn:
        model = conn.execute(
            sa.text("SELECT model FROM fsm_attempts WHERE model IS NOT NULL ORDER BY id LIMIT 1")
        ).scalar()
        day = str(conn.execute(sa.text("SELECT min(created_at) FROM fsm_conversations")).scalar())[
            :10
        ]
        # the conversation with the most messages (one scan, outside the timings)
        longest = conn.execute(
            sa.text(
                "SELECT conversation_id FROM fsm_messages GROUP BY conversation_id "
                "ORDER BY max(seq) DESC LIMIT 1"
            )
        ).scalar()
        attempted = conn.execute(
            sa.text("SELECT conversation_id FROM fsm_attempts ORDER BY id LIMIT 1 OFFSET 1000")
        ).scalar()
    first = _json(app, "/")["rows"][0]["id"]
    assert isinstance(longest, str) and isinstance(attempted, str)
    return [
        ("/ (conversations, newest first)", "/"),
        ("/ page 20 (keyset cursor)", _after(app, "/", 19)),
        ("/?model= (one model)", f"/?model={model}"),
        ("/?prefix=", f"/?prefix={first[:9]}"),
        ("/?since=&until= (one day)", f"/?since={day}&until={day}T23:59:59"),
        ("/ as JSON", "/?format=json"),
        ("/c/{id} (newest conversation)", path_of("c", first)),
        ("/c/{id} (longest conversation)", path_of("c", longest)),
        ("/c/{id} (with a failed attempt)", path_of("c", attempted)),
        ("/calls", "/calls"),
        ("/calls page 20 (keyset cursor)", _after(app, "/calls", 19)),
        ("/calls?tool=get_weather&arg=city=Paris", "/calls?tool=get_weather&arg=city%3DParis"),
        ("/calls?state=truncated", "/calls?state=truncated"),
        (f"/calls?model={model}", f"/calls?model={model}"),
        ("/calls as JSON", "/calls?format=json"),
        ("/failures (counts kept)", "/failures"),
        ("/stats (kept)", "/stats"),
        ("/check (kept)", "/check"),
    ]


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Best seconds of ``repeat`` runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench(url: sa.URL, label: str, repeat: int) -> dict[str, Any]:
    engine = audit.open_readonly(url)
    app = App(engine, label=label)
    results: dict[str, Any] = {"pages": {}, "cold": {}}
    try:
        print(f"\n{label}: {display_url(url)}")
        results["answer"] = {}
        for name in ("/stats", "/check", "/failures"):
            # the first visit: the page answers within the wait budget (the result, or a page
            # that says it is computing and reloads itself); reloads until the result is there
            start = time.perf_counter()
            status = app.respond("GET", name, {}).status
            answered = time.perf_counter() - start
            while status == 202 or (name == "/failures" and b"being computed" in _body(app, name)):
                time.sleep(0.25)
                status = app.respond("GET", name, {}).status
            seconds = time.perf_counter() - start
            results["cold"][name], results["answer"][name] = seconds, answered
            print(
                f"  first visit {name:36s} answered in {answered:.2f} s, "
                f"result after {seconds:.2f} s (a whole-store scan)"
            )
        for name, target in targets(app, engine):
            seconds = timed(functools.partial(_get, app, target), repeat)
            results["pages"][name] = seconds
            flag = "" if seconds * 1000 < TARGET_MS else f"   (over {TARGET_MS:.0f} ms)"
            print(f"  {name:48s} {seconds * 1000:8.1f} ms{flag}")
        results["memory"] = {}
        for path in ("/calls", "/"):
            target, rss = path, []
            for n in range(1, 301):
                cursor = _json(app, target)["next"]
                if n in (20, 300):
                    rss.append(_rss_mb())
                if cursor is None:
                    break
                target = f"{path}?after={cursor}"
            results["memory"][path] = rss
            print(
                f"  paging {path:8s} 300 pages: RSS {rss[0]:.1f} MB at page 20, {rss[-1]:.1f} MB at page 300"
            )
        with engine.connect() as conn:
            results["calls"] = int(
                conn.execute(sa.text("SELECT count(*) FROM fsm_tool_calls")).scalar_one()
            )
            results["conversations"] = int(
                conn.execute(sa.text("SELECT count(*) FROM fsm_conversations")).scalar_one()
            )
    finally:
        engine.dispose()
    return results


def markdown(runs: dict[str, dict[str, Any]], started: datetime, seconds: float, argv: str) -> str:
    engines = list(runs)
    lines = [
        SECTION,
        "",
        f"Generated by `python bench/viewer.py {argv}` on {started:%Y-%m-%d} in {seconds:.0f} s. "
        "Do not edit by hand: rerun the script (it replaces this section only).",
        "",
        "Each page of `fsm audit serve` rendered through `fsm.web.App` (the whole request: "
        "routing, the read-only queries, the HTML or JSON; no socket), warm, best of the "
        f"runs; target < {TARGET_MS:.0f} ms. Store: "
        + "; ".join(
            f"{e}: {runs[e]['calls']:,} tool calls in {runs[e]['conversations']:,} conversations"
            for e in engines
        )
        + " (bench/seed.py). `/stats`, `/check` and the counts of `/failures` scan the whole "
        "store: the scan runs on a thread of its own, the first visit waits for it at most 2 s "
        "and otherwise answers with a page that says it is computing and reloads itself (no "
        "script: a meta refresh); the viewer keeps the result for reloads (a `recompute` link "
        "asks again). Their first visits are listed apart.",
        "",
        "| page | " + " | ".join(engines) + " |",
        "| --- | " + " | ".join("---" for _ in engines) + " |",
    ]
    for name in runs[engines[0]]["pages"]:
        cells = [f"{runs[e]['pages'][name] * 1000:.1f} ms" for e in engines]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in runs[engines[0]]["cold"]:
        cells = [
            f"answered in {runs[e]['answer'][name]:.2f} s, result after {runs[e]['cold'][name]:.2f} s"
            for e in engines
        ]
        lines.append(f"| {name}, first visit | " + " | ".join(cells) + " |")
    memory = "; ".join(
        f"{e}: "
        + ", ".join(
            f"`{path}` {rss[0]:.0f} MB at page 20, {rss[-1]:.0f} MB at page 300"
            for path, rss in runs[e]["memory"].items()
        )
        for e in engines
    )
    loads = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    lines += [
        "",
        f"Memory while paging (the process's anonymous resident memory, RssAnon: the heap, not the database file SQLite maps): {memory}.",
        "",
        f"Machine: {os.cpu_count()} cores; CPython {platform.python_version()} "
        f"({platform.platform()}); SQLite {sqlite3.sqlite_version}, SQLAlchemy {sa.__version__}; "
        f"load average {loads[0]:.2f} / {loads[1]:.2f} / {loads[2]:.2f} at the end (the machine "
        "is shared: the figures are noisy).",
    ]
    return "\n".join(lines) + "\n"


def write_md(section: str, path: Path = BENCHMARKS) -> None:
    """Replace the "## Audit viewer" section of ``path`` (or append it)."""
    replace_section(path, SECTION, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="tool calls to seed")
    parser.add_argument("--sqlite-db", help="a seeded SQLite store to reuse (path)")
    parser.add_argument("--postgres-db", help="a seeded PostgreSQL store to reuse (URL)")
    parser.add_argument("--postgres", help="a PostgreSQL server URL: seed a throwaway database")
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--write-md", action="store_true", help=f"write '{SECTION}' of BENCHMARKS.md"
    )
    args = parser.parse_args(argv)
    started, clock = datetime.now(UTC), time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    if not args.skip_sqlite:
        if args.sqlite_db:
            runs["SQLite"] = bench(
                sa.make_url(f"sqlite:///{args.sqlite_db}"), "SQLite", args.repeat
            )
        else:
            directory = Path(tempfile.mkdtemp(prefix="fsm-viewer-bench-"))
            url = sa.make_url(f"sqlite:///{directory / 'viewer.db'}")
            print("seeded " + _seed_module().seed(url, args.calls).summary())
            try:
                runs["SQLite"] = bench(url, "SQLite", args.repeat)
            finally:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{url.database}{suffix}").unlink(missing_ok=True)
                directory.rmdir()
    if args.postgres_db:
        runs["PostgreSQL"] = bench(normalize_url(args.postgres_db), "PostgreSQL", args.repeat)
    elif args.postgres:
        server = normalize_url(args.postgres)
        name = f"fsm_viewer_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        url = server.set(database=name)
        try:
            print("seeded " + _seed_module().seed(url, args.calls).summary())
            runs["PostgreSQL"] = bench(url, "PostgreSQL", args.repeat)
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    if args.write_md and runs:
        shown = []
        if args.sqlite_db:
            shown.append("--sqlite-db big.db")
        if args.postgres_db or args.postgres:
            shown.append("--postgres-db URL" if args.postgres_db else "--postgres URL")
        section = markdown(
            runs, started, time.perf_counter() - clock, " ".join([*shown, "--write-md"])
        )
        write_md(section)
        print(f"wrote the '{SECTION}' section of {BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
