"""Issue 30, item 4 (the core half): ``ParseResult.to_chat_completion()``, the ``chat.completion``
a parsed Chat Completions stream amounts to, reads back through ``fsm.parse_completion`` as the
same turns, on every recording of the Chat Completions corpus; an incomplete stream, a stream
with no choice, and a Responses or Anthropic stream are typed errors. No LiteLLM here (its half
is tests/integrations/test_litellm.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import fsm
from fsm import IncompleteTurnError, LocalProtocolError, parse_completion
from fsm.parser import ParseResult
from tests.helpers import (
    FORMAT_CORPORA,
    chunk,
    corpus_bytes,
    corpus_files,
    corpus_params,
    need,
    recordings_of,
    require_corpus,
    require_recording,
    sse,
    tc,
)


def _view(result: ParseResult) -> dict[str, Any]:
    """Everything a ``chat.completion`` can carry of a result: the response's fields, and each
    turn as ``fsm parse --json`` shows it, but for the calls' streaming ``index`` (a
    ``chat.completion``'s calls have none: their order is their position)."""
    turns = []
    for turn in result.turns:
        shown = turn.to_json()
        shown["tool_calls"] = [
            {k: v for k, v in call.items() if k != "index"} for call in shown["tool_calls"]
        ]
        shown["message"] = turn.to_message(include_reasoning=True) if turn.complete else None
        turns.append(shown)
    return {
        "response_id": result.response_id,
        "model": result.model,
        "created": result.created,
        "system_fingerprint": result.system_fingerprint,
        "usage": result.usage,
        "format": result.format,
        "turns": turns,
    }


@pytest.mark.parametrize("name", corpus_params())
def test_every_recording_reads_back_as_the_same_turn(name: str | None) -> None:
    streamed = fsm.parse(corpus_bytes(need(name)))
    if not streamed.complete:
        # an incomplete stream has no chat.completion: the typed error, never a cut call
        with pytest.raises(IncompleteTurnError):
            streamed.to_chat_completion()
        return
    completion = streamed.to_chat_completion()
    assert completion["object"] == "chat.completion"
    # plain JSON (what a log, a cache or an HTTP answer holds), and it reads back equal
    completion = json.loads(json.dumps(completion))
    again = parse_completion(completion)
    assert again.complete
    assert _view(again) == _view(streamed)
    # every id and argument string exactly as the stream carried it
    sent = [(c.id, c.name, c.raw_arguments) for t in streamed.turns for c in t.tool_calls]
    built = [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for choice in completion["choices"]
        for c in choice["message"].get("tool_calls", [])
    ]
    assert built == sent


@pytest.mark.parametrize("name", corpus_params())
def test_the_official_sdk_accepts_it(name: str | None) -> None:
    """The OpenAI SDK's own ``ChatCompletion`` type takes it (when the recording's usage has the
    fields that type requires), and parse_completion takes the SDK object too."""
    streamed = fsm.parse(corpus_bytes(need(name)))
    if not streamed.complete:
        pytest.skip("an incomplete stream has no chat.completion (the test above checks why)")
    from openai.types.chat import ChatCompletion

    completion = streamed.to_chat_completion()
    missing = [k for k in ("id", "model", "created") if completion[k] is None]
    if missing:
        pytest.skip(f"the stream carried no {missing} (kept as None, never invented)")
    usage = completion.get("usage")
    if usage is not None and not all(
        isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens")
    ):
        pytest.skip(f"the recording's usage lacks the SDK's required counts: {sorted(usage)}")
    sdk = ChatCompletion.model_validate(completion)
    assert _view(parse_completion(sdk)) == _view(streamed)


def test_the_corpus_holds_what_the_round_trip_is_checked_on() -> None:
    """The parametrized tests above cannot pass empty: the corpus has complete turns with
    parallel calls, reasoning, refusals and several choices, and incomplete ones."""
    require_corpus()
    results = [fsm.parse(corpus_bytes(name)) for name in corpus_files()]
    complete = [r for r in results if r.complete]
    assert len(complete) >= 60
    assert sum(1 for r in complete if len(r.turns[0].tool_calls) >= 2) >= 25
    assert any(t.reasoning for r in complete for t in r.turns)
    assert any(t.refusal for r in complete for t in r.turns)
    assert any(len(r.turns) == 3 for r in complete)
    assert len(results) - len(complete) >= 3


def _groq_7621() -> bytes:
    """LiteLLM #7621's stream: three parallel calls, each whole in one chunk, all at index 0
    with their own ids (as Groq, Ollama and Bedrock send them)."""
    places = [("call_785j", "San Francisco"), ("call_2b7k", "Tokyo"), ("call_9q1m", "Paris")]
    calls = [
        chunk(tc(0, cid, "get_current_weather", json.dumps({"location": place}), "function"))
        for cid, place in places
    ]
    return sse(chunk(content=None, role="assistant"), *calls, chunk(finish="tool_calls"))


def test_parallel_calls_at_one_index_stay_three_calls() -> None:
    completion = fsm.parse(_groq_7621()).to_chat_completion()
    message = completion["choices"][0]["message"]
    assert [(c["id"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("call_785j", '{"location": "San Francisco"}'),
        ("call_2b7k", '{"location": "Tokyo"}'),
        ("call_9q1m", '{"location": "Paris"}'),
    ]
    assert completion["choices"][0]["finish_reason"] == "tool_calls"
    assert completion["id"] == "chatcmpl-test"
    assert completion["created"] == 1700000000
    assert "usage" not in completion  # the stream carried none: nothing invented


def test_arguments_keep_their_bytes_and_an_empty_id_stays_empty() -> None:
    args = '{ "q" :"caf\\u00e9",\n "n": 1.50 }'  # spacing, escapes and number form as sent
    stream = sse(
        chunk(tc(0, "", "search", args[:9], "function")),
        chunk(tc(0, None, None, args[9:])),
        chunk(finish="tool_calls"),
    )
    call = fsm.parse(stream).to_chat_completion()["choices"][0]["message"]["tool_calls"][0]
    assert call == {"id": "", "type": "function", "function": {"name": "search", "arguments": args}}


def test_a_legacy_function_call_and_reasoning_come_back() -> None:
    stream = sse(
        chunk(reasoning_content="think"),
        chunk(function_call={"name": "add", "arguments": '{"a": 1}'}),
        chunk(finish="function_call"),
    )
    result = fsm.parse(stream)
    message = result.to_chat_completion()["choices"][0]["message"]
    assert message["function_call"] == {"name": "add", "arguments": '{"a": 1}'}
    assert message["reasoning_content"] == "think"
    assert _view(parse_completion(result.to_chat_completion())) == _view(result)


def test_usage_and_the_fingerprint_are_kept() -> None:
    last = chunk(finish="stop", content="hi")
    last["usage"] = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    last["system_fingerprint"] = "fp_1"
    completion = fsm.parse(sse(last)).to_chat_completion()
    assert completion["usage"] == last["usage"]
    assert completion["system_fingerprint"] == "fp_1"


def test_a_cut_call_is_the_typed_error_never_a_completion() -> None:
    cut = sse(chunk(tc(0, "call_1", "add", '{"a": 1, "b')), chunk(finish="length"))
    with pytest.raises(IncompleteTurnError, match="choice 0 is not a complete turn"):
        fsm.parse(cut).to_chat_completion()
    unended = sse(chunk(tc(0, "call_1", "add", '{"a": 1}')), done=False)
    with pytest.raises(IncompleteTurnError):
        fsm.parse(unended).to_chat_completion()


def test_a_stream_with_no_choice_is_the_typed_error() -> None:
    with pytest.raises(IncompleteTurnError, match="carried no choice"):
        fsm.parse(b"").to_chat_completion()


@pytest.mark.parametrize(
    "path",
    recordings_of(FORMAT_CORPORA["responses"])[:3] + recordings_of(FORMAT_CORPORA["anthropic"])[:3],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_a_responses_or_anthropic_stream_is_a_typed_error_naming_what_to_use(path: Path) -> None:
    require_recording(path, f"{path.parent.name} recording")
    result = fsm.parse(path)
    use = "to_items()" if result.format == "responses" else "to_anthropic()"
    with pytest.raises(LocalProtocolError, match=rf"this is a {result.format} stream.*{use}"):
        result.to_chat_completion()
