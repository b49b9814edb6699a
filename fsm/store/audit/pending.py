"""The tool ledger in the audit: pending and abandoned (and committed) turns with their age and
what their calls' executions recorded (``fsm audit pending``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, cast

import sqlalchemy as sa

from fsm.states import LEDGER_TURN_STATES
from fsm.store.audit.read import Bind, Row, as_int, as_opt_text, as_text, connect, raw_column
from fsm.store.codec import as_utc
from fsm.store.errors import InvalidFilterError
from fsm.store.models import PendingTurnRow, ToolExecution

__all__ = ["LEDGER_STATES", "PendingRow", "pending_turns"]

#: the states of a ledger turn (:data:`fsm.states.LEDGER_TURN_STATES`).
LEDGER_STATES: Final = LEDGER_TURN_STATES

_TURNS = cast(sa.Table, PendingTurnRow.__table__)
_EXECUTIONS = cast(sa.Table, ToolExecution.__table__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingRow(Row):
    """A turn of the tool ledger: its state, when it was begun and resolved, its age in seconds
    (now less ``created_at``), the abandon reason, the seq it goes to (``at_seq``) or went to
    (``committed_seq``), its model, and its calls' executions: how many are in each state
    and the total number of starts (more starts than calls: a call ran again after a crash).

    ``lease_expires_at`` is when its owner's lease ends (the database's clock; renewed by the
    owner's heartbeat while its tools run) and ``owner``, for a pending turn, whether that owner
    is ``alive`` (the lease holds: its tools may be running, nobody takes the turn over) or
    ``gone`` (the lease ran out, or the turn predates leases: the next run resumes it);
    ``None`` for a resolved turn."""

    conversation_id: str
    pending_id: int
    state: str
    created_at: datetime | None
    resolved_at: datetime | None
    age_seconds: float | None
    reason: str | None
    at_seq: int | None
    committed_seq: int | None
    model: str | None
    calls: int
    not_started: int
    started: int
    succeeded: int
    failed: int
    starts: int
    lease_expires_at: datetime | None = None
    owner: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        """``(conversation_id, pending_id)``."""
        return (self.conversation_id, self.pending_id)


def _lease_columns(conn: sa.Connection) -> list[sa.Label[Any]]:
    """The end of a turn's lease, and whether it holds by the database's clock (as the
    ledger's ``claim`` decides it); NULLs on a store older than migration 0008."""
    schema = (conn.get_execution_options().get("schema_translate_map") or {}).get(None)
    names = {c["name"] for c in sa.inspect(conn).get_columns(_TURNS.name, schema=schema)}
    if "lease_expires_at" not in names:
        return [sa.null().label("lease_expires_at"), sa.literal(0).label("lease_holds")]
    lease = _TURNS.c.lease_expires_at
    if conn.dialect.name == "postgresql":
        holds = sa.case((lease > sa.func.clock_timestamp(), 1), else_=0)
    else:
        holds = sa.case((sa.func.julianday(lease) > sa.func.julianday("now"), 1), else_=0)
    return [raw_column(conn, lease).label("lease_expires_at"), holds.label("lease_holds")]


def pending_turns(
    bind: Bind,
    *,
    states: Sequence[str] = ("pending", "abandoned"),
    conversation: str | None = None,
    now: datetime | None = None,
) -> list[PendingRow]:
    """The ledger's turns in ``states`` (default: pending and abandoned), oldest first, with
    their age at ``now`` (default: the current time) and their executions' counts."""
    bad = [s for s in states if s not in LEDGER_STATES]
    if bad or not states:
        raise InvalidFilterError(
            f"ledger states are {', '.join(LEDGER_STATES)}; got {', '.join(map(str, bad)) or 'none'}"
        )
    at = now or datetime.now(UTC)
    t, e = _TURNS.c, _EXECUTIONS.c
    with connect(bind, snapshot=True) as conn:

        def count(state: str | None) -> sa.ScalarSelect[Any]:
            query = sa.select(sa.func.count()).where(
                e.conversation_id == t.conversation_id, e.pending_id == t.id
            )
            if state is not None:
                query = query.where(e.state == state)
            return query.scalar_subquery()

        starts = (
            sa.select(sa.func.coalesce(sa.func.sum(e.starts), 0))
            .where(e.conversation_id == t.conversation_id, e.pending_id == t.id)
            .scalar_subquery()
        )
        query = (
            sa.select(
                raw_column(conn, t.conversation_id).label("conversation_id"),
                t.id,
                raw_column(conn, t.state).label("state"),
                raw_column(conn, t.created_at).label("created_at"),
                raw_column(conn, t.resolved_at).label("resolved_at"),
                raw_column(conn, t.reason).label("reason"),
                t.at_seq,
                t.committed_seq,
                raw_column(conn, t.model).label("model"),
                count(None),
                count("not_started"),
                count("started"),
                count("succeeded"),
                count("failed"),
                starts,
                *_lease_columns(conn),
            )
            .where(t.state.in_(list(states)))
            .order_by(t.created_at, t.conversation_id, t.id)
        )
        if conversation is not None:
            query = query.where(t.conversation_id == conversation)
        out = []
        for row in conn.execute(query):
            created = as_utc(row[3])
            out.append(
                PendingRow(
                    conversation_id=as_text(row[0]),
                    pending_id=int(row[1]),
                    state=as_text(row[2]),
                    created_at=created,
                    resolved_at=as_utc(row[4]),
                    age_seconds=None if created is None else (at - created).total_seconds(),
                    reason=as_opt_text(row[5]),
                    at_seq=as_int(row[6]),
                    committed_seq=as_int(row[7]),
                    model=as_opt_text(row[8]),
                    calls=int(row[9]),
                    not_started=int(row[10]),
                    started=int(row[11]),
                    succeeded=int(row[12]),
                    failed=int(row[13]),
                    starts=int(row[14]),
                    lease_expires_at=as_utc(row[15]),
                    owner=None
                    if as_text(row[2]) != "pending"
                    else ("alive" if row[16] else "gone"),
                )
            )
        return out
