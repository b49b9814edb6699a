"""The stream core every format calls: one stream's state and the rules every format shares
(limits, anomalies, protocol errors, events, endings), each written once.

A format (:class:`Format`: :class:`~fsm.formats.chat.ChatFormat`,
:class:`~fsm.formats.responses.ResponsesHandler`, :class:`~fsm.formats.anthropic.AnthropicHandler`,
and the detector :class:`~fsm.formats.auto.Detector` until it has chosen one) reads the events
of its wire format and drives the core through the methods below; the
:class:`~fsm.parser.StreamParser` facade owns one core and hands each input to the core's
:attr:`StreamCore.handler`. The stream's states are :class:`fsm.states.StreamState`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final, NamedTuple, NoReturn, Protocol

from fsm.errors import RemoteProtocolError
from fsm.events import AnomalyDetected, Event, StreamEnded, ToolCallOpened, TurnEnded, UsageReceived
from fsm.jsonsyntax import render_json
from fsm.states import NO_TOOL_CALLS, StreamState, stream_next
from fsm.toolcall import ToolCall, loads_strict
from fsm.turn import Anomaly, Meta, Turn
from fsm.vocab import MAX_ANOMALIES_PER_KIND, Limits

__all__ = ["Format", "Frames", "Header", "StreamCore"]

_log = logging.getLogger("fsm.parser")

_OPEN: Final = StreamState.OPEN

#: SSE events as the framer gives them: (event name, data, byte offset)
Frames = list[tuple[str, bytes, int]]


class Format(Protocol):
    """One stream format: what the parser hands it and nothing else. Chat Completions,
    Responses and Anthropic implement it over the one :class:`StreamCore`."""

    def frames(self, frames: Frames) -> None:
        """SSE events from the framer, in order (the stream may end midway)."""

    def chunk(self, chunk: Any) -> None:
        """One event fed as an object (``receive_chunk``), the stream open."""

    def after_end(self, name: str, payload: bytes) -> None:
        """An SSE event after the stream ended."""

    def done_sentinel(self) -> None:
        """``[DONE]`` fed as a chunk (open or ended)."""


class Header(NamedTuple):
    """What :meth:`StreamCore.admit_call` kept of a new call's header: its id, name, type and
    item id within the limits, and the limit one of them passed (``None``: none)."""

    cid: str
    name: str
    typ: str
    item_id: str | None
    over: tuple[str, str, int] | None


class StreamCore:
    """The state of one stream and the rules every format shares. Its fields are read and
    written by the formats (an internal module: none of this is public API)."""

    def __init__(self, limits: Limits, repair_json: bool, format: str | None) -> None:
        self.limits = limits
        self.repair_json = repair_json
        #: the format reading the stream (the detector until one is chosen)
        self.handler: Format
        self.meta = Meta()
        self.turns: dict[int, Turn] = {}
        self.events: list[Event] = []
        self.anomalies: list[Anomaly] = []
        self.anomaly_counts: dict[str, int] = {}
        self.status = _OPEN
        self.event_number = 0
        self.offset: int | None = None
        self.end_how: str | None = None
        self.end_reason: str | None = None
        self.error: RemoteProtocolError | None = None
        self.max_argument_bytes = limits.max_argument_bytes
        #: bytes of text, arguments, names and ids accepted so far (Limits.max_stream_bytes)
        self.stream_bytes = 0
        self.max_stream_bytes = limits.max_stream_bytes
        self.max_text_bytes = limits.max_text_bytes
        #: the stream format, ``None`` until detected; the error code of an error end
        self.format = format
        self.error_code: str | None = None

    def fragment(self, call: ToolCall, fragment: str, nbytes: int) -> bool:
        """THE fragment-limit rule: append an argument fragment of ``nbytes`` UTF-8 bytes to
        ``call`` when it stays within the call's ``max_argument_bytes`` and the stream's
        ``max_stream_bytes`` (``True``); else nothing is changed (``False``: the caller takes the
        slow path, :meth:`arguments`)."""
        stream = self.stream_bytes + nbytes
        if (
            call.argument_bytes + nbytes <= self.max_argument_bytes
            and stream <= self.max_stream_bytes
        ):
            self.stream_bytes = stream
            self.events.append(call.append(fragment, nbytes))
            return True
        return False

    def decode_slow(self, payload: bytes | str) -> Any:
        try:
            return loads_strict(payload)
        except (ValueError, RecursionError) as exc:
            self.fail(f"the data is not valid JSON ({exc})", None)

    def take(self) -> list[Event]:
        events = self.events
        self.events = []
        return events

    def anomaly(self, kind: str, detail: str, choice: int | None = None) -> None:
        # Every anomaly is counted; the first few of each kind are kept with their details and
        # reported as events, so that a hostile stream (a million events after [DONE]) cannot
        # grow memory without bound.
        count = self.anomaly_counts.get(kind, 0) + 1
        self.anomaly_counts[kind] = count
        if count > MAX_ANOMALIES_PER_KIND:
            return
        anomaly = Anomaly(kind, detail, choice, self.event_number)
        _log.debug("anomaly %s (choice %s, event %d): %s", kind, choice, self.event_number, detail)
        self.anomalies.append(anomaly)
        self.events.append(AnomalyDetected(kind=kind, detail=detail, choice=choice))

    def fail(self, reason: str, path: str | None) -> NoReturn:
        error = RemoteProtocolError(
            reason, event_number=self.event_number, byte_offset=self.offset, path=path
        )
        self.error = error
        self.end("protocol_error", "protocol_error")
        self.status = stream_next(self.status, "fail")
        error.events = self.take()
        raise error

    def error_event(self, payload: bytes) -> None:
        # The message: the JSON error's message when the data is JSON, else the data as text,
        # else "error event".
        message: str
        try:
            obj = loads_strict(payload) if payload.strip() else None
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and "error" in obj:
            message = error_message(obj["error"])
        elif isinstance(obj, dict) or (obj is not None and not isinstance(obj, str)):
            message = error_message(obj)
        elif isinstance(obj, str) and obj.strip():
            message = obj
        else:
            message = payload.decode("utf-8", "replace").strip() or "error event"
        self.end("error", message)

    def identifier(self, value: str, what: str) -> bool:
        """Count a stream-level identifier; ``False`` when a limit ended the stream."""
        size = len(value) if value.isascii() else utf8_len(value)
        if size > self.limits.max_id_bytes:
            self.limit("max_id_bytes", f"{what} is longer than {self.limits.max_id_bytes} bytes")
            return False
        self.stream_bytes += size
        if self.stream_bytes > self.max_stream_bytes:
            self.stream_limit()
            return False
        return True

    def count_header_bytes(self, size: int) -> bool:
        """Add ``size`` bytes to what the stream holds; ``False`` when that ended the stream."""
        self.stream_bytes += size
        if self.stream_bytes > self.max_stream_bytes:
            self.stream_limit()
            return False
        return True

    def stream_limit(self) -> None:
        self.limit(
            "max_stream_bytes",
            f"the stream holds more than {self.max_stream_bytes} bytes of text, arguments, "
            "names and ids",
        )

    def keep_usage(self, usage: Any) -> None:
        if type(usage) is not dict:
            self.fail(f"must be an object or null, got {json_type(usage)}", "usage")
        problem = usage_problem(usage)
        if problem is not None:
            self.anomaly(
                "invalid_usage",
                f"usage ignored: it holds {problem}"
                + ("; the previous usage is kept" if self.meta.usage is not None else ""),
            )
            return
        self.meta.usage = usage
        self.events.append(UsageReceived(usage=usage))

    def text_room(self, turn: Turn, nbytes: int, counted: bool = True) -> bool:
        """THE text-limit rule: whether ``nbytes`` more UTF-8 bytes of text fit in ``turn``'s
        ``max_text_bytes`` (``counted``: content, reasoning or refusal; a signature is not) and
        the stream's ``max_stream_bytes``; if so they are counted against the stream (the turn
        counts its own text), else the limit ends the stream (``False``). The chat format
        inlines the same test on its hot path and calls this past it."""
        if counted and turn.text_bytes + nbytes > self.max_text_bytes:
            self.limit("max_text_bytes", f"choice {turn.index} text exceeds the limit")
            return False
        stream = self.stream_bytes + nbytes
        if stream > self.max_stream_bytes:
            self.stream_limit()
            return False
        self.stream_bytes = stream
        return True

    def arguments(self, call: ToolCall, fragment: str, nbytes: int) -> None:
        """Append an argument fragment of ``nbytes`` UTF-8 bytes within the call's and the
        stream's limits (:meth:`fragment`); past the call's, it ends aborted; past the
        stream's, the stream ends."""
        if self.fragment(call, fragment, nbytes):
            return
        if call.argument_bytes + nbytes > self.max_argument_bytes:
            self.over_limit(call)
        else:
            self.stream_limit()

    # -- what ToolCall.merge needs (fsm.toolcall.HeaderSink) --
    @property
    def max_id_bytes(self) -> int:
        """``limits.max_id_bytes`` (for :meth:`ToolCall.merge`)."""
        return self.limits.max_id_bytes

    @property
    def max_name_bytes(self) -> int:
        """``limits.max_name_bytes`` (for :meth:`ToolCall.merge`)."""
        return self.limits.max_name_bytes

    def header_id_set(self, call: ToolCall) -> None:
        """A call got its id late (for :meth:`ToolCall.merge`)."""
        self.turns[call.choice].note_id(call)
        if call.id.isspace():
            self.blank_id(call)

    def admit_call(
        self,
        turn: Turn,
        cid: str,
        name: str,
        typ: str,
        item_id: str | None = None,
        *,
        typ_sent: bool = True,
    ) -> Header | None:
        """The limits on a new call of ``turn``: at most ``max_tool_calls`` per choice; an id,
        item id or type (``typ_sent``: one the provider sent, not a format's own word) past
        ``max_id_bytes`` or a name past ``max_name_bytes`` is dropped (the call will end
        aborted, :meth:`register_call`); what is kept counts against ``max_stream_bytes``.
        ``None`` when a limit ended the stream."""
        limits = self.limits
        if turn.call_count >= limits.max_tool_calls:
            self.limit(
                "max_tool_calls",
                f"choice {turn.index} has more than {limits.max_tool_calls} tool calls",
            )
            return None
        over: tuple[str, str, int] | None = None
        id_size = len(cid) if cid.isascii() else utf8_len(cid)
        name_size = len(name) if name.isascii() else utf8_len(name)
        type_size = (len(typ) if typ.isascii() else utf8_len(typ)) if typ_sent else 0
        item_size = utf8_len(item_id) if item_id else 0
        if id_size > limits.max_id_bytes:
            over, cid = ("max_id_bytes", "id", limits.max_id_bytes), ""
            id_size = 0
        if item_size > limits.max_id_bytes:
            over, item_id = ("max_id_bytes", "item id", limits.max_id_bytes), ""
            item_size = 0
        if name_size > limits.max_name_bytes:
            over, name = over or ("max_name_bytes", "name", limits.max_name_bytes), ""
            name_size = 0
        if type_size > limits.max_id_bytes:
            over, typ = over or ("max_id_bytes", "type", limits.max_id_bytes), ""
            type_size = 0
        if not self.count_header_bytes(id_size + name_size + type_size + item_size):
            return None
        return Header(cid, name, typ, item_id, over)

    def register_call(self, turn: Turn, call: ToolCall, over: tuple[str, str, int] | None) -> None:
        """Add a call :meth:`admit_call` admitted to ``turn``, with its event; a header past a
        limit (``over``) marks it to end aborted."""
        turn.add_call(call)
        self.events.append(
            ToolCallOpened(
                choice=turn.index, ordinal=call.ordinal, index=call.index, id=call.id,
                name=call.name, type=call.type,
            )
        )  # fmt: skip
        if call.id.isspace():
            self.blank_id(call)
        if over is not None:
            self.header_over_limit(call, *over)

    def blank_id(self, call: ToolCall) -> None:
        self.anomaly(
            "blank_id",
            f"choice {call.choice} call {call.ordinal}: the id is only whitespace "
            f"({call.id!r}); kept as sent",
            call.choice,
        )

    def header_over_limit(self, call: ToolCall, limit: str, what: str, size: int) -> None:
        """A call's id, name or type would pass ``limit`` (for :meth:`ToolCall.merge`)."""
        call.exceed(limit)
        self.anomaly(
            "limit_exceeded",
            f"choice {call.choice} call {call.ordinal}: its {what} would exceed {size} bytes; "
            "its later fragments are dropped and the call will end aborted",
            call.choice,
        )

    def over_limit(self, call: ToolCall) -> None:
        call.exceed("max_argument_bytes", drop=True)
        self.anomaly(
            "limit_exceeded",
            f"choice {call.choice} call {call.ordinal}: arguments exceed "
            f"{self.limits.max_argument_bytes} bytes; the call will end aborted",
            call.choice,
        )

    def limit(self, name: str, detail: str) -> None:
        self.anomaly("limit_exceeded", detail)
        self.end("limit", f"limit:{name}")

    # -- ending ---------------------------------------------------------------------------------
    def end(self, how: str, reason: str | None) -> None:
        self.status = stream_next(self.status, "end")
        self.end_how = how
        self.end_reason = reason
        for index in sorted(self.turns):
            self.end_turn(self.turns[index], how, reason)
        complete = bool(self.turns) and all(t.complete for t in self.turns.values())
        self.events.append(StreamEnded(how=how, reason=reason, complete=complete))

    def end_turn(self, turn: Turn, how: str, reason: str | None) -> None:
        self.events.extend(
            turn.end(how, reason, repair=self.repair_json, max_depth=self.limits.max_json_depth)
        )
        if turn.incomplete_reason == NO_TOOL_CALLS:
            self.anomaly(
                "no_tool_calls",
                f"choice {turn.index}: finish_reason {turn.finish_reason!r} but no tool call "
                "arrived; the turn is not complete",
                turn.index,
            )
        self.events.append(
            TurnEnded(
                choice=turn.index, finish_reason=turn.finish_reason, complete=turn.complete,
                reason=turn.incomplete_reason,
            )
        )  # fmt: skip


#: the most characters of an error payload shown as JSON in a reason (a string message is kept
#: whole)
_ERROR_JSON_CHARS: Final = 4096


def error_message(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message
    elif isinstance(error, str) and error:
        return error
    return render_json(error, _ERROR_JSON_CHARS)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def json_repr(value: Any) -> str:
    return f"{json_type(value)} {render_json(value, 60)}"


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
#: the largest choice or tool-call index accepted (the store keeps them as 32-bit integers)
MAX_INDEX: Final = 2**31 - 1
#: how deep ``usage`` may nest (the object itself is level 1)
_MAX_USAGE_DEPTH: Final = 32


def _flat_usage_ok(obj: dict[str, Any], *, nested: bool) -> bool:
    """The common shape of ``usage``, checked with no work list: numbers, strings and nulls,
    and (``nested``) objects of those (prompt_tokens_details). ``x - x != 0.0`` is true only for
    an infinite or NaN x. ``False``: let the full check decide."""
    for item in obj.values():
        kind = type(item)
        if kind is int:
            if item > INT64_MAX or item < INT64_MIN:
                return False
        elif kind is float:
            if item - item != 0.0:
                return False
        elif kind is dict and nested:
            if not _flat_usage_ok(item, nested=False):
                return False
        elif kind is dict or kind is list:
            return False
    return True


def usage_problem(usage: dict[str, Any]) -> str | None:
    """Why ``usage`` cannot be kept (stored as JSON on every engine), or ``None``: integers must
    fit in signed 64 bits, floats be finite, nesting at most 32 deep. Iterative."""
    if _flat_usage_ok(usage, nested=True):
        return None
    todo: list[tuple[Any, int]] = [(usage, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > _MAX_USAGE_DEPTH:
            return f"objects or lists nested deeper than {_MAX_USAGE_DEPTH}"
        for item in value.values() if type(value) is dict else value:
            kind = type(item)
            if kind is int:
                if not INT64_MIN <= item <= INT64_MAX:
                    return "an integer outside signed 64 bits"
            elif kind is float:
                if not math.isfinite(item):
                    return "a number beyond a double (infinite or NaN)"
            elif kind is dict or kind is list:
                todo.append((item, depth + 1))
    return None
