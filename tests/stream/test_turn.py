"""A parsed turn is read-only, and the parser's public surface is its documented API (issue 28).

A :class:`fsm.Turn` is driven only by the stream core that made it: once its stream has ended,
every driving method raises :class:`fsm.errors.LocalProtocolError` and leaves it as it was (it
used to let ``add_call`` leave ``call_count`` at 3 with 2 ``tool_calls``, and ``end`` raise an
untyped ``transitions.MachineError``). The formats drive one core through one protocol, so the
:class:`fsm.StreamParser` facade has no driving methods for a user to call.
"""

from __future__ import annotations

from typing import Any

import pytest

import fsm
from fsm import StreamParser, ToolCall
from fsm.errors import LocalProtocolError
from fsm.turn import CONTENT, Turn
from tests.helpers import chunk, entry, sse

_STREAM = sse(
    chunk(entry(0, "call_a", "add", '{"a": 1}')),
    chunk(entry(1, "call_b", "sub", '{"b": 2}')),
    chunk(finish="tool_calls"),
)

_ANTHROPIC = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","model":"m",'
    b'"content":[],"usage":{"input_tokens":1}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":'
    b'{"type":"tool_use","id":"toolu_1","name":"add","input":{}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
    b'{"type":"input_json_delta","partial_json":"{\\"a\\": 1}"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use"}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def _snapshot(turn: Turn) -> dict[str, Any]:
    return {
        **turn.to_json(),
        "call_count": turn.call_count,
        "ended": turn.ended,
        "end_reason": turn.end_reason,
    }


def _driving_calls(turn: Turn) -> dict[str, Any]:
    extra = ToolCall(
        choice=turn.index, ordinal=turn.call_count, index=2, id="x", name="mul", type="function"
    )
    return {
        "add_call": lambda: turn.add_call(extra),
        "end": lambda: turn.end("done", None, repair=False, max_depth=512),
        "append_text": lambda: turn.append_text(CONTENT, "more", 4),
        "finish": lambda: turn.finish("stop"),
        "route": lambda: turn.route(0, None, None),
        "note_id": lambda: turn.note_id(turn.tool_calls[0]),
    }


@pytest.mark.parametrize("data", [_STREAM, _ANTHROPIC], ids=["chat", "anthropic"])
@pytest.mark.parametrize("method", ["add_call", "end", "append_text", "finish", "route", "note_id"])
def test_a_parsed_turn_refuses_every_driving_method_and_stays_as_it_was(
    data: bytes, method: str
) -> None:
    result = fsm.parse(data)
    turn = result.turn(0)
    assert turn.ended and turn.complete
    before = _snapshot(turn)
    with pytest.raises(LocalProtocolError, match=rf"Turn\.{method}\(\).*read-only"):
        _driving_calls(turn)[method]()
    assert _snapshot(turn) == before
    assert turn.call_count == len(turn.tool_calls)
    assert turn.to_message()["role"] == "assistant"


def test_a_live_turn_is_still_driven_by_its_parser() -> None:
    """The guard is the end of the stream, not the method: the parser drives live turns."""
    parser = StreamParser()
    parser.receive_data(_STREAM[: _STREAM.index(b"data: [DONE]")])
    turn = parser.turns[0]
    assert not turn.ended and turn.call_count == 2
    parser.receive_eof()
    assert turn.ended and turn.complete and turn.call_count == 2


@pytest.mark.parametrize(
    "name",
    [
        "count_header_bytes", "header_id_set", "header_over_limit", "max_id_bytes",
        "max_name_bytes", "_process", "_frames", "_end", "_fail", "_anomaly", "_open",
    ],
)  # fmt: skip
def test_the_parser_has_no_driving_method(name: str) -> None:
    """What a format needs is the core's (fsm.formats.core.StreamCore), not the facade's."""
    assert not hasattr(StreamParser(), name)


@pytest.mark.parametrize("format", ["auto", "chat", "responses", "anthropic"])
def test_no_format_patches_the_parser_instance(format: str) -> None:
    """A format is the core's handler: the parser instance keeps its class's methods."""
    parser = StreamParser(format=format)
    parser.receive_data(_ANTHROPIC if format in ("auto", "anthropic") else b"")
    assert [k for k in vars(parser) if callable(vars(parser)[k])] == []


def test_a_limit_mid_event_ends_the_turn_and_nothing_drives_it_after() -> None:
    """An Anthropic message_start whose id passes max_id_bytes ends the stream (a limit) before
    its stop_reason is read: the ended turn is not driven again (no finish_reason set after
    the end, no event after StreamEnded)."""
    start = (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"'
        + b"m" * 600
        + b'","model":"m","content":[],"stop_reason":"end_turn"}}\n\n'
    )
    parser = StreamParser()
    events = parser.receive_data(start) + parser.receive_eof()
    result = parser.result()
    assert (result.end_how, result.end_reason) == ("limit", "limit:max_id_bytes")
    assert type(events[-1]).__name__ == "StreamEnded"
    assert result.turn(0).ended and result.turn(0).finish_reason is None
