"""Convenience wrappers over :class:`~fsm.parser.StreamParser` for whole streams."""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Callable, Iterable
from pathlib import Path
from typing import Any

from fsm.events import Event
from fsm.parser import Limits, ParseResult, StreamParser

__all__ = ["aparse", "feed", "feed_all", "parse", "parse_file", "parse_text"]

EventCallback = Callable[[Event], object]


def feed(parser: StreamParser, item: Any) -> list[Event]:
    """Feed one item of a stream: ``bytes``/``str`` as SSE data (split anywhere), anything else
    as a chunk (:meth:`~fsm.parser.StreamParser.receive_chunk`). No EOF."""
    if isinstance(item, bytes | bytearray | memoryview):
        return parser.receive_data(item)
    if isinstance(item, str):
        return parser.receive_data(item.encode("utf-8", "surrogatepass"))
    return parser.receive_chunk(item)


def feed_all(parser: StreamParser, items: Iterable[Any]) -> list[Event]:
    """:func:`feed` every item; no EOF."""
    events: list[Event] = []
    for item in items:
        events.extend(feed(parser, item))
    return events


class _Driver:
    """The one driver of :func:`parse` and :func:`aparse`: feed each item, report its events,
    and end the stream: EOF, or ``abort`` when the source failed (a protocol error of the
    parser itself is raised as is)."""

    __slots__ = ("on_event", "parser")

    def __init__(self, parser: StreamParser, on_event: EventCallback | None) -> None:
        self.parser = parser
        self.on_event = on_event

    def _report(self, events: list[Event]) -> None:
        if self.on_event is not None:
            for event in events:
                self.on_event(event)

    def item(self, item: Any) -> None:
        self._report(feed(self.parser, item))

    def end(self, aborted: str | None = None) -> ParseResult:
        parser = self.parser
        self._report(parser.abort(aborted) if aborted is not None else parser.receive_eof())
        return parser.result()

    def failed(self, exc: Exception) -> ParseResult:
        """The source raised ``exc``: re-raise a protocol error, else abort with it."""
        if self.parser.result().error is not None:
            raise exc
        return self.end(f"{type(exc).__name__}: {exc}")


def parse(
    source: Iterable[Any] | bytes | str,
    *,
    repair_json: bool = False,
    limits: Limits | None = None,
    on_event: EventCallback | None = None,
) -> ParseResult:
    """Parse a whole stream and return its :class:`~fsm.parser.ParseResult`.

    ``source`` is SSE bytes or text, or an iterable of items: ``bytes``/``str`` pieces of SSE
    text (split anywhere), or chunks (dicts, ``openai`` ``ChatCompletionChunk`` objects, ...).
    ``on_event`` is called with every event as it happens (for a progress display).

    If iterating ``source`` raises an ``Exception`` (the transport failed), the stream is aborted
    with the error as reason and the incomplete result is returned: check ``result.complete``.
    A :class:`~fsm.errors.RemoteProtocolError` (the input is not a stream) is raised as is.
    """
    driver = _Driver(StreamParser(repair_json=repair_json, limits=limits), on_event)
    items: Iterable[Any] = (source,) if isinstance(source, bytes | str) else source
    try:
        for item in items:
            driver.item(item)
    except Exception as exc:
        return driver.failed(exc)
    return driver.end()


async def aparse(
    source: AsyncIterable[Any],
    *,
    repair_json: bool = False,
    limits: Limits | None = None,
    on_event: EventCallback | None = None,
) -> ParseResult:
    """The async twin of :func:`parse`, over an async iterable (``httpx``'s ``aiter_bytes()``,
    the ``openai`` SDK's ``AsyncStream``).

    Cancelling the task aborts the stream (reason ``cancelled``) and re-raises
    :class:`asyncio.CancelledError`: nothing incomplete can pass for complete.
    """
    import asyncio  # here, so that ``import fsm`` does not load asyncio

    driver = _Driver(StreamParser(repair_json=repair_json, limits=limits), on_event)
    try:
        async for item in source:
            driver.item(item)
    except asyncio.CancelledError:
        driver.end("cancelled")
        raise
    except Exception as exc:
        return driver.failed(exc)
    return driver.end()


def parse_text(
    data: bytes, *, repair_json: bool = False, limits: Limits | None = None
) -> ParseResult:
    """Parse a recorded stream held in memory: SSE text, or JSON lines of chunks.

    The format is told by the first non-blank byte: ``{`` means JSON lines (one chunk per line,
    blank lines skipped, a ``[DONE]`` line allowed), anything else SSE.
    """
    parser = StreamParser(repair_json=repair_json, limits=limits)
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    if body.lstrip()[:1] == b"{":
        for line in body.splitlines():
            if line.strip():
                parser.receive_chunk(line)
    else:
        parser.receive_data(data)
    parser.receive_eof()
    return parser.result()


def parse_file(
    path: str | os.PathLike[str], *, repair_json: bool = False, limits: Limits | None = None
) -> ParseResult:
    """:func:`parse_text` over a file's bytes."""
    return parse_text(Path(path).read_bytes(), repair_json=repair_json, limits=limits)
