"""Convenience wrappers over :class:`~fsm.parser.StreamParser` for whole streams."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterable, Callable, Iterable
from pathlib import Path
from typing import Any

from fsm.events import Event
from fsm.parser import Limits, ParseResult, StreamParser, feed_all

__all__ = ["aparse", "parse", "parse_file", "parse_text"]

EventCallback = Callable[[Event], object]


def _feed(parser: StreamParser, item: Any, on_event: EventCallback | None) -> None:
    events = feed_all(parser, (item,))
    if on_event is not None:
        for event in events:
            on_event(event)


def _finish(parser: StreamParser, on_event: EventCallback | None, *, aborted: str | None) -> None:
    events = parser.abort(aborted) if aborted is not None else parser.receive_eof()
    if on_event is not None:
        for event in events:
            on_event(event)


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
    parser = StreamParser(repair_json=repair_json, limits=limits)
    items: Iterable[Any] = (source,) if isinstance(source, bytes | str) else source
    try:
        for item in items:
            _feed(parser, item, on_event)
    except Exception as exc:
        if parser.result().error is not None:
            raise
        _finish(parser, on_event, aborted=f"{type(exc).__name__}: {exc}")
        return parser.result()
    _finish(parser, on_event, aborted=None)
    return parser.result()


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
    parser = StreamParser(repair_json=repair_json, limits=limits)
    try:
        async for item in source:
            _feed(parser, item, on_event)
    except asyncio.CancelledError:
        _finish(parser, on_event, aborted="cancelled")
        raise
    except Exception as exc:
        if parser.result().error is not None:
            raise
        _finish(parser, on_event, aborted=f"{type(exc).__name__}: {exc}")
        return parser.result()
    _finish(parser, on_event, aborted=None)
    return parser.result()


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
