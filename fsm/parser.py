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

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import orjson

from fsm.errors import LocalProtocolError, RemoteProtocolError
from fsm.events import (
    AnomalyDetected,
    ContentDelta,
    Event,
    FinishReasonReceived,
    ReasoningDelta,
    StreamEnded,
    ToolCallOpened,
    ToolCallUpdated,
    TurnEnded,
    UsageReceived,
    _cd_choice,
    _cd_text,
    _rd_choice,
    _rd_text,
    _refusal_delta,
)
from fsm.jsonsyntax import render_json
from fsm.jsonutil import MAX_JSON_DEPTH as JSONUTIL_MAX_JSON_DEPTH
from fsm.sse import EventTooLargeError, SSEFramer
from fsm.states import KNOWN_FINISH_REASONS, NO_TOOL_CALLS, StreamState, ToolCallState
from fsm.toolcall import ToolCall, loads_strict
from fsm.turn import CONTENT, REASONING, REFUSAL, Anomaly, ParseResult, Turn, _Meta

__all__ = ["KNOWN_FINISH_REASONS", "Anomaly", "Limits", "ParseResult", "StreamParser", "Turn"]

#: receive_data() hands bigger buffers to the framer in pieces of this size.
_WINDOW: Final = 64 * 1024

_new_event: Final = object.__new__
_ACCUMULATING: Final = ToolCallState.ACCUMULATING

_log = logging.getLogger(__name__)

#: anomalies of one kind kept with their details (and reported as events); more are only counted.
MAX_ANOMALIES_PER_KIND: Final = 100


#: the most ``max_name_bytes`` / ``max_id_bytes`` may be: the longest value the store can index
#: on PostgreSQL (a b-tree entry holds about 2.7 KB; 512 bytes leaves room for the rest of a key)
MAX_INDEXED_BYTES: Final = 512
#: the most ``max_json_depth`` may be: :data:`fsm.jsonutil.MAX_JSON_DEPTH`, the one nesting
#: limit of every JSON value fsm keeps (arguments, provider items, what the store keeps as JSON)
MAX_JSON_DEPTH: Final = JSONUTIL_MAX_JSON_DEPTH


@dataclass(frozen=True, slots=True)
class Limits:
    """Safe bounds on what one stream may make the parser hold. All sizes are UTF-8 bytes.

    Past ``max_argument_bytes``, ``max_name_bytes`` or ``max_id_bytes`` (a call's id or type) a
    call's further fragments are dropped and the call ends ``aborted`` (reason
    ``limit:<name>``); arguments nested deeper than ``max_json_depth`` end the call ``aborted``
    (``limit:max_json_depth``). Past any other limit, or a stream-level identifier (response
    id, model, system fingerprint, finish_reason) longer than ``max_id_bytes``, the whole stream
    ends: every live call becomes ``aborted`` with the limit's name as reason.

    Every limit may be lowered; ``max_name_bytes`` and ``max_id_bytes`` may not be raised above
    512 (the store indexes those values), nor ``max_json_depth`` above 512 (the one nesting
    limit of every JSON value fsm keeps, :data:`fsm.jsonutil.MAX_JSON_DEPTH`: a provider item
    kept verbatim nested deeper ends the stream, ``limit:max_json_depth``).
    """

    #: UTF-8 bytes of arguments kept per tool call.
    max_argument_bytes: int = 8 * 1024 * 1024
    #: tool calls per choice.
    max_tool_calls: int = 1024
    #: bytes of one SSE event (one chunk's JSON text).
    max_event_bytes: int = 16 * 1024 * 1024
    #: UTF-8 bytes of content + reasoning + refusal text per choice.
    max_text_bytes: int = 64 * 1024 * 1024
    #: distinct choice indices per stream.
    max_choices: int = 128
    #: UTF-8 bytes of a tool call's name (providers allow 64 characters).
    max_name_bytes: int = MAX_INDEXED_BYTES
    #: UTF-8 bytes of a call's id and of its type; and of the response id, model, system
    #: fingerprint and each finish_reason.
    max_id_bytes: int = MAX_INDEXED_BYTES
    #: UTF-8 bytes of text, arguments, names and ids accepted over the whole stream (all choices).
    max_stream_bytes: int = 64 * 1024 * 1024
    #: nesting of the arguments of a finished call (arrays and objects in one another), and of
    #: each provider item kept verbatim (Responses output item, Anthropic content block).
    max_json_depth: int = 512
    #: provider items kept verbatim per stream (Responses output items, Anthropic content blocks
    #: and citations): each costs about 0.5 KB besides its JSON, so this bounds that overhead.
    max_items: int = 16384

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
        for name in ("max_name_bytes", "max_id_bytes"):
            if getattr(self, name) > MAX_INDEXED_BYTES:
                raise ValueError(
                    f"Limits.{name} must be at most {MAX_INDEXED_BYTES}: {MAX_INDEXED_BYTES} bytes "
                    "is the most the store can index on PostgreSQL, got "
                    f"{getattr(self, name)!r}"
                )
        if self.max_json_depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"Limits.max_json_depth must be at most {MAX_JSON_DEPTH} (the nesting every "
                f"JSON value fsm keeps is limited to), got {self.max_json_depth!r}"
            )


_DEFAULT_LIMITS: Final = Limits()

#: the values of ``StreamParser(format=...)``
_FORMAT_NAMES: Final = ("auto", "chat", "responses", "anthropic")


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
        if format not in _FORMAT_NAMES:
            raise ValueError(
                f"StreamParser(format=...) must be one of {', '.join(_FORMAT_NAMES)}, "
                f"got {format!r}"
            )
        self.repair_json = repair_json
        self.limits = limits or _DEFAULT_LIMITS
        self._framer = SSEFramer(self.limits.max_event_bytes)
        self._meta = _Meta()
        self._turns: dict[int, Turn] = {}
        self._events: list[Event] = []
        self._anomalies: list[Anomaly] = []
        self._anomaly_counts: dict[str, int] = {}
        self._status = _OPEN
        self._event_number = 0
        self._offset: int | None = None
        self._end_how: str | None = None
        self._end_reason: str | None = None
        self._error: RemoteProtocolError | None = None
        self._framer_usable = True
        self._meta_missing = True
        self._max_argument_bytes = self.limits.max_argument_bytes
        #: bytes of text, arguments, names and ids accepted so far (Limits.max_stream_bytes)
        self._stream_bytes = 0
        self._max_stream_bytes = self.limits.max_stream_bytes
        self._max_text_bytes = self.limits.max_text_bytes
        #: the stream format, ``None`` until detected; the error code of an error end
        self._format: str | None = None if format == "auto" else format
        self._error_code: str | None = None
        if format != "chat":
            from fsm.formats import install

            install(self, format)

    # -- public API ---------------------------------------------------------------------------
    @property
    def turns(self) -> dict[int, Turn]:
        """``{choice_index: Turn}``, a live view."""
        return self._turns

    @property
    def format(self) -> str | None:
        """The stream format (``"chat"``, ``"responses"``, ``"anthropic"``), ``None`` while it
        is not yet detected."""
        return self._format

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every anomaly so far, in order."""
        return list(self._anomalies)

    @property
    def ended(self) -> bool:
        """Whether the stream has ended (``[DONE]``, an error, EOF, abort, a limit)."""
        return self._status is not _OPEN

    def result(self) -> ParseResult:
        """A snapshot of the response so far (the :class:`Turn` objects are the live ones)."""
        meta = self._meta
        return ParseResult(
            response_id=meta.response_id,
            model=meta.model,
            created=meta.created,
            system_fingerprint=meta.system_fingerprint,
            usage=meta.usage,
            anomalies=list(self._anomalies),
            turns=[self._turns[i] for i in sorted(self._turns)],
            end_how=self._end_how,
            end_reason=self._end_reason,
            error=self._error,
            anomaly_counts=dict(self._anomaly_counts),
            event_count=self._event_number,
            format=self._format,
            error_code=self._error_code,
        )

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Feed raw SSE bytes, split anywhere. Returns the events they complete.

        The list holds every event of ``data``: for a whole recorded stream it is proportional
        to the stream (feed network-sized reads to keep it small)."""
        self._check_open("receive_data")
        if type(data) is not bytes and not isinstance(data, bytes | bytearray | memoryview):
            raise LocalProtocolError(
                f"receive_data() takes bytes, bytearray or memoryview, not {type(data).__name__} "
                "(encode text as UTF-8, or pass chunks to receive_chunk())"
            )
        if self._status is _ENDED:
            if data and self._framer_usable:
                for _name, _payload, _offset in self._feed_framer(bytes(data)):
                    self._event_number += 1
                    self._after_end(_name, _payload)
            # after an oversized event nothing more is framed: the rest is ignored silently, as
            # the same bytes would have been had they come in the same read
            return self._take()
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
        self._frames(frames)
        if too_large is not None and self._status is _OPEN:
            self._event_number += 1
            self._offset = too_large.offset
            self._anomaly("limit_exceeded", str(too_large))
            self._end("limit", "limit:max_event_bytes")
        return self._take()

    def _frames(self, frames: list[tuple[str, bytes, int]]) -> None:
        loads = orjson.loads
        for name, payload, offset in frames:
            self._event_number += 1
            self._offset = offset
            if payload[:1] == b"{" and not name and self._status is _OPEN:
                try:
                    chunk = loads(payload)
                except orjson.JSONDecodeError:
                    chunk = self._decode_slow(payload)
                self._process(chunk)
            else:
                self._rare_event(name, payload)

    def _rare_event(self, name: str, payload: bytes) -> None:
        # An event named "error" is an error whatever its data, "[DONE]" included: test the name
        # before the data.
        if self._status is not _OPEN:
            self._anomaly("data_after_end", "an SSE event after the end of the stream")
        elif name == "error":
            self._error_event(payload)
        elif payload.strip() == b"[DONE]":
            self._end("done", None)
        elif not payload.strip():
            self._anomaly("empty_event", "an SSE event with empty data was ignored")
        else:
            self._process(self._decode_slow(payload))

    def _decode_slow(self, payload: bytes | str) -> Any:
        try:
            return loads_strict(payload)
        except (ValueError, RecursionError) as exc:
            self._fail(f"the data is not valid JSON ({exc})", None)

    def receive_chunk(self, chunk: Any) -> list[Event]:
        """Feed one chunk: a dict, a JSON ``str``/``bytes``, an ``openai`` SDK
        ``ChatCompletionChunk``, or any pydantic model of the chunk (read through its
        ``model_dump(exclude_unset=True, by_alias=True)``). The string ``"[DONE]"`` ends the
        stream."""
        if type(chunk) is dict and self._status is _OPEN:
            # the common case first: a decoded chunk while the stream is open
            self._event_number += 1
            self._offset = None
            self._process(chunk)
            events = self._events
            self._events = []
            return events
        self._check_open("receive_chunk")
        self._event_number += 1
        self._offset = None
        if isinstance(chunk, str | bytes | bytearray):
            text = chunk.strip()
            if text in ("[DONE]", b"[DONE]"):
                self._done_sentinel()
                return self._take()
            if self._status is not _OPEN:
                self._anomaly("data_after_end", "a chunk after the end of the stream")
                return self._take()
            chunk = self._decode_slow(bytes(text) if isinstance(text, bytearray) else text)
        elif not isinstance(chunk, dict):
            dump = getattr(chunk, "model_dump", None)
            if dump is None:
                raise LocalProtocolError(
                    "receive_chunk() takes a dict, a JSON str/bytes or a pydantic chunk model, "
                    f"not {type(chunk).__name__}"
                )
            chunk = dump(exclude_unset=True, by_alias=True)
        if self._status is not _OPEN:
            self._anomaly("data_after_end", "a chunk after the end of the stream")
            return self._take()
        self._process(chunk)
        return self._take()

    def receive_eof(self) -> list[Event]:
        """The transport closed cleanly. Ends the stream if ``[DONE]`` did not."""
        self._check_open("receive_eof")
        if self._status is _OPEN:
            if self._framer.close():
                self._anomaly(
                    "incomplete_event_at_eof",
                    "the input ended inside an SSE event; the partial event was discarded",
                )
            self._end("eof", None)
        self._status = _CLOSED
        return self._take()

    def abort(self, reason: str = "aborted") -> list[Event]:
        """The transport failed or the caller cancelled: every live call becomes ``aborted``
        with ``reason``. A no-op (returns ``[]``) once the stream has already ended."""
        if self._status is _OPEN:
            self._end("aborted", reason or "aborted")
        if self._status is _ENDED:
            self._status = _CLOSED
        return self._take()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._status is _FAILED:
            assert self._error is not None
            raise RemoteProtocolError(
                f"the stream already failed ({self._error.reason}); no more input is accepted",
                event_number=self._error.event_number,
                byte_offset=self._error.byte_offset,
                path=self._error.path,
            )
        if self._status is _CLOSED:
            raise LocalProtocolError(
                f"{what}() called after the stream was closed by receive_eof() or abort(); "
                "use a new StreamParser for a new response"
            )

    # -- hooks a stream format replaces (fsm.formats installs its own on the instance) --
    def _after_end(self, name: str, payload: bytes) -> None:
        """An SSE event after the end of the stream."""
        self._anomaly("data_after_end", "an SSE event after the end of the stream")

    def _done_sentinel(self) -> None:
        """``[DONE]`` fed as a chunk: the end of a Chat Completions stream."""
        if self._status is _OPEN:
            self._end("done", None)
        else:
            self._anomaly("data_after_end", "[DONE] after the end of the stream")

    def _typed_event(self, chunk: dict[str, Any]) -> None:
        """A chunk with no choices but a ``type``: an event of another format is a protocol
        error (a stream that changes format midway); any other ``type`` is ignored."""
        from fsm.formats import foreign_format

        other = foreign_format(chunk.get("type"))
        if other is not None:
            self._fail(
                f"the stream changed format: a {other} event ({chunk['type']!r}) in a Chat "
                "Completions stream",
                "type",
            )

    def _feed_framer(self, data: bytes) -> list[tuple[str, bytes, int]]:
        try:
            return self._framer.feed(data)
        except EventTooLargeError as exc:
            self._framer_usable = False
            return exc.events

    def _take(self) -> list[Event]:
        events = self._events
        self._events = []
        return events

    def _anomaly(self, kind: str, detail: str, choice: int | None = None) -> None:
        # Every anomaly is counted; the first few of each kind are kept with their details and
        # reported as events, so that a hostile stream (a million events after [DONE]) cannot
        # grow memory without bound.
        count = self._anomaly_counts.get(kind, 0) + 1
        self._anomaly_counts[kind] = count
        if count > MAX_ANOMALIES_PER_KIND:
            return
        anomaly = Anomaly(kind, detail, choice, self._event_number)
        _log.debug("anomaly %s (choice %s, event %d): %s", kind, choice, self._event_number, detail)
        self._anomalies.append(anomaly)
        self._events.append(AnomalyDetected(kind=kind, detail=detail, choice=choice))

    def _fail(self, reason: str, path: str | None) -> NoReturn:
        error = RemoteProtocolError(
            reason, event_number=self._event_number, byte_offset=self._offset, path=path
        )
        self._error = error
        self._end("protocol_error", "protocol_error")
        self._status = _FAILED
        error.events = self._take()
        raise error

    def _error_event(self, payload: bytes) -> None:
        # The message: the JSON error's message when the data is JSON, else the data as text,
        # else "error event".
        message: str
        try:
            obj = loads_strict(payload) if payload.strip() else None
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and "error" in obj:
            message = _error_message(obj["error"])
        elif isinstance(obj, dict) or (obj is not None and not isinstance(obj, str)):
            message = _error_message(obj)
        elif isinstance(obj, str) and obj.strip():
            message = obj
        else:
            message = payload.decode("utf-8", "replace").strip() or "error event"
        self._end("error", message)

    def _process(self, chunk: Any) -> None:
        # The hot path: one call per chunk, with the common shapes handled inline and every
        # rare case (new turn, new call, text, finish, errors) out of line.
        if type(chunk) is not dict:
            self._fail(f"a chunk must be a JSON object, got {_json_type(chunk)}", None)
        if self._meta_missing:
            self._metadata(chunk)
            if self._status is not _OPEN:
                return
        usage = chunk.get("usage")
        if usage is not None:
            self._usage(usage)
        choices = chunk.get("choices")
        if choices:
            if type(choices) is not list:
                self._fail(f"must be a list or null, got {_json_type(choices)}", "choices")
            turns = self._turns
            ci = -1  # counted by hand: cheaper than enumerate() for the usual single choice
            for choice in choices:
                ci += 1
                if type(choice) is not dict:
                    self._fail(f"must be an object, got {_json_type(choice)}", f"choices[{ci}]")
                index = choice.get("index", 0)
                if type(index) is not int or index < 0:
                    self._bad_choice_index(ci, index)
                turn = turns.get(index)
                if turn is None:
                    if index > _MAX_INDEX:
                        self._bad_choice_index(ci, index)
                    turn = self._new_turn(index)
                    if turn is None:
                        return
                delta = choice.get("delta")
                if delta:
                    if type(delta) is not dict:
                        self._fail(
                            f"must be an object, got {_json_type(delta)}", f"choices[{ci}].delta"
                        )
                    if turn.finish_seen and _has_payload(delta):
                        self._anomaly(
                            "delta_after_finish",
                            f"choice {index} sent data after finish_reason {turn.finish_reason!r}",
                            index,
                        )
                    tool_calls = delta.get("tool_calls")
                    if (tool_calls is None or len(delta) > 1) and not self._texts(turn, delta, ci):
                        return
                    if tool_calls:
                        if type(tool_calls) is not list:
                            self._fail(
                                f"must be a list or null, got {_json_type(tool_calls)}",
                                f"choices[{ci}].delta.tool_calls",
                            )
                        by_index = turn.by_index
                        ti = -1  # counted by hand, as ci
                        for entry in tool_calls:
                            ti += 1
                            # The hottest case inline: a continuation {"index": i, "function":
                            # {"arguments": "..."}} of a call already accumulating, routed by
                            # Turn.route's first rule (index, no id), within the limits
                            # _arguments checks, appended by ToolCall.append (the one append);
                            # anything else (a limit passed included) goes to _tool_delta.
                            if type(entry) is dict and len(entry) == 2:
                                tindex = entry.get("index")
                                fn = entry.get("function")
                                if type(tindex) is int and type(fn) is dict and len(fn) == 1:
                                    fragment = fn.get("arguments")
                                    call = by_index.get(tindex)
                                    if (
                                        type(fragment) is str
                                        and fragment.isascii()
                                        and call is not None
                                        and call.state is _ACCUMULATING
                                        and call.over_limit is None
                                    ):
                                        size = len(fragment)
                                        stream = self._stream_bytes + size
                                        if (
                                            call.argument_bytes + size <= self._max_argument_bytes
                                            and stream <= self._max_stream_bytes
                                        ):
                                            self._stream_bytes = stream
                                            self._events.append(call.append(fragment, size))
                                            continue
                            self._tool_delta(turn, entry, ci, ti)
                            if self._status is not _OPEN:
                                return
                    elif tool_calls is not None and type(tool_calls) is not list:
                        self._fail(
                            f"must be a list or null, got {_json_type(tool_calls)}",
                            f"choices[{ci}].delta.tool_calls",
                        )
                elif delta is not None and type(delta) is not dict:
                    self._fail(
                        f"must be an object, got {_json_type(delta)}", f"choices[{ci}].delta"
                    )
                finish = choice.get("finish_reason")
                if finish is not None:
                    self._finish(turn, finish, ci)
                    if self._status is not _OPEN:
                        return
        elif choices is not None and type(choices) is not list:
            self._fail(f"must be a list or null, got {_json_type(choices)}", "choices")
        elif "type" in chunk:
            self._typed_event(chunk)
        error = chunk.get("error")
        if error is not None:
            self._end("error", _error_message(error))

    def _metadata(self, chunk: dict[str, Any]) -> None:
        meta = self._meta
        rid = chunk.get("id")
        if meta.response_id is None and type(rid) is str and rid:
            if not self._identifier(rid, "the response id"):
                return
            meta.response_id = rid
        model = chunk.get("model")
        if model is None:
            model = chunk.get("model_id")  # watsonx
        if meta.model is None and type(model) is str and model:
            if not self._identifier(model, "the model"):
                return
            meta.model = model
        created = chunk.get("created")
        if meta.created is None and type(created) is int:
            if _INT64_MIN <= created <= _INT64_MAX:
                meta.created = created
            else:
                self._anomaly(
                    "invalid_created", "created is outside signed 64-bit integers; ignored"
                )
        fp = chunk.get("system_fingerprint")
        if meta.system_fingerprint is None and type(fp) is str and fp:
            if not self._identifier(fp, "the system fingerprint"):
                return
            meta.system_fingerprint = fp
        self._meta_missing = meta.response_id is None or meta.model is None

    def _identifier(self, value: str, what: str) -> bool:
        """Count a stream-level identifier; ``False`` when a limit ended the stream."""
        size = len(value) if value.isascii() else _utf8_len(value)
        if size > self.limits.max_id_bytes:
            self._limit("max_id_bytes", f"{what} is longer than {self.limits.max_id_bytes} bytes")
            return False
        self._stream_bytes += size
        if self._stream_bytes > self._max_stream_bytes:
            self._stream_limit()
            return False
        return True

    def count_header_bytes(self, size: int) -> bool:
        """Add ``size`` bytes to what the stream holds; ``False`` when that ended the stream."""
        self._stream_bytes += size
        if self._stream_bytes > self._max_stream_bytes:
            self._stream_limit()
            return False
        return True

    def _stream_limit(self) -> None:
        self._limit(
            "max_stream_bytes",
            f"the stream holds more than {self._max_stream_bytes} bytes of text, arguments, "
            "names and ids",
        )

    def _usage(self, usage: Any) -> None:
        if type(usage) is not dict:
            self._fail(f"must be an object or null, got {_json_type(usage)}", "usage")
        problem = _usage_problem(usage)
        if problem is not None:
            self._anomaly(
                "invalid_usage",
                f"usage ignored: it holds {problem}"
                + ("; the previous usage is kept" if self._meta.usage is not None else ""),
            )
            return
        self._meta.usage = usage
        self._events.append(UsageReceived(usage=usage))

    def _bad_choice_index(self, ci: int, index: Any) -> NoReturn:
        self._fail(
            f"must be a non-negative integer (at most {_MAX_INDEX}), got {_json_repr(index)}",
            f"choices[{ci}].index",
        )

    def _new_turn(self, index: int) -> Turn | None:
        if len(self._turns) >= self.limits.max_choices:
            self._limit("max_choices", f"more than {self.limits.max_choices} choices")
            return None
        turn = self._turns[index] = Turn(index, self._meta)
        return turn

    def _finish(self, turn: Turn, finish: Any, ci: int) -> None:
        if type(finish) is not str:
            self._fail(
                f"must be a string or null, got {_json_type(finish)}",
                f"choices[{ci}].finish_reason",
            )
        if not finish:
            return
        if finish not in KNOWN_FINISH_REASONS:
            if _utf8_len(finish) > self.limits.max_id_bytes:
                self._limit(
                    "max_id_bytes",
                    f"choice {turn.index}: a finish_reason is longer than "
                    f"{self.limits.max_id_bytes} bytes",
                )
                return
            self._anomaly(
                "unknown_finish_reason",
                f"finish_reason {finish!r} is not a known value; treated like 'stop'",
                turn.index,
            )
        turn.finish(finish)
        self._events.append(FinishReasonReceived(choice=turn.index, finish_reason=finish))

    def _text(self, turn: Turn, value: str, field: int) -> bool:
        """Keep one text fragment (checked to be a non-empty str); ``False`` when a limit ended
        the stream."""
        nbytes = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
        if turn.text_bytes + nbytes > self._max_text_bytes:
            self._limit("max_text_bytes", f"choice {turn.index} text exceeds the limit")
            return False
        stream = self._stream_bytes + nbytes
        if stream > self._max_stream_bytes:
            self._stream_limit()
            return False
        self._stream_bytes = stream
        turn.append_text(field, value, nbytes)
        return True

    def _texts(self, turn: Turn, delta: dict[str, Any], ci: int) -> bool:
        """Apply content, reasoning, refusal and a legacy ``function_call``; ``False`` when a
        limit ended the stream. Content and reasoning (a fragment in most chunks) are kept
        here, within the limits :meth:`_text` checks (which takes over past one)."""
        content = delta.get("content")
        if content is not None:
            if type(content) is not str:
                self._bad_text(content, "content", ci)
            if content:
                nbytes = len(content) if content.isascii() else _utf8_len(content)
                stream = self._stream_bytes + nbytes
                if (
                    turn.text_bytes + nbytes > self._max_text_bytes
                    or stream > self._max_stream_bytes
                ):
                    return self._text(turn, content, CONTENT)  # past a limit: it ends the stream
                self._stream_bytes = stream
                turn.append_text(CONTENT, content, nbytes)
                event: Event = _new_event(ContentDelta)  # built through its slots (fsm.events)
                _cd_choice(event, turn.index)
                _cd_text(event, content)
                self._events.append(event)
            if len(delta) == 1:
                return True  # the common {"content": "..."}: nothing else to look for
        reasoning = delta.get("reasoning_content")
        field_name = "reasoning_content"
        if reasoning is None:
            reasoning = delta.get("reasoning")
            field_name = "reasoning"
        if reasoning is not None:
            if type(reasoning) is not str:
                self._bad_text(reasoning, field_name, ci)
            if reasoning:
                nbytes = len(reasoning) if reasoning.isascii() else _utf8_len(reasoning)
                stream = self._stream_bytes + nbytes
                if (
                    turn.text_bytes + nbytes > self._max_text_bytes
                    or stream > self._max_stream_bytes
                ):
                    return self._text(turn, reasoning, REASONING)
                self._stream_bytes = stream
                turn.append_text(REASONING, reasoning, nbytes)
                event = _new_event(ReasoningDelta)  # built through its slots (fsm.events)
                _rd_choice(event, turn.index)
                _rd_text(event, reasoning)
                self._events.append(event)
        refusal = delta.get("refusal")
        if refusal is not None:
            if type(refusal) is not str:
                self._bad_text(refusal, "refusal", ci)
            if refusal:
                if not self._text(turn, refusal, REFUSAL):
                    return False
                self._events.append(_refusal_delta(turn.index, refusal))
        function_call = delta.get("function_call")
        if function_call is not None:
            return self._function_call(turn, function_call, ci)
        return True

    def _function_call(self, turn: Turn, fc: Any, ci: int) -> bool:
        """Apply a legacy ``delta.function_call`` (spec "Rules added in round 2"): the one call
        of its choice, id ``""``, merged and appended like any call. ``False`` when a limit
        ended the stream."""
        path = f"choices[{ci}].delta.function_call"
        if type(fc) is not dict:
            self._fail(f"must be an object or null, got {_json_type(fc)}", path)
        name = fc.get("name")
        arguments = fc.get("arguments")
        if name is not None and type(name) is not str:
            self._fail(f"must be a string or null, got {_json_repr(name)}", f"{path}.name")
        if arguments is not None and type(arguments) is not str:
            self._fail(
                f"must be a string or null, got {_json_repr(arguments)}", f"{path}.arguments"
            )
        call = turn.legacy_call
        if call is None and turn.call_count:
            self._fail(
                "a choice cannot mix the legacy function_call with tool_calls (it already has "
                "tool calls)",
                path,
            )
        if call is None:
            if not name and not arguments:
                return True  # nothing to open a call with
            call = self._open(turn, None, "", name or "", "", legacy=True)
            if call is None:
                return False
        elif name and call.merge(None, name, None, self):
            self._events.append(
                ToolCallUpdated(
                    choice=turn.index, ordinal=call.ordinal, index=None, id="", name=call.name
                )
            )
        if arguments and call.over_limit is None:
            self._arguments(call, arguments, _utf8_len(arguments))
        return self._status is _OPEN

    def _bad_text(self, value: Any, field: str, ci: int) -> NoReturn:
        self._fail(
            f"must be a string or null, got {_json_type(value)}", f"choices[{ci}].delta.{field}"
        )

    def _tool_delta(self, turn: Turn, entry: Any, ci: int, ti: int) -> None:
        if turn.legacy_call is not None:
            self._fail(
                "a choice cannot mix tool_calls with the legacy function_call (it already has a "
                "function_call)",
                f"choices[{ci}].delta.tool_calls[{ti}]",
            )
        if type(entry) is not dict:
            self._fail(
                f"must be an object, got {_json_type(entry)}",
                f"choices[{ci}].delta.tool_calls[{ti}]",
            )
        index = entry.get("index")
        fn = entry.get("function")
        if len(entry) > (index is not None) + (fn is not None):
            cid = entry.get("id")
            typ = entry.get("type")
            if cid is not None and type(cid) is not str:
                self._bad_field(ci, ti, "id", "a string or null", cid)
            if typ is not None and type(typ) is not str:
                self._bad_field(ci, ti, "type", "a string or null", typ)
        else:
            cid = typ = None
        if fn is not None:
            if type(fn) is not dict:
                self._bad_field(ci, ti, "function", "an object or null", fn)
            arguments = fn.get("arguments")
            if arguments is not None and type(arguments) is not str:
                self._bad_field(ci, ti, "function.arguments", "a string or null", arguments)
            if len(fn) > (arguments is not None):
                name = fn.get("name")
                if name is not None and type(name) is not str:
                    self._bad_field(ci, ti, "function.name", "a string or null", name)
            else:
                name = None
        else:
            name = arguments = None
        if index is not None and (type(index) is not int or index < 0):
            self._bad_index(ci, ti, index)

        try:
            call = turn.route(index, cid, name)
        except LookupError:
            self._anomaly(
                "orphan_continuation",
                f"choice {turn.index}: a tool-call fragment with no index, id or name and no "
                "open call was dropped",
                turn.index,
            )
            return
        if call is None:
            if index is not None and index > _MAX_INDEX:
                self._bad_index(ci, ti, index)
            call = self._open(turn, index, cid or "", name or "", typ or "")
            if call is None:
                return
        elif (cid or name or typ) and call.merge(cid, name, typ, self):
            self._events.append(
                ToolCallUpdated(
                    choice=turn.index, ordinal=call.ordinal, index=call.index, id=call.id,
                    name=call.name,
                )
            )  # fmt: skip
        if not arguments or call.over_limit is not None:
            return
        self._arguments(call, arguments, _utf8_len(arguments))

    def _arguments(self, call: ToolCall, fragment: str, nbytes: int) -> None:
        """Append an argument fragment of ``nbytes`` UTF-8 bytes within the call's and the
        stream's limits (:meth:`ToolCall.append`); past the call's, it ends aborted."""
        if call.argument_bytes + nbytes > self._max_argument_bytes:
            self._over_limit(call)
            return
        stream = self._stream_bytes + nbytes
        if stream > self._max_stream_bytes:
            self._stream_limit()
            return
        self._stream_bytes = stream
        self._events.append(call.append(fragment, nbytes))

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
        self._turns[call.choice].note_id(call)
        if call.id.isspace():
            self._blank_id(call)

    def _open(
        self, turn: Turn, index: int | None, cid: str, name: str, typ: str, legacy: bool = False
    ) -> ToolCall | None:
        if turn.call_count >= self.limits.max_tool_calls:
            self._limit(
                "max_tool_calls",
                f"choice {turn.index} has more than {self.limits.max_tool_calls} tool calls",
            )
            return None
        limits = self.limits
        over: tuple[str, str, int] | None = None
        id_size = len(cid) if cid.isascii() else _utf8_len(cid)
        name_size = len(name) if name.isascii() else _utf8_len(name)
        type_size = len(typ) if typ.isascii() else _utf8_len(typ)
        if id_size > limits.max_id_bytes:
            over, cid = ("max_id_bytes", "id", limits.max_id_bytes), ""
            id_size = 0
        if name_size > limits.max_name_bytes:
            over, name = over or ("max_name_bytes", "name", limits.max_name_bytes), ""
            name_size = 0
        if type_size > limits.max_id_bytes:
            over, typ = over or ("max_id_bytes", "type", limits.max_id_bytes), ""
            type_size = 0
        self._stream_bytes += id_size + name_size + type_size
        if self._stream_bytes > self._max_stream_bytes:
            self._stream_limit()
            return None
        call = ToolCall(
            choice=turn.index,
            ordinal=turn.call_count,
            index=index,
            id=cid,
            name=name,
            type=typ,
            legacy=legacy,
        )
        turn.add_call(call)
        self._events.append(
            ToolCallOpened(
                choice=turn.index, ordinal=call.ordinal, index=index, id=cid, name=name,
                type=call.type,
            )
        )  # fmt: skip
        if cid.isspace():
            self._blank_id(call)
        if over is not None:
            self.header_over_limit(call, *over)
        return call

    def _blank_id(self, call: ToolCall) -> None:
        self._anomaly(
            "blank_id",
            f"choice {call.choice} call {call.ordinal}: the id is only whitespace "
            f"({call.id!r}); kept as sent",
            call.choice,
        )

    def header_over_limit(self, call: ToolCall, limit: str, what: str, size: int) -> None:
        """A call's id, name or type would pass ``limit`` (for :meth:`ToolCall.merge`)."""
        call.exceed(limit)
        self._anomaly(
            "limit_exceeded",
            f"choice {call.choice} call {call.ordinal}: its {what} would exceed {size} bytes; "
            "its later fragments are dropped and the call will end aborted",
            call.choice,
        )

    def _over_limit(self, call: ToolCall) -> None:
        call.exceed("max_argument_bytes", drop=True)
        self._anomaly(
            "limit_exceeded",
            f"choice {call.choice} call {call.ordinal}: arguments exceed "
            f"{self.limits.max_argument_bytes} bytes; the call will end aborted",
            call.choice,
        )

    def _bad_index(self, ci: int, ti: int, index: Any) -> NoReturn:
        # the store keeps indices as 32-bit integers: a bigger one could not be committed
        self._bad_field(
            ci, ti, "index", f"a non-negative integer (at most {_MAX_INDEX}) or null", index
        )

    def _bad_field(self, ci: int, ti: int, name: str, expected: str, value: Any) -> NoReturn:
        self._fail(
            f"must be {expected}, got {_json_repr(value)}",
            f"choices[{ci}].delta.tool_calls[{ti}].{name}",
        )

    def _limit(self, name: str, detail: str) -> None:
        self._anomaly("limit_exceeded", detail)
        self._end("limit", f"limit:{name}")

    # -- ending ---------------------------------------------------------------------------------
    def _end(self, how: str, reason: str | None) -> None:
        self._status = _ENDED
        self._end_how = how
        self._end_reason = reason
        for index in sorted(self._turns):
            self._end_turn(self._turns[index], how, reason)
        complete = bool(self._turns) and all(t.complete for t in self._turns.values())
        self._events.append(StreamEnded(how=how, reason=reason, complete=complete))

    def _end_turn(self, turn: Turn, how: str, reason: str | None) -> None:
        self._events.extend(
            turn.end(how, reason, repair=self.repair_json, max_depth=self.limits.max_json_depth)
        )
        if turn.incomplete_reason == NO_TOOL_CALLS:
            self._anomaly(
                "no_tool_calls",
                f"choice {turn.index}: finish_reason {turn.finish_reason!r} but no tool call "
                "arrived; the turn is not complete",
                turn.index,
            )
        self._events.append(
            TurnEnded(
                choice=turn.index, finish_reason=turn.finish_reason, complete=turn.complete,
                reason=turn.incomplete_reason,
            )
        )  # fmt: skip


def _has_payload(delta: dict[str, Any]) -> bool:
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("refusal")
        or delta.get("tool_calls")
        or delta.get("function_call")
    )


#: the most characters of an error payload shown as JSON in a reason (a string message is kept
#: whole)
_ERROR_JSON_CHARS: Final = 4096


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message
    elif isinstance(error, str) and error:
        return error
    return render_json(error, _ERROR_JSON_CHARS)


def _json_type(value: Any) -> str:
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


def _json_repr(value: Any) -> str:
    return f"{_json_type(value)} {render_json(value, 60)}"


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
#: the largest choice or tool-call index accepted (the store keeps them as 32-bit integers)
_MAX_INDEX: Final = 2**31 - 1
#: how deep ``usage`` may nest (the object itself is level 1)
_MAX_USAGE_DEPTH: Final = 32


def _flat_usage_ok(obj: dict[str, Any], *, nested: bool) -> bool:
    """The common shape of ``usage``, checked with no work list: numbers, strings and nulls,
    and (``nested``) objects of those (prompt_tokens_details). ``x - x != 0.0`` is true only for
    an infinite or NaN x. ``False``: let the full check decide."""
    for item in obj.values():
        kind = type(item)
        if kind is int:
            if item > _INT64_MAX or item < _INT64_MIN:
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


def _usage_problem(usage: dict[str, Any]) -> str | None:
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
                if not _INT64_MIN <= item <= _INT64_MAX:
                    return "an integer outside signed 64 bits"
            elif kind is float:
                if not math.isfinite(item):
                    return "a number beyond a double (infinite or NaN)"
            elif kind is dict or kind is list:
                todo.append((item, depth + 1))
    return None


def feed_all(parser: StreamParser, items: Iterable[Any]) -> list[Event]:
    """Feed every item (bytes/str as SSE data, anything else as a chunk); no EOF.

    Kept for old imports: the driver is :func:`fsm.api.feed_all`."""
    from fsm.api import feed_all as _feed_all

    return _feed_all(parser, items)
