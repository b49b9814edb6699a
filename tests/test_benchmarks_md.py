"""BENCHMARKS.md (written by ``python bench/peers.py --write``) has the expected shape.

Only the format is checked: the sections, one correctness row per quirk stream and per corpus
file, every correctness cell one of a few symbols, well-formed speed and memory cells. The
figures themselves depend on the machine and are not checked.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

import pytest

from tests.helpers import REPO, corpus_files, require_corpus

BENCHMARKS = REPO / "BENCHMARKS.md"
LIBRARIES = ["fsm", "openai", "langchain", "litellm", "pydantic-ai", "openai-agents"]
SYMBOLS = {"✓", "✗", "E", "n/a"}
HEADINGS = [
    "# Side by side with the peers",
    "## Machine",
    "## How to rerun",
    "## Correctness",
    "### Summary (right / total)",
    "### Quirks",
    "### Corpus",
    "### Why each wrong cell is wrong",
    "## Speed",
    "### Recorded corpus",
    "### Synthetic, growing arguments",
    "### Synthetic, interleaved calls",
    "## Memory",
    "## Where fsm lost",
]
RATIO = r"\d+(\.\d+)?x \(\d+(\.\d+)? µs\)"
CAPPED = r"> cap( \(est\.\))?"
FSM_TIME = r"\d+(\.\d+)? µs"
EXPONENT = r"(-?\d+\.\d\d \([^)]*\)|-)"


def _quirks() -> ModuleType:
    """bench/_peers/quirks.py, loaded from its file (it needs nothing but the stdlib)."""
    path = REPO / "bench" / "_peers" / "quirks.py"
    spec = importlib.util.spec_from_file_location("_bench_quirks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text() -> str:
    assert BENCHMARKS.is_file(), "BENCHMARKS.md is missing: run python bench/peers.py --write"
    return BENCHMARKS.read_text(encoding="utf-8")


def table_after(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The first Markdown table after ``heading``: (header cells, body rows)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    i = start + 1
    while i < len(lines) and not lines[i].startswith("|"):
        assert not lines[i].startswith("#"), f"no table under {heading!r}"
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip())[1:-1]]
        rows.append(cells)
        i += 1
    assert len(rows) >= 2, f"no table under {heading!r}"
    head, rule, *body = rows
    assert all(set(c) <= {"-", " ", ":"} for c in rule), f"bad rule line under {heading!r}"
    for row in body:
        assert len(row) == len(head), f"row {row} under {heading!r} has the wrong width"
    return head, body


def test_headings_in_order(text: str) -> None:
    positions = []
    for heading in HEADINGS:
        match = re.search(rf"^{re.escape(heading)}", text, re.MULTILINE)
        assert match is not None, f"missing heading {heading!r}"
        positions.append(match.start())
    assert positions == sorted(positions)


def test_machine_and_rerun(text: str) -> None:
    assert re.search(r"^- CPU: .+, \d+ cores$", text, re.MULTILINE)
    assert re.search(r"^- Python: ", text, re.MULTILINE)
    assert "python bench/peers.py --write" in text
    for dist in ("openai", "langchain-core", "litellm", "pydantic-ai-slim", "openai-agents"):
        assert re.search(rf"{re.escape(dist)} \S+", text), f"no version for {dist}"


def test_quirk_rows(text: str) -> None:
    head, body = table_after(text, "### Quirks")
    assert head == ["quirk", *LIBRARIES, "what the stream does"]
    keys = [row[0].strip("`") for row in body]
    assert keys == [q.key for q in _quirks().QUIRKS]
    for row in body:
        assert set(row[1:-1]) <= SYMBOLS, row


def test_corpus_rows(text: str) -> None:
    require_corpus()
    head, body = table_after(text, "### Corpus")
    assert head == ["corpus file", *LIBRARIES]
    assert [row[0].strip("`") for row in body] == corpus_files()
    for row in body:
        assert set(row[1:]) <= SYMBOLS, row


def test_summary_counts_rows(text: str) -> None:
    head, body = table_after(text, "### Summary (right / total)")
    assert head == ["streams", *LIBRARIES]
    assert [row[0] for row in body] == ["quirks", "corpus", "**all**"]
    n_quirks = len(_quirks().QUIRKS)
    for row, total in zip(body[:2], (n_quirks, None), strict=True):
        for cell in row[1:]:
            right, of = (int(x) for x in cell.split("/"))
            assert 0 <= right <= of
            if total is not None:
                assert of == total
    for cell in body[2][1:]:
        assert re.fullmatch(r"\*\*\d+/\d+\*\*", cell), cell


def test_wrong_cells_are_explained(text: str) -> None:
    _, quirks = table_after(text, "### Quirks")
    _, corpus = table_after(text, "### Corpus")
    wrong = sum(cell in {"✗", "E"} for row in quirks for cell in row[1:-1]) + sum(
        cell in {"✗", "E"} for row in corpus for cell in row[1:]
    )
    section = text.split("### Why each wrong cell is wrong", 1)[1].split("\n## ", 1)[0]
    explained = [line for line in section.splitlines() if line.startswith("- `")]
    assert len(explained) == wrong


@pytest.mark.parametrize(
    "heading",
    ["### Recorded corpus", "### Synthetic, growing arguments", "### Synthetic, interleaved"],
)
def test_speed_tables(text: str, heading: str) -> None:
    head, body = table_after(text, heading)
    assert head[0] in {"workload", "arguments", "calls"} and head[1] == "chunks"
    assert head[2:] == LIBRARIES
    for row in body:
        if row[0].startswith("growth exponent"):
            assert all(re.fullmatch(EXPONENT, c) for c in row[2:]), row
            continue
        assert row[1].isdigit(), row
        assert re.fullmatch(f"{FSM_TIME}|{CAPPED}", row[2]), row
        for cell in row[3:]:
            assert re.fullmatch(f"{RATIO}|{CAPPED}", cell), row
    if heading != "### Recorded corpus":
        assert body[-1][0].startswith("growth exponent")


def test_memory_table(text: str) -> None:
    head, body = table_after(text, "## Memory")
    assert head[:3] == ["library", head[1], "vs fsm"] and head[1].startswith("peak, ")
    assert [row[0] for row in body] == LIBRARIES
    for row in body:
        assert re.match(r"(\d+\.\d MiB|> cap)", row[1]), row
        assert re.fullmatch(r"\d+\.\dx|-", row[2]), row


FLOOR = "## Floor: store writes"
MS = r"\d+\.\d\d ms"
FLOOR_HEAD = [
    "engine",
    "fsm",
    "floor",
    "fsm/floor",
    "openai-agents",
    "fsm/openai-agents",
    "langchain",
    "fsm/langchain",
    "fsm statements",
    "fsm round trips",
]
CONCURRENT_HEAD = [
    "engine",
    "writers",
    "conversations",
    "fsm turns/s",
    "fsm p99",
    "floor turns/s",
    "floor p99",
    "fsm/floor turns/s",
]


def test_floor_section(text: str) -> None:
    """The section of ``python bench/floor.py --write-md``: one writer (fsm, the floor, the
    peers, ratios) and sixteen writers (turns per second, p99), per engine."""
    section = text.split(FLOOR, 1)[1].split("\n## ", 1)[0]
    assert "python bench/floor.py" in section
    head, body = table_after(section, "")
    assert head == FLOOR_HEAD
    assert [row[0] for row in body][:1] == ["SQLite"] and len(body) in (1, 2), body
    for row in body:
        assert re.fullmatch(MS, row[1]) and re.fullmatch(MS, row[2]), row
        assert re.fullmatch(r"\d+\.\d\d", row[3]), row
        for value, ratio in ((row[4], row[5]), (row[6], row[7])):
            assert (re.fullmatch(MS, value) and re.fullmatch(r"\d+\.\d\d", ratio)) or (
                value == "skipped" and ratio == "-"
            ), row
        assert row[8].isdigit(), row
        # round trips are counted on PostgreSQL only (SQLite runs in the process)
        assert (row[9] == "-") if row[0] == "SQLite" else row[9].isdigit(), row
    assert "Where a commit's time goes" in section
    assert "CPU in the process" in section
    rest = section.split("Under concurrency", 1)[1]
    head, body = table_after(rest, "")
    assert head == CONCURRENT_HEAD
    assert {(row[1], row[2]) for row in body} >= {
        ("16 threads", "16"),
        ("16 threads", "1,000"),
        ("16 processes", "one each"),
    }, body
    for row in body:
        assert re.fullmatch(r"[\d,]+", row[3]) and re.fullmatch(r"[\d,]+", row[5]), row
        assert re.fullmatch(MS, row[4]) and re.fullmatch(MS, row[6]), row
        assert re.fullmatch(r"\d+\.\d\d", row[7]), row
    goals = section.split("The goals of issue 31", 1)[1]
    assert re.search(r"^- (met|NOT met): PostgreSQL commit <= 2x the floor", goals, re.M), goals


def test_floor_goals_say_what_is_priced() -> None:
    """bench/floor.py's goals: a goal the floor itself misses is marked priced, with why; one
    the floor meets is not."""
    from bench import floor

    def run(ours: float, theirs: float, base: float) -> floor.SingleRun:
        return floor.SingleRun(
            "PostgreSQL", best={floor.FSM: ours, floor.LANGCHAIN: theirs, floor.FLOOR: base}
        )

    def crowd(p99: float, base_p99: float) -> floor.ConcurrentRun:
        return floor.ConcurrentRun(
            "SQLite",
            16,
            floor.Throughput(500.0, 0.003, p99),
            floor.Throughput(1000.0, 0.001, base_p99),
            processes=True,
        )

    below = floor.goals([run(0.0025, 0.001, 0.0017)], [crowd(0.120, 0.110)])
    assert "NOT met: PostgreSQL commit faster than LangChain" in below[1]
    assert "priced: LangChain's commit is faster than the floor itself" in below[1]
    assert "NOT met: SQLite" in below[2] and "priced: the floor's own p99" in below[2]
    above = floor.goals([run(0.0025, 0.002, 0.0017)], [crowd(0.120, 0.030)])
    assert "NOT met" in above[1] and "priced" not in above[1]
    assert "NOT met" in above[2] and "priced" not in above[2]


LEDGER = "## Tool ledger"
LEDGER_HEAD = ["engine", "path", "ms/turn", "transactions", "statements", "/ commit_turn"]


def test_ledger_section_and_the_agent_loop_s_default(text: str) -> None:
    """The section of ``python bench/ledger.py --write-md``: each path's time per turn and its
    ratio to ``commit_turn`` on each engine, where each store call's time goes, and the verdict
    on the agent loop's default, which ``run_agent_loop`` and its asyncio twin really have:
    the ledger exactly when every engine's ledger turn is within 2x of ``commit_turn``."""
    import inspect

    from bench import ledger as bench_ledger
    from fsm.agent import arun_agent_loop, run_agent_loop

    section = text.split(LEDGER, 1)[1].split("\n## ", 1)[0]
    assert "python bench/ledger.py" in section
    head, body = table_after(section, "")
    assert head == LEDGER_HEAD
    assert {row[0] for row in body} >= {"SQLite"} and {row[1] for row in body} == set(
        bench_ledger.PATHS
    ), body
    ratios = {}
    for row in body:
        assert re.fullmatch(r"\d+\.\d\d", row[2]) and re.fullmatch(r"\d+\.\d\d", row[5]), row
        assert row[3].isdigit() and row[4].isdigit(), row
        if row[1] == "ledger":
            ratios[row[0]] = float(row[5])
    steps = section.split("Where the time goes", 1)[1]
    head, body = table_after(steps, "")
    assert head == ["engine", "call", "ms", "in the driver"]
    assert {row[1] for row in body} >= {
        "ledger: begin",
        "ledger: commit",
        "commit_turn: commit_turn",
    }
    within = all(ratio <= bench_ledger.DEFAULT_BOUND for ratio in ratios.values())
    for loop in (run_agent_loop, arun_agent_loop):
        assert inspect.signature(loop).parameters["ledger"].default is within, (loop, ratios)
    assert ("stays `ledger=False`" in section) is not within, section


def test_ledger_verdict() -> None:
    """bench/ledger.py's verdict names each engine above the bound and says why the default
    stays off; within it on every engine, it says the default can be the ledger."""
    from bench import ledger as bench_ledger

    above = bench_ledger.default_verdict(
        [{"engine": "sqlite", "ratio": 2.27}, {"engine": "postgresql", "ratio": 1.6}]
    )
    assert above.startswith("Above 2x: SQLite 2.27x.") and "stays `ledger=False`" in above
    assert "PostgreSQL" not in above.split(".")[0]
    within = bench_ledger.default_verdict([{"engine": "sqlite", "ratio": 1.9}])
    assert "can be the ledger" in within and "stays" not in within
