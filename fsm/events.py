"""Events the parser emits, in stream order.

Every ``StreamParser.receive_*`` call returns a list of these. They are frozen, slotted,
keyword-only dataclasses with past-tense names, so they can be matched::

    for event in parser.receive_data(data):
        match event:
            case ToolCallOpened(name=name):
                print(f"calling {name}...")
            case ToolCallFinished(id=call_id, arguments=arguments):
                ...

Fields shared by the tool-call events: ``choice`` (the choice index), ``ordinal`` (the call's
0-based opening order within its choice: a stable key while streaming, since ids and names may
arrive late), and ``index`` (the provider's index, ``None`` when the provider sent none). The final
events also carry ``position``: the call's place in the finished turn (by index, then by opening
order), which is also its place in history.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AnomalyDetected",
    "ContentDelta",
    "Event",
    "FinishReasonReceived",
    "ReasoningDelta",
    "RefusalDelta",
    "StreamEnded",
    "ToolCallAborted",
    "ToolCallArgumentsDelta",
    "ToolCallFinished",
    "ToolCallOpened",
    "ToolCallTruncated",
    "ToolCallUpdated",
    "TurnEnded",
    "UsageReceived",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base class of every event."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContentDelta(Event):
    """A piece of the assistant's text content for one choice."""

    choice: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningDelta(Event):
    """A piece of reasoning text (``delta.reasoning_content`` or ``delta.reasoning``)."""

    choice: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RefusalDelta(Event):
    """A piece of a refusal (``delta.refusal``)."""

    choice: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallOpened(Event):
    """A tool call now exists. ``name`` and ``id`` are what is known so far (maybe ``""``)."""

    choice: int
    ordinal: int
    index: int | None
    id: str
    name: str
    type: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallUpdated(Event):
    """A call's ``id`` or ``name`` changed after it was opened (late id, name split in parts)."""

    choice: int
    ordinal: int
    index: int | None
    id: str
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallArgumentsDelta(Event):
    """A non-empty fragment of a call's arguments, verbatim."""

    choice: int
    ordinal: int
    index: int | None
    delta: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _ToolCallFinal(Event):
    choice: int
    ordinal: int
    position: int
    index: int | None
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallFinished(_ToolCallFinal):
    """The call is final and usable: arguments are valid JSON (or empty).

    ``repaired`` is true when opt-in JSON repair appended characters to make them parse; the raw
    string is then ``arguments[:raw_length]``.
    """

    repaired: bool = False
    raw_length: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallTruncated(_ToolCallFinal):
    """The call is final and its arguments are incomplete (``length`` or ``invalid_json``)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallAborted(_ToolCallFinal):
    """The call is final and unusable; ``reason`` says why (``eof``, ``missing_name``, ...)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishReasonReceived(Event):
    """A choice reported a ``finish_reason``. It may come more than once; the last one counts."""

    choice: int
    finish_reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageReceived(Event):
    """A ``usage`` object arrived (the last one seen is kept on the result)."""

    usage: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class AnomalyDetected(Event):
    """The provider did something wrong that the parser survived. See :class:`fsm.Anomaly`."""

    kind: str
    detail: str
    choice: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnEnded(Event):
    """A choice's turn is final; ``complete`` says whether it may go to history, and
    ``reason`` why not (:attr:`fsm.Turn.incomplete_reason`; ``None`` when complete)."""

    choice: int
    finish_reason: str | None
    complete: bool
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEnded(Event):
    """The stream is over.

    ``how`` is one of ``done`` (``data: [DONE]``), ``eof`` (``receive_eof()``), ``error`` (an
    error payload), ``aborted`` (``abort()``), ``limit`` (a stream-wide limit was exceeded) or
    ``protocol_error``. ``reason`` is the error message or abort reason, else ``None``.
    """

    how: str
    reason: str | None
    complete: bool


# -- fast constructors for the per-fragment events (internal: not in __all__) -----------------
# A frozen dataclass's generated __init__ assigns each field through object.__setattr__, which
# costs about twice a plain store. On the parser's hot path the same instances are built by
# writing the slots through their descriptors: identical objects, half the cost.
_new = object.__new__


def _slot_setter(cls: type[Event], name: str) -> Callable[[Event, Any], None]:
    setter: Callable[[Event, Any], None] = cls.__dict__[name].__set__
    return setter


#: slot setters of ToolCallArgumentsDelta (for ToolCall.append, the one place building it)
ad_choice = _slot_setter(ToolCallArgumentsDelta, "choice")
ad_ordinal = _slot_setter(ToolCallArgumentsDelta, "ordinal")
ad_index = _slot_setter(ToolCallArgumentsDelta, "index")
ad_delta = _slot_setter(ToolCallArgumentsDelta, "delta")


def _text_factory(cls: type[Event]) -> Callable[[int, str], Event]:
    set_choice = _slot_setter(cls, "choice")
    set_text = _slot_setter(cls, "text")

    def make(choice: int, text: str) -> Event:
        event: Event = _new(cls)
        set_choice(event, choice)
        set_text(event, text)
        return event

    return make


#: slot setters of ContentDelta and ReasoningDelta, for the parser's inlined hot paths
cd_choice = _slot_setter(ContentDelta, "choice")
cd_text = _slot_setter(ContentDelta, "text")
rd_choice = _slot_setter(ReasoningDelta, "choice")
rd_text = _slot_setter(ReasoningDelta, "text")
refusal_delta = _text_factory(RefusalDelta)
