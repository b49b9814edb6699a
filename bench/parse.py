"""Benchmark: per-chunk cost of ``fsm.StreamParser.receive_data`` against the JSON decode floor.

Run from the repository root::

    python bench/parse.py            # full run (under a minute on an idle machine)
    python bench/parse.py --quick    # short run (~10 s): no 2 MB stream, fewer runs
    python bench/parse.py --json     # one JSON object on stdout (progress goes to stderr)
    python bench/parse.py --no-gc    # gc.disable() during every timed run
    python bench/parse.py --profile  # also cProfile fsm on the 200 KB synthetic stream

    python bench/parse.py --instructions --write-md   # also count instructions (valgrind)
                                                      # and write its BENCHMARKS.md section

Everything runs in one process, on the same bytes; the floors and fsm are interleaved (one run
of each in turn, round after round):

* **decode floor**: ``orjson.loads`` of every ``data:`` payload, pre-extracted before timing (so
  the floor does no SSE framing and builds nothing). The floor of ``receive_chunk``.
* **SSE floor**: the same reads split the fastest plain way (per read, the complete events end
  at the last blank line; when they are all one ``data: `` line, one split on the separator),
  then ``orjson.loads`` of each payload. The floor of ``receive_data``.
* **fsm**: a fresh ``StreamParser`` per stream, fed the raw bytes in network-sized reads
  (``--read-size``, 16 KiB by default) and, separately, as one whole buffer; the returned event
  lists are collected, and ``receive_eof()`` is called at the end. And ``receive_chunk`` of
  every chunk decoded before timing (then ``"[DONE]"`` where the stream has it).
* **bare dict loop**: the same result built from the decoded chunks with no library (text per
  choice, calls by index): no check, no event, no limit.
* **bare**: a minimal accumulation loop (split on ``b"\\n\\n"``, strip ``data: ``,
  ``orjson.loads``, append argument fragments to a dict keyed by index): no events, no checks.
  Same feeding as fsm.
* **openai**: openai-python's ``ChatCompletionStreamState`` the way ``ChatCompletionStream``
  drives it: per payload ``construct_type(type_=ChatCompletionChunk, value=data)`` then
  ``handle_chunk(chunk)`` (events collected). It gets the pre-extracted payloads and decodes them
  with ``orjson.loads``: the SDK itself uses its own SSE decoder and ``json.loads``, so this is a
  lower bound of the SDK's cost.

Workloads: every ``*.sse`` stream of the shared corpus (read in place), and a synthetic stream of
8 interleaved tool calls in OpenAI's shape, arguments in 4-character fragments, at 20 KB, 200 KB
(the table) and 2 MB of arguments (the scaling section).

Timing: ``time.perf_counter_ns``; each figure is the best (minimum) of several runs after a
warm-up run; medians are in ``--json``. The collector stays enabled unless ``--no-gc`` (the
scaling section adds an fsm column measured with ``gc.disable()``), with the inputs frozen out of
it (``gc.freeze()``). Results of the last timed run of every consumer are checked (arguments
byte-exact) so no consumer can skip work.

"chunks" are the JSON ``data:`` payloads before ``data: [DONE]``. Every ratio is a consumer's
time divided by the floor's time on the same streams. Corpus streams a peer cannot handle (it
raises, or decodes a different number of payloads) are left out of that peer's ratio, and the
row says so.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import itertools
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson
from mdsection import replace_section

import fsm
from fsm import StreamParser
from fsm.sse import SSEFramer

if "--count-one" in sys.argv:  # an instruction-counting child: importing openai is not counted
    sys.modules["openai"] = None  # type: ignore[assignment]
try:
    from openai._models import construct_type
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    HAVE_OPENAI = True
except ImportError:  # pragma: no cover - the peer is optional
    HAVE_OPENAI = False

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus"

READ_SIZE = 16 * 1024
TARGET_RATIO = 3.0
SYNTHETIC_CALLS = 8
FRAGMENT_CHARS = 4
SIZES = (20_000, 200_000, 2_000_000)
MAIN_SIZE = 200_000
#: openai's ChatCompletionStreamState is quadratic in argument bytes (it re-dumps and re-builds
#: the whole message snapshot on every chunk): ~15 s at 200 KB, so no 2 MB run.
OPENAI_MAX_SIZE = 200_000

_BOM = b"\xef\xbb\xbf"
_DONE = b"[DONE]"

Timer = Callable[[], int]


# -- workloads --------------------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    """Streams plus, per stream, the JSON payloads the floor decodes."""

    name: str
    streams: list[bytes]
    payloads: list[list[bytes]]
    arg_bytes: int = 0
    #: for synthetic streams: the arguments every call must end with.
    expected_args: list[str] | None = None
    labels: list[str] = field(default_factory=list)
    #: per stream: the payloads decoded (receive_chunk's input; built on first use) and
    #: whether the stream ends in [DONE]
    decoded: list[list[Any]] | None = None

    @property
    def dicts(self) -> list[list[Any]]:
        if self.decoded is None:
            self.decoded = [[orjson.loads(p) for p in ps] for ps in self.payloads]
        return self.decoded

    @property
    def done(self) -> list[bool]:
        return [b"\ndata: [DONE]" in b"\n" + s for s in self.streams]

    @property
    def chunks(self) -> int:
        return sum(len(p) for p in self.payloads)

    @property
    def stream_bytes(self) -> int:
        return sum(len(s) for s in self.streams)

    def subset(self, keep: Sequence[int]) -> Workload:
        return Workload(
            self.name,
            [self.streams[i] for i in keep],
            [self.payloads[i] for i in keep],
            self.arg_bytes,
            self.expected_args,
            [self.labels[i] for i in keep] if self.labels else [],
        )


def sse_payloads(stream: bytes) -> list[bytes]:
    """The JSON ``data`` payloads of ``stream`` before ``[DONE]``, by a naive framer of its own.

    Setup only (never timed); cross-checked against ``fsm.sse.SSEFramer``.
    """
    text = stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if text.startswith(_BOM):
        text = text[3:]
    blocks = text.split(b"\n\n")
    blocks.pop()  # an event is dispatched by a blank line: the tail is incomplete or empty
    out: list[bytes] = []
    for block in blocks:
        data: list[bytes] = []
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value[:1] == b" " else value)
            elif line == b"data":
                data.append(b"")
        if not data:
            continue
        payload = b"\n".join(data)
        if payload.strip() == _DONE:
            break
        if payload.strip():
            out.append(payload)
    return out


def _framer_payloads(stream: bytes) -> list[bytes]:
    out: list[bytes] = []
    for _event, payload, _offset in SSEFramer().feed(stream):
        if payload.strip() == _DONE:
            break
        if payload.strip():
            out.append(payload)
    return out


def _decodable(payloads: list[bytes]) -> list[bytes]:
    out = []
    for p in payloads:
        try:
            orjson.loads(p)
        except orjson.JSONDecodeError:
            continue
        out.append(p)
    return out


def corpus_workload() -> Workload:
    files = sorted(CORPUS.rglob("*.sse"))
    if not files:
        raise SystemExit(f"no corpus streams under {CORPUS}")
    streams = [f.read_bytes() for f in files]
    payloads = []
    for f, s in zip(files, streams, strict=True):
        mine = sse_payloads(s)
        if mine != _framer_payloads(s):
            raise SystemExit(f"payload extraction disagrees with fsm's framer on {f}")
        payloads.append(_decodable(mine))
    labels = [str(f.relative_to(CORPUS)) for f in files]
    return Workload(f"corpus ({len(files)} streams)", streams, payloads, labels=labels)


def _arguments(i: int, size: int) -> str:
    """A valid JSON object of exactly ``size`` ASCII characters."""
    head = f'{{"path":"src/module_{i}.py","content":"'
    unit = "lorem ipsum dolor sit amet, consectetur adipiscing elit\\n"
    n = size - len(head) - 2
    if n < 0:
        raise ValueError(f"argument size {size} is too small")
    filler = (unit * (n // len(unit) + 1))[:n]
    if filler.endswith("\\"):  # never leave a lone backslash before the closing quote
        filler = filler[:-1] + " "
    return head + filler + '"}'


def synthetic_workload(total_arg_bytes: int) -> Workload:
    """8 interleaved tool calls, ``total_arg_bytes`` of arguments in 4-character fragments, in
    the shape OpenAI streams them (gpt-4o chunks, round-robin across the indices)."""
    calls = SYNTHETIC_CALLS
    sizes = [total_arg_bytes // calls] * calls
    for i in range(total_arg_bytes % calls):
        sizes[i] += 1
    args = [_arguments(i, n) for i, n in enumerate(sizes)]
    head = (
        b'{"id":"chatcmpl-9tXjpPLJgivc9nyuBCCWX8HNg9L2J","object":"chat.completion.chunk",'
        b'"created":1723024757,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_2a322c9ffc",'
        b'"choices":[{"index":0,"delta":'
    )
    tail_open = b',"logprobs":null,"finish_reason":null}]}'

    def chunk(delta: bytes, tail: bytes = tail_open) -> bytes:
        return head + delta + tail

    payloads = [chunk(b'{"role":"assistant","content":null}')]
    for i in range(calls):
        header = {
            "tool_calls": [
                {
                    "index": i,
                    "id": f"call_{i:02d}lQnnsesjFMWMQ5IeWPHzR4th",
                    "type": "function",
                    "function": {"name": "write_file", "arguments": ""},
                }
            ]
        }
        payloads.append(chunk(orjson.dumps(header)))
    frags = [[a[j : j + FRAGMENT_CHARS] for j in range(0, len(a), FRAGMENT_CHARS)] for a in args]
    prefixes = [b'{"tool_calls":[{"index":%d,"function":{"arguments":' % i for i in range(calls)]
    dumps = orjson.dumps
    for r in range(max(len(f) for f in frags)):
        for i in range(calls):
            if r < len(frags[i]):
                payloads.append(head + prefixes[i] + dumps(frags[i][r]) + b"}}]}" + tail_open)
    payloads.append(chunk(b"{}", b',"logprobs":null,"finish_reason":"tool_calls"}]}'))
    stream = b"".join([b"data: " + p + b"\n\n" for p in payloads]) + b"data: " + _DONE + b"\n\n"
    return Workload(
        f"synthetic {_size(total_arg_bytes)}",
        [stream],
        [payloads],
        arg_bytes=total_arg_bytes,
        expected_args=args,
    )


def _size(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1_000_000:g} MB"
    if n >= 1_000:
        return f"{n / 1_000:g} KB"
    return f"{n} B"


# -- consumers (each returns the elapsed ns of one run over the whole workload) -------------------


def run_floor(w: Workload) -> int:
    loads = orjson.loads
    t0 = time.perf_counter_ns()
    for payloads in w.payloads:
        for p in payloads:
            loads(p)
    return time.perf_counter_ns() - t0


def sse_floor(stream: bytes, read: int | None) -> int:
    """The floor of ``receive_data``: split the SSE the fastest plain way and ``orjson.loads``
    every data payload, in the same reads. Per read, the complete events end at the last blank
    line; when they are all single ``data: `` lines (the newlines tell), one split on the
    separator gives the payloads; otherwise each block's ``data`` lines are joined. Returns the
    payloads decoded."""
    loads = orjson.loads
    decoded = 0
    buf = b""
    step = len(stream) if read is None else read
    for i in range(0, len(stream), step):
        buf += stream[i : i + step]
        end = buf.rfind(b"\n\n")
        if end < 0:
            continue
        text = buf[:end]
        buf = buf[end + 2 :]
        if text.startswith(b"data: ") and text.count(b"\n") == 2 * text.count(b"\n\ndata: "):
            payloads = text[6:].split(b"\n\ndata: ")
        else:
            payloads = []
            for block in text.split(b"\n\n"):
                data = [
                    line[6:] if line[5:6] == b" " else line[5:]
                    for line in block.split(b"\n")
                    if line.startswith(b"data:")
                ]
                if data:
                    payloads.append(b"\n".join(data))
        for payload in payloads:
            if payload == _DONE:
                return decoded
            loads(payload)
            decoded += 1
    return decoded


def run_sse_floor(w: Workload, read: int | None) -> int:
    t0 = time.perf_counter_ns()
    for stream in w.streams:
        sse_floor(stream, read)
    return time.perf_counter_ns() - t0


def bare_dicts(chunks: list[Any]) -> dict[Any, Any]:
    """The same result as fsm's from decoded chunks with no library: per choice, the text
    fields and the calls by index (id, name, arguments), the last finish_reason. No check, no
    event, no limit."""
    turns: dict[Any, Any] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            t = turns.get(choice.get("index", 0))
            if t is None:
                t = turns[choice.get("index", 0)] = [[], [], {}, None]
            delta = choice.get("delta")
            if delta:
                content = delta.get("content")
                if content:
                    t[0].append(content)
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    t[1].append(reasoning)
                for tc in delta.get("tool_calls") or ():
                    call = t[2].get(tc.get("index"))
                    if call is None:
                        call = t[2][tc.get("index")] = ["", "", []]
                    if tc.get("id"):
                        call[0] = tc["id"]
                    fn = tc.get("function")
                    if fn:
                        if fn.get("name"):
                            call[1] = fn["name"]
                        if fn.get("arguments"):
                            call[2].append(fn["arguments"])
            if choice.get("finish_reason"):
                t[3] = choice["finish_reason"]
    for t in turns.values():
        t[0] = "".join(t[0])
        t[1] = "".join(t[1])
        for call in t[2].values():
            call[2] = "".join(call[2])
    return turns


def run_bare_dicts(w: Workload, keep: list[Any] | None = None) -> int:
    held = []
    t0 = time.perf_counter_ns()
    for chunks in w.dicts:
        held.append(bare_dicts(chunks))
    elapsed = time.perf_counter_ns() - t0
    if keep is not None:
        keep[:] = held
    return elapsed


def run_fsm_chunks(w: Workload, keep: list[Any] | None = None) -> int:
    """``receive_chunk`` of every decoded chunk (then ``"[DONE]"`` where the stream has it, then
    ``receive_eof()``), events collected."""
    held: list[Any] = []
    t0 = time.perf_counter_ns()
    for chunks, done in zip(w.dicts, w.done, strict=True):
        parser = StreamParser()
        receive = parser.receive_chunk
        events: list[Any] = []
        for chunk in chunks:
            events += receive(chunk)
        if done:
            events += receive("[DONE]")
        events += parser.receive_eof()
        held.append((parser, events))
    elapsed = time.perf_counter_ns() - t0
    if keep is not None:
        keep[:] = held
    return elapsed


def run_fsm(w: Workload, read: int | None, keep: list[Any] | None = None) -> int:
    """``read=None`` feeds each stream as one buffer. Parsers and events are kept alive until
    the clock has stopped, so their deallocation is not timed."""
    held: list[Any] = []
    t0 = time.perf_counter_ns()
    for stream in w.streams:
        parser = StreamParser()
        receive = parser.receive_data
        events: list[Any] = []
        if read is None:
            events += receive(stream)
        else:
            for i in range(0, len(stream), read):
                events += receive(stream[i : i + read])
        events += parser.receive_eof()
        held.append((parser, events))
    elapsed = time.perf_counter_ns() - t0
    if keep is not None:
        keep[:] = held
    return elapsed


def bare_parse(stream: bytes, read: int | None) -> tuple[int, dict[Any, list[str]]]:
    """The bare loop over one stream: returns (payloads decoded, {index: fragments})."""
    loads = orjson.loads
    calls: dict[Any, list[str]] = {}
    decoded = 0
    buf = b""
    step = len(stream) if read is None else read
    for i in range(0, len(stream), step):
        buf += stream[i : i + step]
        blocks = buf.split(b"\n\n")
        buf = blocks.pop()
        for block in blocks:
            if not block.startswith(b"data: "):
                continue
            payload = block[6:]
            if payload == _DONE:
                return decoded, calls
            obj = loads(payload)
            decoded += 1
            for choice in obj.get("choices") or ():
                for tc in (choice.get("delta") or {}).get("tool_calls") or ():
                    fn = tc.get("function")
                    if fn and fn.get("arguments"):
                        calls.setdefault(tc.get("index"), []).append(fn["arguments"])
    return decoded, calls


def run_bare(w: Workload, read: int | None, keep: list[Any] | None = None) -> int:
    held = []
    t0 = time.perf_counter_ns()
    for stream in w.streams:
        held.append(bare_parse(stream, read))
    elapsed = time.perf_counter_ns() - t0
    if keep is not None:
        keep[:] = held
    return elapsed


def openai_parse(payloads: list[bytes]) -> tuple[Any, list[Any]]:
    """The SDK's streaming loop minus its SSE decoder, with orjson instead of json.loads."""
    loads = orjson.loads
    state: Any = ChatCompletionStreamState()
    events: list[Any] = []
    for p in payloads:
        data = loads(p)
        if isinstance(data, dict) and data.get("error"):
            raise RuntimeError("APIError")  # what openai._streaming.Stream raises here
        chunk: Any = construct_type(type_=ChatCompletionChunk, value=data)
        if chunk.object != "chat.completion.chunk":  # _is_valid_chat_completion_chunk_weak
            continue
        events.extend(state.handle_chunk(chunk))
    return state, events


def run_openai(w: Workload, keep: list[Any] | None = None) -> int:
    held = []
    t0 = time.perf_counter_ns()
    for payloads in w.payloads:
        held.append(openai_parse(payloads))
    elapsed = time.perf_counter_ns() - t0
    if keep is not None:
        keep[:] = held
    return elapsed


# -- checks (untimed): every consumer must have done the whole job --------------------------------


def check_fsm(w: Workload, held: list[Any]) -> int:
    """Verify fsm's result of the last timed run on a synthetic stream; return its event count."""
    parser, events = held[0]
    result = parser.result()
    got = [c.arguments for c in result.turn(0).tool_calls]
    if got != w.expected_args or not result.complete:
        raise SystemExit(f"fsm got wrong arguments on {w.name}")
    return len(events)


def check_bare(w: Workload, held: list[Any]) -> None:
    decoded, calls = held[0]
    if ["".join(calls[i]) for i in sorted(calls)] != w.expected_args:
        raise SystemExit(f"bare loop got wrong arguments on {w.name}")
    if decoded != w.chunks:
        raise SystemExit(f"bare loop decoded {decoded} payloads, expected {w.chunks}")


def check_openai(w: Workload, held: list[Any]) -> None:
    state, _events = held[0]
    message = state.current_completion_snapshot.choices[0].message
    if [tc.function.arguments for tc in message.tool_calls] != w.expected_args:
        raise SystemExit(f"openai got wrong arguments on {w.name}")


def supported(w: Workload, peer: str) -> tuple[list[int], list[str]]:
    """Indices of the corpus streams a peer handles, and the labels of the others."""
    ok: list[int] = []
    bad: list[int] = []
    for i, (stream, payloads) in enumerate(zip(w.streams, w.payloads, strict=True)):
        try:
            if peer == "bare":
                a = bare_parse(stream, None)[0]
                b = bare_parse(stream, READ_SIZE)[0]
                good = a == b == len(payloads)
            else:
                openai_parse(payloads)
                good = True
        except Exception:
            good = False
        (ok if good else bad).append(i)
    return ok, [w.labels[i] for i in bad]


# -- timing -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Stat:
    best_ns: int
    median_ns: int
    runs: int

    def per(self, n: int) -> float:
        """Best time per unit, in µs."""
        return self.best_ns / n / 1000


@dataclass(slots=True)
class Settings:
    min_runs: int
    max_runs: int
    budget_ns: int
    gc_off: bool
    #: a first run longer than this is timed once only (and is not a warm-up).
    single_run_ns: int = 4_000_000_000
    #: a first run longer than this counts as a sample (the global warm-up has run).
    warm_ns: int = 1_000_000_000


def _timed(fn: Timer, gc_off: bool) -> int:
    gc.collect()
    if gc_off:
        gc.disable()
    try:
        return fn()
    finally:
        if gc_off:
            gc.enable()


def measure(label: str, fn: Timer, s: Settings) -> Stat:
    """Warm up, then repeat until ``min_runs`` and the time budget are spent; best = min.

    A first run longer than ``warm_ns`` counts as a sample (the code is warm by then: the
    smaller workloads ran first) and such long runs are repeated only once; a first run longer
    than ``single_run_ns`` is the only sample.
    """
    t0 = time.perf_counter()
    first = _timed(fn, s.gc_off)
    samples: list[int] = []
    need = s.min_runs
    if first >= s.warm_ns:
        samples.append(first)
        need = 2
    if first < s.single_run_ns:
        start = time.perf_counter_ns()
        while len(samples) < s.max_runs and (
            len(samples) < need or time.perf_counter_ns() - start < s.budget_ns
        ):
            samples.append(_timed(fn, s.gc_off))
    stat = Stat(min(samples), int(statistics.median(samples)), len(samples))
    log(
        f"    {label:<28} best {stat.best_ns / 1e6:9.1f} ms  median {stat.median_ns / 1e6:9.1f} ms"
        f"  runs {stat.runs:>2}  ({time.perf_counter() - t0:.1f} s)"
    )
    return stat


def measure_group(fns: dict[str, Timer], s: Settings) -> dict[str, Stat]:
    """Like :func:`measure` for several consumers at once, interleaved: one run of each in
    turn, round after round, so that a noisy spell on a shared machine hits all of them."""
    t0 = time.perf_counter()
    for fn in fns.values():
        _timed(fn, s.gc_off)  # warm-up
    samples: dict[str, list[int]] = {name: [] for name in fns}
    start = time.perf_counter_ns()
    rounds = 0
    while rounds < s.max_runs and (
        rounds < s.min_runs or time.perf_counter_ns() - start < s.budget_ns * len(fns)
    ):
        for name, fn in fns.items():
            samples[name].append(_timed(fn, s.gc_off))
        rounds += 1
    out = {}
    for name, runs in samples.items():
        out[name] = stat = Stat(min(runs), int(statistics.median(runs)), len(runs))
        log(
            f"    {name:<28} best {stat.best_ns / 1e6:9.1f} ms  median "
            f"{stat.median_ns / 1e6:9.1f} ms  runs {stat.runs:>2}"
        )
    log(f"    ({len(fns)} consumers interleaved, {time.perf_counter() - t0:.1f} s)")
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the benchmark --------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    workload: str
    #: the entry point: ``receive_data`` or ``receive_chunk``
    entry: str
    feed: str
    chunks: int
    stream_bytes: int
    #: the row's floor: the SSE floor (split + decode) for receive_data, the decode floor for
    #: receive_chunk
    floor: Stat
    #: orjson.loads of the pre-extracted payloads (no framing)
    decode: Stat
    fsm: Stat
    fsm_events: int | None
    peers: dict[str, dict[str, Any]]

    @property
    def ratio(self) -> float:
        return self.fsm.best_ns / self.floor.best_ns

    @property
    def decode_ratio(self) -> float:
        return self.fsm.best_ns / self.decode.best_ns


def peer_entry(
    stat: Stat | None, floor: Stat | None, chunks: int, note: str = ""
) -> dict[str, Any]:
    if stat is None or floor is None:
        return {"ratio": None, "note": note}
    return {
        "ratio": stat.best_ns / floor.best_ns,
        "us_per_chunk": stat.per(chunks),
        "best_ns": stat.best_ns,
        "median_ns": stat.median_ns,
        "runs": stat.runs,
        "floor_best_ns": floor.best_ns,
        "chunks": chunks,
        "note": note,
    }


def bench_workload(
    w: Workload, s: Settings, read: int, openai_skip: str | None, whole: bool
) -> tuple[list[Row], dict[str, Any]]:
    """The table rows (network feed, and whole buffer if ``whole``) of one workload, plus its
    scaling point. ``openai_skip`` is the reason the openai peer is not run, if it is not."""
    log(f"  {w.name}: {w.chunks} chunks, {w.stream_bytes / 1e6:.1f} MB of SSE")
    synth = w.expected_args is not None
    box: list[Any] = []
    group: dict[str, Timer] = {
        "decode floor": lambda: run_floor(w),
        f"SSE floor, {read}-byte reads": lambda: run_sse_floor(w, read),
        f"fsm, {read}-byte reads": lambda: run_fsm(w, read, box),
    }
    if whole:  # the table's workloads (the scaling points need fsm's reads only)
        group["fsm, receive_chunk"] = lambda: run_fsm_chunks(w, box)
        group["bare dict loop"] = lambda: run_bare_dicts(w, box)
        group["SSE floor, whole buffer"] = lambda: run_sse_floor(w, None)
        group["fsm, whole buffer"] = lambda: run_fsm(w, None, box)
    stats = measure_group(group, s)
    floor = stats["decode floor"]
    fsm_net = stats[f"fsm, {read}-byte reads"]
    run_fsm(w, read, box)
    events = check_fsm(w, box) if synth else None
    if whole:
        run_fsm_chunks(w, box)
        if synth:
            check_fsm(w, box)
    box.clear()
    fsm_whole = stats.get("fsm, whole buffer")

    # peers on the corpus: only on the streams they handle, against the floor on those streams
    bare_w, bare_floor, bare_note = w, floor, ""
    if w.labels:
        keep, bad = supported(w, "bare")
        if bad:
            bare_w = w.subset(keep)
            bare_floor = measure("floor (bare's streams)", lambda: run_floor(bare_w), s)
            bare_note = f"{len(keep)}/{len(w.streams)} streams (its naive framing misses the rest)"
    bare_net = measure(f"bare, {read}-byte reads", lambda: run_bare(bare_w, read, box), s)
    if synth:
        check_bare(w, box)
    bare_whole = None
    if whole:
        bare_whole = measure("bare, whole buffer", lambda: run_bare(bare_w, None, box), s)
        if synth:
            check_bare(w, box)
    box.clear()

    oa_stat: Stat | None = None
    oa_w, oa_floor, oa_note = w, floor, openai_skip or ""
    if openai_skip is None:
        if w.labels:
            keep, bad = supported(w, "openai")
            if bad:
                oa_w = w.subset(keep)
                oa_floor = measure("floor (openai's streams)", lambda: run_floor(oa_w), s)
                oa_note = f"{len(keep)}/{len(w.streams)} streams (it raises on: {', '.join(bad)})"
        oa_stat = measure("openai", lambda: run_openai(oa_w, box), s)
        if synth:
            check_openai(w, box)
        box.clear()
    oa_entry = peer_entry(oa_stat, oa_floor, oa_w.chunks, oa_note)

    feed = f"{read // 1024} KiB" if read % 1024 == 0 else f"{read} B"
    peers = {"bare": peer_entry(bare_net, bare_floor, bare_w.chunks, bare_note), "openai": oa_entry}
    sse = stats[f"SSE floor, {read}-byte reads"]
    rows = [
        Row(w.name, "receive_data", feed, w.chunks, w.stream_bytes, sse, floor, fsm_net, events, peers)
    ]  # fmt: skip
    if fsm_whole is not None and bare_whole is not None:
        whole_peers = {
            "bare": peer_entry(bare_whole, bare_floor, bare_w.chunks, bare_note),
            "openai": oa_entry,
        }
        rows.append(
            Row(
                w.name, "receive_data", "whole", w.chunks, w.stream_bytes,
                stats["SSE floor, whole buffer"], floor, fsm_whole, events, whole_peers,
            )
        )  # fmt: skip
    if whole:
        dict_loop = stats["bare dict loop"]
        rows.append(
            Row(
                w.name, "receive_chunk", "dicts", w.chunks, w.stream_bytes, floor, floor,
                stats["fsm, receive_chunk"], events,
                {"bare dicts": peer_entry(dict_loop, floor, w.chunks, ""), "openai": oa_entry},
            )
        )  # fmt: skip
    fsm_nogc: Stat | None = None
    if synth and not s.gc_off:
        # the events are kept alive: separate the cyclic collector's share from fsm's own work
        nogc = dataclasses.replace(s, gc_off=True)
        fsm_nogc = measure(f"fsm, {read}-byte reads, gc off", lambda: run_fsm(w, read), nogc)
    point = {
        "arg_bytes": w.arg_bytes,
        "chunks": w.chunks,
        "stream_bytes": w.stream_bytes,
        "floor_ns": floor.best_ns,
        "fsm_ns": fsm_net.best_ns,
        "fsm_gc_off_ns": fsm_nogc.best_ns if fsm_nogc else None,
        "bare_ns": bare_net.best_ns,
        "openai_ns": oa_stat.best_ns if oa_stat else None,
        "runs": {
            "floor": floor.runs,
            "fsm": fsm_net.runs,
            "fsm_gc_off": fsm_nogc.runs if fsm_nogc else None,
            "bare": bare_net.runs,
            "openai": oa_stat.runs if oa_stat else None,
        },
    }
    return rows, point


def warm_up(corpus: Workload, small: Workload, read: int) -> None:
    for w in (corpus, small):
        run_floor(w)
        run_fsm(w, read)
        run_fsm(w, None)
    run_bare(small, read)
    run_bare(small, None)


def profile_fsm(w: Workload, read: int, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run_fsm(w, read)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def fsm_revision() -> str | None:
    """The repository's HEAD commit (short), ``+dirty`` when ``fsm/`` has local changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "fsm"], timeout=5
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def exponent(t1: float, t2: float, n1: float, n2: float) -> float:
    return math.log(t2 / t1) / math.log(n2 / n1)


# -- output -----------------------------------------------------------------------------------


def _fmt_ratio(entry: dict[str, Any]) -> str:
    r = entry.get("ratio")
    if r is None:
        return "-"
    return f"{r:.2f}x" + ("*" if entry.get("note") else "")


def render(result: dict[str, Any]) -> str:
    env = result["environment"]
    st = result["settings"]
    lines = [
        f"fsm {env['fsm']} ({env['fsm_revision']}) parse benchmark: Python {env['python']}, "
        f"orjson {env['orjson']}, openai {env['openai']}, {env['platform']}",
        f"timing: time.perf_counter_ns, {st['statistic']}; {st['gc']}",
        f"feed: network-like reads of {st['read_size']} bytes, and whole buffer (one "
        "receive_data per stream); fsm/bare collect their output and fsm ends with receive_eof()",
        "decode floor: orjson.loads of each pre-extracted data: payload (no framing); SSE floor: "
        "the same reads split the fastest plain way + orjson.loads; openai: "
        "orjson.loads + construct_type(ChatCompletionChunk) + ChatCompletionStreamState"
        ".handle_chunk on the pre-extracted payloads (no framing: a lower bound for the SDK)",
        "",
    ]
    head = (
        f"{'workload':<20} {'entry':<13} {'chunks':>6} {'feed':>6} {'floor µs/ch':>11} "
        f"{'fsm µs/ch':>9} {'fsm/floor':>9} {'fsm/decode':>10} {'bare/decode':>11} "
        f"{'openai/decode':>13}"
    )
    lines += [head, "-" * len(head)]
    notes: dict[str, str] = {}
    for row in result["rows"]:
        bare = row["peers"].get("bare") or row["peers"].get("bare dicts") or {}
        lines.append(
            f"{row['workload']:<20} {row['entry']:<13} {row['chunks']:>6} {row['feed']:>6} "
            f"{row['floor_us_per_chunk']:>11.2f} {row['fsm_us_per_chunk']:>9.2f} "
            f"{row['fsm_ratio']:>8.2f}x {row['fsm_decode_ratio']:>9.2f}x "
            f"{_fmt_ratio(bare):>11} {_fmt_ratio(row['peers']['openai']):>13}"
        )
        for peer, entry in row["peers"].items():
            if entry.get("note"):
                notes[f"{peer} on {row['workload']}"] = entry["note"]
    for what, note in notes.items():
        lines.append(f"  * {what}: {note}")
    lines.append(
        "  floor: receive_data rows: the SSE floor (the same reads split the fastest plain way, "
        "orjson.loads of each payload); receive_chunk rows: the decode floor (orjson.loads of "
        "the same chunks). bare/decode: receive_data rows the bare SSE loop, receive_chunk "
        "rows the bare dict loop (the same result from the dicts, no check, no event)"
    )
    if result.get("instructions"):
        lines += ["", render_instructions(result["instructions"])]

    sc = result["scaling"]
    lines += [
        "",
        f"scaling: synthetic stream, {SYNTHETIC_CALLS} interleaved calls, "
        f"{FRAGMENT_CHARS}-char fragments, {st['read_size']}-byte reads; "
        "ns per argument byte (best run)",
    ]
    head = (
        f"{'arguments':>9} {'chunks':>7} {'SSE MB':>7} {'floor':>7} {'fsm':>7} "
        f"{'fsm gc-off':>10} {'bare':>7} {'openai':>8}"
    )
    lines += [head, "-" * len(head)]
    for p in sc["points"]:

        def nb(key: str, width: int = 7, p: dict[str, Any] = p) -> str:
            v = p[key]
            return f"{v / p['arg_bytes']:>{width}.1f}" if v else f"{'-':>{width}}"

        lines.append(
            f"{_size(p['arg_bytes']):>9} {p['chunks']:>7} {p['stream_bytes'] / 1e6:>7.1f} "
            f"{nb('floor_ns')} {nb('fsm_ns')} {nb('fsm_gc_off_ns', 10)} {nb('bare_ns')} "
            f"{nb('openai_ns', 8)}"
        )
    for e in sc["exponents"]:
        parts = [
            f"{k.replace('_', '-')} {v:.2f}" for k, v in e["exponent"].items() if v is not None
        ]
        lines.append(f"growth exponent {e['from']} -> {e['to']}: " + ", ".join(parts))
    lines.append(
        "  (log(t2/t1)/log(n2/n1) over argument bytes: 1.0 = linear, 10x the bytes costs 10x the "
        "time; 2.0 = quadratic. fsm gc-off: same run with gc.disable(), since the collected "
        "events stay alive and the cyclic gc's full passes grow with the live heap)"
    )
    lines += ["", result["verdict"]]
    if result.get("profile"):
        lines += ["", result["profile"]]
    return "\n".join(lines)


# -- instruction counts (valgrind), repeatable on a busy machine ----------------------------------

#: what is counted: (mode, label) for each consumer
COUNTED = (
    ("decode", "decode floor"),
    ("sse", "SSE floor"),
    ("dicts", "bare dict loop"),
    ("data", "fsm receive_data"),
    ("chunk", "fsm receive_chunk"),
)
COUNT_SYNTHETIC = 20_000
SECTION = "## The parser against its floor"


def _count_one(mode: str, workload: str, runs: int, read: int) -> None:
    """The instruction-counting child: build the workload, run one consumer ``runs`` times."""
    w = corpus_workload() if workload == "corpus" else synthetic_workload(int(workload))
    if mode in ("chunk", "dicts"):
        w.dicts  # noqa: B018 - decoded before counting
    gc.collect()
    gc.freeze()  # the inputs out of the collector, as in the timed runs
    box: list[Any] = []
    fn: Timer = {
        "decode": lambda: run_floor(w),
        "sse": lambda: run_sse_floor(w, read),
        "dicts": lambda: run_bare_dicts(w, box),
        "data": lambda: run_fsm(w, read, box),
        "chunk": lambda: run_fsm_chunks(w, box),
    }[mode]
    gc.collect()
    for _ in range(runs):
        fn()


def _instructions(mode: str, workload: str, runs: int, read: int) -> int:
    cmd = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, str(Path(__file__).resolve()), "--count-one", mode, workload, str(runs),
        "--read-size", str(read),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in done.stderr.splitlines():
        if "I   refs:" in line or "I refs:" in line:
            return int(line.rsplit(":", 1)[1].replace(",", "").strip())
    raise SystemExit(f"valgrind gave no instruction count for {mode} on {workload}:\n{done.stderr}")


def count_instructions(read: int) -> dict[str, Any]:
    """Instructions per run of every consumer on the synthetic 20 KB stream and the corpus:
    (3 runs - 1 run) / 2 of the same child process, so that start-up, workload building and
    first-run effects cancel. Two children at a time."""
    from concurrent.futures import ThreadPoolExecutor

    workloads = [str(COUNT_SYNTHETIC), "corpus"]
    jobs = [(m, wl, n) for wl in workloads for m, _ in COUNTED for n in (1, 3)]
    log(f"counting instructions ({len(jobs)} valgrind runs, two at a time)...")
    with ThreadPoolExecutor(2) as pool:
        counts = dict(zip(jobs, pool.map(lambda j: _instructions(*j, read), jobs), strict=True))
    out: dict[str, Any] = {}
    for wl in workloads:
        per = {m: (counts[(m, wl, 3)] - counts[(m, wl, 1)]) // 2 for m, _ in COUNTED}
        out["corpus" if wl == "corpus" else f"synthetic {_size(int(wl))}"] = per
    return out


def render_instructions(counts: dict[str, Any]) -> str:
    lines = [
        "instructions per run (valgrind --tool=cachegrind, PYTHONHASHSEED=0; (3 runs - 1 run) / 2)",
        f"{'workload':<20} "
        + " ".join(f"{label:>17}" for _, label in COUNTED)
        + f" {'data/SSE floor':>14} {'chunk/decode':>12} {'chunk/dicts':>11}",
    ]
    for wl, per in counts.items():
        lines.append(
            f"{wl:<20} "
            + " ".join(f"{per[m] / 1e6:>16.1f}M" for m, _ in COUNTED)
            + f" {per['data'] / per['sse']:>13.2f}x {per['chunk'] / per['decode']:>11.2f}x"
            f" {per['chunk'] / per['dicts']:>10.2f}x"
        )
    return "\n".join(lines)


def render_md(result: dict[str, Any], shown: str) -> str:
    """The BENCHMARKS.md section of this benchmark."""
    env = result["environment"]
    lines = [
        SECTION,
        "",
        f"Generated by `python bench/parse.py {shown}` on {time.strftime('%Y-%m-%d')} in "
        f"{result['elapsed_s']:.0f} s. Do not edit by hand: rerun the script (it replaces this "
        "section only).",
        "",
        "fsm's parser against the floor: the cost of the same input with no library at all, "
        "measured in the same process, interleaved, best run of each. For `receive_data` (SSE "
        "bytes in 16 KiB reads, or the whole buffer) the floor is splitting the SSE the fastest "
        "plain way (per read, one split on the event separator when every event is one "
        "`data:` line) and `orjson.loads` of each payload. For `receive_chunk` (the chunk dicts, "
        "decoded before timing) the floor is `orjson.loads` of the same chunks: the cost of "
        "getting the dicts. Next to it, the bare dict loop: the same result built from the "
        "dicts (text per choice, calls by index) with no check, no event and no limit. fsm's "
        "events are collected and every stream ends with `receive_eof()`.",
        "",
        "| workload | entry | feed | chunks | floor | fsm | fsm / floor | fsm / decode only "
        "| bare / decode only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        bare = row["peers"].get("bare") or row["peers"].get("bare dicts") or {}
        floor_name = "SSE" if row["entry"] == "receive_data" else "decode"
        lines.append(
            f"| {row['workload']} | `{row['entry']}` | {row['feed']} | {row['chunks']} | "
            f"{floor_name} {row['floor_us_per_chunk']:.2f} µs | {row['fsm_us_per_chunk']:.2f} µs | "
            f"**{row['fsm_ratio']:.2f}x** | {row['fsm_decode_ratio']:.2f}x | {_fmt_ratio(bare)} |"
        )
    lines += [
        "",
        "Cells: µs per chunk; ratios are times over the floor's on the same streams. "
        "bare / decode only: the bare SSE loop (split, decode, arguments appended by index) for "
        "`receive_data` rows, the bare dict loop for `receive_chunk` rows"
        + (
            "; `*`: on the streams it handles"
            if any(e.get("note") for r in result["rows"] for e in r["peers"].values())
            else ""
        )
        + ".",
        "",
    ]
    if result.get("instructions"):
        lines += [
            "Instructions per run (`valgrind --tool=cachegrind --cache-sim=no`, "
            "`PYTHONHASHSEED=0`; (3 runs - 1 run) / 2 of one process, so start-up cancels; the "
            "inputs frozen out of the collector): repeatable to about 1% (the cyclic "
            "collector's passes fall where the allocations put them), whatever the load, "
            "unlike the times above.",
            "",
            "| workload | "
            + " | ".join(label for _, label in COUNTED)
            + " | receive_data / SSE floor | receive_chunk / decode | receive_chunk / dict loop |",
            "| --- | " + " | ".join("---" for _ in COUNTED) + " | --- | --- | --- |",
        ]
        for wl, per in result["instructions"].items():
            lines.append(
                f"| {wl} | "
                + " | ".join(f"{per[m] / 1e6:.1f} M" for m, _ in COUNTED)
                + f" | {per['data'] / per['sse']:.2f}x | {per['chunk'] / per['decode']:.2f}x | "
                f"{per['chunk'] / per['dicts']:.2f}x |"
            )
        lines.append("")
    lines.append(result["verdict"] + ".")
    if result.get("instructions"):
        worst = max(
            max(per["data"] / per["sse"], per["chunk"] / per["decode"])
            for per in result["instructions"].values()
        )
        lines += [
            "",
            f"By instructions (the repeatable measure): fsm/floor at most {worst:.2f}x "
            f"({'MET' if worst <= TARGET_RATIO else 'NOT MET'} against {TARGET_RATIO:g}x). "
            "Python code loses more than orjson when the machine is shared (its working set "
            "is larger), so the times above give higher ratios than the instructions on a "
            "busy machine.",
        ]
    lines += [
        "",
        f"Machine: {platform.platform(terse=True)}, {os.cpu_count()} cores; Python "
        f"{env['python']}, orjson {env['orjson']}, fsm {env['fsm']} ({env['fsm_revision']}); "
        f"load average {result['loadavg_1min']['start']} at the start, "
        f"{result['loadavg_1min']['end']} at the end.",
    ]
    return "\n".join(lines) + "\n"


def write_md(section: str, path: Path) -> None:
    """Replace this benchmark's section of ``path`` (or append it); the rest stays as it is."""
    replace_section(path, SECTION, section)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--quick", action="store_true", help="short run: no 2 MB stream, fewer runs")
    ap.add_argument("--read-size", type=int, default=READ_SIZE, help="bytes per network read")
    ap.add_argument("--no-gc", action="store_true", help="gc.disable() during timed runs")
    ap.add_argument("--profile", action="store_true", help="cProfile fsm on the 200 KB stream")
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions under valgrind (synthetic 20 KB and corpus; a few minutes)",
    )
    ap.add_argument(
        "--write-md", action="store_true", help=f"write the '{SECTION}' section of BENCHMARKS.md"
    )
    ap.add_argument("--count-one", nargs=3, metavar=("MODE", "WORKLOAD", "RUNS"), help="internal")
    args = ap.parse_args(argv)
    read: int = args.read_size
    if read < 1:
        ap.error("--read-size must be positive")
    if args.count_one:
        mode, workload, runs = args.count_one
        _count_one(mode, workload, int(runs), read)
        return 0

    t_start = time.perf_counter()
    cpu_start = time.process_time()
    load_start = _loadavg()
    if args.quick:
        s = Settings(
            min_runs=3, max_runs=5, budget_ns=150_000_000, gc_off=args.no_gc, warm_ns=200_000_000
        )
        sizes: tuple[int, ...] = (20_000, 200_000)
    else:
        s = Settings(min_runs=3, max_runs=25, budget_ns=600_000_000, gc_off=args.no_gc)
        sizes = SIZES

    log("building workloads...")
    corpus = corpus_workload()
    synth = {n: synthetic_workload(n) for n in sizes}
    corpus.dicts  # noqa: B018 - receive_chunk's input, decoded before timing
    if MAIN_SIZE in synth:
        synth[MAIN_SIZE].dicts  # noqa: B018
    gc.collect()
    gc.freeze()  # the inputs out of the collector: what is collected is what the consumers made
    log("warming up...")
    warm_up(corpus, synth[sizes[0]], read)

    log("measuring...")
    rows: list[Row] = []
    no_openai = None if HAVE_OPENAI else "openai is not installed"
    rows += bench_workload(corpus, s, read, no_openai, whole=True)[0]
    points = []
    for n in sizes:
        skip = no_openai
        if n > OPENAI_MAX_SIZE:
            skip = f"skipped above {_size(OPENAI_MAX_SIZE)}: too slow"
        elif args.quick and n > 20_000:
            skip = "skipped in --quick"
        w_rows, point = bench_workload(synth.pop(n), s, read, skip, whole=n == MAIN_SIZE)
        points.append(point)
        if n == MAIN_SIZE:
            rows += w_rows

    exps = []
    for a, b in itertools.pairwise(points):
        e: dict[str, float | None] = {}
        for key in ("floor", "fsm", "fsm_gc_off", "bare", "openai"):
            t1, t2 = a[f"{key}_ns"], b[f"{key}_ns"]
            e[key] = exponent(t1, t2, a["arg_bytes"], b["arg_bytes"]) if t1 and t2 else None
        exps.append({"from": _size(a["arg_bytes"]), "to": _size(b["arg_bytes"]), "exponent": e})

    worst = max(r.ratio for r in rows)
    verdict = (
        f"target fsm/floor <= {TARGET_RATIO:g}x, events included: "
        f"{'MET' if worst <= TARGET_RATIO else 'NOT MET'} ("
        + ", ".join(f"{r.workload} {r.entry} {r.feed} {r.ratio:.2f}x" for r in rows)
        + ")"
    )
    instructions = count_instructions(read) if args.instructions else None
    prof = None
    if args.profile:
        w = synthetic_workload(MAIN_SIZE)
        prof = profile_fsm(w, read)

    result: dict[str, Any] = {
        "environment": {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": platform.platform(terse=True),
            "fsm": fsm.__version__,
            "fsm_revision": fsm_revision(),
            "orjson": version("orjson"),
            "openai": version("openai") if HAVE_OPENAI else None,
        },
        "settings": {
            "read_size": read,
            "statistic": f"best (min) of {s.min_runs}-{s.max_runs} runs after a warm-up run, "
            f"~{s.budget_ns / 1e9:g} s per figure (runs over {s.warm_ns / 1e9:g} s: best of 2, "
            f"no warm-up; over {s.single_run_ns / 1e9:g} s: one run); medians and run counts "
            "in --json",
            "gc": "gc disabled during timed runs (--no-gc)"
            if s.gc_off
            else "gc enabled (gc.collect() before each run)",
            "quick": args.quick,
            "corpus": str(CORPUS),
        },
        "rows": [
            {
                "workload": r.workload,
                "entry": r.entry,
                "feed": r.feed,
                "chunks": r.chunks,
                "stream_bytes": r.stream_bytes,
                "floor_us_per_chunk": r.floor.per(r.chunks),
                "fsm_us_per_chunk": r.fsm.per(r.chunks),
                "fsm_ratio": r.ratio,
                "fsm_decode_ratio": r.decode_ratio,
                "decode_best_ns": r.decode.best_ns,
                "floor_best_ns": r.floor.best_ns,
                "floor_median_ns": r.floor.median_ns,
                "fsm_best_ns": r.fsm.best_ns,
                "fsm_median_ns": r.fsm.median_ns,
                "runs": r.fsm.runs,
                "fsm_events": r.fsm_events,
                "peers": r.peers,
            }
            for r in rows
        ],
        "scaling": {"points": points, "exponents": exps},
        "target_ratio": TARGET_RATIO,
        "target_met": worst <= TARGET_RATIO,
        "verdict": verdict,
        "instructions": instructions,
        "profile": prof,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "cpu_over_wall": round(
            (time.process_time() - cpu_start) / (time.perf_counter() - t_start), 3
        ),
        "loadavg_1min": {"start": load_start, "end": _loadavg()},
    }
    if args.write_md:
        shown = " ".join(
            a for a, on in (("--quick", args.quick), ("--instructions", args.instructions)) if on
        )
        write_md(render_md(result, (shown + " --write-md").strip()), REPO / "BENCHMARKS.md")
        log(f"wrote the '{SECTION}' section of {REPO / 'BENCHMARKS.md'}")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
        busy = result["cpu_over_wall"] < 0.95 or (result["loadavg_1min"]["end"] or 0) > 1.5
        print(
            f"\n(total {result['elapsed_s']} s; cpu/wall {result['cpu_over_wall']:.2f}; load "
            f"average {result['loadavg_1min']['start']} -> {result['loadavg_1min']['end']}"
            + ("; other processes competed for the CPU: figures are noisy" if busy else "")
            + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
