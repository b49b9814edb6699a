""":func:`tool_calls`: calls of history (state ``finished``) and of recorded attempts (any
state), filtered by tool, state, conversation, model, time and argument content, a page at a
time, in key order (conversation, seq, then attempts before the committed turn at the same seq,
position). Pages continue with ``after=row.key`` (keyset) or ``offset``.

A call of history that went through the tool ledger (``begin`` ... ``commit``) shows its
execution: ``execution`` (its state), ``duration_ms`` and ``starts``, read from
``tool_executions`` through the committed ``pending_turns`` row that points at the call's
assistant message (``committed_seq``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta
from typing import Any, Final, Literal, TypeAlias, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.states import ToolCallState
from fsm.store.audit.filters import (
    ArgFilter,
    Filters,
    arg_condition,
    contains_text,
    parse_json_path,
    pg_function,
    row_key,
    search_condition,
    time_filters,
)
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    CALLS,
    MESSAGES,
    PAGE_SIZE,
    Bind,
    Row,
    as_int,
    as_opt_text,
    as_text,
    connect,
    json_value,
    raw_columns,
)
from fsm.store.codec import as_utc
from fsm.store.errors import InvalidFilterError
from fsm.store.models import PendingTurnRow, ToolExecution

_PENDING: Final = cast(sa.Table, PendingTurnRow.__table__)
_EXECUTIONS: Final = cast(sa.Table, ToolExecution.__table__)

#: where a listed call sits: (conversation id, seq, rank, attempt id, position); ``rank`` is 0 for
#: a call of an attempt (``seq`` is where the attempt would have gone, ``at_seq``) and 1 for a call
#: of history (``seq`` is its assistant message's; ``attempt id`` is 0).
CallKey: TypeAlias = tuple[str, int, int, int, int]
Source: TypeAlias = Literal["all", "history", "attempts"]


# -- tool calls --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class CallRow(Row):
    """One tool call, from history (``attempt_id is None``) or from a recorded attempt.

    ``seq`` is the assistant message's seq for a call of history, and for a call of an attempt
    the seq its turn would have had (``at_seq``). ``result`` is the content of the call's tool
    message (a string, or a list of content parts), ``None`` for attempts. ``reason`` says why a
    call of an attempt is truncated or aborted.

    ``execution`` is the state of the call's execution in the tool ledger (``not_started``,
    ``started``, ``succeeded``, ``failed``), ``None`` when the call never went through the
    ledger (``commit_turn``, an attempt); ``duration_ms`` is ``finished_at - started_at`` of its
    latest start in milliseconds (``None`` without both), ``starts`` how many times it was
    started (``None`` without a ledger execution).
    """

    conversation_id: str
    seq: int
    position: int
    call_id: str
    name: str
    arguments: str
    state: str
    model: str | None
    #: the API of the stream the call came from: ``chat``, ``responses`` or ``anthropic``
    #: (rows written before migration 0007 are ``chat``; an attempt of unknown format ``None``)
    format: str | None
    created_at: datetime | None
    result: str | list[Any] | None
    attempt_id: int | None
    reason: str | None
    execution: str | None = None
    duration_ms: float | None = None
    starts: int | None = None

    @property
    def key(self) -> CallKey:
        """Where the row sits in the listing: pass it as ``after=`` for the next page."""
        if self.attempt_id is None:
            return (self.conversation_id, self.seq, 1, 0, self.position)
        return (self.conversation_id, self.seq, 0, self.attempt_id, self.position)


def tool_calls(
    bind: Bind,
    *,
    name: str | None = None,
    state: str | ToolCallState | None = None,
    conversation: str | None = None,
    model: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
    args: Iterable[ArgFilter] = (),
    args_contains: str | None = None,
    format: str | None = None,
    search: str | None = None,
    source: Source = "all",
    limit: int | None = 100,
    offset: int = 0,
    after: CallKey | None = None,
) -> Iterator[CallRow]:
    """Tool calls matching every filter given, in key order (see :attr:`CallRow.key`).

    Filters: ``name`` (the tool), ``state`` (history holds only ``finished`` calls; the other
    states come from attempts), ``conversation``, ``model``, ``since`` <= created_at < ``until``
    (datetimes, dates or ISO strings; naive means UTC), ``args`` (each ``(json_path, value)``
    must hold, with the value compared as JSON: ``("city", "Paris")``, ``("n", 3)``,
    ``("dry_run", True)``; only finished calls match), ``args_contains`` (a substring of the raw
    arguments), ``format`` (the stream's API: ``chat``, ``responses`` or ``anthropic``; the
    calls of history written before it was recorded are ``chat``), ``search`` (a text found,
    case-insensitively and without wildcards, in the tool name, the call id, the conversation id
    or the raw arguments; a substring search reads every row the other filters leave: bound its
    time with the connection you pass). ``source`` picks history, attempts or both.

    ``limit`` rows at most (``None``: all of them, read a page at a time), after skipping
    ``offset`` rows, starting after the key ``after`` (keyset pagination: give the last row's
    :attr:`~CallRow.key` to get the next page; it stays right while rows are added).
    """
    filters = Filters.of(
        name=name,
        state=state,
        conversation=conversation,
        model=model,
        since=since,
        until=until,
        args=args,
        args_contains=args_contains,
        format=format,
        search=search,
    )
    if source not in ("all", "history", "attempts"):
        raise InvalidFilterError(f"source must be all, history or attempts, not {source!r}")
    if (limit is not None and limit < 0) or offset < 0:
        raise InvalidFilterError("limit and offset must not be negative")
    after = call_key(after)
    for path, value in filters.args:  # validate before touching the database
        parse_json_path(path)
        if value is not None and not isinstance(value, str | int | float | bool):
            raise InvalidFilterError(f"argument filter {path!r}: the value must be a scalar")
    history = source != "attempts" and filters.state in (None, ToolCallState.FINISHED.value)
    attempts = source != "history"
    with connect(bind, snapshot=True) as conn:
        if filters.args and conn.dialect.name == "postgresql":
            filters = replace(filters, try_jsonb=pg_function(conn, "fsm_try_jsonb(text)"))
        if limit is not None:
            yield from _call_page(conn, filters, history, attempts, limit, offset, after)
            return
        skip = offset
        while True:
            page = _call_page(conn, filters, history, attempts, PAGE_SIZE, skip, after)
            yield from page
            if len(page) < PAGE_SIZE:
                return
            after, skip = page[-1].key, 0


def call_key(after: Any) -> CallKey | None:
    """``after`` checked as the :attr:`~CallRow.key` of a row of :func:`tool_calls` (text, then
    four whole numbers, the third 0 or 1; ``None`` passes): :class:`InvalidFilterError` for
    anything else (a forged or garbled cursor), before any I/O."""
    key = row_key(after, "sibii", "fsm audit calls")
    if key is None:
        return None
    return (key[0], key[1], key[2], key[3], key[4])


_KEY_COLUMNS: Final = ("conversation_id", "seq", "rnk", "attempt_id", "position")


def _call_page(
    conn: Connection,
    f: Filters,
    history: bool,
    attempts: bool,
    limit: int,
    offset: int,
    after: CallKey | None,
) -> list[CallRow]:
    """One page: each source picks its first keys through an index (LIMIT inside), then joins
    the details of those rows only; the sources are merged in key order by the database."""
    if limit == 0 or not (history or attempts):
        return []
    arms: list[sa.Select[Any]] = []
    if history:
        keys = _history_keys(conn, f, after, limit + offset).subquery("hk")
        arms.append(_history_arm(conn, keys))
    if attempts:
        keys = _attempt_keys(conn, f, after, limit + offset).subquery("ak")
        arms.append(_attempt_arm(conn, keys))
    page = (arms[0] if len(arms) == 1 else sa.union_all(*arms)).subquery("page")
    query = sa.select(page).order_by(*(page.c[c] for c in _KEY_COLUMNS)).limit(limit).offset(offset)
    rows = []
    for (cid, seq, rank, attempt, position, call_id, name, arguments, state, model, created,
         content, parts, reason, execution, starts, started_at,
         finished_at, fmt) in conn.execute(query):  # fmt: skip
        rows.append(
            CallRow(
                conversation_id=as_text(cid),
                seq=seq,
                position=position,
                call_id=as_text(call_id),
                name=as_text(name),
                arguments=as_text(arguments),
                state=as_text(state),
                model=as_opt_text(model),
                created_at=as_utc(created),
                result=json_value(parts) if parts is not None else as_opt_text(content),
                attempt_id=attempt if rank == 0 else None,
                reason=as_opt_text(reason),
                execution=as_opt_text(execution),
                duration_ms=_duration_ms(started_at, finished_at),
                starts=as_int(starts),
                format=(as_opt_text(fmt) or "chat") if rank == 1 else as_opt_text(fmt),
            )
        )
    return rows


def _duration_ms(started_at: Any, finished_at: Any) -> float | None:
    """``finished_at - started_at`` in milliseconds (values read raw), ``None`` without both."""
    start, end = as_utc(started_at), as_utc(finished_at)
    if start is None or end is None:
        return None
    return (end - start) / timedelta(milliseconds=1)


def _history_arm(conn: Connection, keys: sa.Subquery) -> sa.Select[Any]:
    """The rows of history for ``keys``: the call, its assistant message, its result (every
    value read raw, see :func:`raw_column`), and its execution in the tool ledger when it went
    through one: the committed pending turn of its assistant message (found through
    ``ix_fsm_pending_turns_conversation_id_committed_seq``) and that turn's execution at the call's position
    (its key)."""
    t = CALLS.alias("tc")
    a = MESSAGES.alias("am")
    r = MESSAGES.alias("rm")
    p = _PENDING.alias("pt")
    e = _EXECUTIONS.alias("te")
    return sa.select(
        *(keys.c[c] for c in _KEY_COLUMNS),
        *raw_columns(conn, call_id=t.c.call_id, name=t.c.name, arguments=t.c.arguments),
        sa.literal(ToolCallState.FINISHED.value, sa.String).label("state"),
        *raw_columns(
            conn,
            model=a.c.model,
            created_at=a.c.created_at,
            content=r.c.content,
            content_parts=r.c.content_parts,
        ),
        sa.null().label("reason"),
        *raw_columns(
            conn,
            execution=e.c.state,
            starts=e.c.starts,
            started_at=e.c.started_at,
            finished_at=e.c.finished_at,
        ),
        *raw_columns(conn, format=a.c.format),
    ).select_from(
        keys.join(
            t,
            sa.and_(
                t.c.conversation_id == keys.c.conversation_id,
                t.c.assistant_seq == keys.c.seq,
                t.c.position == keys.c.position,
            ),
        )
        .join(a, sa.and_(a.c.conversation_id == keys.c.conversation_id, a.c.seq == keys.c.seq))
        .outerjoin(
            r,
            sa.and_(
                r.c.conversation_id == keys.c.conversation_id,
                r.c.seq == keys.c.seq + 1 + keys.c.position,
                r.c.role == "tool",
            ),
        )
        .outerjoin(
            p,
            sa.and_(
                p.c.conversation_id == keys.c.conversation_id,
                p.c.committed_seq == keys.c.seq,  # set only on a committed turn
            ),
        )
        .outerjoin(
            e,
            sa.and_(
                e.c.conversation_id == p.c.conversation_id,
                e.c.pending_id == p.c.id,
                e.c.position == keys.c.position,
            ),
        )
    )


def _attempt_arm(conn: Connection, keys: sa.Subquery) -> sa.Select[Any]:
    """The rows of attempts for ``keys``: the call and its attempt (read raw, see :func:`raw_column`)."""
    c_ = ATTEMPT_CALLS.alias("acd")
    a = ATTEMPTS.alias("atd")
    return sa.select(
        *(keys.c[c] for c in _KEY_COLUMNS),
        *raw_columns(
            conn,
            call_id=c_.c.call_id,
            name=c_.c.name,
            arguments=c_.c.arguments,
            state=c_.c.state,
            model=a.c.model,
            created_at=a.c.created_at,
        ),
        sa.null().label("content"),
        sa.null().label("content_parts"),
        *raw_columns(conn, reason=c_.c.reason),
        sa.null().label("execution"),
        sa.null().label("starts"),
        sa.null().label("started_at"),
        sa.null().label("finished_at"),
        *raw_columns(conn, format=a.c.format),
    ).select_from(
        keys.join(
            c_,
            sa.and_(c_.c.attempt_id == keys.c.attempt_id, c_.c.position == keys.c.position),
        ).join(a, a.c.id == keys.c.attempt_id)
    )


def _history_keys(
    conn: Connection, f: Filters, after: CallKey | None, limit: int
) -> sa.Select[Any]:
    t = CALLS.alias("t")
    a = MESSAGES.alias("m")
    conditions: list[sa.ColumnElement[bool]] = []
    source: sa.FromClause = t
    # the key columns: the call's, or its assistant message's (equal) when that message is read
    # first through an index of its own, so that the planner sees the page is in that order
    conversation, seq = t.c.conversation_id, t.c.assistant_seq
    if f.model is not None or f.since is not None or f.until is not None or f.format is not None:
        source = t.join(
            a, sa.and_(a.c.conversation_id == t.c.conversation_id, a.c.seq == t.c.assistant_seq)
        )
        conditions.append(a.c.role == "assistant")  # what the partial indexes cover
        if f.model is not None:
            conditions.append(a.c.model == f.model)
        if f.format == "chat":  # rows written before migration 0007 have no format
            conditions.append(sa.or_(a.c.format == "chat", a.c.format.is_(None)))
        elif f.format is not None:
            conditions.append(a.c.format == f.format)
        conditions += time_filters(conn, a.c.created_at, f.since, f.until)
        if f.name is None and f.conversation is None:
            conversation, seq = a.c.conversation_id, a.c.seq
    if f.name is not None:
        conditions.append(t.c.name == f.name)
    if f.conversation is not None:
        conditions.append(t.c.conversation_id == f.conversation)
    for path, value in f.args:
        conditions.append(
            arg_condition(conn, t.c.arguments, None, path, value, try_jsonb=f.try_jsonb)
        )
    if f.contains is not None:
        conditions.append(contains_text(conn, t.c.arguments, f.contains))
    if f.search is not None:
        conditions.append(
            search_condition(f.search, t.c.name, t.c.call_id, t.c.conversation_id, t.c.arguments)
        )
    if after is not None:
        c, s, rank, _attempt, p = after
        if rank == 1:
            conditions.append(sa.tuple_(conversation, seq, t.c.position) > sa.tuple_(c, s, p))
        else:  # the calls of history at seq s come after the attempts at s
            conditions.append(sa.tuple_(conversation, seq) >= sa.tuple_(c, s))
    return (
        sa.select(
            conversation.label("conversation_id"),
            seq.label("seq"),
            sa.literal(1).label("rnk"),
            sa.literal(0).label("attempt_id"),
            t.c.position,
        )
        .select_from(source)
        .where(*conditions)
        .order_by(conversation, seq, t.c.position)
        .limit(limit)
    )


def _attempt_keys(
    conn: Connection, f: Filters, after: CallKey | None, limit: int
) -> sa.Select[Any]:
    c_ = ATTEMPT_CALLS.alias("ac")
    a = ATTEMPTS.alias("at")
    conditions: list[sa.ColumnElement[bool]] = []
    if f.name is not None:
        conditions.append(c_.c.name == f.name)
    if f.state is not None:
        conditions.append(c_.c.state == ToolCallState(f.state))
    if f.conversation is not None:
        conditions.append(a.c.conversation_id == f.conversation)
    if f.model is not None:
        conditions.append(a.c.model == f.model)
    if f.format is not None:
        conditions.append(a.c.format == f.format)
    conditions += time_filters(conn, a.c.created_at, f.since, f.until)
    for path, value in f.args:
        conditions.append(
            arg_condition(conn, c_.c.arguments, c_.c.state, path, value, try_jsonb=f.try_jsonb)
        )
    if f.contains is not None:
        conditions.append(contains_text(conn, c_.c.arguments, f.contains))
    if f.search is not None:
        conditions.append(
            search_condition(f.search, c_.c.name, c_.c.call_id, a.c.conversation_id, c_.c.arguments)
        )
    drive_from_attempts = (
        f.name is None
        and f.state is None
        and not f.args
        and f.contains is None
        and f.search is None
    )
    if after is not None:
        c, s, rank, attempt, p = after
        if rank == 0:
            conditions.append(
                sa.tuple_(a.c.conversation_id, a.c.at_seq, a.c.id, c_.c.position)
                > sa.tuple_(c, s, attempt, p)
            )
        else:
            conditions.append(sa.tuple_(a.c.conversation_id, a.c.at_seq) > sa.tuple_(c, s))
    return (
        sa.select(
            a.c.conversation_id,
            a.c.at_seq.label("seq"),
            sa.literal(0).label("rnk"),
            a.c.id.label("attempt_id"),
            c_.c.position,
        )
        .select_from(c_.join(a, _attempt_link(conn, a, c_, drive_from_attempts)))
        .where(*conditions)
        .order_by(a.c.conversation_id, a.c.at_seq, a.c.id, c_.c.position)
        .limit(limit)
    )


def _attempt_link(
    conn: Connection, a: sa.FromClause, c_: sa.FromClause, drive_from_attempts: bool
) -> sa.ColumnElement[bool]:
    """The join of a call to its attempt.

    With no filter on the calls themselves, the page is best read from the attempts in key
    order (their index), each with its calls. SQLite's planner, which has no statistics, would
    rather scan every call and sort: ``id + 0`` keeps it from looking attempts up by id, so it
    walks the index (PostgreSQL's planner weighs the LIMIT itself and is left alone).
    """
    if drive_from_attempts and conn.dialect.name == "sqlite":
        return a.c.id + 0 == c_.c.attempt_id
    return a.c.id == c_.c.attempt_id
