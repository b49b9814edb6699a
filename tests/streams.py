"""Builders for small hand-written streams in the shape providers send."""

from __future__ import annotations

import json
from typing import Any


def tc(
    index: Any = None,
    id: Any = None,
    name: Any = None,
    args: Any = None,
    type: Any = None,
    *,
    omit_index: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """One ``tool_calls[]`` entry; ``None`` fields are left out (``omit_index`` drops index).

    Values are not checked, so tests can put wrong types anywhere; ``extra`` adds fields."""
    entry: dict[str, Any] = {}
    if index is not None and not omit_index:
        entry["index"] = index
    if id is not None:
        entry["id"] = id
    if type is not None:
        entry["type"] = type
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    if function:
        entry["function"] = function
    entry.update(extra)
    return entry


def entry(
    index: Any = 0, id: Any = None, name: Any = None, args: Any = None, **extra: Any
) -> dict[str, Any]:
    """:func:`tc` with index 0 by default (positional: index, id, name, args)."""
    return tc(index, id, name, args, **extra)


def chunk(
    *tool_calls: dict[str, Any],
    content: str | None = None,
    finish: str | None = None,
    choice: int = 0,
    **delta_extra: Any,
) -> dict[str, Any]:
    delta: dict[str, Any] = dict(delta_extra)
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = list(tool_calls)
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "test-model",
        "choices": [{"index": choice, "delta": delta, "finish_reason": finish}],
    }


def sse(*chunks: dict[str, Any] | str, done: bool = True) -> bytes:
    """SSE bytes: each chunk as ``data: <json>`` plus a blank line; a str is sent raw."""
    out = []
    for c in chunks:
        out.append(c if isinstance(c, str) else "data: " + json.dumps(c) + "\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def strict_json(text: str) -> bool:
    """The tests' own oracle (independent of fsm.toolcall.is_json): RFC 8259 JSON (no
    NaN/Infinity), or empty / JSON whitespace only."""
    if not text.strip(" \t\r\n"):
        return True

    def reject(constant: str) -> Any:
        raise ValueError(constant)

    try:
        json.loads(text, parse_constant=reject)
    except (ValueError, RecursionError):
        return False
    return True
