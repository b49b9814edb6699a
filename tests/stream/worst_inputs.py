"""The worst inputs for the parser's memory and time at its default limits (round 2).

Each generator yields SSE bytes in pieces (fed to ``receive_data`` in 64 KiB reads by
``tests/stream/test_limits.py``, in a subprocess that measures peak RSS). The bounds and the measured
figures are in the README ("Limits" / "Worst-case memory").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MiB = 1024 * 1024
DONE = b"data: [DONE]\n\n"


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _choice(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish}


def _chunk(*choices: dict[str, Any]) -> dict[str, Any]:
    return {"id": "chatcmpl-worst", "model": "m", "choices": list(choices)}


def many_calls() -> Iterator[bytes]:
    """128 choices (max_choices) x 1024 calls (max_tool_calls) with a 1-byte name: the most
    call objects a stream can make (131,072), 64 calls per chunk."""
    for ci in range(128):
        for start in range(0, 1024, 64):
            entries = [
                {"index": i, "id": f"c{i}", "function": {"name": "f", "arguments": "{}"}}
                for i in range(start, start + 64)
            ]
            yield _event(_chunk(_choice(ci, {"tool_calls": entries})))
    yield _event(_chunk(*(_choice(ci, {}, "tool_calls") for ci in range(128)))) + DONE


def name_fragments() -> Iterator[bytes]:
    """1024 calls whose names come in 512 one-byte fragments each (max_name_bytes): 524,288
    header fragments, 64 per chunk (never equal to the name held, so none is a repeat)."""
    yield _event(_chunk(_choice(0, {"tool_calls": [{"index": i} for i in range(1024)]})))
    for k in range(512):
        byte = "ab"[k % 2]
        for start in range(0, 1024, 64):
            entries = [{"index": i, "function": {"name": byte}} for i in range(start, start + 64)]
            yield _event(_chunk(_choice(0, {"tool_calls": entries})))
    yield _event(_chunk(_choice(0, {}, "tool_calls"))) + DONE


def tiny_content(count: int = 1_000_000) -> Iterator[bytes]:
    """A million one-byte content fragments: memory must track the text, not the fragments."""
    piece = _event(_chunk(_choice(0, {"content": "x"}))) * 10_000
    for _ in range(count // 10_000):
        yield piece
    yield _event(_chunk(_choice(0, {}, "stop"))) + DONE


def wide_text() -> Iterator[bytes]:
    """Text up to max_stream_bytes (64 MiB of UTF-8) in 4 MiB fragments over two choices, each
    fragment with one emoji, so that every string Python keeps is 4 bytes per character (the
    most memory per UTF-8 byte of mostly-ASCII text); then the stream limit ends it."""
    fragment = "😀" + "x" * (4 * MiB - 4)
    for k in range(17):  # 68 MiB: the 17th fragment passes the limit
        yield _event(_chunk(_choice(k % 2, {"content": fragment})))
    yield DONE


def wide_arguments() -> Iterator[bytes]:
    """Arguments up to max_stream_bytes: 8 calls of 8 MiB (max_argument_bytes) in 2 MiB
    fragments, each fragment with one emoji (4 bytes per character kept), all valid JSON."""
    fragment = "😀" + "x" * (2 * MiB - 6)  # 2 MiB - 2 bytes of UTF-8
    calls = []
    for i in range(8):
        calls.append({"index": i, "id": f"c{i}", "function": {"name": "f", "arguments": '["'}})
    yield _event(_chunk(_choice(0, {"tool_calls": calls})))
    for i in range(8):
        for k in range(4):
            last = '"]' if k == 3 else ""
            # the header's 2 bytes + 4 fragments: 8 MiB - 6 bytes per call, and the whole
            # stream just under 64 MiB
            piece = fragment[: len(fragment) - (2 if k == 3 else 0)] + last
            yield _event(_chunk(_choice(0, {"tool_calls": [{"index": i, "function": {
                "arguments": piece}}]})))  # fmt: skip
    yield _event(_chunk(_choice(0, {}, "tool_calls"))) + DONE


def deep_arguments(size: int = 2 * MiB) -> Iterator[bytes]:
    """One call whose arguments are the syntax checker's slowest valid JSON: many branches
    nested five deep (``[[[[[]]]]],...``), which orjson is not trusted with (too many
    containers: memory), in 64 KiB fragments."""
    unit = "[[[[[]]]]]"
    text = "[" + ",".join([unit] * (size // (len(unit) + 1))) + "]"
    yield _event(_chunk(_choice(0, {"tool_calls": [{"index": 0, "id": "c", "function": {
        "name": "f", "arguments": ""}}]})))  # fmt: skip
    for start in range(0, len(text), 64 * 1024):
        fragment = text[start : start + 64 * 1024]
        yield _event(_chunk(_choice(0, {"tool_calls": [{"index": 0, "function": {
            "arguments": fragment}}]})))  # fmt: skip
    yield _event(_chunk(_choice(0, {}, "tool_calls"))) + DONE


@dataclass(frozen=True)
class Worst:
    id: str
    make: Callable[[], Iterator[bytes]]
    #: the outcome: (end_how, end_reason)
    end: tuple[str, str | None]
    #: peak RSS growth allowed (MB), and wall time (s)
    max_rss_mb: float
    max_seconds: float
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


WORST: dict[str, Worst] = {
    w.id: w
    for w in [
        Worst("many-calls", many_calls, ("done", None), 160, 20),
        Worst("name-fragments", name_fragments, ("done", None), 24, 30),
        Worst("tiny-content", tiny_content, ("done", None), 16, 20),
        Worst("wide-text", wide_text, ("limit", "limit:max_stream_bytes"), 640, 20),
        Worst("wide-arguments", wide_arguments, ("done", None), 640, 20),
        Worst("deep-arguments", deep_arguments, ("done", None), 24, 20),
    ]
}
