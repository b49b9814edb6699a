"""A pydantic-ai agent whose conversations live in fsm's store: ``FsmConversationStore`` is
pydantic-ai's ``ConversationStore`` over an fsm ``ConversationStore``, so each run's tool calls
and results are fsm turns the database checks, and the next run (here a second one, as a new
request of a web service would) continues from what fsm holds.

The model is pydantic-ai's ``OpenAIChatModel`` pointed at fsm's replay server, started here with
two scripted streams per run, so the program runs offline; point the provider at your real
``base_url`` instead. Needs ``pip install 'fsm-toolcalls[pydantic-ai]'`` (and the ``openai``
package, which pydantic-ai's OpenAI model uses). ``python pydantic_ai_store.py``
"""

import asyncio
import json
import tempfile
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.conversation import Conversation
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from fsm.integrations.pydantic_ai import FsmConversationStore
from fsm.replay import ReplayServer, ReplayTurn
from fsm.store import ConversationStore, audit


def stream(text=None, call=None):
    """A Chat Completions stream as a provider sends it: some text, then maybe one tool call
    ``(id, name, arguments)`` whose arguments arrive in pieces."""

    def chunk(delta, finish=None):
        body = {"id": "chatcmpl-demo", "object": "chat.completion.chunk", "model": "demo-model-1"}
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
        return f"data: {json.dumps(body)}\n\n"

    out = [chunk({"role": "assistant", "content": text or ""})]
    if call:
        call_id, name, arguments = call
        fn = {"name": name, "arguments": ""}
        out.append(chunk({"tool_calls": [{"index": 0, "id": call_id, "function": fn}]}))
        for i in range(0, len(arguments), 8):
            piece = {"index": 0, "function": {"arguments": arguments[i : i + 8]}}
            out.append(chunk({"tool_calls": [piece]}))
    out.append(chunk({}, "tool_calls" if call else "stop"))
    return ("".join(out) + "data: [DONE]\n\n").encode()


SCRIPT = [  # what the model answers, request by request (two per run: a call, then text)
    ReplayTurn(stream(call=("call_1", "add", '{"a":1234,"b":5678}'))),
    ReplayTurn(stream("1234 + 5678 = 6912."), expect_tool_results=["6912"]),
    ReplayTurn(stream("Adding one.", call=("call_2", "add", '{"a":6912,"b":1}'))),
    ReplayTurn(stream("6912 + 1 = 6913."), expect_tool_results=["6913"]),
]


async def main(db: Path, base_url: str) -> None:
    model = OpenAIChatModel("demo-model-1", provider=OpenAIProvider(base_url=base_url, api_key="-"))
    agent = Agent(model, instructions="Use the add tool for sums.")

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        return a + b

    async def streamed(_ctx, events):  # any handler makes agent.run stream
        async for _event in events:
            pass

    with ConversationStore(f"sqlite:///{db}") as fsm_store:
        store = FsmConversationStore(fsm_store)
        for prompt in ["What is 1234 + 5678?", "And plus one?"]:  # two requests, one conversation
            conversation = await store.load("chat-42") or Conversation(conversation_id="chat-42")
            result = await agent.run(
                prompt, conversation=conversation, event_stream_handler=streamed
            )
            entries = await store.save(result)  # a stale revision raises ConversationConflict
            print(f"{prompt!r} -> {result.output!r} ({len(entries)} messages saved)")

        print("\nwhat fsm holds (ready for any Chat Completions call):")
        for message in fsm_store.history("chat-42"):
            calls = [c["function"]["name"] for c in message.get("tool_calls") or []]
            print(f"  {message['role']:9} {message.get('content')!r} {calls or ''}")
        print("fsm audit check:", list(audit.check(fsm_store.engine)) or "clean")


with tempfile.TemporaryDirectory() as tmp, ReplayServer(SCRIPT) as server:
    asyncio.run(main(Path(tmp) / "chat.db", server.base_url))
    assert server.failures == [], server.failures  # every call went back with its result
