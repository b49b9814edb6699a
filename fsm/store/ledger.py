"""The tool ledger: a complete turn is stored *pending* while its tools run, each tool's outcome
is recorded as it finishes, and ``commit`` moves it into history in one transaction.

::

    pending = store.begin(cid, turn)                      # durable: the turn and its calls
    for call in pending.calls:
        pending = store.started(pending, call)            # before the tool runs
        content = run(call)
        pending = store.succeeded(pending, call, content) # or store.failed(pending, call, text)
    done = store.commit(pending)                          # history: the existing commit path

After a crash, ``store.pending(cid)`` returns the pending turn with each call's recorded state
(``not_started``, ``started``, ``succeeded``, ``failed``) and result; ``store.claim(pending)``
makes the caller its owner (compare-and-set on the owner token: of two processes resuming the
same turn, one wins, the other gets :class:`~fsm.store.errors.PendingTurnError`). Only the
owner records.

**Leases** (issue 26). The owner holds the turn until ``lease_expires_at``, by the database's
clock (PostgreSQL's ``clock_timestamp()``, SQLite's ``'now'``: one clock for every process
that shares the database): ``begin`` and ``claim`` set it to now + :attr:`ledger_lease
<LedgerMethods.ledger_lease>` seconds, ``started`` and :meth:`~LedgerMethods.renew` move it on,
and :meth:`~LedgerMethods.heartbeat` renews it every third of the lease while the tools run.
``claim`` takes a turn over only once its lease has run out (its owner is gone); before that it
raises :class:`~fsm.store.errors.TurnInProgressError` (retryable, with ``retry_after``), so a
live owner keeps its turn. A retried ``claim`` of the same handle (after a lost COMMIT reply)
recognises its own claim: the handle carries the token it claims with. While a turn is pending, ``append`` and ``commit_turn`` on its conversation raise
:class:`~fsm.store.errors.PendingTurnError`.

Every step is its own short transaction and idempotent: repeating it after a lost
acknowledgement changes nothing (``begin`` of the same turn returns the pending one, ``started``
of a call this owner already started is a no-op, ``succeeded``/``failed`` with the recorded
outcome is a no-op and with another one raises :class:`~fsm.store.errors.LedgerStateError`,
``commit`` of a committed turn returns the stored turn, ``abandon`` with the same reason is a
no-op). The database enforces at most one pending turn per conversation (a partial unique
index) and what each state carries (checks: :mod:`fsm.store.models`).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.parser import ParseResult, Turn
from fsm.states import ToolCallState
from fsm.store import plans
from fsm.store.errors import (
    CommitOutcomeUnknownError,
    ConversationNotFoundError,
    IdempotencyMismatchError,
    LedgerStateError,
    PendingTurnError,
    ResultsError,
    StoreError,
    TurnInProgressError,
)
from fsm.store.history import (
    CommittedTurn,
    StoreCoreLike,
    WriteState,
    check_expected,
    read_history,
    require_conversation,
)
from fsm.store.models import Conversation, Message, PendingTurnRow, ToolExecution
from fsm.store.render import stored_items
from fsm.toolcall import ToolCall

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection


__all__ = [
    "DEFAULT_LEASE",
    "AsyncLedgerMethods",
    "Execution",
    "ExecutionState",
    "LedgerCall",
    "LedgerMethods",
    "Outcome",
    "PendingTurn",
    "check_no_pending",
    "pending_error",
]

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
        return self.state in ("succeeded", "failed")

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
        return self.executions[_position(self, call)]

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


def _recording(pending: PendingTurn, outcome: object) -> Recording:
    if not isinstance(outcome, Outcome):
        raise TypeError(f"recording is an Outcome, not {type(outcome).__name__}")
    position = _position(pending, outcome.call)
    if outcome.error is not None:
        return (position, "failed", _check_error(outcome.error), None)
    text, parts = plan_result(pending.executions[position].call, outcome.result)
    return (position, "succeeded", text, parts)


def _position(pending: PendingTurn, call: object) -> int:
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


def _start_position(calls: Sequence[ToolCall], start: object) -> int | None:
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


def _check_error(error: object) -> str:
    if not isinstance(error, str):
        raise ResultsError(f"a tool's error is its text (a str), not {type(error).__name__}")
    return error


def _check_reason(reason: object) -> str:
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


# -- transaction bodies ------------------------------------------------------------------------
def _now() -> sa.ColumnElement[Any]:
    return sa.func.current_timestamp()


def _utc(value: Any) -> datetime | None:
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _lease_until(core: StoreCoreLike, lease: float) -> sa.ColumnElement[Any]:
    """Now + ``lease`` seconds, by the database's clock."""
    if core.postgres:
        return sa.func.clock_timestamp() + sa.func.make_interval(
            0, 0, 0, 0, 0, 0, sa.literal(float(lease), sa.Float())
        )
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", f"+{lease:.3f} seconds")


def _lease_left(core: StoreCoreLike) -> sa.ColumnElement[Any]:
    """Seconds left on a pending turn's lease by the database's clock (negative: run out;
    NULL: none)."""
    lease = PendingTurnRow.lease_expires_at
    if core.postgres:
        return sa.func.extract("epoch", lease - sa.func.clock_timestamp())
    return (sa.func.julianday(lease) - sa.func.julianday("now")) * 86400.0


def _check_lease(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0.05 <= value <= 86400
    ):
        raise ValueError(
            f"ledger_lease is the seconds an owner holds a pending turn between renewals: a "
            f"number from 0.05 to 86400, not {value!r}"
        )
    return float(value)


def _live_owner(core: StoreCoreLike, conn: Connection, stored: PendingTurn) -> None:
    """Raise :class:`~fsm.store.errors.TurnInProgressError` if ``stored``'s lease has not run
    out (its owner is alive)."""
    p = PendingTurnRow
    left = conn.execute(
        sa.select(_lease_left(core)).where(
            p.conversation_id == stored.conversation_id, p.id == stored.id
        )
    ).scalar()
    if left is None or float(left) <= 0 or stored.lease_expires_at is None:
        return
    raise TurnInProgressError(
        stored.conversation_id,
        stored.id,
        stored.at_seq,
        stored.owner,
        stored.lease_expires_at,
        float(left),
    )


# -- the steps' statements, built once (building a statement costs more than running it) ------
_TURNS_T = cast(sa.Table, PendingTurnRow.__table__)
_EXEC_T = cast(sa.Table, ToolExecution.__table__)
_STATEMENTS: dict[tuple[str, bool], Any] = {}


def _statement(name: str, postgres: bool = False) -> Any:
    """The step's statement ``name`` (for PostgreSQL or SQLite where they differ), with bind
    parameters ``c`` (the conversation), ``p`` (the pending turn), ``pos``, ..."""
    key = (name, postgres)
    found = _STATEMENTS.get(key)
    if found is None:
        found = _STATEMENTS[key] = _build(name, postgres)
    return found


def _build(name: str, postgres: bool) -> Any:
    t, e = _TURNS_T.c, _EXEC_T.c
    turn = sa.and_(t.conversation_id == sa.bindparam("c"), t.id == sa.bindparam("p"))
    call = sa.and_(
        e.conversation_id == sa.bindparam("c"),
        e.pending_id == sa.bindparam("p"),
        e.position == sa.bindparam("pos"),
    )
    if name == "lease":
        return (
            sa.update(_TURNS_T)
            .where(turn)
            .values(lease_expires_at=_lease_bind(postgres))
            .returning(t.lease_expires_at)
        )
    if name in ("turn", "turn_locked"):
        query = sa.select(_TURNS_T).where(turn)
        return query.with_for_update() if name == "turn_locked" else query
    if name in ("open", "open_locked"):  # the conversation's pending turn
        query = sa.select(_TURNS_T).where(
            t.conversation_id == sa.bindparam("c"), t.state == "pending"
        )
        return query.with_for_update() if name == "open_locked" else query
    if name == "renew":  # the owner's lease renewed, the turn's row read back
        return (
            sa.update(_TURNS_T)
            .where(turn, t.state == "pending", t.owner == sa.bindparam("holder"))
            .values(lease_expires_at=_lease_bind(postgres))
            .returning(*_TURNS_T.c)
        )
    if name == "insert_turn":  # binds its columns and the lease
        return (
            sa.insert(_TURNS_T)
            .values(lease_expires_at=_lease_bind(postgres))
            .returning(*_TURNS_T.c)
        )
    if name == "insert_executions":
        return sa.insert(_EXEC_T).returning(*_EXEC_T.c, sort_by_parameter_order=True)
    if name == "resolve":
        return (
            sa.update(_TURNS_T)
            .where(turn)
            .values(state="committed", committed_seq=sa.bindparam("seq"), resolved_at=_now())
        )
    if name in ("begin_key", "begin_response", "begin_none"):
        return _begin_state(name.removeprefix("begin_"), exists=not postgres)
    if name == "executions":
        return (
            sa.select(_EXEC_T)
            .where(e.conversation_id == sa.bindparam("c"), e.pending_id == sa.bindparam("p"))
            .order_by(e.position)
        )
    if name == "start":
        return (
            sa.update(_EXEC_T)
            .where(call)
            .values(
                state="started",
                starts=e.starts + 1,
                started_at=_now(),
                started_by=sa.bindparam("owner", type_=e.started_by.type),
            )
            .returning(*_EXEC_T.c)
        )
    if name == "finish":
        return (
            sa.update(_EXEC_T)
            .where(call)
            .values(
                state=sa.bindparam("state", type_=e.state.type),
                finished_at=_now(),
                result=sa.bindparam("result", type_=e.result.type),
                result_parts=sa.bindparam("parts", type_=e.result_parts.type),
                error=sa.bindparam("error", type_=e.error.type),
            )
            .returning(*_EXEC_T.c)
        )
    raise AssertionError(name)  # pragma: no cover


def _lease_bind(postgres: bool) -> Any:
    """Now + the bound lease (``lease`` seconds on PostgreSQL, SQLite's ``modifier``), by the
    database's clock (see :func:`_lease_params`)."""
    if postgres:
        return sa.func.clock_timestamp() + sa.func.make_interval(
            0, 0, 0, 0, 0, 0, sa.bindparam("lease", type_=sa.Float())
        )
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", sa.bindparam("modifier"))


def _begin_state(same: str, *, exists: bool) -> sa.Select[Any]:
    """What a begin reads before it inserts, in one query (bind ``c``): ``[exists,]
    pending_id, done_id, last_seq, last_slots_left``: the conversation's pending turn, the
    latest ledger turn committed under the same idempotency key (``same="key"``, bind ``key``)
    or response id and choice (``"response"``, binds ``response_id`` and ``choice``; ``"none"``:
    NULL), and its last message (the seq the turn takes)."""
    t, c = _TURNS_T.c, sa.bindparam("c", type_=_TURNS_T.c.conversation_id.type)
    columns: list[Any] = []
    if exists:
        columns.append(sa.select(sa.literal(1)).where(Conversation.id == c).scalar_subquery())
    columns.append(
        sa.select(t.id).where(t.conversation_id == c, t.state == "pending").scalar_subquery()
    )
    if same == "none":
        columns.append(sa.null())
    else:
        found = (
            t.idempotency_key == sa.bindparam("key")
            if same == "key"
            else sa.and_(
                t.response_id == sa.bindparam("response_id"), t.choice == sa.bindparam("choice")
            )
        )
        columns.append(
            sa.select(t.id)
            .where(t.conversation_id == c, t.state == "committed", found)
            .order_by(t.id.desc())
            .limit(1)
            .scalar_subquery()
        )
    m = Message
    last = sa.select(m.seq).where(m.conversation_id == c).order_by(m.seq.desc()).limit(1)
    columns += [last.scalar_subquery(), last.with_only_columns(m.slots_left).scalar_subquery()]
    return sa.select(*columns)


def _lease_params(core: StoreCoreLike, lease: float) -> dict[str, Any]:
    if core.postgres:
        return {"lease": float(lease)}
    return {"modifier": f"+{lease:.3f} seconds"}


def _set_lease(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, owner: str, lease: float
) -> None:
    p = PendingTurnRow
    conn.execute(
        sa.update(p)
        .where(p.conversation_id == pending.conversation_id, p.id == pending.id)
        .values(owner=owner, lease_expires_at=_lease_until(core, lease))
    )


def _load(
    conn: Connection, conversation_id: str, pending_id: int | None, *, lock: bool = False
) -> PendingTurn | None:
    """A pending turn by id (``None``: the conversation's pending one), with its executions."""
    if pending_id is None:
        row = conn.execute(
            _statement("open_locked" if lock else "open"), {"c": conversation_id}
        ).first()
    else:
        statement = _statement("turn_locked" if lock else "turn")
        row = conn.execute(statement, {"c": conversation_id, "p": pending_id}).first()
    if row is None:
        return None
    values = row._mapping
    executions = conn.execute(
        _statement("executions"), {"c": conversation_id, "p": values["id"]}
    ).all()
    return _built(conversation_id, values, executions)


def _built(conversation_id: str, values: Any, executions: Sequence[Any]) -> PendingTurn:
    """A :class:`PendingTurn` from its row's mapping and its executions' rows (in order)."""
    return PendingTurn(
        conversation_id=conversation_id,
        id=int(values["id"]),
        state=values["state"],
        owner=values["owner"],
        at_seq=int(values["at_seq"]),
        created_at=_utc(values["created_at"]),
        resolved_at=_utc(values["resolved_at"]),
        reason=values["reason"],
        committed_seq=values["committed_seq"],
        content=values["content"],
        reasoning=values["reasoning"],
        refusal=values["refusal"],
        model=values["model"],
        response_id=values["response_id"],
        choice=values["choice"],
        finish_reason=values["finish_reason"],
        usage=values["usage"],
        idempotency_key=values["idempotency_key"],
        executions=tuple(_execution(x._mapping) for x in executions),
        format=values.get("format"),
        provider_items=values.get("provider_items"),
        lease_expires_at=_utc(values.get("lease_expires_at")),
    )


def _execution(x: Any) -> Execution:
    call = LedgerCall(
        position=int(x["position"]),
        id=x["call_id"],
        index=x["provider_index"],
        type=x["type"],
        name=x["name"],
        arguments=x["arguments"],
        raw_arguments=x["raw_arguments"],
        repaired=bool(x["repaired"]),
        legacy=bool(x["legacy"]),
    )
    result = x["result"] if x["result_parts"] is None else x["result_parts"]
    return Execution(
        call=call,
        state=x["state"],
        starts=int(x["starts"]),
        started_at=_utc(x["started_at"]),
        finished_at=_utc(x["finished_at"]),
        result=result,
        error=x["error"],
        started_by=x["started_by"],
    )


def _same_turn(pending: PendingTurn, turn: Turn, key: str | None) -> bool:
    stored = pending.to_message()
    given = dict(turn.to_message())
    return (
        stored == given
        and pending.idempotency_key == key
        and pending.reasoning == turn.reasoning
        and pending.model == turn.model
        and (pending.response_id or None) == (turn.response_id or None)
        and pending.choice == turn.index
    )


def begin_body(
    core: StoreCoreLike,
    conn: Connection,
    conversation_id: str,
    turn: Turn,
    calls: Sequence[ToolCall],
    idempotency_key: str | None,
    expected_seq: int | None,
    owner: str | None = None,
    lease: float = DEFAULT_LEASE,
    start: int | None = None,
) -> PendingTurn:
    """Store ``turn`` as the conversation's pending turn owned by ``owner`` (or return it if
    this ``owner`` already began it; the same turn begun by an owner whose lease ran out is
    taken over, one whose lease holds raises :class:`~fsm.store.errors.TurnInProgressError`),
    and start call ``start`` in the same transaction (not on a turn taken over)."""
    owner = owner or secrets.token_hex(16)
    if core.postgres:  # the conversation's row lock first: its writers queue here
        require_conversation(conn, conversation_id, lock=True)
    # one query says whether this is the common case (a new turn: no pending turn, no earlier
    # commit of it); the others read what they need after it
    params: dict[str, Any] = {"c": conversation_id}
    if idempotency_key is not None:
        same, params["key"] = "key", idempotency_key
    elif turn.response_id:
        same, params["response_id"], params["choice"] = "response", turn.response_id, turn.index
    else:
        same = "none"
    row = tuple(conn.execute(_statement("begin_" + same, core.postgres), params).one())
    if not core.postgres:
        if row[0] is None:
            raise ConversationNotFoundError(conversation_id)
        row = row[1:]
    pending_id, done_id, last_seq, slots_left = row
    existing = (
        None if pending_id is None else _load(conn, conversation_id, None, lock=core.postgres)
    )
    if existing is not None:
        if _same_turn(existing, turn, idempotency_key):
            if existing.owner != owner:  # not this begin retried: another request's turn
                _live_owner(core, conn, existing)
                _set_lease(core, conn, existing, owner, lease)
            found = _load(conn, conversation_id, existing.id)
            assert found is not None
            if existing.owner == owner and start is not None:
                return _start(core, conn, found, start, lease)
            return found
        raise PendingTurnError(
            conversation_id,
            existing.id,
            existing.at_seq,
            f"pending turn {existing.id} is another turn: one turn at a time per conversation; "
            "resume or abandon it first",
        )
    if done_id is not None:
        # a begin retried after its turn was committed: the same turn, committed
        found = _load(conn, conversation_id, int(done_id))
        assert found is not None
        if not _same_turn(found, turn, idempotency_key):
            raise IdempotencyMismatchError(
                f"conversation {conversation_id!r} already committed a different turn "
                f"through the ledger under this response id / idempotency key (pending turn "
                f"{found.id}): use a new idempotency key for a new turn"
            )
        return found
    with core.reading(conversation_id):
        seq = WriteState(None, None, last_seq, slots_left).next_seq()
    check_expected(conversation_id, expected_seq, seq)
    n = len(calls)
    inserted = conn.execute(
        _statement("insert_turn", core.postgres),
        {
            **_lease_params(core, lease),
            "conversation_id": conversation_id,
            "state": "pending",
            "owner": owner,
            "at_seq": seq,
            "content": turn.content,
            "reasoning": turn.reasoning,
            "refusal": turn.refusal,
            "model": turn.model,
            "response_id": turn.response_id or None,
            "choice": turn.index,
            "finish_reason": turn.finish_reason,
            "usage": plans.json_safe(turn.usage),
            "idempotency_key": idempotency_key,
            "n_calls": n,
            **dict(zip(("format", "provider_items"), stored_items(turn), strict=True)),
        },
    ).one()
    pending_id = inserted._mapping["id"]
    executions: Sequence[Any] = []
    if n:
        executions = conn.execute(
            _statement("insert_executions"),
            [
                {
                    "conversation_id": conversation_id,
                    "pending_id": pending_id,
                    "position": p,
                    "pending_n_calls": n,
                    **plans.call_columns(call),
                    "legacy": call.legacy,
                    "state": "not_started",
                    "starts": 0,
                }
                for p, call in enumerate(calls)
            ],
        ).all()
    found = _built(conversation_id, inserted._mapping, executions)
    # the INSERT gave it its lease: starting the call needs no renewal
    return found if start is None else _start(core, conn, found, start, None)


def pending_body(conn: Connection, conversation_id: str) -> PendingTurn | None:
    """The conversation's pending turn, or ``None``."""
    found = _load(conn, conversation_id, None)
    if found is None:
        require_conversation(conn, conversation_id)
    return found


def _owned(
    core: StoreCoreLike,
    conn: Connection,
    pending: PendingTurn,
    *,
    resolved_ok: bool = False,
    conversation_lock: bool = True,
) -> PendingTurn:
    """The stored state of ``pending`` under the conversation's lock (``conversation_lock``;
    else under its own row's lock: a step that records a call changes nothing the
    conversation's other writers read); raises unless it is still pending and ``pending``'s
    owner still owns it."""
    if not isinstance(pending, PendingTurn):
        raise TypeError(
            f"a ledger step takes the PendingTurn of begin()/claim(), not {type(pending).__name__}"
        )
    if conversation_lock and core.postgres:  # SQLite: BEGIN IMMEDIATE took the database's
        require_conversation(conn, pending.conversation_id, lock=True)
    stored = _load(conn, pending.conversation_id, pending.id, lock=core.postgres)
    if stored is None:
        require_conversation(conn, pending.conversation_id)  # the conversation is gone: say so
        raise LedgerStateError(
            f"conversation {pending.conversation_id!r} has no pending turn {pending.id} (it was "
            "deleted with its conversation)"
        )
    if stored.state != "pending" and not resolved_ok:
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} is already "
            f"{stored.state}" + (f" ({stored.reason})" if stored.reason else "") + ": nothing to "
            "record"
        )
    if stored.state == "pending" and stored.owner != pending.owner:
        raise PendingTurnError(
            stored.conversation_id,
            stored.id,
            stored.at_seq,
            f"pending turn {stored.id} was claimed by another process since this handle was "
            "taken: it resumes the turn; read store.pending() again before acting",
        )
    return stored


def _renewed(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, lease: float
) -> PendingTurn:
    """The stored state of ``pending`` with its owner's lease renewed (see :func:`_owned`,
    which raises unless it is still pending and ``pending``'s owner owns it): one UPDATE that
    renews the lease of a turn still pending and owned and reads its row back, then its
    executions."""
    if isinstance(pending, PendingTurn):
        keys = {"c": pending.conversation_id, "p": pending.id}
        row = conn.execute(
            _statement("renew", core.postgres),
            {**keys, "holder": pending.owner, **_lease_params(core, lease)},
        ).first()
        if row is not None:
            executions = conn.execute(_statement("executions"), keys).all()
            return _built(pending.conversation_id, row._mapping, executions)
    # not pending or not ours: _owned raises and says which (should it find the turn owned
    # after all, the lease is renewed the long way)
    stored = _owned(core, conn, pending, conversation_lock=False)
    _set_lease(core, conn, stored, stored.owner, lease)
    found = _load(conn, stored.conversation_id, stored.id)
    assert found is not None
    return found


def claim_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, lease: float = DEFAULT_LEASE
) -> PendingTurn:
    """Make the caller the owner of ``pending`` (with ``pending.claim_token``) if nobody
    claimed it since it was read and its owner's lease has run out; a claim retried with the
    same handle returns the turn it claimed."""
    if not isinstance(pending, PendingTurn):
        raise TypeError(f"claim() takes a PendingTurn, not {type(pending).__name__}")
    require_conversation(conn, pending.conversation_id, lock=core.postgres)
    stored = _load(conn, pending.conversation_id, pending.id, lock=core.postgres)
    if stored is not None and stored.state == "pending" and stored.owner == pending.claim_token:
        # this very claim, retried (its COMMIT's answer was lost): it is ours
        _set_lease(core, conn, stored, stored.owner, lease)
    else:
        if stored is not None and stored.state == "pending":
            _live_owner(core, conn, stored)  # its owner is alive: it keeps its turn
        _owned(core, conn, pending)  # raises: resolved, gone, or claimed by another since
        _set_lease(core, conn, pending, pending.claim_token, lease)
    found = _load(conn, pending.conversation_id, pending.id)
    assert found is not None
    return found


def renew_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, lease: float = DEFAULT_LEASE
) -> datetime:
    """Move the owner's lease on to now + ``lease``; the new end of the lease."""
    if isinstance(pending, PendingTurn):
        row = conn.execute(
            _statement("renew", core.postgres),
            {
                "c": pending.conversation_id,
                "p": pending.id,
                "holder": pending.owner,
                **_lease_params(core, lease),
            },
        ).first()
        if row is not None:
            found = _utc(row._mapping["lease_expires_at"])
            assert found is not None
            return found
    _owned(core, conn, pending, conversation_lock=False)  # raises: not pending, or not ours
    raise AssertionError("unreachable")  # pragma: no cover


def release_body(core: StoreCoreLike, conn: Connection, pending: PendingTurn) -> PendingTurn:
    """End the owner's lease now (it stays the owner until someone claims the turn)."""
    stored = _owned(core, conn, pending, conversation_lock=False)
    p = PendingTurnRow
    conn.execute(
        sa.update(p)
        .where(p.conversation_id == stored.conversation_id, p.id == stored.id)
        .values(lease_expires_at=_lease_until(core, 0.0))
    )
    found = _load(conn, stored.conversation_id, stored.id)
    assert found is not None
    return found


def _where(pending: PendingTurn, position: int) -> sa.ColumnElement[bool]:
    e = ToolExecution
    return sa.and_(
        e.conversation_id == pending.conversation_id,
        e.pending_id == pending.id,
        e.position == position,
    )


def _with(
    stored: PendingTurn, position: int, row: Any, lease: datetime | None = None
) -> PendingTurn:
    """``stored`` with call ``position``'s execution read from ``row`` (an UPDATE's
    RETURNING), and its lease when given: no second read of the turn."""
    executions = list(stored.executions)
    executions[position] = _execution(row._mapping)
    return replace(
        stored,
        executions=tuple(executions),
        lease_expires_at=lease if lease is not None else stored.lease_expires_at,
    )


def _start(
    core: StoreCoreLike, conn: Connection, stored: PendingTurn, position: int, lease: float | None
) -> PendingTurn:
    """Mark call ``position`` started by ``stored``'s owner (a no-op if it already is) and
    renew the lease (``None``: ``stored``'s lease was just renewed by this transaction)."""
    ex = stored.executions[position]
    if ex.finished:
        raise LedgerStateError(
            f"call {position} ({ex.call.name}) of pending turn {stored.id} already {ex.state}: "
            "it is not started again; its recorded outcome is reused"
        )
    keys = {"c": stored.conversation_id, "p": stored.id}
    if lease is None:
        until = stored.lease_expires_at
    else:
        until = _utc(
            conn.execute(
                _statement("lease", core.postgres), {**keys, **_lease_params(core, lease)}
            ).scalar()
        )
    if ex.state == "started" and ex.started_by == stored.owner:
        return replace(stored, lease_expires_at=until)  # a retry after a lost acknowledgement
    row = conn.execute(_statement("start"), {**keys, "pos": position, "owner": stored.owner}).one()
    return _with(stored, position, row, until)


def _finish(conn: Connection, stored: PendingTurn, recording: Recording) -> PendingTurn:
    """Record an outcome on ``stored`` (a no-op if the same one is recorded)."""
    position, outcome, text, parts = recording
    ex = stored.executions[position]
    given: str | list[Any] | None = parts if parts is not None else text
    if ex.finished:
        recorded = ex.result if ex.state == "succeeded" else ex.error
        if ex.state == outcome and recorded == given:
            return stored  # a retry after a lost acknowledgement
        raise LedgerStateError(
            f"call {position} ({ex.call.name}) of pending turn {stored.id} already {ex.state} "
            f"with another {'result' if ex.state == 'succeeded' else 'error'}: an outcome is "
            "recorded once; abandon the turn to start over"
        )
    if ex.state != "started":
        raise LedgerStateError(
            f"call {position} ({ex.call.name}) of pending turn {stored.id} was never started: "
            "record started() before the tool runs"
        )
    succeeded = outcome == "succeeded"
    row = conn.execute(
        _statement("finish"),
        {
            "c": stored.conversation_id,
            "p": stored.id,
            "pos": position,
            "state": outcome,
            "result": text if succeeded else None,
            "parts": parts if succeeded else None,
            "error": None if succeeded else text,
        },
    ).one()
    return _with(stored, position, row)


def started_body(
    core: StoreCoreLike,
    conn: Connection,
    pending: PendingTurn,
    position: int,
    lease: float = DEFAULT_LEASE,
    recording: Recording | None = None,
) -> PendingTurn:
    """Record that the owner starts call ``position`` (a no-op if this owner already did), and
    renew its lease: the tool starts with a whole lease ahead. ``recording``: an outcome to
    record first, in the same transaction (the previous tool's)."""
    stored = _renewed(core, conn, pending, lease)
    if recording is not None:
        stored = _finish(conn, stored, recording)
    return _start(core, conn, stored, position, None)


def finished_body(
    core: StoreCoreLike,
    conn: Connection,
    pending: PendingTurn,
    position: int,
    outcome: Literal["succeeded", "failed"],
    text: str | None,
    parts: list[Any] | None,
) -> PendingTurn:
    """Record call ``position``'s outcome (a no-op if the same one is recorded)."""
    stored = _owned(core, conn, pending, conversation_lock=False)
    return _finish(conn, stored, (position, outcome, text, parts))


def commit_recording_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, recording: Recording
) -> tuple[CommittedTurn | None, BaseException | None]:
    """Record ``recording`` (the last tool's outcome), then commit the turn in a savepoint of
    the same transaction: the committed turn, or the commit's error with the outcome still
    recorded (the caller commits the transaction, then raises it)."""
    stored = _owned(core, conn, pending, resolved_ok=True)
    if stored.state == "pending" and stored.owner == pending.owner:
        stored = _finish(conn, stored, recording)
    try:
        with conn.begin_nested():
            return _commit_stored(core, conn, pending, stored), None
    except (StoreError, sa.exc.IntegrityError, sa.exc.DataError) as exc:
        return None, exc


def commit_body(core: StoreCoreLike, conn: Connection, pending: PendingTurn) -> CommittedTurn:
    """Move the pending turn and its outcomes into history (or return the stored turn)."""
    return _commit_stored(core, conn, pending, _owned(core, conn, pending, resolved_ok=True))


def _commit_stored(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, stored: PendingTurn
) -> CommittedTurn:
    if stored.state == "committed":
        assert stored.committed_seq is not None
        return CommittedTurn(
            stored.conversation_id,
            stored.committed_seq,
            cast(
                "list[Any]",
                read_history(
                    conn,
                    stored.conversation_id,
                    turn_at=stored.committed_seq,
                    include_reasoning=False,
                ),
            ),
            False,
        )
    if stored.state == "abandoned":
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} was abandoned "
            f"({stored.reason}): it cannot be committed; ask the model again"
        )
    if stored.owner != pending.owner:
        _owned(core, conn, pending)  # raises PendingTurnError
    unfinished = [e for e in stored.executions if not e.finished]
    if unfinished:
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} cannot be "
            "committed: "
            + ", ".join(f"call {e.call.position} ({e.call.name}) is {e.state}" for e in unfinished)
            + "; record each call's outcome first"
        )
    contents = [
        plan_result(e.call, {"content": e.content} if isinstance(e.content, list) else e.content)
        for e in stored.executions
    ]
    plan = plans.TurnPlan(
        cast(Turn, stored),
        cast("list[ToolCall]", stored.calls),
        contents,
        stored.to_message(),
        stored.format or "chat",
        stored.provider_items,
    )
    done = core.commit_turn(
        conn,
        stored.conversation_id,
        plan,
        stored.at_seq,
        stored.idempotency_key,
        ledger=True,
    )
    conn.execute(
        _statement("resolve"), {"c": stored.conversation_id, "p": stored.id, "seq": done.seq}
    )
    return done


def abandon_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, reason: str
) -> PendingTurn:
    """Keep the pending turn for audit only (a no-op if it was abandoned for ``reason``)."""
    stored = _owned(core, conn, pending, resolved_ok=True)
    if stored.state == "abandoned" and stored.reason == reason:
        return stored
    if stored.state != "pending":
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} is already "
            f"{stored.state}" + (f" ({stored.reason})" if stored.reason else "")
        )
    if stored.owner != pending.owner:
        _owned(core, conn, pending)  # raises PendingTurnError
    conn.execute(
        sa.update(PendingTurnRow)
        .where(
            PendingTurnRow.conversation_id == stored.conversation_id,
            PendingTurnRow.id == stored.id,
        )
        .values(state="abandoned", reason=reason, resolved_at=_now())
    )
    found = _load(conn, stored.conversation_id, stored.id)
    assert found is not None
    return found


# -- the stores' methods -------------------------------------------------------------------------
class _Heartbeats:
    """One daemon thread per store renews the leases of the turns registered with it (a
    thread per turn would cost more than the turn's transactions): each every third of its
    lease. The thread ends after a while with nothing to renew; the next turn starts it
    again. It holds the store weakly."""

    #: seconds the thread waits with nothing to renew before it ends
    LINGER = 30.0

    def __init__(self, renew: Any) -> None:
        self._renew = weakref.WeakMethod(renew)
        self._cond = threading.Condition()
        self._due: dict[int, tuple[PendingTurn, float, float]] = {}  # key: turn, every, next
        self._busy: set[int] = set()  # keys whose renewal is running
        self._thread: threading.Thread | None = None
        self._key = 0
        self._until = 0.0  # when the thread wakes up next (it is woken only to come sooner)

    def add(self, pending: PendingTurn, every: float) -> int:
        with self._cond:
            self._key += 1
            at = time.monotonic() + every
            self._due[self._key] = (pending, every, at)
            if self._thread is None or not self._thread.is_alive():  # (none yet; or forked)
                self._until = at
                self._thread = threading.Thread(
                    target=self._run, name="fsm-ledger-heartbeat", daemon=True
                )
                self._thread.start()
            elif at < self._until:
                self._cond.notify_all()
            return self._key

    def remove(self, key: int) -> None:
        """Stop renewing ``key``; returns once no renewal of it is running (a renewal that
        ended after the owner released its lease would take the lease back)."""
        with self._cond:
            self._due.pop(key, None)
            while key in self._busy:
                self._cond.wait()

    def _run(self) -> None:
        idle = time.monotonic()
        while True:
            with self._cond:
                now = time.monotonic()
                if not self._due:
                    if now - idle > self.LINGER:
                        self._thread = None
                        return
                    self._until = now + self.LINGER
                    self._cond.wait(self.LINGER)
                    continue
                due = [(k, p, e) for k, (p, e, at) in self._due.items() if at <= now]
                if not due:
                    self._until = min(at for _, _, at in self._due.values())
                    self._cond.wait(self._until - now)
                    continue
                for key, turn, every in due:
                    self._due[key] = (turn, every, now + every)
                    self._busy.add(key)
            renew = self._renew()
            for key, turn, _every in due:
                try:
                    if renew is not None:
                        renew(turn)
                except (PendingTurnError, LedgerStateError, ConversationNotFoundError):
                    with self._cond:
                        self._due.pop(key, None)  # taken over or resolved: nothing to keep
                except Exception:  # a brief fault: the next beat tries again
                    pass
                finally:
                    with self._cond:
                        self._busy.discard(key)
                        self._cond.notify_all()
            del renew
            idle = time.monotonic()


_HEARTBEATS_LOCK = threading.Lock()


#: how often a begin whose COMMIT's answer was lost is tried again (with its owner token).
_BEGIN_TRIES = 3
_BEGIN_PAUSE = 0.2


class LedgerMethods:
    """The ledger's methods of :class:`~fsm.store.ConversationStore` (see the module)."""

    _core: StoreCoreLike

    #: seconds an owner holds a pending turn without renewing it (``begin``, ``claim``,
    #: ``started``, ``renew`` and the heartbeat each give it this long, by the database's
    #: clock); set it on the store (``store.ledger_lease = 10``). A crashed owner's turn can be
    #: claimed this long after its last renewal; a tool that runs longer needs the heartbeat.
    ledger_lease: float = DEFAULT_LEASE

    #: :class:`Outcome`, the type of ``started``'s and ``commit``'s ``recording`` (here for
    #: callers that do not import the store's modules, such as the agent loop)
    ledger_outcome: ClassVar[type[Outcome]] = Outcome

    if TYPE_CHECKING:

        def _write(self) -> AbstractContextManager[Connection]: ...
        def _reader(self) -> AbstractContextManager[Connection]: ...

    def begin(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        *,
        idempotency_key: str | None = None,
        expected_seq: int | None = None,
        start: int | ToolCall | None = None,
    ) -> PendingTurn:
        """Store a complete ``turn`` as the conversation's pending turn, before its tools run.

        Returns the :class:`PendingTurn` (its calls ``not_started``; the caller owns it and
        holds its lease). ``start`` (a call's position): also record that this call starts, in
        the same transaction (one transaction less before the first tool runs). A begin whose
        COMMIT's answer was lost is retried here with the same owner token. The same turn
        begun again elsewhere raises :class:`~fsm.store.errors.TurnInProgressError` while its
        owner's lease holds, and takes it over once the lease ran out (as :meth:`claim`).
        Another pending turn raises :class:`~fsm.store.errors.PendingTurnError`; an incomplete
        turn :class:`~fsm.errors.IncompleteTurnError`; a stale ``expected_seq``
        :class:`~fsm.store.errors.ConflictError`.
        """
        single, calls = plan_begin(conversation_id, turn, idempotency_key)
        first = _start_position(calls, start)
        lease = _check_lease(self.ledger_lease)
        owner = secrets.token_hex(16)  # kept across tries: a retry recognises its own begin
        for tried in range(1, _BEGIN_TRIES + 1):
            try:
                with self._core.translate(), self._write() as conn:
                    return begin_body(
                        self._core,
                        conn,
                        conversation_id,
                        single,
                        calls,
                        idempotency_key,
                        expected_seq,
                        owner,
                        lease,
                        first,
                    )
            except CommitOutcomeUnknownError:
                if tried == _BEGIN_TRIES:
                    raise
                time.sleep(_BEGIN_PAUSE * tried)
        raise AssertionError("unreachable")  # pragma: no cover

    def pending(self, conversation_id: str) -> PendingTurn | None:
        """The conversation's pending turn with each call's recorded state and result, or
        ``None``: what a restarted process needs to resume (then :meth:`claim` it)."""
        plans.check_conversation_id(conversation_id)
        with self._core.translate(), self._reader() as conn:
            return pending_body(conn, conversation_id)

    def claim(self, pending: PendingTurn) -> PendingTurn:
        """Become the owner of ``pending`` (read by :meth:`pending`) to resume it, once its
        owner is gone. Raises :class:`~fsm.store.errors.TurnInProgressError` while the owner's
        lease holds (it is alive: retry after ``error.retry_after``),
        :class:`~fsm.store.errors.PendingTurnError` if another process claimed it since it was
        read, and :class:`~fsm.store.errors.LedgerStateError` if it was committed or abandoned.
        Retrying with the same ``pending`` (after a lost answer) returns the claimed turn."""
        lease = _check_lease(self.ledger_lease)
        with self._core.translate(), self._write() as conn:
            return claim_body(self._core, conn, pending, lease)

    def renew(self, pending: PendingTurn) -> datetime:
        """Renew the owner's lease on ``pending`` (``ledger_lease`` seconds from now, by the
        database's clock); the new end of the lease. Raises
        :class:`~fsm.store.errors.PendingTurnError` if another process took the turn over,
        :class:`~fsm.store.errors.LedgerStateError` if it was resolved."""
        lease = _check_lease(self.ledger_lease)
        with self._core.translate(), self._write() as conn:
            return renew_body(self._core, conn, pending, lease)

    def release(self, pending: PendingTurn) -> PendingTurn:
        """End the owner's lease on ``pending`` now, without resolving it: the next
        :meth:`claim` (this process's next run, or another's) takes it at once. For an owner
        that stops working on the turn while it stays pending (the agent loop does this when
        it raises after ``begin``/``claim``). Raises as :meth:`renew` does."""
        with self._core.translate(), self._write() as conn:
            return release_body(self._core, conn, pending)

    @contextmanager
    def heartbeat(self, pending: PendingTurn) -> Iterator[None]:
        """Keep ``pending`` while the body runs (its tools): the store's heartbeat thread
        renews the lease every third of ``ledger_lease``. A renewal that fails on a brief fault
        is tried at the next beat; renewing stops when the turn is taken over or resolved (the
        owner's next step then raises), and when the body ends (after a renewal in flight)."""
        lease = _check_lease(self.ledger_lease)
        with _HEARTBEATS_LOCK:
            beats = self.__dict__.get("_fsm_heartbeats")
            if beats is None:
                beats = self.__dict__["_fsm_heartbeats"] = _Heartbeats(self.renew)
        key = beats.add(pending, lease / 3)
        try:
            yield
        finally:
            beats.remove(key)

    def started(
        self,
        pending: PendingTurn,
        call: int | ToolCall | LedgerCall,
        *,
        recording: Outcome | None = None,
    ) -> PendingTurn:
        """Record that ``call`` (a position, or the call) starts, before its tool runs, and
        renew the owner's lease; the ledger's new state. A retry by the same owner changes
        nothing. ``recording``: the previous tool's :class:`Outcome`, recorded first in the
        same transaction (one transaction per call instead of two)."""
        position = _position(pending, call)
        lease = _check_lease(self.ledger_lease)
        outcome = None if recording is None else _recording(pending, recording)
        with self._core.translate(), self._write() as conn:
            return started_body(self._core, conn, pending, position, lease, outcome)

    def succeeded(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, result: Any
    ) -> PendingTurn:
        """Record ``call``'s result (a string, or a list of content parts, as ``commit_turn``
        takes it). The same result again changes nothing; another raises
        :class:`~fsm.store.errors.LedgerStateError`."""
        position = _position(pending, call)
        text, parts = plan_result(pending.executions[position].call, result)
        with self._core.translate(), self._write() as conn:
            return finished_body(self._core, conn, pending, position, "succeeded", text, parts)

    def failed(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, error: str
    ) -> PendingTurn:
        """Record that ``call``'s tool failed with ``error`` (its text is the result history
        gets, as the agent loop sends a tool's error back to the model)."""
        position = _position(pending, call)
        text = _check_error(error)
        with self._core.translate(), self._write() as conn:
            return finished_body(self._core, conn, pending, position, "failed", text, None)

    def commit(self, pending: PendingTurn, *, recording: Outcome | None = None) -> CommittedTurn:
        """Move the pending turn and every call's outcome into history in one transaction
        (``commit_turn``'s contract); a committed turn committed again returns the stored one
        (``created=False``). Every call must have an outcome first. ``recording``: the last
        tool's :class:`Outcome`, recorded in the same transaction; it stays recorded when the
        commit itself fails (that error is raised once the outcome is stored)."""
        if recording is None:
            with self._core.translate(), self._write() as conn:
                return commit_body(self._core, conn, pending)
        outcome = _recording(pending, recording)
        with self._core.translate():
            with self._write() as conn:
                done, failure = commit_recording_body(self._core, conn, pending, outcome)
            if failure is not None:
                raise failure
        assert done is not None
        return done

    def abandon(self, pending: PendingTurn, reason: str) -> PendingTurn:
        """Give up the pending turn: it stays in the ledger for audit (with ``reason``), and
        the conversation takes writes again."""
        why = _check_reason(reason)
        with self._core.translate(), self._write() as conn:
            return abandon_body(self._core, conn, pending, why)


class AsyncLedgerMethods:
    """The ledger's methods of :class:`~fsm.store.aio.AsyncConversationStore` (awaited)."""

    _core: StoreCoreLike

    #: :attr:`LedgerMethods.ledger_lease`.
    ledger_lease: float = DEFAULT_LEASE

    #: :attr:`LedgerMethods.ledger_outcome`.
    ledger_outcome: ClassVar[type[Outcome]] = Outcome

    if TYPE_CHECKING:

        async def open(self) -> Any: ...
        def _write(self) -> AbstractAsyncContextManager[AsyncConnection]: ...
        def _reader(self) -> AbstractAsyncContextManager[AsyncConnection]: ...

    async def begin(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        *,
        idempotency_key: str | None = None,
        expected_seq: int | None = None,
        start: int | ToolCall | None = None,
    ) -> PendingTurn:
        """:meth:`ConversationStore.begin <fsm.store.ConversationStore.begin>`, awaited."""
        single, calls = plan_begin(conversation_id, turn, idempotency_key)
        first = _start_position(calls, start)
        lease = _check_lease(self.ledger_lease)
        owner = secrets.token_hex(16)
        await self.open()
        for tried in range(1, _BEGIN_TRIES + 1):
            try:
                with self._core.translate():
                    async with self._write() as conn:
                        return await conn.run_sync(
                            lambda c: begin_body(
                                self._core,
                                c,
                                conversation_id,
                                single,
                                calls,
                                idempotency_key,
                                expected_seq,
                                owner,
                                lease,
                                first,
                            )
                        )
            except CommitOutcomeUnknownError:
                if tried == _BEGIN_TRIES:
                    raise
                await asyncio.sleep(_BEGIN_PAUSE * tried)
        raise AssertionError("unreachable")  # pragma: no cover

    async def pending(self, conversation_id: str) -> PendingTurn | None:
        """:meth:`ConversationStore.pending <fsm.store.ConversationStore.pending>`, awaited."""
        plans.check_conversation_id(conversation_id)
        await self.open()
        with self._core.translate():
            async with self._reader() as conn:
                return await conn.run_sync(pending_body, conversation_id)

    async def claim(self, pending: PendingTurn) -> PendingTurn:
        """:meth:`ConversationStore.claim <fsm.store.ConversationStore.claim>`, awaited."""
        lease = _check_lease(self.ledger_lease)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: claim_body(self._core, c, pending, lease))

    async def renew(self, pending: PendingTurn) -> datetime:
        """:meth:`ConversationStore.renew <fsm.store.ConversationStore.renew>`, awaited."""
        lease = _check_lease(self.ledger_lease)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: renew_body(self._core, c, pending, lease))

    async def release(self, pending: PendingTurn) -> PendingTurn:
        """:meth:`ConversationStore.release <fsm.store.ConversationStore.release>`, awaited."""
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: release_body(self._core, c, pending))

    @asynccontextmanager
    async def heartbeat(self, pending: PendingTurn) -> AsyncIterator[None]:
        """:meth:`ConversationStore.heartbeat <fsm.store.ConversationStore.heartbeat>`, as a
        task of the running event loop (``async with``). A tool that blocks the event loop
        (a plain function doing I/O) blocks the heartbeat too: make long tools ``async`` (or
        run them with ``asyncio.to_thread``), or raise ``ledger_lease`` above their run time."""
        lease = _check_lease(self.ledger_lease)

        async def beat() -> None:
            while True:
                await asyncio.sleep(lease / 3)
                try:
                    await self.renew(pending)
                except (PendingTurnError, LedgerStateError, ConversationNotFoundError):
                    return
                except Exception:  # a brief fault: the next beat tries again
                    continue

        task = asyncio.ensure_future(beat())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def started(
        self,
        pending: PendingTurn,
        call: int | ToolCall | LedgerCall,
        *,
        recording: Outcome | None = None,
    ) -> PendingTurn:
        """:meth:`ConversationStore.started <fsm.store.ConversationStore.started>`, awaited."""
        position = _position(pending, call)
        lease = _check_lease(self.ledger_lease)
        outcome = None if recording is None else _recording(pending, recording)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(
                    lambda c: started_body(self._core, c, pending, position, lease, outcome)
                )

    async def succeeded(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, result: Any
    ) -> PendingTurn:
        """:meth:`ConversationStore.succeeded <fsm.store.ConversationStore.succeeded>`,
        awaited."""
        position = _position(pending, call)
        text, parts = plan_result(pending.executions[position].call, result)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(
                    lambda c: finished_body(
                        self._core, c, pending, position, "succeeded", text, parts
                    )
                )

    async def failed(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, error: str
    ) -> PendingTurn:
        """:meth:`ConversationStore.failed <fsm.store.ConversationStore.failed>`, awaited."""
        position = _position(pending, call)
        text = _check_error(error)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(
                    lambda c: finished_body(self._core, c, pending, position, "failed", text, None)
                )

    async def commit(
        self, pending: PendingTurn, *, recording: Outcome | None = None
    ) -> CommittedTurn:
        """:meth:`ConversationStore.commit <fsm.store.ConversationStore.commit>`, awaited."""
        outcome = None if recording is None else _recording(pending, recording)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                if outcome is None:
                    return await conn.run_sync(lambda c: commit_body(self._core, c, pending))
                done, failure = await conn.run_sync(
                    lambda c: commit_recording_body(self._core, c, pending, outcome)
                )
            if failure is not None:
                raise failure
        assert done is not None
        return done

    async def abandon(self, pending: PendingTurn, reason: str) -> PendingTurn:
        """:meth:`ConversationStore.abandon <fsm.store.ConversationStore.abandon>`, awaited."""
        why = _check_reason(reason)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: abandon_body(self._core, c, pending, why))
