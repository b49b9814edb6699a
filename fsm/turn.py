"""One choice of a streamed response (:class:`Turn`), what a whole response amounted to
(:class:`ParseResult`), and the anomalies a parser survived (:class:`Anomaly`).

A :class:`Turn` owns the two per-choice rules of the spec: *routing* a tool-call delta to a call
(:meth:`Turn.route`) and *ending* the turn by the ending table of :mod:`fsm.states`
(:meth:`Turn.end`). The parser validates and dispatches; it never changes a turn's fields itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, NoReturn

from fsm.errors import IncompleteTurnError, LocalProtocolError, RemoteProtocolError
from fsm.events import Event
from fsm.jsonutil import JsonSyntax, is_json, repair_json
from fsm.shapes import assistant_message
from fsm.states import (
    ARGUMENT_ENDINGS,
    CALL_NOT_FINISHED,
    CALL_STOPS,
    MISSING_NAME,
    NO_TOOL_CALLS,
    CallEnding,
    Ending,
    ToolCallState,
    ending,
)
from fsm.toolcall import FLUSH_EVERY, ToolCall, pair_surrogates
from fsm.types import AssistantMessage

__all__ = ["CONTENT", "REASONING", "REFUSAL", "Anomaly", "ParseResult", "Turn"]

#: the text fields of a turn (:meth:`Turn.append_text`)
CONTENT: Final = 0
REASONING: Final = 1
REFUSAL: Final = 2


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something the provider did wrong that the parser survived.

    ``kind`` is one of: ``orphan_continuation`` (a nameless, id-less fragment with no open call),
    ``delta_after_finish`` (content or tool-call data after the choice's ``finish_reason``),
    ``data_after_end`` (input after ``[DONE]`` or another end), ``unknown_finish_reason``,
    ``incomplete_event_at_eof`` (EOF inside an SSE event), ``empty_event`` (a ``data:`` event
    with nothing in it), ``limit_exceeded`` (a call's later fragments are then dropped without
    further anomalies), ``blank_id`` (a call id made only of whitespace: kept as sent),
    ``no_tool_calls`` (``finish_reason`` ``tool_calls`` / ``function_call`` in a choice with no
    call: the turn is not complete), ``invalid_usage`` (a ``usage`` object the store could not
    hold as JSON: a number outside signed 64-bit integers or finite doubles, or nesting deeper
    than 32; it is ignored and the previous one kept), ``invalid_created`` (an integer
    ``created`` outside signed 64 bits: ignored).

    Responses API and Anthropic Messages streams (:mod:`fsm.formats`) add: ``orphan_delta`` (a
    delta for no open item or block: dropped), ``done_mismatch`` (a ``.done`` text differs from
    the deltas: the done text wins), ``id_changed`` (an item's id or call id, or the response
    id, changed mid-stream: the first is kept), ``item_type_changed``, ``item_without_added``
    (an ``output_item.done`` for an item never added: kept whole), ``duplicate_output_index``,
    ``missing_call_id`` (the call's id stays ``""``), ``unknown_event`` and ``unknown_delta``
    (ignored), ``wrong_delta`` (a delta of the wrong kind for its block: dropped),
    ``done_before_end`` (``[DONE]`` before the terminal event: ignored),
    ``second_message_start`` (the calls of the message it cut off end ``aborted``),
    ``block_index_reused``, ``unclosed_block`` (no ``content_block_stop`` before
    ``message_stop``), ``orphan_stop``, ``input_and_deltas`` (deltas after an input already
    whole: the deltas are the arguments), ``invalid_server_input`` (a server tool's streamed
    input is not JSON: kept as it was).
    """

    kind: str
    detail: str
    choice: int | None = None
    event_number: int | None = None


class Meta:
    __slots__ = ("created", "model", "response_id", "system_fingerprint", "usage")

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.system_fingerprint: str | None = None
        self.usage: dict[str, Any] | None = None


def _joined(parts: list[str], blocks: list[str]) -> str | None:
    """One text field of a turn. Its fragments are kept in two levels like a call's arguments
    (see ``ToolCall._parts``), so memory tracks the text's size, not the number of fragments:
    up to FLUSH_EVERY recent ones in ``parts``, joined into one block of ``blocks`` when that
    many have come. Reading joins everything once (and keeps the result as the only block)."""
    if not parts and not blocks:
        return None
    text = pair_surrogates("".join(blocks) + "".join(parts))
    blocks[:] = [text]
    parts.clear()
    return text


class Turn:
    """One choice of a streamed response: the assistant turn being assembled.

    A live view while streaming; final once :attr:`ended`. Only a :attr:`complete` turn can
    become history (:meth:`to_message`).
    """

    __slots__ = (
        "_by_id",
        "_calls",
        "_content",
        "_content_blocks",
        "_final_calls",
        "_last",
        "_meta",
        "_reasoning",
        "_reasoning_blocks",
        "_refusal",
        "_refusal_blocks",
        "_text_fields",
        "by_index",
        "complete",
        "end_reason",
        "ended",
        "finish_reason",
        "finish_seen",
        "incomplete_reason",
        "index",
        "legacy_call",
        "text_bytes",
    )

    def __init__(self, index: int, meta: Meta) -> None:
        self.index = index
        #: the last non-empty ``finish_reason`` seen for this choice.
        self.finish_reason: str | None = None
        #: whether the turn is over (the stream ended).
        self.ended = False
        #: whether the turn ended normally with every call ``finished``: safe for history.
        self.complete = False
        #: how the stream ended for this turn (``done``, ``eof``, ``error``, ``aborted``, ...).
        self.end_reason: str | None = None
        #: why an ended turn is not complete, else ``None``: the reason its calls were cut
        #: (``length``, ``content_filter``, ``eof``, the error message or abort reason,
        #: ``protocol_error``, ``limit:<name>``), ``no_tool_calls`` (finish_reason ``tool_calls``
        #: or ``function_call`` with no call at all), or ``call_not_finished`` (the stream ended
        #: normally but a call is truncated or aborted: see each call's ``reason``).
        self.incomplete_reason: str | None = None
        self._meta = meta
        # text fields: recent fragments, and blocks of FLUSH_EVERY fragments joined (_joined);
        # changed in place only, so _text_fields (by CONTENT, REASONING, REFUSAL) stays theirs
        self._content: list[str] = []
        self._content_blocks: list[str] = []
        self._reasoning: list[str] = []
        self._reasoning_blocks: list[str] = []
        self._refusal: list[str] = []
        self._refusal_blocks: list[str] = []
        self._text_fields = (
            (self._content, self._content_blocks),
            (self._reasoning, self._reasoning_blocks),
            (self._refusal, self._refusal_blocks),
        )
        #: UTF-8 bytes of content + reasoning + refusal (``Limits.max_text_bytes``)
        self.text_bytes = 0
        self._calls: list[ToolCall] = []
        #: the live call of each provider index (routing; read by the parser's hot path)
        self.by_index: dict[int, ToolCall] = {}
        self._by_id: dict[str, ToolCall] = {}
        self._last: ToolCall | None = None
        self._final_calls: list[ToolCall] | None = None
        #: whether a non-empty finish_reason arrived (later data is ``delta_after_finish``)
        self.finish_seen = False
        #: the choice's one legacy ``function_call`` (:attr:`ToolCall.legacy`), else ``None``
        self.legacy_call: ToolCall | None = None

    @property
    def content(self) -> str | None:
        """Concatenated ``delta.content`` (``None`` if the provider sent no non-empty content).

        Surrogate halves that pair up across fragments become the real character."""
        return _joined(self._content, self._content_blocks)

    @property
    def reasoning(self) -> str | None:
        """Concatenated ``delta.reasoning_content`` / ``delta.reasoning``, or ``None``."""
        return _joined(self._reasoning, self._reasoning_blocks)

    @property
    def refusal(self) -> str | None:
        """Concatenated ``delta.refusal``, or ``None``."""
        return _joined(self._refusal, self._refusal_blocks)

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

    @property
    def call_count(self) -> int:
        """How many calls the turn has opened."""
        return len(self._calls)

    @property
    def unfinished_calls(self) -> list[ToolCall]:
        """The calls (in final order) that are not ``finished``: why an ended turn with calls
        is incomplete, call by call."""
        return [c for c in self.tool_calls if c.state is not ToolCallState.FINISHED]

    # -- driving (internal: the stream core's, while the stream is parsed) ------------------------
    # A turn is driven only by the parser that made it. Once it has ended (every turn a user
    # gets from a ParseResult of an ended stream), each driving method raises
    # LocalProtocolError instead of changing it: a parsed turn is read-only.

    def route(self, index: int | None, cid: str | None, name: str | None) -> ToolCall | None:
        """Internal. The call a tool-call delta goes to (spec "Routing a tool-call delta to a
        call"), or ``None`` for a new call. Raises :class:`LookupError` for a continuation with
        no live call (an orphan: the caller drops it and reports an anomaly)."""
        if self.ended:
            _read_only(self, "route")
        if index is not None:
            call = self.by_index.get(index)
            if call is not None and cid and call.id and cid != call.id:
                return None  # same index, a new distinct id: a new call (Groq, Bedrock, Ollama)
            return call
        if cid:
            return self._by_id.get(cid)
        if name:
            return None
        if self._last is None:
            raise LookupError("no open call")
        return self._last

    def add_call(self, call: ToolCall) -> None:
        """Internal. Register a newly opened call (the most recent one: continuations go to
        it)."""
        if self.ended:
            _read_only(self, "add_call")
        self._calls.append(call)
        self._last = call
        if call.legacy:
            self.legacy_call = call
        if call.index is not None:
            self.by_index[call.index] = call
        if call.id:
            self._by_id[call.id] = call

    def note_id(self, call: ToolCall) -> None:
        """Internal. A call got its id late: route that id to it (unless another call has
        it)."""
        if self.ended:
            _read_only(self, "note_id")
        self._by_id.setdefault(call.id, call)

    def append_text(self, field: int, text: str, nbytes: int) -> None:
        """Internal. Append a text fragment (``field``: :data:`CONTENT`, :data:`REASONING` or
        :data:`REFUSAL`) of ``nbytes`` UTF-8 bytes; the caller checked the limits."""
        if self.ended:
            _read_only(self, "append_text")
        parts, blocks = self._text_fields[field]
        self.text_bytes += nbytes
        parts.append(text)
        if len(parts) >= FLUSH_EVERY:
            blocks.append("".join(parts))
            parts.clear()

    def finish(self, finish_reason: str) -> None:
        """Internal. Keep the choice's last non-empty ``finish_reason``."""
        if self.ended:
            _read_only(self, "finish")
        self.finish_reason = finish_reason
        self.finish_seen = True

    def end(self, how: str, reason: str | None, *, repair: bool, max_depth: int) -> list[Event]:
        """Internal. End the turn when the stream ended ``how`` (with the stream's ``reason``):
        every call by the ending table (:func:`fsm.states.ending`, or a format's
        :meth:`ending_row`), then the turn's own verdict. Returns the calls' final events, in
        final order."""
        if self.ended:
            _read_only(self, "end")
        row = self.ending_row(how)
        why = None if row.trigger is None else (row.reason or reason or how)
        calls = self.final_call_order()
        events: list[Event] = []
        for position, call in enumerate(calls):
            call.position = position
            forced = self.forced_ending(call)
            if call.over_limit is not None:
                event = call.end("abort", call.over_limit)
            elif not call.name.strip():  # empty or only whitespace (str.isspace): no name
                event = call.end(*MISSING_NAME)
            elif forced is not None:
                event = call.end(*forced)
            elif row.trigger is None:
                event = _end_normally(call, repair=repair, max_depth=max_depth)
            else:
                event = call.end(row.trigger, why)
            events.append(event)
        self._final_calls = calls
        self.by_index = {}
        self._by_id = {}
        self._last = None
        self.ended = True
        self.end_reason = how
        if row.trigger is not None:
            self.incomplete_reason = why
        elif not calls and self.promises_calls():
            self.incomplete_reason = NO_TOOL_CALLS
        elif any(c.state is not ToolCallState.FINISHED for c in calls):
            self.incomplete_reason = CALL_NOT_FINISHED
        self.complete = self.incomplete_reason is None
        return events

    def ending_row(self, how: str) -> Ending:
        """The row of the ending table for a stream that ended ``how``, by the choice's last
        ``finish_reason`` (a format turn maps its own stop signal)."""
        return ending(how, self.finish_reason)

    def final_call_order(self) -> list[ToolCall]:
        """The calls in their final order (by index, then arrival)."""
        return sorted(self._calls, key=_call_order)

    def forced_ending(self, call: ToolCall) -> CallEnding | None:
        """An ending the stream itself decided for ``call`` (none in Chat Completions)."""
        return None

    def promises_calls(self) -> bool:
        """Whether the stop signal says calls were made (then a turn with none is
        ``no_tool_calls``)."""
        return self.finish_reason in CALL_STOPS["chat"]

    def to_message(self, *, include_reasoning: bool = False) -> AssistantMessage:
        """The OpenAI assistant message for this turn, ready to send back (with
        ``function_call`` instead of ``tool_calls`` for a legacy call).

        Only for a complete turn: any other raises :class:`~fsm.errors.IncompleteTurnError`, so an
        unfinished call can never be salvaged into history by accident. ``include_reasoning``
        adds ``reasoning_content`` (some providers want it back with tool calls).
        """
        if not self.complete:
            states = {c.position: (c.state.value, c.reason) for c in self.tool_calls}
            if not self.ended:
                why = "the stream has not ended"
            elif self.incomplete_reason == NO_TOOL_CALLS:
                why = (
                    f"finish_reason {self.finish_reason!r} but the stream carried no tool call "
                    "(something was lost between the model and here)"
                )
            elif unfinished := self.unfinished_calls:
                why = ", ".join(
                    f"call {c.position} ({c.name or 'no name'}) is {c.state.value} ({c.reason})"
                    for c in unfinished
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
        legacy = self.legacy_call
        return assistant_message(
            self.content,
            refusal=self.refusal,
            reasoning=self.reasoning if include_reasoning else None,
            tool_calls=[c.to_dict() for c in self.tool_calls] if legacy is None else (),
            function_call=legacy.to_function_call() if legacy is not None else None,
        )

    #: the stream format the turn came from: ``"chat"`` here; ``"responses"`` /
    #: ``"anthropic"`` for the turns of :mod:`fsm.formats`
    format: ClassVar[str] = "chat"

    def output_items(self) -> list[dict[str, Any]]:
        """The provider's own items of the turn, verbatim, in output order, as JSON-serializable
        copies: Responses output items (reasoning with ``encrypted_content``, messages, calls,
        built-in tool items) or Anthropic content blocks (thinking with its signature, text,
        ``tool_use``, server tool blocks). ``[]`` for a Chat Completions turn. Never raises:
        the items of an incomplete turn can be kept as an attempt."""
        return list(self.iter_output_items())

    def iter_output_items(self) -> Iterator[dict[str, Any]]:
        """The items of :meth:`output_items`, decoded one at a time (none for a Chat
        Completions turn)."""
        return iter(())

    def to_items(self, results: Mapping[str, Any] | Sequence[Any] | None = None) -> list[Any]:
        """The turn as Responses API input items, in output order (reasoning, message,
        ``function_call`` / ``custom_tool_call``, built-in tool items); with ``results`` (a
        mapping of call id to output, or the outputs in call order) also one
        ``function_call_output`` / ``custom_tool_call_output`` per call, in call order. Items
        only another provider understands are dropped (see the manual's guide to the three
        stream formats, docs/guides/formats.md).

        Only for a complete turn (:class:`~fsm.errors.IncompleteTurnError` otherwise)."""
        from fsm.shapes import to_items

        return to_items(self, results)

    def to_anthropic(
        self, results: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> list[dict[str, Any]]:
        """The turn as Anthropic Messages: one ``assistant`` message of content blocks in index
        order (thinking with its signature, redacted thinking, text, ``tool_use`` with ``input``
        the parsed object, server tool blocks), and with ``results`` (a mapping of call id to
        content, or the contents in call order) ONE ``user`` message of ``tool_result`` blocks
        in call order.

        Only for a complete turn, or an Anthropic turn stopped by ``pause_turn`` (sent back to
        let the model continue); :class:`~fsm.errors.IncompleteTurnError` otherwise."""
        from fsm.shapes import to_anthropic

        return to_anthropic(self, results)

    def to_json(self) -> dict[str, Any]:
        """The turn as the ``choices[]`` entry of ``fsm parse --json``."""
        return {
            "index": self.index,
            "finish_reason": self.finish_reason,
            "complete": self.complete,
            "incomplete_reason": self.incomplete_reason,
            "content": self.content,
            "reasoning": self.reasoning,
            "refusal": self.refusal,
            "tool_calls": [_call_json(c) for c in self.tool_calls],
        }

    def __repr__(self) -> str:
        return (
            f"Turn(index={self.index}, finish_reason={self.finish_reason!r}, "
            f"complete={self.complete}, tool_calls={len(self._calls)})"
        )


def _read_only(turn: Turn, method: str) -> NoReturn:
    raise LocalProtocolError(
        f"Turn.{method}() changes a turn while its stream is parsed; choice {turn.index} has "
        "ended and is read-only (read it, or parse the stream again with a new StreamParser)"
    )


def _end_normally(call: ToolCall, *, repair: bool, max_depth: int) -> Event:
    """End ``call`` of a stream that ended normally: ``finished`` when its arguments are JSON
    (or, opt-in, repaired to JSON), else by :data:`ARGUMENT_ENDINGS`; a custom call (free text,
    never JSON) is ``finished`` whatever its text."""
    if call.custom:
        return call.end("finish", None)
    raw = call.raw_arguments
    syntax = is_json(raw, max_depth)
    suffix = repair_json(raw, max_depth) if syntax is JsonSyntax.INVALID and repair else None
    if suffix:
        return call.end("finish", None, suffix)
    return call.end(*ARGUMENT_ENDINGS[syntax])


def _call_json(call: ToolCall) -> dict[str, Any]:
    """A call as a ``tool_calls[]`` entry of ``fsm parse --json``; a legacy ``function_call``
    also has ``"legacy": true`` (other calls have no ``legacy`` key)."""
    out: dict[str, Any] = {
        "position": call.position,
        "index": call.index,
        "id": call.id,
        "type": call.type,
        "name": call.name,
        "arguments": call.arguments,
        "state": call.state.value,
        "reason": call.reason,
        "repaired": call.repaired,
    }
    if call.legacy:
        out["legacy"] = True
    return out


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
    #: SSE events and chunks received (``0``: the input held no event at all, not a stream).
    event_count: int = 0
    #: the stream's format: ``"chat"``, ``"responses"`` or ``"anthropic"``; ``None`` when no
    #: event carried JSON (nothing to detect it from)
    format: str | None = None
    #: the error's code or type when the stream ended with an error that had one
    #: (``"rate_limit_exceeded"``, ``"overloaded_error"``), else ``None``
    error_code: str | None = None

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

    def to_chat_completion(self) -> dict[str, Any]:
        """The ``chat.completion`` this Chat Completions stream amounts to (a drop-in for
        LiteLLM's ``stream_chunk_builder``): see :func:`fsm.chat_completion.chat_completion`."""
        from fsm.chat_completion import chat_completion

        return chat_completion(self)

    def to_json(self) -> dict[str, Any]:
        """The object ``fsm parse --json`` prints. ``end`` says how the stream ended
        (``{"how": "done" | "eof" | "error" | "aborted" | "protocol_error" | "limit" | null,
        "reason": <the error message, abort reason or limit, or null>}``), also when no choice
        ever arrived."""
        return {
            "response_id": self.response_id,
            "model": self.model,
            "usage": self.usage,
            "end": {"how": self.end_how, "reason": self.end_reason},
            "anomalies": [{"kind": a.kind, "detail": a.detail} for a in self.anomalies],
            "choices": [t.to_json() for t in self.turns],
            "format": self.format,
            "error_code": self.error_code,
        }
