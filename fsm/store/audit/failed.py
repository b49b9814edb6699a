""":func:`failures` lists the truncated and aborted calls of attempts with reasons and
anomalies; :func:`failure_counts` groups them by model, state and reason.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.states import ToolCallState
from fsm.store.audit.filters import (
    Filters,
    _time_filters,
)
from fsm.store.audit.read import (
    _ATTEMPT_CALLS,
    _ATTEMPTS,
    _FAILED_STATES,
    _PAGE,
    Bind,
    _as_utc,
    _connect,
    _json_value,
    _opt_text,
    _raw,
    _Row,
    _text,
)
from fsm.store.errors import InvalidFilterError


# -- failures ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class FailureRow(_Row):
    """A truncated or aborted call of a recorded attempt, with why its turn failed.

    ``seq`` is where the turn would have gone (the attempt's ``at_seq``); ``reason`` is the
    call's (``length``, ``eof``, ``content_filter``, ``invalid_json``, an error message, ...);
    ``end_how`` / ``end_reason`` say how the stream ended; ``anomalies`` are the kinds of the
    parser's anomalies recorded with the attempt; ``arguments`` is the (cut) text received.
    """

    attempt_id: int
    conversation_id: str
    seq: int
    position: int
    call_id: str
    name: str
    state: str
    reason: str | None
    model: str | None
    finish_reason: str | None
    end_how: str | None
    end_reason: str | None
    anomalies: list[str]
    created_at: datetime | None
    arguments: str

    @property
    def key(self) -> tuple[int, int]:
        """``(attempt_id, position)``: pass it as ``after=`` for the next page."""
        return (self.attempt_id, self.position)


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureCount(_Row):
    """How many failed calls (and distinct attempts) share a model, a state and a reason."""

    model: str | None
    state: str
    reason: str | None
    calls: int
    attempts: int


def _failed_filters(
    *,
    conversation: str | None,
    model: str | None,
    name: str | None,
    state: str | ToolCallState | None,
    reason: str | None,
    since: datetime | date | str | None,
    until: datetime | date | str | None,
) -> Filters:
    """The filters of :func:`failures` and :func:`failure_counts`: a state, if given, is a
    failed one."""
    f = Filters.of(
        conversation=conversation,
        model=model,
        name=name,
        state=state,
        reason=reason,
        since=since,
        until=until,
    )
    if f.state is not None and f.state not in _FAILED_STATES:
        raise InvalidFilterError(
            f"failed calls are {' or '.join(_FAILED_STATES)}, not {f.state!r} "
            "(list calls of any state with tool_calls())"
        )
    return f


def _failure_conditions(
    conn: Connection, c_: sa.FromClause, a: sa.FromClause, f: Filters
) -> list[sa.ColumnElement[bool]]:
    wanted = f.state
    conditions: list[sa.ColumnElement[bool]]
    if wanted:
        conditions = [c_.c.state == ToolCallState(wanted)]
    elif conn.dialect.name == "sqlite":
        # both failed states are most of the calls of attempts, which SQLite (no statistics)
        # cannot know: as an expression, not through the state index, so that it reads the
        # index of the other filters instead
        state_text = sa.type_coerce(c_.c.state, sa.String) + ""
        conditions = [state_text.in_(_FAILED_STATES)]
    else:
        conditions = [c_.c.state.in_([ToolCallState(s) for s in _FAILED_STATES])]
    if f.conversation is not None:
        conditions.append(a.c.conversation_id == f.conversation)
    if f.model is not None:
        conditions.append(a.c.model == f.model)
    if f.name is not None:
        conditions.append(c_.c.name == f.name)
    if f.reason is not None:
        conditions.append(c_.c.reason == f.reason)
    conditions += _time_filters(conn, a.c.created_at, f.since, f.until)
    return conditions


#: the calls of attempts and their attempts, as every query of this module reads them.
_AC = _ATTEMPT_CALLS.alias("ac")
_AT = _ATTEMPTS.alias("at")
_FAILED_FROM = _AC.join(_AT, _AT.c.id == _AC.c.attempt_id)


def failures(
    bind: Bind,
    *,
    conversation: str | None = None,
    model: str | None = None,
    name: str | None = None,
    state: str | ToolCallState | None = None,
    reason: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
    limit: int | None = 100,
    offset: int = 0,
    after: tuple[int, int] | None = None,
) -> Iterator[FailureRow]:
    """The truncated and aborted calls of recorded attempts, oldest attempt first.

    Filters as in :func:`tool_calls`, plus ``state`` (``truncated`` or ``aborted``) and
    ``reason`` (the call's). Pages: ``limit`` / ``offset``, or ``after=row.key``.
    """
    if (limit is not None and limit < 0) or offset < 0:
        raise InvalidFilterError("limit and offset must not be negative")
    filters = _failed_filters(
        conversation=conversation,
        model=model,
        name=name,
        state=state,
        reason=reason,
        since=since,
        until=until,
    )
    c_, a = _AC, _AT
    with _connect(bind, snapshot=True) as conn:
        conditions = _failure_conditions(conn, c_, a, filters)
        raw = functools.partial(_raw, conn)
        query = (
            sa.select(
                a.c.id,
                raw(a.c.conversation_id),
                a.c.at_seq,
                c_.c.position,
                raw(c_.c.call_id),
                raw(c_.c.name),
                raw(c_.c.state),
                raw(c_.c.reason),
                raw(a.c.model),
                raw(a.c.finish_reason),
                raw(a.c.end_how),
                raw(a.c.end_reason),
                raw(a.c.anomalies),
                raw(a.c.created_at),
                raw(c_.c.arguments),
            )
            .select_from(_FAILED_FROM)
            .order_by(c_.c.attempt_id, c_.c.position)
        )
        page = _PAGE if limit is None else limit
        skip = offset
        while page:
            bounded = [*conditions]
            if after is not None:
                bounded.append(sa.tuple_(c_.c.attempt_id, c_.c.position) > sa.tuple_(*after))
            rows = conn.execute(query.where(*bounded).limit(page).offset(skip)).all()
            for row in rows:
                anomalies = _json_value(row[12])
                yield FailureRow(
                    attempt_id=row[0],
                    conversation_id=_text(row[1]),
                    seq=row[2],
                    position=row[3],
                    call_id=_text(row[4]),
                    name=_text(row[5]),
                    state=_text(row[6]),
                    reason=_opt_text(row[7]),
                    model=_opt_text(row[8]),
                    finish_reason=_opt_text(row[9]),
                    end_how=_opt_text(row[10]),
                    end_reason=_opt_text(row[11]),
                    anomalies=[
                        _text(a.get("kind"))
                        for a in (anomalies if isinstance(anomalies, list) else [])
                        if isinstance(a, dict)
                    ],
                    created_at=_as_utc(row[13]),
                    arguments=_text(row[14]),
                )
            if limit is not None or len(rows) < page:
                return
            after, skip = (rows[-1][0], rows[-1][3]), 0


def failure_counts(
    bind: Bind,
    *,
    conversation: str | None = None,
    model: str | None = None,
    name: str | None = None,
    state: str | ToolCallState | None = None,
    reason: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
) -> list[FailureCount]:
    """Failed calls of attempts grouped by model, state and reason, the largest group first."""
    filters = _failed_filters(
        conversation=conversation,
        model=model,
        name=name,
        state=state,
        reason=reason,
        since=since,
        until=until,
    )
    c_, a = _AC, _AT
    with _connect(bind) as conn:
        conditions = _failure_conditions(conn, c_, a, filters)
        calls = sa.func.count()
        model_, state_, reason_ = (_raw(conn, c) for c in (a.c.model, c_.c.state, c_.c.reason))
        query = (
            sa.select(
                model_,
                state_,
                reason_,
                calls,
                sa.func.count(sa.distinct(c_.c.attempt_id)),
            )
            .select_from(_FAILED_FROM)
            .where(*conditions)
            .group_by(model_, state_, reason_)
        )
        rows = conn.execute(query).all()
    out = [
        FailureCount(
            model=_opt_text(m), state=_text(s), reason=_opt_text(r), calls=int(n), attempts=int(k)
        )
        for m, s, r, n, k in rows
    ]
    out.sort(key=lambda c: (-c.calls, c.model or "", c.state, c.reason or ""))
    return out
