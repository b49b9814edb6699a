"""Benchmark: peak memory of a parser (and of a commit) for provider items kept verbatim.

Run from the repository root::

    python bench/items_memory.py                 # every case at 60 MiB of items (~1 minute)
    python bench/items_memory.py --mib 8         # smaller
    python bench/items_memory.py --commit        # also commit each turn (SQLite file)
    python bench/items_memory.py --json

Each case runs in a fresh subprocess that reads the stream from a file in 64 KiB reads (the
input is never held whole): the peak RSS growth (Linux ``VmHWM`` after ``/proc/self/clear_refs``
reset it, minus ``VmRSS`` before) and the CPU time of parsing it, then of ``commit_turn`` and of ``history(format=...)`` with ``--commit``. Cases:

* ``responses``: Responses ``output_item.done`` events of about 1 MiB, each a hosted-tool item
  (``web_search_call``) holding small JSON objects (``{"u": 1234, "t": "ab"}``), until the size.
* ``anthropic``: Anthropic ``web_search_tool_result`` blocks of about 1 MiB of small objects.
* ``anthropic-small``: Anthropic blocks of about 200 bytes each, as many as ``max_items`` lets
  through (the per-item overhead).
* ``chat``: Chat Completions chunks whose unknown field holds the same small objects (nothing is
  kept: the cost of decoding events only).
* ``one-event``: a single 16 MiB Responses event made of empty objects (``[{},{},...]``), the
  densest JSON: the transient cost of decoding one event at ``max_event_bytes``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20
CASES = ("responses", "anthropic", "anthropic-small", "chat", "one-event")


def _objects(size: int) -> str:
    one = '{"u":1234,"t":"ab"}'
    return "[" + ",".join([one] * max(size // (len(one) + 1), 1)) + "]"


def _sse(kind: str, data: str) -> bytes:
    return f"event: {kind}\ndata: {data}\n\n".encode()


def build(case: str, total: int) -> bytes:
    """The stream of ``case`` holding about ``total`` bytes of items."""
    out: list[bytes] = []
    if case in ("responses", "one-event"):
        out.append(_sse("response.created", '{"type":"response.created","response":{"id":"r"}}'))
        size, body = (16 * MiB - 200, "[" + ",".join(["{}"] * ((16 * MiB - 300) // 3)) + "]")
        if case == "responses":
            size, body = MiB, _objects(MiB)
        n = 1 if case == "one-event" else max(total // size, 1)
        for i in range(n):
            item = (
                f'{{"type":"web_search_call","id":"ws_{i}","status":"completed","results":{body}}}'
            )
            out.append(_sse("response.output_item.added", json.dumps({
                "type": "response.output_item.added", "output_index": i,
                "item": {"type": "web_search_call", "id": f"ws_{i}", "status": "in_progress"}})))  # fmt: skip
            out.append(_sse("response.output_item.done",
                            f'{{"type":"response.output_item.done","output_index":{i},'
                            f'"item":{item}}}'))  # fmt: skip
        out.append(
            _sse("response.completed", '{"type":"response.completed","response":{"id":"r"}}')
        )
    elif case in ("anthropic", "anthropic-small"):
        start = {"type": "message_start", "message": {"id": "m", "model": "c", "content": []}}
        out.append(_sse("message_start", json.dumps(start)))
        size = MiB if case == "anthropic" else 200
        body = _objects(size - 120)
        n = max(total // size, 1) if case == "anthropic" else 16000
        for i in range(n):
            block = (f'{{"type":"web_search_tool_result","tool_use_id":"srvtoolu_{i}",'
                     f'"content":{body}}}')  # fmt: skip
            out.append(_sse("content_block_start",
                            f'{{"type":"content_block_start","index":{i},"content_block":{block}}}'))  # fmt: skip
            out.append(_sse("content_block_stop", f'{{"type":"content_block_stop","index":{i}}}'))
        out.append(
            _sse("message_delta", '{"type":"message_delta","delta":{"stop_reason":"end_turn"}}')
        )
        out.append(_sse("message_stop", '{"type":"message_stop"}'))
    else:  # chat
        body = _objects(MiB)
        for i in range(max(total // MiB, 1)):
            out.append(
                f'data: {{"id":"c","choices":[{{"index":0,"delta":{{"content":"x"}}}}],'
                f'"extra_{i}":{body}}}\n\n'.encode()
            )
        out.append(
            b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        )
        out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> int:
    """Give freed memory back (``malloc_trim``), reset the peak RSS (Linux:
    ``/proc/self/clear_refs``) and return the RSS now (KiB)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_kib("VmRSS")


def _peak_kib() -> int:
    return _status_kib("VmHWM")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(case: str, path: str, commit: bool) -> dict[str, Any]:
    import gc

    import fsm
    from fsm import StreamParser

    gc.collect()
    before, cpu = _reset_peak(), _cpu()
    parser = StreamParser()
    size = 0
    with open(path, "rb") as stream:  # network-sized reads: the input is never held whole
        while chunk := stream.read(64 * 1024):
            size += len(chunk)
            parser.receive_data(chunk)
    parser.receive_eof()
    result = parser.result()
    turn = result.turns[0]
    parse_peak, parse_cpu = _peak_kib() - before, _cpu() - cpu
    _reset_peak()
    held = _status_kib("VmRSS") - before
    before, cpu = _reset_peak(), _cpu()
    items = len(turn.output_items()) if hasattr(turn, "items") else 0
    items_peak = _peak_kib() - before
    out: dict[str, Any] = {
        "case": case,
        "fsm": os.path.dirname(fsm.__file__),
        "input_mib": round(size / MiB, 1),
        "end": result.end_how,
        "items": items,
        "parse_peak_mib": round(parse_peak / 1024, 1),
        "held_after_parse_mib": round(held / 1024, 1),
        "parse_cpu_s": round(parse_cpu, 2),
        "output_items_peak_mib": round(items_peak / 1024, 1),
    }
    if commit and turn.complete:
        from fsm.store import ConversationStore
        from fsm.store.migrate import upgrade

        gc.collect()
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/bench.db"
            upgrade(url)
            with ConversationStore(url) as store:
                store.create_conversation("c")
                store.append("c", [{"role": "user", "content": "q"}])
                before, cpu, wall = _reset_peak(), _cpu(), time.perf_counter()
                store.commit_turn("c", result)
                out["commit_peak_mib"] = round((_peak_kib() - before) / 1024, 1)
                out["commit_cpu_s"] = round(_cpu() - cpu, 2)
                out["commit_wall_s"] = round(time.perf_counter() - wall, 2)
                fmt = result.format if result.format in ("responses", "anthropic") else "chat"
                before, cpu = _reset_peak(), _cpu()
                history = store.history("c", format=fmt)
                out["read_peak_mib"] = round((_peak_kib() - before) / 1024, 1)
                out["read_cpu_s"] = round(_cpu() - cpu, 2)
                out["read_messages"] = len(history)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=60)
    parser.add_argument("--commit", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--case", action="append", choices=CASES)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.input, args.commit)))
        return
    rows = []
    for case in args.case or CASES:
        with tempfile.NamedTemporaryFile(suffix=".sse") as tmp:
            tmp.write(build(case, args.mib * MiB))
            tmp.flush()
            command = [sys.executable, __file__, "--child", case, "--input", tmp.name]
            if args.commit:
                command.append("--commit")
            done = subprocess.run(
                command, capture_output=True, text=True, env=os.environ, check=False
            )
        if done.returncode:
            rows.append({"case": case, "error": done.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(done.stdout))
        print(json.dumps(rows[-1]), file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
