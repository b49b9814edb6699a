"""Issue 29, item 1: a non-streamed response (``chat.completion``, Responses ``response``,
Anthropic ``message``) parses into the same result its stream gives, by the same rules, and
commits; anything else is a typed error.

Real data: the terminal ``response`` objects of the Responses recordings (whole responses as the
API returns them), and the complete turns of the Chat Completions and Anthropic recordings
rebuilt as the non-streamed object the API would have returned, validated by the SDKs' own
types first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import fsm
from fsm import LocalProtocolError, RemoteProtocolError, parse_completion
from fsm.cli.main import cli
from fsm.parser import ParseResult
from fsm.states import ToolCallState
from fsm.store import ConversationStore
from tests.helpers import (
    CORPUS,
    FORMAT_CORPORA,
    corpus_bytes,
    corpus_params,
    need,
    recordings_of,
    require_corpus,
    require_recording,
)

RESPONSES = FORMAT_CORPORA["responses"]
ANTHROPIC = FORMAT_CORPORA["anthropic"]


def _summary(result: ParseResult) -> list[Any]:
    return [
        (
            t.index,
            t.complete,
            t.finish_reason,
            t.content,
            t.reasoning,
            [(c.id, c.name, c.arguments, c.state, c.reason, c.custom) for c in t.tool_calls],
        )
        for t in result.turns
    ]


def _terminal_response(path: Path) -> dict[str, Any] | None:
    """The ``response`` of a recording's terminal event, when it is a whole response."""
    for line in path.read_text().splitlines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") in (
            "response.completed",
            "response.incomplete",
            "response.failed",
        ):
            response = event.get("response")
            if isinstance(response, dict) and response.get("object") == "response":
                return response
    return None


# -- the Responses recordings' own whole responses ----------------------------------------------


@pytest.mark.parametrize("path", recordings_of(RESPONSES), ids=lambda p: p.name)
def test_a_recorded_response_object_parses_as_its_stream(path: Path) -> None:
    require_recording(path, "Responses recording")
    name = path.name
    response = _terminal_response(path)
    if response is None:
        pytest.skip(f"{name} ends with no whole response object (hand-written error stream)")
    from openai.types.responses import Response

    streamed = fsm.parse(path)
    assert _summary(parse_completion(response)) == _summary(streamed)
    # its JSON text and the SDK's own object too
    assert _summary(parse_completion(json.dumps(response).encode())) == _summary(streamed)
    # as the SDK builds it from the API's reply (leniently: recordings predate some fields)
    sdk = Response.construct(**response)
    assert isinstance(sdk, Response)
    assert _summary(parse_completion(sdk)) == _summary(streamed)


# -- Chat Completions: complete turns of the corpus as chat.completion objects -----------------


def _as_chat_completion(result: ParseResult) -> dict[str, Any]:
    return {
        "id": result.response_id or "chatcmpl-x",
        "object": "chat.completion",
        "created": 1,
        "model": result.model or "m",
        "choices": [
            {"index": t.index, "message": t.to_message(), "finish_reason": t.finish_reason}
            for t in result.turns
        ],
        "usage": result.usage,
    }


@pytest.mark.parametrize("name", corpus_params())
def test_a_chat_completion_of_a_recorded_turn_parses_as_its_stream(name: str | None) -> None:
    streamed = fsm.parse(corpus_bytes(need(name)))
    if not streamed.turns or not all(t.complete for t in streamed.turns):
        pytest.skip("only complete turns have a message to rebuild")
    if any(t.finish_reason is None for t in streamed.turns):
        pytest.skip("a chat.completion always has a finish_reason")
    completion = _as_chat_completion(streamed)
    result = parse_completion(completion)
    assert result.complete
    assert [t.to_message() for t in result.turns] == [t.to_message() for t in streamed.turns]
    assert result.response_id == streamed.response_id
    if streamed.usage is not None and all(
        isinstance(streamed.usage.get(k), int)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    ):
        from openai.types.chat import ChatCompletion

        sdk = ChatCompletion.model_validate(completion)
        assert [t.to_message() for t in parse_completion(sdk).turns] == [
            t.to_message() for t in streamed.turns
        ]


def test_the_chat_corpus_gives_completions_to_check() -> None:
    require_corpus()
    checked = 0
    for path in sorted(CORPUS.glob("*/*.sse")):
        streamed = fsm.parse(path)
        turns = streamed.turns
        if turns and all(t.complete and t.finish_reason for t in turns):
            checked += any(t.tool_calls for t in turns)
    assert checked >= 20


# -- Anthropic: complete turns of the recordings as Message objects ----------------------------


@pytest.mark.parametrize("path", recordings_of(ANTHROPIC), ids=lambda p: p.name)
def test_an_anthropic_message_of_a_recorded_turn_parses_as_its_stream(path: Path) -> None:
    require_recording(path, "Anthropic recording")
    streamed = fsm.parse(path)
    turn = streamed.turns[0] if streamed.turns else None
    if turn is None or not turn.complete:
        pytest.skip("only complete turns have a message to rebuild")
    message = {
        "id": streamed.response_id or "msg_x",
        "type": "message",
        "role": "assistant",
        "model": streamed.model or "claude",
        "content": turn.to_anthropic()[0]["content"],
        "stop_reason": turn.finish_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 2},
    }
    result = parse_completion(message)
    assert result.complete
    got = result.turns[0]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        (c.id, c.name, json.loads(c.arguments)) for c in turn.tool_calls
    ]
    assert got.content == turn.content
    assert got.to_anthropic() == turn.to_anthropic()
    import anthropic.types

    try:
        sdk = anthropic.types.Message.model_validate(message)
    except ValueError:
        pytest.skip("a block type this anthropic version does not know")
    assert parse_completion(sdk).turns[0].to_anthropic() == turn.to_anthropic()


# -- the same rules as a stream, on hand-written responses -------------------------------------


def _chat(message: dict[str, Any], finish: str | None = "tool_calls") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def _call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_chat_completion_with_parallel_calls_keeps_each_call() -> None:
    calls = [_call("call_a", "add", '{"a":1,"b":2}'), _call("call_b", "mul", '{"a":3}')]
    result = parse_completion(_chat({"role": "assistant", "content": None, "tool_calls": calls}))
    turn = result.turns[0]
    assert turn.complete
    assert [(c.id, c.name, c.arguments, c.index) for c in turn.tool_calls] == [
        ("call_a", "add", '{"a":1,"b":2}', 0),
        ("call_b", "mul", '{"a":3}', 1),
    ]
    assert turn.to_message()["tool_calls"] == calls


def test_a_chat_completion_cut_by_length_is_never_executable() -> None:
    message = {"role": "assistant", "tool_calls": [_call("call_a", "add", '{"a": 1, "b')]}
    turn = parse_completion(_chat(message, "length")).turns[0]
    assert not turn.complete
    assert turn.tool_calls[0].state is ToolCallState.TRUNCATED


def test_arguments_that_are_not_json_are_not_finished() -> None:
    message = {"role": "assistant", "tool_calls": [_call("call_a", "add", "{'a': 1}")]}
    turn = parse_completion(_chat(message)).turns[0]
    assert not turn.complete
    assert turn.tool_calls[0].state is not ToolCallState.FINISHED


def test_a_blank_name_is_refused() -> None:
    message = {"role": "assistant", "tool_calls": [_call("call_a", "  ", "{}")]}
    turn = parse_completion(_chat(message)).turns[0]
    assert not turn.complete
    assert turn.tool_calls[0].state is ToolCallState.ABORTED


def test_the_provider_id_is_kept_as_sent_even_empty() -> None:
    message = {"role": "assistant", "tool_calls": [_call("", "add", "{}")]}
    turn = parse_completion(_chat(message)).turns[0]
    assert turn.tool_calls[0].id == ""


def test_a_text_answer_is_a_complete_turn_without_calls() -> None:
    turn = parse_completion(_chat({"role": "assistant", "content": "hi"}, "stop")).turns[0]
    assert turn.complete and turn.content == "hi" and turn.tool_calls == []


def test_an_anthropic_message_cut_by_max_tokens_is_never_executable() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}],
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    turn = parse_completion(message).turns[0]
    assert not turn.complete
    assert turn.tool_calls[0].state is ToolCallState.TRUNCATED


def _response(status: str, **extra: Any) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "add",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    return {"id": "resp_1", "object": "response", "status": status, "output": [item], **extra}


def test_an_incomplete_response_is_never_executable() -> None:
    response = _response("incomplete", incomplete_details={"reason": "max_output_tokens"})
    result = parse_completion(response)
    assert not result.complete
    assert result.turns[0].tool_calls[0].state is ToolCallState.TRUNCATED


def test_a_completed_response_commits_its_call() -> None:
    result = parse_completion(_response("completed"))
    assert result.complete
    assert result.format == "responses"
    call = result.turns[0].tool_calls[0]
    assert (call.id, call.name, call.arguments, call.item_id) == (
        "call_1",
        "add",
        '{"a": 1}',
        "fc_1",
    )


@pytest.mark.parametrize("status", ["queued", "in_progress"])
def test_a_background_response_that_has_not_ended_is_incomplete(status: str) -> None:
    result = parse_completion(_response(status))
    assert not result.complete
    assert result.end_how == "aborted"
    assert status in (result.end_reason or "")
    assert result.turns[0].tool_calls[0].state is ToolCallState.ABORTED


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"object": "chat.completion.chunk", "choices": []}, "stream chunk"),
        ({"type": "response.output_item.added"}, "event of type"),
        ({"type": "message_start"}, "event of type"),
        ([1, 2], "list"),
        ("not json", "not JSON"),
        ({"hello": 1}, "neither"),
        (None, "null"),
    ],
)
def test_anything_else_is_a_typed_error_saying_what_it_got(obj: Any, says: str) -> None:
    with pytest.raises(LocalProtocolError, match=says):
        parse_completion(obj)


def test_a_malformed_response_is_the_protocol_error_its_stream_would_give() -> None:
    with pytest.raises(RemoteProtocolError):
        parse_completion({"object": "chat.completion", "choices": "x"})
    with pytest.raises(RemoteProtocolError, match="output"):
        parse_completion({"object": "response", "status": "completed", "output": {}})


# -- the store and the command line -------------------------------------------------------------


def test_each_kind_commits_and_reads_back(store: ConversationStore) -> None:
    cid = store.create_conversation()
    store.append(cid, [{"role": "user", "content": "1 + 2?"}])
    chat = parse_completion(
        _chat({"role": "assistant", "tool_calls": [_call("call_a", "add", '{"a":1,"b":2}')]})
    )
    store.commit_turn(cid, chat, ["3"])
    store.append(cid, [{"role": "user", "content": "again"}])
    store.commit_turn(cid, parse_completion(_response("completed")), ["1"])
    history = store.history(cid)
    calls = [m["tool_calls"][0]["id"] for m in history if m.get("tool_calls")]
    assert calls == ["call_a", "call_1"]
    assert [m["tool_call_id"] for m in history if m["role"] == "tool"] == ["call_a", "call_1"]


def test_fsm_parse_reads_a_completion_file_and_says_what_it_is(tmp_path: Path) -> None:
    path = tmp_path / "completion.json"
    message = {"role": "assistant", "tool_calls": [_call("call_a", "add", '{"a":1}')]}
    path.write_text(json.dumps(_chat(message), indent=2))
    runner = CliRunner()
    done = runner.invoke(cli, ["parse", str(path)])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("a non-streamed chat.completion")
    assert "COMPLETE" in done.output
    as_json = runner.invoke(cli, ["parse", "--json", str(path)])
    assert json.loads(as_json.output)["input"] == "chat.completion"
    wrong = runner.invoke(cli, ["parse", "--format", "anthropic", str(path)])
    assert wrong.exit_code == 2 and "chat.completion" in wrong.output
    path.write_text(json.dumps(_chat(message, "length")))
    assert runner.invoke(cli, ["parse", str(path)]).exit_code == 1


def test_fsm_ingest_commits_a_completion_file(tmp_path: Path) -> None:
    path = tmp_path / "response.json"
    path.write_text(json.dumps(_response("completed")))
    results = tmp_path / "results.json"
    results.write_text('["1"]')
    db = f"sqlite:///{tmp_path / 'chat.db'}"
    runner = CliRunner()
    done = runner.invoke(
        cli, ["ingest", "--db", db, "--conversation", "c1", str(path), "--results", str(results)]
    )
    assert done.exit_code == 0, done.output
    with ConversationStore(db) as store:
        history = store.history("c1", format="responses")
    assert [item.get("call_id") for item in history] == ["call_1", "call_1"]
