"""The sans-IO stream parser: bytes or chunks in, events out.

::

    parser = StreamParser()
    for data in transport:                      # bytes, split anywhere
        for event in parser.receive_data(data):
            ...
    parser.receive_eof()                        # or parser.abort("reason") when the transport fails
    result = parser.result()

The parser does no I/O and owns no threads. The exact semantics are ``shared/spec/parser.md``;
the project README documents every choice made where the spec is silent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

import orjson

from fsm.errors import IncompleteTurnError, LocalProtocolError, RemoteProtocolError
from fsm.events import (
    AnomalyDetected,
    Event,
    FinishReasonReceived,
    StreamEnded,
    ToolCallAborted,
    ToolCallFinished,
    ToolCallOpened,
    ToolCallTruncated,
    ToolCallUpdated,
    TurnEnded,
    UsageReceived,
    _arguments_delta,
    _content_delta,
    _reasoning_delta,
    _refusal_delta,
)
from fsm.sse import EventTooLargeError, SSEFramer
from fsm.states import ToolCallState
from fsm.toolcall import FLUSH_EVERY, ToolCall, is_json, loads_strict, repair_json

__all__ = ["Anomaly", "Limits", "ParseResult", "StreamParser", "Turn"]

#: receive_data() hands bigger buffers to the framer in pieces of this size.
_WINDOW: Final = 64 * 1024

_OPENED: Final = ToolCallState.OPENED
_ACCUMULATING: Final = ToolCallState.ACCUMULATING

#: anomalies of one kind kept with their details (and reported as events); more are only counted.
MAX_ANOMALIES_PER_KIND: Final = 100

#: finish_reason values with a meaning of their own; any other value ends a turn like ``stop``.
KNOWN_FINISH_REASONS: Final = frozenset(
    {"stop", "tool_calls", "function_call", "length", "content_filter"}
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Safe bounds on what one stream may make the parser hold. All sizes are bytes.

    Past ``max_argument_bytes`` a call's further fragments are dropped and the call ends
    ``aborted`` (reason ``limit:max_argument_bytes``). Past any other limit the whole stream ends:
    every live call becomes ``aborted`` with the limit's name as reason.
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

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something the provider did wrong that the parser survived.

    ``kind`` is one of: ``orphan_continuation`` (a nameless, id-less fragment with no open call),
    ``delta_after_finish`` (content or tool-call data after the choice's ``finish_reason``),
    ``data_after_end`` (input after ``[DONE]`` or another end), ``unknown_finish_reason``,
    ``incomplete_event_at_eof`` (EOF inside an SSE event), ``empty_event`` (a ``data:`` event
    with nothing in it),
    ``limit_exceeded`` (a call's later fragments are then dropped without further anomalies).
    """

    kind: str
    detail: str
    choice: int | None = None
    event_number: int | None = None


class _Meta:
    __slots__ = ("created", "model", "response_id", "system_fingerprint", "usage")

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.system_fingerprint: str | None = None
        self.usage: dict[str, Any] | None = None


class Turn:
    """One choice of a streamed response: the assistant turn being assembled.

    A live view while streaming; final once :attr:`ended`. Only a :attr:`complete` turn can
    become history (:meth:`to_message`).
    """

    __slots__ = (
        "_by_id",
        "_by_index",
        "_calls",
        "_content",
        "_final_calls",
        "_finish_seen",
        "_last",
        "_meta",
        "_reasoning",
        "_refusal",
        "_text_bytes",
        "complete",
        "end_reason",
        "ended",
        "finish_reason",
        "index",
    )

    def __init__(self, index: int, meta: _Meta) -> None:
        self.index = index
        #: the last non-empty ``finish_reason`` seen for this choice.
        self.finish_reason: str | None = None
        #: whether the turn is over (the stream ended).
        self.ended = False
        #: whether the turn ended normally with every call ``finished``: safe for history.
        self.complete = False
        #: how the stream ended for this turn (``done``, ``eof``, ``error``, ``aborted``, ...).
        self.end_reason: str | None = None
        self._meta = meta
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._refusal: list[str] = []
        self._text_bytes = 0
        self._calls: list[ToolCall] = []
        self._by_index: dict[int, ToolCall] = {}
        self._by_id: dict[str, ToolCall] = {}
        self._last: ToolCall | None = None
        self._final_calls: list[ToolCall] | None = None
        self._finish_seen = False

    @property
    def content(self) -> str | None:
        """Concatenated ``delta.content`` (``None`` if the provider sent no non-empty content)."""
        return "".join(self._content) if self._content else None

    @property
    def reasoning(self) -> str | None:
        """Concatenated ``delta.reasoning_content`` / ``delta.reasoning``, or ``None``."""
        return "".join(self._reasoning) if self._reasoning else None

    @property
    def refusal(self) -> str | None:
        """Concatenated ``delta.refusal``, or ``None``."""
        return "".join(self._refusal) if self._refusal else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls in final order: by provider index, then by opening order (calls without an
        index after indexed ones)."""
        if self._final_calls is not None:
            return list(self._final_calls)
        return sorted(self._calls, key=_call_order)

    @property
    def usage(self) -> dict[str, Any] | None:
        """The response's ``usage`` when known (shared by every choice of the response)."""
        return self._meta.usage

    @property
    def response_id(self) -> str | None:
        """The response id (the chunks' ``id``)."""
        return self._meta.response_id

    @property
    def model(self) -> str | None:
        """The model name the provider reported."""
        return self._meta.model

    def to_message(self, *, include_reasoning: bool = False) -> dict[str, Any]:
        """The OpenAI assistant message for this turn, ready to send back.

        Only for a complete turn: any other raises :class:`~fsm.errors.IncompleteTurnError`, so an
        unfinished call can never be salvaged into history by accident. ``include_reasoning``
        adds ``reasoning_content`` (some providers want it back with tool calls).
        """
        if not self.complete:
            states = {c.position: (c.state.value, c.reason) for c in self.tool_calls}
            if not self.ended:
                why = "the stream has not ended"
            elif states and any(s != "finished" for s, _ in states.values()):
                why = ", ".join(
                    f"call {p} ({c.name or 'no name'}) is {s} ({r})"
                    for p, (s, r), c in zip(states, states.values(), self.tool_calls, strict=True)
                    if s != "finished"
                )
            else:
                why = (
                    f"the stream ended with {self.end_reason} / finish_reason {self.finish_reason}"
                )
            raise IncompleteTurnError(
                f"choice {self.index} is not a complete turn: {why}; record it as an attempt "
                "instead of sending it back",
                choice=self.index,
                states=states,
            )
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.refusal is not None:
            message["refusal"] = self.refusal
        if include_reasoning and self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        calls = self.tool_calls
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
        return message

    def to_json(self) -> dict[str, Any]:
        """The turn as the ``choices[]`` entry of ``fsm parse --json``."""
        return {
            "index": self.index,
            "finish_reason": self.finish_reason,
            "complete": self.complete,
            "content": self.content,
            "reasoning": self.reasoning,
            "refusal": self.refusal,
            "tool_calls": [
                {
                    "position": c.position,
                    "index": c.index,
                    "id": c.id,
                    "type": c.type,
                    "name": c.name,
                    "arguments": c.arguments,
                    "state": c.state.value,
                    "reason": c.reason,
                    "repaired": c.repaired,
                }
                for c in self.tool_calls
            ],
        }

    def __repr__(self) -> str:
        return (
            f"Turn(index={self.index}, finish_reason={self.finish_reason!r}, "
            f"complete={self.complete}, tool_calls={len(self._calls)})"
        )


def _call_order(call: ToolCall) -> tuple[bool, int, int]:
    return (call.index is None, call.index or 0, call.ordinal)


@dataclass(slots=True)
class ParseResult:
    """What one streamed response amounted to."""

    response_id: str | None
    model: str | None
    created: int | None
    system_fingerprint: str | None
    usage: dict[str, Any] | None
    anomalies: list[Anomaly]
    #: one per choice index, sorted by index.
    turns: list[Turn]
    #: how the stream ended (see :class:`fsm.events.StreamEnded`), ``None`` while it goes on.
    end_how: str | None
    #: the error message or abort reason, when there is one.
    end_reason: str | None
    #: the protocol error that ended the stream, if any.
    error: RemoteProtocolError | None = field(default=None)
    #: how many anomalies of each kind occurred (``anomalies`` keeps the first 100 of a kind).
    anomaly_counts: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether there is at least one choice and every choice is a complete turn."""
        return bool(self.turns) and all(t.complete for t in self.turns)

    def turn(self, index: int = 0) -> Turn:
        """The turn of choice ``index``; ``KeyError`` with a clear message if there is none."""
        for t in self.turns:
            if t.index == index:
                return t
        raise KeyError(
            f"the stream has no choice {index} (choices: {[t.index for t in self.turns]})"
        )

    def to_json(self) -> dict[str, Any]:
        """The object ``fsm parse --json`` prints."""
        return {
            "response_id": self.response_id,
            "model": self.model,
            "usage": self.usage,
            "anomalies": [{"kind": a.kind, "detail": a.detail} for a in self.anomalies],
            "choices": [t.to_json() for t in self.turns],
        }


_OPEN, _ENDED, _CLOSED, _FAILED = range(4)


class StreamParser:
    """Parses one streamed Chat Completions response. Create one per HTTP response.

    Args:
        repair_json: opt-in, append-only JSON repair for calls of a turn that ended normally
            (never for ``finish_reason: length``). Off by default: a truncated call is never
            executed.
        limits: bounds on memory; see :class:`Limits`.
    """

    def __init__(self, *, repair_json: bool = False, limits: Limits | None = None) -> None:
        self.repair_json = repair_json
        self.limits = limits or Limits()
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

    # -- public API ---------------------------------------------------------------------------
    @property
    def turns(self) -> dict[int, Turn]:
        """``{choice_index: Turn}``, a live view."""
        return self._turns

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every anomaly so far, in order."""
        return list(self._anomalies)

    @property
    def ended(self) -> bool:
        """Whether the stream has ended (``[DONE]``, an error, EOF, abort, a limit)."""
        return self._status != _OPEN

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
        )

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Feed raw SSE bytes, split anywhere. Returns the events they complete."""
        self._check_open("receive_data")
        if self._status == _ENDED:
            if data and self._framer_usable:
                for _name, _payload, _offset in self._feed_framer(bytes(data)):
                    self._event_number += 1
                    self._anomaly("data_after_end", "an SSE event after the end of the stream")
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
        if too_large is not None and self._status == _OPEN:
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
            if payload[:1] == b"{" and not name and self._status == _OPEN:
                try:
                    chunk = loads(payload)
                except orjson.JSONDecodeError:
                    chunk = self._decode_slow(payload)
                self._process(chunk)
            else:
                self._rare_event(name, payload)

    def _rare_event(self, name: str, payload: bytes) -> None:
        if self._status != _OPEN:
            self._anomaly("data_after_end", "an SSE event after the end of the stream")
        elif payload.strip() == b"[DONE]":
            self._end("done", None)
        elif name == "error":
            self._error_event(payload)
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
        ``ChatCompletionChunk``, or any pydantic model of the chunk (such as
        :class:`fsm.wire.ChatCompletionChunk`). The string ``"[DONE]"`` ends the stream."""
        self._check_open("receive_chunk")
        self._event_number += 1
        self._offset = None
        if isinstance(chunk, str | bytes | bytearray):
            text = chunk.strip()
            if text in ("[DONE]", b"[DONE]"):
                if self._status == _OPEN:
                    self._end("done", None)
                else:
                    self._anomaly("data_after_end", "[DONE] after the end of the stream")
                return self._take()
            if self._status != _OPEN:
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
        if self._status != _OPEN:
            self._anomaly("data_after_end", "a chunk after the end of the stream")
            return self._take()
        self._process(chunk)
        return self._take()

    def receive_eof(self) -> list[Event]:
        """The transport closed cleanly. Ends the stream if ``[DONE]`` did not."""
        self._check_open("receive_eof")
        if self._status == _OPEN:
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
        if self._status == _OPEN:
            self._end("aborted", reason or "aborted")
        if self._status == _ENDED:
            self._status = _CLOSED
        return self._take()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._status == _FAILED:
            assert self._error is not None
            raise RemoteProtocolError(
                f"the stream already failed ({self._error.reason}); no more input is accepted",
                event_number=self._error.event_number,
                byte_offset=self._error.byte_offset,
                path=self._error.path,
            )
        if self._status == _CLOSED:
            raise LocalProtocolError(
                f"{what}() called after the stream was closed by receive_eof() or abort(); "
                "use a new StreamParser for a new response"
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
        message: str
        try:
            obj = loads_strict(payload) if payload.strip() else None
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and "error" in obj:
            message = _error_message(obj["error"])
        elif isinstance(obj, dict):
            message = _error_message(obj)
        else:
            message = payload.decode("utf-8", "replace").strip() or "error event without data"
        self._end("error", message)

    def _process(self, chunk: Any) -> None:
        # The hot path: one call per chunk, with the common shapes handled inline and every
        # rare case (new turn, new call, text, finish, errors) out of line.
        if type(chunk) is not dict:
            self._fail(f"a chunk must be a JSON object, got {_json_type(chunk)}", None)
        if self._meta_missing:
            self._metadata(chunk)
        usage = chunk.get("usage")
        if usage is not None:
            self._usage(usage)
        choices = chunk.get("choices")
        if choices:
            if type(choices) is not list:
                self._fail(f"must be a list or null, got {_json_type(choices)}", "choices")
            turns = self._turns
            for ci, choice in enumerate(choices):
                if type(choice) is not dict:
                    self._fail(f"must be an object, got {_json_type(choice)}", f"choices[{ci}]")
                index = choice.get("index", 0)
                if type(index) is not int or index < 0:
                    self._fail(
                        f"must be a non-negative integer, got {_json_repr(index)}",
                        f"choices[{ci}].index",
                    )
                turn = turns.get(index)
                if turn is None:
                    turn = self._new_turn(index)
                    if turn is None:
                        return
                delta = choice.get("delta")
                if delta:
                    if type(delta) is not dict:
                        self._fail(
                            f"must be an object, got {_json_type(delta)}", f"choices[{ci}].delta"
                        )
                    if turn._finish_seen and _has_payload(delta):
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
                        by_index = turn._by_index
                        for ti, entry in enumerate(tool_calls):
                            # The hottest case inline: a continuation {"index": i, "function":
                            # {"arguments": "..."}} of a call already accumulating. It does
                            # exactly what _tool_delta does for it; anything else goes there.
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
                                        total = call._nbytes + len(fragment)
                                        if total <= self._max_argument_bytes:
                                            parts = call._parts
                                            parts.append(fragment)
                                            if len(parts) >= FLUSH_EVERY:
                                                call._flush()
                                            call._nbytes = total
                                            self._events.append(
                                                _arguments_delta(
                                                    index, call.ordinal, tindex, fragment
                                                )
                                            )
                                            continue
                            self._tool_delta(turn, entry, ci, ti)
                            if self._status != _OPEN:
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
        elif choices is not None and type(choices) is not list:
            self._fail(f"must be a list or null, got {_json_type(choices)}", "choices")
        error = chunk.get("error")
        if error is not None:
            self._end("error", _error_message(error))

    def _metadata(self, chunk: dict[str, Any]) -> None:
        meta = self._meta
        rid = chunk.get("id")
        if meta.response_id is None and type(rid) is str and rid:
            meta.response_id = rid
        model = chunk.get("model")
        if model is None:
            model = chunk.get("model_id")  # watsonx
        if meta.model is None and type(model) is str and model:
            meta.model = model
        created = chunk.get("created")
        if meta.created is None and type(created) is int:
            meta.created = created
        fp = chunk.get("system_fingerprint")
        if meta.system_fingerprint is None and type(fp) is str and fp:
            meta.system_fingerprint = fp
        self._meta_missing = meta.response_id is None or meta.model is None

    def _usage(self, usage: Any) -> None:
        if type(usage) is not dict:
            self._fail(f"must be an object or null, got {_json_type(usage)}", "usage")
        self._meta.usage = usage
        self._events.append(UsageReceived(usage=usage))

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
            self._anomaly(
                "unknown_finish_reason",
                f"finish_reason {finish!r} is not a known value; treated like 'stop'",
                turn.index,
            )
        turn.finish_reason = finish
        turn._finish_seen = True
        self._events.append(FinishReasonReceived(choice=turn.index, finish_reason=finish))

    def _text(self, turn: Turn, value: Any, parts: list[str], field: str, ci: int) -> bool:
        if type(value) is not str:
            self._fail(
                f"must be a string or null, got {_json_type(value)}", f"choices[{ci}].delta.{field}"
            )
        nbytes = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
        turn._text_bytes += nbytes
        if turn._text_bytes > self.limits.max_text_bytes:
            self._limit("max_text_bytes", f"choice {turn.index} text exceeds the limit")
            return False
        parts.append(value)
        return True

    def _texts(self, turn: Turn, delta: dict[str, Any], ci: int) -> bool:
        """Apply content, reasoning and refusal; ``False`` when a limit ended the stream."""
        events = self._events
        index = turn.index
        content = delta.get("content")
        if content is not None and (type(content) is not str or content):
            if not self._text(turn, content, turn._content, "content", ci):
                return False
            events.append(_content_delta(index, content))
        reasoning = delta.get("reasoning_content")
        field_name = "reasoning_content"
        if reasoning is None:
            reasoning = delta.get("reasoning")
            field_name = "reasoning"
        if reasoning is not None and (type(reasoning) is not str or reasoning):
            if not self._text(turn, reasoning, turn._reasoning, field_name, ci):
                return False
            events.append(_reasoning_delta(index, reasoning))
        refusal = delta.get("refusal")
        if refusal is not None and (type(refusal) is not str or refusal):
            if not self._text(turn, refusal, turn._refusal, "refusal", ci):
                return False
            events.append(_refusal_delta(index, refusal))
        return True

    def _tool_delta(self, turn: Turn, entry: Any, ci: int, ti: int) -> None:
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
            self._bad_field(ci, ti, "index", "a non-negative integer or null", index)

        # -- routing (spec: "Routing a tool-call delta to a call") --
        call: ToolCall | None
        if index is not None:
            call = turn._by_index.get(index)
            if call is not None and cid and call.id and cid != call.id:
                call = None  # same index, a new distinct id: a new call (Groq, Bedrock, Ollama)
        elif cid:
            call = turn._by_id.get(cid)
        elif name:
            call = None
        else:
            call = turn._last
            if call is None:
                self._anomaly(
                    "orphan_continuation",
                    f"choice {turn.index}: a tool-call fragment with no index, id or name and no "
                    "open call was dropped",
                    turn.index,
                )
                return
        if call is None:
            call = self._open(turn, index, cid or "", name or "", typ or "")
            if call is None:
                return
        elif cid or name or typ:
            self._merge_header(turn, call, cid, name, typ)
        if not arguments:
            return
        # -- appending (O(fragment); no trigger but the first) --
        if call.over_limit is None:
            nbytes = (
                len(arguments)
                if arguments.isascii()
                else len(arguments.encode("utf-8", "surrogatepass"))
            )
            if call._nbytes + nbytes > self._max_argument_bytes:
                self._over_limit(call)
                return
            call._append(arguments, nbytes)
            self._events.append(_arguments_delta(call.choice, call.ordinal, call.index, arguments))

    def _merge_header(
        self, turn: Turn, call: ToolCall, cid: str | None, name: str | None, typ: str | None
    ) -> None:
        changed = False
        if cid and not call.id:
            call.id = cid
            turn._by_id.setdefault(cid, call)
            changed = True
        if name and name != call.name:
            call.name += name
            changed = True
        if typ and not call._type:
            call._type = typ
        if changed:
            self._events.append(
                ToolCallUpdated(
                    choice=turn.index, ordinal=call.ordinal, index=call.index, id=call.id,
                    name=call.name,
                )
            )  # fmt: skip

    def _open(
        self, turn: Turn, index: int | None, cid: str, name: str, typ: str
    ) -> ToolCall | None:
        if len(turn._calls) >= self.limits.max_tool_calls:
            self._limit(
                "max_tool_calls",
                f"choice {turn.index} has more than {self.limits.max_tool_calls} tool calls",
            )
            return None
        call = ToolCall(
            choice=turn.index, ordinal=len(turn._calls), index=index, id=cid, name=name, type=typ
        )
        turn._calls.append(call)
        turn._last = call
        if index is not None:
            turn._by_index[index] = call
        if cid:
            turn._by_id[cid] = call
        self._events.append(
            ToolCallOpened(
                choice=turn.index, ordinal=call.ordinal, index=index, id=cid, name=name,
                type=call.type,
            )
        )  # fmt: skip
        return call

    def _over_limit(self, call: ToolCall) -> None:
        call.over_limit = "limit:max_argument_bytes"
        call._drop()
        self._anomaly(
            "limit_exceeded",
            f"choice {call.choice} call {call.ordinal}: arguments exceed "
            f"{self.limits.max_argument_bytes} bytes; the call will end aborted",
            call.choice,
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
        finish = turn.finish_reason
        # mode: "ok" (normal end), "truncate" or "abort", with the reason for the last two
        if how in ("done", "eof"):
            if finish == "length":
                mode, why = "truncate", "length"
            elif finish == "content_filter":
                mode, why = "abort", "content_filter"
            elif finish is None and how == "eof":
                mode, why = "abort", "eof"
            else:
                mode, why = "ok", None
        else:
            mode, why = "abort", reason or how
        calls = sorted(turn._calls, key=_call_order)
        for position, call in enumerate(calls):
            call.position = position
            if call.over_limit is not None:
                call._end("abort", call.over_limit)
            elif not call.name:
                call._end("abort", "missing_name")
            elif mode == "ok":
                raw = call.raw_arguments
                if is_json(raw):
                    call._end("finish", None)
                else:
                    suffix = repair_json(raw) if self.repair_json else None
                    if suffix:
                        call._end("finish", None, suffix)
                    else:
                        call._end("truncate", "invalid_json")
            elif mode == "truncate":
                call._end("truncate", why)
            else:
                call._end("abort", why)
            self._events.append(_final_event(call))
        turn._final_calls = calls
        turn._by_index = {}
        turn._by_id = {}
        turn._last = None
        turn.ended = True
        turn.end_reason = how
        turn.complete = mode == "ok" and all(c.state is ToolCallState.FINISHED for c in calls)
        self._events.append(
            TurnEnded(choice=turn.index, finish_reason=finish, complete=turn.complete)
        )


def _final_event(call: ToolCall) -> Event:
    if call.state is ToolCallState.FINISHED:
        return ToolCallFinished(
            choice=call.choice, ordinal=call.ordinal, position=call.position, index=call.index,
            id=call.id, name=call.name, arguments=call.arguments, repaired=call.repaired,
            raw_length=len(call.raw_arguments),
        )  # fmt: skip
    cls = ToolCallTruncated if call.state is ToolCallState.TRUNCATED else ToolCallAborted
    return cls(
        choice=call.choice, ordinal=call.ordinal, position=call.position, index=call.index,
        id=call.id, name=call.name, arguments=call.arguments, reason=call.reason or "",
    )  # fmt: skip


def _has_payload(delta: dict[str, Any]) -> bool:
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("refusal")
        or delta.get("tool_calls")
    )


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message
        return json.dumps(error, ensure_ascii=False, sort_keys=True)
    if isinstance(error, str) and error:
        return error
    return json.dumps(error, ensure_ascii=False)


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
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{_json_type(value)} {text}"


def feed_all(parser: StreamParser, items: Iterable[Any]) -> list[Event]:
    """Feed every item (bytes/str as SSE data, anything else as a chunk); no EOF."""
    events: list[Event] = []
    for item in items:
        if isinstance(item, bytes | bytearray | memoryview):
            events.extend(parser.receive_data(item))
        elif isinstance(item, str):
            events.extend(parser.receive_data(item.encode("utf-8", "surrogatepass")))
        else:
            events.extend(parser.receive_chunk(item))
    return events
