"""A chat endpoint for the Vercel AI SDK's ``useChat``: the server runs the model and the tools,
and streams each step to the browser as the AI SDK's UI message stream (protocol ``v1``), with
fsm deciding which tool calls are usable.

Needs ``pip install 'fsm-toolcalls[openai,proxy]'``. Offline: run ``fsm replay`` in another
terminal and paste the ``export`` lines it prints into this one. Then serve it (``uvicorn
vercel_ui_stream:app`` and point ``useChat``'s transport at ``/api/chat``), or run ``python
vercel_ui_stream.py``: it posts one question through httpx's in-process ASGI transport and
prints the parts the browser would get.
"""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from openai import AsyncOpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fsm import StreamParser
from fsm.integrations.vercel import (
    DONE,
    Part,
    UIMessageStreamEncoder,
    encode_sse,
    ui_message_response,
)


def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


TOOLS = {"add": add, "multiply": multiply}
TOOL_DEFINITIONS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in TOOLS
]
client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment


def question_of(body: dict[str, Any]) -> str:
    """The last user message's text (useChat sends UI messages: parts, not content)."""
    last = [m for m in body["messages"] if m["role"] == "user"][-1]
    return "".join(p["text"] for p in last["parts"] if p["type"] == "text")


def sse(parts: list[Part]) -> bytes:
    return b"".join(encode_sse(part) for part in parts)


async def answer(question: str) -> AsyncIterator[bytes]:
    """The agent loop, each model call a step of one UI message."""
    encoder = UIMessageStreamEncoder(message_id=f"msg-{uuid.uuid4().hex[:12]}")
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    yield sse(encoder.start())
    for _ in range(5):  # at most five model calls
        parser = StreamParser()
        yield sse(encoder.start_step())
        async with client.chat.completions.with_streaming_response.create(
            model="demo-model-1", messages=messages, tools=TOOL_DEFINITIONS, stream=True
        ) as response:
            async for data in response.iter_bytes():  # the provider's bytes, as they come
                yield sse(encoder.feed(parser.receive_data(data)))
        yield sse(encoder.feed(parser.receive_eof()))
        turn = parser.result().turn(0)
        if not turn.complete or not turn.tool_calls:
            break  # the answer, or a turn fsm will not act on (the UI shows why)
        messages.append(turn.to_message())
        for call in turn.tool_calls:
            result = TOOLS[call.name](**json.loads(call.arguments))
            yield sse(encoder.tool_output(call.id, result))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    if not encoder.ended:
        yield sse(encoder.finish())
    yield DONE


async def chat(request: Request) -> Response:
    return ui_message_response(answer(question_of(await request.json())))


app = Starlette(routes=[Route("/api/chat", chat, methods=["POST"])])


async def main() -> None:
    body = {
        "id": "chat-1",
        "messages": [
            {
                "id": "user-1",
                "role": "user",
                "parts": [{"type": "text", "text": "What are 1234 + 5678 and 12 x 34?"}],
            }
        ],
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
        response = await http.post("/api/chat", json=body)
    assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    parts = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    for part in parts:
        if part["type"] not in ("text-delta", "tool-input-delta", "reasoning-delta"):
            print(json.dumps(part))
    kinds = [p["type"] for p in parts]
    assert kinds.count("tool-input-available") == kinds.count("tool-output-available") == 2
    assert kinds[-2:] == ["finish-step", "finish"]


if __name__ == "__main__":
    asyncio.run(main())
