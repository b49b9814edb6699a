"""fsm.clients over real HTTP on 127.0.0.1: the openai SDK (sync and async) and httpx (sync and
async) against fsm.testing.ReplayServer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest

from fsm import (
    Event,
    ParseResult,
    RemoteProtocolError,
    StreamEnded,
    StreamParser,
    ToolCallAborted,
    ToolCallOpened,
)
from fsm.api import parse_file, parse_text
from fsm.clients import (
    AsyncEventIterator,
    EventIterator,
    HTTPStatusError,
    UnsupportedStreamError,
    aiter_httpx_events,
    aiter_openai_events,
    iter_httpx_events,
    iter_openai_events,
)
from fsm.errors import FsmError
from fsm.testing import EXAMPLES_DIR, ReplayServer, ReplayTurn, demo_script
from tests.helpers import CORPUS, corpus_params, require_corpus

T = TypeVar("T")

DEMO = EXAMPLES_DIR / "parallel_add_multiply.sse"
DEMO_BYTES = DEMO.read_bytes()
USER = {"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}
REQUEST = {"model": "demo-model-1", "messages": [USER], "stream": True}

#: Streams the openai SDK cannot hand over whole: its SSE decoder raises json.JSONDecodeError on
#: watsonx's final data-less ``event: close`` (fsm ignores it), after every chunk arrived.
SDK_RAISES_ON = {"watsonx/watsonx-mistral-large_name_on_second_delta_event_id_fields.sse"}

#: "openai": the SDK's parsed Stream; "openai-raw": the APIResponse of with_streaming_response
#: (raw bytes); "openai-helper": the ChatCompletionStream of chat.completions.stream() (its raw
#: bytes); "httpx": an httpx response. Each has an async twin.
HELPERS = [
    "openai",
    "async-openai",
    "openai-raw",
    "async-openai-raw",
    "openai-helper",
    "async-openai-helper",
    "httpx",
    "async-httpx",
]
#: the helpers whose bytes fsm reads itself (the others get the SDK's parsed chunks)
RAW = {h for h in HELPERS if not h.endswith("openai")}


# -- one client of each kind, one event loop for the async ones -----------------------------------
class Clients:
    """The four real clients, created once (building an SSL context costs ~40 ms each)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.openai = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="t", max_retries=0)
        self.httpx = httpx.Client(timeout=10)
        self.async_openai, self.async_httpx = self.run(self._make_async())

    @staticmethod
    async def _make_async() -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
        return (
            openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="t", max_retries=0),
            httpx.AsyncClient(timeout=10),
        )

    def run(self, coro: Awaitable[T]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(10):
                return await coro

        return self.loop.run_until_complete(bounded())

    def close(self) -> None:
        self.openai.close()
        self.httpx.close()
        self.run(self.async_openai.close())
        self.run(self.async_httpx.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def clients() -> Iterator[Clients]:
    c = Clients()
    yield c
    c.close()


class Outcome:
    """What one helper made of one response: every event, the result, what was raised."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.result: ParseResult | None = None
        self.error: BaseException | None = None
        self.iterator: EventIterator | AsyncEventIterator | None = None


def consume(
    helper: str,
    clients: Clients,
    server: ReplayServer,
    request: dict[str, Any] = REQUEST,
    **kwargs: Any,
) -> Outcome:
    """Send ``request`` with ``helper``'s client and parse the streamed answer with fsm.clients
    (``kwargs`` go to the fsm helper)."""
    out = Outcome()
    if helper.startswith("async-"):
        clients.run(_aconsume(helper, clients, server, out, request, kwargs))
    else:
        with _open(helper, clients, server, request) as source:
            if helper == "httpx":
                out.iterator = iter_httpx_events(source, **kwargs)
            else:
                out.iterator = iter_openai_events(source, **kwargs)
            try:
                for event in out.iterator:
                    out.events.append(event)
            except Exception as exc:
                out.error = exc
    assert out.iterator is not None
    out.result = out.iterator.result()
    return out


def _open(
    helper: str, clients: Clients, server: ReplayServer, request: dict[str, Any]
) -> contextlib.AbstractContextManager[Any]:
    """The streamed response of ``helper``'s kind, to enter."""
    if helper == "httpx":
        return clients.httpx.stream("POST", server.chat_url, json=request)
    sdk = clients.openai.with_options(base_url=server.base_url)
    if helper == "openai":
        stream: contextlib.AbstractContextManager[Any] = sdk.chat.completions.create(**request)
        return stream
    if helper == "openai-raw":
        return sdk.chat.completions.with_streaming_response.create(**request)
    assert helper == "openai-helper"
    _require_stream_helper(sdk)
    return sdk.chat.completions.stream(**{k: v for k, v in request.items() if k != "stream"})


def _require_stream_helper(sdk: Any) -> None:
    if not hasattr(sdk.chat.completions, "stream"):  # openai < 1.40.0 had it under .beta
        pytest.skip(f"openai {openai.__version__} has no chat.completions.stream()")


def _aopen(
    helper: str, clients: Clients, server: ReplayServer, request: dict[str, Any]
) -> contextlib.AbstractAsyncContextManager[Any]:
    """The async twin of :func:`_open`."""
    if helper == "async-httpx":
        return clients.async_httpx.stream("POST", server.chat_url, json=request)
    sdk = clients.async_openai.with_options(base_url=server.base_url)
    if helper == "async-openai":

        @contextlib.asynccontextmanager
        async def parsed() -> AsyncIterator[Any]:
            async with await sdk.chat.completions.create(**request) as stream:
                yield stream

        return parsed()
    if helper == "async-openai-raw":
        return sdk.chat.completions.with_streaming_response.create(**request)
    assert helper == "async-openai-helper"
    _require_stream_helper(sdk)
    return sdk.chat.completions.stream(**{k: v for k, v in request.items() if k != "stream"})


async def _aconsume(
    helper: str,
    clients: Clients,
    server: ReplayServer,
    out: Outcome,
    request: dict[str, Any],
    kwargs: dict[str, Any],
) -> None:
    async with _aopen(helper, clients, server, request) as source:
        if helper == "async-httpx":
            out.iterator = aiter_httpx_events(source, **kwargs)
        else:
            out.iterator = aiter_openai_events(source, **kwargs)
        try:
            async for event in out.iterator:
                out.events.append(event)
        except Exception as exc:
            out.error = exc


def summary(result: ParseResult) -> dict[str, Any]:
    """Everything a turn means for history, per choice."""
    return {
        "complete": result.complete,
        "choices": [
            {
                "index": t.index,
                "complete": t.complete,
                "finish_reason": t.finish_reason,
                "content": t.content,
                "reasoning": t.reasoning,
                "refusal": t.refusal,
                "tool_calls": [
                    (
                        c.position,
                        c.index,
                        c.id,
                        c.type,
                        c.name,
                        c.arguments,
                        c.state.value,
                        c.reason,
                    )
                    for c in t.tool_calls
                ],
            }
            for t in result.turns
        ],
    }


def final_events(events: list[Event]) -> list[Event]:
    return [e for e in events if isinstance(e, StreamEnded)]


# -- every corpus stream through every helper --------------------------------------------------------
@pytest.mark.parametrize("helper", HELPERS)
@pytest.mark.parametrize("name", corpus_params())
def test_corpus_stream_over_http_matches_parse_file(
    name: str | None, helper: str, clients: Clients
) -> None:
    require_corpus()
    assert name is not None
    expected = parse_file(CORPUS / name)
    with ReplayServer([ReplayTurn(CORPUS / name)], response_ids="recorded") as server:
        out = consume(helper, clients, server)
    assert server.failures == []
    assert out.result is not None
    got = out.result
    assert len(final_events(out.events)) == 1, "the last event is the one StreamEnded"
    assert out.events[-1] == final_events(out.events)[0]

    if helper in RAW:
        # raw bytes: exactly what fsm reads from the file, anomalies and ending included
        assert out.error is None
        assert got.to_json() == expected.to_json()
        assert (got.end_how, got.end_reason) == (expected.end_how, expected.end_reason)
        return

    if name in SDK_RAISES_ON:
        assert isinstance(out.error, json.JSONDecodeError)
        assert not got.complete
        assert got.end_how == "aborted"
        assert got.end_reason is not None and got.end_reason.startswith("JSONDecodeError")
        for turn in got.turns:
            assert all(c.state.value == "aborted" for c in turn.tool_calls)
        return

    assert summary(got) == summary(expected)
    if expected.end_how == "error":
        # the SDK raised on the error payload; fsm still ends the stream with its message
        assert isinstance(out.error, openai.APIError)
        assert (got.end_how, got.end_reason) == ("error", expected.end_reason)
    else:
        assert out.error is None
        # the SDK swallows [DONE]: its normal end is fed as EOF
        assert got.end_how == "eof"


def test_sdk_raising_streams_are_still_in_the_corpus() -> None:
    require_corpus()
    for name in SDK_RAISES_ON:
        assert (CORPUS / name).is_file(), name


# -- cuts and failures -------------------------------------------------------------------------------
DONE_AT = DEMO_BYTES.index(b"data: [DONE]")
CUTS = {
    "no body": 0,
    "inside the first event": 30,
    "inside a tool-call event": DEMO_BYTES.index(b'"arguments":"\\": 12"') + 5,
    "after the finish_reason": DEMO_BYTES.index(b'"finish_reason":"tool_calls"') + 60,
    "before [DONE]": DONE_AT,
    "inside [DONE]": DONE_AT + 8,
}


@pytest.mark.parametrize("helper", HELPERS)
@pytest.mark.parametrize("cut", CUTS)
def test_cut_stream_is_never_complete(cut: str, helper: str, clients: Clients) -> None:
    offset = CUTS[cut]
    with ReplayServer([ReplayTurn(DEMO, cut_at=offset)]) as server:
        out = consume(helper, clients, server)
    assert out.result is not None
    result = out.result
    if helper not in RAW:
        # openai 2.x+ wraps transport errors; 1.x let httpx's own through
        assert isinstance(out.error, openai.APIConnectionError | httpx.RemoteProtocolError)
    else:  # the transport's own error (httpx's, or httpx2's under openai 3)
        assert type(out.error).__name__ == "RemoteProtocolError", repr(out.error)
    assert not result.complete
    assert result.end_how == "aborted"
    assert result.end_reason is not None
    assert "incomplete chunked read" in result.end_reason
    for turn in result.turns:
        assert not turn.complete
        for call in turn.tool_calls:
            assert (call.state.value, call.reason) == ("aborted", result.end_reason)
    ended = final_events(out.events)
    assert len(ended) == 1
    assert ended[0].how == "aborted"
    assert not ended[0].complete
    if offset > DEMO_BYTES.index(b"call_add"):
        assert [c.id for c in result.turn(0).tool_calls] == ["call_add_7Qz2", "call_mul_9Xk4"]
        assert sum(isinstance(e, ToolCallAborted) for e in out.events) == 2


@pytest.mark.parametrize("helper", HELPERS)
def test_error_event_mid_stream_aborts_with_its_message(helper: str, clients: Clients) -> None:
    at = DEMO_BYTES.index(b'"arguments":"12, "')
    turn = ReplayTurn(DEMO, error_at=at, error_message="upstream model crashed")
    with ReplayServer([turn]) as server:
        out = consume(helper, clients, server)
    assert out.result is not None
    result = out.result
    if helper not in RAW:
        assert isinstance(out.error, openai.APIError)
        assert out.error.message == "upstream model crashed"
    else:
        assert out.error is None  # fsm reads the error event itself: the stream just ends
    assert (result.end_how, result.end_reason) == ("error", "upstream model crashed")
    assert not result.complete
    calls = result.turn(0).tool_calls
    assert [(c.id, c.state.value, c.reason) for c in calls] == [
        ("call_add_7Qz2", "aborted", "upstream model crashed"),
        ("call_mul_9Xk4", "aborted", "upstream model crashed"),
    ]


@pytest.mark.parametrize("helper", HELPERS)
def test_dropped_socket_mid_stream_aborts(helper: str, clients: Clients) -> None:
    with ReplayServer([ReplayTurn(DEMO, reset_at=DEMO_BYTES.index(b"multiply"))]) as server:
        out = consume(helper, clients, server)
    assert out.result is not None
    result = out.result
    if helper not in RAW:
        assert isinstance(out.error, openai.APIConnectionError | httpx.TransportError)
    else:  # httpx's, or httpx2's under openai 3
        assert any(c.__name__ == "TransportError" for c in type(out.error).__mro__)
    assert not result.complete
    assert result.end_how == "aborted"
    assert result.end_reason is not None
    assert "Error" in result.end_reason
    for turn in result.turns:
        assert all(c.state.value == "aborted" for c in turn.tool_calls)


@pytest.mark.parametrize("helper", HELPERS)
def test_string_error_payload(helper: str, clients: Clients) -> None:
    """``{"error": "..."}``: the SDK raises with a generic message; fsm keeps the provider's."""
    data = DEMO_BYTES[: DEMO_BYTES.index(b"data: [DONE]")]
    data = data[: data.index(b"data: ", 2000)] + b'data: {"error": "overloaded"}\n\n'
    expected = parse_text(data)
    assert (expected.end_how, expected.end_reason) == ("error", "overloaded")
    with ReplayServer([ReplayTurn(data)]) as server:
        out = consume(helper, clients, server)
    assert out.result is not None
    assert summary(out.result) == summary(expected)
    assert (out.result.end_how, out.result.end_reason) == ("error", "overloaded")
    if helper not in RAW:
        assert isinstance(out.error, openai.APIError)
        assert out.error.message == "An error occurred during streaming"
    else:
        assert out.error is None


@pytest.mark.parametrize("helper", HELPERS)
def test_error_event_without_error_key_after_the_finish_is_still_an_error(
    helper: str, clients: Clients
) -> None:
    """The SDK yields ``event: error`` + ``{"message": ...}`` as an ordinary chunk; buffered
    chunks with a finish_reason then a clean end must not pass for success (openai-node #2046)."""
    data = DEMO_BYTES[: DEMO_BYTES.index(b"data: [DONE]")]
    data += b'event: error\ndata: {"message": "backend died", "code": 500}\n\n'
    expected = parse_text(data)
    assert (expected.end_how, expected.end_reason, expected.complete) == (
        "error",
        "backend died",
        False,
    )
    with ReplayServer([ReplayTurn(data)]) as server:
        out = consume(helper, clients, server)
    assert out.error is None  # neither the SDK nor fsm raises: the events say it
    assert out.result is not None
    assert summary(out.result) == summary(expected)
    assert (out.result.end_how, out.result.end_reason) == ("error", "backend died")
    assert [e.how for e in final_events(out.events)] == ["error"]


def test_sdk_chunk_with_chunk_fields_and_a_message_stays_a_chunk(clients: Clients) -> None:
    """Only something with none of a chunk's fields is taken for an unrecognised error."""
    data = b'data: {"id": "c1", "message": "hello", "choices": []}\n\ndata: [DONE]\n\n'
    with ReplayServer([ReplayTurn(data)], response_ids="recorded") as server:
        out = consume("openai", clients, server)
    assert out.result is not None
    assert out.result.end_how == "eof"
    assert out.result.response_id == "c1"


def test_invalid_json_from_httpx_raises_fsm_protocol_error(clients: Clients) -> None:
    with ReplayServer([ReplayTurn(b"data: {nope\n\n")]) as server:
        out = consume("httpx", clients, server)
    assert isinstance(out.error, RemoteProtocolError)
    assert out.result is not None
    assert out.result.error is out.error


# -- async cancellation ------------------------------------------------------------------------------
FIRST_CALL_EVENT_END = DEMO_BYTES.index(b"\n\n", DEMO_BYTES.index(b"tool_calls")) + 2


@pytest.mark.parametrize("helper", [h for h in HELPERS if h.startswith("async-")])
def test_cancelling_the_consumer_mid_stream_aborts_with_cancelled(
    helper: str, clients: Clients
) -> None:
    """The server stalls right after the first tool-call event (no sleep: it holds until
    released); the task is cancelled once it saw that event, while it waits for more."""

    async def scenario(server: ReplayServer) -> tuple[AsyncEventIterator, list[Event]]:
        seen: list[Event] = []
        opened = asyncio.Event()
        holder: list[AsyncEventIterator] = []

        async def consumer() -> None:
            # only the transport in a with block: the abort must come from the iterator itself
            async with AsyncClientStream(helper, clients, server, enter_events=False) as events:
                holder.append(events)
                async for event in events:
                    seen.append(event)
                    if isinstance(event, ToolCallOpened):
                        opened.set()

        task = asyncio.create_task(consumer())
        await opened.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return holder[0], seen

    with ReplayServer([ReplayTurn(DEMO, hold_at=FIRST_CALL_EVENT_END)]) as server:
        events, seen = clients.run(scenario(server))
    result = events.result()
    assert sum(isinstance(e, ToolCallOpened) for e in seen) == 1
    assert not any(isinstance(e, StreamEnded) for e in seen)  # cancelled: no more events
    assert (result.end_how, result.end_reason) == ("aborted", "cancelled")
    assert not result.complete
    assert not any(t.complete for t in result.turns)
    assert [(c.id, c.state.value, c.reason) for c in result.turn(0).tool_calls] == [
        ("call_add_7Qz2", "aborted", "cancelled")
    ]


@pytest.mark.parametrize("helper", [h for h in HELPERS if h.startswith("async-")])
def test_cancelled_while_not_reading_aborts_on_leaving_the_block(
    helper: str, clients: Clients
) -> None:
    """Cancelled while awaiting something else between events: ``async with`` aborts."""

    async def scenario(server: ReplayServer) -> AsyncEventIterator:
        holder: list[AsyncEventIterator] = []
        opened = asyncio.Event()

        async def consumer() -> None:
            async with AsyncClientStream(helper, clients, server) as events:
                holder.append(events)
                async for event in events:
                    if isinstance(event, ToolCallOpened):
                        opened.set()
                        await asyncio.Event().wait()  # e.g. a slow UI update

        task = asyncio.create_task(consumer())
        await opened.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return holder[0]

    with ReplayServer([ReplayTurn(DEMO)]) as server:
        result = clients.run(scenario(server)).result()
    assert (result.end_how, result.end_reason) == ("aborted", "cancelled")
    assert not result.complete


class AsyncClientStream:
    """``async with``: open the streamed response with the helper's client, yield the fsm
    iterator, close both."""

    def __init__(
        self, helper: str, clients: Clients, server: ReplayServer, *, enter_events: bool = True
    ) -> None:
        self.helper, self.clients, self.server = helper, clients, server
        self.enter_events = enter_events
        self._close: list[Callable[[], Awaitable[Any]]] = []

    async def __aenter__(self) -> AsyncEventIterator:
        source = _aopen(self.helper, self.clients, self.server, REQUEST)
        response = await source.__aenter__()
        self._close.append(lambda: source.__aexit__(None, None, None))
        if self.helper == "async-httpx":
            events = aiter_httpx_events(response)
        else:
            events = aiter_openai_events(response)
        self._events = events
        return await events.__aenter__() if self.enter_events else events

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self.enter_events:
                await self._events.__aexit__(*exc)
        finally:
            for close in self._close:
                await close()


# -- closing early -----------------------------------------------------------------------------------
@pytest.mark.parametrize("helper", HELPERS)
def test_breaking_out_early_aborts_with_closed(helper: str, clients: Clients) -> None:
    with ReplayServer([ReplayTurn(DEMO)]) as server:
        if helper.startswith("async-"):

            async def scenario() -> AsyncEventIterator:
                async with AsyncClientStream(helper, clients, server) as events:
                    async for event in events:
                        if isinstance(event, ToolCallOpened):
                            break
                return events

            events: EventIterator | AsyncEventIterator = clients.run(scenario())
        elif helper == "httpx":
            with clients.httpx.stream("POST", server.chat_url, json=REQUEST) as response:
                events = iter_httpx_events(response)
                for event in events:
                    if isinstance(event, ToolCallOpened):
                        break
                events.close()
        else:
            with _open(helper, clients, server, REQUEST) as stream:
                events = iter_openai_events(stream)
                with events:
                    for event in events:
                        if isinstance(event, ToolCallOpened):
                            break
    result = events.result()
    assert (result.end_how, result.end_reason) == ("aborted", "closed")
    assert [c.state.value for c in result.turn(0).tool_calls] == ["aborted"]


def test_exception_in_the_with_block_is_the_abort_reason(clients: Clients) -> None:
    with ReplayServer([ReplayTurn(DEMO)]) as server:
        sdk = clients.openai.with_options(base_url=server.base_url)
        with sdk.chat.completions.create(**REQUEST) as stream:
            events = iter_openai_events(stream)
            with pytest.raises(KeyError), events:
                for event in events:
                    if isinstance(event, ToolCallOpened):
                        raise KeyError("tool not found")
    assert events.result().end_reason == "KeyError: 'tool not found'"


def test_leaving_the_block_after_the_end_changes_nothing(clients: Clients) -> None:
    with (
        ReplayServer([ReplayTurn(DEMO)]) as server,
        clients.httpx.stream("POST", server.chat_url, json=REQUEST) as response,
    ):
        with iter_httpx_events(response) as events:
            assert isinstance(list(events)[-1], StreamEnded)
        events.close()
    assert events.result().complete
    assert events.result().end_how == "done"


# -- chat.completions.stream(): read through its bytes, or a typed error ------------------------------
def test_the_stream_helper_is_read_through_its_bytes(clients: Clients) -> None:
    """``with client.chat.completions.stream(...) as stream``: fsm reads the raw bytes of its
    response (it used to yield nothing at all), ``[DONE]`` included."""
    with ReplayServer([ReplayTurn(DEMO)], response_ids="recorded") as server:
        out = consume("openai-helper", clients, server)
    assert out.error is None and out.result is not None
    assert out.result.to_json() == parse_file(DEMO).to_json()
    assert out.result.end_how == "done" and out.result.complete


@pytest.mark.filterwarnings("ignore:coroutine 'AsyncCompletions.create' was never awaited")
def test_the_unentered_stream_manager_is_a_typed_error(clients: Clients) -> None:
    sdk = clients.openai.with_options(base_url="http://127.0.0.1:9/v1")
    _require_stream_helper(sdk)
    manager = sdk.chat.completions.stream(model="m", messages=[USER])
    with pytest.raises(UnsupportedStreamError, match="pass the stream it opens") as info:
        iter_openai_events(manager)
    assert isinstance(info.value, FsmError) and isinstance(info.value, TypeError)

    async def run() -> None:
        asdk = clients.async_openai.with_options(base_url="http://127.0.0.1:9/v1")
        amanager = asdk.chat.completions.stream(model="m", messages=[USER])
        with pytest.raises(UnsupportedStreamError, match="AsyncChatCompletionStreamManager"):
            aiter_openai_events(amanager)

    clients.run(run())


@pytest.mark.parametrize("helper", ["openai-helper", "async-openai-helper"])
def test_a_stream_helper_already_read_from_is_a_typed_error(helper: str, clients: Clients) -> None:
    with ReplayServer([ReplayTurn(DEMO)]) as server:
        if helper == "openai-helper":
            with _open(helper, clients, server, REQUEST) as stream:
                next(iter(stream))
                with pytest.raises(UnsupportedStreamError, match="already read from"):
                    iter_openai_events(stream)
        else:

            async def run() -> None:
                async with _aopen(helper, clients, server, REQUEST) as stream:
                    await anext(aiter(stream))
                    with pytest.raises(UnsupportedStreamError, match="already read from"):
                        aiter_openai_events(stream)

            clients.run(run())


def test_the_events_of_the_stream_helper_are_a_typed_error(clients: Clients) -> None:
    """Its events (``ChunkEvent``, ``ContentDeltaEvent``, ...) are not chunks: passing them
    one by one says so instead of yielding an empty result."""
    with (
        ReplayServer([ReplayTurn(DEMO)]) as server,
        _open("openai-helper", clients, server, REQUEST) as stream,
    ):
        events = iter_openai_events(iter(stream))
        with pytest.raises(UnsupportedStreamError, match=r"event \('chunk'\), not a chunk"):
            list(events)
    assert not events.result().complete
    assert events.result().end_reason == "closed"


# -- the parser, passed in or exposed ----------------------------------------------------------------
@pytest.mark.parametrize("helper", HELPERS)
def test_the_given_parser_is_fed(helper: str, clients: Clients) -> None:
    parser = StreamParser(repair_json=True)
    with ReplayServer([ReplayTurn(DEMO)]) as server:
        out = consume(helper, clients, server, parser=parser)
    assert out.iterator is not None
    assert out.iterator.parser is parser
    assert parser.turns[0].complete
    assert out.result is not None
    assert [c.name for c in out.result.turn(0).tool_calls] == ["add", "multiply"]


# -- HTTP status errors (httpx; the SDK raises its own before streaming) -----------------------------
@pytest.mark.parametrize("helper", ["httpx", "async-httpx"])
@pytest.mark.parametrize(
    ("status", "error_type"), [(400, "invalid_request_error"), (503, "server_error")]
)
def test_non_2xx_raises_a_typed_fsm_error(
    helper: str, status: int, error_type: str, clients: Clients
) -> None:
    turn = ReplayTurn(DEMO, status=status, error_message="model is overloaded")
    with ReplayServer([turn]) as server:
        out = consume(helper, clients, server)
    assert isinstance(out.error, HTTPStatusError)
    assert isinstance(out.error, FsmError)
    assert out.error.status_code == status
    assert out.error.message == "model is overloaded"
    assert out.error.error_type == error_type
    assert str(out.error) == f"HTTP {status}: model is overloaded"
    assert json.loads(out.error.body)["error"]["message"] == "model is overloaded"
    assert out.result is not None
    assert out.result.end_how == "aborted"
    assert out.result.end_reason == f"HTTP {status}: model is overloaded"
    assert out.events == []


class FakeResponse:
    def __init__(self, status: int, body: bytes, phrase: str = "Bad Gateway") -> None:
        self.status_code, self._body, self.reason_phrase = status, body, phrase

    def read(self) -> bytes:
        return self._body

    async def aread(self) -> bytes:
        return self._body

    def iter_bytes(self) -> Iterator[bytes]:
        raise AssertionError("a failed response's body is not a stream")

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        raise AssertionError("a failed response's body is not a stream")
        yield b""  # pragma: no cover


@pytest.mark.parametrize(
    ("body", "message", "code"),
    [
        (b'{"error": {"message": "bad key", "type": "auth", "code": 401}}', "bad key", "401"),
        (b'{"error": "quota exceeded"}', "quota exceeded", None),
        (
            b'{"message": "no such model", "code": "model_not_found"}',
            "no such model",
            "model_not_found",
        ),
        (b"<html>upstream timed out</html>", "<html>upstream timed out</html>", None),
        (b"[1, 2]", "[1, 2]", None),
        (b'{"error": 5}', '{"error": 5}', None),
        (b"", "Bad Gateway", None),
    ],
)
def test_error_message_comes_from_the_body(body: bytes, message: str, code: str | None) -> None:
    with pytest.raises(HTTPStatusError) as info:
        list(iter_httpx_events(FakeResponse(502, body)))
    assert (info.value.message, info.value.code) == (message, code)

    async def run() -> None:
        async for _ in aiter_httpx_events(FakeResponse(502, body)):
            pass  # pragma: no cover

    with pytest.raises(HTTPStatusError, match=re.escape(f"HTTP 502: {message}")):
        asyncio.run(run())


# -- the agent loop, through each helper --------------------------------------------------------------
@pytest.mark.parametrize("helper", HELPERS)
def test_demo_agent_loop_round_trips_byte_exact(helper: str, clients: Clients) -> None:
    results = {"add": "6912", "multiply": "408"}
    with ReplayServer(demo_script([results["add"], results["multiply"]])) as server:
        first = consume(helper, clients, server)
        assert first.result is not None
        message = first.result.turn(0).to_message()
        history = [USER, message] + [
            {"role": "tool", "tool_call_id": c["id"], "content": results[c["function"]["name"]]}
            for c in message["tool_calls"]
        ]
        second = consume(helper, clients, server, {**REQUEST, "messages": history})
    assert server.failures == []
    assert second.result is not None
    assert second.result.complete
    assert second.result.turn(0).content == "1234 + 5678 = 6912, and 12 \u00d7 34 = 408."


# -- lightness ---------------------------------------------------------------------------------------
def test_import_fsm_does_not_load_the_clients_or_the_sdk() -> None:
    code = (
        "import sys, json, fsm\n"
        "print(json.dumps([m for m in ('openai', 'httpx', 'httpx2', 'fsm.clients', 'fsm.testing')"
        " if m in sys.modules]))\n"
        "import fsm.clients\n"
        "print(json.dumps([m for m in ('openai', 'httpx', 'httpx2') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert [json.loads(line) for line in out.stdout.splitlines()] == [[], []]
