"""Read-only queries for browsing a store (the viewer of ``fsm audit serve``): the conversations
newest first (:func:`conversations`) and one conversation as a timeline (:func:`timeline`).

Both read every value raw and leniently, as the rest of the audit does (:mod:`.read`): a store
edited with its enforcement off (a blob in a text column, malformed JSON, a time that is not one)
is shown, never makes a page fail. Both page by keyset: :func:`conversations` by
``(created_at, id)`` descending (``after=row.key``), :func:`timeline` by ``seq`` (``after=`` the
last seq shown; the contract makes seq dense from 0, so pages of ``limit`` messages start at
multiples of ``limit``).

The timeline is :mod:`fsm.store.audit.timeline` (re-exported here with its limits); this module
lists the conversations and counts the failed calls per day.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.store.audit.filters import (
    Filters,
    search_condition,
    time_column,
    time_filters,
)
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    CALLS,
    CONVERSATIONS,
    MESSAGES,
    Bind,
    Row,
    as_int,
    as_opt_text,
    as_text,
    connect,
    raw_column,
)
from fsm.store.audit.timeline import (
    CALLS_PER_TURN as CALLS_PER_TURN,
)
from fsm.store.audit.timeline import (
    MAX_PAGE,
    UNSENDABLE,
    Timeline,
    TimelineAttempt,
    TimelineCall,
    TimelineMessage,
    timeline,
)
from fsm.store.audit.timeline import PAGE_CHARS as PAGE_CHARS
from fsm.store.audit.timeline import VALUE_CHARS as VALUE_CHARS
from fsm.store.codec import as_utc, encode_text
from fsm.store.errors import InvalidFilterError

__all__ = [
    "COUNT_CAP",
    "ConversationRow",
    "Timeline",
    "TimelineAttempt",
    "TimelineCall",
    "TimelineMessage",
    "conversations",
    "count_conversations",
    "failed_calls_per_day",
    "timeline",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationRow(Row):
    """One conversation as the viewer lists it: when it was created, its last activity (its
    newest message or attempt; its creation when it has neither), its history messages, tool
    calls in history and recorded (failed) attempts."""

    id: str
    created_at: datetime | None
    last_activity: datetime | None
    messages: int
    calls: int
    attempts: int
    #: the API of its latest turn: its newest assistant message's format (``chat``,
    #: ``responses``, ``anthropic``; one written before migration 0007 is ``chat``), else its
    #: newest attempt's (``None``: neither, or an attempt of unknown format)
    format: str | None = None
    #: whether the conversation has more than :data:`COUNT_CAP` calls (``calls`` is the cap)
    calls_capped: bool = False
    #: whether it has more than :data:`COUNT_CAP` attempts (``attempts`` is the cap)
    attempts_capped: bool = False
    #: the stored ``created_at`` as the engine compares it (the cursor's first part)
    created_key: str | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        """``(created_at as stored, id)``: pass it as ``after=`` for the next page."""
        return (self.created_key or "", self.id)

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order (without the cursor's internals)."""
        out = Row.as_dict(self)
        out.pop("created_key")
        return out


def conversations(
    bind: Bind,
    *,
    prefix: str | None = None,
    model: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
    api: str | None = None,
    search: str | None = None,
    limit: int = 50,
    after: tuple[str, str] | None = None,
) -> list[ConversationRow]:
    """Conversations newest first (by ``created_at``, then id, both descending).

    ``prefix``: ids that start with it (case-sensitive, no wildcards); ``model``: conversations
    with an assistant message or an attempt of that model; ``since`` <= created_at < ``until``
    (the conversation's creation; datetimes, dates or ISO strings, naive means UTC); ``api``:
    conversations with an assistant message or an attempt of that format (``chat``,
    ``responses``, ``anthropic``); ``search``: ids that contain it (case-insensitive, ``%``
    and ``_`` literal). ``after``: the :attr:`~ConversationRow.key` of the last row of the
    previous page.
    """
    if type(limit) is not int or not 0 <= limit <= MAX_PAGE:
        raise InvalidFilterError(f"limit must be an integer from 0 to {MAX_PAGE}, not {limit!r}")
    if after is not None and (len(after) != 2 or not all(isinstance(part, str) for part in after)):
        raise InvalidFilterError("after must be a conversation row's key (two strings)")
    f = _conversation_filters(prefix, model, since, until, api, search)
    c = CONVERSATIONS.alias("c")
    m = MESSAGES.alias("m")
    a = ATTEMPTS.alias("a")
    t = CALLS.alias("t")
    with connect(bind, snapshot=True) as conn:
        # the order: SQLite's stored text (it orders as time does); PostgreSQL's timestamp
        order = time_column(conn, c.c.created_at)
        conditions = _conversation_conditions(conn, c, prefix, f)
        if after is not None:
            bound = _after_bound(conn, after[0])
            conditions.append(sa.or_(order < bound, sa.and_(order == bound, c.c.id < after[1])))
        inner = (
            sa.select(c.c.id, c.c.created_at, order.label("ordered"))
            .where(*conditions)
            .order_by(order.desc(), c.c.id.desc())
            .limit(limit)
            .subquery("inner")
        )
        page = sa.select(
            inner.c.id,
            inner.c.created_at,
            inner.c.ordered,
            _created_key(conn, inner.c.created_at).label("created_key"),
        ).subquery("page")
        last_seq = sa.select(sa.func.max(m.c.seq)).where(m.c.conversation_id == page.c.id)
        # counts read at most COUNT_CAP + 1 index entries each (a page's time stays bounded
        # however many calls or attempts one conversation has)
        n_calls = _capped_count(
            sa.select(t.c.position).where(t.c.conversation_id == page.c.id).correlate(page)
        )
        n_attempts = _capped_count(
            sa.select(a.c.id).where(a.c.conversation_id == page.c.id).correlate(page)
        )
        # the newest message and attempt, by the keys' indexes (not a max over their times)
        last_message = (
            sa.select(raw_column(conn, m.c.created_at))
            .where(m.c.conversation_id == page.c.id)
            .order_by(m.c.seq.desc())
            .limit(1)
        )
        last_attempt = (
            sa.select(raw_column(conn, a.c.created_at))
            .where(a.c.conversation_id == page.c.id)
            .order_by(a.c.at_seq.desc(), a.c.id.desc())
            .limit(1)
        )
        # the API of the latest turn: the newest assistant message's, else the newest attempt's
        last_format = (
            sa.select(sa.func.coalesce(m.c.format, sa.literal("chat", sa.Text)))
            .where(m.c.conversation_id == page.c.id, m.c.role == "assistant")
            .order_by(m.c.seq.desc())
            .limit(1)
        )
        attempt_format = (
            sa.select(a.c.format)
            .where(a.c.conversation_id == page.c.id)
            .order_by(a.c.at_seq.desc(), a.c.id.desc())
            .limit(1)
        )
        query = sa.select(
            raw_column(conn, page.c.id),
            raw_column(conn, page.c.created_at),
            page.c.created_key,
            last_seq.scalar_subquery(),
            n_calls.scalar_subquery(),
            n_attempts.scalar_subquery(),
            last_message.scalar_subquery(),
            last_attempt.scalar_subquery(),
            sa.func.coalesce(last_format.scalar_subquery(), attempt_format.scalar_subquery()),
        ).order_by(page.c.ordered.desc(), page.c.id.desc())
        rows = conn.execute(query).all()
    out = []
    for cid, created_at, key, seq, calls, attempts, at_m, at_a, fmt in rows:
        created_time = as_utc(created_at)
        times = [x for x in (as_utc(at_m), as_utc(at_a)) if x is not None]
        out.append(
            ConversationRow(
                id=as_text(cid),
                created_at=created_time,
                last_activity=max(times) if times else created_time,
                messages=0 if as_int(seq) is None else int(seq) + 1,
                calls=min(int(calls or 0), COUNT_CAP),
                attempts=min(int(attempts or 0), COUNT_CAP),
                calls_capped=int(calls or 0) > COUNT_CAP,
                attempts_capped=int(attempts or 0) > COUNT_CAP,
                format=as_opt_text(fmt),
                created_key=as_opt_text(key),
            )
        )
    return out


def count_conversations(
    bind: Bind,
    *,
    prefix: str | None = None,
    model: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
    api: str | None = None,
    search: str | None = None,
    cap: int = 10_000,
) -> tuple[int, bool]:
    """How many conversations :func:`conversations` lists with these filters, counted up to
    ``cap`` (at most ``cap + 1`` rows read): ``(count, capped)``, ``capped`` when there are
    more than ``cap`` (then ``count`` is ``cap``)."""
    f = _conversation_filters(prefix, model, since, until, api, search)
    c = CONVERSATIONS.alias("c")
    with connect(bind, snapshot=True) as conn:
        conditions = _conversation_conditions(conn, c, prefix, f)
        rows = sa.select(c.c.id).where(*conditions).limit(cap + 1).subquery()
        found = int(conn.execute(sa.select(sa.func.count()).select_from(rows)).scalar() or 0)
    return min(found, cap), found > cap


def _conversation_filters(
    prefix: str | None,
    model: str | None,
    since: datetime | date | str | None,
    until: datetime | date | str | None,
    api: str | None,
    search: str | None,
) -> Filters:
    if prefix and UNSENDABLE.search(prefix):
        raise InvalidFilterError(
            f"prefix {prefix!r} starts no conversation id (ids are text without U+0000 or "
            "surrogates)"
        )
    return Filters.of(model=model, since=since, until=until, format=api, search=search)


def _conversation_conditions(
    conn: Connection, c: sa.FromClause, prefix: str | None, f: Filters
) -> list[sa.ColumnElement[bool]]:
    """The conditions of :func:`conversations` (but its cursor) on the alias ``c``."""
    m = MESSAGES.alias("m")
    a = ATTEMPTS.alias("a")
    conditions: list[sa.ColumnElement[bool]] = []
    if prefix:
        conditions.append(sa.func.substr(c.c.id, 1, len(prefix)) == sa.literal(prefix))
    if f.search is not None:
        conditions.append(search_condition(f.search, c.c.id))
    if f.model is not None:
        # probed per conversation, newest first, until the page is full (a scalar subquery
        # the planner keeps per row: a semi join would read every message of the model)
        conditions.append(
            sa.or_(
                _probe(
                    m.c.conversation_id == c.c.id, m.c.role == "assistant", m.c.model == f.model
                ),
                # model || '': by the conversation's attempts, not the model's index
                # (which would read every attempt of the model for each conversation)
                _probe(
                    a.c.conversation_id == c.c.id,
                    sa.type_coerce(a.c.model, sa.String) + "" == encode_text(f.model),
                ),
            )
        )
    if f.format is not None:
        # probed per conversation as the model is; an assistant message written before
        # migration 0007 (format NULL) is chat
        fmt = m.c.format == f.format
        if f.format == "chat":
            fmt = sa.or_(fmt, m.c.format.is_(None))
        conditions.append(
            sa.or_(
                _probe(m.c.conversation_id == c.c.id, m.c.role == "assistant", fmt),
                _probe(a.c.conversation_id == c.c.id, a.c.format == f.format),
            )
        )
    conditions += time_filters(conn, c.c.created_at, f.since, f.until)
    return conditions


#: the most calls or attempts :func:`conversations` counts per conversation (a row with more
#: shows ``COUNT_CAP`` and says so: ``calls_capped``, ``attempts_capped``).
COUNT_CAP: Final = 10_000


def _capped_count(rows: sa.Select[Any]) -> sa.Select[Any]:
    """The number of ``rows``, reading at most ``COUNT_CAP + 1`` of them."""
    return sa.select(sa.func.count()).select_from(rows.limit(COUNT_CAP + 1).subquery())


def _created_key(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``created_at`` as text the page is ordered by: SQLite's stored text; PostgreSQL's
    timestamp in UTC, ISO 8601 with microseconds (text orders as time does)."""
    if conn.dialect.name == "sqlite":
        return time_column(conn, column)
    return sa.func.to_char(sa.func.timezone("UTC", column), 'YYYY-MM-DD"T"HH24:MI:SS.US')


def _after_bound(conn: Connection, text: str) -> sa.ColumnElement[Any]:
    """A cursor's time as the engine compares it with the order column: SQLite's text as it
    is; PostgreSQL's UTC text as a timestamp (text that is not one: an error for the user)."""
    if conn.dialect.name == "sqlite":
        return sa.literal(text, sa.String)
    try:
        moment = datetime.fromisoformat(text).replace(tzinfo=UTC)
    except ValueError:
        raise InvalidFilterError(f"{text!r} is not the time of a cursor of this listing") from None
    return sa.literal(moment, sa.DateTime(timezone=True))


def _probe(*conditions: sa.ColumnElement[bool]) -> sa.ColumnElement[bool]:
    """Some row meets ``conditions`` (a correlated ``LIMIT 1`` lookup, kept per row)."""
    return sa.select(sa.literal(1)).where(*conditions).limit(1).scalar_subquery().is_not(None)


def failed_calls_per_day(
    bind: Bind,
    *,
    conversation: str | None = None,
    model: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
) -> dict[str, dict[str, int]]:
    """The calls of recorded attempts that did not finish, per UTC day of their attempt and
    state: ``{"2026-11-30": {"truncated": 3, "aborted": 1}}`` (days in order). The calls of
    history per day are :func:`~fsm.store.audit.stats`' ``days``."""
    f = Filters.of(conversation=conversation, model=model, since=since, until=until)
    a = ATTEMPTS.alias("a")
    ac = ATTEMPT_CALLS.alias("ac")
    with connect(bind) as conn:
        if conn.dialect.name == "sqlite":
            day = sa.func.substr(sa.cast(a.c.created_at, sa.Text), 1, 10)
        else:
            day = sa.func.to_char(sa.func.timezone("UTC", a.c.created_at), "YYYY-MM-DD")
        state = raw_column(conn, ac.c.state)
        conditions: list[sa.ColumnElement[bool]] = [state.in_(_FAILED_STATE_NAMES)]
        if f.conversation is not None:
            conditions.append(a.c.conversation_id == f.conversation)
        if f.model is not None:
            conditions.append(a.c.model == f.model)
        conditions += time_filters(conn, a.c.created_at, f.since, f.until)
        rows = conn.execute(
            sa.select(day, state, sa.func.count())
            .select_from(ac.join(a, a.c.id == ac.c.attempt_id))
            .where(*conditions)
            .group_by(day, state)
        ).all()
    out: dict[str, dict[str, int]] = {}
    for day_text, state_text, count in sorted(rows, key=lambda r: (str(r[0]), str(r[1]))):
        out.setdefault(as_text(day_text), {})[as_text(state_text)] = int(count)
    return out


_FAILED_STATE_NAMES: Final = ("truncated", "aborted")
