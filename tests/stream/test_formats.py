"""Responses API and Anthropic Messages streams, on small hand-written streams: each rule of
``shared/spec/formats.md`` and each piece of bad input gives the spec's answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm import (
    IncompleteTurnError,
    Limits,
    LocalProtocolError,
    RemoteProtocolError,
    StreamParser,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallOpened,
    parse,
)
from fsm.errors import ToolResultError
from fsm.formats import detect


def sse(*events: dict[str, Any], names: bool = True) -> bytes:
    out = []
    for event in events:
        head = f"event: {event['type']}\n" if names and "type" in event else ""
        out.append(f"{head}data: {json.dumps(event)}\n\n")
    return "".join(out).encode()


def run(data: bytes, fmt: str = "auto", **kw: Any) -> tuple[StreamParser, list[Any]]:
    parser = StreamParser(format=fmt, **kw)
    events = parser.receive_data(data) + parser.receive_eof()
    return parser, events


def kinds(parser: StreamParser) -> list[str]:
    return [a.kind for a in parser.anomalies]


# -- Responses API ---------------------------------------------------------------------------------
def r_created(rid: str = "resp_1") -> dict[str, Any]:
    return {"type": "response.created", "response": {"id": rid, "model": "gpt-x", "output": []}}


def r_added(i: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_item.added", "output_index": i, "item": item}


def r_done(i: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_item.done", "output_index": i, "item": item}


def fc(
    i: int = 0, args: str = "", item_id: str = "fc_1", call_id: str = "call_1"
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": "add",
            "arguments": args}  # fmt: skip


def r_delta(delta: str, item_id: str = "fc_1", i: int = 0) -> dict[str, Any]:
    return {"type": "response.function_call_arguments.delta", "item_id": item_id,
            "output_index": i, "delta": delta}  # fmt: skip


def r_completed(rid: str = "resp_1", **extra: Any) -> dict[str, Any]:
    return {"type": "response.completed", "response": {"id": rid, "status": "completed", **extra}}


def responses_call(*middle: dict[str, Any], end: dict[str, Any] | None = None) -> bytes:
    return sse(r_created(), r_added(0, fc()), *middle, end or r_completed())


def test_responses_call_events_and_turn() -> None:
    data = responses_call(r_delta('{"a":'), r_delta("1}"), r_done(0, fc(args='{"a":1}')))
    parser, events = run(data)
    assert parser.format == "responses"
    opened = [e for e in events if isinstance(e, ToolCallOpened)]
    assert [(e.id, e.name, e.index) for e in opened] == [("call_1", "add", 0)]
    assert [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)] == ['{"a":', "1}"]
    (final,) = [e for e in events if isinstance(e, ToolCallFinished)]
    assert (final.id, final.arguments) == ("call_1", '{"a":1}')
    result = parser.result()
    assert result.complete and result.format == "responses" and result.response_id == "resp_1"
    turn = result.turn()
    assert (turn.format, turn.finish_reason) == ("responses", "completed")
    (call,) = turn.tool_calls
    assert (call.item_id, call.custom, call.input) == ("fc_1", False, {"a": 1})
    assert turn.to_message()["tool_calls"] == [  # type: ignore[typeddict-item]
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
    ]
    assert turn.to_items(results={"call_1": "2"})[-1] == {
        "type": "function_call_output", "call_id": "call_1", "output": "2"
    }  # fmt: skip
    assert kinds(parser) == []


def test_named_format_and_no_event_lines() -> None:
    data = sse(r_created(), r_added(0, fc(args="{}")), r_completed(), names=False)
    for fmt in ("auto", "responses"):
        parser, _ = run(data, fmt)
        assert parser.result().complete and parser.format == "responses"


def test_routing_falls_back_to_output_index_without_anomaly() -> None:
    # GitHub Copilot: a new item_id on every event after output_item.added
    data = responses_call(r_delta("{", "x1"), r_delta("}", "x2"))
    parser, _ = run(data)
    assert parser.result().turn().tool_calls[0].arguments == "{}"
    assert kinds(parser) == []


def test_a_delta_for_no_open_item_is_an_anomaly_and_dropped() -> None:
    data = responses_call(r_delta("{}"), r_delta("zzz", "nope", 7))
    parser, _ = run(data)
    assert parser.result().turn().tool_calls[0].arguments == "{}"
    assert kinds(parser) == ["orphan_delta"]
    assert parser.result().complete


def test_arguments_only_in_done_are_the_arguments_without_anomaly() -> None:
    done = {"type": "response.function_call_arguments.done", "item_id": "fc_1",
            "output_index": 0, "arguments": '{"b":2}'}  # fmt: skip
    parser, events = run(responses_call(done, r_done(0, fc(args='{"b":2}'))))
    assert parser.result().turn().tool_calls[0].arguments == '{"b":2}'
    assert kinds(parser) == []
    assert [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)] == ['{"b":2}']


def test_the_done_text_wins_and_the_difference_is_an_anomaly() -> None:
    # a proxy dropped a delta: the done arguments win
    parser, _ = run(responses_call(r_delta('{"a":1'), r_done(0, fc(args='{"a":1,"b":2}'))))
    assert parser.result().turn().tool_calls[0].arguments == '{"a":1,"b":2}'
    assert kinds(parser) == ["done_mismatch"]
    # not a prefix either: replaced
    parser, _ = run(responses_call(r_delta('{"z"'), r_done(0, fc(args='{"a":1}'))))
    assert parser.result().turn().tool_calls[0].arguments == '{"a":1}'
    assert parser.result().complete
    # text .done too
    msg = {"type": "message", "id": "m1", "role": "assistant", "content": []}
    text = {"type": "response.output_text.delta", "item_id": "m1", "output_index": 0,
            "content_index": 0, "delta": "Hello"}  # fmt: skip
    tdone = {"type": "response.output_text.done", "item_id": "m1", "output_index": 0,
             "content_index": 0, "text": "Hello!"}  # fmt: skip
    parser, _ = run(sse(r_created(), r_added(0, msg), text, tdone, r_completed()))
    assert parser.result().turn().content == "Hello!"
    assert kinds(parser) == ["done_mismatch"]


def test_ids_that_change_are_anomalies_and_the_first_is_kept() -> None:
    data = sse(
        r_created("resp_A"), r_added(0, fc()), r_delta("{}"),
        r_done(0, fc(args="{}", item_id="fc_OTHER", call_id="call_OTHER")),
        r_completed("resp_B"),
    )  # fmt: skip
    parser, _ = run(data)
    result = parser.result()
    assert result.complete and result.response_id == "resp_A"
    (call,) = result.turn().tool_calls
    assert (call.id, call.item_id) == ("call_1", "fc_1")
    assert kinds(parser) == ["id_changed", "id_changed", "id_changed"]
    assert result.turn().output_items()[0]["id"] == "fc_1"


def test_custom_tool_call_is_free_text_and_finished() -> None:
    item = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_c", "name": "sql",
            "input": ""}  # fmt: skip
    delta = {"type": "response.custom_tool_call_input.delta", "item_id": "ctc_1",
             "output_index": 0, "delta": "SELECT 1"}  # fmt: skip
    parser, _ = run(sse(r_created(), r_added(0, item), delta, r_completed()))
    turn = parser.result().turn()
    (call,) = turn.tool_calls
    assert (call.custom, call.type, call.state.value, call.input) == (
        True, "custom", "finished", "SELECT 1"
    )  # fmt: skip
    items = turn.to_items(results=["1 row"])
    assert items[0]["type"] == "custom_tool_call" and items[0]["input"] == "SELECT 1"
    assert items[-1] == {"type": "custom_tool_call_output", "call_id": "call_c", "output": "1 row"}
    assert turn.to_message()["tool_calls"][0] == {  # type: ignore[typeddict-item]
        "id": "call_c", "type": "custom", "custom": {"name": "sql", "input": "SELECT 1"}
    }  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "state", "why"),
    [("max_output_tokens", "truncated", "length"), ("content_filter", "aborted", "content_filter"),
     ("something_new", "aborted", "incomplete:something_new")],
)  # fmt: skip
def test_response_incomplete(reason: str, state: str, why: str) -> None:
    end = {"type": "response.incomplete",
           "response": {"id": "resp_1", "incomplete_details": {"reason": reason}}}  # fmt: skip
    parser, _ = run(responses_call(r_delta('{"a":1}'), end=end))
    result = parser.result()
    (call,) = result.turn().tool_calls
    assert (call.state.value, call.reason, result.complete) == (state, why, False)
    with pytest.raises(IncompleteTurnError):
        result.turn().to_items()


def test_the_first_terminal_event_decides() -> None:
    error = {"type": "error", "code": "server_error", "message": "boom"}
    failed = {"type": "response.failed",
              "response": {"error": {"code": "other", "message": "later"}}}  # fmt: skip
    parser, _ = run(responses_call(r_delta("{}"), end=error) + sse(failed, r_completed()))
    result = parser.result()
    assert (result.end_how, result.end_reason, result.error_code) == (
        "error",
        "boom",
        "server_error",
    )
    assert result.turn().tool_calls[0].state.value == "aborted"
    assert kinds(parser) == ["data_after_end", "data_after_end"]
    # response.failed alone: its error
    parser, _ = run(responses_call(end=failed))
    assert (parser.result().end_reason, parser.result().error_code) == ("later", "other")
    assert parser.result().turn().finish_reason == "failed"


def test_eof_without_a_terminal_event_aborts_and_done_is_not_an_end() -> None:
    parser, _ = run(responses_call(r_delta("{}"), end=r_delta("")) + b"data: [DONE]\n\n")
    result = parser.result()
    (call,) = result.turn().tool_calls
    assert (call.state.value, call.reason, result.end_how) == ("aborted", "eof", "eof")
    assert kinds(parser) == ["done_before_end"]
    # [DONE] after the terminal event is harmless
    parser, _ = run(responses_call(r_delta("{}")) + b"data: [DONE]\n\n")
    assert parser.result().complete and kinds(parser) == []


def test_reasoning_and_opaque_items_are_kept_verbatim_in_output_order() -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "ENC=="}
    summary = {"type": "response.reasoning_summary_text.delta", "item_id": "rs_1",
               "output_index": 0, "summary_index": 0, "delta": "thinking"}  # fmt: skip
    reasoning_done = dict(reasoning, summary=[{"type": "summary_text", "text": "thinking"}])
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "q"}}  # fmt: skip
    progress = {"type": "response.web_search_call.searching", "item_id": "ws_1", "output_index": 1}
    data = sse(
        r_created(), r_added(0, reasoning), summary, r_done(0, reasoning_done),
        r_added(1, search), progress, r_done(1, search),
        r_added(2, fc(2, item_id="fc_2")), r_delta("{}", "fc_2", 2), r_completed(),
    )  # fmt: skip
    parser, _ = run(data)
    turn = parser.result().turn()
    assert kinds(parser) == []
    assert turn.reasoning == "thinking"
    items = turn.output_items()
    assert [i["type"] for i in items] == ["reasoning", "web_search_call", "function_call"]
    assert items[0] == reasoning_done and items[1] == search
    assert [i["type"] for i in turn.to_items()] == [
        "reasoning", "web_search_call", "function_call"
    ]  # fmt: skip
    # rendered for Anthropic, only the neutral parts cross over
    (message,) = turn.to_anthropic()
    assert message["content"] == [{"type": "tool_use", "id": "call_1", "name": "add", "input": {}}]


def test_unknown_event_with_a_known_shape_is_an_anomaly() -> None:
    odd = {"type": "response.function_call_arguments.delta_v2", "item_id": "fc_1",
           "output_index": 0, "delta": "zzz"}  # fmt: skip
    parser, _ = run(responses_call(r_delta("{}"), odd))
    assert parser.result().complete and kinds(parser) == ["unknown_event"]
    assert parser.result().turn().tool_calls[0].arguments == "{}"


# -- Anthropic Messages -----------------------------------------------------------------------
def a_start(content: list[Any] | None = None, stop: str | None = None,
            mid: str = "msg_1") -> dict[str, Any]:  # fmt: skip
    return {"type": "message_start",
            "message": {"id": mid, "type": "message", "role": "assistant", "model": "claude-x",
                        "content": content or [], "stop_reason": stop,
                        "usage": {"input_tokens": 3, "output_tokens": 1}}}  # fmt: skip


def a_block(i: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": i, "content_block": block}


def a_json(i: int, text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": i,
            "delta": {"type": "input_json_delta", "partial_json": text}}  # fmt: skip


def a_stop(i: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": i}


def a_end(stop: str = "tool_use") -> list[dict[str, Any]]:
    return [{"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
             "usage": {"output_tokens": 9}}, {"type": "message_stop"}]  # fmt: skip


def tool(tid: str = "toolu_1", value: Any = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": "get", "input": {} if value is None else value}


def anthropic_call(*middle: dict[str, Any], stop: str = "tool_use") -> bytes:
    return sse({"type": "ping"}, a_start(), a_block(0, tool()), *middle, a_stop(0), *a_end(stop))


def test_anthropic_call_with_thinking_and_text() -> None:
    thinking = {"type": "thinking", "thinking": "", "signature": ""}
    data = sse(
        {"type": "ping"}, a_start(), a_block(0, thinking),
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "hmm"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "SIG"}}, a_stop(0),
        {"type": "ping"},
        a_block(1, {"type": "text", "text": ""}),
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}},
        a_stop(1), a_block(2, tool()), a_json(2, '{"q": '), a_json(2, '"x"}'), a_stop(2),
        *a_end(),
    )  # fmt: skip
    parser, _ = run(data)
    result = parser.result()
    assert result.complete and result.format == "anthropic" and kinds(parser) == []
    assert result.usage == {"input_tokens": 3, "output_tokens": 9}
    turn = result.turn()
    assert (turn.content, turn.reasoning, turn.finish_reason) == ("Hi", "hmm", "tool_use")
    (call,) = turn.tool_calls
    assert (call.id, call.arguments, call.index) == ("toolu_1", '{"q": "x"}', 2)
    messages = turn.to_anthropic(results={"toolu_1": "42"})
    assert messages == [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "SIG"},
            {"type": "text", "text": "Hi"},
            {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"q": "x"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]},
    ]  # fmt: skip
    assert turn.to_message()["content"] == "Hi"
    items = turn.to_items(results=["42"])
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]


def test_empty_arguments_are_an_empty_object() -> None:
    parser, _ = run(anthropic_call(a_json(0, "")))
    (call,) = parser.result().turn().tool_calls
    assert (call.arguments, call.state.value) == ("{}", "finished")


def test_input_whole_in_content_block_start_or_in_message_start() -> None:
    data = sse(a_start(), a_block(0, tool(value={"player": "p1"})), a_stop(0), *a_end())
    parser, _ = run(data)
    assert parser.result().turn().tool_calls[0].arguments == '{"player":"p1"}'
    assert parser.result().complete
    whole = sse(a_start([tool(value={"n": 1}), {"type": "text", "text": "ok"}], "tool_use"),
                {"type": "message_stop"})  # fmt: skip
    parser, _ = run(whole)
    turn = parser.result().turn()
    assert parser.result().complete and turn.content == "ok"
    assert [(c.id, c.arguments) for c in turn.tool_calls] == [("toolu_1", '{"n":1}')]


def test_server_tools_are_opaque_never_calls() -> None:
    server = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
    result_block = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
    data = sse(
        a_start(), a_block(0, server), a_json(0, '{"query": "x"}'), a_stop(0),
        a_block(1, result_block), a_stop(1), *a_end("end_turn"),
    )  # fmt: skip
    parser, _ = run(data)
    turn = parser.result().turn()
    assert parser.result().complete and turn.tool_calls == []
    assert turn.output_items() == [dict(server, input={"query": "x"}), result_block]


def test_second_message_start_is_an_anomaly_and_cuts_off_the_first_message() -> None:
    data = sse(
        a_start(), a_block(0, tool("toolu_a")), a_json(0, '{"v": "Sp'),
        a_start(mid="msg_2"), a_block(0, tool("toolu_b")), a_json(0, '{"v": 1}'), a_stop(0),
        *a_end(),
    )  # fmt: skip
    parser, _ = run(data)
    result = parser.result()
    assert kinds(parser) == ["second_message_start"]
    first, second = result.turn().tool_calls
    assert (first.id, first.state.value, first.reason) == (
        "toolu_a", "aborted", "second_message_start"
    )  # fmt: skip
    assert (second.id, second.state.value) == ("toolu_b", "finished")
    assert not result.complete and result.response_id == "msg_1"


def test_a_delta_for_no_open_block_is_an_anomaly() -> None:
    parser, _ = run(anthropic_call(a_json(0, "{}"), a_json(5, "zz")))
    assert kinds(parser) == ["orphan_delta"]
    assert parser.result().complete
    parser, _ = run(anthropic_call(a_json(0, "{}")) + b"")
    after_stop = sse(a_start(), a_block(0, tool()), a_json(0, "{}"), a_stop(0), a_json(0, "x"),
                     *a_end())  # fmt: skip
    parser, _ = run(after_stop)
    assert kinds(parser) == ["orphan_delta"]
    assert parser.result().turn().tool_calls[0].arguments == "{}"


@pytest.mark.parametrize(
    ("stop", "state", "reason", "turn_reason"),
    [("max_tokens", "truncated", "length", "length"),
     ("refusal", "aborted", "refusal", "refusal"),
     ("pause_turn", "aborted", "pause_turn", "pause_turn"),
     ("end_turn", "finished", None, None),
     ("stop_sequence", "finished", None, None)],
)  # fmt: skip
def test_stop_reasons(stop: str, state: str, reason: str | None, turn_reason: str | None) -> None:
    parser, _ = run(anthropic_call(a_json(0, '{"a": 1}'), stop=stop))
    turn = parser.result().turn()
    (call,) = turn.tool_calls
    assert (call.state.value, call.reason, turn.incomplete_reason) == (state, reason, turn_reason)
    if stop == "pause_turn":
        # sent back as is to continue; never executed
        assert turn.to_anthropic()[0]["role"] == "assistant"
        with pytest.raises(IncompleteTurnError):
            turn.to_items()
        with pytest.raises(IncompleteTurnError):
            turn.to_message()


def test_tool_use_stop_with_no_call_is_not_complete() -> None:
    data = sse(a_start(), a_block(0, {"type": "text", "text": "hi"}), a_stop(0), *a_end())
    parser, _ = run(data)
    assert not parser.result().complete and kinds(parser) == ["no_tool_calls"]


def test_anthropic_error_event_and_eof() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    data = sse(a_start(), a_block(0, tool()), a_json(0, "{}"), error)
    parser, _ = run(data)
    result = parser.result()
    assert (result.end_how, result.end_reason, result.error_code) == (
        "error", "Overloaded", "overloaded_error"
    )  # fmt: skip
    assert result.turn().tool_calls[0].reason == "Overloaded"
    parser, _ = run(sse(a_start(), a_block(0, tool()), a_json(0, "{}"), a_stop(0), a_end()[0]))
    assert parser.result().turn().tool_calls[0].reason == "eof"
    assert parser.result().end_how == "eof"


def test_unknown_event_and_delta_types_are_anomalies() -> None:
    odd_delta = {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "input_json_delta_v2", "partial_json": "x"}}  # fmt: skip
    parser, _ = run(anthropic_call(a_json(0, "{}"), {"type": "message_ping", "x": 1}, odd_delta))
    assert kinds(parser) == ["unknown_event", "unknown_delta"]
    assert parser.result().complete


# -- bad input: typed protocol errors, with event number and byte offset --------------------------
@pytest.mark.parametrize(
    ("data", "event_number", "path"),
    [
        (sse(r_created(), r_added(0, fc()), r_delta(5)), 3, "delta"),  # type: ignore[arg-type]
        (sse(r_created(), {"type": "response.output_item.added", "output_index": 0,
                           "item": []}), 2, "item"),
        (sse(r_created(), r_added("x", fc())), 2, "output_index"),  # type: ignore[arg-type]
        (sse(a_start(), {"type": "content_block_delta", "index": "x", "delta": {}}), 2, "index"),
        (sse(a_start(), a_block(0, {"type": "tool_use", "id": 7, "name": "n", "input": {}})), 2,
         "content_block.id"),
        (sse(a_start(), {"type": "message_delta", "delta": {"stop_reason": 3}}), 2,
         "delta.stop_reason"),
        (sse(r_created(), a_start()), 2, "type"),  # a stream that switches format
        (sse(a_start(), r_created()), 2, "type"),
        (sse(a_start()) + b'data: {"id": "c", "choices": [{"index": 0, "delta": {}}]}\n\n', 2,
         "choices"),
        (b'data: {"id": "c", "choices": [{"index": 0, "delta": {}}]}\n\n' + sse(r_created()), 2,
         "type"),
        (b'data: {"id": "c", "choices": []}\n\n' + sse(a_start()), 2, "type"),
        (sse(r_created()) + b'data: {"no": "type"}\n\n', 2, "type"),
    ],
)  # fmt: skip
def test_bad_input_is_a_protocol_error_that_says_where(
    data: bytes, event_number: int, path: str
) -> None:
    parser = StreamParser()
    with pytest.raises(RemoteProtocolError) as info:
        parser.receive_data(data)
    error = info.value
    assert (error.event_number, error.path) == (event_number, path)
    boundary = data.index(b"\n\n") + 2
    if event_number == 2:
        assert error.byte_offset == boundary
    assert f"event {event_number}" in str(error) and "byte" in str(error)
    with pytest.raises(RemoteProtocolError):
        parser.receive_data(b"data: {}\n\n")
    assert parser.result().end_how == "protocol_error"


def test_format_names_and_errors_of_use() -> None:
    with pytest.raises(ValueError, match="format"):
        StreamParser(format="bedrock")
    assert detect({"type": "response.created"}) == "responses"
    assert detect({"type": "message_start"}) == "anthropic"
    assert detect({"type": "error", "error": {"type": "overloaded_error"}}) == "anthropic"
    assert detect({"type": "error", "code": "x"}) == "responses"
    assert detect({"id": "c", "choices": []}) == "chat"
    parser, _ = run(anthropic_call(a_json(0, "{}")))
    with pytest.raises(LocalProtocolError):
        parser.receive_data(b"data: {}\n\n")
    # a named format refuses the other's first event
    with pytest.raises(RemoteProtocolError, match="changed format"):
        StreamParser(format="anthropic").receive_data(sse(r_created()))
    with pytest.raises(RemoteProtocolError, match="changed format"):
        StreamParser(format="chat").receive_data(sse(r_created()))


def test_receive_chunk_and_parse_take_events() -> None:
    events = [r_created(), r_added(0, fc()), r_delta("{}"), r_completed()]
    parser = StreamParser()
    for event in events:
        parser.receive_chunk(event)
    parser.receive_chunk("[DONE]")
    parser.receive_eof()
    assert parser.result().complete and parser.format == "responses"
    result = parse([a_start(), a_block(0, tool()), a_stop(0), *a_end()])
    assert result.complete and result.format == "anthropic"
    assert parse(sse(*events), format="responses").complete


def test_results_must_answer_every_call() -> None:
    parser, _ = run(anthropic_call(a_json(0, "{}")))
    turn = parser.result().turn()
    for bad in ({}, {"toolu_1": 1, "other": 2}, [], [1, 2], "x"):
        with pytest.raises(ToolResultError):
            turn.to_anthropic(results=bad)  # type: ignore[arg-type]


# -- limits and hostile input ---------------------------------------------------------------------
def test_limits_apply() -> None:
    limits = Limits(max_argument_bytes=8, max_tool_calls=1)
    parser, _ = run(responses_call(r_delta('{"a": 123456789}')), limits=limits)
    (call,) = parser.result().turn().tool_calls
    assert (call.state.value, call.reason) == ("aborted", "limit:max_argument_bytes")
    two = sse(a_start(), a_block(0, tool("t1")), a_stop(0), a_block(1, tool("t2")), a_stop(1),
              *a_end())  # fmt: skip
    parser, _ = run(two, limits=limits)
    assert parser.result().end_reason == "limit:max_tool_calls"
    parser, _ = run(anthropic_call(a_json(0, "{}")), limits=Limits(max_text_bytes=1))
    assert parser.result().complete
    text = sse(a_start(), a_block(0, {"type": "text", "text": "long text"}), a_stop(0), *a_end())
    parser, _ = run(text, limits=Limits(max_text_bytes=4))
    assert parser.result().end_reason == "limit:max_text_bytes"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6,
)  # fmt: skip

_STREAMS = [
    [r_created(), r_added(0, fc()), r_delta("{}"), r_done(0, fc(args="{}")), r_completed()],
    [a_start(), a_block(0, tool()), a_json(0, "{}"), a_stop(0), *a_end()],
]


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, 1), at=st.integers(0, 10), key=st.text(max_size=12), value=_JSON,
    split=st.integers(0, 400),
)  # fmt: skip
def test_any_wrong_value_gives_only_documented_errors(
    which: int, at: int, key: str, value: Any, split: int
) -> None:
    """Any field of any event replaced by any JSON value: a result, or a RemoteProtocolError;
    never another exception."""
    events = json.loads(json.dumps(_STREAMS[which]))
    event = events[at % len(events)]
    target = event
    for part in ("response", "item", "content_block", "delta", "message"):
        if isinstance(target.get(part), dict) and len(key) % 2:
            target = target[part]
            break
    keys = list(target)
    target[keys[len(key) % len(keys)] if key[:1] != "+" else key] = value
    data = sse(*events)
    parser = StreamParser()
    try:
        parser.receive_data(data[:split])
        parser.receive_data(data[split:])
        parser.receive_eof()
    except RemoteProtocolError:
        return
    result = parser.result()
    assert isinstance(result.complete, bool)
    json.dumps(result.to_json())
    for turn in result.turns:
        json.dumps(turn.output_items())


def test_a_chat_turn_renders_for_both_apis_and_stored_rows_render_the_same() -> None:
    pytest.importorskip("anthropic")
    from anthropic.types import MessageParam
    from openai.types.responses import ResponseInputItemParam
    from pydantic import TypeAdapter

    from fsm.formats.render import anthropic_messages, responses_input

    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "ok", "tool_calls": [
        {"index": 0, "id": "call_9", "function": {"name": "add", "arguments": '{"a":1}'}}]},
        "finish_reason": "tool_calls"}]}  # fmt: skip
    result = parse([chunk, "[DONE]"])
    turn = result.turn()
    assert (result.format, turn.format, turn.output_items()) == ("chat", "chat", [])
    items = turn.to_items(results={"call_9": "2"})
    assert items == [
        {"type": "message", "role": "assistant", "content": "ok"},
        {"type": "function_call", "call_id": "call_9", "name": "add", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "2"},
    ]
    TypeAdapter(list[ResponseInputItemParam]).validate_python(items)
    messages = turn.to_anthropic(results=["2"])
    assert messages[0]["content"][1] == {
        "type": "tool_use", "id": "call_9", "name": "add", "input": {"a": 1}
    }  # fmt: skip
    TypeAdapter(list[MessageParam]).validate_python(messages)
    # the same from what a store keeps (format, verbatim items, text, calls)
    calls = [{"id": "call_9", "name": "add", "arguments": '{"a":1}'}]
    assert responses_input("chat", [], "ok", calls, ["2"]) == items
    assert anthropic_messages("chat", [], "ok", calls, ["2"]) == messages
    # an Anthropic turn from its stored blocks
    parser, _ = run(anthropic_call(a_json(0, '{"q": 1}')))
    anth = parser.result().turn()
    stored = anth.output_items()
    assert anthropic_messages("anthropic", stored, None, [], None) == anth.to_anthropic()


@pytest.mark.parametrize(
    "data",
    [
        b'event: message_start\ndata: {"a": 1}\n\nevent: ping\ndata: {}\n\n',
        b"event:  two spaces\ndata: x\n\nevent: a:b\ndata: \n\n",
        b"event: e\ndata: one\ndata: two\n\nevent: e\nid: 7\ndata: z\n\n",
        b"data: {}\nevent: bedrock order\n\nevent: caf\xc3\xa9\ndata: {}\n\nevent: x\n\n",
    ],
)
def test_named_events_frame_the_same_whole_and_byte_by_byte(data: bytes) -> None:
    """The framer's fast path for 'event: NAME' + one data line gives what its general
    line-by-line path gives (names, payloads, byte offsets)."""
    from fsm.sse import SSEFramer

    whole = SSEFramer(1 << 20).feed(data)
    framer = SSEFramer(1 << 20)
    pieces = [e for i in range(len(data)) for e in framer.feed(data[i : i + 1])]
    assert whole == pieces
    assert all(data[offset:].startswith((b"event", b"data", b"id")) for _n, _p, offset in whole)
