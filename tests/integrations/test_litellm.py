"""Issue 30, item 4: ``ParseResult.to_chat_completion()`` as the drop-in for LiteLLM's
``stream_chunk_builder``, on LiteLLM's own chunk objects.

LiteLLM #7621 (still so on 1.110.2): a provider that sends each of three parallel calls whole in
one chunk at ``index`` 0 (Groq, Ollama, Bedrock) comes back from ``stream_chunk_builder`` as one
call, the last id, the three argument strings concatenated. Here LiteLLM itself streams that
from a local fake server (:class:`fsm.replay.ReplayServer`) and its ``ModelResponseStream``
chunks go to both builders; the next request, sent by LiteLLM again, carries the built message
back, and the server checks it is what a correct loop sends after that stream. And every Chat
Completions recording of the corpus, as LiteLLM's chunk objects, parses to the turns its bytes
give.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import fsm
from fsm.replay import ReplayServer, ReplayTurn
from tests.helpers import (
    chunk,
    corpus_bytes,
    corpus_params,
    need,
    require_framework,
    sse,
    tc,
)

PLACES = [("call_785j", "San Francisco"), ("call_2b7k", "Tokyo"), ("call_9q1m", "Paris")]
WEATHER = {"San Francisco": "72F", "Tokyo": "10C", "Paris": "22C"}


@pytest.fixture(scope="module")
def litellm() -> Iterator[Any]:
    """LiteLLM, imported offline: its bundled model cost map (no fetch from GitHub) and no
    tokenizer download (it counts tokens with tiktoken when a stream has no usage)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        env.setenv("HF_HUB_OFFLINE", "1")
        module = require_framework("litellm", "litellm")
        module.suppress_debug_info = True
        yield module


def _groq_stream() -> bytes:
    """#7621's stream: each call whole in its own chunk, every one at index 0, with usage."""
    calls = [
        chunk(tc(0, cid, "get_weather", json.dumps({"location": place}), "function"))
        for cid, place in PLACES
    ]
    last = chunk(finish="tool_calls")
    last["usage"] = {"prompt_tokens": 40, "completion_tokens": 30, "total_tokens": 70}
    return sse(chunk(content=None, role="assistant"), *calls, last)


def _stream(litellm: Any, server: ReplayServer, messages: list[dict[str, Any]]) -> list[Any]:
    """LiteLLM's own streaming call to the fake server: its ``ModelResponseStream`` chunks."""
    response = litellm.completion(
        model="openai/llama-3.3-70b-versatile",
        api_base=server.base_url,
        api_key="test",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_retries=0,
    )
    return list(response)


def test_fsm_keeps_the_three_calls_stream_chunk_builder_merges(litellm: Any) -> None:
    from litellm.types.utils import ModelResponse, ModelResponseStream

    question = [{"role": "user", "content": "Weather in San Francisco, Tokyo and Paris?"}]
    answer = sse(chunk(content="72F, 10C and 22C."), chunk(finish="stop"))
    results = [json.dumps({"location": p, "weather": WEATHER[p]}) for _, p in PLACES]
    script = [ReplayTurn(_groq_stream()), ReplayTurn(answer, expect_tool_results=results)]
    with ReplayServer(script) as server:
        chunks = _stream(litellm, server, question)
        assert chunks and all(isinstance(c, ModelResponseStream) for c in chunks)

        # LiteLLM's builder: one call, the last id, the arguments run together (#7621)
        built = litellm.stream_chunk_builder(chunks)
        merged = built.choices[0].message.tool_calls
        assert [(c.id, c.function.arguments) for c in merged] == [
            ("call_9q1m", "".join(json.dumps({"location": p}) for _, p in PLACES))
        ], "LiteLLM no longer merges the calls (#7621 fixed?): update docs/guides/litellm.md"

        # fsm on the same chunk objects: three calls, ids and arguments as sent
        result = fsm.parse(chunks)
        assert result.complete
        completion = result.to_chat_completion()
        message = completion["choices"][0]["message"]
        assert [(c["id"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
            (cid, json.dumps({"location": place})) for cid, place in PLACES
        ]
        assert completion["choices"][0]["finish_reason"] == "tool_calls"
        assert completion["usage"]["total_tokens"] == 70
        # a drop-in: LiteLLM's own response type takes it
        typed = ModelResponse(**completion)
        assert [c.id for c in typed.choices[0].message.tool_calls] == [c for c, _ in PLACES]

        # sending LiteLLM's merged message back: the server refuses it as no correct loop's
        tool_results = [
            {"role": "tool", "tool_call_id": c["id"], "content": r}
            for c, r in zip(message["tool_calls"], results, strict=True)
        ]
        wrong = built.choices[0].message.model_dump(exclude_none=True)
        wrong_results = [{"role": "tool", "tool_call_id": "call_9q1m", "content": results[2]}]
        with pytest.raises(litellm.BadRequestError):
            _stream(litellm, server, [*question, wrong, *wrong_results])
        assert len(server.failures) == 1

        # fsm's message and one result per call: the second turn sees the first
        second = _stream(litellm, server, [*question, message, *tool_results])
        final = fsm.parse(second).to_chat_completion()
        assert final["choices"][0]["message"]["content"] == "72F, 10C and 22C."
        assert len(server.failures) == 1
        sent = server.requests[-1]["messages"]
        assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == [c for c, _ in PLACES]


def _chunk_dicts(data: bytes) -> list[dict[str, Any]]:
    chunks = []
    for line in data.decode().splitlines():
        if not line.startswith("data:"):
            continue
        try:
            decoded = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(decoded, dict) and "choices" in decoded:
            chunks.append(decoded)
    return chunks


def _turns(result: fsm.ParseResult) -> list[dict[str, Any]]:
    turns = []
    for turn in result.turns:
        shown = turn.to_json()
        shown["tool_calls"] = [
            {k: v for k, v in call.items() if k != "index"} for call in shown["tool_calls"]
        ]
        turns.append(shown)
    return turns


@pytest.mark.parametrize("name", corpus_params())
def test_litellm_chunk_objects_parse_as_their_bytes(litellm: Any, name: str | None) -> None:
    """Every recording's chunks made LiteLLM ``ModelResponseStream`` objects: fsm.parse takes
    them and gives the turns the bytes give (LiteLLM reshapes ``usage`` into its own type, so
    that is compared by its counts), and the built completion is a LiteLLM ``ModelResponse``."""
    from litellm.types.utils import ModelResponse, ModelResponseStream

    data = corpus_bytes(need(name))
    objects = [ModelResponseStream(**c) for c in _chunk_dicts(data)]
    from_bytes, from_objects = fsm.parse(data), fsm.parse(objects)
    if from_bytes.end_how == "error":
        # an error event is no chunk (LiteLLM raises it): without it the objects' stream ends
        # at EOF, incomplete too, never a complete turn by accident
        assert not from_objects.complete
        return
    # LiteLLM's delta type sets index 0 on a call the provider sent without one (Mistral):
    # the calls are compared without it (fsm routes index-0 calls with new ids apart anyway)
    assert _turns(from_objects) == _turns(from_bytes)
    assert (from_objects.response_id, from_objects.model, from_objects.created) == (
        from_bytes.response_id,
        from_bytes.model,
        from_bytes.created,
    )
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    if from_bytes.usage is not None:
        assert from_objects.usage is not None
        assert [from_objects.usage.get(k) for k in counts] == [
            from_bytes.usage.get(k) for k in counts
        ]
    if not from_bytes.complete:
        return
    built = from_objects.to_chat_completion()
    assert built["choices"] == from_bytes.to_chat_completion()["choices"]
    if built["model"] is not None:
        typed = ModelResponse(**built)
        assert [
            (c.id, c.function.arguments) for c in typed.choices[0].message.tool_calls or []
        ] == [(c.id, c.raw_arguments) for c in from_bytes.turns[0].tool_calls]
