"""The parser's contract: each rule of shared/spec/parser.md, with a small stream of its own.

The place to start. The rest of the parser's tests are beside this file: the rules at the edges
(test_parser_edges.py), the machines and the ending table (test_states.py), the three formats
(test_formats.py), splits and cuts (test_splits.py, test_cut_streams.py), limits and hostile
input (test_limits.py, test_bad_input.py, test_hostile.py), the real recordings (test_corpus.py,
test_formats_corpus.py)."""

from __future__ import annotations

from typing import Any

import pytest

from fsm import (
    AnomalyDetected,
    ContentDelta,
    IncompleteTurnError,
    LocalProtocolError,
    ReasoningDelta,
    RefusalDelta,
    StreamParser,
    ToolCallAborted,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallOpened,
    ToolCallState,
    ToolCallTruncated,
    ToolCallUpdated,
    TurnEnded,
    parse,
)
from tests.helpers import chunk, sse, tc

FINISHED = ToolCallState.FINISHED
TRUNCATED = ToolCallState.TRUNCATED
ABORTED = ToolCallState.ABORTED


def calls(data: bytes, **kwargs: Any) -> list[tuple[Any, ...]]:
    result = parse(data, **kwargs)
    return [
        (c.index, c.id, c.name, c.arguments, c.state.value, c.reason)
        for c in result.turns[0].tool_calls
    ]


# -- routing ----------------------------------------------------------------------------------
def test_index_with_absent_empty_or_equal_id_continues_the_call() -> None:
    data = sse(
        chunk(tc(0, "call_1", "f", "")),
        chunk(tc(0, args='{"a"')),
        chunk(tc(0, "", args=":")),
        chunk(tc(0, "call_1", args="1}")),
        chunk(finish="tool_calls"),
    )
    assert calls(data) == [(0, "call_1", "f", '{"a":1}', "finished", None)]


def test_same_index_with_a_new_id_opens_a_new_call() -> None:
    """Groq / Bedrock / Ollama put several calls at index 0 with distinct ids."""
    data = sse(
        chunk(tc(0, "a", "f", '{"x":')),
        chunk(tc(0, args="1}")),
        chunk(tc(0, "b", "g", '{"y":')),
        chunk(tc(0, args="2}")),  # goes to the most recently opened call at index 0
        chunk(finish="tool_calls"),
    )
    assert calls(data) == [
        (0, "a", "f", '{"x":1}', "finished", None),
        (0, "b", "g", '{"y":2}', "finished", None),
    ]


def test_new_index_opens_a_call_whose_name_comes_later() -> None:
    data = sse(
        chunk(tc(0, "a", args="")),
        chunk(tc(0, name="lookup")),
        chunk(tc(0, args="{}")),
        chunk(finish="tool_calls"),
    )
    assert calls(data) == [(0, "a", "lookup", "{}", "finished", None)]


def test_index_absent_routing_by_id_name_and_continuation() -> None:
    data = sse(
        chunk(tc(id="a", name="f", omit_index=True)),
        chunk(tc(args='{"p":', omit_index=True)),  # continuation -> most recent (a)
        chunk(tc(id="b", omit_index=True)),  # nameless WITH an id: a new call, never a continuation
        chunk(tc(id="a", args="1}", omit_index=True)),  # id matches a -> a
        chunk(tc(id="b", name="g", args="{}", omit_index=True)),  # backfills b's name
        chunk(tc(name="h", omit_index=True)),  # no id, a name: a new call
        chunk(tc(args="[]", omit_index=True)),  # continuation -> h
        chunk(finish="tool_calls"),
    )
    assert calls(data) == [
        (None, "a", "f", '{"p":1}', "finished", None),
        (None, "b", "g", "{}", "finished", None),
        (None, "", "h", "[]", "finished", None),
    ]


def test_continuation_with_no_open_call_is_dropped_as_an_anomaly() -> None:
    data = sse(chunk(tc(args='{"x":1}', omit_index=True)), chunk(finish="stop"))
    result = parse(data)
    assert result.turns[0].tool_calls == []
    assert [a.kind for a in result.anomalies] == ["orphan_continuation"]
    assert result.complete  # nothing was invented


def test_sparse_interleaved_indices_starting_at_one_sort_by_index() -> None:
    data = sse(
        chunk(tc(3, "c3", "third", "")),
        chunk(tc(1, "c1", "first", "")),
        chunk(tc(3, args='{"n":')),
        chunk(tc(1, args='{"n":')),
        chunk(tc(3, args="3}")),
        chunk(tc(1, args="1}")),
        chunk(finish="tool_calls"),
    )
    result = parse(data)
    turn = result.turns[0]
    assert [(c.index, c.name, c.arguments, c.position) for c in turn.tool_calls] == [
        (1, "first", '{"n":1}', 0),
        (3, "third", '{"n":3}', 1),
    ]
    assert [c["id"] for c in turn.to_message()["tool_calls"]] == ["c1", "c3"]


# -- merging ----------------------------------------------------------------------------------
def test_empty_id_never_overwrites_and_no_id_is_never_invented() -> None:
    data = sse(
        chunk(tc(0, name="f", args="")),
        chunk(tc(0, "", args="{}")),
        chunk(finish="tool_calls"),
    )
    assert calls(data) == [(0, "", "f", "{}", "finished", None)]
    late = sse(chunk(tc(0, name="f")), chunk(tc(0, "late_id", args="{}")), chunk(finish="stop"))
    assert calls(late) == [(0, "late_id", "f", "{}", "finished", None)]


def test_repeated_whole_name_is_not_doubled_and_split_name_is_joined() -> None:
    vllm = sse(
        chunk(tc(0, "x", "get_weather", "")),
        chunk(tc(0, "x", "get_weather", '{"c":')),
        chunk(tc(0, "x", "", '"P"}')),
        chunk(finish="tool_calls"),
    )
    assert calls(vllm) == [(0, "x", "get_weather", '{"c":"P"}', "finished", None)]
    split = sse(chunk(tc(0, "y", "get_")), chunk(tc(0, name="weather", args="{}")), chunk())
    assert calls(split)[0][2] == "get_weather"


def test_type_is_set_once_and_defaults_to_function() -> None:
    data = sse(
        chunk(tc(0, "a", "f", "{}")),
        chunk(tc(1, "b", "g", "{}", type="custom")),
        chunk(tc(1, type="other")),
        chunk(finish="tool_calls"),
    )
    turn = parse(data).turns[0]
    assert [c.type for c in turn.tool_calls] == ["function", "custom"]


def test_arguments_are_verbatim_including_whitespace_and_unicode() -> None:
    fragments = ['{\n  "q"', ': "h\\u00e9llo wörld 🎉",', ' "n": 1.50', "\n}"]
    data = sse(
        chunk(tc(0, "a", "search", "")),
        *[chunk(tc(0, args=f)) for f in fragments],
        chunk(finish="tool_calls"),
    )
    assert calls(data)[0][3] == "".join(fragments)


def test_one_delta_with_several_entries_applies_them_in_order() -> None:
    data = sse(
        chunk(tc(0, "a", "f", '{"x"'), tc(0, args=":1}"), tc(1, "b", "g", "[]")),
        chunk(finish="tool_calls"),
    )
    assert calls(data) == [
        (0, "a", "f", '{"x":1}', "finished", None),
        (1, "b", "g", "[]", "finished", None),
    ]


def test_deltas_and_finish_reason_in_one_chunk() -> None:
    """Mistral: the whole call arrives in the chunk that carries finish_reason."""
    data = sse(chunk(tc(id="m1", name="f", args='{"a":1}', omit_index=True), finish="tool_calls"))
    assert calls(data) == [(None, "m1", "f", '{"a":1}', "finished", None)]


# -- ending -----------------------------------------------------------------------------------
def test_calls_stay_live_until_the_stream_ends() -> None:
    """Not final when the arguments first parse, nor when another index starts, nor at the
    first finish_reason."""
    parser = StreamParser()
    parser.receive_data(sse(chunk(tc(0, "a", "f", '{"a":1}')), done=False))
    call = parser.turns[0].tool_calls[0]
    assert call.state is ToolCallState.ACCUMULATING  # a prefix may be valid JSON
    parser.receive_data(sse(chunk(tc(1, "b", "g", "{}")), done=False))
    assert call.state is ToolCallState.ACCUMULATING
    parser.receive_data(sse(chunk(finish="tool_calls"), done=False))
    assert call.state is ToolCallState.ACCUMULATING
    parser.receive_data(sse(chunk(tc(0, args=', "more": 2}')), done=False))
    events = parser.receive_data(b"data: [DONE]\n\n")
    assert call.state is ToolCallState.TRUNCATED  # '{"a":1}, "more": 2}' is not JSON
    assert call.arguments == '{"a":1}, "more": 2}'
    assert [a.kind for a in parser.anomalies] == ["delta_after_finish"]
    assert sum(isinstance(e, ToolCallTruncated | ToolCallFinished) for e in events) == 2


def test_opened_call_with_no_arguments_finishes_with_empty_arguments() -> None:
    data = sse(chunk(tc(0, "a", "ping")), chunk(finish="tool_calls"))
    assert calls(data) == [(0, "a", "ping", "", "finished", None)]
    assert parse(data).turns[0].tool_calls[0].state is FINISHED


ENDINGS: list[tuple[str, bytes, str, str | None, bool]] = [
    # (case, the stream's ending, state, reason, complete)
    ("tool_calls then DONE", sse(chunk(finish="tool_calls")), "finished", None, True),
    ("stop then EOF", sse(chunk(finish="stop"), done=False), "finished", None, True),
    ("function_call then DONE", sse(chunk(finish="function_call")), "finished", None, True),
    ("unknown finish then DONE", sse(chunk(finish="weird")), "finished", None, True),
    ("no finish, DONE", sse(), "finished", None, True),
    ("length", sse(chunk(finish="length")), "truncated", "length", False),
    ("content_filter", sse(chunk(finish="content_filter")), "aborted", "content_filter", False),
    ("EOF without finish or DONE", sse(done=False), "aborted", "eof", False),
    (
        "error payload",
        sse('data: {"error": {"message": "upstream overloaded"}}\n\n', done=False),
        "aborted",
        "upstream overloaded",
        False,
    ),
    (
        "SSE event: error",
        sse('event: error\ndata: {"message": "boom"}\n\n', done=False),
        "aborted",
        "boom",
        False,
    ),
    (
        "SSE event: error with plain text",
        sse("event: error\ndata: gateway timeout\n\n", done=False),
        "aborted",
        "gateway timeout",
        False,
    ),
]


@pytest.mark.parametrize(("case", "ending", "state", "reason", "complete"), ENDINGS)
def test_ending_table(
    case: str, ending: bytes, state: str, reason: str | None, complete: bool
) -> None:
    head = sse(chunk(tc(0, "a", "f", '{"x": 1}')), done=False)
    result = parse(head + ending)
    (call,) = result.turns[0].tool_calls
    assert (call.state.value, call.reason) == (state, reason), case
    assert result.turns[0].complete is complete
    assert result.complete is complete


def test_ending_table_abort() -> None:
    parser = StreamParser()
    parser.receive_data(sse(chunk(tc(0, "a", "f", '{"x": 1}')), done=False))
    events = parser.abort("client disconnected")
    call = parser.turns[0].tool_calls[0]
    assert (call.state, call.reason) == (ABORTED, "client disconnected")
    assert any(isinstance(e, ToolCallAborted) for e in events)
    assert not parser.turns[0].complete
    assert parser.abort("again") == []  # a no-op once ended


def test_missing_name_aborts_the_call_whatever_the_ending() -> None:
    for ending in (sse(chunk(finish="tool_calls")), sse(chunk(finish="length"))):
        data = sse(chunk(tc(0, "a", args="{}")), done=False) + ending
        result = parse(data)
        (call,) = result.turns[0].tool_calls
        assert (call.state, call.reason) == (ABORTED, "missing_name")
        assert not result.complete


def test_invalid_json_with_tool_calls_is_truncated_and_whitespace_is_finished() -> None:
    bad = sse(chunk(tc(0, "a", "f", '{"x": ')), chunk(finish="tool_calls"))
    assert calls(bad)[0][4:] == ("truncated", "invalid_json")
    blank = sse(chunk(tc(0, "a", "f", "  \n")), chunk(finish="tool_calls"))
    assert calls(blank)[0][4:] == ("finished", None)


def test_turn_without_calls_is_complete_only_when_it_ended_normally() -> None:
    assert parse(sse(chunk(content="hi"), chunk(finish="stop"))).complete
    assert not parse(sse(chunk(content="hi"), chunk(finish="length"))).complete
    assert not parse(sse(chunk(content="hi"), done=False)).complete


def test_error_payload_after_buffered_chunks_is_not_success() -> None:
    """openai-node #2046: a terminal error after buffered chunks looked like success."""
    data = sse(
        chunk(tc(0, "a", "f", '{"x": 1}')),
        chunk(finish="tool_calls"),
        'data: {"error": {"message": "internal error", "code": 500}}\n\n',
    )
    result = parse(data)
    assert not result.complete
    assert result.end_how == "error"
    assert result.turns[0].tool_calls[0].reason == "internal error"


def test_incomplete_turn_never_becomes_a_message() -> None:
    result = parse(sse(chunk(tc(0, "a", "f", '{"x": ')), chunk(finish="length")))
    with pytest.raises(IncompleteTurnError) as info:
        result.turns[0].to_message()
    assert info.value.states == {0: ("truncated", "length")}
    assert "truncated" in str(info.value)


# -- events -----------------------------------------------------------------------------------
def test_events_in_order_with_an_early_name() -> None:
    parser = StreamParser()
    first = parser.receive_data(sse(chunk(tc(0, "a", "search", "")), done=False))
    assert first == [
        ToolCallOpened(choice=0, ordinal=0, index=0, id="a", name="search", type="function")
    ]
    second = parser.receive_data(sse(chunk(tc(0, args='{"q":1}')), done=False))
    assert second == [ToolCallArgumentsDelta(choice=0, ordinal=0, index=0, delta='{"q":1}')]
    third = parser.receive_data(sse(chunk(tc(0, name="_more")), done=False))
    assert third == [ToolCallUpdated(choice=0, ordinal=0, index=0, id="a", name="search_more")]
    end = parser.receive_data(sse(chunk(finish="tool_calls")))
    finals = [e for e in end if isinstance(e, ToolCallFinished)]
    assert finals == [
        ToolCallFinished(
            choice=0, ordinal=0, position=0, index=0, id="a", name="search_more",
            arguments='{"q":1}', repaired=False, raw_length=7,
        )
    ]  # fmt: skip
    assert isinstance(end[-2], TurnEnded) and end[-2].complete


# -- repair -----------------------------------------------------------------------------------
def test_repair_is_opt_in_append_only_and_keeps_the_raw_string() -> None:
    data = sse(chunk(tc(0, "a", "f", '{"city": "Par')), chunk(finish="tool_calls"))
    assert calls(data)[0][4:] == ("truncated", "invalid_json")
    result = parse(data, repair_json=True)
    call = result.turns[0].tool_calls[0]
    assert call.state is FINISHED and call.repaired
    assert call.raw_arguments == '{"city": "Par'
    assert call.arguments == '{"city": "Par"}'
    assert call.arguments.startswith(call.raw_arguments)
    assert result.complete


def test_repair_never_applies_to_length() -> None:
    data = sse(chunk(tc(0, "a", "f", '{"city": "Par')), chunk(finish="length"))
    call = parse(data, repair_json=True).turns[0].tool_calls[0]
    assert (call.state, call.reason, call.repaired) == (TRUNCATED, "length", False)


def test_unrepairable_arguments_stay_truncated() -> None:
    data = sse(chunk(tc(0, "a", "f", '{"a": 1,')), chunk(finish="tool_calls"))
    call = parse(data, repair_json=True).turns[0].tool_calls[0]
    assert (call.state, call.reason, call.repaired) == (TRUNCATED, "invalid_json", False)


# -- everything else in a chunk ---------------------------------------------------------------
def test_text_fields_are_concatenated_with_events() -> None:
    data = sse(
        chunk(reasoning_content="think "),
        chunk(reasoning="more"),
        chunk(content="Hel"),
        chunk(tc(0, "a", "f", "{}")),
        chunk(content="lo"),
        chunk(refusal="no"),
        chunk(finish="tool_calls"),
    )
    events: list[Any] = []
    result = parse(data, on_event=events.append)
    turn = result.turns[0]
    assert (turn.reasoning, turn.content, turn.refusal) == ("think more", "Hello", "no")
    assert [type(e) for e in events[:3]] == [ReasoningDelta, ReasoningDelta, ContentDelta]
    assert any(isinstance(e, RefusalDelta) for e in events)
    message = turn.to_message(include_reasoning=True)
    assert message["content"] == "Hello" and message["refusal"] == "no"
    assert message["reasoning_content"] == "think more"


def test_empty_and_null_choices_and_choice_without_delta_are_legal() -> None:
    data = sse(
        {"id": "", "choices": [], "prompt_filter_results": [{"x": 1}]},
        {"id": "r", "choices": None},
        {"id": "r", "choices": [{"index": 0, "finish_reason": None}]},
        chunk(tc(0, "a", "f", "{}")),
        {"id": "r", "choices": [{"index": 0, "finish_reason": "tool_calls"}]},
        {"id": "r", "choices": [], "usage": {"prompt_tokens": 1, "total_tokens": 2}},
    )
    result = parse(data)
    assert result.complete
    assert result.usage == {"prompt_tokens": 1, "total_tokens": 2}
    assert result.anomalies == []


def test_metadata_is_kept_and_unknown_fields_are_ignored() -> None:
    first = chunk(tc(0, "a", "f", "{}"))
    first.update(system_fingerprint="fp_1", obfuscation="zz", x_vendor={"a": [1]})
    first["choices"][0]["delta"]["unknown"] = {"deep": True}
    result = parse(sse(first, chunk(finish="tool_calls")))
    assert (result.response_id, result.model, result.created, result.system_fingerprint) == (
        "chatcmpl-test", "test-model", 1700000000, "fp_1",
    )  # fmt: skip
    assert result.complete


def test_message_object_in_a_choice_is_not_read() -> None:
    """Writer sends ``message`` and ``delta`` with the same fragments: read ``delta`` only."""
    c = chunk(tc(0, "a", "f", '{"x":1}'))
    c["choices"][0]["message"] = {"tool_calls": c["choices"][0]["delta"]["tool_calls"]}
    assert calls(sse(c, chunk(finish="tool_calls")))[0][3] == '{"x":1}'


def test_several_choices_are_independent_turns() -> None:
    data = sse(
        chunk(tc(0, "a", "f", "{}"), choice=0),
        chunk(content="text only", choice=1),
        chunk(tc(0, "b", "g", '{"x":'), choice=2),
        chunk(finish="tool_calls", choice=0),
        chunk(finish="stop", choice=1),
        chunk(finish="length", choice=2),
    )
    result = parse(data)
    assert [(t.index, t.complete) for t in result.turns] == [(0, True), (1, True), (2, False)]
    assert not result.complete
    assert result.turn(2).tool_calls[0].reason == "length"
    with pytest.raises(KeyError, match="no choice 7"):
        result.turn(7)


def test_data_after_done_is_an_anomaly_and_ignored() -> None:
    data = sse(chunk(tc(0, "a", "f", "{}")), chunk(finish="tool_calls")) + sse(
        chunk(tc(0, args="MORE")), done=True
    )
    events: list[Any] = []
    result = parse(data, on_event=events.append)
    assert result.turns[0].tool_calls[0].arguments == "{}"
    assert [a.kind for a in result.anomalies] == ["data_after_end", "data_after_end"]
    assert any(isinstance(e, AnomalyDetected) for e in events)
    assert result.complete


def test_unknown_finish_reason_is_reported() -> None:
    result = parse(sse(chunk(tc(0, "a", "f", "{}")), chunk(finish="eos_token")))
    assert [a.kind for a in result.anomalies] == ["unknown_finish_reason"]
    assert result.turns[0].finish_reason == "eos_token"


def test_parse_returns_an_aborted_result_when_the_transport_fails() -> None:
    def transport() -> Any:
        yield sse(chunk(tc(0, "a", "f", '{"x": 1}')), done=False)
        raise ConnectionError("peer reset")

    result = parse(transport())
    assert result.end_how == "aborted"
    assert result.turns[0].tool_calls[0].reason == "ConnectionError: peer reset"
    assert not result.complete


def test_receive_chunk_accepts_dicts_json_and_pydantic_models() -> None:
    from openai.types.chat import ChatCompletionChunk
    from pydantic import BaseModel

    class Choice(BaseModel):  # any pydantic model of a chunk (fsm.wire is gone: issue 11)
        index: int
        delta: dict[str, object]
        finish_reason: str | None = None

    class WireChunk(BaseModel):
        choices: list[Choice]

    parser = StreamParser()
    parser.receive_chunk(chunk(tc(0, "a", "f", '{"x":')))
    parser.receive_chunk(
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":" 1"}}]}}]}'
    )
    parser.receive_chunk(ChatCompletionChunk.model_validate(chunk(tc(0, args="}"))))
    parser.receive_chunk(WireChunk.model_validate(chunk(finish="tool_calls")))
    parser.receive_chunk("[DONE]")
    parser.receive_eof()
    call = parser.turns[0].tool_calls[0]
    assert (call.arguments, call.state) == ('{"x": 1}', FINISHED)
    with pytest.raises(LocalProtocolError, match="receive_chunk"):
        StreamParser().receive_chunk(42)


def test_protocol_error_carries_the_events_of_the_failing_read() -> None:
    """Nothing is lost when a read raises: earlier deltas and the final events ride on it."""
    from fsm import RemoteProtocolError, StreamEnded

    parser = StreamParser()
    data = sse(chunk(tc(0, "a", "f", '{"x":')), done=False) + b"data: [1]\n\n"
    with pytest.raises(RemoteProtocolError) as info:
        parser.receive_data(data)
    kinds = [type(e).__name__ for e in info.value.events]
    assert kinds[:2] == ["ToolCallOpened", "ToolCallArgumentsDelta"]
    assert "ToolCallAborted" in kinds and isinstance(info.value.events[-1], StreamEnded)
    assert parser.turns[0].tool_calls[0].reason == "protocol_error"
