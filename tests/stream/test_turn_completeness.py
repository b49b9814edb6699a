"""A turn is complete, and a call executable, only when the stream says so (the parser holes of
issue 26, finding 9: Responses ``response.incomplete``, a reused output or block index)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsm import StreamParser
from fsm.parser import ParseResult


def parse(events: list[dict[str, Any]]) -> ParseResult:
    parser = StreamParser()
    parser.receive_data(
        "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
    )
    parser.receive_eof()
    return parser.result()


def call_item(n: int, arguments: str = "") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "pay",
            "arguments": arguments}  # fmt: skip


CREATED = {"type": "response.created", "response": {"id": "resp_1"}}


@pytest.mark.parametrize("reason", ["completed", "max_output_tokens", "whatever"])
def test_response_incomplete_is_never_a_complete_turn(reason: str) -> None:
    result = parse([
        CREATED,
        {"type": "response.output_item.added", "output_index": 0, "item": call_item(1)},
        {"type": "response.output_item.done", "output_index": 0,
         "item": call_item(1, '{"amount": 1}')},
        {"type": "response.incomplete",
         "response": {"id": "resp_1", "incomplete_details": {"reason": reason}}},
    ])  # fmt: skip
    turn = result.turns[0]
    assert not turn.complete
    assert turn.finish_reason == reason
    assert [c.state.value for c in turn.tool_calls] != ["finished"]


def test_response_completed_stays_complete() -> None:
    result = parse([
        CREATED,
        {"type": "response.output_item.added", "output_index": 0, "item": call_item(1)},
        {"type": "response.output_item.done", "output_index": 0,
         "item": call_item(1, '{"amount": 1}')},
        {"type": "response.completed", "response": {"id": "resp_1"}},
    ])  # fmt: skip
    assert result.turns[0].complete


def test_reused_output_index_leaves_no_executable_empty_call() -> None:
    result = parse([
        CREATED,
        {"type": "response.output_item.added", "output_index": 0, "item": call_item(1)},
        {"type": "response.output_item.added", "output_index": 0, "item": call_item(2)},
        {"type": "response.function_call_arguments.delta", "output_index": 0,
         "delta": '{"amount": 2}'},
        {"type": "response.output_item.done", "output_index": 0,
         "item": call_item(2, '{"amount": 2}')},
        {"type": "response.completed", "response": {"id": "resp_1"}},
    ])  # fmt: skip
    first, second = result.turns[0].tool_calls
    assert (first.id, first.state.value, first.reason) == (
        "call_1",
        "aborted",
        "duplicate_output_index",
    )
    assert (second.state.value, second.arguments) == ("finished", '{"amount": 2}')
    assert not result.turns[0].complete
    assert "duplicate_output_index" in {a.kind for a in result.anomalies}


def tool_use(n: int) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{n}", "name": "pay", "input": {}}


def test_reused_block_index_leaves_no_executable_empty_call() -> None:
    result = parse([
        {"type": "message_start", "message": {"id": "msg_1", "model": "c", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": tool_use(1)},
        {"type": "content_block_start", "index": 0, "content_block": tool_use(2)},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"amount": 2}'}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"},
    ])  # fmt: skip
    first, second = result.turns[0].tool_calls
    assert (first.id, first.state.value, first.reason) == ("toolu_1", "aborted",
                                                           "block_index_reused")  # fmt: skip
    assert (second.state.value, second.arguments) == ("finished", '{"amount": 2}')
    assert not result.turns[0].complete


def test_a_block_index_reused_after_its_stop_keeps_the_first_call() -> None:
    result = parse([
        {"type": "message_start", "message": {"id": "msg_1", "model": "c", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": tool_use(1)},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"amount": 1}'}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 0, "content_block": tool_use(2)},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"},
    ])  # fmt: skip
    assert [(c.state.value, c.arguments) for c in result.turns[0].tool_calls] == [
        ("finished", '{"amount": 1}'), ("finished", "{}")
    ]  # fmt: skip
