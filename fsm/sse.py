"""An incremental Server-Sent Events framer (WHATWG ``text/event-stream`` rules).

Bytes go in, split anywhere (inside a line, inside a CRLF pair, inside a UTF-8 character, inside
the BOM); complete events come out. It works on bytes and never decodes the data: UTF-8
continuation bytes can never be ``\\r`` or ``\\n``, so splitting lines on bytes is exact, and the
JSON decoder gets the payload as bytes.

Rules implemented: lines end with ``\\n``, ``\\r\\n`` or ``\\r``; a blank line dispatches the
event; ``data:`` with or without one leading space; several ``data:`` lines join with ``\\n``;
lines starting with ``:`` are comments; ``event:``, ``id:`` and ``retry:`` fields; unknown fields
are ignored; a UTF-8 BOM at the very start is skipped; an event with no data is not dispatched,
except one named ``error`` (an error must never vanish). An incomplete event at end of input is
discarded, as the standard says, and reported by :meth:`SSEFramer.close`.

The work per call is linear in the bytes given: an incomplete line is kept as a list of pieces and
joined once, when its end arrives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["EventTooLargeError", "SSEEvent", "SSEFramer"]

_BOM: Final = b"\xef\xbb\xbf"
_LINE_SEP: Final = re.compile(rb"(\r\n|\r|\n)")
#: the most significant digits of a ``retry:`` field that is kept
_MAX_RETRY_DIGITS: Final = 18


@dataclass(frozen=True, slots=True, kw_only=True)
class SSEEvent:
    """One dispatched event: its type (``""`` when no ``event:`` field), its data, and the byte
    offset in the stream of its first ``data:`` or ``event:`` line."""

    event: str
    data: bytes
    offset: int


class EventTooLargeError(Exception):
    """An event grew past ``max_event_bytes``; ``offset`` is where it started.

    ``events`` holds the events the same :meth:`SSEFramer.feed` call completed before the
    oversized one, so that what is reported never depends on how the bytes were split.
    """

    def __init__(self, limit: int, offset: int) -> None:
        self.limit = limit
        self.offset = offset
        self.events: list[tuple[str, bytes, int]] = []
        super().__init__(f"an SSE event starting at byte {offset} exceeds {limit} bytes")


class SSEFramer:
    """Turns a byte stream into SSE events. One instance per stream.

    :meth:`feed` returns ``(event_type, data, offset)`` tuples (cheap to make; the parser's hot
    path uses them); :meth:`events` wraps the same in :class:`SSEEvent` objects.
    """

    __slots__ = (
        "_bom_buf",
        "_bom_checking",
        "_data",
        "_data_len",
        "_event",
        "_event_start",
        "_line_start",
        "_pending",
        "_pending_len",
        "_skip_lf",
        "last_event_id",
        "max_event_bytes",
        "retry",
    )

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self.max_event_bytes = max_event_bytes
        #: The last ``id:`` field seen (``None`` until one is).
        self.last_event_id: str | None = None
        #: The last valid ``retry:`` field, in milliseconds.
        self.retry: int | None = None
        self._bom_checking = True
        self._bom_buf = b""
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._data: list[bytes] = []
        self._data_len = 0
        self._event = ""
        self._event_start = -1
        self._line_start = 0
        self._skip_lf = False

    def feed(self, data: bytes) -> list[tuple[str, bytes, int]]:
        """Consume ``data``; return every event completed by it, in order.

        Raises :class:`EventTooLargeError` (carrying the events completed before it) when an
        event exceeds ``max_event_bytes``; the framer must not be fed after that.
        """
        out: list[tuple[str, bytes, int]] = []
        try:
            self._feed(data, out)
        except EventTooLargeError as exc:
            exc.events = out
            raise
        return out

    def _feed(self, data: bytes, out: list[tuple[str, bytes, int]]) -> None:
        if self._bom_checking:
            head = self._bom_buf + data
            if len(head) < 3 and _BOM.startswith(head):
                self._bom_buf = head
                return
            self._bom_checking = False
            self._bom_buf = b""
            if head.startswith(_BOM):
                head = head[3:]
                self._line_start = 3
            data = head
        if not data:
            return
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == 10:  # the "\n" of a "\r\n" split across two feeds
                data = data[1:]
                self._line_start += 1
                if not data:
                    return
        if b"\r" in data:
            self._lines(data, out)
            return
        if not self._at_boundary():
            # finish the event in progress the general way, then take the fast path
            end = data.find(b"\n\n")
            if end < 0:
                self._lines(data, out)
                return
            self._lines(data[: end + 2], out)
            data = data[end + 2 :]
            if not self._at_boundary():  # pragma: no cover - "\n\n" always ends an event
                self._lines(data, out)
                return
        # Fast paths at an event boundary, with LF line ends.
        end = data.rfind(b"\n\n")
        if end > 6 and data.startswith(b"data: "):
            # Every event a single "data: " line (the common case): one split on the 8-byte
            # separator, verified by counting the newlines, with no per-event scanning.
            payloads = data[6:end].split(b"\n\ndata: ")
            if data.count(b"\n", 0, end) == 2 * len(payloads) - 2 and (
                max(map(len, payloads)) <= self.max_event_bytes
            ):
                pos = self._line_start
                for payload in payloads:
                    out.append(("", payload, pos))
                    pos += len(payload) + 8
                self._line_start = pos
                if end + 2 < len(data):
                    self._lines(data[end + 2 :], out)
                return
        # Most events a single "data: " line: check each block, others the general way.
        blocks = data.split(b"\n\n")
        tail = blocks.pop()
        pos = self._line_start
        limit = self.max_event_bytes + 6
        for block in blocks:
            if block.startswith(b"data: ") and len(block) <= limit and block.find(b"\n") < 0:
                out.append(("", block[6:], pos))
            elif (
                block.startswith(b"event: ")
                and (nl := block.find(b"\n")) > 7
                and block.startswith(b"data: ", nl + 1)
                and block.find(b"\n", nl + 1) < 0
                and len(block) - nl - 7 <= self.max_event_bytes
                and nl <= limit
            ):
                # "event: NAME" then one "data: " line (Responses API, Anthropic Messages)
                out.append((block[7:nl].decode("utf-8", "replace"), block[nl + 7 :], pos))
            else:
                self._line_start = pos
                self._lines(block + b"\n\n", out)
            pos += len(block) + 2
        self._line_start = pos
        if tail:
            self._lines(tail, out)
        return

    def _at_boundary(self) -> bool:
        return not (self._pending or self._data or self._event or self._event_start >= 0)

    def _lines(self, data: bytes, out: list[tuple[str, bytes, int]]) -> None:
        """The general line-by-line path (any line ends, fields, comments, multi-line data)."""
        if b"\r" in data:
            parts = _LINE_SEP.split(data)
            lines = parts[0::2]
            seps = [len(s) for s in parts[1::2]]
            self._skip_lf = data[-1] == 13
        else:
            lines = data.split(b"\n")
            seps = None
        last = len(lines) - 1
        if last and self._pending:
            self._pending.append(lines[0])
            lines[0] = b"".join(self._pending)
            self._pending = []
            self._pending_len = 0
        line_start = self._line_start
        for i in range(last):
            line = lines[i]
            if line.startswith(b"data:"):
                value = line[6:] if line[5:6] == b" " else line[5:]
                if self._event_start < 0:
                    self._event_start = line_start
                # the payload is the data lines joined with "\n": count those too
                self._data_len += len(value) + (1 if self._data else 0)
                self._data.append(value)
                if self._data_len > self.max_event_bytes:
                    raise EventTooLargeError(self.max_event_bytes, self._event_start)
            elif not line:
                if self._data or self._event == "error":
                    out.append((self._event, b"\n".join(self._data), self._event_start))
                self._data = []
                self._data_len = 0
                self._event = ""
                self._event_start = -1
            elif len(line) > self.max_event_bytes + 6:
                # an over-long comment or field line: the same verdict as while it was pending
                start = self._event_start if self._event_start >= 0 else line_start
                raise EventTooLargeError(self.max_event_bytes, start)
            elif line[0] != 58:  # not a ":" comment
                self._field(line, line_start)
            line_start += len(line) + (1 if seps is None else seps[i])
        self._line_start = line_start
        tail = lines[last]
        if tail:
            self._pending.append(tail)
            self._pending_len += len(tail)
            # a line in progress may be "data: " + a payload of the limit, and no longer
            if self._pending_len > self.max_event_bytes + 6:
                start = self._event_start if self._event_start >= 0 else line_start
                raise EventTooLargeError(self.max_event_bytes, start)

    def _field(self, line: bytes, line_start: int) -> None:
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name, value = line[:colon], line[colon + 1 :]
            if value[:1] == b" ":
                value = value[1:]
        if name == b"event":
            if self._event_start < 0:
                self._event_start = line_start
            self._event = value.decode("utf-8", "replace")
        elif name == b"id":
            if b"\0" not in value:
                self.last_event_id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():
            # int() refuses more than 4,300 digits: leading zeros aside, a value past 18 digits
            # (over 31 million years in milliseconds) is ignored
            digits = value.lstrip(b"0") or b"0"
            if len(digits) <= _MAX_RETRY_DIGITS:
                self.retry = int(digits)
        # "data" with no colon is an empty data line: append it
        elif name == b"data":
            if self._event_start < 0:
                self._event_start = line_start
            self._data.append(b"")

    def events(self, data: bytes) -> list[SSEEvent]:
        """Like :meth:`feed`, returning :class:`SSEEvent` objects."""
        return [SSEEvent(event=e, data=d, offset=o) for e, d, o in self.feed(data)]

    def close(self) -> bool:
        """End of input. Returns whether an incomplete event (or line) was discarded."""
        dropped = bool(self._pending or self._data or self._bom_buf or self._event_start >= 0)
        self._pending = []
        self._pending_len = 0
        self._data = []
        self._data_len = 0
        self._bom_buf = b""
        self._event = ""
        self._event_start = -1
        return dropped
