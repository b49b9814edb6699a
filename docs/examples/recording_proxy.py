"""A recording proxy: an agent talks to the model through this Starlette app, which forwards
the model's streamed bytes to it unchanged while fsm parses and records the conversation. The
agent runs its tools itself; the proxy keeps their turn pending in the tool ledger until the
agent's next request brings the results.

Needs ``pip install 'fsm-toolcalls[openai,async,proxy]' uvicorn``. Offline: run ``fsm replay``
in another terminal and paste the ``export`` lines it prints into this one (the proxy forwards
to ``$OPENAI_BASE_URL``). Then serve it (``uvicorn recording_proxy:app``), or run ``python
recording_proxy.py``: it serves the proxy on a free port, sends an agent's two requests
through it with the official ``openai`` client, and checks what was recorded.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from openai import OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fsm import parse
from fsm.integrations.proxy import ProxyHistoryError, record_request, recording_response
from fsm.store import ConversationStore, PendingTurnError
from fsm.store.aio import AsyncConversationStore

DATABASE = os.environ.get("FSM_DB_URL", "sqlite:///proxy.db")
PROVIDER = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
PROVIDER_KEY = os.environ["OPENAI_API_KEY"]  # the proxy holds the provider's key


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with AsyncConversationStore(DATABASE) as store, httpx.AsyncClient(timeout=60) as http:
        app.state.store, app.state.http = store, http
        yield


async def chat_completions(request: Request) -> Response:
    body = await request.json()
    conversation = request.headers.get("x-conversation-id")
    if not conversation:
        return JSONResponse({"error": {"message": "send x-conversation-id"}}, status_code=400)
    store = request.app.state.store
    try:
        # the tool results in the request close the pending turn; new messages are appended
        seq = await record_request(store, conversation, body["messages"])
    except (ProxyHistoryError, PendingTurnError) as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=409)
    http = request.app.state.http
    upstream = await http.send(
        http.build_request(
            "POST",
            PROVIDER,
            content=await request.body(),
            headers={
                "authorization": f"Bearer {PROVIDER_KEY}",
                "content-type": "application/json",
                "accept-encoding": "identity",
            },
        ),
        stream=True,
    )
    # the bytes go to the client as they come; the turn is recorded when the stream ends
    return recording_response(upstream, store, conversation, expected_seq=seq)


app = Starlette(
    routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])],
    lifespan=lifespan,
)


# -- the agent on the other side: the official openai client, its tools run by itself --------
def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


TOOLS = {"add": add, "multiply": multiply}


def agent(base_url: str, conversation: str) -> str:
    client = OpenAI(
        base_url=base_url,
        api_key="the-proxy-checks-its-own-users",
        default_headers={"x-conversation-id": conversation},
    )
    messages = [{"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}]
    while True:
        with client.chat.completions.with_streaming_response.create(
            model="demo-model-1", messages=messages, stream=True
        ) as response:
            turn = parse(b"".join(response.iter_bytes())).turn(0)  # the provider's own bytes
        messages.append(turn.to_message())
        if not turn.tool_calls:
            return turn.content or ""
        for call in turn.tool_calls:
            result = TOOLS[call.name](**json.loads(call.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})


def serve_in_background() -> tuple[uvicorn.Server, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}/v1"


if __name__ == "__main__":
    server, base_url = serve_in_background()
    conversation = f"demo-{uuid.uuid4().hex[:8]}"
    answer = agent(base_url, conversation)
    server.should_exit = True
    print("answer:", answer)
    with ConversationStore(DATABASE) as store:
        history = store.history(conversation)
        assert store.pending(conversation) is None  # the results closed the pending turn
    print("recorded:", [m["role"] for m in history])
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
    # fsm's own check of every conversation in the database
    subprocess.run([sys.executable, "-m", "fsm", "audit", "check", "--db", DATABASE], check=True)
