"""The Vercel AI SDK's UI message stream (protocol ``v1``), from fsm's parser events (issue 30).

A browser running the AI SDK's ``useChat`` reads a server-sent stream of JSON *parts*
(``x-vercel-ai-ui-message-stream: v1``): ``start``, ``start-step``, ``text-start`` /
``text-delta`` / ``text-end``, ``reasoning-*``, ``tool-input-start`` / ``tool-input-delta`` /
``tool-input-available``, ``tool-input-error``, ``tool-output-available``, ``finish-step``,
``finish``, ``abort``, ``error``, then ``data: [DONE]``. :class:`UIMessageStreamEncoder` turns
the events of :class:`fsm.StreamParser` into those parts, so a Python backend streams any
provider (Chat Completions, Responses, Anthropic Messages) to ``useChat`` with fsm's judgement of
each tool call:

- a call's input streams as ``tool-input-delta`` once its id and name are known, and becomes
  ``tool-input-available`` (its arguments parsed) only when fsm finished it;
- a truncated or unusable call (``finish_reason: length``, invalid JSON, no name, a stream that
  broke) is ``tool-input-error`` with fsm's reason and the raw arguments: the UI shows it failed,
  and nothing runs it;
- a stream that ended with an error event, a protocol error, a limit, or that was cut off (EOF
  before its end) ends its step with an ``error`` part (and the message's ``finish`` says
  ``error``); one that was aborted (``parser.abort()``) ends the message with ``abort``.

The parts are plain dicts in the protocol's field names; :func:`encode_sse` frames one,
:func:`ui_message_stream` turns a provider's body into the whole framed stream and
:func:`ui_message_response` serves it from Starlette/FastAPI with the protocol's headers
(:data:`UI_MESSAGE_STREAM_HEADERS`). Checked against the protocol's own definition, the ``ai``
package's ``uiMessageChunkSchema``, and its ``readUIMessageStream`` (tests/integrations).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsm.errors import RemoteProtocolError
from fsm.events import (
    ContentDelta,
    Event,
    FinishReasonReceived,
    ReasoningDelta,
    RefusalDelta,
    StreamEnded,
    ToolCallAborted,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallOpened,
    ToolCallTruncated,
    ToolCallUpdated,
)
from fsm.integrations.errors import IntegrationError
from fsm.parser import Limits, StreamParser

if TYPE_CHECKING:
    import starlette.responses

__all__ = [
    "DONE",
    "UI_MESSAGE_STREAM_HEADERS",
    "Part",
    "UIMessageStreamEncoder",
    "UIMessageStreamError",
    "encode_sse",
    "ui_message_response",
    "ui_message_stream",
    "ui_parts",
]

#: one part of the stream: a JSON object with its ``type``
Part = dict[str, Any]

#: the response headers of a UI message stream (the ``ai`` package's own
#: ``UI_MESSAGE_STREAM_HEADERS``)
UI_MESSAGE_STREAM_HEADERS: Mapping[str, str] = {
    "content-type": "text/event-stream",
    "cache-control": "no-cache",
    "connection": "keep-alive",
    "x-vercel-ai-ui-message-stream": "v1",
    "x-accel-buffering": "no",
}

#: the last event of the stream
DONE = b"data: [DONE]\n\n"

#: a provider's finish reason as the protocol names it (anything else is ``other``)
_FINISH_REASONS = {
    "stop": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "completed": "stop",
    "length": "length",
    "max_tokens": "length",
    "max_output_tokens": "length",
    "incomplete": "length",
    "tool_calls": "tool-calls",
    "function_call": "tool-calls",
    "tool_use": "tool-calls",
    "content_filter": "content-filter",
    "refusal": "content-filter",
}


def _protocol_reason(reason: str) -> str:
    if reason in _FINISH_REASONS:
        return _FINISH_REASONS[reason]
    return reason if reason in _FINISH_REASONS.values() or reason == "error" else "other"


class UIMessageStreamError(IntegrationError):
    """A part asked of the encoder out of the protocol's order (a part after the message
    finished, a tool output for a call the message never showed)."""


@dataclass(slots=True)
class _Call:
    ordinal: int
    id: str
    name: str
    type: str
    started: bool = False
    buffered: list[str] = field(default_factory=list)


def encode_sse(part: Part) -> bytes:
    """One part as the stream frames it: ``data: <json>`` and a blank line."""
    return (
        b"data: " + json.dumps(part, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


class UIMessageStreamEncoder:
    """fsm's parser events as the parts of one UI message.

    Each method returns the parts to send, in order. A message is :meth:`start`, then per
    model call (a *step*) :meth:`start_step` and the parser's events through :meth:`feed` (the
    step ends with the stream: its ``StreamEnded`` event emits ``finish-step``), the tools'
    outcomes (:meth:`tool_output`, :meth:`tool_output_error`) between steps, and :meth:`finish`
    (or :meth:`abort`). Only the choice ``choice`` of each response is shown (a UI message is
    one answer).

    Args:
        message_id: the ``start`` part's ``messageId`` (``None``: the client assigns one).
        choice: the choice of each response to show (0 unless the request asked for ``n``).
    """

    def __init__(self, *, message_id: str | None = None, choice: int = 0) -> None:
        self.message_id = message_id
        self.choice = choice
        self._counter = 0
        self._text: str | None = None
        self._reasoning: str | None = None
        self._calls: dict[int, _Call] = {}
        self._known: set[str] = set()
        self._finish_reason: str | None = None
        self._failed = False
        self._in_step = False
        self._started = False
        self._ended = False

    @property
    def ended(self) -> bool:
        """Whether the message ended (``finish`` or ``abort`` sent)."""
        return self._ended

    # -- message and steps ----------------------------------------------------------------------
    def start(self, metadata: Any = None) -> list[Part]:
        """The ``start`` part (with ``messageId``, and ``messageMetadata`` when given)."""
        self._check_open("start")
        if self._started:
            raise UIMessageStreamError("the message already started: start() once per message")
        self._started = True
        part: Part = {"type": "start"}
        if self.message_id is not None:
            part["messageId"] = self.message_id
        if metadata is not None:
            part["messageMetadata"] = metadata
        return [part]

    def start_step(self) -> list[Part]:
        """``start-step``: a model call begins (its calls and text are new)."""
        self._check_open("start_step")
        parts = [] if self._started else self.start()
        parts += self._end_step() if self._in_step else []
        self._in_step = True
        self._calls = {}
        return [*parts, {"type": "start-step"}]

    def finish(self, finish_reason: str | None = None) -> list[Part]:
        """End the message: the open step's ``finish-step``, then ``finish`` with the protocol's
        name of ``finish_reason`` (default: the last step's, ``error`` if a step failed)."""
        self._check_open("finish")
        parts = self._end_step() if self._in_step else []
        reason = finish_reason or self._finish_reason
        part: Part = {"type": "finish"}
        if self._failed and finish_reason is None:
            part["finishReason"] = "error"
        elif reason is not None:
            part["finishReason"] = _protocol_reason(reason)
        self._ended = True
        return [*parts, part]

    def abort(self, reason: str | None = None) -> list[Part]:
        """End the message as aborted (the user stopped it, or its stream was cut): the open
        text, reasoning and tool inputs are closed (unfinished inputs as ``tool-input-error``),
        then ``abort``."""
        self._check_open("abort")
        parts = self._close_all() if self._in_step else []
        self._ended = True
        part: Part = {"type": "abort"}
        if reason:
            part["reason"] = reason
        return [*parts, part]

    def error(self, text: str) -> list[Part]:
        """An ``error`` part: the UI shows ``text`` (the message goes on, or ends with
        :meth:`finish`)."""
        self._check_open("error")
        self._failed = True
        return [{"type": "error", "errorText": text}]

    # -- tool outcomes --------------------------------------------------------------------------
    def tool_output(self, tool_call_id: str, output: Any) -> list[Part]:
        """``tool-output-available``: the result of a call this message showed."""
        self._check_call(tool_call_id)
        return [{"type": "tool-output-available", "toolCallId": tool_call_id, "output": output}]

    def tool_output_error(self, tool_call_id: str, error_text: str) -> list[Part]:
        """``tool-output-error``: the call's tool failed with ``error_text``."""
        self._check_call(tool_call_id)
        return [{"type": "tool-output-error", "toolCallId": tool_call_id, "errorText": error_text}]

    # -- the parser's events --------------------------------------------------------------------
    def feed(self, events: Iterable[Event]) -> list[Part]:
        """The parts of ``events`` (what ``StreamParser.receive_*`` returned, or a
        ``RemoteProtocolError``'s ``events``). Opens the message and a step if none is open."""
        self._check_open("feed")
        events = list(events)
        if not events:
            return []
        parts: list[Part] = [] if self._in_step else self.start_step()
        for event in events:
            if not self._in_step:
                break
            choice = getattr(event, "choice", self.choice)
            if choice != self.choice and not isinstance(event, StreamEnded):
                continue
            parts += self._event(event)
        return parts

    def _event(self, event: Event) -> list[Part]:
        match event:
            case ContentDelta(text=text) | RefusalDelta(text=text):
                return self._text_delta(text)
            case ReasoningDelta(text=text):
                return self._reasoning_delta(text)
            case ToolCallOpened(ordinal=ordinal, id=cid, name=name, type=kind):
                self._calls[ordinal] = _Call(ordinal, cid, name, kind)
                return []
            case ToolCallUpdated(ordinal=ordinal, id=cid, name=name):
                call = self._calls.get(ordinal)
                if call is not None and not call.started:
                    call.id, call.name = cid, name
                return []
            case ToolCallArgumentsDelta(ordinal=ordinal, delta=delta):
                return self._input_delta(ordinal, delta)
            case ToolCallFinished():
                return self._input_final(event, None)
            case ToolCallTruncated(reason=reason) | ToolCallAborted(reason=reason):
                return self._input_final(event, reason)
            case FinishReasonReceived(finish_reason=reason):
                self._finish_reason = reason
                return []
            case StreamEnded(how=how, reason=reason, complete=complete):
                return self._stream_ended(how, reason, complete)
        return []  # usage, anomalies, turn ends: nothing the UI shows

    def _text_delta(self, text: str) -> list[Part]:
        parts = self._close_reasoning()
        if self._text is None:
            self._text = self._id("text")
            parts.append({"type": "text-start", "id": self._text})
        parts.append({"type": "text-delta", "id": self._text, "delta": text})
        return parts

    def _reasoning_delta(self, text: str) -> list[Part]:
        parts = self._close_text()
        if self._reasoning is None:
            self._reasoning = self._id("reasoning")
            parts.append({"type": "reasoning-start", "id": self._reasoning})
        parts.append({"type": "reasoning-delta", "id": self._reasoning, "delta": text})
        return parts

    def _input_delta(self, ordinal: int, delta: str) -> list[Part]:
        call = self._calls.get(ordinal)
        if call is None:
            return []
        if call.started:
            return [{"type": "tool-input-delta", "toolCallId": call.id, "inputTextDelta": delta}]
        call.buffered.append(delta)
        if not (call.id and call.name) or call.id in self._known:
            return []  # shown once its id and name are known (and unique)
        return self._input_start(call)

    def _input_start(self, call: _Call) -> list[Part]:
        parts = self._close_text() + self._close_reasoning()
        call.started = True
        self._known.add(call.id)
        start: Part = {"type": "tool-input-start", "toolCallId": call.id, "toolName": call.name}
        if call.type == "custom":
            start["inputEncoding"] = "text"
        parts.append(start)
        if call.buffered:
            text = "".join(call.buffered)
            parts.append(
                {"type": "tool-input-delta", "toolCallId": call.id, "inputTextDelta": text}
            )
        call.buffered = []
        return parts

    def _input_final(
        self, event: ToolCallFinished | ToolCallTruncated | ToolCallAborted, reason: str | None
    ) -> list[Part]:
        call = self._calls.get(event.ordinal)
        if call is None:
            call = self._calls[event.ordinal] = _Call(
                event.ordinal, event.id, event.name, "function"
            )
        parts: list[Part] = []
        if not call.started:
            call.id, call.name = event.id, event.name
            if not call.id or call.id in self._known:  # no id, or one already shown: ours
                call.id = self._id(f"call-{event.choice}-{event.ordinal}")
            if reason is None:
                call.buffered = []  # the whole input comes with tool-input-available
                parts += self._input_start(call)
            else:
                parts += self._close_text() + self._close_reasoning()
                self._known.add(call.id)
        common: Part = {"toolCallId": call.id, "toolName": event.name or call.name}
        if reason is None:
            assert isinstance(event, ToolCallFinished)
            value: Any = event.arguments
            if call.type != "custom":
                value = json.loads(event.arguments) if event.arguments.strip() else {}
            parts.append({"type": "tool-input-available", **common, "input": value})
        else:
            text = (
                f"the call's arguments are incomplete ({reason}): fsm did not finish it, and "
                "nothing ran it"
                if isinstance(event, ToolCallTruncated)
                else f"the call is unusable ({reason}): nothing ran it"
            )
            parts.append(
                {"type": "tool-input-error", **common, "input": event.arguments, "errorText": text}
            )
        return parts

    def _stream_ended(self, how: str, reason: str | None, complete: bool) -> list[Part]:
        if how == "aborted":
            return self.abort(reason)
        parts = self._close_all()
        if how in ("error", "protocol_error", "limit"):
            parts += self.error(f"the model's stream ended with {how}: {reason}")
        elif how == "eof" and not complete:
            parts += self.error("the model's stream was cut off before its end: it is incomplete")
        parts += self._end_step()
        return parts

    # -- internals ------------------------------------------------------------------------------
    def _close_all(self) -> list[Part]:
        """Close the open text and reasoning parts (the parser ends every call of a stream
        with its final event before the stream's end, so no tool input is left open)."""
        return self._close_text() + self._close_reasoning()

    def _end_step(self) -> list[Part]:
        parts = self._close_all()
        self._in_step = False
        return [*parts, {"type": "finish-step"}]

    def _close_text(self) -> list[Part]:
        if self._text is None:
            return []
        part: Part = {"type": "text-end", "id": self._text}
        self._text = None
        return [part]

    def _close_reasoning(self) -> list[Part]:
        if self._reasoning is None:
            return []
        part: Part = {"type": "reasoning-end", "id": self._reasoning}
        self._reasoning = None
        return [part]

    def _id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    def _check_open(self, what: str) -> None:
        if self._ended:
            raise UIMessageStreamError(
                f"{what}() after the message ended (finish or abort): use a new encoder for "
                "a new message"
            )

    def _check_call(self, tool_call_id: str) -> None:
        self._check_open("tool_output")
        if tool_call_id not in self._known:
            raise UIMessageStreamError(
                f"no tool call {tool_call_id!r} in this message: a tool output follows its "
                "call's tool-input parts"
            )


def _parse_into(
    encoder: UIMessageStreamEncoder, parser: StreamParser, data: bytes | None
) -> list[Part]:
    """Feed ``data`` (``None``: the end of the body) and encode what it completes."""
    try:
        events = parser.receive_eof() if data is None else parser.receive_data(data)
    except RemoteProtocolError as exc:
        events = exc.events
    return encoder.feed(events)


def ui_parts(
    body: bytes | Iterable[bytes],
    *,
    message_id: str | None = None,
    format: str = "auto",
    repair_json: bool = False,
    limits: Limits | None = None,
) -> list[Part]:
    """Every part of the one-step message a provider's whole streamed body makes (``start``
    to ``finish``, or ``abort``): a recording, or a body read in pieces."""
    encoder = UIMessageStreamEncoder(message_id=message_id)
    parser = StreamParser(format=format, repair_json=repair_json, limits=limits)
    parts = encoder.start_step()
    for data in [body] if isinstance(body, bytes | bytearray) else body:
        if parser.ended:
            break
        parts += _parse_into(encoder, parser, bytes(data))
    if not parser.ended:
        parts += _parse_into(encoder, parser, None)
    if not encoder.ended:
        parts += encoder.finish()
    return parts


async def ui_message_stream(
    upstream: AsyncIterable[bytes],
    *,
    message_id: str | None = None,
    format: str = "auto",
    repair_json: bool = False,
    limits: Limits | None = None,
) -> AsyncIterator[bytes]:
    """A provider's streamed body (an async iterator of bytes, such as httpx's
    ``aiter_bytes()``) as a UI message stream, framed: each part as :func:`encode_sse` frames
    it, then :data:`DONE`. An upstream that fails mid-stream ends the message with an ``error``
    part and ``abort`` (its unfinished calls as ``tool-input-error``)."""
    encoder = UIMessageStreamEncoder(message_id=message_id)
    parser = StreamParser(format=format, repair_json=repair_json, limits=limits)
    for part in encoder.start_step():
        yield encode_sse(part)
    try:
        async for data in upstream:
            if parser.ended:
                break
            for part in _parse_into(encoder, parser, data):
                yield encode_sse(part)
    except Exception as exc:  # the upstream failed: say so, end the message
        if not encoder.ended:
            failure = f"the model's stream failed: {type(exc).__name__}: {exc}"
            for part in encoder.error(failure) + encoder.feed(parser.abort("upstream_failed")):
                yield encode_sse(part)
    if not parser.ended:
        for part in _parse_into(encoder, parser, None):
            yield encode_sse(part)
    if not encoder.ended:
        for part in encoder.finish():
            yield encode_sse(part)
    yield DONE


def ui_message_response(
    stream: AsyncIterable[bytes], *, headers: Mapping[str, str] | None = None
) -> starlette.responses.StreamingResponse:
    """A Starlette ``StreamingResponse`` serving a framed UI message stream (what
    :func:`ui_message_stream` yields) with :data:`UI_MESSAGE_STREAM_HEADERS` (and
    ``headers``)."""
    try:
        from starlette.responses import StreamingResponse
    except ImportError as exc:
        raise UIMessageStreamError(
            f"ui_message_response needs Starlette ({exc}): pip install 'fsm-toolcalls[proxy]'"
        ) from exc
    return StreamingResponse(stream, headers={**UI_MESSAGE_STREAM_HEADERS, **(headers or {})})
