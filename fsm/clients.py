"""Real HTTP clients into :class:`~fsm.parser.StreamParser`: the ``openai`` SDK and ``httpx``.

Four helpers turn a live response into fsm events, feeding the parser as the data arrives::

    from openai import OpenAI
    from fsm.clients import iter_openai_events

    client = OpenAI()
    with client.chat.completions.with_streaming_response.create(
        model=..., messages=..., tools=..., stream=True
    ) as response:
        events = iter_openai_events(response)    # the raw bytes, parsed by fsm
        for event in events:
            ...                                  # ToolCallOpened, ToolCallFinished, ...
    turn = events.result().turn(0)               # or events.parser.turns[0]

* :func:`iter_openai_events` / :func:`aiter_openai_events`: what the ``openai`` SDK gives:

  - the ``APIResponse`` / ``AsyncAPIResponse`` of
    ``client.chat.completions.with_streaming_response.create(..., stream=True)`` (the
    recommended way, and what the agent loop uses): its raw bytes go to ``receive_data``, so
    fsm sees ``data: [DONE]``, event names (``event: error``) and every byte, and does not
    depend on how a given SDK version decodes SSE (about 2 us per chunk instead of ~70);
  - the ``ChatCompletionStream`` that ``with client.chat.completions.stream(...) as stream``
    opens: the raw bytes of its HTTP response, as above (before anything read from it; reading
    it with fsm uses it up). The manager itself (``client.chat.completions.stream(...)`` not
    entered) or a stream already read from raise :class:`UnsupportedStreamError`;
  - the SDK's parsed ``Stream`` / ``AsyncStream`` of ``ChatCompletionChunk``
    (``client.chat.completions.create(..., stream=True)``): each chunk goes to
    ``receive_chunk``, with the limits listed below.

* :func:`iter_httpx_events` / :func:`aiter_httpx_events`: an ``httpx`` streaming response (its
  raw bytes go to ``receive_data``; a non-2xx status raises :class:`HTTPStatusError`).

Each returns an :class:`EventIterator` (or :class:`AsyncEventIterator`): an iterator of events
that also holds the ``parser``. When the transport ends normally the parser gets
``receive_eof()``. When it raises (the connection dropped, the SDK raised on an error payload or
an undecodable event), the parser is aborted with a reason naming the error, the resulting final
events are yielded, and the error is re-raised: the result is never complete. A cancelled task
(``asyncio.CancelledError``) aborts with reason ``cancelled`` and re-raises at once. Closing the
iterator before the stream ended (``break``, ``close()``, leaving its ``with`` block) aborts with
reason ``closed``.

What the ``openai`` SDK's parsed ``Stream`` hides (it decodes SSE itself, so fsm only sees its
chunks; none of this applies to the raw bytes of ``with_streaming_response``):

* ``data: [DONE]`` is swallowed, so a normal end of the SDK's iteration is fed as
  ``receive_eof()``. A stream that sent ``[DONE]`` but no ``finish_reason`` therefore ends
  ``aborted`` (reason ``eof``) here, where fsm reading the bytes would call it complete: the
  safe direction.
* An error payload (``{"error": ...}`` data, with or without ``event: error``) makes the SDK raise
  ``openai.APIError``. The error object is handed to the parser as the chunk it was, so the result
  ends exactly as fsm reading the bytes would (``end_how == "error"``, every live call ``aborted``
  with the error's message), then the ``APIError`` is re-raised. The SDK drops any ``choices`` of
  that same chunk.
* An ``event: error`` whose data has no ``error`` key is yielded by the SDK as an ordinary
  chunk: the event name is lost. Left alone, chunks received before it plus the clean end that
  follows would make a complete turn. So a "chunk" with none of a chunk's top-level fields
  (``id``, ``object``, ``model``, ``choices``, ``usage``, ...) but a ``message`` string is taken
  for the error it is: the stream ends as an ``error`` with that message.
* An event with empty data (watsonx's final data-less ``event: close``) makes the SDK raise
  ``json.JSONDecodeError``, even after every chunk arrived: the stream ends ``aborted`` with that
  reason (fsm reading the bytes ignores such an event).

This module imports neither ``openai`` nor ``httpx`` (``import fsm`` stays light, and
``fsm/__init__.py`` does not import this module): it works on whatever objects it is given.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
)
from types import TracebackType
from typing import Any, Final, Protocol

from fsm.errors import FsmError
from fsm.events import Event
from fsm.parser import ParseResult, StreamParser

__all__ = [
    "CANCELLED",
    "CLOSED",
    "AsyncByteResponse",
    "AsyncEventIterator",
    "ByteResponse",
    "EventIterator",
    "HTTPStatusError",
    "UnsupportedStreamError",
    "aiter_httpx_events",
    "aiter_openai_events",
    "instrumented_stream",
    "iter_httpx_events",
    "iter_openai_events",
]

#: The abort reason when the consuming task is cancelled.
CANCELLED = "cancelled"
#: The abort reason when the iterator is closed before the stream ended.
CLOSED = "closed"


class HTTPStatusError(FsmError):
    """The server answered a non-2xx status instead of a stream.

    Attributes: ``status_code``; ``message`` (the body's ``error.message`` when it is an
    OpenAI-style error, else the body's text, else the reason phrase); ``error_type`` and
    ``code`` (the body's ``error.type`` / ``error.code`` when present); ``body`` (the raw text).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        body: str = "",
        error_type: str | None = None,
        code: str | None = None,
    ) -> None:
        self.status_code = status_code
        self.message = message
        self.body = body
        self.error_type = error_type
        self.code = code
        super().__init__(f"HTTP {status_code}: {message}")


class UnsupportedStreamError(FsmError, TypeError):
    """:func:`iter_openai_events` / :func:`aiter_openai_events` was given something it cannot
    read a stream from (the message says what to pass instead)."""


class ByteResponse(Protocol):
    """What :func:`iter_httpx_events` needs of a response (``httpx.Response`` has it)."""

    @property
    def status_code(self) -> int: ...

    @property
    def reason_phrase(self) -> str: ...

    def read(self) -> bytes: ...

    def iter_bytes(self) -> Iterator[bytes]: ...


class AsyncByteResponse(Protocol):
    """What :func:`aiter_httpx_events` needs of a response (``httpx.Response`` has it)."""

    @property
    def status_code(self) -> int: ...

    @property
    def reason_phrase(self) -> str: ...

    async def aread(self) -> bytes: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...


# -- the iterators ------------------------------------------------------------------------------
class _Parsed:
    """What both iterators share: the :attr:`parser` they feed and its result."""

    __slots__ = ()
    parser: StreamParser

    def result(self) -> ParseResult:
        """``parser.result()``: the response so far (final once the iteration is over)."""
        return self.parser.result()


class EventIterator(_Parsed, Iterator[Event]):
    """Events of one streamed response, parsed as the transport delivers it.

    Iterate it (once) for the events; read :attr:`parser` or
    :meth:`~fsm.clients.EventIterator.result` at any time. Also a context manager: leaving the
    block closes it (aborting a stream that has not ended, with the block's exception as reason
    if there is one).
    """

    def __init__(
        self,
        source: Iterable[Any],
        feed: Callable[[StreamParser, Any], list[Event]],
        parser: StreamParser | None = None,
        *,
        before: Callable[[StreamParser], None] | None = None,
    ) -> None:
        #: the parser fed by this iterator; its ``turns`` and ``result()`` are live.
        self.parser = parser if parser is not None else StreamParser()
        #: ``time.perf_counter()`` when the first bytes (or chunk) arrived; ``None`` before.
        self.first_data_at: float | None = None
        self._gen = self._run(source, feed, before)

    def _run(
        self,
        source: Iterable[Any],
        feed: Callable[[StreamParser, Any], list[Event]],
        before: Callable[[StreamParser], None] | None,
    ) -> Generator[Event, None, None]:
        parser = self.parser
        try:
            if before is not None:
                before(parser)
            iterator = iter(source)
            while True:
                try:
                    item = next(iterator)
                except StopIteration:
                    break
                except BaseException as exc:
                    yield from _source_failed(parser, exc, cancellable=False)
                    raise
                if self.first_data_at is None:
                    self.first_data_at = time.perf_counter()
                yield from feed(parser, item)
            yield from parser.receive_eof()
        finally:
            if not parser.ended:
                parser.abort(CLOSED)

    def __iter__(self) -> EventIterator:
        return self

    def __next__(self) -> Event:
        return next(self._gen)

    def close(self) -> None:
        """Stop iterating; a stream that has not ended is aborted with reason ``closed``."""
        self._gen.close()

    def __enter__(self) -> EventIterator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _left(self.parser, exc, cancellable=False)
        self.close()


class AsyncEventIterator(_Parsed, AsyncIterator[Event]):
    """The async twin of :class:`EventIterator` (``async for``, ``async with``, ``aclose()``).

    Cancelling the consuming task while it waits for data aborts the stream with reason
    ``cancelled`` and re-raises :class:`asyncio.CancelledError` (the abort's events are not
    yielded: read :attr:`parser` or :meth:`~fsm.clients.EventIterator.result`).
    """

    def __init__(
        self,
        source: AsyncIterable[Any],
        feed: Callable[[StreamParser, Any], list[Event]],
        parser: StreamParser | None = None,
        *,
        before: Callable[[StreamParser], Awaitable[None]] | None = None,
    ) -> None:
        #: the parser fed by this iterator; its ``turns`` and ``result()`` are live.
        self.parser = parser if parser is not None else StreamParser()
        #: ``time.perf_counter()`` when the first bytes (or chunk) arrived; ``None`` before.
        self.first_data_at: float | None = None
        self._gen = self._run(source, feed, before)

    async def _run(
        self,
        source: AsyncIterable[Any],
        feed: Callable[[StreamParser, Any], list[Event]],
        before: Callable[[StreamParser], Awaitable[None]] | None,
    ) -> AsyncGenerator[Event, None]:
        parser = self.parser
        try:
            if before is not None:
                await before(parser)
            iterator = aiter(source)
            while True:
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    break
                except BaseException as exc:
                    for event in _source_failed(parser, exc, cancellable=True):
                        yield event
                    raise
                if self.first_data_at is None:
                    self.first_data_at = time.perf_counter()
                for event in feed(parser, item):
                    yield event
            for event in parser.receive_eof():
                yield event
        finally:
            if not parser.ended:
                parser.abort(CLOSED)

    def __aiter__(self) -> AsyncEventIterator:
        return self

    async def __anext__(self) -> Event:
        return await anext(self._gen)

    async def aclose(self) -> None:
        """Stop iterating; a stream that has not ended is aborted with reason ``closed``."""
        await self._gen.aclose()

    async def __aenter__(self) -> AsyncEventIterator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _left(self.parser, exc, cancellable=True)
        await self.aclose()


# -- the helpers --------------------------------------------------------------------------------
#: Top-level fields of a chat-completion chunk (``model_id``: watsonx).
_CHUNK_FIELDS: Final = frozenset(
    {"id", "object", "created", "model", "model_id", "choices", "usage", "system_fingerprint"}
)


def _feed_sdk_chunk(parser: StreamParser, chunk: Any) -> list[Event]:
    if not isinstance(chunk, dict):
        dump = getattr(chunk, "model_dump", None)
        if dump is not None:
            chunk = dump(exclude_unset=True, by_alias=True)  # as receive_chunk() would
    if isinstance(chunk, dict) and not _CHUNK_FIELDS.intersection(chunk):
        kind = chunk.get("type")
        if isinstance(kind, str) and (kind == "chunk" or "." in kind):
            # ChunkEvent, ContentDeltaEvent, ... of chat.completions.stream(): not chunks
            raise UnsupportedStreamError(
                f"got a chat.completions.stream() event ({kind!r}), not a chunk: pass "
                "the ChatCompletionStream itself to iter_openai_events (fsm reads its bytes)"
            )
        message = chunk.get("message")
        if isinstance(message, str) and message:
            # Not a chunk but an error the SDK did not recognise: ``event: error`` whose data
            # has no "error" key is yielded as an ordinary chunk (the event name is lost).
            # Taken for the error it is, so that buffered chunks cannot pass for success.
            return parser.receive_chunk({"error": chunk})
    return parser.receive_chunk(chunk)


def _feed_bytes(parser: StreamParser, data: bytes) -> list[Event]:
    return parser.receive_data(data)


def iter_openai_events(
    stream: Iterable[Any] | Any, *, parser: StreamParser | None = None
) -> EventIterator:
    """Events of an ``openai`` SDK response, parsed as it arrives.

    ``stream`` is one of (see the module's documentation):

    * the ``APIResponse`` of ``client.chat.completions.with_streaming_response.create(...,
      stream=True)``: its raw bytes go to ``parser.receive_data``, exactly as
      :func:`iter_httpx_events` reads an ``httpx`` response (``[DONE]`` and ``event: error``
      seen; a transport error, such as ``httpx.RemoteProtocolError`` for a cut stream, aborts the
      parser and is re-raised as it is);
    * the ``ChatCompletionStream`` opened by ``with client.chat.completions.stream(...) as
      stream``: the raw bytes of its response, the same way;
    * the parsed ``Stream`` of ``client.chat.completions.create(..., stream=True)``: each
      ``ChatCompletionChunk`` goes to ``parser.receive_chunk``; the end of the stream to
      ``receive_eof()``. If the stream raises (``openai.APIConnectionError`` when the connection
      drops, ``openai.APIError`` for an error payload, ...), the parser is aborted (an error
      payload ends it as an ``error``, with the error's message), the final events are yielded
      and the exception is re-raised.

    ``parser`` defaults to a new :class:`~fsm.parser.StreamParser`; it is the returned
    iterator's ``parser`` attribute either way. The caller still owns ``stream`` (close it, or
    use it in a ``with`` block). Raises :class:`UnsupportedStreamError` for the unentered
    ``chat.completions.stream(...)`` manager, a ``ChatCompletionStream`` already read from, or
    the events of one.
    """
    raw = _raw_response(stream)
    if raw is not None:
        return iter_httpx_events(raw, parser=parser)
    return EventIterator(stream, _feed_sdk_chunk, parser)


def aiter_openai_events(
    stream: AsyncIterable[Any] | Any, *, parser: StreamParser | None = None
) -> AsyncEventIterator:
    """The async twin of :func:`iter_openai_events`, for ``AsyncOpenAI``: the
    ``AsyncAPIResponse`` of ``with_streaming_response`` (raw bytes), the
    ``AsyncChatCompletionStream`` of ``chat.completions.stream()`` (raw bytes), or the parsed
    ``AsyncStream``.

    Cancelling the consuming task aborts the stream with reason ``cancelled`` and re-raises.
    """
    raw = _raw_response(stream)
    if raw is not None:
        return aiter_httpx_events(raw, parser=parser)
    return AsyncEventIterator(stream, _feed_sdk_chunk, parser)


#: The SDK's ``chat.completions.stream()`` context managers (not streams yet).
_STREAM_MANAGERS: Final = frozenset(
    {"ChatCompletionStreamManager", "AsyncChatCompletionStreamManager"}
)
#: The SDK's ``chat.completions.stream()`` streams: events, not chunks.
_HELPER_STREAMS: Final = frozenset({"ChatCompletionStream", "AsyncChatCompletionStream"})


def _raw_response(stream: Any) -> Any:
    """The HTTP response whose raw bytes to read for ``stream``, or ``None`` to read the
    SDK's parsed chunks. Duck-typed on the SDK's classes (``openai`` is not imported)."""
    name = type(stream).__name__
    if name in _STREAM_MANAGERS:
        raise UnsupportedStreamError(
            f"{name} is the context manager of chat.completions.stream(), not a stream: "
            "pass the stream it opens (with client.chat.completions.stream(...) as stream: "
            "iter_openai_events(stream))"
        )
    if name in _HELPER_STREAMS:
        response = getattr(stream, "_response", None)
        if response is None or not hasattr(response, "is_stream_consumed"):
            raise UnsupportedStreamError(
                f"cannot reach the HTTP response of this {name} (an unknown openai version): "
                "use client.chat.completions.with_streaming_response.create(..., stream=True)"
            )
        if response.is_stream_consumed:
            raise UnsupportedStreamError(
                f"this {name} was already read from: pass it to fsm before iterating it "
                "(fsm reads its raw bytes)"
            )
        return response
    http_response = getattr(stream, "http_response", None)
    if http_response is not None and hasattr(stream, "iter_bytes") and hasattr(stream, "parse"):
        return http_response  # APIResponse / AsyncAPIResponse of with_streaming_response
    inner = instrumented_stream(stream)
    if inner is not None:
        return inner.response
    return None


#: The SDK's parsed streams, whose HTTP response is ``.response``.
_SDK_STREAMS: Final = frozenset({"Stream", "AsyncStream"})


def instrumented_stream(stream: Any) -> Any:
    """The SDK ``Stream`` an instrumentation's wrapper holds, not yet read from, else ``None``.

    ``opentelemetry-instrumentation-openai-v2`` wraps ``chat.completions.create``: for a
    streamed request it parses the ``APIResponse`` that ``with_streaming_response`` asked for
    into a ``Stream`` and returns its own wrapper of that (``.stream``) instead; wrapt proxies
    hold it as ``__wrapped__``. Its HTTP response has not been read, so fsm reads the raw bytes
    from there rather than the wrapper's parsed chunks (which lose ``[DONE]``, event names and
    ~35x the time)."""
    for name in ("stream", "__wrapped__"):
        try:
            inner = object.__getattribute__(stream, name)
        except AttributeError:
            continue
        response = getattr(inner, "response", None)
        if (
            type(inner).__name__ in _SDK_STREAMS
            and response is not None
            and hasattr(response, "status_code")
            and getattr(response, "is_stream_consumed", True) is False
        ):
            return inner
    return None


def iter_httpx_events(
    response: ByteResponse, *, parser: StreamParser | None = None
) -> EventIterator:
    """Events of an ``httpx`` streaming response (``client.stream("POST", url, json=...)``).

    Its raw bytes (``response.iter_bytes()``) go to ``parser.receive_data``, split wherever the
    network split them. A non-2xx status raises :class:`HTTPStatusError` with the body's error
    message when the iteration starts (the parser is aborted with that message). A transport
    error (``httpx.RemoteProtocolError``, ``httpx.ReadError``, ...) aborts the parser, the final
    events are yielded, and the error is re-raised.
    """

    def check(parser: StreamParser) -> None:
        if not 200 <= response.status_code < 300:
            _status_failed(parser, response.status_code, response.reason_phrase, response.read())

    return EventIterator(_LazyBytes(response), _feed_bytes, parser, before=check)


def aiter_httpx_events(
    response: AsyncByteResponse, *, parser: StreamParser | None = None
) -> AsyncEventIterator:
    """The async twin of :func:`iter_httpx_events` (``response.aiter_bytes()``).

    Cancelling the consuming task aborts the stream with reason ``cancelled`` and re-raises.
    """

    async def check(parser: StreamParser) -> None:
        if not 200 <= response.status_code < 300:
            body = await response.aread()
            _status_failed(parser, response.status_code, response.reason_phrase, body)

    return AsyncEventIterator(_LazyAsyncBytes(response), _feed_bytes, parser, before=check)


class _LazyBytes(Iterable[bytes]):
    """``response.iter_bytes()``, called only when iteration starts (after the status check)."""

    def __init__(self, response: ByteResponse) -> None:
        self._response = response

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._response.iter_bytes())


class _LazyAsyncBytes(AsyncIterable[bytes]):
    """``response.aiter_bytes()``, called only when iteration starts (after the status check)."""

    def __init__(self, response: AsyncByteResponse) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return aiter(self._response.aiter_bytes())


# -- failures -----------------------------------------------------------------------------------
def _describe(exc: BaseException) -> str:
    """``Type: message``, then its causes (``Connection error.`` says little alone), e.g.
    ``APIConnectionError: Connection error.; caused by RemoteProtocolError: peer closed
    connection without sending complete message body (incomplete chunked read)``."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 4:
        seen.add(id(current))
        text = str(current)
        part = f"{type(current).__name__}: {text}" if text else type(current).__name__
        if not parts or part != parts[-1]:
            parts.append(part)  # httpx re-raises httpcore's error under the same name and text
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return "; caused by ".join(parts)


def _stream_error_body(exc: Exception) -> Any:
    """The error object of an ``openai.APIError`` the SDK raised for an error payload inside the
    stream, else ``None`` (a connection error, a status error, or not the SDK at all)."""
    openai = sys.modules.get("openai")
    if openai is None or not isinstance(exc, openai.APIError):
        return None
    if isinstance(exc, openai.APIConnectionError | openai.APIStatusError):
        return None
    if isinstance(exc, openai.APIResponseValidationError):
        return None
    return exc.body or None


def _source_failed(parser: StreamParser, exc: BaseException, *, cancellable: bool) -> list[Event]:
    """The source raised ``exc``: end the stream with it, and the final events to yield (none
    for a cancellation, ``KeyboardInterrupt`` or ``SystemExit``; a cancellation's reason is
    ``cancelled`` when ``cancellable``)."""
    if isinstance(exc, Exception):
        return _transport_failed(parser, exc)
    parser.abort(_stop_reason(exc, cancellable=cancellable))
    return []


def _left(parser: StreamParser, exc: BaseException | None, *, cancellable: bool) -> None:
    """Leaving the iterator's block because of ``exc`` (if any): abort a stream not ended."""
    if exc is not None and not parser.ended:
        parser.abort(_stop_reason(exc, cancellable=cancellable))


def _stop_reason(exc: BaseException, *, cancellable: bool) -> str:
    """The abort reason when ``exc`` stops the reading: ``cancelled`` for a cancellation (when
    ``cancellable``), else the exception as text."""
    if cancellable and isinstance(exc, asyncio.CancelledError):
        return CANCELLED
    return _describe(exc)


def _transport_failed(parser: StreamParser, exc: Exception) -> list[Event]:
    if parser.ended:
        return []
    body = _stream_error_body(exc)
    if body is not None:
        # The SDK consumed the stream's error payload and raised: hand it back as the chunk it
        # was, so the stream ends as an ``error`` with the provider's message, as in the bytes.
        events = parser.receive_chunk({"error": body})
        return events + parser.abort(_describe(exc))  # a no-op once the error ended the stream
    return parser.abort(_describe(exc))


def _status_failed(parser: StreamParser, status: int, phrase: str, raw: bytes) -> None:
    text = raw.decode("utf-8", "replace")
    message, error_type, code = _error_fields(text)
    message = message or text.strip()[:500] or phrase or "no body"
    parser.abort(f"HTTP {status}: {message}")
    raise HTTPStatusError(message, status_code=status, body=text, error_type=error_type, code=code)


def _error_fields(text: str) -> tuple[str | None, str | None, str | None]:
    try:
        data = json.loads(text)
    except ValueError:
        return None, None, None
    if not isinstance(data, dict):
        return None, None, None
    error = data.get("error", data)
    if isinstance(error, str):
        return error, None, None
    if not isinstance(error, dict):
        return None, None, None
    message, error_type, code = error.get("message"), error.get("type"), error.get("code")
    return (
        message if isinstance(message, str) and message else None,
        error_type if isinstance(error_type, str) else None,
        str(code) if isinstance(code, str | int) and not isinstance(code, bool) else None,
    )
