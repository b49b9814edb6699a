"""The sans-IO stream parser: bytes or chunks in, events out.

::

    parser = StreamParser()
    for data in transport:                      # bytes, split anywhere
        for event in parser.receive_data(data):
            ...
    parser.receive_eof()                        # or parser.abort("reason") when the transport fails
    result = parser.result()

The parser does no I/O and owns no threads. The exact semantics are ``shared/spec/parser.md``;
the manual's decisions log (docs/decisions.md) lists every choice made where the spec is silent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from fsm.errors import LocalProtocolError, RemoteProtocolError
from fsm.events import Event
from fsm.formats.auto import make_format
from fsm.formats.core import StreamCore
from fsm.sse import EventTooLargeError, SSEFramer
from fsm.states import KNOWN_FINISH_REASONS, StreamState, stream_next
from fsm.turn import Anomaly, ParseResult, Turn
from fsm.vocab import DEFAULT_LIMITS, FORMAT_NAMES, Limits
from fsm.vocab import MAX_ANOMALIES_PER_KIND as MAX_ANOMALIES_PER_KIND  # old imports
from fsm.vocab import MAX_INDEXED_BYTES as MAX_INDEXED_BYTES  # old imports
from fsm.vocab import MAX_JSON_DEPTH as MAX_JSON_DEPTH  # old imports

__all__ = ["KNOWN_FINISH_REASONS", "Anomaly", "Limits", "ParseResult", "StreamParser", "Turn"]

#: receive_data() hands bigger buffers to the framer in pieces of this size.
_WINDOW: Final = 64 * 1024

_OPEN: Final = StreamState.OPEN
_ENDED: Final = StreamState.ENDED
_CLOSED: Final = StreamState.CLOSED
_FAILED: Final = StreamState.FAILED


class StreamParser:
    """Parses one streamed Chat Completions response. Create one per HTTP response.

    Args:
        repair_json: opt-in, append-only JSON repair for calls of a turn that ended normally
            (never for ``finish_reason: length``). Off by default: a truncated call is never
            executed.
        limits: bounds on memory; see :class:`Limits`.
        format: the stream format: ``"auto"`` (the default: detected from the first event that
            carries JSON), ``"chat"`` (Chat Completions chunks), ``"responses"`` (the OpenAI
            Responses API) or ``"anthropic"`` (Anthropic Messages); see :mod:`fsm.formats`.
    """

    def __init__(
        self, *, repair_json: bool = False, limits: Limits | None = None, format: str = "auto"
    ) -> None:
        if format not in FORMAT_NAMES:
            raise ValueError(
                f"StreamParser(format=...) must be one of {', '.join(FORMAT_NAMES)}, got {format!r}"
            )
        self.limits = limits or DEFAULT_LIMITS
        self._framer = SSEFramer(self.limits.max_event_bytes)
        self._framer_usable = True
        core = self._core = StreamCore(
            self.limits, repair_json, None if format == "auto" else format
        )
        core.handler = make_format(core, format)

    @property
    def repair_json(self) -> bool:
        """Whether calls of a turn that ended normally get the opt-in JSON repair."""
        return self._core.repair_json

    @repair_json.setter
    def repair_json(self, value: bool) -> None:
        self._core.repair_json = value

    @property
    def turns(self) -> dict[int, Turn]:
        """``{choice_index: Turn}``, a live view."""
        return self._core.turns

    @property
    def format(self) -> str | None:
        """The stream format (``"chat"``, ``"responses"``, ``"anthropic"``), ``None`` while it
        is not yet detected."""
        return self._core.format

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every anomaly so far, in order."""
        return list(self._core.anomalies)

    @property
    def ended(self) -> bool:
        """Whether the stream has ended (``[DONE]``, an error, EOF, abort, a limit)."""
        return self._core.status is not _OPEN

    def result(self) -> ParseResult:
        """A snapshot of the response so far (the :class:`Turn` objects are the live ones)."""
        core = self._core
        meta = core.meta
        return ParseResult(
            response_id=meta.response_id,
            model=meta.model,
            created=meta.created,
            system_fingerprint=meta.system_fingerprint,
            usage=meta.usage,
            anomalies=list(core.anomalies),
            turns=[core.turns[i] for i in sorted(core.turns)],
            end_how=core.end_how,
            end_reason=core.end_reason,
            error=core.error,
            anomaly_counts=dict(core.anomaly_counts),
            event_count=core.event_number,
            format=core.format,
            error_code=core.error_code,
        )

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Feed raw SSE bytes, split anywhere. Returns the events they complete.

        The list holds every event of ``data``: for a whole recorded stream it is proportional
        to the stream (feed network-sized reads to keep it small)."""
        self._check_open("receive_data")
        core = self._core
        if type(data) is not bytes and not isinstance(data, bytes | bytearray | memoryview):
            raise LocalProtocolError(
                f"receive_data() takes bytes, bytearray or memoryview, not {type(data).__name__} "
                "(encode text as UTF-8, or pass chunks to receive_chunk())"
            )
        if core.status is _ENDED:
            if data and self._framer_usable:
                for _name, _payload, _offset in self._feed_framer(bytes(data)):
                    core.event_number += 1
                    core.handler.after_end(_name, _payload)
            # after an oversized event nothing more is framed: the rest is ignored silently, as
            # the same bytes would have been had they come in the same read
            return core.take()
        if len(data) > _WINDOW:
            # Big buffers go through in windows: the framer's lists stay small and warm.
            events: list[Event] = []
            view = memoryview(data)
            try:
                for start in range(0, len(data), _WINDOW):
                    events.extend(self.receive_data(view[start : start + _WINDOW]))
            except RemoteProtocolError as exc:
                exc.events[:0] = events
                raise
            return events
        too_large: EventTooLargeError | None = None
        try:
            frames = self._framer.feed(bytes(data))
        except EventTooLargeError as exc:
            self._framer_usable = False
            frames = exc.events
            too_large = exc
        core.handler.frames(frames)
        if too_large is not None and core.status is _OPEN:
            core.event_number += 1
            core.offset = too_large.offset
            core.anomaly("limit_exceeded", str(too_large))
            core.end("limit", "limit:max_event_bytes")
        return core.take()

    def receive_chunk(self, chunk: Any) -> list[Event]:
        """Feed one chunk: a dict, a JSON ``str``/``bytes``, an ``openai`` SDK
        ``ChatCompletionChunk``, or any pydantic model of the chunk (read through its
        ``model_dump(exclude_unset=True, by_alias=True)``). The string ``"[DONE]"`` ends the
        stream."""
        core = self._core
        if type(chunk) is dict and core.status is _OPEN:
            # the common case first: a decoded chunk while the stream is open
            core.event_number += 1
            core.offset = None
            core.handler.chunk(chunk)
            events = core.events
            core.events = []
            return events
        self._check_open("receive_chunk")
        core.event_number += 1
        core.offset = None
        if isinstance(chunk, str | bytes | bytearray):
            text = chunk.strip()
            if text in ("[DONE]", b"[DONE]"):
                core.handler.done_sentinel()
                return core.take()
            if core.status is not _OPEN:
                core.anomaly("data_after_end", "a chunk after the end of the stream")
                return core.take()
            chunk = core.decode_slow(bytes(text) if isinstance(text, bytearray) else text)
        elif not isinstance(chunk, dict):
            dump = getattr(chunk, "model_dump", None)
            if dump is None:
                raise LocalProtocolError(
                    "receive_chunk() takes a dict, a JSON str/bytes or a pydantic chunk model, "
                    f"not {type(chunk).__name__}"
                )
            chunk = dump(exclude_unset=True, by_alias=True)
        if core.status is not _OPEN:
            core.anomaly("data_after_end", "a chunk after the end of the stream")
            return core.take()
        core.handler.chunk(chunk)
        return core.take()

    def receive_eof(self) -> list[Event]:
        """The transport closed cleanly. Ends the stream if ``[DONE]`` did not."""
        self._check_open("receive_eof")
        core = self._core
        if core.status is _OPEN:
            if self._framer.close():
                core.anomaly(
                    "incomplete_event_at_eof",
                    "the input ended inside an SSE event; the partial event was discarded",
                )
            core.end("eof", None)
        core.status = stream_next(core.status, "close")
        return core.take()

    def abort(self, reason: str = "aborted") -> list[Event]:
        """The transport failed or the caller cancelled: every live call becomes ``aborted``
        with ``reason``. A no-op (returns ``[]``) once the stream has already ended."""
        core = self._core
        if core.status is _OPEN:
            core.end("aborted", reason or "aborted")
        if core.status is _ENDED:
            core.status = stream_next(core.status, "close")
        return core.take()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        core = self._core
        if core.status is _FAILED:
            error = core.error
            assert error is not None
            raise RemoteProtocolError(
                f"the stream already failed ({error.reason}); no more input is accepted",
                event_number=error.event_number,
                byte_offset=error.byte_offset,
                path=error.path,
            )
        if core.status is _CLOSED:
            raise LocalProtocolError(
                f"{what}() called after the stream was closed by receive_eof() or abort(); "
                "use a new StreamParser for a new response"
            )

    # -- internals ----------------------------------------------------------------------------
    def _feed_framer(self, data: bytes) -> list[tuple[str, bytes, int]]:
        try:
            return self._framer.feed(data)
        except EventTooLargeError as exc:
            self._framer_usable = False
            return exc.events


def feed(parser: StreamParser, item: Any) -> list[Event]:
    """Feed one item of a stream: ``bytes``/``str`` as SSE data (split anywhere), anything else
    as a chunk (:meth:`~fsm.parser.StreamParser.receive_chunk`). No EOF."""
    if isinstance(item, bytes | bytearray | memoryview):
        return parser.receive_data(item)
    if isinstance(item, str):
        return parser.receive_data(item.encode("utf-8", "surrogatepass"))
    return parser.receive_chunk(item)


def feed_all(parser: StreamParser, items: Iterable[Any]) -> list[Event]:
    """:func:`feed` every item; no EOF (also :func:`fsm.api.feed_all`)."""
    events: list[Event] = []
    for item in items:
        events.extend(feed(parser, item))
    return events
