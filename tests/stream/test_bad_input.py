"""Bad input on purpose: what is not a chunk raises ``RemoteProtocolError`` (saying where), misuse
of the API raises ``LocalProtocolError``, and limits end calls or streams with a named reason
while memory stays bounded."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest

from fsm import (
    AnomalyDetected,
    Limits,
    LocalProtocolError,
    RemoteProtocolError,
    StreamEnded,
    StreamParser,
    ToolCallAborted,
    ToolCallArgumentsDelta,
    ToolCallOpened,
    ToolCallState,
)
from tests.helpers import entry

# -- builders ----------------------------------------------------------------------------------


def chunk_with(choices: Any = None, **top: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    if choices is not None:
        out["choices"] = choices
    out.update(top)
    return out


def choice(delta: Any = None, index: Any = 0, finish: Any = None) -> dict[str, Any]:
    return {"index": index, "delta": {} if delta is None else delta, "finish_reason": finish}


def delta_chunk(delta: Any, ci: int = 0, finish: Any = None) -> dict[str, Any]:
    return chunk_with([choice(delta, ci, finish)])


def calls_chunk(*entries: Any, ci: int = 0, finish: Any = None) -> dict[str, Any]:
    return delta_chunk({"tool_calls": list(entries)}, ci, finish)


def sse(*items: dict[str, Any] | str) -> bytes:
    return b"".join(
        (item if isinstance(item, str) else "data: " + json.dumps(item)).encode() + b"\n\n"
        for item in items
    )


#: The first event of every bad stream: opens a live call (index 0) with partial arguments.
OPENING = calls_chunk(entry(0, "call_a", "get_weather", '{"city": "Par'))
OPENING_SSE = sse(OPENING)
GOOD_ENTRY = entry(1, "call_b", "lookup", "{}")
GOOD_CHOICE = choice({"content": "fine"})


def wrong_entry(**fields: Any) -> dict[str, Any]:
    """A chunk whose SECOND tool-call entry (tool_calls[1]) carries ``fields``."""
    bad = {"index": 2, "id": "call_c", "function": {"name": "f", "arguments": "{}"}}
    for key, value in fields.items():
        if key.startswith("function."):
            bad["function"][key.removeprefix("function.")] = value
        else:
            bad[key] = value
    return calls_chunk(GOOD_ENTRY, bad)


TC1 = "choices[0].delta.tool_calls[1]"

#: (id, bad chunk, JSON path the error must name)
WRONG_TYPES: list[tuple[str, Any, str]] = [
    ("choices-object", chunk_with({"0": GOOD_CHOICE}), "choices"),
    ("choices-string", chunk_with("abc"), "choices"),
    ("choices-number", chunk_with(7), "choices"),
    ("choices-zero", chunk_with(0), "choices"),
    ("choices-false", chunk_with(False), "choices"),
    ("choice-number", chunk_with([GOOD_CHOICE, 5]), "choices[1]"),
    ("choice-list", chunk_with([[]]), "choices[0]"),
    ("choice-string", chunk_with(["x"]), "choices[0]"),
    ("choice-index-string", chunk_with([choice({}, "0")]), "choices[0].index"),
    ("choice-index-negative", chunk_with([choice({}, -1)]), "choices[0].index"),
    ("choice-index-true", chunk_with([choice({}, True)]), "choices[0].index"),
    ("choice-index-false", chunk_with([choice({}, False)]), "choices[0].index"),
    ("choice-index-float", chunk_with([choice({}, 0.0)]), "choices[0].index"),
    ("second-choice-index", chunk_with([GOOD_CHOICE, choice({}, "1")]), "choices[1].index"),
    ("delta-list", chunk_with([{"index": 0, "delta": []}]), "choices[0].delta"),
    ("delta-string", chunk_with([{"index": 0, "delta": "hi"}]), "choices[0].delta"),
    ("delta-number", chunk_with([{"index": 0, "delta": 0}]), "choices[0].delta"),
    ("tool-calls-object", delta_chunk({"tool_calls": {"index": 0}}), "choices[0].delta.tool_calls"),
    ("tool-calls-empty-object", delta_chunk({"tool_calls": {}}), "choices[0].delta.tool_calls"),
    ("tool-calls-string", delta_chunk({"tool_calls": "x"}), "choices[0].delta.tool_calls"),
    ("tool-calls-zero", delta_chunk({"tool_calls": 0}), "choices[0].delta.tool_calls"),
    ("entry-string", calls_chunk(GOOD_ENTRY, "x"), TC1),
    ("entry-null", calls_chunk(GOOD_ENTRY, None), TC1),
    ("entry-list", calls_chunk(GOOD_ENTRY, []), TC1),
    ("entry-number", calls_chunk(GOOD_ENTRY, 3), TC1),
    ("index-string", wrong_entry(index="x"), TC1 + ".index"),
    ("index-numeric-string", wrong_entry(index="1"), TC1 + ".index"),
    ("index-negative", wrong_entry(index=-1), TC1 + ".index"),
    ("index-true", wrong_entry(index=True), TC1 + ".index"),
    ("index-float", wrong_entry(index=1.5), TC1 + ".index"),
    ("id-number", wrong_entry(id=5), TC1 + ".id"),
    ("id-object", wrong_entry(id={}), TC1 + ".id"),
    ("type-number", wrong_entry(type=1), TC1 + ".type"),
    ("type-false", wrong_entry(type=False), TC1 + ".type"),
    ("function-list", wrong_entry(function=[]), TC1 + ".function"),
    ("function-string", wrong_entry(function="f"), TC1 + ".function"),
    ("function-false", wrong_entry(function=False), TC1 + ".function"),
    ("name-number", wrong_entry(**{"function.name": 3}), TC1 + ".function.name"),
    ("name-list", wrong_entry(**{"function.name": ["f"]}), TC1 + ".function.name"),
    ("arguments-object", wrong_entry(**{"function.arguments": {}}), TC1 + ".function.arguments"),
    ("arguments-filled-object", wrong_entry(**{"function.arguments": {"a": 1}}), TC1 + ".function.arguments"),
    ("arguments-number", wrong_entry(**{"function.arguments": 0}), TC1 + ".function.arguments"),
    ("arguments-list", wrong_entry(**{"function.arguments": []}), TC1 + ".function.arguments"),
    ("content-number", delta_chunk({"content": 5}), "choices[0].delta.content"),
    ("content-zero", delta_chunk({"content": 0}), "choices[0].delta.content"),
    ("content-false", delta_chunk({"content": False}), "choices[0].delta.content"),
    ("content-object", delta_chunk({"content": {"text": "x"}}), "choices[0].delta.content"),
    ("reasoning-content-number", delta_chunk({"reasoning_content": 1}), "choices[0].delta.reasoning_content"),
    ("reasoning-content-zero", delta_chunk({"reasoning_content": 0}), "choices[0].delta.reasoning_content"),
    ("reasoning-list", delta_chunk({"reasoning": ["x"]}), "choices[0].delta.reasoning"),
    ("refusal-true", delta_chunk({"refusal": True}), "choices[0].delta.refusal"),
    ("refusal-false", delta_chunk({"refusal": False}), "choices[0].delta.refusal"),
    ("finish-number", delta_chunk({}, finish=1), "choices[0].finish_reason"),
    ("finish-false", delta_chunk({}, finish=False), "choices[0].finish_reason"),
    ("finish-list", delta_chunk({}, finish=["stop"]), "choices[0].finish_reason"),
    ("usage-list", chunk_with([], usage=[]), "usage"),
    ("usage-string", chunk_with([], usage="10 tokens"), "usage"),
    ("usage-number", chunk_with(None, usage=12), "usage"),
]  # fmt: skip


def feed_bad(parser: StreamParser, bad: Any, via: str) -> RemoteProtocolError:
    """Feed the opening event then ``bad`` (event 2); return the error it raised."""
    if via == "data":
        parser.receive_data(OPENING_SSE)
        payload = bad if isinstance(bad, bytes) else sse(bad)
        with pytest.raises(RemoteProtocolError) as info:
            parser.receive_data(payload)
    else:
        parser.receive_chunk(OPENING)
        with pytest.raises(RemoteProtocolError) as info:
            parser.receive_chunk(bad)
    return info.value


def assert_failed_cleanly(parser: StreamParser, error: RemoteProtocolError) -> None:
    """Every live call aborted (protocol_error); every later receive_* raises again."""
    turn = parser.turns[0]
    calls = turn.tool_calls
    assert calls, "the call opened by the first event is gone"
    for call in calls:
        assert call.state is ToolCallState.ABORTED, call
        assert call.reason == "protocol_error", call
    assert turn.ended is True
    assert turn.complete is False
    result = parser.result()
    assert result.error is error
    assert result.end_how == "protocol_error"
    assert result.complete is False
    assert parser.ended
    for again in (
        lambda: parser.receive_data(sse(delta_chunk({"content": "more"}))),
        lambda: parser.receive_data(b""),
        lambda: parser.receive_chunk(delta_chunk({"content": "more"})),
        lambda: parser.receive_chunk("[DONE]"),
        parser.receive_eof,
    ):
        with pytest.raises(RemoteProtocolError) as info:
            again()
        assert not isinstance(info.value, LocalProtocolError)
    # nothing changed by the refused input
    assert [c.state for c in parser.turns[0].tool_calls] == [c.state for c in calls]


@pytest.mark.parametrize("via", ["data", "chunk"])
@pytest.mark.parametrize(
    ("bad", "path"), [(b, p) for _, b, p in WRONG_TYPES], ids=[i for i, _, _ in WRONG_TYPES]
)
def test_wrong_type_raises_remote_protocol_error(bad: Any, path: str, via: str) -> None:
    parser = StreamParser()
    error = feed_bad(parser, bad, via)
    assert error.event_number == 2
    assert error.path == path
    message = str(error)
    assert "event 2" in message
    assert path in message
    # the exact path, not a longer one that merely starts with it
    assert f"{path}:" in message
    if via == "data":
        assert error.byte_offset == len(OPENING_SSE)
        assert f"byte {len(OPENING_SSE)}" in message
    else:
        assert error.byte_offset is None
    assert error.reason and error.reason in message
    assert_failed_cleanly(parser, error)


MALFORMED_JSON = [
    b"{bad",
    b'{"choices": [',
    b'{"a": 1,}',
    b"{'a': 1}",
    b'{"a": 1} {"b": 2}',
    b"NaN",
    b"[DONE",
    b"DONE",
    b'{"a": "unterminated}',
]


@pytest.mark.parametrize("payload", MALFORMED_JSON)
def test_malformed_json_in_data_event(payload: bytes) -> None:
    parser = StreamParser()
    error = feed_bad(parser, b"data: " + payload + b"\n\n", "data")
    assert error.event_number == 2
    assert error.byte_offset == len(OPENING_SSE)
    assert "event 2" in str(error)
    assert f"byte {len(OPENING_SSE)}" in str(error)
    assert "JSON" in str(error)
    assert_failed_cleanly(parser, error)


@pytest.mark.parametrize("payload", MALFORMED_JSON)
def test_malformed_json_chunk_text(payload: bytes) -> None:
    for text in (payload, payload.decode()):
        parser = StreamParser()
        error = feed_bad(parser, text, "chunk")
        assert error.event_number == 2
        assert "event 2" in str(error)
        assert_failed_cleanly(parser, error)


def test_malformed_json_split_over_data_lines_and_feeds() -> None:
    parser = StreamParser()
    parser.receive_data(OPENING_SSE)
    parser.receive_data(b'data: {"choices":\n')
    with pytest.raises(RemoteProtocolError) as info:
        parser.receive_data(b"data: [{]\n\n")
    assert info.value.event_number == 2
    assert info.value.byte_offset == len(OPENING_SSE)
    assert_failed_cleanly(parser, info.value)


@pytest.mark.parametrize(
    "payload", [b"[1, 2]", b"[]", b"5", b"-1.5", b'"a string"', b"null", b"true"]
)
def test_chunk_that_is_not_an_object(payload: bytes) -> None:
    parser = StreamParser()
    error = feed_bad(parser, b"data: " + payload + b"\n\n", "data")
    assert error.event_number == 2
    assert "event 2" in str(error)
    assert "object" in str(error)
    assert_failed_cleanly(parser, error)

    parser = StreamParser()
    error = feed_bad(parser, payload.decode(), "chunk")
    assert error.event_number == 2
    assert_failed_cleanly(parser, error)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe",  # never valid in UTF-8
        b"\xe6\x97",  # a 3-byte character cut short
        b"\xed\xa0\x80",  # an encoded surrogate
        b"\xc0\xaf",  # an overlong encoding of "/"
        b"\xf4\x90\x80\x80",  # above U+10FFFF
    ],
)
def test_invalid_utf8_in_data_payload(raw: bytes) -> None:
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "x' + raw + b'y"}}]}\n\n'
    parser = StreamParser()
    error = feed_bad(parser, event, "data")
    assert error.event_number == 2
    assert error.byte_offset == len(OPENING_SSE)
    assert_failed_cleanly(parser, error)
    assert parser.turns[0].content is None  # nothing of the bad event was kept

    # byte by byte makes no difference
    parser = StreamParser()
    parser.receive_data(OPENING_SSE)
    with pytest.raises(RemoteProtocolError) as info:
        for i in range(len(event)):
            parser.receive_data(event[i : i + 1])
    assert info.value.event_number == 2
    assert_failed_cleanly(parser, info.value)


def test_invalid_utf8_in_chunk_bytes() -> None:
    parser = StreamParser()
    error = feed_bad(parser, b'{"choices": [{"index": 0, "delta": {"content": "\xff"}}]}', "chunk")
    assert error.event_number == 2
    assert_failed_cleanly(parser, error)


def test_error_in_a_later_event_of_the_same_feed() -> None:
    # events before the bad one in the same feed were applied; the error names the bad one
    head = OPENING_SSE + sse(calls_chunk(entry(0, args='is"}')), ": comment")
    data = head + sse(delta_chunk({"content": 1}))
    parser = StreamParser()
    with pytest.raises(RemoteProtocolError) as info:
        parser.receive_data(data)
    assert info.value.event_number == 3  # the comment is not an event
    assert info.value.byte_offset == len(head)
    assert info.value.path == "choices[0].delta.content"
    assert parser.turns[0].tool_calls[0].raw_arguments == '{"city": "Paris"}'
    assert_failed_cleanly(parser, info.value)


def test_bad_input_after_done_is_an_anomaly_not_an_error() -> None:
    parser = StreamParser()
    parser.receive_data(OPENING_SSE + sse(delta_chunk({}, finish="tool_calls")))
    parser.receive_data(b"data: [DONE]\n\n")
    call = parser.turns[0].tool_calls[0]
    assert call.state is ToolCallState.TRUNCATED  # '{"city": "Par' never closed
    events = parser.receive_data(b"data: {bad json\n\ndata: [1]\n\n")
    assert [e.kind for e in events if isinstance(e, AnomalyDetected)] == ["data_after_end"] * 2
    events = parser.receive_chunk({"choices": "not a list"})
    assert [e.kind for e in events if isinstance(e, AnomalyDetected)] == ["data_after_end"]
    parser.receive_eof()
    assert parser.result().error is None
    assert call.state is ToolCallState.TRUNCATED
    assert call.reason == "invalid_json"


# -- misuse of the API: LocalProtocolError -----------------------------------------------------


def test_error_classes_are_distinct() -> None:
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)


def _closed_by_eof() -> StreamParser:
    parser = StreamParser()
    parser.receive_data(OPENING_SSE)
    parser.receive_eof()
    return parser


def _closed_by_done_and_eof() -> StreamParser:
    parser = StreamParser()
    parser.receive_data(OPENING_SSE + b"data: [DONE]\n\n")
    parser.receive_eof()
    return parser


def _closed_by_abort() -> StreamParser:
    parser = StreamParser()
    parser.receive_data(OPENING_SSE)
    parser.abort("cancelled")
    return parser


def _closed_by_abort_of_fresh_parser() -> StreamParser:
    parser = StreamParser()
    parser.abort()
    return parser


def _closed_by_done_and_abort() -> StreamParser:
    parser = StreamParser()
    parser.receive_chunk(OPENING)
    parser.receive_chunk("[DONE]")
    parser.abort("late")
    return parser


CLOSERS = [
    _closed_by_eof,
    _closed_by_done_and_eof,
    _closed_by_abort,
    _closed_by_abort_of_fresh_parser,
    _closed_by_done_and_abort,
]


@pytest.mark.parametrize("make", CLOSERS, ids=lambda f: f.__name__.removeprefix("_closed_by_"))
@pytest.mark.parametrize(
    "feed",
    [
        lambda p: p.receive_data(OPENING_SSE),
        lambda p: p.receive_data(b""),
        lambda p: p.receive_chunk(OPENING),
        lambda p: p.receive_chunk("[DONE]"),
        lambda p: p.receive_eof(),
    ],
    ids=["data", "empty-data", "chunk", "done-chunk", "eof"],
)
def test_feeding_a_closed_parser_is_a_local_error(make: Any, feed: Any) -> None:
    parser = make()
    before = parser.result().to_json()
    with pytest.raises(LocalProtocolError) as info:
        feed(parser)
    assert not isinstance(info.value, RemoteProtocolError)
    assert parser.result().to_json() == before
    assert parser.result().error is None


def test_abort_reason_and_states() -> None:
    parser = StreamParser()
    parser.receive_data(OPENING_SSE)
    events = parser.abort("connection reset")
    call = parser.turns[0].tool_calls[0]
    assert call.state is ToolCallState.ABORTED
    assert call.reason == "connection reset"
    assert any(isinstance(e, ToolCallAborted) and e.reason == "connection reset" for e in events)
    assert parser.abort("again") == []  # already over: a no-op
    assert call.reason == "connection reset"


# -- limits ------------------------------------------------------------------------------------


def limit_anomalies(parser: StreamParser) -> list[str]:
    return [a.kind for a in parser.anomalies if a.kind == "limit_exceeded"]


@pytest.mark.parametrize("field", list(Limits.__dataclass_fields__))
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "5", None])
def test_limits_must_be_positive_integers(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


def test_max_tool_calls_zero_is_rejected() -> None:
    with pytest.raises(ValueError):
        Limits(max_tool_calls=0)


def test_limits_of_one_are_allowed() -> None:
    limits = Limits(
        max_argument_bytes=1, max_tool_calls=1, max_event_bytes=1, max_text_bytes=1, max_choices=1
    )
    assert limits.max_tool_calls == 1


def _args_stream(fragments: list[str], finish: str = "tool_calls") -> list[dict[str, Any]]:
    chunks = [
        calls_chunk(entry(0, "call_big", "big", fragments[0])),
        calls_chunk(entry(1, "call_small", "small", "{}")),
    ]
    chunks += [calls_chunk(entry(0, args=f)) for f in fragments[1:]]
    chunks.append(delta_chunk({}, finish=finish))
    return chunks


def test_max_argument_bytes_exceeded() -> None:
    limit = 10
    parser = StreamParser(limits=Limits(max_argument_bytes=limit))
    events = []
    for c in _args_stream(['{"a":', ' "xyz', '"}', "more", "and more"]):
        events += parser.receive_chunk(c)
        big = parser.turns[0].tool_calls[0]
        assert big.argument_bytes <= limit
        assert len(big.raw_arguments.encode()) <= limit
    events += parser.receive_chunk("[DONE]")
    events += parser.receive_eof()
    big, small = parser.turns[0].tool_calls
    assert big.state is ToolCallState.ABORTED
    assert big.reason == "limit:max_argument_bytes"
    assert big.argument_bytes <= limit
    assert len(big.arguments.encode()) <= limit
    # only this call is hit: the other one, and the stream, end normally
    assert small.state is ToolCallState.FINISHED
    assert parser.result().end_how == "done"
    assert parser.turns[0].complete is False
    assert limit_anomalies(parser) == ["limit_exceeded"]
    assert [e.kind for e in events if isinstance(e, AnomalyDetected)] == ["limit_exceeded"]
    # fragments past the limit are not passed on as deltas
    deltas = [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta) and e.ordinal == 0]
    assert "".join(deltas) == '{"a": "xyz'
    assert any(
        isinstance(e, ToolCallAborted) and e.reason == "limit:max_argument_bytes" for e in events
    )


def test_max_argument_bytes_exactly_reached_is_fine() -> None:
    parser = StreamParser(limits=Limits(max_argument_bytes=12))
    for c in _args_stream(['{"a":', ' "xyz"}']):  # 12 bytes
        parser.receive_chunk(c)
    parser.receive_eof()
    big = parser.turns[0].tool_calls[0]
    assert big.state is ToolCallState.FINISHED
    assert big.argument_bytes == 12
    assert limit_anomalies(parser) == []


def test_max_argument_bytes_counts_utf8_bytes() -> None:
    args = json.dumps({"k": "ééé"}, ensure_ascii=False)  # 12 characters, 15 bytes
    assert (len(args), len(args.encode())) == (12, 15)
    parser = StreamParser(limits=Limits(max_argument_bytes=14))
    parser.receive_chunk(calls_chunk(entry(0, "c", "f", args), finish="tool_calls"))
    parser.receive_eof()
    call = parser.turns[0].tool_calls[0]
    assert call.state is ToolCallState.ABORTED
    assert call.reason == "limit:max_argument_bytes"
    assert call.argument_bytes <= 14


def test_max_argument_bytes_memory_stays_bounded() -> None:
    limit = 4096
    parser = StreamParser(limits=Limits(max_argument_bytes=limit))
    parser.receive_chunk(calls_chunk(entry(0, "c", "f", "[")))
    piece = calls_chunk(entry(0, args="1," * 512))  # 1 KiB per fragment
    tracemalloc.start()
    try:
        for _ in range(16):  # past the limit
            parser.receive_chunk(piece)
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):  # ~2 MiB more, all of it past the limit
            parser.receive_chunk(piece)
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    call = parser.turns[0].tool_calls[0]
    assert call.argument_bytes <= limit
    assert len(call.raw_arguments) <= limit
    assert grown < 256 * 1024, f"{grown} bytes retained for input past the limit"
    parser.receive_eof()
    assert call.reason == "limit:max_argument_bytes"


def test_max_tool_calls_exceeded() -> None:
    parser = StreamParser(limits=Limits(max_tool_calls=2))
    events = []
    events += parser.receive_chunk(calls_chunk(entry(0, "c0", "f0", "{}")))
    events += parser.receive_chunk(calls_chunk(entry(1, "c1", "f1", '{"x"')))
    events += parser.receive_chunk(calls_chunk(entry(2, "c2", "f2", "{}")))
    turn = parser.turns[0]
    assert len(turn.tool_calls) == 2  # the third call was never made
    assert [c.state for c in turn.tool_calls] == [ToolCallState.ABORTED] * 2
    assert [c.reason for c in turn.tool_calls] == ["limit:max_tool_calls"] * 2
    assert parser.ended
    assert parser.result().end_how == "limit"
    assert parser.result().end_reason == "limit:max_tool_calls"
    assert turn.complete is False
    assert limit_anomalies(parser) == ["limit_exceeded"]
    assert [e.name for e in events if isinstance(e, ToolCallOpened)] == ["f0", "f1"]
    ended = [e for e in events if isinstance(e, StreamEnded)]
    assert ended == [StreamEnded(how="limit", reason="limit:max_tool_calls", complete=False)]
    # later input changes nothing (an anomaly), and EOF is still accepted
    parser.receive_chunk(calls_chunk(entry(3, "c3", "f3", "{}")))
    parser.receive_eof()
    assert len(turn.tool_calls) == 2
    assert [c.reason for c in turn.tool_calls] == ["limit:max_tool_calls"] * 2


def test_max_tool_calls_counts_calls_sharing_an_index() -> None:
    # Groq/Bedrock/Ollama: every call at index 0 with a distinct id is a new call
    parser = StreamParser(limits=Limits(max_tool_calls=2))
    for n in range(3):
        parser.receive_chunk(calls_chunk(entry(0, f"c{n}", "f", "{}")))
    assert parser.result().end_reason == "limit:max_tool_calls"
    assert len(parser.turns[0].tool_calls) == 2


def test_max_tool_calls_is_per_choice() -> None:
    parser = StreamParser(limits=Limits(max_tool_calls=2))
    for ci in (0, 1):
        for n in (0, 1):
            parser.receive_chunk(calls_chunk(entry(n, f"c{ci}{n}", "f", "{}"), ci=ci))
        parser.receive_chunk(delta_chunk({}, ci=ci, finish="tool_calls"))
    parser.receive_chunk("[DONE]")
    parser.receive_eof()
    assert parser.result().complete is True
    assert limit_anomalies(parser) == []


def test_max_event_bytes_exceeded() -> None:
    parser = StreamParser(limits=Limits(max_event_bytes=256))
    parser.receive_data(OPENING_SSE)
    big = sse(calls_chunk(entry(0, args="x" * 300)))
    events = parser.receive_data(big)
    call = parser.turns[0].tool_calls[0]
    assert call.state is ToolCallState.ABORTED
    assert call.reason == "limit:max_event_bytes"
    assert call.raw_arguments == '{"city": "Par'  # nothing of the oversized event was applied
    assert parser.result().end_how == "limit"
    assert parser.result().end_reason == "limit:max_event_bytes"
    assert limit_anomalies(parser) == ["limit_exceeded"]
    assert [e.kind for e in events if isinstance(e, AnomalyDetected)] == ["limit_exceeded"]
    assert StreamEnded(how="limit", reason="limit:max_event_bytes", complete=False) in events
    # the rest of the stream is ignored and EOF is accepted
    parser.receive_data(sse(delta_chunk({}, finish="tool_calls")) + b"data: [DONE]\n\n")
    parser.receive_eof()
    assert call.reason == "limit:max_event_bytes"


def test_max_event_bytes_line_without_newline_memory_stays_bounded() -> None:
    parser = StreamParser(limits=Limits(max_event_bytes=64 * 1024))
    parser.receive_data(OPENING_SSE)
    piece = b"x" * 65536
    tracemalloc.start()
    try:
        parser.receive_data(b"data: ")
        for _ in range(4):  # reaches the limit
            parser.receive_data(piece)
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(80):  # 5 MiB more, in one endless line
            parser.receive_data(piece)
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert parser.result().end_reason == "limit:max_event_bytes"
    assert grown < 512 * 1024, f"{grown} bytes retained for input past the limit"
    kinds = [a.kind for a in parser.anomalies]
    assert kinds.count("limit_exceeded") == 1
    assert kinds.count("data_after_end") <= 1  # reported once, not once per piece
    parser.receive_eof()
    assert parser.turns[0].tool_calls[0].reason == "limit:max_event_bytes"


def test_max_event_bytes_many_data_lines() -> None:
    parser = StreamParser(limits=Limits(max_event_bytes=1024))
    parser.receive_data(OPENING_SSE)
    for _ in range(200):
        parser.receive_data(b"data: 0123456789\n")
    assert parser.result().end_reason == "limit:max_event_bytes"
    assert parser.turns[0].tool_calls[0].reason == "limit:max_event_bytes"


def test_max_text_bytes_exceeded() -> None:
    limit = 10
    parser = StreamParser(limits=Limits(max_text_bytes=limit))
    parser.receive_chunk(OPENING)
    parser.receive_chunk(delta_chunk({"content": "hello"}))
    events = parser.receive_chunk(delta_chunk({"content": " world!"}))
    turn = parser.turns[0]
    assert turn.content == "hello"
    assert len((turn.content or "").encode()) <= limit
    assert parser.result().end_reason == "limit:max_text_bytes"
    assert turn.tool_calls[0].state is ToolCallState.ABORTED
    assert turn.tool_calls[0].reason == "limit:max_text_bytes"
    assert [e.kind for e in events if isinstance(e, AnomalyDetected)] == ["limit_exceeded"]
    parser.receive_eof()


def test_max_text_bytes_counts_content_reasoning_and_refusal_together_in_utf8() -> None:
    parser = StreamParser(limits=Limits(max_text_bytes=12))
    parser.receive_chunk(delta_chunk({"reasoning_content": "ééé"}))  # 6 bytes
    parser.receive_chunk(delta_chunk({"refusal": "no"}))  # 8
    parser.receive_chunk(delta_chunk({"content": "abcd"}))  # 12: still fine
    assert not parser.ended
    parser.receive_chunk(delta_chunk({"content": "e"}))  # 13
    assert parser.result().end_reason == "limit:max_text_bytes"
    turn = parser.turns[0]
    total = sum(len((t or "").encode()) for t in (turn.content, turn.reasoning, turn.refusal))
    assert total <= 12


def test_max_choices_exceeded() -> None:
    parser = StreamParser(limits=Limits(max_choices=2))
    parser.receive_chunk(OPENING)
    parser.receive_chunk(delta_chunk({"content": "one"}, ci=1))
    assert not parser.ended
    events = parser.receive_chunk(delta_chunk({"content": "two"}, ci=2))
    assert sorted(parser.turns) == [0, 1]
    assert parser.result().end_reason == "limit:max_choices"
    assert parser.turns[0].tool_calls[0].state is ToolCallState.ABORTED
    assert parser.turns[0].tool_calls[0].reason == "limit:max_choices"
    assert [e.kind for e in events if isinstance(e, AnomalyDetected)] == ["limit_exceeded"]
    assert all(not t.complete for t in parser.turns.values())
