"""The parser's rules at the edges (shared/spec/parser.md, "Rules added in round 2"): the error
event, blank names and ids, ``finish_reason: tool_calls`` with no call, the stream-level end in
every output, storable values, ``fsm parse`` on unusable input, and no exception outside the
documented classes for any input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm import (
    IncompleteTurnError,
    LocalProtocolError,
    RemoteProtocolError,
    StreamParser,
    TurnEnded,
    parse,
)
from fsm.cli.main import cli
from fsm.jsonsyntax import render_json
from fsm.sse import SSEFramer
from tests.helpers import bytewise, chunk, cut, sse, strict_json, tc

SPLITS = settings(max_examples=20, deadline=None)
DOCUMENTED = (RemoteProtocolError, LocalProtocolError)


def run(pieces: list[bytes]) -> tuple[StreamParser, list[Any], RemoteProtocolError | None]:
    parser = StreamParser()
    events: list[Any] = []
    try:
        for piece in pieces:
            events += parser.receive_data(piece)
        events += parser.receive_eof()
    except RemoteProtocolError as exc:
        return parser, events + exc.events, exc
    return parser, events, None


def everywhere(data: bytes, points: list[int]) -> StreamParser:
    """Whole, byte by byte and in random pieces: the same result and events."""
    whole, events, _ = run([data])
    for pieces in (bytewise(data), cut(data, points)):
        other, other_events, _ = run(pieces)
        assert other.result().to_json() == whole.result().to_json()
        assert other_events == events
    return whole


OPEN = sse(chunk(tc(0, "call_a", "get_weather", '{"city": "Paris"}')), done=False)


def call_states(parser: StreamParser) -> list[tuple[str, str | None]]:
    return [(c.state.value, c.reason) for t in parser.result().turns for c in t.tool_calls]


# -- an SSE event named "error" is an error, whatever its data ----------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"data: [DONE]", "[DONE]"),
        (b"data:  [DONE]  ", "[DONE]"),
        (b'data: {"message": "overloaded", "code": 529}', "overloaded"),
        (b'data: {"error": {"message": "rate limited"}}', "rate limited"),
        (b'data: "upstream closed"', "upstream closed"),
        (b"data: 503", "503"),
        (b"data: <html>bad gateway", "<html>bad gateway"),
        (b"data:", "error event"),
        (b"", "error event"),
    ],
)
def test_error_event_ends_the_stream_aborted_whatever_its_data(data: bytes, message: str) -> None:
    stream = OPEN + b"event: error\n" + data + (b"\n" if data else b"") + b"\n"
    parser, _, error = run([stream])
    assert error is None
    result = parser.result()
    assert (result.end_how, result.end_reason) == ("error", message)
    assert call_states(parser) == [("aborted", message)]
    assert not result.complete


@SPLITS
@given(points=st.lists(st.integers(0, 1 << 12), max_size=10))
def test_error_event_with_done_data_in_any_split(points: list[int]) -> None:
    parser = everywhere(OPEN + b"event: error\ndata: [DONE]\n\n" + b"data: [DONE]\n\n", points)
    assert call_states(parser) == [("aborted", "[DONE]")]
    assert [a.kind for a in parser.anomalies] == ["data_after_end"]


# -- blank names and ids -----------------------------------------------------------------------


@pytest.mark.parametrize("name", [" ", "\t\n", "\u3000", "\u2028", " \u00a0 "])
def test_blank_name_counts_as_missing(name: str) -> None:
    parser, _, _ = run([sse(chunk(tc(0, "call_a", name, "{}")), chunk(finish="tool_calls"))])
    assert call_states(parser) == [("aborted", "missing_name")]
    assert parser.result().turns[0].incomplete_reason == "call_not_finished"


@SPLITS
@given(points=st.lists(st.integers(0, 1 << 12), max_size=10))
def test_blank_name_in_fragments(points: list[int]) -> None:
    data = sse(
        chunk(tc(0, "call_a", " ", "")),
        chunk(tc(0, name="\t")),
        chunk(tc(0, args="{}")),
        chunk(finish="tool_calls"),
    )
    parser = everywhere(data, points)
    assert call_states(parser) == [("aborted", "missing_name")]


def test_a_name_with_spaces_around_is_kept_as_sent() -> None:
    parser, _, _ = run([sse(chunk(tc(0, "call_a", " f ", "{}")), chunk(finish="tool_calls"))])
    assert call_states(parser) == [("finished", None)]
    assert parser.result().turns[0].tool_calls[0].name == " f "


@pytest.mark.parametrize("late", [False, True])
def test_blank_id_is_kept_and_reported(late: bool) -> None:
    first = tc(0, None if late else "  ", "f", "{")
    data = sse(chunk(first), chunk(tc(0, "  " if late else None, args="}")), chunk(finish="stop"))
    parser, _, _ = run([data])
    (call,) = parser.result().turns[0].tool_calls
    assert (call.id, call.state.value) == ("  ", "finished")
    assert [a.kind for a in parser.anomalies] == ["blank_id"]
    assert parser.result().complete  # the id is sacred: kept, and the turn is usable


# -- finish_reason tool_calls with no call ----------------------------------------------------


@pytest.mark.parametrize("finish", ["tool_calls", "function_call"])
@SPLITS
@given(points=st.lists(st.integers(0, 1 << 12), max_size=10))
def test_tool_calls_finish_without_a_call_is_not_complete(finish: str, points: list[int]) -> None:
    parser = everywhere(sse(chunk(content="I will call a tool"), chunk(finish=finish)), points)
    turn = parser.result().turns[0]
    assert (turn.complete, turn.incomplete_reason) == (False, "no_tool_calls")
    assert [a.kind for a in parser.anomalies] == ["no_tool_calls"]
    with pytest.raises(IncompleteTurnError, match="carried no tool call"):
        turn.to_message()
    assert parser.result().to_json()["choices"][0]["incomplete_reason"] == "no_tool_calls"


def test_turn_ended_event_says_why() -> None:
    _, events, _ = run([sse(chunk(content="x"), chunk(finish="tool_calls"))])
    (ended,) = [e for e in events if isinstance(e, TurnEnded)]
    assert (ended.complete, ended.reason) == (False, "no_tool_calls")
    _, events, _ = run([sse(chunk(content="x"), chunk(finish="stop"))])
    (ended,) = [e for e in events if isinstance(e, TurnEnded)]
    assert (ended.complete, ended.reason) == (True, None)


def test_stop_without_a_call_is_complete() -> None:
    result = parse(sse(chunk(content="hi"), chunk(finish="stop")))
    assert result.complete and result.turns[0].incomplete_reason is None


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (sse(chunk(tc(0, "a", "f", "{")), chunk(finish="length")), "length"),
        (sse(chunk(tc(0, "a", "f", "{")), chunk(finish="content_filter")), "content_filter"),
        (sse(chunk(tc(0, "a", "f", "{")), done=False), "eof"),
        (sse(chunk(tc(0, "a", "f", "{")), chunk(finish="stop")), "call_not_finished"),
    ],
)
def test_incomplete_reason(data: bytes, reason: str) -> None:
    assert parse(data).turns[0].incomplete_reason == reason


# -- the stream-level end in every output -------------------------------------------------------


def test_end_is_in_the_json_result() -> None:
    result = parse(sse(chunk(tc(0, "a", "f", "{}")), chunk(finish="tool_calls")))
    assert result.to_json()["end"] == {"how": "done", "reason": None}
    result = parse(OPEN + b"event: error\ndata: boom\n\n")
    assert result.to_json()["end"] == {"how": "error", "reason": "boom"}


def test_an_error_with_no_choice_still_says_how_the_stream_ended() -> None:
    data = b'data: {"error": {"message": "invalid api key", "code": 401}}\n\n'
    result = parse(data)
    assert result.to_json()["end"] == {"how": "error", "reason": "invalid api key"}
    assert result.to_json()["choices"] == []
    code, out, _ = cli_run(["parse", "--json", "-"], data)
    assert code == 1
    assert json.loads(out)["end"] == {"how": "error", "reason": "invalid api key"}
    code, out, _ = cli_run(["parse", "-"], data)
    assert "ended: error (invalid api key)" in out and "no choices in the stream" in out


# -- values in a result must be storable --------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        b"1e400",
        b"-1e400",
        b"9223372036854775808",  # orjson keeps it an integer (past 2**63 - 1)
        b"1" * 5000,
        b'{"a": 1e999}',
        b"[" * 33 + b"1" + b"]" * 33,
    ],
)
def test_unstorable_usage_is_ignored_and_the_previous_kept(bad: bytes) -> None:
    good = b'data: {"choices": [], "usage": {"total_tokens": 3}}\n\n'
    worse = b'data: {"choices": [], "usage": {"total_tokens": ' + bad + b"}}\n\n"
    parser, _, error = run([sse(chunk(content="x"), done=False) + good + worse])
    assert error is None
    assert parser.result().usage == {"total_tokens": 3}
    assert [a.kind for a in parser.anomalies] == ["invalid_usage"]


def test_usage_at_the_bounds_is_kept() -> None:
    usage = {
        "a": 2**63 - 1,
        "b": -(2**63),
        "c": 1.7976931348623157e308,
        "d": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],  # 32 deep
    }
    parser = StreamParser()
    parser.receive_chunk({"choices": [], "usage": usage})
    assert parser.result().usage == usage and not parser.anomalies
    parser.receive_chunk({"choices": [], "usage": {"x": float("nan")}})
    parser.receive_chunk({"choices": [], "usage": {"x": {"y": -(2**63) - 1}}})
    assert parser.result().usage == usage
    assert [a.kind for a in parser.anomalies] == ["invalid_usage", "invalid_usage"]


@pytest.mark.parametrize("created", [2**63, -(2**63) - 1, 10**30])
def test_created_outside_64_bits_is_ignored(created: int) -> None:
    parser = StreamParser()
    parser.receive_chunk({"id": "r", "created": created, "choices": []})
    assert parser.result().created is None
    assert [a.kind for a in parser.anomalies] == ["invalid_created"]
    parser = StreamParser()
    parser.receive_chunk({"id": "r", "created": 2**63 - 1, "choices": []})
    assert parser.result().created == 2**63 - 1 and not parser.anomalies


def test_nul_and_lone_surrogates_are_kept() -> None:
    data = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a\\u0000\\udc00","tool_calls":'
        b'[{"index":0,"id":"i\\u0000\\ud800","function":{"name":"f\\u0000",'
        b'"arguments":"{\\"k\\": \\"\\\\ud800\\"}"}}]}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    )
    result = parse(data)
    turn = result.turns[0]
    assert turn.content == "a\x00\udc00"
    (call,) = turn.tool_calls
    assert (call.id, call.name, call.state.value) == ("i\x00\ud800", "f\x00", "finished")
    assert result.complete


# -- fsm parse ---------------------------------------------------------------------------------


def cli_run(args: list[str], stdin: bytes | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, args, input=stdin)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    "content",
    [
        b"# A README\n\nSome *markdown* text.\n",
        bytes(range(256)) * 4,
        b"",
        b"\n\n\n",
        b": just a comment\n\n: another\n\n",
        b"event: close\n\n",
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
    ],
)
def test_a_file_with_no_event_is_not_a_stream(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "notes.md"
    path.write_bytes(content)
    for args in (["parse", str(path)], ["parse", "--json", str(path)]):
        code, out, err = cli_run(args)
        assert code == 2, (content, out, err)
        assert out == ""
        assert err.count("\n") == 1 and "is not a stream" in err
    result = parse(content)  # the library still returns a result
    assert (result.complete, result.end_how, result.event_count) == (False, "eof", 0)


@pytest.mark.parametrize(
    "data",
    [
        OPEN + b'data: {"error": ' + b"[" * 1000 + b"]" * 1000 + b"}\n\n",
        OPEN + b'data: {"error": {"message": ' + b"[" * 1000 + b"]" * 1000 + b"}}\n\n",
        OPEN + b'data: {"choices": [{"index": ' + b"[" * 1000 + b"]" * 1000 + b"}]}\n\n",
        OPEN + b"retry: " + b"7" * 5000 + b"\n\n" + b"data: [DONE]\n\n",
        OPEN + b'data: {"x": ' + b"1" * 5000 + b', "choices": []}\n\n' + b"data: [DONE]\n\n",
        OPEN + b'data: {"choices": [{"index": 0, "delta": {"content": "\\ud83d"}}]}\n\n',
        sse(chunk(tc(0, "i\ud800", "f\udc00", "{}")), chunk(finish="stop")).replace(
            b"\\ud800", b"\\ud800"
        ),
        b'data: {"choices": [{"index": 0, "delta": {"content": "\\udc00"}, '
        b'"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n',
        b'data: {"choices": [{"index": 2147483648, "delta": {}}]}\n\n',
    ],
)
def test_fsm_parse_never_exits_70(data: bytes) -> None:
    for args in (["parse", "-"], ["parse", "--json", "-"]):
        code, out, err = cli_run(args, data)
        assert code in (0, 1, 2), (code, err)
        assert "internal error" not in err and "Traceback" not in err
        if code != 2 and "--json" in args:
            json.loads(out)  # one valid JSON document, even with lone surrogates


def test_fsm_parse_subprocess_deep_error_exits_one() -> None:
    data = OPEN + b'data: {"error": ' + b"[" * 1000 + b"]" * 1000 + b"}\n\n"
    proc = subprocess.run([sys.executable, "-m", "fsm", "parse", "--json", "-"], input=data,
                          capture_output=True)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["end"]["how"] == "error"


# -- no exception outside the documented classes -------------------------------------------------


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


DEEP = [nested(990), [[[[[]]]]] * 100, "x", 10**30, -1, 1.5, True, None, {"message": nested(900)}]
FIELDS = [
    lambda v: {"error": v},
    lambda v: {"error": {"message": v}},
    lambda v: {"choices": v},
    lambda v: {"choices": [v]},
    lambda v: {"choices": [{"index": v}]},
    lambda v: {"choices": [{"index": 0, "delta": v}]},
    lambda v: {"choices": [{"index": 0, "finish_reason": v}]},
    lambda v: {"choices": [{"index": 0, "delta": {"content": v}}]},
    lambda v: {"choices": [{"index": 0, "delta": {"tool_calls": v}}]},
    lambda v: {"choices": [{"index": 0, "delta": {"tool_calls": [v]}}]},
    lambda v: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": v}]}}]},
    lambda v: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": v}]}}]},
    lambda v: {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": v}]}}]},
    lambda v: {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"name": v}}]}}]},
    lambda v: {"usage": v},
    lambda v: {"usage": {"x": v}},
    lambda v: {"id": v, "model": v, "created": v, "system_fingerprint": v},
]


@pytest.mark.parametrize("field", range(len(FIELDS)))
@pytest.mark.parametrize("value", range(len(DEEP)))
@pytest.mark.parametrize("via", ["data", "chunk", "error-event"])
def test_deep_and_odd_values_anywhere(field: int, value: int, via: str) -> None:
    payload = FIELDS[field](DEEP[value])
    parser = StreamParser()
    try:
        if via == "chunk":
            parser.receive_chunk(payload)
        else:
            text = render_json(payload, 1 << 30).encode()  # json.dumps would recurse
            prefix = b"event: error\n" if via == "error-event" else b""
            parser.receive_data(OPEN + prefix + b"data: " + text + b"\n\n")
        parser.receive_eof()
    except DOCUMENTED as exc:
        assert str(exc)
    check_result(parser)


def check_result(parser: StreamParser) -> None:
    """Whatever the input, the result is usable: it renders as JSON, every finished call's
    arguments are JSON, only complete turns become messages."""
    result = parser.result()
    json.dumps(result.to_json())
    for turn in result.turns:
        for call in turn.tool_calls:
            if call.state.value == "finished":
                assert strict_json(call.arguments) or call.arguments.count("[") > 900
        if turn.complete:
            turn.to_message()
        else:
            with pytest.raises(IncompleteTurnError):
                turn.to_message()


def test_retry_of_any_length() -> None:
    framer = SSEFramer()
    assert framer.feed(b"retry: " + b"9" * 5000 + b"\n\n") == []
    assert framer.retry is None  # past 18 digits: ignored
    framer.feed(b"retry: " + b"0" * 5000 + b"1500\n\n")
    assert framer.retry == 1500  # leading zeros do not count
    framer.feed(b"retry: 123456789012345678\n\n")
    assert framer.retry == 123456789012345678


def test_receive_data_of_the_wrong_type_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="bytes"):
        StreamParser().receive_data("data: [DONE]\n\n")  # type: ignore[arg-type]


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(st.characters(), max_size=8)
    | st.sampled_from(["[DONE]", "tool_calls", "stop", "length", "function", "", " "]),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(
        st.sampled_from(
            ["id", "model", "choices", "index", "delta", "content", "tool_calls", "function",
             "name", "arguments", "finish_reason", "usage", "error", "message", "type",
             "reasoning", "refusal", "created", "x"]
        ),
        inner,
        max_size=5,
    ),
    max_leaves=25,
)  # fmt: skip


def to_sse(item: Any, ascii: bool) -> bytes:
    try:
        text = json.dumps(item, ensure_ascii=ascii, allow_nan=True)
    except (ValueError, UnicodeEncodeError):  # pragma: no cover
        text = "{}"
    return b"data: " + text.encode("utf-8", "surrogatepass") + b"\n\n"


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    items=st.lists(
        JSONISH
        | st.binary(max_size=40)
        | st.sampled_from([b"data: [DONE]\n\n", b"event: error\n", b"retry: 99999\n", b"\r\n"]),
        max_size=8,
    ),
    ascii=st.booleans(),
    points=st.lists(st.integers(0, 1 << 12), max_size=8),
    via_chunks=st.booleans(),
    end=st.sampled_from(["eof", "abort"]),
)
def test_random_jsonish_and_bytes_raise_only_documented_errors(
    items: list[Any], ascii: bool, points: list[int], via_chunks: bool, end: str
) -> None:
    parser = StreamParser()
    try:
        if via_chunks:
            for item in items:
                parser.receive_chunk(item)
        else:
            data = b"".join(i if isinstance(i, bytes) else to_sse(i, ascii) for i in items)
            for piece in cut(data, points):
                parser.receive_data(piece)
        if end == "abort":
            parser.abort("test")
        else:
            parser.receive_eof()
    except DOCUMENTED:
        pass
    check_result(parser)


def test_a_surrogate_pair_split_across_argument_fragments_is_the_character() -> None:
    """A provider that cuts an emoji between two argument fragments sends ``"\\ud83d"`` then
    ``"\\ude00"`` (JSON escapes of the chunk): the arguments are the emoji, valid JSON, and the
    call finishes; a half that pairs with nothing stays a lone surrogate, which is not JSON text
    (it has no UTF-8 form), so that call is truncated."""

    def turn(second: str) -> Any:
        chunks = [
            {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"a": "\ud83d'}}
            ]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": second}}
            ]}, "finish_reason": "tool_calls"}]},
        ]  # fmt: skip
        return parse(chunks).turns[0]

    paired = turn('\ude00"}')
    assert paired.complete
    assert paired.tool_calls[0].arguments == '{"a": "\U0001f600"}'
    assert paired.tool_calls[0].raw_arguments == '{"a": "\U0001f600"}'
    lone = turn('"}')
    assert not lone.complete
    assert (lone.tool_calls[0].state.value, lone.tool_calls[0].reason) == (
        "truncated",
        "invalid_json",
    )
