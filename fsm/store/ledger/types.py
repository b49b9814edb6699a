"""The tool ledger's types (:mod:`fsm.store.ledger`): a pending turn, its calls' executions, an outcome to record; the plans and checks that need no I/O."""

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.parser import ParseResult, Turn
from fsm.states import EXECUTION_OUTCOMES, ToolCallState
from fsm.store import plans
from fsm.store.errors import (
    LedgerStateError,
    PendingTurnError,
    ResultsError,
)
from fsm.store.models import PendingTurnRow
from fsm.toolcall import ToolCall

if TYPE_CHECKING:
    pass


#: seconds an owner holds a pending turn without renewing it (``ledger_lease``'s default).
DEFAULT_LEASE = 30.0

#: the state of one call's execution.
ExecutionState = Literal["not_started", "started", "succeeded", "failed"]

#: an outcome to record: (position, "succeeded" or "failed", text, content parts)
Recording = tuple[int, Literal["succeeded", "failed"], str | None, list[Any] | None]


@dataclass(frozen=True, slots=True)
class LedgerCall:
    """A call of a pending turn, as history will hold it (the attributes of a finished
    :class:`~fsm.toolcall.ToolCall` that the store and the tools read)."""

    position: int
    id: str
    index: int | None
    type: str
    name: str
    arguments: str
    raw_arguments: str | None
    repaired: bool
    legacy: bool
    state: ToolCallState = ToolCallState.FINISHED

    @property
    def custom(self) -> bool:
        """A free-text (Responses ``custom_tool_call``) call: never given to a function."""
        return self.type == "custom"

    def to_dict(self) -> dict[str, Any]:
        """The ``tool_calls[]`` entry of the assistant message."""
        if self.type == "custom":  # a free-text call (as ToolCall.to_dict renders it)
            return {
                "id": self.id,
                "type": "custom",
                "custom": {"name": self.name, "input": self.arguments},
            }
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def to_function_call(self) -> dict[str, Any]:
        """The legacy ``function_call`` of the assistant message."""
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class Execution:
    """What the ledger recorded for one call: its state, how many times it was started, when,
    and its result (``succeeded``: a string or a list of content parts) or error text
    (``failed``)."""

    call: LedgerCall
    state: ExecutionState
    starts: int
    started_at: datetime | None
    finished_at: datetime | None
    result: str | list[Any] | None
    error: str | None
    started_by: str | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        """Whether the call has an outcome (``succeeded`` or ``failed``)."""
        return self.state in EXECUTION_OUTCOMES

    @property
    def content(self) -> str | list[Any] | None:
        """What history gets as the call's result: the result, or the error text."""
        return self.result if self.state == "succeeded" else self.error


@dataclass(frozen=True, slots=True)
class PendingTurn:
    """A turn in the ledger: its assistant message, its calls' executions, its state
    (``pending``, ``committed``, ``abandoned``) and its owner token (the handle returned by
    ``begin`` or ``claim`` is the one that may record)."""

    conversation_id: str
    id: int
    state: Literal["pending", "committed", "abandoned"]
    owner: str
    at_seq: int
    created_at: datetime | None
    resolved_at: datetime | None
    reason: str | None
    committed_seq: int | None
    content: str | None
    reasoning: str | None
    refusal: str | None
    model: str | None
    response_id: str | None
    choice: int | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    idempotency_key: str | None
    executions: tuple[Execution, ...]
    #: the stream's format and the assistant message's provider-only items (issue 17)
    format: str | None = None
    provider_items: list[Any] | None = None
    #: until when the owner holds the turn (the database's clock; ``None``: a turn written
    #: before leases, or resolved); changes with every renewal, so not compared
    lease_expires_at: datetime | None = field(default=None, compare=False)
    #: the owner token the store's ``claim()`` takes with this handle: a claim retried
    #: with the same handle recognises its own (a new one for every handle read)
    claim_token: str = field(
        default_factory=lambda: secrets.token_hex(16), compare=False, repr=False
    )

    @property
    def calls(self) -> list[LedgerCall]:
        """The turn's calls, in order."""
        return [e.call for e in self.executions]

    @property
    def index(self) -> int | None:
        """The choice (the attribute name of :class:`~fsm.parser.Turn`)."""
        return self.choice

    @property
    def tool_calls(self) -> list[LedgerCall]:
        """:attr:`calls` (the attribute name of :class:`~fsm.parser.Turn`)."""
        return self.calls

    def execution(self, call: int | ToolCall | LedgerCall | Execution) -> Execution:
        """The execution of ``call`` (a position, or the call)."""
        return self.executions[call_position(self, call)]

    def to_message(self) -> dict[str, Any]:
        """The assistant message as history will hold it (as :meth:`fsm.Turn.to_message`)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.refusal is not None:
            message["refusal"] = self.refusal
        calls = self.calls
        if len(calls) == 1 and calls[0].legacy:
            message["function_call"] = calls[0].to_function_call()
        elif calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
        return message


@dataclass(frozen=True, slots=True)
class Outcome:
    """A call's outcome to record in the transaction of the next step (``started(...,
    recording=...)`` of the next call, or ``commit(..., recording=...)``), which saves a
    transaction per call: ``result`` for a tool that succeeded (a string, or a list of content
    parts), or ``error`` (its text) for one that failed."""

    call: int | ToolCall | LedgerCall
    result: Any = None
    error: str | None = None


def to_recording(pending: PendingTurn, outcome: object) -> Recording:
    if not isinstance(outcome, Outcome):
        raise TypeError(f"recording is an Outcome, not {type(outcome).__name__}")
    position = call_position(pending, outcome.call)
    if outcome.error is not None:
        return (position, "failed", check_error(outcome.error), None)
    text, parts = plan_result(pending.executions[position].call, outcome.result)
    return (position, "succeeded", text, parts)


def call_position(pending: PendingTurn, call: object) -> int:
    if isinstance(call, Execution):
        call = call.call
    if isinstance(call, bool) or not isinstance(call, int | ToolCall | LedgerCall):
        raise TypeError(
            f"a call is its position (an int) or the call itself, not {type(call).__name__}"
        )
    position = call if isinstance(call, int) else call.position
    if not 0 <= position < len(pending.executions):
        raise LedgerStateError(
            f"pending turn {pending.id} of conversation {pending.conversation_id!r} has "
            f"{len(pending.executions)} call(s): there is no call at position {position}"
        )
    return position


# -- plans (no I/O) --------------------------------------------------------------------------
def plan_begin(
    conversation_id: str, turn: Turn | ParseResult, idempotency_key: str | None
) -> tuple[Turn, list[ToolCall]]:
    """``begin``: one complete turn, the conversation id and key checked as ``commit_turn``."""
    plans.check_conversation_id(conversation_id)
    plans.check_idempotency_key(idempotency_key)
    single = plans._single_turn(turn)
    calls = plans._complete_calls(single)
    plans._check_key_lengths(single, calls)
    return single, calls


def plan_result(call: LedgerCall, result: Any) -> tuple[str | None, list[Any] | None]:
    """A tool's result as ``commit_turn`` takes it: (text, parts)."""
    return plans._normalize_results([cast(ToolCall, call)], [result])[0]


def start_position(calls: Sequence[ToolCall], start: object) -> int | None:
    """``begin``'s ``start``: a call's position in ``calls`` (or the call), or ``None``."""
    if start is None:
        return None
    position = start if isinstance(start, int) and not isinstance(start, bool) else None
    if isinstance(start, ToolCall):
        position = next((p for p, c in enumerate(calls) if c is start), None)
    if position is None or not 0 <= position < len(calls):
        raise LedgerStateError(
            f"begin(start=...) names a call of the turn (0 to {len(calls) - 1}), not {start!r}"
        )
    return position


def check_error(error: object) -> str:
    if not isinstance(error, str):
        raise ResultsError(f"a tool's error is its text (a str), not {type(error).__name__}")
    return error


def check_reason(reason: object) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("abandon() needs a reason: a non-blank string saying why")
    return reason


# -- the write path's hook ---------------------------------------------------------------------
def check_no_pending(conn: Connection, conversation_id: str) -> None:
    """Raise :class:`~fsm.store.errors.PendingTurnError` if the conversation has a pending turn
    (called by ``append`` and ``commit_turn`` under the conversation's write lock)."""
    row = conn.execute(
        sa.select(PendingTurnRow.id, PendingTurnRow.at_seq).where(
            PendingTurnRow.conversation_id == conversation_id, PendingTurnRow.state == "pending"
        )
    ).first()
    if row is not None:
        raise pending_error(conversation_id, row[0], row[1])


def pending_error(conversation_id: str, pending_id: object, at_seq: object) -> PendingTurnError:
    """The :class:`~fsm.store.errors.PendingTurnError` of a write that found the
    conversation's pending turn ``pending_id`` (at ``at_seq``)."""
    return PendingTurnError(
        conversation_id,
        int(cast(int, pending_id)),
        int(cast(int, at_seq)),
        f"pending turn {pending_id} (its tools are running, or a process crashed while they "
        "ran) blocks other writes until it is committed or abandoned; resume it "
        "(store.pending(), store.claim()) or abandon it, then retry",
    )
