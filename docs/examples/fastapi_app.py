"""A FastAPI service: POST a message, get the agent's answer as server-sent events while the
model streams. Each complete turn is committed with its tool results in one transaction; if
the browser goes away mid-answer, the loop aborts the turn, records the attempt and commits
nothing, and the conversation stays valid for the next request.

Needs ``pip install 'fsm-toolcalls[openai,async]' fastapi``. Offline: run ``fsm replay`` in
another terminal and paste the ``export`` lines it prints into this one. Then serve it
(``uvicorn fastapi_app:app``), or try it with no server at all: ``python fastapi_app.py`` sends
one request through httpx's in-process ASGI transport.

The store opens when the service starts: a new SQLite file gets its schema; a database that is
not at fsm's revision (run ``fsm db upgrade --db URL`` when you deploy) stops the start-up with
``SchemaNotAtHeadError`` naming that command, instead of failing every request.
"""

import asyncio
import json
import os
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from openai import AsyncOpenAI
from pydantic import BaseModel

from fsm import ContentDelta, ToolCallOpened
from fsm.agent import TurnFailedError, arun_agent_loop
from fsm.store.aio import AsyncConversationStore

# in production: postgresql+psycopg://app@db.internal/app, upgraded by `fsm db upgrade`
DATABASE = os.environ.get("FSM_DB_URL", "sqlite:///service.db")


async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = {"add": add, "multiply": multiply}


class Message(BaseModel):
    content: str


@asynccontextmanager
async def lifespan(app: FastAPI):
    async with AsyncConversationStore(DATABASE) as store:  # checks the schema: refuses to start
        app.state.store = store
        app.state.client = AsyncOpenAI()
        app.state.running = set()  # keeps cancelled loops alive while they record the attempt
        yield
        await asyncio.gather(*app.state.running, return_exceptions=True)


app = FastAPI(lifespan=lifespan)


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


@app.post("/conversations/{cid}/messages")
async def post_message(cid: str, message: Message) -> StreamingResponse:
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.create_task(
        arun_agent_loop(
            app.state.client,
            app.state.store,
            cid,
            TOOLS,
            model="gpt-4o-mini",
            on_event=events.put_nowait,
            messages=[{"role": "user", "content": message.content}],
        )
    )
    app.state.running.add(loop)
    loop.add_done_callback(app.state.running.discard)
    loop.add_done_callback(lambda _: events.put_nowait(None))  # no more events

    first = await events.get()  # failed before the first event: an HTTP error, not a 200
    if first is None and not loop.cancelled() and (error := loop.exception()) is not None:
        # fsm's typed errors: a value it refuses (a conversation id too long) is a ValueError;
        # an unreachable or busy database is retryable (StoreUnavailableError, StoreBusyError)
        status = 422 if isinstance(error, ValueError) else 503
        raise HTTPException(status, f"{type(error).__name__}: {error}") from error

    async def body():
        event = first
        try:
            while event is not None:
                match event:
                    case ContentDelta(text=text):
                        yield sse({"text": text})
                    case ToolCallOpened(name=name):
                        yield sse({"tool": name})  # "Searching..." as soon as the name arrives
                event = await events.get()
            result = await loop  # done: no wait here
            yield sse({"done": result.status})
        except TurnFailedError as exc:  # cut, truncated, provider error: nothing in history
            yield sse({"error": exc.reason})
        except Exception as exc:  # the store or the provider failed mid-answer: say so
            yield sse({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            loop.cancel()  # the browser left: abort, record the attempt; a no-op once done

    return StreamingResponse(body(), media_type="text/event-stream")


async def try_it() -> None:
    """One request through the app in this process (what a browser would send)."""
    import httpx

    async with lifespan(app):  # what the server runs at start-up and shut-down
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
            response = await http.post(
                f"/conversations/{uuid.uuid4().hex}/messages",
                json={"content": "What is 1234 + 5678 and 12 * 34?"},
            )
    print(response.status_code, response.headers["content-type"])
    print(response.text)
    assert response.status_code == 200 and '"done": "completed"' in response.text


if __name__ == "__main__":
    asyncio.run(try_it())
