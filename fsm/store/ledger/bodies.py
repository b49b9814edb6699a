"""The tool ledger's transaction bodies (:mod:`fsm.store.ledger`): begin, pending, claim, renew, release, started, finished, commit, abandon; one transaction each, run by the facades."""

import secrets
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.parser import Turn
from fsm.states import EXECUTION_OUTCOMES, execution_next, ledger_turn_next
from fsm.store import plans
from fsm.store.errors import (
    ConversationNotFoundError,
    IdempotencyMismatchError,
    LedgerStateError,
    PendingTurnError,
    StoreError,
)
from fsm.store.history import (
    CommittedTurn,
    StoreCoreLike,
    WriteState,
    check_expected,
    read_history,
    require_conversation,
)
from fsm.store.ledger.rows import begin_reading, begin_rows, insert_pending
from fsm.store.ledger.statements import (
    built_turn,
    db_now,
    execution_of,
    lease_params,
    lease_until,
    live_owner,
    load,
    set_lease,
    step_statement,
    utc,
)
from fsm.store.ledger.types import DEFAULT_LEASE, PendingTurn, Recording, plan_result
from fsm.store.models import PendingTurnRow, ToolExecution
from fsm.toolcall import ToolCall

if TYPE_CHECKING:
    pass


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
    turn_row, call_rows = begin_rows(conversation_id, turn, calls, idempotency_key, owner, start)
    # one query says whether this is the common case (a new turn: no pending turn, no earlier
    # commit of it); the others read what they need after it
    same, params = begin_reading(conversation_id, turn, idempotency_key)
    if core.postgres:  # the conversation's row lock first: its writers queue here
        require_conversation(conn, conversation_id, lock=True)
        # the reading and, in the common case, the insert: one statement
        begun, row = insert_pending(
            conn, turn_row, call_rows, start, lease, same, {**params, "expected": expected_seq}
        )
        if begun is not None:
            return begun
    else:
        row = tuple(conn.execute(step_statement("begin_" + same), params).one())
        if row[0] is None:
            raise ConversationNotFoundError(conversation_id)
        row = row[1:]
    pending_id, done_id, last_seq, slots_left = row
    existing = None if pending_id is None else load(conn, conversation_id, None, lock=core.postgres)
    if existing is not None:
        if _same_turn(existing, turn, idempotency_key):
            if existing.owner != owner:  # not this begin retried: another request's turn
                live_owner(core, conn, existing)
                set_lease(core, conn, existing, owner, lease)
            found = load(conn, conversation_id, existing.id)
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
        found = load(conn, conversation_id, int(done_id))
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
    turn_row["at_seq"] = seq
    if core.postgres:
        begun, _ = insert_pending(conn, turn_row, call_rows, start, lease)
        assert begun is not None
        return begun
    inserted = conn.execute(
        step_statement("insert_turn"), {**lease_params(core, lease), **turn_row}
    ).one()
    keys = {"conversation_id": conversation_id, "pending_id": inserted._mapping["id"]}
    executions: Sequence[Any] = []
    if call_rows:
        executions = conn.execute(
            step_statement("insert_executions"),
            [
                {
                    **keys,
                    **call,
                    "pending_n_calls": len(calls),
                    "started": call["position"] == start,
                }
                for call in call_rows
            ],
        ).all()
    return built_turn(conversation_id, inserted._mapping, executions)


def begin_at_once(
    conn: Connection,
    conversation_id: str,
    turn: Turn,
    calls: Sequence[ToolCall],
    idempotency_key: str | None,
    expected_seq: int | None,
    owner: str,
    lease: float,
    start: int | None,
) -> PendingTurn | None:
    """PostgreSQL, on a connection whose transaction is one statement
    (:data:`fsm.store.engine_config.AT_ONCE`): :func:`begin_body`'s common case (a new turn)
    in one round trip, the conversation's lock and then the reading with the insert, committed
    by the server as it ends: the :class:`PendingTurn`, or ``None`` when it wrote nothing (the
    caller runs :func:`begin_body`, which decides)."""
    turn_row, call_rows = begin_rows(conversation_id, turn, calls, idempotency_key, owner, start)
    same, params = begin_reading(conversation_id, turn, idempotency_key)
    begun, _ = insert_pending(
        conn,
        turn_row,
        call_rows,
        start,
        lease,
        same,
        {**params, "expected": expected_seq},
        at_once=True,
    )
    return begun


def pending_body(conn: Connection, conversation_id: str) -> PendingTurn | None:
    """The conversation's pending turn, or ``None``."""
    found = load(conn, conversation_id, None)
    if found is None:
        require_conversation(conn, conversation_id)
    return found


def _owned(
    core: StoreCoreLike,
    conn: Connection,
    pending: PendingTurn,
    step: str,
    *,
    conversation_lock: bool = True,
) -> PendingTurn:
    """The stored state of ``pending`` under the conversation's lock (``conversation_lock``;
    else under its own row's lock: a step that records a call changes nothing the
    conversation's other writers read); raises unless its state allows ``step`` (a trigger of
    :data:`~fsm.states.LEDGER_TURN_TRANSITIONS`) and ``pending``'s owner still owns it. A
    step that resolves the turn (``commit``, ``abandon``) finds it resolved without raising:
    its body tells a retry from a refusal."""
    if not isinstance(pending, PendingTurn):
        raise TypeError(
            f"a ledger step takes the PendingTurn of begin()/claim(), not {type(pending).__name__}"
        )
    if conversation_lock and core.postgres:  # SQLite: BEGIN IMMEDIATE took the database's
        require_conversation(conn, pending.conversation_id, lock=True)
    stored = load(conn, pending.conversation_id, pending.id, lock=core.postgres)
    if stored is None:
        require_conversation(conn, pending.conversation_id)  # the conversation is gone: say so
        raise LedgerStateError(
            f"conversation {pending.conversation_id!r} has no pending turn {pending.id} (it was "
            "deleted with its conversation)"
        )
    if ledger_turn_next(stored.state, step) is None and not _resolves(step):
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


def _resolves(step: str) -> bool:
    """Whether ``step`` takes a pending turn out of ``pending``."""
    return ledger_turn_next("pending", step) not in (None, "pending")


def _already(stored: PendingTurn, step: str) -> bool:
    """Whether ``stored`` is already where ``step`` leads (it resolved the turn): ``step``
    retried after its acknowledgement was lost."""
    return _resolves(step) and stored.state == ledger_turn_next("pending", step)


def _renew(core: StoreCoreLike, conn: Connection, pending: object, lease: float) -> Any:
    """The owner's lease renewed by one UPDATE, the turn's row read back; ``None`` when
    ``pending`` is not a :class:`PendingTurn` still pending and owned by its owner."""
    if not isinstance(pending, PendingTurn):
        return None
    return conn.execute(
        step_statement("renew", core.postgres),
        {
            "c": pending.conversation_id,
            "p": pending.id,
            "holder": pending.owner,
            **lease_params(core, lease),
        },
    ).first()


def _renewed(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, lease: float
) -> PendingTurn:
    """The stored state of ``pending`` with its owner's lease renewed (see :func:`_owned`,
    which raises unless it is still pending and ``pending``'s owner owns it): one UPDATE that
    renews the lease of a turn still pending and owned and reads its row back, then its
    executions."""
    row = _renew(core, conn, pending, lease)
    if row is not None:
        keys = {"c": pending.conversation_id, "p": pending.id}
        executions = conn.execute(step_statement("executions"), keys).all()
        return built_turn(pending.conversation_id, row._mapping, executions)
    # not pending or not ours: _owned raises and says which (should it find the turn owned
    # after all, the lease is renewed the long way)
    stored = _owned(core, conn, pending, "renew", conversation_lock=False)
    set_lease(core, conn, stored, stored.owner, lease)
    found = load(conn, stored.conversation_id, stored.id)
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
    stored = load(conn, pending.conversation_id, pending.id, lock=core.postgres)
    if stored is not None and stored.state == "pending" and stored.owner == pending.claim_token:
        # this very claim, retried (its COMMIT's answer was lost): it is ours
        set_lease(core, conn, stored, stored.owner, lease)
    else:
        if stored is not None and stored.state == "pending":
            live_owner(core, conn, stored)  # its owner is alive: it keeps its turn
        _owned(core, conn, pending, "claim")  # raises: resolved, gone, or claimed since
        set_lease(core, conn, pending, pending.claim_token, lease)
    found = load(conn, pending.conversation_id, pending.id)
    assert found is not None
    return found


def renew_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, lease: float = DEFAULT_LEASE
) -> datetime:
    """Move the owner's lease on to now + ``lease``; the new end of the lease."""
    row = _renew(core, conn, pending, lease)
    if row is not None:
        found = utc(row._mapping["lease_expires_at"])
        assert found is not None
        return found
    _owned(core, conn, pending, "renew", conversation_lock=False)  # raises: not pending/ours
    raise AssertionError("unreachable")  # pragma: no cover


def release_body(core: StoreCoreLike, conn: Connection, pending: PendingTurn) -> PendingTurn:
    """End the owner's lease now (it stays the owner until someone claims the turn)."""
    stored = _owned(core, conn, pending, "release", conversation_lock=False)
    p = PendingTurnRow
    conn.execute(
        sa.update(p)
        .where(p.conversation_id == stored.conversation_id, p.id == stored.id)
        .values(lease_expires_at=lease_until(core, 0.0))
    )
    found = load(conn, stored.conversation_id, stored.id)
    assert found is not None
    return found


def _where(pending: PendingTurn, position: int) -> sa.ColumnElement[bool]:
    e = ToolExecution
    return sa.and_(
        e.conversation_id == pending.conversation_id,
        e.pending_id == pending.id,
        e.position == position,
    )


def _with(stored: PendingTurn, rows: Sequence[Any], lease: datetime | None = None) -> PendingTurn:
    """``stored`` with the executions read from ``rows`` (an UPDATE's RETURNING: each row
    replaces the call at its position), and its lease when given: no second read of the
    turn, one new handle."""
    executions = list(stored.executions)
    for row in rows:
        found = execution_of(row._mapping)
        executions[found.call.position] = found
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
    if execution_next(ex.state, "start") is None:
        raise LedgerStateError(
            f"call {position} ({ex.call.name}) of pending turn {stored.id} already {ex.state}: "
            "it is not started again; its recorded outcome is reused"
        )
    keys = {"c": stored.conversation_id, "p": stored.id}
    if lease is None:
        until = stored.lease_expires_at
    else:
        until = utc(
            conn.execute(
                step_statement("lease", core.postgres), {**keys, **lease_params(core, lease)}
            ).scalar()
        )
    if ex.state == "started" and ex.started_by == stored.owner:
        return replace(stored, lease_expires_at=until)  # a retry after a lost acknowledgement
    row = conn.execute(
        step_statement("start"), {**keys, "pos": position, "owner": stored.owner}
    ).one()
    return _with(stored, [row], until)


def _finish(conn: Connection, stored: PendingTurn, recording: Recording) -> PendingTurn:
    """Record an outcome on ``stored`` (a no-op if the same one is recorded)."""
    position, outcome, text, parts = recording
    ex = stored.executions[position]
    given: str | list[Any] | None = parts if parts is not None else text
    if ex.state in EXECUTION_OUTCOMES:
        recorded = ex.result if ex.state == "succeeded" else ex.error
        if ex.state == outcome and recorded == given:
            return stored  # a retry after a lost acknowledgement
        raise LedgerStateError(
            f"call {position} ({ex.call.name}) of pending turn {stored.id} already {ex.state} "
            f"with another {'result' if ex.state == 'succeeded' else 'error'}: an outcome is "
            "recorded once; abandon the turn to start over"
        )
    state = execution_next(ex.state, "succeed" if outcome == "succeeded" else "fail")
    if state is None:
        raise LedgerStateError(
            f"call {position} ({ex.call.name}) of pending turn {stored.id} was never started: "
            "record started() before the tool runs"
        )
    row = conn.execute(step_statement("finish"), _finish_params(stored, recording)).one()
    return _with(stored, [row])


def _finish_params(stored: PendingTurn, recording: Recording) -> dict[str, Any]:
    """The binds of the ``finish`` statement that records ``recording`` on ``stored``."""
    position, outcome, text, parts = recording
    state = execution_next("started", "succeed" if outcome == "succeeded" else "fail")
    succeeded = state == "succeeded"
    return {
        "c": stored.conversation_id,
        "p": stored.id,
        "pos": position,
        "state": state,
        "result": text if succeeded else None,
        "parts": parts if succeeded else None,
        "error": None if succeeded else text,
    }


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
    done: PendingTurn | None = None
    if core.postgres and recording is not None and isinstance(pending, PendingTurn):
        # the lease renewed by the statement that records and starts (one round trip)
        done = _started_as_handled(core, conn, pending, position, recording, lease)
    else:
        row = _renew(core, conn, pending, lease)
        if row is not None:  # still pending and this owner's: the common case, read no more
            handled = _as_handled(pending, row)
            done = _started_as_handled(core, conn, handled, position, recording, None)
    if done is not None:
        return done
    stored = _renewed(core, conn, pending, lease)
    if recording is not None:
        stored = _finish(conn, stored, recording)
    return _start(core, conn, stored, position, None)


def _as_handled(pending: PendingTurn, row: Any) -> PendingTurn:
    """The turn as its row (just read under its lock, still pending and ``pending``'s owner's)
    says, with the executions of the handle ``pending``: this owner's own record of them. An
    outcome there is the stored one (an outcome is final); a state before an outcome may be
    older than the store's when the handle is (a step retried after its answer was lost), so
    the steps below change a call only from the state the handle shows, and give up (``None``)
    when the store holds another: the caller then reads the executions and decides as always."""
    return built_turn(pending.conversation_id, row._mapping, (), handled=pending.executions)


def _finished_as_handled(
    conn: Connection, stored: PendingTurn, recording: Recording, *, owned: bool = False
) -> PendingTurn | None:
    """``recording`` on a call the handle shows started, or ``None``; ``owned``: only if the
    turn is still pending and the handle's owner's, checked by the same statement."""
    position = recording[0]
    if stored.executions[position].state != "started":
        return None
    params = _finish_params(stored, recording)
    if owned:
        params["holder"] = stored.owner
    row = conn.execute(step_statement("finish_owned" if owned else "finish"), params).first()
    return None if row is None else _with(stored, [row])


def _started_as_handled(
    core: StoreCoreLike,
    conn: Connection,
    stored: PendingTurn,
    position: int,
    recording: Recording | None,
    lease: float | None,
) -> PendingTurn | None:
    """``recording``, then call ``position`` started, on the calls as the handle shows them
    (see :func:`_as_handled`), or ``None``. ``lease`` (PostgreSQL, with a ``recording``): the
    owner's lease renewed by the same statement, which changes nothing unless the turn is still
    pending and the handle's owner's (``stored`` is then the handle itself)."""
    if stored.executions[position].state != "not_started":
        return None
    keys = {"c": stored.conversation_id, "p": stored.id, "pos": position, "owner": stored.owner}
    if recording is None:
        row = conn.execute(step_statement("start_new"), keys).first()
        return None if row is None else _with(stored, [row])
    done = recording[0]
    if done == position or stored.executions[done].state != "started":
        return None
    # the outcome and the next start in one statement; should it change one call only (the
    # store holds another state than the handle for the other), the caller's full path reads
    # the store and finishes the step from there, in the same transaction
    finished = _finish_params(stored, recording)
    params = {
        **{f"f{key}": finished[key] for key in ("state", "result", "parts", "error")},
        "c": stored.conversation_id,
        "p": stored.id,
        "pos": position,
        "starter": stored.owner,
        "fpos": done,
    }
    if lease is not None:
        params |= {"holder": stored.owner, **lease_params(core, lease)}
    rows = conn.execute(step_statement("finish_start", lease is not None), params).all()
    if len(rows) != 2:
        return None
    renewed = None if lease is None else utc(rows[0]._mapping["renewed_lease"])
    return _with(stored, rows, renewed)


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
    stored = _owned(core, conn, pending, "record", conversation_lock=False)
    return _finish(conn, stored, (position, outcome, text, parts))


class CommitFailed(Exception):
    """The commit of :func:`commit_recording_body` failed (``cause``) after the outcome was
    recorded in the same transaction (``recorded``), which rolls back with it: the caller
    records the outcome alone, in a transaction of its own, then raises ``cause``."""

    def __init__(self, cause: BaseException, recorded: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.recorded = recorded


def commit_recording_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, recording: Recording
) -> CommittedTurn:
    """Record ``recording`` (the last tool's outcome), then commit the turn, in one
    transaction; a commit that fails raises :class:`CommitFailed` (no savepoint: the rare
    failure costs a second transaction, the common commit two statements less)."""
    found = _commit_as_handled(core, conn, pending, recording)
    if isinstance(found, CommittedTurn):
        return found
    if found is not None:
        stored, recorded = found, True
    else:
        stored = _owned(core, conn, pending, "commit")
        recorded = stored.state == "pending" and stored.owner == pending.owner
        if recorded:
            stored = _finish(conn, stored, recording)
    try:
        return _commit_stored(core, conn, pending, stored)
    except (StoreError, sa.exc.IntegrityError, sa.exc.DataError) as exc:
        raise CommitFailed(exc, recorded) from exc


def _commit_as_handled(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, recording: Recording
) -> PendingTurn | CommittedTurn | None:
    """The common case of :func:`commit_recording_body`: the turn still pending and
    ``pending``'s owner's, read by one query, ``recording`` recorded on the calls as the handle
    shows them (see :func:`_as_handled`), every call then with an outcome; ``None`` otherwise.
    On PostgreSQL the turn is then committed too, by the statement that records the outcome
    (the :class:`CommittedTurn`)."""
    if not isinstance(pending, PendingTurn):
        return None
    if core.postgres:
        # the turn's row with the conversation's lock, in one statement; no row: nothing
        # locked, the full path locks and says why
        keys = {"c": pending.conversation_id, "p": pending.id, "holder": pending.owner}
        row = conn.execute(step_statement("owned_locked", True), keys).first()
        if row is None:
            return None
        handled = _as_handled(pending, row)
        done = _commit_in_one(core, conn, handled, recording)
        if done is not None:
            return done
        found = _finished_as_handled(conn, handled, recording)
    else:
        # SQLite (BEGIN IMMEDIATE holds the database's lock): the outcome recorded only if the
        # turn is still pending and the handle's owner's, by the same statement; the turn's
        # other columns are the handle's (they never change after begin)
        found = _finished_as_handled(conn, pending, recording, owned=True)
    if found is None or any(e.state not in EXECUTION_OUTCOMES for e in found.executions):
        return None
    return found


def commit_at_once(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, recording: Recording
) -> CommittedTurn | None:
    """PostgreSQL, on a connection whose transaction is one statement
    (:data:`fsm.store.engine_config.AT_ONCE`): :func:`commit_recording_body`'s common case in
    one round trip: the lock of the conversation and of the turn, then ``recording`` and the
    turn written by :func:`_commit_in_one`'s statement, only if the turn is still pending and
    ``pending``'s owner's; ``None`` when it wrote nothing (the caller runs
    :func:`commit_recording_body`, which decides). A failure of that statement raises
    :class:`CommitFailed` with the outcome not recorded (the server rolled it back)."""
    if not isinstance(pending, PendingTurn):
        return None
    return _commit_in_one(core, conn, pending, recording, holder=pending.owner)


def _commit_in_one(
    core: StoreCoreLike,
    conn: Connection,
    handled: PendingTurn,
    recording: Recording,
    holder: str | None = None,
) -> CommittedTurn | None:
    """PostgreSQL: ``recording`` on a call the handle shows started, the pending turn
    resolved and the turn with every call's outcome written to history, by one statement; or
    ``None`` (nothing written) when the other calls' outcomes are not all in the handle or the
    store does not hold the call started: the caller goes on step by step. ``holder``: see
    :meth:`~fsm.store.history.StoreCoreLike.commit_ledger_turn`."""
    position, outcome, text, parts = recording
    if handled.executions[position].state != "started":
        return None
    finished = _finish_params(handled, recording)
    executions = list(handled.executions)
    executions[position] = replace(
        executions[position],
        state=finished["state"],
        result=parts if parts is not None else text if outcome == "succeeded" else None,
        error=finished["error"],
    )
    stored = replace(handled, executions=tuple(executions))
    if any(e.state not in EXECUTION_OUTCOMES for e in stored.executions):
        return None
    try:
        return core.commit_ledger_turn(
            conn,
            stored.conversation_id,
            _turn_plan(stored),
            stored.at_seq,
            stored.idempotency_key,
            {f"l_{key}": value for key, value in finished.items()},
            holder,
        )
    except (StoreError, sa.exc.IntegrityError, sa.exc.DataError) as exc:
        raise CommitFailed(exc, recorded=True) from exc


def _turn_plan(stored: PendingTurn) -> plans.TurnPlan:
    """The :class:`~fsm.store.plans.TurnPlan` of a pending turn whose calls all have an
    outcome: the turn as ``commit_turn`` writes it."""
    contents = [
        plan_result(e.call, {"content": e.content} if isinstance(e.content, list) else e.content)
        for e in stored.executions
    ]
    return plans.TurnPlan(
        cast(Turn, stored),
        cast("list[ToolCall]", stored.calls),
        contents,
        stored.to_message(),
        stored.format or "chat",
        stored.provider_items,
    )


def commit_body(core: StoreCoreLike, conn: Connection, pending: PendingTurn) -> CommittedTurn:
    """Move the pending turn and its outcomes into history (or return the stored turn)."""
    return _commit_stored(core, conn, pending, _owned(core, conn, pending, "commit"))


def _commit_stored(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, stored: PendingTurn
) -> CommittedTurn:
    if _already(stored, "commit"):
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
    if ledger_turn_next(stored.state, "commit") is None:
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} was "
            f"{stored.state} ({stored.reason}): it cannot be committed; ask the model again"
        )
    if stored.owner != pending.owner:
        _owned(core, conn, pending, "commit")  # raises PendingTurnError
    unfinished = [e for e in stored.executions if e.state not in EXECUTION_OUTCOMES]
    if unfinished:
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} cannot be "
            "committed: "
            + ", ".join(f"call {e.call.position} ({e.call.name}) is {e.state}" for e in unfinished)
            + "; record each call's outcome first"
        )
    done = core.commit_turn(
        conn,
        stored.conversation_id,
        _turn_plan(stored),
        stored.at_seq,
        stored.idempotency_key,
        ledger=True,
    )
    conn.execute(
        step_statement("resolve"), {"c": stored.conversation_id, "p": stored.id, "seq": done.seq}
    )
    return done


def abandon_body(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, reason: str
) -> PendingTurn:
    """Keep the pending turn for audit only (a no-op if it was abandoned for ``reason``)."""
    stored = _owned(core, conn, pending, "abandon")
    if _already(stored, "abandon") and stored.reason == reason:
        return stored
    if ledger_turn_next(stored.state, "abandon") is None:
        raise LedgerStateError(
            f"pending turn {stored.id} of conversation {stored.conversation_id!r} is already "
            f"{stored.state}" + (f" ({stored.reason})" if stored.reason else "")
        )
    if stored.owner != pending.owner:
        _owned(core, conn, pending, "abandon")  # raises PendingTurnError
    conn.execute(
        sa.update(PendingTurnRow)
        .where(
            PendingTurnRow.conversation_id == stored.conversation_id,
            PendingTurnRow.id == stored.id,
        )
        .values(state=ledger_turn_next("pending", "abandon"), reason=reason, resolved_at=db_now())
    )
    found = load(conn, stored.conversation_id, stored.id)
    assert found is not None
    return found
