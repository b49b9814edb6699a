"""LiteLLM streams, fsm assembles: ``fsm.parse(chunks).to_chat_completion()`` in place of
``litellm.stream_chunk_builder(chunks)``, which runs parallel calls sent at one index together
(LiteLLM #7621).

The model is a local fake server (fsm's ``ReplayServer``) sending what Groq sends for three
parallel calls: each call whole in one chunk, all at ``index`` 0. LiteLLM streams it with its
own client; both builders get LiteLLM's own ``ModelResponseStream`` chunks. Then the turn is
committed with its results and the second request carries fsm's message back. Offline: LiteLLM
uses its bundled price map and downloads no tokenizer. ``python litellm_stream.py``
"""

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price map
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no tokenizer download

import litellm

import fsm
from fsm.replay import ReplayServer, ReplayTurn
from fsm.store import ConversationStore

litellm.suppress_debug_info = True
WEATHER = {"San Francisco": "18C", "Tokyo": "10C", "Paris": "22C"}


def sse(*chunks: dict) -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (body + "data: [DONE]\n\n").encode()


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {
        "id": "chatcmpl-7621",
        "object": "chat.completion.chunk",
        "created": 1764720000,
        "model": "llama-3.3-70b-versatile",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def call(cid: str, city: str) -> dict:
    arguments = json.dumps({"location": city})
    function = {"name": "get_weather", "arguments": arguments}
    return chunk(
        {"tool_calls": [{"index": 0, "id": cid, "type": "function", "function": function}]}
    )


calls = [call("call_785j", "San Francisco"), call("call_2b7k", "Tokyo"), call("call_9q1m", "Paris")]
first = sse(chunk({"role": "assistant"}), *calls, chunk({}, "tool_calls"))
final = sse(chunk({"content": "18C, 10C and 22C."}), chunk({}, "stop"))


def stream(server: ReplayServer, messages: list) -> list:
    """LiteLLM's own streaming call: its chunk objects."""
    response = litellm.completion(
        model="openai/llama-3.3-70b-versatile",
        api_base=server.base_url,
        api_key="not-needed",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    return list(response)


messages: list = [{"role": "user", "content": "Weather in San Francisco, Tokyo and Paris?"}]
with ReplayServer([ReplayTurn(first), ReplayTurn(final)]) as server:
    chunks = stream(server, messages)

    merged = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
    print(f"stream_chunk_builder: {len(merged)} call(s)")
    for c in merged:
        print(f"  {c.id} {c.function.arguments}")

    result = fsm.parse(chunks)  # LiteLLM's chunk objects, as they came
    if not result.complete:  # a cut stream: no completion to build, keep it for the audit
        raise SystemExit(f"incomplete: {result.turn().incomplete_reason}")
    completion = result.to_chat_completion()  # a plain dict; ModelResponse(**it) for LiteLLM's type
    message = completion["choices"][0]["message"]
    print(f"fsm: {len(message['tool_calls'])} call(s)")
    for c in message["tool_calls"]:
        print(f"  {c['id']} {c['function']['arguments']}")

    results = [WEATHER[json.loads(c.arguments)["location"]] for c in result.turn().tool_calls]
    with tempfile.TemporaryDirectory() as folder:
        store = ConversationStore(f"sqlite:///{Path(folder) / 'chat.db'}")
        store.create_conversation("c1")
        store.append("c1", messages)
        store.commit_turn("c1", result, results)  # the turn and one result per call, atomically
        history = store.history("c1")
        store.close()

    answer = fsm.parse(stream(server, history)).to_chat_completion()
    print("answer:", answer["choices"][0]["message"]["content"])
    # the server checked the second request: fsm's message and one result per call, in order
    assert server.failures == [], server.failures
