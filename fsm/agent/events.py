"""The agent loop's own events and its result (the parser's events come from :mod:`fsm.events`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fsm.events import Event

if TYPE_CHECKING:
    from fsm.store.store import CommittedTurn

__all__ = [
    "AgentEvent",
    "AgentResult",
    "AttemptRecorded",
    "RequestSent",
    "ToolExecuted",
    "TurnCommitted",
]


@dataclass(frozen=True, slots=True)
class RequestSent:
    """Request number ``step`` (1-based) is about to go out with ``messages`` messages."""

    step: int
    messages: int


@dataclass(frozen=True, slots=True)
class ToolExecuted:
    """A tool ran for call ``position`` of the turn: ``content`` is the result sent back;
    ``error`` says whether it is an error result (an exception, an unknown tool, arguments that
    are not a JSON object)."""

    step: int
    position: int
    call_id: str
    name: str
    arguments: str
    content: str
    error: bool
    #: no tool ran: the call names no registered tool, or is a custom (free-text) call;
    #: ``content`` is the error result that says so (issue 17)
    refused: bool = False


@dataclass(frozen=True, slots=True)
class TurnCommitted:
    """The turn of request ``step`` and its results are in history (``turn.messages``)."""

    step: int
    turn: CommittedTurn


@dataclass(frozen=True, slots=True)
class AttemptRecorded:
    """The turn of request ``step`` did not end complete: it was recorded as attempts
    ``attempt_ids`` (empty when ``record_attempts`` is false) and nothing went to history."""

    step: int
    attempt_ids: list[int]
    reason: str


#: What ``on_event`` receives: the parser's events (:mod:`fsm.events`) as they stream, and the
#: loop's own.
AgentEvent = Event | RequestSent | ToolExecuted | TurnCommitted | AttemptRecorded


@dataclass(frozen=True, slots=True)
class AgentResult:
    """How the loop ended: ``status`` is ``"completed"`` (a turn without tool calls was
    committed) or ``"max_turns"`` (the last request's turn still had tool calls; its results are
    committed, so the conversation can go on); ``turns`` holds every committed turn, in order."""

    conversation_id: str
    status: Literal["completed", "max_turns"]
    turns: list[CommittedTurn] = field(default_factory=list)

    @property
    def content(self) -> str | None:
        """The text of the last committed assistant message (the answer, when completed)."""
        if not self.turns:
            return None
        content = self.turns[-1].messages[0].get("content")
        return content if isinstance(content, str) else None
