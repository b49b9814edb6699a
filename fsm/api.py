"""Convenience wrappers over :class:`~fsm.parser.StreamParser` for whole streams."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterable, Callable, Iterable
from pathlib import Path
from typing import Any, Final

from fsm.errors import LocalProtocolError
from fsm.events import Event
from fsm.parser import Limits, ParseResult, StreamParser, feed, feed_all

__all__ = ["aparse", "feed", "feed_all", "parse", "parse_file", "parse_text"]

EventCallback = Callable[[Event], object]


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

    def whole(self, data: bytes) -> ParseResult:
        """Parse a whole recorded stream (:func:`parse_text`'s format rule) and end it."""
        body = data[3:] if data.startswith(_BOM) else data
        if body.lstrip()[:1] == b"{":
            for line in body.splitlines():
                if line.strip():
                    self._report(self.parser.receive_chunk(line))
        else:
            self._report(self.parser.receive_data(data))
        return self.end()

    def end(self, aborted: str | None = None) -> ParseResult:
        parser = self.parser
        self._report(parser.abort(aborted) if aborted is not None else parser.receive_eof())
        return parser.result()

    def failed(self, exc: Exception) -> ParseResult:
        """The source raised ``exc``: re-raise a protocol error or a programming error (see
        :data:`_PROGRAMMING_ERRORS`), else abort with it."""
        if self.parser.result().error is not None or isinstance(exc, _PROGRAMMING_ERRORS):
            raise exc
        return self.end(f"{type(exc).__name__}: {exc}")


_BOM: Final = b"\xef\xbb\xbf"

#: exceptions a source may raise that are bugs, not transport failures: raised as they are,
#: never turned into an ``aborted`` stream
_PROGRAMMING_ERRORS: Final = (TypeError, AttributeError, NameError, AssertionError)

#: what the first non-blank line of stream text starts with: an SSE field (``data``, ``event``,
#: ``id``, ``retry``, alone or followed by ``:``), an SSE comment (``:``), a JSON chunk (``{``)
#: or ``[DONE]``
_STREAM_START: Final = re.compile(
    r"(?:data|event|id|retry)(?::|[ \t]*(?:\r\n|\r|\n|$))|[:{]|\[DONE\]"
)


def _stream_text(text: str) -> bytes:
    """``text`` as bytes if it is stream text (see :func:`parse`), else raise."""
    body = text[1:] if text.startswith("\ufeff") else text
    stripped = body.lstrip()
    if stripped and _STREAM_START.match(stripped) is None:
        shown = stripped[:60] + ("..." if len(stripped) > 60 else "")
        raise LocalProtocolError(
            f"parse() got a str that is not stream text ({shown!r}): to read a file pass "
            f"Path({shown!r}) (or use fsm.api.parse_file), to parse text pass the SSE text "
            "itself (its first line starts with 'data:', 'event:', 'id:', 'retry:' or ':') or "
            "JSON lines of chunks"
        )
    return text.encode("utf-8", "surrogatepass")


def parse(
    source: Iterable[Any] | bytes | str | os.PathLike[str],
    *,
    repair_json: bool = False,
    limits: Limits | None = None,
    on_event: EventCallback | None = None,
    format: str = "auto",
) -> ParseResult:
    """Parse a whole stream and return its :class:`~fsm.parser.ParseResult`.

    ``source`` is one of:

    - an :class:`os.PathLike` (``Path("stream.sse")``): the file is read and parsed like
      :func:`parse_file` (SSE text, or JSON lines of chunks);
    - ``bytes``: a whole recorded stream (SSE, or JSON lines of chunks when its first non-blank
      byte is ``{``);
    - a ``str``: a whole recorded stream as text, the same two formats. A ``str`` must *look*
      like one: its first non-blank line starts with an SSE field (``data:``, ``event:``,
      ``id:``, ``retry:``), an SSE comment (``:``), ``{`` or ``[DONE]`` (an empty or blank string
      is an empty stream). Anything else (``parse("stream.sse")``: a file name passed as text)
      raises :class:`~fsm.errors.LocalProtocolError` saying to pass ``Path(...)``;
    - any other iterable of items: ``bytes``/``str`` pieces of SSE text (split anywhere, not
      checked), or chunks (dicts, ``openai`` ``ChatCompletionChunk`` objects, ...).

    ``on_event`` is called with every event as it happens (for a progress display).

    ``format`` is the stream format: ``"auto"`` (detected from the first event that carries
    JSON), ``"chat"``, ``"responses"`` or ``"anthropic"`` (see :mod:`fsm.formats`).

    If iterating ``source`` raises an ``Exception`` (the transport failed: ``OSError``,
    ``httpx.HTTPError``, ...), the stream is aborted with the error as reason and the incomplete
    result is returned: check ``result.complete``. Programming errors are raised, never reported
    as a stream failure: a source of the wrong type (``TypeError``), a ``TypeError``,
    ``AttributeError``, ``NameError`` or ``AssertionError`` raised by the source, an error of
    ``on_event``, an item the parser does not take (:class:`~fsm.errors.LocalProtocolError`). A
    :class:`~fsm.errors.RemoteProtocolError` (the input is not a stream) is raised as is.
    """
    driver = _Driver(StreamParser(repair_json=repair_json, limits=limits, format=format), on_event)
    if isinstance(source, os.PathLike):
        return driver.whole(Path(source).read_bytes())
    if isinstance(source, str):
        return driver.whole(_stream_text(source))
    if isinstance(source, bytes | bytearray | memoryview):
        return driver.whole(bytes(source))
    try:
        items = iter(source)
    except TypeError:
        raise TypeError(
            "parse() takes a path (os.PathLike), SSE bytes or text, or an iterable of SSE "
            f"pieces or chunks, not {type(source).__name__}"
        ) from None
    while True:
        try:
            item = next(items)
        except StopIteration:
            break
        except Exception as exc:
            return driver.failed(exc)
        driver.item(item)
    return driver.end()


async def aparse(
    source: AsyncIterable[Any],
    *,
    repair_json: bool = False,
    limits: Limits | None = None,
    on_event: EventCallback | None = None,
    format: str = "auto",
) -> ParseResult:
    """The async twin of :func:`parse`, over an async iterable (``httpx``'s ``aiter_bytes()``,
    the ``openai`` SDK's ``AsyncStream``) of ``bytes``/``str`` pieces of SSE text or chunks.

    Anything else (a path, bytes, a str, a list) raises ``TypeError``: use :func:`parse` for
    those. Failures of the source and programming errors are handled as in :func:`parse`.
    Cancelling the task aborts the stream (reason ``cancelled``) and re-raises
    :class:`asyncio.CancelledError`: nothing incomplete can pass for complete.
    """
    if not hasattr(source, "__aiter__"):
        raise TypeError(
            "aparse() takes an async iterable of SSE pieces or chunks, not "
            f"{type(source).__name__} (use fsm.parse() for a path, bytes, text or a sync "
            "iterable)"
        )
    import asyncio  # here, so that ``import fsm`` does not load asyncio

    driver = _Driver(StreamParser(repair_json=repair_json, limits=limits, format=format), on_event)
    items = aiter(source)
    while True:
        try:
            item = await anext(items)
        except StopAsyncIteration:
            break
        except asyncio.CancelledError:
            driver.end("cancelled")
            raise
        except Exception as exc:
            return driver.failed(exc)
        driver.item(item)
    return driver.end()


def parse_text(
    data: bytes, *, repair_json: bool = False, limits: Limits | None = None, format: str = "auto"
) -> ParseResult:
    """Parse a recorded stream held in memory: SSE text, or JSON lines of chunks.

    The format is told by the first non-blank byte: ``{`` means JSON lines (one chunk per line,
    blank lines skipped, a ``[DONE]`` line allowed), anything else SSE.
    """
    return _Driver(StreamParser(repair_json=repair_json, limits=limits, format=format), None).whole(
        data
    )


def parse_file(
    path: str | os.PathLike[str],
    *,
    repair_json: bool = False,
    limits: Limits | None = None,
    format: str = "auto",
) -> ParseResult:
    """:func:`parse_text` over a file's bytes."""
    return parse_text(
        Path(path).read_bytes(), repair_json=repair_json, limits=limits, format=format
    )
