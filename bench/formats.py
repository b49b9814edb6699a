"""Responses API and Anthropic Messages streams: fsm against the official SDKs' accumulators
(and pydantic-ai), side by side in one process on the same bytes.

    python bench/formats.py              # prints the report
    python bench/formats.py --write-md   # also (re)writes "## Responses and Anthropic streams"
                                         # in BENCHMARKS.md (the rest of the file untouched)

Workloads: the 22 + 22 recordings of ``../shared/corpus-responses`` and
``../shared/corpus-anthropic``. For each library, each stream goes from its SSE bytes to the
library's final result (fsm: ``StreamParser.receive_data`` + ``receive_eof``; openai:
``openai.Stream``'s own SSE decoder, ``construct_type`` into ``ResponseStreamEvent`` and
``ResponseStreamState.handle_event``; anthropic: its ``Stream``'s SSE decoder,
``construct_type`` into ``RawMessageStreamEvent`` and ``accumulate_event``, as ``MessageStream``
does). The orjson floor is ``orjson.loads`` of every event's data, pre-split (no framing, no
work). Timings: best of N, interleaved, gc enabled; per SSE event.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
from mdsection import replace_section  # noqa: E402

import fsm  # noqa: E402

SHARED = Path(os.environ.get("FSM_FORMATS_CORPUS_DIR", REPO.parent / "shared"))
CORPORA = {"responses": SHARED / "corpus-responses", "anthropic": SHARED / "corpus-anthropic"}
BENCHMARKS = REPO / "BENCHMARKS.md"
SECTION = "## Responses and Anthropic streams"
#: the spliced Anthropic recording: its expected.json is a naive per-index accumulation; by the
#: spec the first message's call, cut off mid-JSON by a second message_start, is never usable
DEVIATIONS = {"vercel-ai__hw_spliced_two_message_starts.sse": {"complete": False}}


def load(fmt: str) -> list[tuple[str, bytes, dict[str, Any]]]:
    folder = CORPORA[fmt]
    expected = json.loads((folder / "expected.json").read_text())
    out = []
    for name in sorted(expected):
        exp = dict(expected[name])
        exp.update(DEVIATIONS.get(name, {}))
        out.append((name, (folder / name).read_bytes(), exp))
    return out


def events_of(raw: bytes) -> list[bytes]:
    """The JSON data of every SSE event (blank-line separated; data lines joined)."""
    out = []
    text = raw.replace(b"\r\n", b"\n")
    for block in text.split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if data and data[0][:1] == b"{":
            out.append(b"\n".join(data))
    return out


# -- the libraries: bytes -> (complete, usable calls) --------------------------------------------
Call = tuple[str, str, Any]  # id, name, arguments (text; an Anthropic peer's input as JSON)


def fsm_run(raw: bytes) -> Any:
    parser = fsm.StreamParser()
    parser.receive_data(raw)
    parser.receive_eof()
    return parser.result()


def fsm_calls(result: Any) -> tuple[bool, list[Call]]:
    if not result.complete:
        return False, []
    return True, [(c.id, c.name, c.arguments) for c in result.turns[0].tool_calls]


def _openai() -> tuple[Callable[[bytes], Any], Callable[[Any], tuple[bool, list[Call]]]]:
    from openai._models import construct_type
    from openai._streaming import SSEDecoder
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    def run(raw: bytes) -> Any:
        state = ResponseStreamState(input_tools=omit, text_format=omit)
        for sse in SSEDecoder().iter_bytes(iter([raw])):
            if sse.data.startswith("[DONE]"):
                break
            data = sse.json()
            if isinstance(data, dict) and data.get("error"):  # openai.Stream raises APIError
                raise RuntimeError(f"APIError: {data['error']}")
            state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
        return state

    def calls(state: Any) -> tuple[bool, list[Call]]:
        response = state._completed_response
        if response is None:
            return False, []
        out = []
        for item in response.output:
            if item.type == "function_call":
                out.append((item.call_id, item.name, item.arguments))
            elif item.type == "custom_tool_call":
                out.append((item.call_id, item.name, item.input))
        return True, out

    return run, calls


def _anthropic() -> tuple[Callable[[bytes], Any], Callable[[Any], tuple[bool, list[Call]]]]:
    from anthropic._models import construct_type
    from anthropic._streaming import SSEDecoder
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    def run(raw: bytes) -> Any:
        snapshot = None
        bufs: dict[int, bytes] = {}
        for sse in SSEDecoder().iter_bytes(iter([raw])):
            # as anthropic's Stream: ping and events without an `event:` name are skipped
            if sse.event == "ping" or sse.event is None:
                continue
            if sse.event == "error":
                raise RuntimeError(f"APIStatusError: {sse.data[:80]}")
            if not sse.data:
                continue
            event = construct_type(type_=RawMessageStreamEvent, value=sse.json())
            if snapshot is None and event.type != "message_start":
                continue
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
        return snapshot

    def calls(message: Any) -> tuple[bool, list[Call]]:
        # what a caller runs: the tool_use blocks of a final message that stopped for tool use
        # (or ended normally); MessageStream checks nothing else (message_stop is not required)
        if message is None or message.stop_reason not in ("tool_use", "end_turn", "stop_sequence"):
            return False, []
        out = [(b.id, b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]
        return True, out

    return run, calls


PEERS: dict[str, dict[str, Any]] = {
    "responses": {"openai": _openai},
    "anthropic": {"anthropic": _anthropic},
}


def _same_args(got: Any, want: str, fmt: str, custom: bool) -> bool:
    if fmt == "anthropic" and not custom:
        try:
            return bool(json.loads(got) == json.loads(want))
        except ValueError:
            return False
    return bool(got == want)


def judge(fmt: str, exp: dict[str, Any], outcome: tuple[bool, list[Call]] | None) -> str:
    """``✓`` / ``✗`` / ``E`` (raised on a stream whose turn is complete)."""
    if outcome is None:
        return "✓" if not exp["complete"] else "E"
    usable, calls = outcome
    if not exp["complete"]:
        return "✗" if usable and calls else "✓"
    if not usable:
        return "✗"
    want = exp["calls"]
    if len(calls) != len(want):
        return "✗"
    for (cid, name, args), w in zip(calls, want, strict=True):
        custom = w.get("type") == "custom_tool_call"
        if cid != w["id"] or name != w["name"] or not _same_args(args, w["arguments"], fmt, custom):
            return "✗"
    return "✓"


def correctness(fmt: str, streams: list[Any], peers: dict[str, Any]) -> dict[str, list[str]]:
    table: dict[str, list[str]] = {"fsm": []}
    for name in peers:
        table[name] = []
    for _name, raw, exp in streams:
        table["fsm"].append(judge(fmt, exp, fsm_calls(fsm_run(raw))))
        for peer, (run, calls) in peers.items():
            try:
                outcome = calls(run(raw))
            except Exception:
                outcome = None
            table[peer].append(judge(fmt, exp, outcome))
    return table


# -- timing ----------------------------------------------------------------------------------------
def best_of(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # interleaved: every library once per round
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _swallow(run: Callable[[bytes], Any], streams: list[bytes]) -> Callable[[], None]:
    def go() -> None:
        for raw in streams:
            try:
                run(raw)
            except Exception:  # a peer that raises on a stream: timed up to its raise
                continue

    return go


def timings(fmt: str, streams: list[Any], peers: dict[str, Any], rounds: int) -> dict[str, Any]:
    raws = [raw for _n, raw, _e in streams]
    payloads = [p for raw in raws for p in events_of(raw)]
    loads = orjson.loads

    def floor() -> None:
        for p in payloads:
            loads(p)

    fns: dict[str, Callable[[], Any]] = {"orjson floor": floor, "fsm": _swallow(fsm_run, raws)}
    for name, (run, _calls) in peers.items():
        fns[name] = _swallow(run, raws)
    gc.collect()
    gc.freeze()
    try:
        best = best_of(fns, rounds)
    finally:
        gc.unfreeze()
    n = len(payloads)
    return {"events": n, "bytes": sum(map(len, raws)),
            "us": {k: v / n * 1e6 for k, v in best.items()}}  # fmt: skip


# -- instruction counts (valgrind), repeatable on a busy machine ---------------------------------
def _child(lib: str, fmt: str, repeat: int) -> None:
    """Run ``lib`` over the ``fmt`` corpus ``repeat`` times (setup included even for 0)."""
    streams = load(fmt)
    raws = [raw for _n, raw, _e in streams]
    if lib == "orjson floor":
        payloads = [p for raw in raws for p in events_of(raw)]
        loads = orjson.loads

        def work() -> None:
            for p in payloads:
                loads(p)

    elif lib == "fsm":
        work = _swallow(fsm_run, raws)
        fsm_run(raws[0])  # imports the format modules (setup)
    else:
        run, _calls = PEERS[fmt][lib]()
        work = _swallow(run, raws)
        _swallow(run, raws[:1])()  # warm: lazy imports and model classes built (setup)
    for _ in range(repeat):
        work()


def instructions(fmt: str, lib: str, repeat: int = 2) -> float:
    """Instructions per SSE event of ``lib`` on the ``fmt`` corpus: cachegrind's count of
    ``repeat`` runs minus the count of none (setup), divided by the events."""
    import subprocess

    counts = []
    for n in (0, repeat):
        proc = subprocess.run(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
             sys.executable, __file__, "--child", lib, fmt, str(n)],
            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
            check=True,
        )  # fmt: skip
        found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
        assert found is not None, proc.stderr[-500:]
        counts.append(int(found.group(1).replace(",", "")))
    events = sum(len(events_of(raw)) for _n, raw, _e in load(fmt))
    return (counts[1] - counts[0]) / repeat / events


def instruction_table() -> list[str]:
    rows = [
        "| corpus | library | instructions per event | ratio to fsm |",
        "| --- | --- | --- | --- |",
    ]
    for fmt in CORPORA:
        libs = ["orjson floor", "fsm", *PEERS[fmt]]
        counts = {lib: instructions(fmt, lib, 2 if lib in ("fsm", "orjson floor") else 1)
                  for lib in libs}  # fmt: skip
        for lib in libs:
            rows.append(
                f"| {fmt} | {lib} | {counts[lib] / 1000:.1f} k | "
                f"{counts[lib] / counts['fsm']:.2f}x |"
            )
    return rows


def _without_names(fmt: str) -> int:
    return sum(not (raw.startswith(b"event:") or b"\nevent:" in raw) for _n, raw, _e in load(fmt))


def _pydantic_ai_note() -> str:
    return (
        "pydantic-ai (`OpenAIResponsesModel`, `AnthropicModel`) parses both formats, but only "
        "inside its model classes, from the SDKs' own stream objects (`AsyncStream` / "
        "`BetaAsyncMessageStream` with `peek()`), after the SDK has built every event: it is "
        "the SDK path above plus its own parts manager, so it is not timed separately here."
    )


def report(rounds: int) -> tuple[str, dict[str, Any]]:
    lines = [SECTION, ""]
    lines.append(
        "Generated by `python bench/formats.py --write-md`. fsm against the official SDKs' own "
        "stream accumulators on the recordings of `shared/corpus-responses` and "
        "`shared/corpus-anthropic`, in one process, on the same bytes: each library goes from "
        "a stream's SSE bytes to its final result. fsm: `StreamParser` (`receive_data`, "
        "`receive_eof`), format auto-detected. openai: `openai.Stream`'s SSE decoder, "
        "`construct_type` into `ResponseStreamEvent` (no validation, as `openai.Stream` does), "
        "`ResponseStreamState.handle_event` (what `client.responses.stream()` runs). anthropic: "
        "its `Stream`'s SSE decoder and event filter (`ping` and events without an `event:` "
        "line skipped, `event: error` raised), `construct_type` into `RawMessageStreamEvent`, "
        "`accumulate_event` (what `MessageStream` runs). orjson floor: `orjson.loads` of each "
        "event's data, pre-split. Best of "
        f"{rounds} interleaved rounds, gc enabled; µs per SSE event; ratio = library / fsm."
    )
    lines.append("")
    lines.append(_pydantic_ai_note())
    lines += [
        "",
        "Read the anthropic ratio with care: its `Stream` drops every event that has no "
        "`event:` line, so on the recordings written without them (proxies; "
        f"{_without_names('anthropic')} of the 22) it accumulates nothing at all, which is "
        "cheap, and wrong where calls were expected.",
    ]
    data: dict[str, Any] = {}
    speed_rows = []
    corr_rows = []
    detail = []
    for fmt in CORPORA:
        streams = load(fmt)
        peers = {name: make() for name, make in PEERS[fmt].items()}
        t = timings(fmt, streams, peers, rounds)
        c = correctness(fmt, streams, peers)
        data[fmt] = {"timings": t, "correctness": c}
        us = t["us"]
        for peer in peers:
            speed_rows.append(
                f"| {fmt} ({len(streams)} streams, {t['events']} events) | {us['fsm']:.2f} µs | "
                f"{peer}: {us[peer] / us['fsm']:.1f}x ({us[peer]:.2f} µs) | "
                f"{us['fsm'] / us['orjson floor']:.2f}x ({us['orjson floor']:.2f} µs) |"
            )
        for lib, cells in c.items():
            corr_rows.append(
                f"| {fmt} | {lib} | {cells.count('✓')}/{len(cells)} | "
                f"{', '.join(n for (n, _r, _e), cell in zip(streams, cells, strict=True) if cell != '✓') or '-'} |"
            )
        detail.append((fmt, streams, c))
    lines += [
        "",
        "### Speed (per SSE event)",
        "",
        "| corpus | fsm | SDK (ratio to fsm) | fsm / orjson floor |",
        "| --- | --- | --- | --- |",
        *speed_rows,
        "",
        "### Correctness (right / total)",
        "",
        "Judged against each corpus's `expected.json` (never against fsm): for a turn it calls "
        "complete, the calls handed over as usable must be exactly the expected ones (id, name, "
        "arguments; Anthropic arguments compared as JSON); for an incomplete one, no call may "
        "be handed over as usable (raising is right). What a peer hands over as usable: openai, "
        "the calls of `response.completed`'s response (none before it); anthropic, the "
        "`tool_use` blocks of the final message snapshot when its `stop_reason` is `tool_use`, "
        "`end_turn` or `stop_sequence` (`MessageStream` does not require `message_stop`). One "
        "deviation from expected.json, also in fsm's tests: "
        "`vercel-ai__hw_spliced_two_message_starts.sse` is judged incomplete (its first "
        "message's call is cut off mid-JSON by a second `message_start`).",
        "",
        "| corpus | library | right | wrong on |",
        "| --- | --- | --- | --- |",
        *corr_rows,
        "",
        "### Machine",
        "",
        f"CPython {platform.python_version()} ({platform.platform()}), {os.cpu_count()} cores, "
        f"load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())}. Packages: "
        + ", ".join(_versions())
        + ".",
        "",
    ]
    return "\n".join(lines), data


def _versions() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("openai", "anthropic", "orjson", "pydantic"):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            out.append(f"{dist} (not installed)")
    return out


def write_md(section: str, path: Path = BENCHMARKS) -> None:
    """Replace this script's section of ``path`` (or append it); the rest stays byte-identical."""
    replace_section(path, SECTION, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--write-md", action="store_true", help=f"write '{SECTION}'")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--instructions", action="store_true",
        help="also count instructions per event with valgrind (slow; repeatable on a busy machine)",
    )  # fmt: skip
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    for fmt, folder in CORPORA.items():
        if not (folder / "expected.json").is_file():
            print(f"the {fmt} recordings are not at {folder}", file=sys.stderr)
            return 2
    section, data = report(args.rounds)
    if args.instructions:
        section += "\n" + "\n".join(
            [
                "### Instructions per event (valgrind)",
                "",
                "Wall-clock figures on a shared machine are noisy; instruction counts are repeatable: "
                "`valgrind --tool=cachegrind --cache-sim=no`, `PYTHONHASHSEED=0`, the count of the "
                "workload run N times minus the count of the same process with setup only "
                "(`python bench/formats.py --instructions`).",
                "",
                *instruction_table(),
                "",
            ]
        )
    print(json.dumps(data, indent=1, ensure_ascii=False) if args.json else section)
    if args.write_md:
        write_md(section)
        print(f"wrote the '{SECTION}' section of {BENCHMARKS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
