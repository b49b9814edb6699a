"""Side by side with the peers: correctness, speed and memory of fsm and five peer libraries.

Run from the repository root, in the project's virtualenv with the peers installed::

    python bench/peers.py             # print the report (nothing written)
    python bench/peers.py --write     # rewrite BENCHMARKS.md with it
    python bench/peers.py --quick     # smaller synthetic streams, for a fast look

Every library is fed the same inputs through its public accumulation API (see
``bench/_peers/*.py``: each module says exactly how, and what "usable" means for it):

* **correctness**: one hand-written SSE stream per provider quirk of ``shared/spec/parser.md``
  (``bench/_peers/quirks.py``, with the result the spec prescribes) and every recorded stream of
  ``shared/corpus`` (with ``expected.json``). fsm reads the SSE bytes itself; the peers read them
  through the ``openai`` SDK's ``Stream``, their front end in real use. Each cell says whether
  the calls the library hands over as usable are the spec's.
* **speed**: per-chunk cost on the corpus and on synthetic OpenAI-shaped streams (1 KB to 1 MB of
  arguments; 1 to 64 interleaved calls), all libraries fed the same chunk dicts in one process,
  each measurement capped; ratios to fsm and each library's growth exponent.
* **memory**: ``tracemalloc`` peak of each library, in turn, on the largest stream.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The peers must never reach the network (LiteLLM fetches a model cost map and tokenizers).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _peers import Outcome, Peer, load_peers  # noqa: E402
from _peers import fsm_peer as _fsm  # noqa: E402
from _peers.frontend import data_payloads, sdk_decode  # noqa: E402
from _peers.judge import (  # noqa: E402
    RAISED,
    RIGHT,
    SYMBOLS,
    UNAVAILABLE,
    WRONG,
    judge,
    turns_from_expected,
)
from _peers.quirks import QUIRKS, Turn  # noqa: E402

REPO = HERE.parent
CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"
OUTPUT = REPO / "BENCHMARKS.md"

KIB = 1024
SIZES = (1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB)
QUICK_SIZES = (1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB)
CALLS = (1, 4, 16, 64)
CALLS_SIZE = 64 * KIB
FRAGMENT = 4  # characters of arguments per chunk (about one token, as OpenAI streams them)
CAP_S = 20.0
RUN_BUDGET_S = 1.0  # repeat a measurement until this much time is spent (at most MAX_RUNS),
MIN_RUNS = 3  # and at least MIN_RUNS times unless one run takes over RUN_BUDGET_S
MAX_RUNS = 9
TRACE_SLOWDOWN = 10  # assumed slowdown under tracemalloc, for a library not yet traced
FIT_FROM = 16 * KIB  # growth exponents are fitted on sizes from here up
MEMORY_SIZE = 64 * KIB  # every library's memory is compared on this stream (and on the largest)

PEER_DISTS = (
    "openai",
    "langchain-core",
    "langchain-openai",
    "litellm",
    "pydantic-ai-slim",
    "openai-agents",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the cap ------------------------------------------------------------------------------------


class CapExceeded(BaseException):
    """Raised by the alarm inside a measurement that ran past the cap (a BaseException, so that
    the adapters' ``except Exception`` cannot swallow it)."""


@contextmanager
def capped(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise CapExceeded

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- correctness ----------------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    title: str
    cells: dict[str, tuple[str, str]] = field(default_factory=dict)  # peer -> (symbol, why)


def corpus_cases() -> list[tuple[str, bytes, tuple[Turn, ...]]]:
    expected = json.loads((CORPUS / "expected.json").read_text(encoding="utf-8"))
    cases = []
    for name in sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.glob("*/*.sse")):
        path = CORPUS / name
        if name not in expected:
            raise SystemExit(f"{name} has no entry in {CORPUS / 'expected.json'}")
        cases.append((name, path.read_bytes(), turns_from_expected(expected[name])))
    return cases


def judge_all(
    peers: list[Peer], cases: list[tuple[str, str, bytes, tuple[Turn, ...]]]
) -> list[Row]:
    rows = []
    for key, title, sse, expected in cases:
        row = Row(key, title)
        chunks, front_error = sdk_decode(sse)
        for peer in peers:
            if not peer.available:
                row.cells[peer.key] = (UNAVAILABLE, peer.error or "")
                continue
            if peer.key == "fsm":
                outcome = _fsm.run_sse(sse)
            elif front_error is not None:
                outcome = Outcome(raised=f"the openai SDK's Stream raised {front_error}")
            else:
                outcome = peer.run(chunks)
            row.cells[peer.key] = judge(expected, outcome)
        rows.append(row)
    return rows


# -- speed ------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    streams: list[list[dict[str, Any]]]
    arg_bytes: int = 0
    calls: int = 0

    @property
    def chunks(self) -> int:
        return sum(len(s) for s in self.streams)


def synthetic(arg_bytes: int, calls: int) -> Workload:
    """An OpenAI-shaped stream: role chunk, one header per call, then FRAGMENT-character argument
    fragments dealt round-robin over the calls (interleaved when calls > 1), finish chunk, usage
    chunk."""
    per_call = max(arg_bytes // calls, 16)
    filler = "lorem ipsum dolor sit amet, consectetur adipiscing elit. " * (per_call // 56 + 1)
    args = ['{"text": "' + filler[: per_call - 12] + '"}' for _ in range(calls)]
    base = {
        "id": "chatcmpl-synthetic",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-2024-08-06",
        "service_tier": "default",
        "system_fingerprint": "fp_synthetic",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice], "usage": None}

    out = [chunk({"role": "assistant", "content": None, "refusal": None})]
    for k in range(calls):
        header = {
            "index": k,
            "id": f"call_{k:024d}",
            "type": "function",
            "function": {"name": f"tool_{k}", "arguments": ""},
        }
        out.append(chunk({"tool_calls": [header]}))
    pieces = [[a[i : i + FRAGMENT] for i in range(0, len(a), FRAGMENT)] for a in args]
    for i in range(max(len(p) for p in pieces)):
        for k, p in enumerate(pieces):
            if i < len(p):
                out.append(chunk({"tool_calls": [{"index": k, "function": {"arguments": p[i]}}]}))
    out.append(chunk({}, "tool_calls"))
    usage = {"prompt_tokens": 50, "completion_tokens": len(out), "total_tokens": 50 + len(out)}
    out.append({**base, "choices": [], "usage": usage})
    size = sum(len(a) for a in args)
    return Workload(f"{_size(size)}, {calls} call{'s' * (calls > 1)}", [out], size, calls)


def _size(n: int) -> str:
    if n >= KIB * KIB and n % (KIB * KIB) == 0:
        return f"{n // (KIB * KIB)} MB"
    if n >= KIB:
        return f"{round(n / KIB)} KB"
    return f"{n} B"


@dataclass
class Timing:
    seconds: float | None  # best run; None when capped or skipped
    runs: int = 0
    note: str = ""  # "> cap", "> cap (est.)"


class Prepared:
    """The chunks of one workload as each kind of library is handed them, built once (untimed)
    and shared by the libraries of that kind."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self._cache: dict[str, list[Any]] = {}

    def get(self, peer: Peer) -> list[Any]:
        if peer.kind not in self._cache:
            with gc_paused():
                self._cache[peer.kind] = [peer.prepare_fast(s) for s in self.w.streams]
            # Keep the inputs out of the collector's scans, for every library alike (they are
            # still freed by reference counting once dropped).
            gc.freeze()
        return self._cache[peer.kind]


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic gc while building large inputs (it would scan them over and over)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_runs(fn: Callable[[Any], Any], streams: list[Any], cap: float) -> Timing:
    """Best of several runs of ``fn`` over every stream: at least MIN_RUNS (one if a run takes
    over RUN_BUDGET_S), more until RUN_BUDGET_S is spent, at most MAX_RUNS."""
    best = math.inf
    spent = 0.0
    runs = 0
    while runs < MAX_RUNS and (
        runs == 0 or spent < RUN_BUDGET_S or (runs < MIN_RUNS and best < RUN_BUDGET_S)
    ):
        gc.collect()
        try:
            with capped(cap):
                t0 = time.perf_counter()
                for stream in streams:
                    fn(stream)
                dt = time.perf_counter() - t0
        except CapExceeded:
            return Timing(None, runs, "> cap")
        best = min(best, dt)
        spent += dt
        runs += 1
    return Timing(best, runs)


def fit_exponent(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(time) against log(size)."""
    if len(points) < 2:
        return None
    xs = [math.log(s) for s, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def series(
    peers: list[Peer],
    loads: list[Workload],
    cap: float,
    x: Callable[[Workload], float],
    *,
    min_growth: float,
    seed: dict[str, Timing] | None = None,
) -> dict[str, list[Timing]]:
    """Time every peer on workloads of growing x. A peer whose next run is predicted past the cap
    (from its last two points: time grows as x**e with e at least ``min_growth``) is not run and
    marked ``> cap (est.)``; so is every later point once one is past the cap. ``seed`` gives a
    measurement of the first workload already made (not repeated)."""
    out: dict[str, list[Timing]] = {p.key: [] for p in peers}
    for i, w in enumerate(loads):
        log(f"  {w.name}: {w.chunks} chunks")
        prepared = Prepared(w)
        for p in peers:
            if i == 0 and seed is not None and p.key in seed:
                out[p.key].append(seed[p.key])
                continue
            done = [(x(v), t.seconds) for v, t in zip(loads, out[p.key], strict=False)]
            ok = [(xv, t) for xv, t in done if t is not None]
            if len(ok) != len(done):
                out[p.key].append(Timing(None, 0, "> cap (est.)"))
                continue
            if ok:
                x1, t1 = ok[-1]
                e = min_growth
                if len(ok) >= 2:
                    x0, t0 = ok[-2]
                    e = max(min_growth, math.log(t1 / t0) / math.log(x1 / x0))
                if t1 * (x(w) / x1) ** e > cap:
                    out[p.key].append(Timing(None, 0, "> cap (est.)"))
                    continue
            t0 = time.perf_counter()
            timing = time_runs(p.consume, prepared.get(p), cap)
            out[p.key].append(timing)
            log(
                f"    {p.key}: {_fmt_s(timing)} "
                f"({timing.runs} runs, {time.perf_counter() - t0:.1f} s with preparation)"
            )
        del prepared
    return out


def _fmt_s(t: Timing) -> str:
    return t.note if t.seconds is None else f"{t.seconds:.3f} s"


@dataclass
class Mem:
    peak: int | None  # bytes; None when the traced run went past the cap
    seconds: float | None  # how long the traced run took


def memory_peak(peer: Peer, w: Workload, cap: float) -> Mem:
    """``tracemalloc`` peak of one library on ``w``, its prepared input built before tracing."""
    prepared = Prepared(w).get(peer)
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with capped(cap):
            for stream in prepared:
                peer.consume(stream)
        _, peak = tracemalloc.get_traced_memory()
    except CapExceeded:
        return Mem(None, None)
    finally:
        tracemalloc.stop()
        del prepared
    return Mem(peak, time.perf_counter() - t0)


def reference_timings(w: Workload, cap: float) -> dict[str, Timing]:
    """Front-end costs for reference: fsm reading the same chunks as SSE bytes (its real input),
    and the openai SDK building the ``ChatCompletionChunk`` objects (what ``openai.Stream`` does
    per chunk before any peer's accumulator sees it)."""
    from _peers import openai_peer

    out: dict[str, Timing] = {}
    sse = [_fsm.prepare_sse(s) for s in w.streams]
    out["fsm, SSE bytes in (`receive_data`)"] = time_runs(_fsm.run_sse, sse, cap)
    if openai_peer.available():
        out["openai SDK: build the `ChatCompletionChunk`s"] = time_runs(
            openai_peer.prepare, w.streams, cap
        )
    return out


def _loadavg() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


# -- environment --------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(peers: list[Peer]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str] = {}
    for dist in ("fsm-toolcalls", *PEER_DISTS, "orjson", "pydantic"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "not installed"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(terse=True),
        "versions": versions,
    }


# -- report -------------------------------------------------------------------------------------------


def _cell_time(t: Timing, fsm: Timing, chunks: int) -> str:
    if t.seconds is None:
        return t.note
    if fsm.seconds is None:
        return f"({t.seconds / chunks * 1e6:.1f} µs)"
    return f"{t.seconds / fsm.seconds:.1f}x ({t.seconds / chunks * 1e6:.1f} µs)"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(res: dict[str, Any]) -> str:
    peers: list[Peer] = res["peers"]
    keys = [p.key for p in peers]
    env = res["env"]
    v = env["versions"]
    L: list[str] = []
    L += [
        "# Side by side with the peers",
        "",
        f"Generated by `python bench/peers.py --write` on {res['date']} in {res['elapsed']:.0f} s"
        f"{' (--quick)' if res['quick'] else ''}. Do not edit by hand: rerun the script.",
        "",
        "fsm against five libraries that assemble streamed Chat Completions tool calls, on the "
        "same inputs: the provider quirks of `shared/spec/parser.md` and the recorded streams "
        "of `shared/corpus` for correctness; synthetic OpenAI-shaped streams for speed and "
        "memory.",
        "",
        "## Machine",
        "",
        f"- CPU: {env['cpu']}, {env['cores']} cores",
        f"- Python: {env['python']} ({env['platform']})",
        f"- Load average (1, 5, 15 min) at the start: {res['load'][0]}; at the end: "
        f"{res['load'][1]} (anything else running on the machine shows up as noise in the "
        "timings; the best of several runs is reported to damp it)",
        "- Packages: " + ", ".join(f"{d} {v[d]}" for d in v),
        "",
        "## How to rerun",
        "",
        "```sh",
        ". .venv/bin/activate",
        'pip install -e ".[bench]"   # or pin the peers by hand: '
        + " ".join(
            f"'{d}[openai]=={v[d]}'" if d == "pydantic-ai-slim" else f"{d}=={v[d]}"
            for d in PEER_DISTS
            if v[d] != "not installed"
        ),
        "python bench/peers.py --write   # rewrites BENCHMARKS.md (a few minutes)",
        "python bench/peers.py           # prints the same report, writes nothing",
        "```",
        "",
        "The script reads the corpus from `../shared/corpus` beside the checkout. The peers "
        "run offline (`LITELLM_LOCAL_MODEL_COST_MAP=True`, `HF_HUB_OFFLINE=1`).",
        "",
    ]

    # -- correctness
    L += ["## Correctness", ""]
    L += [
        "Each cell says whether the tool calls the library hands over as usable are what the "
        "spec prescribes for that stream; the expected result of a quirk stream was written "
        "from the spec's rules (`bench/_peers/quirks.py`), that of a corpus stream is "
        "`shared/corpus/expected.json`. Never compared with fsm's output.",
        "",
        f"- `{RIGHT}` right. For a turn the spec calls complete: the calls presented as usable "
        "are exactly the expected ones, id, name and arguments byte-exact (order not judged), "
        "none missing, none extra, none flagged. For an incomplete turn (finish_reason "
        "`length` or `content_filter`, invalid JSON, EOF without an end, an error event, a call "
        "without a name): no call the spec does not end `finished` is presented as usable; "
        "raising, flagging it or dropping it is right. An id the library made up where the "
        "provider sent none is not the provider's id: wrong.",
        f"- `{WRONG}` wrong: a call missing, extra, altered (doubled name or id, merged or "
        "leniently closed arguments, a generated id), or an incomplete call presented as usable.",
        f"- `{RAISED}` wrong: the library raised on a stream whose turn is complete.",
        f"- `{UNAVAILABLE}` the library is not installed.",
        "",
        "Front end: fsm reads the SSE bytes itself. The peers read them through the `openai` "
        "SDK's `openai.Stream` (`bench/_peers/frontend.py`), their front end in real use: it "
        "stops at `data: [DONE]` and raises `APIError` on a payload with an `error` key (so "
        "every peer gets those right through the SDK), and it raises `JSONDecodeError` on an "
        "event without JSON data (watsonx's `event: close`).",
        "",
        "How each library is driven, and what counts as usable for it:",
        "",
    ]
    for p in peers:
        L.append(f"- **{p.key}** ({p.label}): {p.how} Usable: {p.usable}")
    L.append("")

    quirk_rows: list[Row] = res["quirk_rows"]
    corpus_rows: list[Row] = res["corpus_rows"]
    L += ["### Summary (right / total)", ""]
    summary = []
    for label, rows in (("quirks", quirk_rows), ("corpus", corpus_rows)):
        summary.append(
            [label] + [f"{sum(r.cells[k][0] == RIGHT for r in rows)}/{len(rows)}" for k in keys]
        )
    both = quirk_rows + corpus_rows
    summary.append(
        ["**all**"] + [f"**{sum(r.cells[k][0] == RIGHT for r in both)}/{len(both)}**" for k in keys]
    )
    L += _table(["streams", *keys], summary)
    L += ["", "### Quirks", ""]
    L += _table(
        ["quirk", *keys, "what the stream does"],
        [[f"`{r.key}`", *(r.cells[k][0] for k in keys), _esc(r.title)] for r in quirk_rows],
    )
    L += ["", "### Corpus", ""]
    L += _table(
        ["corpus file", *keys],
        [[f"`{r.key}`", *(r.cells[k][0] for k in keys)] for r in corpus_rows],
    )
    L += ["", "### Why each wrong cell is wrong", ""]
    any_wrong = False
    for r in both:
        for k in keys:
            sym, why = r.cells[k]
            if sym in (WRONG, RAISED):
                any_wrong = True
                L.append(f"- `{r.key}`, **{k}**: {_esc(why)}")
    if not any_wrong:
        L.append("- none")
    L.append("")

    # -- speed
    sp = res["speed"]
    fsm_key = "fsm"
    L += [
        "## Speed",
        "",
        "All libraries get the same chunks in one process. Each library is handed them as the "
        "objects its pipeline gives it (built before timing): plain dicts for fsm "
        "(`receive_chunk`), `ChatCompletionChunk`s for openai, LangChain, pydantic-ai and "
        "openai-agents, `ModelResponseStream`s for LiteLLM; a timed run takes every stream "
        "from its first chunk to the library's final result. Figure: the best of at least "
        f"{MIN_RUNS} runs (one if a run takes over {RUN_BUDGET_S:g} s), more until "
        f"{RUN_BUDGET_S:g} s is spent, at most {MAX_RUNS}; gc enabled, the inputs frozen out of "
        "the collector. Cells: time relative to fsm on the same workload (lower is faster; "
        "fsm = 1), then µs per chunk. Each measurement is capped at "
        f"{res['cap']:.0f} s: `> cap` ran past it and was stopped; `> cap (est.)` was not run "
        "because the library's last two points predicted it past the cap (at least linear "
        "growth in the size series, at least flat in the calls series).",
        "",
        "### Recorded corpus",
        "",
    ]
    cw = sp["corpus"]
    L += _table(
        ["workload", "chunks", *(k for k in keys if k in cw["timing"])],
        [
            [
                f"all {len(cw['workload'].streams)} corpus streams",
                str(cw["workload"].chunks),
                *(
                    f"{cw['timing'][k].seconds / cw['workload'].chunks * 1e6:.2f} µs"
                    if k == fsm_key and cw["timing"][k].seconds
                    else _cell_time(cw["timing"][k], cw["timing"][fsm_key], cw["workload"].chunks)
                    for k in keys
                    if k in cw["timing"]
                ),
            ]
        ],
    )
    L.append("")
    L += [
        "Front-end reference (not part of the comparison above, which starts from chunk "
        "objects): what fsm costs when it reads the same streams as SSE bytes, its real input, "
        "and what the `openai` SDK spends building the `ChatCompletionChunk` objects every "
        "SDK-based peer is handed (`openai.Stream` does this per chunk, before any accumulator).",
        "",
    ]
    ref_rows = []
    for wname, refs in res["reference"].items():
        n = (
            cw["workload"].chunks
            if wname == "corpus"
            else sp["sizes"]["workloads"][
                [_size(w.arg_bytes) for w in sp["sizes"]["workloads"]].index(wname)
            ].chunks
        )
        f = (
            cw["timing"][fsm_key]
            if wname == "corpus"
            else sp["sizes"]["timing"][fsm_key][
                [_size(w.arg_bytes) for w in sp["sizes"]["workloads"]].index(wname)
            ]
        )
        for what, t in refs.items():
            ref_rows.append(
                [what, "corpus" if wname == "corpus" else f"{wname}, 1 call", _cell_time(t, f, n)]
            )
    L += _table(["what", "workload", "vs fsm from chunk dicts (µs per chunk)"], ref_rows)
    L.append("")
    for title, key, xlabel in (
        (
            f"### Synthetic, growing arguments (one call, {FRAGMENT}-character fragments)",
            "sizes",
            "arguments",
        ),
        (
            f"### Synthetic, interleaved calls ({_size(CALLS_SIZE)} of arguments in all, "
            f"{FRAGMENT}-character fragments dealt round-robin)",
            "calls",
            "calls",
        ),
    ):
        s = sp[key]
        loads: list[Workload] = s["workloads"]
        tk = [k for k in keys if k in s["timing"]]
        rows = []
        for i, w in enumerate(loads):
            fsm_t = s["timing"][fsm_key][i]
            cells = []
            for k in tk:
                t = s["timing"][k][i]
                if k == fsm_key:
                    cells.append(
                        f"{t.seconds / w.chunks * 1e6:.2f} µs" if t.seconds is not None else t.note
                    )
                else:
                    cells.append(_cell_time(t, fsm_t, w.chunks))
            label = _size(w.arg_bytes) if key == "sizes" else str(w.calls)
            rows.append([label, str(w.chunks), *cells])
        exp_row = [f"growth exponent ({s['fit_label']})", ""]
        for k in tk:
            e = s["exponents"][k]
            exp_row.append("-" if e[0] is None else f"{e[0]:.2f} ({e[1]})")
        rows.append(exp_row)
        L += [title, ""]
        L += _table([xlabel, "chunks", *tk], rows)
        L.append("")
    L += [
        "Growth exponent: the slope of log(time) against log(arguments size) (or number of "
        "calls), least squares over the points named in brackets: about 1 is linear, about 2 "
        f"quadratic. The size fit uses the points from {_size(FIT_FROM)} up that finished; for a "
        "library capped before that, its last two points.",
        "",
    ]

    # -- memory
    mem = res["memory"]
    common: Workload = mem["common"]
    largest: Workload = mem["largest"]
    peaks: dict[str, dict[str, Any]] = mem["peaks"]
    fsm_common: Mem | None = mem["fsm_common"]

    def mib(m: Mem | None) -> str:
        if m is None:
            return "-"
        return "> cap" if m.peak is None else f"{m.peak / 2**20:.1f} MiB"

    def ratio(a: Mem | None, b: Mem | None) -> str:
        if a is None or b is None or a.peak is None or not b.peak:
            return "-"
        return f"{a.peak / b.peak:.1f}x"

    L += [
        "## Memory",
        "",
        "`tracemalloc` peak while one library, then the next, processes one synthetic stream "
        "(one call; its prepared input is allocated before tracing starts; each traced run "
        f"capped at {res['cap']:.0f} s). First every library on the same "
        f"{_size(common.arg_bytes)} stream ({common.chunks} chunks); then each on the largest "
        f"stream it can do (the largest is {_size(largest.arg_bytes)}, {largest.chunks} chunks): "
        "the largest it finished in the speed run whose traced run should stay under the cap "
        "(tracing slows a library down by the factor seen on the first stream), next to fsm on "
        "that same stream.",
        "",
    ]
    mrows = []
    for k in keys:
        if k not in peaks:
            continue
        e = peaks[k]
        c = mib(e["common"]) if "common" in e else "> cap (speed run)"
        row = [k, c, ratio(e.get("common"), fsm_common)]
        if "largest" in e:
            w, m = e["largest"]
            f = e.get("fsm_largest", e["common"] if k == "fsm" else fsm_common)
            row += [_size(w.arg_bytes), mib(m), mib(f), ratio(m, f)]
        else:
            row += ["-", "-", "-", "-"]
        mrows.append(row)
    L += _table(
        [
            "library",
            f"peak, {_size(common.arg_bytes)}",
            "vs fsm",
            "largest stream it can do",
            "its peak there",
            "fsm there",
            "vs fsm",
        ],
        mrows,
    )
    L.append("")

    # -- where fsm lost
    L += ["## Where fsm lost", ""]
    lost = res["fsm_lost"]
    L += [f"- {_esc(x)}" for x in lost] if lost else ["- nowhere in this run."]
    L.append("")
    return "\n".join(L)


def fsm_losses(res: dict[str, Any]) -> list[str]:
    out = []
    keys = [p.key for p in res["peers"] if p.key != "fsm" and p.available]
    for r in res["quirk_rows"] + res["corpus_rows"]:
        if r.cells["fsm"][0] != RIGHT:
            right = [k for k in keys if r.cells[k][0] == RIGHT]
            out.append(
                f"correctness: `{r.key}`: fsm is {r.cells['fsm'][0]} ({r.cells['fsm'][1]})"
                + (f"; right: {', '.join(right)}" if right else "")
            )
    sp = res["speed"]
    cw = sp["corpus"]
    f = cw["timing"]["fsm"].seconds
    for k in keys:
        t = cw["timing"][k].seconds
        if f and t is not None and t < f:
            out.append(f"speed: {k} is faster than fsm on the corpus ({t / f:.2f}x)")
    for key in ("sizes", "calls"):
        s = sp[key]
        for i, w in enumerate(s["workloads"]):
            f = s["timing"]["fsm"][i].seconds
            for k in keys:
                t = s["timing"][k][i].seconds
                if f and t is not None and t < f:
                    out.append(f"speed: {k} is faster than fsm on {w.name} ({t / f:.2f}x)")
    fsm_common = res["memory"]["fsm_common"]
    size = _size(res["memory"]["common"].arg_bytes)
    for k in keys:
        m = res["memory"]["peaks"].get(k, {}).get("common")
        if (
            fsm_common is not None
            and fsm_common.peak
            and m is not None
            and m.peak is not None
            and m.peak < fsm_common.peak
        ):
            out.append(
                f"memory: {k} peaks lower than fsm on the {size} stream "
                f"({m.peak / 2**20:.2f} MiB against {fsm_common.peak / 2**20:.2f} MiB)"
            )
    return out


# -- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write the report to {OUTPUT.name}")
    ap.add_argument("--quick", action="store_true", help="synthetic streams up to 64 KB only")
    ap.add_argument("--cap", type=float, default=CAP_S, help="seconds per measurement")
    args = ap.parse_args(argv)
    if not (CORPUS / "expected.json").is_file():
        raise SystemExit(f"the corpus is not at {CORPUS}")
    t_start = time.perf_counter()
    load_start = _loadavg()
    log("loading the peers...")
    peers = load_peers()
    for p in peers:
        if not p.available:
            log(f"  {p.key}: {p.error}")
    available = [p for p in peers if p.available]

    log("correctness...")
    quirk_cases = [(q.key, q.title, q.sse(), q.expected) for q in QUIRKS]
    corpus = corpus_cases()
    corpus_cases_ = [(name, name, sse, exp) for name, sse, exp in corpus]
    quirk_rows = judge_all(peers, quirk_cases)
    corpus_rows = judge_all(peers, corpus_cases_)

    log("building workloads...")
    corpus_w = Workload("corpus", [data_payloads(sse) for _, sse, _ in corpus])
    sizes = QUICK_SIZES if args.quick else SIZES
    with gc_paused():
        size_loads = [synthetic(n, 1) for n in sizes]
        calls_loads = [synthetic(CALLS_SIZE, k) for k in CALLS]
    gc.freeze()
    mem_w = next(w for w in size_loads if w.arg_bytes == MEMORY_SIZE)

    log("warming up...")
    for p in available:
        for w in (corpus_w, size_loads[0], synthetic(4 * KIB, 16)):
            prepared = Prepared(w).get(p)
            for stream in prepared:
                p.consume(stream)

    log("speed: corpus")
    prepared = Prepared(corpus_w)
    corpus_t = {p.key: time_runs(p.consume, prepared.get(p), args.cap) for p in available}
    reference = {"corpus": reference_timings(corpus_w, args.cap)}
    del prepared
    log("speed: growing arguments")
    size_t = series(available, size_loads, args.cap, lambda w: w.arg_bytes, min_growth=1.0)
    log("speed: interleaved calls")
    seed = {k: ts[sizes.index(CALLS_SIZE)] for k, ts in size_t.items()}
    calls_t = series(available, calls_loads, args.cap, lambda w: w.calls, min_growth=0.0, seed=seed)
    reference["64 KB"] = reference_timings(size_loads[sizes.index(CALLS_SIZE)], args.cap)

    def exponents(loads: list[Workload], timing: dict[str, list[Timing]], by_size: bool) -> Any:
        out = {}
        for k, ts in timing.items():
            x = [(w.arg_bytes if by_size else w.calls) for w in loads]
            pts = [(xi, t.seconds) for xi, t in zip(x, ts, strict=True) if t.seconds is not None]
            use = [pt for pt in pts if pt[0] >= FIT_FROM] if by_size else pts
            if by_size and len(use) < 2:
                use = pts[-2:]
            e = fit_exponent(use)
            fmt = _size if by_size else str
            label = f"{fmt(int(use[0][0]))}-{fmt(int(use[-1][0]))}" if len(use) >= 2 else ""
            out[k] = (e, label)
        return out

    log("memory...")
    big = size_loads[-1]
    i_mem = size_loads.index(mem_w)
    mem: dict[str, dict[str, Any]] = {}
    fsm_peer = next(p for p in available if p.key == "fsm")
    fsm_mem: dict[int, Mem] = {}
    for p in available:
        entry: dict[str, Any] = {}
        timing = size_t[p.key]
        slowdown = float(TRACE_SLOWDOWN)
        t_common = timing[i_mem].seconds
        if t_common is not None:
            m = memory_peak(p, mem_w, args.cap)
            entry["common"] = m
            if m.seconds is not None:
                slowdown = max(1.0, m.seconds / t_common)
        # the largest stream it finished whose traced run should stay under the cap
        fits = [
            i
            for i, t in enumerate(timing)
            if t.seconds is not None and t.seconds * slowdown < args.cap
        ]
        if fits and (fits[-1] != i_mem or "common" not in entry):
            w = size_loads[fits[-1]]
            entry["largest"] = (w, memory_peak(p, w, args.cap))
            if w.arg_bytes not in fsm_mem:
                fsm_mem[w.arg_bytes] = memory_peak(fsm_peer, w, args.cap)
            entry["fsm_largest"] = fsm_mem[w.arg_bytes]
        elif "common" in entry:
            entry["largest"] = (mem_w, entry["common"])
        mem[p.key] = entry
        log(f"  {p.key}: done")
    mem_common_fsm = mem.get("fsm", {}).get("common")

    gc.unfreeze()
    res: dict[str, Any] = {
        "peers": peers,
        "env": environment(peers),
        "date": _dt.date.today().isoformat(),
        "quick": args.quick,
        "cap": args.cap,
        "quirk_rows": quirk_rows,
        "corpus_rows": corpus_rows,
        "speed": {
            "corpus": {"workload": corpus_w, "timing": corpus_t},
            "sizes": {
                "workloads": size_loads,
                "timing": size_t,
                "exponents": exponents(size_loads, size_t, True),
                "fit_label": "size",
            },
            "calls": {
                "workloads": calls_loads,
                "timing": calls_t,
                "exponents": exponents(calls_loads, calls_t, False),
                "fit_label": "calls",
            },
        },
        "memory": {"common": mem_w, "largest": big, "peaks": mem, "fsm_common": mem_common_fsm},
        "reference": reference,
        "load": (load_start, _loadavg()),
    }
    res["fsm_lost"] = fsm_losses(res)
    res["elapsed"] = time.perf_counter() - t_start
    text = render(res)
    if args.write:
        # keep the sections other scripts write (bench/store.py and bench/parse.py --write-md)
        old = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        for heading in ("## Store", "## The parser against its floor"):
            if f"\n{heading}\n" in old:
                kept = f"{heading}\n" + old.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
                text = text.rstrip("\n") + "\n\n" + kept.rstrip("\n") + "\n"
        OUTPUT.write_text(text, encoding="utf-8")
        log(f"wrote {OUTPUT} ({res['elapsed']:.0f} s)")
    else:
        print(text)
        log(f"(total {res['elapsed']:.0f} s)")
    assert set(SYMBOLS) >= {c[0] for r in quirk_rows + corpus_rows for c in r.cells.values()}
    return 0


if __name__ == "__main__":
    sys.exit(main())
