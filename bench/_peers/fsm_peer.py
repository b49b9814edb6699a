"""fsm itself: ``StreamParser``."""

from __future__ import annotations

from typing import Any

from . import Call, Outcome, describe

LABEL = "fsm"
DISTS = ("fsm",)
#: what prepare() builds; adapters of the same kind can share prepared chunks
KIND = "dicts"
HOW = (
    "`fsm.StreamParser`: the matrix feeds the raw SSE bytes to `receive_data()` then "
    "`receive_eof()` (fsm is its own SSE front end); the timings feed the chunk dicts to "
    "`receive_chunk()` then `receive_eof()` (and, for reference, the SSE bytes to "
    "`receive_data()`)."
)
USABLE = (
    "the call's turn is `complete` (so `Turn.to_message()` returns it); an incomplete turn's "
    "calls are never usable (`to_message()` raises `IncompleteTurnError`)."
)

_StreamParser: Any = None
_RemoteProtocolError: Any = None


def setup() -> None:
    global _StreamParser, _RemoteProtocolError
    from fsm import RemoteProtocolError, StreamParser

    _StreamParser = StreamParser
    _RemoteProtocolError = RemoteProtocolError


def _outcome(parser: Any) -> Outcome:
    result = parser.result()
    out = Outcome()
    for turn in result.turns:
        out.choices[turn.index] = [
            Call(
                id=c.id,
                name=c.name,
                arguments=c.arguments,
                usable=turn.complete,
                note="" if turn.complete else f"{c.state.value} ({c.reason})",
            )
            for c in turn.tool_calls
        ]
    if result.error is not None:
        out.raised = f"{type(result.error).__name__}: {result.error}"
    return out


def prepare(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return chunks


prepare_fast = prepare


def consume(chunks: list[dict[str, Any]]) -> Outcome:
    parser = _StreamParser()
    receive = parser.receive_chunk
    try:
        for chunk in chunks:
            receive(chunk)
        parser.receive_eof()
    except _RemoteProtocolError as exc:
        return Outcome(raised=describe(exc))
    return _outcome(parser)


def run_sse(sse: bytes) -> Outcome:
    parser = _StreamParser()
    try:
        parser.receive_data(sse)
        parser.receive_eof()
    except _RemoteProtocolError as exc:
        return Outcome(raised=describe(exc))
    return _outcome(parser)


def prepare_sse(chunks: list[dict[str, Any]]) -> bytes:
    """The chunks as one SSE body, for the "fsm from SSE bytes" reference timing."""
    import json

    body = "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks)
    return (body + "data: [DONE]\n\n").encode("utf-8")
