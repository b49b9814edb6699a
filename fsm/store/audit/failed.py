""":func:`failures` lists the failed turns of recorded attempts: each truncated or aborted call,
with reasons and anomalies, and each attempt that has no such call (a provider's error event
before any call, a text turn cut by ``length``, a stream cut or cancelled before any call, a turn
whose commit failed after its tools ran) as one row of its own; :func:`failure_counts` groups
both by model, state and reason.

Every recorded attempt therefore appears at least once (when no call filter is given): an attempt
is a turn that could not go to history, whether or not it had a call that broke.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.states import ToolCallState
from fsm.store.audit.filters import (
    Filters,
    row_key,
    time_filters,
)
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    FAILED_STATE_VALUES,
    PAGE_SIZE,
    Bind,
    Row,
    as_opt_text,
    as_text,
    connect,
    json_value,
    raw_column,
)
from fsm.store.codec import as_utc
from fsm.store.errors import InvalidFilterError


# -- failures ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class FailureRow(Row):
    """A truncated or aborted call of a recorded attempt, with why its turn failed, or an attempt
    that has no such call.

    ``seq`` is where the turn would have gone (the attempt's ``at_seq``); ``reason`` is the
    call's (``length``, ``eof``, ``content_filter``, ``invalid_json``, an error message, ...);
    ``end_how`` / ``end_reason`` say how the stream ended; ``anomalies`` are the kinds of the
    parser's anomalies recorded with the attempt; ``arguments`` is the (cut) text received.

    An attempt without a truncated or aborted call (no call at all, or finished calls only) is
    one row whose call fields (``position``, ``call_id``, ``name``, ``state``, ``arguments``)
    are ``None`` and whose ``reason`` is the attempt's (:func:`attempt_reason`).
    """

    attempt_id: int
    conversation_id: str
    seq: int
    position: int | None
    call_id: str | None
    name: str | None
    state: str | None
    reason: str | None
    model: str | None
    finish_reason: str | None
    end_how: str | None
    end_reason: str | None
    anomalies: list[str]
    created_at: datetime | None
    arguments: str | None

    @property
    def key(self) -> tuple[int, int]:
        """``(attempt_id, position)`` (position ``-1`` for a row of an attempt without a failed
        call): pass it as ``after=`` for the next page."""
        return (self.attempt_id, -1 if self.position is None else self.position)


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureCount(Row):
    """How many failed calls (and distinct attempts) share a model, a state and a reason.

    Attempts without a truncated or aborted call are counted with ``state`` ``None``, ``calls``
    0 and the attempt's reason (:func:`attempt_reason`)."""

    model: str | None
    state: str | None
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
    if f.state is not None and f.state not in FAILED_STATE_VALUES:
        raise InvalidFilterError(
            f"failed calls are {' or '.join(FAILED_STATE_VALUES)}, not {f.state!r} "
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
        conditions = [state_text.in_(FAILED_STATE_VALUES)]
    else:
        conditions = [c_.c.state.in_([ToolCallState(s) for s in FAILED_STATE_VALUES])]
    if f.conversation is not None:
        conditions.append(a.c.conversation_id == f.conversation)
    if f.model is not None:
        conditions.append(a.c.model == f.model)
    if f.name is not None:
        conditions.append(c_.c.name == f.name)
    if f.reason is not None:
        conditions.append(c_.c.reason == f.reason)
    conditions += time_filters(conn, a.c.created_at, f.since, f.until)
    return conditions


#: finish reasons of a turn that ended as it should (nothing to say about it).
_NORMAL_FINISH = frozenset({"stop", "tool_calls", "function_call"})


def attempt_reason(
    finish_reason: str | None, end_how: str | None, end_reason: str | None, error: str | None
) -> str | None:
    """Why an attempt failed, from what it recorded, in the words of a call's ``reason``: the
    error of a commit that failed after the tools ran; else how the stream ended when that was
    not ``done`` (its reason: a provider's error message, an abort reason; else ``eof``,
    ``aborted``, ...); else an unusual ``finish_reason`` (``length``, ``content_filter``);
    else ``None``."""
    if error:
        return error
    if end_how and end_how != "done":
        return end_reason or end_how
    if finish_reason and finish_reason not in _NORMAL_FINISH:
        return finish_reason
    return None


def _no_failed_call(conn: Connection, a: sa.FromClause) -> sa.ColumnElement[bool]:
    """The attempt ``a`` has no truncated or aborted call."""
    c_ = ATTEMPT_CALLS.alias("nf")
    if conn.dialect.name == "sqlite":  # by the primary key, not the state index
        state_ok = (sa.type_coerce(c_.c.state, sa.String) + "").in_(FAILED_STATE_VALUES)
        return ~sa.exists().where(c_.c.attempt_id == a.c.id, state_ok)
    state_ok = c_.c.state.in_([ToolCallState(s) for s in FAILED_STATE_VALUES])
    # OFFSET 0 keeps PostgreSQL from turning this into an anti join that reads every call of
    # every attempt: it stays a lookup by the primary key per attempt the other filters found
    probe = sa.select(sa.literal(1)).select_from(c_).where(c_.c.attempt_id == a.c.id, state_ok)
    return ~probe.offset(0).exists()


def _attempt_conditions(
    conn: Connection, a: sa.FromClause, f: Filters
) -> list[sa.ColumnElement[bool]]:
    conditions = [_no_failed_call(conn, a)]
    if f.conversation is not None:
        conditions.append(a.c.conversation_id == f.conversation)
    if f.model is not None:
        conditions.append(a.c.model == f.model)
    conditions += time_filters(conn, a.c.created_at, f.since, f.until)
    return conditions


def _calls_filtered(f: Filters) -> bool:
    """Whether a filter selects calls (tool, state, reason): then only failed calls match."""
    return f.name is not None or f.state is not None or f.reason is not None


def _anomaly_kinds(value: object) -> list[str]:
    anomalies = json_value(value)
    return [
        as_text(a.get("kind"))
        for a in (anomalies if isinstance(anomalies, list) else [])
        if isinstance(a, dict)
    ]


#: the calls of attempts and their attempts, as every query of this module reads them.
_AC = ATTEMPT_CALLS.alias("ac")
_AT = ATTEMPTS.alias("at")
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
    """The failed turns of recorded attempts, oldest attempt first: each truncated or aborted
    call, and each attempt without one as a row of its own (call fields ``None``; see
    :class:`FailureRow`).

    Filters as in :func:`tool_calls`, plus ``state`` (``truncated`` or ``aborted``) and
    ``reason`` (the call's). ``name``, ``state`` and ``reason`` select calls: with any of them,
    only failed calls are listed. Pages: ``limit`` / ``offset``, or ``after=row.key``.
    """
    if (limit is not None and limit < 0) or offset < 0:
        raise InvalidFilterError("limit and offset must not be negative")
    after = failure_key(after)
    filters = _failed_filters(
        conversation=conversation,
        model=model,
        name=name,
        state=state,
        reason=reason,
        since=since,
        until=until,
    )
    with connect(bind, snapshot=True) as conn:
        page = PAGE_SIZE if limit is None else min(PAGE_SIZE, limit + offset) or 1
        streams: list[Iterator[FailureRow | _Reached]] = [_failed_calls(conn, filters, page, after)]
        if not _calls_filtered(filters):
            streams.append(_failed_attempts(conn, filters, page, after))
        merged = heapq.merge(*streams, key=lambda row: row.key)
        rows = (row for row in merged if isinstance(row, FailureRow))
        stop = None if limit is None else offset + limit
        yield from itertools.islice(rows, offset, stop)


def failure_key(after: Any) -> tuple[int, int] | None:
    """``after`` checked as the :attr:`~FailureRow.key` of a row of :func:`failures` (two whole
    numbers; ``None`` passes): :class:`InvalidFilterError` for anything else (a forged or
    garbled cursor), before any I/O."""
    key = row_key(after, "ii", "fsm audit failures")
    return None if key is None else (key[0], key[1])


def _failed_calls(
    conn: Connection, filters: Filters, page: int, after: tuple[int, int] | None
) -> Iterator[FailureRow]:
    """The failed calls, in key order, read ``page`` rows at a time."""
    c_, a = _AC, _AT
    conditions = _failure_conditions(conn, c_, a, filters)
    raw = functools.partial(raw_column, conn)
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
    while True:
        bounded = [*conditions]
        if after is not None:
            bounded.append(sa.tuple_(c_.c.attempt_id, c_.c.position) > sa.tuple_(*after))
        rows = conn.execute(query.where(*bounded).limit(page)).all()
        for row in rows:
            yield FailureRow(
                attempt_id=row[0],
                conversation_id=as_text(row[1]),
                seq=row[2],
                position=row[3],
                call_id=as_text(row[4]),
                name=as_text(row[5]),
                state=as_text(row[6]),
                reason=as_opt_text(row[7]),
                model=as_opt_text(row[8]),
                finish_reason=as_opt_text(row[9]),
                end_how=as_opt_text(row[10]),
                end_reason=as_opt_text(row[11]),
                anomalies=_anomaly_kinds(row[12]),
                created_at=as_utc(row[13]),
                arguments=as_text(row[14]),
            )
        if len(rows) < page:
            return
        after = (rows[-1][0], rows[-1][3])


def _failed_attempts(
    conn: Connection, filters: Filters, page: int, after: tuple[int, int] | None
) -> Iterator[FailureRow | _Reached]:
    """The attempts without a failed call, in id order, read ``page`` rows at a time, with a
    :class:`_Reached` mark after each window of ids."""
    a = _AT
    conditions = _attempt_conditions(conn, a, filters)
    raw = functools.partial(raw_column, conn)
    query = (
        sa.select(
            a.c.id,
            raw(a.c.conversation_id),
            a.c.at_seq,
            raw(a.c.model),
            raw(a.c.finish_reason),
            raw(a.c.end_how),
            raw(a.c.end_reason),
            raw(a.c.error),
            raw(a.c.anomalies),
            raw(a.c.created_at),
        )
        .select_from(a)
        .order_by(a.c.id)
    )
    bounds = conn.execute(sa.select(sa.func.min(a.c.id), sa.func.max(a.c.id))).one()
    if bounds[0] is None:
        return
    # its own row (position -1) is at or before the cursor
    low = bounds[0] - 1 if after is None else max(after[0], bounds[0] - 1)
    window = _WINDOW
    while low < bounds[1]:
        # a window of ids at a time (growing), so that a page ends as soon as the failed calls
        # fill it even when no attempt lacks a failed call: no query reads all the attempts
        high = low + window
        yield from _attempt_rows(conn, query, conditions, low, high, page)
        yield _Reached(high)
        low, window = high, min(window * 2, _MAX_WINDOW)


class _Reached:
    """A mark in :func:`_failed_attempts`' stream: no more of its rows up to attempt ``id``
    (it sorts after every row of that attempt; :func:`failures` drops it)."""

    __slots__ = ("key",)

    def __init__(self, attempt_id: int) -> None:
        self.key = (attempt_id, _AFTER_ALL)


#: attempt ids read per window by :func:`_failed_attempts` (the first, the largest), and a
#: position after every call.
_WINDOW, _MAX_WINDOW = 1_000, 64_000
_AFTER_ALL = 2**62


def _attempt_rows(
    conn: Connection,
    query: sa.Select[Any],
    conditions: list[sa.ColumnElement[bool]],
    low: int,
    high: int,
    page: int,
) -> Iterator[FailureRow]:
    """The rows of :func:`_failed_attempts` with ``low < id <= high``, ``page`` at a time."""
    a = _AT
    while True:
        bounded = [*conditions, a.c.id > low, a.c.id <= high]
        rows = conn.execute(query.where(*bounded).limit(page)).all()
        for row in rows:
            finish, end_how, end_reason = (as_opt_text(v) for v in row[4:7])
            yield FailureRow(
                attempt_id=row[0],
                conversation_id=as_text(row[1]),
                seq=row[2],
                position=None,
                call_id=None,
                name=None,
                state=None,
                reason=attempt_reason(finish, end_how, end_reason, as_opt_text(row[7])),
                model=as_opt_text(row[3]),
                finish_reason=finish,
                end_how=end_how,
                end_reason=end_reason,
                anomalies=_anomaly_kinds(row[8]),
                created_at=as_utc(row[9]),
                arguments=None,
            )
        if len(rows) < page:
            return
        low = rows[-1][0]


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
    """Failed calls of attempts grouped by model, state and reason, the largest group first;
    then the attempts without a failed call (``calls`` 0, ``state`` ``None``), grouped by model
    and the attempt's reason (:func:`attempt_reason`), unless a call filter (``name``,
    ``state``, ``reason``) is given."""
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
    with connect(bind) as conn:
        conditions = _failure_conditions(conn, c_, a, filters)
        calls = sa.func.count()
        model_, state_, reason_ = (
            raw_column(conn, c) for c in (a.c.model, c_.c.state, c_.c.reason)
        )
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
        bare: dict[tuple[str | None, str | None], int] = {}
        if not _calls_filtered(filters):
            a = _AT
            columns = [raw_column(conn, c) for c in (a.c.model, a.c.finish_reason, a.c.end_how)]
            columns += [raw_column(conn, c) for c in (a.c.end_reason, a.c.error)]
            grouped = (
                sa.select(*columns, sa.func.count())
                .select_from(a)
                .where(*_attempt_conditions(conn, a, filters))
                .group_by(*columns)
            )
            for row in conn.execute(grouped).all():
                finish, how, why, error = (as_opt_text(v) for v in row[1:5])
                group = (as_opt_text(row[0]), attempt_reason(finish, how, why, error))
                bare[group] = bare.get(group, 0) + int(row[5])
    out = [
        FailureCount(
            model=as_opt_text(m),
            state=as_text(s),
            reason=as_opt_text(r),
            calls=int(n),
            attempts=int(k),
        )
        for m, s, r, n, k in rows
    ]
    out += [
        FailureCount(model=m, state=None, reason=r, calls=0, attempts=n)
        for (m, r), n in bare.items()
    ]
    out.sort(key=lambda c: (-c.calls, -c.attempts, c.model or "", c.state or "", c.reason or ""))
    return out
