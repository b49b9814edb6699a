"""Benchmark: per-chunk cost of the agent loop reading raw bytes against the SDK's parsed stream.

Run from the repository root (needs ``openai``)::

    python bench/agent.py              # 2000-chunk stream, 7 runs of each path
    python bench/agent.py --quick      # 500 chunks, 3 runs (~10 s)
    python bench/agent.py --json       # one JSON object on stdout

Everything runs in one process, against one :class:`fsm.replay.ReplayServer` on 127.0.0.1, on
the same bytes, the two paths alternating run by run:

* **raw**: what :func:`fsm.agent.run_agent_loop` does now: the ``APIResponse`` of
  ``client.chat.completions.with_streaming_response.create(..., stream=True)``, whose bytes
  (``iter_bytes()``) go to ``StreamParser.receive_data``.
* **parsed**: what it did before (and still does for a client without
  ``with_streaming_response``): the SDK's parsed ``Stream`` of ``ChatCompletionChunk`` from
  ``chat.completions.create(..., stream=True)``, each chunk to ``receive_chunk``. It is driven
  through the same ``run_agent_loop``, with the client wrapped so that it only has ``create``.

A **floor** too: the same request through ``with_streaming_response``, its bytes read and
dropped (the replay server's thread and the socket, which in one process share the GIL with the
client); "above the floor" is a path's stream figure minus the floor's.

Two figures per path:

* **stream**: one request and its stream read to the end through
  :func:`fsm.clients.iter_openai_events` (the loop's per-chunk work, without the store);
* **loop**: a whole :func:`~fsm.agent.run_agent_loop` run (two requests: the long tool-call
  turn, its tool, the commit to SQLite, the final answer), divided by the chunks of both turns.

The workload: one assistant turn streaming ``--chunks`` chunks (a quarter content deltas, the
rest the arguments of one ``echo`` call in small fragments), then the demo's final answer.
Timing: ``time.perf_counter``; best (minimum) of ``--runs`` after a warm-up, medians in
``--json``. ``us/chunk`` is that time divided by the ``data:`` payloads streamed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

try:
    import openai
except ImportError:  # pragma: no cover
    sys.exit("bench/agent.py needs the openai SDK: pip install -e '.[openai]'")

from fsm.agent import run_agent_loop
from fsm.clients import iter_openai_events
from fsm.replay import EXAMPLES_DIR, ReplayServer, ReplayTurn
from fsm.store import ConversationStore

USER = {"role": "user", "content": "Echo a long text."}
FINAL = EXAMPLES_DIR / "final_answer.sse"


def synthetic_turn(chunks: int) -> bytes:
    """An OpenAI-shaped stream of ``chunks`` data payloads: content deltas, then one tool call
    whose arguments arrive in small fragments, then the finish and ``[DONE]``."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
            "model": "bench"}  # fmt: skip
    out: list[bytes] = []

    def emit(delta: dict[str, Any], finish: str | None = None) -> None:
        payload = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        out.append(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

    content = max(1, chunks // 4)
    emit({"role": "assistant", "content": ""})
    for i in range(content - 1):
        emit({"content": f"word{i} "})
    call = {"index": 0, "id": "call_bench_1", "type": "function",
            "function": {"name": "echo", "arguments": ""}}  # fmt: skip
    emit({"tool_calls": [call]})
    fragments = max(2, chunks - content - 2)
    text = "x" * (fragments - 2) * 4
    pieces = ['{"text": "'] + [text[i : i + 4] for i in range(0, len(text), 4)] + ['"}']
    for piece in pieces:
        emit({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    emit({}, "tool_calls")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def payloads(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.startswith(b"data: {"))


class ParsedOnly:
    """The client without ``with_streaming_response``: the loop falls back to the parsed path."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.chat = SimpleNamespace(
            completions=SimpleNamespace(create=client.chat.completions.create)
        )


def echo(text: str) -> str:
    return f"{len(text)} characters"


REQUEST: dict[str, Any] = {"model": "bench", "messages": [USER], "stream": True}


def time_floor(client: openai.OpenAI, server: ReplayServer) -> float:
    """The transport alone: the same request, its bytes read and dropped."""
    start = time.perf_counter()
    with client.chat.completions.with_streaming_response.create(**REQUEST) as response:
        size = sum(len(data) for data in response.iter_bytes())
    elapsed = time.perf_counter() - start
    assert size > 0
    return elapsed


def time_stream(client: openai.OpenAI, server: ReplayServer, raw: bool) -> float:
    request = REQUEST
    start = time.perf_counter()
    completions = client.chat.completions
    source = completions.with_streaming_response.create if raw else completions.create
    with source(**request) as stream:
        events = iter_openai_events(stream)
        for _event in events:
            pass
    elapsed = time.perf_counter() - start
    result = events.result()
    assert result.turn(0).complete, result.end_how
    assert result.end_how == ("done" if raw else "eof")
    return elapsed


def time_loop(client: Any, server: ReplayServer, store: ConversationStore, n: int) -> float:
    start = time.perf_counter()
    result = run_agent_loop(client, store, f"c{n}", {"echo": echo}, model="bench",
                            messages=[USER])  # fmt: skip
    elapsed = time.perf_counter() - start
    assert result.status == "completed" and len(result.turns) == 2
    return elapsed


def measure(chunks: int, runs: int) -> dict[str, Any]:
    data = synthetic_turn(chunks)
    per_request = payloads(data)
    final_chunks = payloads(FINAL.read_bytes())
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="bench", max_retries=0)
    times: dict[str, list[float]] = {k: [] for k in ("stream floor", "stream raw", "stream parsed",
                                                     "loop raw", "loop parsed")}  # fmt: skip
    stream_script = [ReplayTurn(data, check=False) for _ in range(3 * (runs + 1))]
    with ReplayServer(stream_script) as server:
        sdk = client.with_options(base_url=server.base_url)
        for run in range(runs + 1):
            elapsed = time_floor(sdk, server)
            if run:
                times["stream floor"].append(elapsed)
            for raw in (True, False):
                elapsed = time_stream(sdk, server, raw)
                if run:  # the first is the warm-up
                    times["stream raw" if raw else "stream parsed"].append(elapsed)
    loop_script = [ReplayTurn(data, check=False), ReplayTurn(FINAL)] * (2 * (runs + 1))
    with tempfile.TemporaryDirectory() as tmp, ReplayServer(loop_script) as server:
        sdk = client.with_options(base_url=server.base_url)
        clients: dict[bool, Any] = {True: sdk, False: ParsedOnly(sdk)}
        with ConversationStore(f"sqlite:///{Path(tmp) / 'bench.db'}", auto_upgrade=True) as store:
            n = 0
            for run in range(runs + 1):
                for raw in (True, False):
                    n += 1
                    elapsed = time_loop(clients[raw], server, store, n)
                    if run:
                        times["loop raw" if raw else "loop parsed"].append(elapsed)
        assert server.failures == [], server.failures
    client.close()
    loop_chunks = per_request + final_chunks
    report: dict[str, Any] = {"chunks_per_stream": per_request, "chunks_per_loop": loop_chunks,
                              "runs": runs, "python": sys.version.split()[0],
                              "openai": openai.__version__, "figures": {}}  # fmt: skip
    for key, values in times.items():
        n_chunks = per_request if key.startswith("stream") else loop_chunks
        report["figures"][key] = {
            "best_s": min(values),
            "median_s": statistics.median(values),
            "us_per_chunk": min(values) / n_chunks * 1e6,
            "median_us_per_chunk": statistics.median(values) / n_chunks * 1e6,
        }
    f = report["figures"]
    for what in ("stream", "loop"):
        report[f"{what}_ratio_parsed_over_raw"] = (
            f[f"{what} parsed"]["us_per_chunk"] / f[f"{what} raw"]["us_per_chunk"]
        )
    # above the transport: what reading the stream costs on top of receiving its bytes
    floor = f["stream floor"]["us_per_chunk"]
    report["above_floor_us_per_chunk"] = {
        "raw": f["stream raw"]["us_per_chunk"] - floor,
        "parsed": f["stream parsed"]["us_per_chunk"] - floor,
    }
    above = report["above_floor_us_per_chunk"]
    report["above_floor_ratio_parsed_over_raw"] = above["parsed"] / max(above["raw"], 1e-9)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="500 chunks, 3 runs")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    chunks, runs = (500, 3) if args.quick else (args.chunks, args.runs)
    report = measure(chunks, runs)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    show: Callable[[str], str] = lambda k: (  # noqa: E731
        f"{report['figures'][k]['us_per_chunk']:8.2f} us/chunk "
        f"(median {report['figures'][k]['median_us_per_chunk']:.2f})"
    )
    print(f"openai {report['openai']}, Python {report['python']}, "
          f"{report['chunks_per_stream']} chunks per stream, best of {runs}")  # fmt: skip
    print(f"stream floor  {show('stream floor')}  (the transport: bytes read, nothing parsed)")
    for what in ("stream", "loop"):
        print(f"{what:6} raw    {show(what + ' raw')}")
        print(f"{what:6} parsed {show(what + ' parsed')}")
        print(f"{what:6} parsed / raw = {report[f'{what}_ratio_parsed_over_raw']:.1f}x")
    above = report["above_floor_us_per_chunk"]
    print(f"above the floor: raw {above['raw']:.2f} us/chunk, parsed {above['parsed']:.2f} "
          f"us/chunk, parsed / raw = {report['above_floor_ratio_parsed_over_raw']:.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
