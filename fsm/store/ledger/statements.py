"""The tool ledger's SQL (:mod:`fsm.store.ledger`): the lease by the database's clock, the steps' statements built once, and loading a pending turn."""

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.states import execution_next, ledger_turn_next
from fsm.store import writes
from fsm.store.errors import (
    TurnInProgressError,
)
from fsm.store.history import (
    StoreCoreLike,
)
from fsm.store.ledger.types import Execution, LedgerCall, PendingTurn
from fsm.store.models import Conversation, PendingTurnRow, ToolExecution

if TYPE_CHECKING:
    pass


# -- transaction bodies ------------------------------------------------------------------------
def db_now() -> sa.ColumnElement[Any]:
    return sa.func.current_timestamp()


def utc(value: Any) -> datetime | None:
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def lease_until(core: StoreCoreLike, lease: float) -> sa.ColumnElement[Any]:
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


def check_lease(value: object) -> float:
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


def live_owner(core: StoreCoreLike, conn: Connection, stored: PendingTurn) -> None:
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


def step_statement(name: str, postgres: bool = False) -> Any:
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
    # the turn, still pending and the holder's
    held = sa.and_(turn, t.state == "pending", t.owner == sa.bindparam("holder"))
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
    if name == "owned_locked":
        # PostgreSQL: the turn's row, if still pending and the holder's, with the
        # conversation's lock taken by the same statement (it locks the rows of both tables; a
        # turn changed while the lock was awaited is read again at its newest version, so a
        # claim made meanwhile is seen)
        return (
            sa.select(_TURNS_T)
            .join(Conversation, Conversation.id == t.conversation_id)
            .where(held)
            .with_for_update()
        )
    if name == "renew":  # the owner's lease renewed, the turn's row read back
        return (
            sa.update(_TURNS_T)
            .where(held)
            .values(lease_expires_at=_lease_bind(postgres))
            .returning(*_TURNS_T.c)
        )
    if name == "insert_turn":  # binds its columns and the lease
        return (
            sa.insert(_TURNS_T)
            .values(lease_expires_at=_lease_bind(postgres))
            .returning(*_TURNS_T.c)
        )
    if name == "insert_executions":  # bind ``started``: the call begun started (begin's start)
        return (
            sa.insert(_EXEC_T)
            .values(
                started_at=sa.case(
                    (sa.bindparam("started", type_=sa.Boolean()), db_now()), else_=sa.null()
                )
            )
            .returning(*_EXEC_T.c, sort_by_parameter_order=True)
        )
    if name == "resolve":
        return (
            sa.update(_TURNS_T)
            .where(turn)
            .values(
                state=ledger_turn_next("pending", "commit"),
                committed_seq=sa.bindparam("seq"),
                resolved_at=db_now(),
            )
        )
    if name in ("begin_key", "begin_response", "begin_none"):
        return writes.begin_state(None, exists=not postgres, same=name.removeprefix("begin_"))
    if name == "executions":
        return (
            sa.select(_EXEC_T)
            .where(e.conversation_id == sa.bindparam("c"), e.pending_id == sa.bindparam("p"))
            .order_by(e.position)
        )
    if name in ("start", "start_new"):  # start_new: only a call not started yet
        where = call if name == "start" else sa.and_(call, e.state == "not_started")
        return (
            sa.update(_EXEC_T)
            .where(where)
            .values(
                state=execution_next("not_started", "start"),
                starts=e.starts + 1,
                started_at=db_now(),
                started_by=sa.bindparam("owner", type_=e.started_by.type),
            )
            .returning(*_EXEC_T.c)
        )
    if name in ("finish", "finish_owned"):  # only a started call: an outcome is recorded once
        # finish_owned (SQLite): only if the turn is still pending and the holder's
        owned = [sa.exists().where(held)] if name == "finish_owned" else []
        return (
            sa.update(_EXEC_T)
            .where(call, e.state == "started", *owned)
            .values(
                state=sa.bindparam("state", type_=e.state.type),
                finished_at=db_now(),
                result=sa.bindparam("result", type_=e.result.type),
                result_parts=sa.bindparam("parts", type_=e.result_parts.type),
                error=sa.bindparam("error", type_=e.error.type),
            )
            .returning(*_EXEC_T.c)
        )
    if name == "finish_start":  # the call at ``fpos`` finished, the one at ``pos`` started
        done = e.position == sa.bindparam("fpos")
        which = [
            e.conversation_id == sa.bindparam("c"),
            e.pending_id == sa.bindparam("p"),
            sa.or_(
                sa.and_(done, e.state == "started"),
                sa.and_(e.position == sa.bindparam("pos"), e.state == "not_started"),
            ),
        ]
        returning: list[Any] = list(_EXEC_T.c)
        if postgres:
            # and the owner's lease renewed, in the same statement: the executions change
            # only if the renewal found the turn pending and the holder's
            renewed = (
                sa.update(_TURNS_T)
                .where(held)
                .values(lease_expires_at=_lease_bind(postgres))
                .returning(t.id, t.lease_expires_at)
                .cte("renewed")
            )
            which.append(e.pending_id == renewed.c.id)
            returning.append(renewed.c.lease_expires_at.label("renewed_lease"))
        return (
            sa.update(_EXEC_T)
            .where(*which)
            .values(
                state=sa.case(
                    (done, sa.bindparam("fstate", type_=e.state.type)),
                    else_=sa.literal(execution_next("not_started", "start"), e.state.type),
                ),
                finished_at=sa.case((done, db_now()), else_=e.finished_at),
                result=sa.case(
                    (done, sa.bindparam("fresult", type_=e.result.type)), else_=e.result
                ),
                result_parts=sa.case(
                    (done, sa.bindparam("fparts", type_=e.result_parts.type)),
                    else_=e.result_parts,
                ),
                error=sa.case((done, sa.bindparam("ferror", type_=e.error.type)), else_=e.error),
                starts=sa.case((done, e.starts), else_=e.starts + 1),
                started_at=sa.case((done, e.started_at), else_=db_now()),
                started_by=sa.case(
                    (done, e.started_by),
                    # not "owner": a key named as a column of the renewed turn would be taken
                    # for a value of its SET clause
                    else_=sa.bindparam("starter", type_=e.started_by.type),
                ),
            )
            .returning(*returning)
        )
    raise AssertionError(name)  # pragma: no cover


def _lease_bind(postgres: bool) -> Any:
    """Now + the bound lease (``lease`` seconds on PostgreSQL, SQLite's ``modifier``), by the
    database's clock (see :func:`lease_params`)."""
    if postgres:
        return sa.func.clock_timestamp() + sa.func.make_interval(
            0, 0, 0, 0, 0, 0, sa.bindparam("lease", type_=sa.Float())
        )
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", sa.bindparam("modifier"))


def lease_params(core: StoreCoreLike, lease: float) -> dict[str, Any]:
    if core.postgres:
        return {"lease": float(lease)}
    return {"modifier": f"+{lease:.3f} seconds"}


def set_lease(
    core: StoreCoreLike, conn: Connection, pending: PendingTurn, owner: str, lease: float
) -> None:
    p = PendingTurnRow
    conn.execute(
        sa.update(p)
        .where(p.conversation_id == pending.conversation_id, p.id == pending.id)
        .values(owner=owner, lease_expires_at=lease_until(core, lease))
    )


def load(
    conn: Connection, conversation_id: str, pending_id: int | None, *, lock: bool = False
) -> PendingTurn | None:
    """A pending turn by id (``None``: the conversation's pending one), with its executions."""
    if pending_id is None:
        row = conn.execute(
            step_statement("open_locked" if lock else "open"), {"c": conversation_id}
        ).first()
    else:
        statement = step_statement("turn_locked" if lock else "turn")
        row = conn.execute(statement, {"c": conversation_id, "p": pending_id}).first()
    if row is None:
        return None
    values = row._mapping
    executions = conn.execute(
        step_statement("executions"), {"c": conversation_id, "p": values["id"]}
    ).all()
    return built_turn(conversation_id, values, executions)


def built_turn(
    conversation_id: str,
    values: Any,
    executions: Sequence[Any],
    *,
    handled: tuple[Execution, ...] | None = None,
) -> PendingTurn:
    """A :class:`PendingTurn` from its row's mapping and its executions' rows (in order), or
    with the executions ``handled`` (a handle's own)."""
    return PendingTurn(
        conversation_id=conversation_id,
        id=int(values["id"]),
        state=values["state"],
        owner=values["owner"],
        at_seq=int(values["at_seq"]),
        created_at=utc(values["created_at"]),
        resolved_at=utc(values["resolved_at"]),
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
        executions=(
            handled if handled is not None else tuple(execution_of(x._mapping) for x in executions)
        ),
        format=values.get("format"),
        provider_items=values.get("provider_items"),
        lease_expires_at=utc(values.get("lease_expires_at")),
    )


def execution_of(x: Any) -> Execution:
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
        started_at=utc(x["started_at"]),
        finished_at=utc(x["finished_at"]),
        result=result,
        error=x["error"],
        started_by=x["started_by"],
    )
