"""The recording proxy (issue 30, item 5): a real Starlette app served by uvicorn on a port,
between the official ``openai`` client and ``fsm.replay.ReplayServer`` (the provider), recording
into the store on each engine (the async store: SQLite through aiosqlite, PostgreSQL through
psycopg; and the sync store, whose calls run in a worker thread).

Each test checks what the client received byte for byte against what the provider sent, what
the store holds afterwards (history, the ledger's pending turn, attempts) and that ``fsm audit
check`` finds nothing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm import parse
from fsm.cli.main import cli
from fsm.replay import EXAMPLES_DIR, ReplayServer, ReplayTurn
from fsm.store import ConversationStore
from tests.helpers import chunk, require_framework, sse
from tests.helpers.agent import USER
from tests.helpers.faults import free_port

FIRST = EXAMPLES_DIR / "parallel_add_multiply.sse"
FINAL = EXAMPLES_DIR / "final_answer.sse"
CUT = EXAMPLES_DIR / "cut_off_call.sse"
RESPONSES_FIRST = EXAMPLES_DIR / "responses_add_multiply.sse"
RESPONSES_FINAL = EXAMPLES_DIR / "responses_final_answer.sse"
ANTHROPIC_FIRST = EXAMPLES_DIR / "anthropic_add_multiply.sse"
ANTHROPIC_FINAL = EXAMPLES_DIR / "anthropic_final_answer.sse"
CID = "conv-proxy-1"
TOOLS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


@pytest.fixture
def url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


def _app(store_url: str, upstream: str, *, sync_store: bool = False) -> Any:
    """The proxy under test: what docs/guides/recording-proxy.md shows, with either store."""
    require_framework("starlette", "proxy")
    httpx = require_framework("httpx", "proxy")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from fsm.integrations.proxy import ProxyHistoryError, record_request, recording_response
    from fsm.store.aio import AsyncConversationStore

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if sync_store:
            with ConversationStore(store_url) as store:
                app.state.store = store
                async with httpx.AsyncClient(timeout=30) as http:
                    app.state.http = http
                    yield
        else:
            async with AsyncConversationStore(store_url) as astore:
                app.state.store = astore
                async with httpx.AsyncClient(timeout=30) as http:
                    app.state.http = http
                    yield

    async def chat(request: Request) -> Response:
        body = await request.json()
        cid = request.headers["x-conversation-id"]
        store = request.app.state.store
        try:
            seq = await record_request(store, cid, body["messages"])
        except ProxyHistoryError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=409)
        http = request.app.state.http
        upstream_request = http.build_request(
            "POST", upstream, content=await request.body(), headers={"accept-encoding": "identity"}
        )
        answer = await http.send(upstream_request, stream=True)
        return recording_response(answer, store, cid, expected_seq=seq)

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan
    )


@contextmanager
def _serve(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free port of 127.0.0.1, in a thread; its base URL."""
    uvicorn = require_framework("uvicorn", "frameworks")
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(20)


@contextmanager
def _proxied(url: str, script: list[ReplayTurn], **app: Any) -> Iterator[tuple[ReplayServer, str]]:
    """The provider (a ReplayServer sending its recordings' exact bytes) and the proxy's URL."""
    with (
        ReplayServer(script, response_ids="recorded") as provider,
        _serve(_app(url, provider.chat_url, **app)) as base,
    ):
        yield provider, base


def _client(base_url: str) -> Any:
    openai = require_framework("openai", "openai")
    return openai.OpenAI(
        base_url=base_url,
        api_key="test",
        max_retries=0,
        default_headers={"x-conversation-id": CID},
    )


def _run_tools(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": str(
                TOOLS[call["function"]["name"]](**json.loads(call["function"]["arguments"]))
            ),
        }
        for call in message["tool_calls"]
    ]


def _check_clean(url: str) -> None:
    result = CliRunner().invoke(cli, ["audit", "check", "--db", url])
    assert result.exit_code == 0, result.output
    assert "no violations" in result.output


def _history(url: str) -> tuple[list[Any], Any, list[Any]]:
    with ConversationStore(url) as store:
        return store.history(CID), store.pending(CID), store.attempts(CID)


def test_a_tool_round_through_the_proxy(url: str) -> None:
    _tool_round(url, sync_store=False)


@pytest.mark.parametrize("engine_name", ["sqlite"])
def test_a_tool_round_with_the_sync_store(url: str) -> None:
    """The sync store's calls run in a worker thread (one engine is enough for that path)."""
    _tool_round(url, sync_store=True)


def _tool_round(url: str, *, sync_store: bool) -> None:
    script = [ReplayTurn(FIRST), ReplayTurn(FINAL, expect_tool_results=["6912", "408"])]
    with _proxied(url, script, sync_store=sync_store) as (provider, base):
        client = _client(base)
        messages: list[Any] = [{"role": "system", "content": "Use the tools."}, USER]
        # 1: the raw bytes the client gets are the provider's, unchanged
        with client.chat.completions.with_streaming_response.create(
            model="demo-model-1", messages=messages, stream=True
        ) as response:
            received = b"".join(response.iter_bytes())
            assert response.headers["content-type"].startswith("text/event-stream")
        assert received == FIRST.read_bytes()
        first = parse(received).turn(0).to_message()
        assert [c["function"]["name"] for c in first["tool_calls"]] == ["add", "multiply"]
        history, pending, attempts = _history(url)
        assert history == messages  # the turn is not history yet: it is pending
        assert pending is not None and pending.state == "pending"
        assert [e.state for e in pending.executions] == ["started", "started"]
        assert pending.at_seq == 2 and attempts == []
        # 2: the tool results close the pending turn; the answer is committed
        messages += [first, *_run_tools(first)]
        stream = client.chat.completions.create(
            model="demo-model-1", messages=messages, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert provider.failures == []
    assert len(provider.requests) == 2
    final = parse(FINAL.read_bytes()).turn(0).to_message()
    assert text == final["content"] and text
    history, pending, attempts = _history(url)
    assert pending is None and attempts == []
    assert [m["role"] for m in history] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    assert history[2]["tool_calls"] == first["tool_calls"]
    assert [m["content"] for m in history[3:5]] == ["6912", "408"]
    assert history[5]["content"] == final["content"]
    _check_clean(url)


def test_a_client_that_disconnects_leaves_an_attempt(url: str) -> None:
    data = FIRST.read_bytes()
    hold = data.index(b'"arguments"', len(data) // 2)  # inside the second call's arguments
    with _proxied(url, [ReplayTurn(FIRST, hold_at=hold)]) as (provider, base):
        client = _client(base)
        with client.chat.completions.with_streaming_response.create(
            model="demo-model-1", messages=[USER], stream=True
        ) as response:
            got = b""
            for piece in response.iter_bytes():
                got += piece
                if len(got) >= hold // 2:
                    break  # the browser tab closes: the connection drops mid-stream
        deadline = time.monotonic() + 20
        while True:
            history, pending, attempts = _history(url)
            if attempts or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        provider.release()
    assert data.startswith(got)
    assert history == [USER] and pending is None  # never a half turn, nothing pending
    assert len(attempts) == 1
    assert "client disconnected" in json.dumps(attempts[0], default=str)
    _check_clean(url)


def test_a_truncated_call_is_an_attempt_and_the_bytes_still_pass(url: str) -> None:
    with _proxied(url, [ReplayTurn(CUT)]) as (_provider, base):
        client = _client(base)
        with client.chat.completions.with_streaming_response.create(
            model="demo-model-1", messages=[USER], stream=True
        ) as response:
            received = b"".join(response.iter_bytes())
    assert received == CUT.read_bytes()
    history, pending, attempts = _history(url)
    assert history == [USER] and pending is None
    assert len(attempts) == 1 and "incomplete" in json.dumps(attempts[0], default=str)
    _check_clean(url)


def test_a_request_that_does_not_answer_the_pending_calls_is_refused(url: str) -> None:
    script = [ReplayTurn(FIRST), ReplayTurn(FINAL, check=False)]
    with _proxied(url, script) as (provider, base):
        client = _client(base)
        with client.chat.completions.with_streaming_response.create(
            model="demo-model-1", messages=[USER], stream=True
        ) as response:
            first = parse(b"".join(response.iter_bytes())).turn(0).to_message()
        openai = require_framework("openai", "openai")
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="demo-model-1",
                messages=[USER, first, _run_tools(first)[0]],  # multiply's result missing
                stream=True,
            )
    assert caught.value.status_code == 409
    assert "does not answer the tool call(s)" in str(caught.value)
    history, pending, _attempts = _history(url)
    assert history == [USER] and pending is not None  # still pending, nothing half written
    assert len(provider.requests) == 1


def test_record_stream_over_a_plain_iterator(url: str) -> None:
    """``record_stream`` takes any async iterator of bytes: a response cut into 7-byte pieces is
    forwarded piece for piece and committed when it ends."""
    require_framework("anyio", "proxy")
    from fsm.integrations.proxy import record_request, record_stream
    from fsm.store.aio import AsyncConversationStore

    data = FINAL.read_bytes()
    pieces = [data[i : i + 7] for i in range(0, len(data), 7)]

    async def upstream() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async def body() -> list[bytes]:
        async with AsyncConversationStore(url) as store:
            seq = await record_request(store, CID, [USER])
            return [p async for p in record_stream(upstream(), store, CID, expected_seq=seq)]

    assert asyncio.run(body()) == pieces
    history, _pending, attempts = _history(url)
    assert [m["role"] for m in history] == ["user", "assistant"] and attempts == []
    _check_clean(url)


@pytest.mark.parametrize("end", ["error_at", "reset_at"])
def test_a_provider_that_fails_mid_stream_leaves_an_attempt(url: str, end: str) -> None:
    """An error event is forwarded and recorded as an attempt; a provider that drops the
    connection is an attempt too, and the client's response breaks as the provider's did."""
    data = FIRST.read_bytes()
    at = data.index(b'"arguments"', len(data) // 2)
    with _proxied(url, [ReplayTurn(FIRST, **{end: at})]) as (_provider, base):
        client = _client(base)
        received = b""
        try:
            with client.chat.completions.with_streaming_response.create(
                model="demo-model-1", messages=[USER], stream=True
            ) as response:
                for piece in response.iter_bytes():
                    received += piece
            broke = False
        except Exception:  # the proxy's response ends without its last chunk
            broke = True
    history, pending, attempts = _history(url)
    assert history == [USER] and pending is None
    assert len(attempts) == 1
    if end == "error_at":
        assert not broke and received.startswith(data[:at]) and b"event: error" in received
        assert "failed this stream on purpose" in json.dumps(attempts[0], default=str)
    else:
        assert broke and data[:at].startswith(received)
        assert "the upstream failed" in json.dumps(attempts[0], default=str)
    _check_clean(url)


def _pieces(data: bytes) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 64):
            yield data[start : start + 64]

    return gen()


def test_a_legacy_function_call_and_the_other_stream_formats(url: str) -> None:
    """A legacy ``function_call`` is closed by the ``function`` message that answers it; a
    Responses or Anthropic stream is recorded as its turn (the request side stays Chat)."""
    require_framework("anyio", "proxy")
    from fsm.integrations.proxy import record_request, record_stream
    from fsm.store.aio import AsyncConversationStore

    legacy = sse(
        chunk(function_call={"name": "get_weather", "arguments": '{"city": "Paris"}'}),
        chunk(finish="function_call"),
    )

    async def body() -> dict[str, list[Any]]:
        histories = {}
        async with AsyncConversationStore(url) as store:
            for cid, first, final in [
                ("legacy", legacy, FINAL),
                ("responses", RESPONSES_FIRST.read_bytes(), RESPONSES_FINAL),
                ("anthropic", ANTHROPIC_FIRST.read_bytes(), ANTHROPIC_FINAL),
            ]:
                seq = await record_request(store, cid, [USER])
                sent = [
                    p async for p in record_stream(_pieces(first), store, cid, expected_seq=seq)
                ]
                assert b"".join(sent) == first
                pending = await store.pending(cid)
                assert pending is not None
                call = pending.calls[0]
                messages = [USER, pending.to_message()]
                if call.legacy:
                    messages.append({"role": "function", "name": call.name, "content": "sunny"})
                else:
                    messages += [
                        {"role": "tool", "tool_call_id": c.id, "content": str(n)}
                        for n, c in enumerate(pending.calls)
                    ]
                seq = await record_request(store, cid, messages)
                assert await store.pending(cid) is None
                data = final.read_bytes()
                async for _ in record_stream(_pieces(data), store, cid, expected_seq=seq):
                    pass
                histories[cid] = await store.history(cid)
        return histories

    histories = asyncio.run(body())
    assert [m["role"] for m in histories["legacy"]] == [
        "user",
        "assistant",
        "function",
        "assistant",
    ]
    assert histories["legacy"][2]["content"] == "sunny"
    for cid in ("responses", "anthropic"):
        roles = [m["role"] for m in histories[cid]]
        assert roles == ["user", "assistant", "tool", "tool", "assistant"], cid
    _check_clean(url)


def test_a_stream_that_is_not_valid_is_forwarded_whole_and_recorded_as_an_attempt(
    url: str,
) -> None:
    require_framework("anyio", "proxy")
    from fsm.integrations.proxy import record_request, record_stream
    from fsm.store.aio import AsyncConversationStore

    data = FIRST.read_bytes()
    broken = data[: len(data) // 2].rsplit(b"\n\n", 1)[0] + b"\n\ndata: {not json\n\n" + b"x" * 100

    async def body() -> bytes:
        async with AsyncConversationStore(url) as store:
            seq = await record_request(store, CID, [USER])
            pieces = record_stream(_pieces(broken), store, CID, expected_seq=seq)
            return b"".join([p async for p in pieces])

    assert asyncio.run(body()) == broken  # every byte still goes to the client
    history, pending, attempts = _history(url)
    assert history == [USER] and pending is None
    assert len(attempts) == 1 and "protocol error" in json.dumps(attempts[0], default=str)
    _check_clean(url)


def test_an_error_status_is_forwarded_as_it_is_and_not_recorded(url: str) -> None:
    openai = require_framework("openai", "openai")
    turn = ReplayTurn(FIRST, status=429, error_message="slow down")
    with _proxied(url, [turn]) as (_provider, base), pytest.raises(openai.APIStatusError) as caught:
        _client(base).chat.completions.create(model="demo-model-1", messages=[USER], stream=True)
    assert caught.value.status_code == 429 and "slow down" in str(caught.value)
    history, pending, attempts = _history(url)
    assert history == [USER] and pending is None and attempts == []
