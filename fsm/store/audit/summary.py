""":func:`stats`: calls per tool, per model and per day, tokens from the assistant
messages' usage (its token columns, see :func:`_turns_query`), and the share of incomplete
turns per model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.store import models
from fsm.store.audit.filters import Filters, time_filters
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    CALLS,
    FAILED_STATE_VALUES,
    MESSAGES,
    Bind,
    Row,
    as_opt_text,
    as_text,
    connect,
    raw_column,
)


# -- statistics --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolStat(Row):
    """Calls of one tool: in history, and failed (truncated / aborted) in attempts."""

    name: str
    calls: int
    failed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStat(Row):
    """One model's turns and tokens.

    ``turns`` are its assistant messages in history (with or without calls); ``calls`` their
    tool calls; ``attempts`` its recorded attempts, ``incomplete`` those that were not complete
    turns, and ``incomplete_share`` = incomplete / (turns + incomplete): the share of the turns
    it streamed that could not go to history. Tokens are summed from the messages' usage.
    """

    model: str | None
    turns: int
    calls: int
    attempts: int
    incomplete: int
    incomplete_share: float
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DayStat(Row):
    """One UTC day: turns and calls of history, incomplete attempts, tokens."""

    day: str
    turns: int
    calls: int
    incomplete: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """What :func:`stats` returns: one list per breakdown, and the totals."""

    tools: list[ToolStat] = field(default_factory=list)
    models: list[ModelStat] = field(default_factory=list)
    days: list[DayStat] = field(default_factory=list)
    totals: ModelStat | None = None
    #: assistant messages whose usage is set but is not a JSON object fsm can read (malformed
    #: text, ``Infinity``, an array, a string): their tokens are left out of every sum, as is
    #: any single token count that is not an integer from 0 to :data:`TOKEN_MAX`.
    unreadable_usage: int = 0


#: the largest token count :func:`stats` adds up (larger, negative or fractional counts, text,
#: ``Infinity`` and malformed usage are not counted: see :attr:`Stats.unreadable_usage`).
TOKEN_MAX: Final = models.TOKEN_MAX


def _turns_query(
    conn: Connection, m: sa.FromClause, where: Sequence[sa.ColumnElement[bool]]
) -> sa.Select[Any]:
    """The assistant messages of ``where`` grouped by (model, day): count, calls, prompt,
    completion and total tokens (the total given, else prompt + completion), and how many have
    a usage that is not a JSON object.

    Read from the token columns the store writes with each message (migration 0006, which
    backfilled the rows written before it), not from the usage JSON: unfiltered, the query is a
    scan of ``ix_fsm_messages_stats`` alone (SQLite: in (model, day) order, no sort; PostgreSQL: an
    index-only scan aggregated by hash). The columns' checks hold what the store writes (an
    integer from 0 to :data:`TOKEN_MAX`, or NULL); SQLite adds them up with ``total()``, which
    no value fails (raw SQL with the checks off can store anything there, and ``fsm audit
    check`` reports it): a guard per value would double the cost of the scan.
    """
    day = _day(conn, m.c.created_at)
    model_ = raw_column(conn, m.c.model)
    add = sa.func.total if conn.dialect.name == "sqlite" else sa.func.sum
    prompt, completion = m.c.prompt_tokens, m.c.completion_tokens
    return (
        sa.select(
            model_,
            day,
            sa.func.count(),
            add(m.c.n_calls),
            add(prompt),
            add(completion),
            add(sa.func.coalesce(m.c.total_tokens, prompt + completion)),
            add(m.c.usage_unreadable),
        )
        .where(*where)
        .group_by(model_, day)
    )


_ASSISTANT: Final[sa.ColumnElement[Any]] = sa.literal_column("'assistant'")


def _day(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """A time column's UTC day: SQLite, the first 10 characters of its text (the expression
    ``ix_fsm_messages_stats`` indexes); PostgreSQL, a ``date`` (read as ``YYYY-MM-DD``)."""
    if conn.dialect.name == "sqlite":
        # literal bounds: SQLite matches an indexed expression only with the same constants
        return sa.func.substr(
            sa.type_coerce(column, sa.Text), sa.literal_column("1"), sa.literal_column("10")
        )
    return sa.cast(sa.func.timezone("UTC", column), sa.Date)


def stats(
    bind: Bind,
    *,
    conversation: str | None = None,
    model: str | None = None,
    since: datetime | date | str | None = None,
    until: datetime | date | str | None = None,
) -> Stats:
    """Usage statistics, optionally for one conversation, one model or a time range.

    Three grouped scans: the assistant messages by (model, day) (turns, calls, tokens), the
    attempts by (model, day), and the calls by tool; per model, per day and the totals are rolled
    up from them. Times are the assistant messages' / attempts' ``created_at``, days are UTC.
    """
    f = Filters.of(conversation=conversation, model=model, since=since, until=until)
    m = MESSAGES.alias("m")
    a = ATTEMPTS.alias("at")
    t = CALLS.alias("t")
    ac = ATTEMPT_CALLS.alias("ac")
    with connect(bind, snapshot=True) as conn:
        # a literal, as in the partial indexes' WHERE (SQLite uses one only for the same term)
        msg_where: list[sa.ColumnElement[bool]] = [m.c.role == _ASSISTANT]
        att_where: list[sa.ColumnElement[bool]] = []
        if f.conversation is not None:
            msg_where.append(m.c.conversation_id == f.conversation)
            att_where.append(a.c.conversation_id == f.conversation)
        if f.model is not None:
            msg_where.append(m.c.model == f.model)
            att_where.append(a.c.model == f.model)
        msg_where += time_filters(conn, m.c.created_at, f.since, f.until)
        att_where += time_filters(conn, a.c.created_at, f.since, f.until)

        turns_query = _turns_query(conn, m, msg_where)
        if conn.dialect.name == "postgresql" and not isinstance(bind, Connection):
            conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))  # aggregate in memory
        turns = list(conn.execute(turns_query).all())
        attempt_day = _day(conn, a.c.created_at)
        attempt_model = raw_column(conn, a.c.model)
        incomplete = sa.func.sum(sa.case((a.c.complete, 0), else_=1))
        attempts = conn.execute(
            sa.select(attempt_model, attempt_day, sa.func.count(), incomplete)
            .where(*att_where)
            .group_by(attempt_model, attempt_day)
        ).all()

        tool = raw_column(conn, t.c.name)
        calls_query = sa.select(tool, sa.func.count())
        if len(msg_where) > 1:
            calls_query = calls_query.select_from(
                t.join(
                    m,
                    sa.and_(
                        m.c.conversation_id == t.c.conversation_id, m.c.seq == t.c.assistant_seq
                    ),
                )
            ).where(*msg_where)
        per_tool = {as_text(k): v for k, v in conn.execute(calls_query.group_by(tool)).all()}
        failed_tool = raw_column(conn, ac.c.name)
        failed_query = (
            sa.select(failed_tool, sa.func.count())
            .where(raw_column(conn, ac.c.state).in_(FAILED_STATE_VALUES))
            .group_by(failed_tool)
        )
        if att_where:
            failed_query = failed_query.select_from(ac.join(a, a.c.id == ac.c.attempt_id)).where(
                *att_where
            )
        per_tool_failed = {as_text(k): v for k, v in conn.execute(failed_query).all()}

    def n(value: Any) -> int:
        if isinstance(value, float) and not math.isfinite(value):
            return 0
        return int(value) if isinstance(value, int | float | Decimal) else 0

    by_model: dict[str | None, list[int]] = {}
    by_day: dict[str, list[int]] = {}
    unreadable_usage = 0
    # [turns, calls, attempts, incomplete, prompt, completion, total]
    for model_name, day_text, count, n_calls, p, c, tt, bad_usage in turns:
        unreadable_usage += n(bad_usage)
        for bucket in (
            by_model.setdefault(as_opt_text(model_name), [0] * 7),
            by_day.setdefault(as_text(day_text), [0] * 7),
        ):
            bucket[0] += n(count)
            bucket[1] += n(n_calls)
            bucket[4] += n(p)
            bucket[5] += n(c)
            bucket[6] += n(tt)
    for model_name, day_text, count, bad in attempts:
        for bucket in (
            by_model.setdefault(as_opt_text(model_name), [0] * 7),
            by_day.setdefault(as_text(day_text), [0] * 7),
        ):
            bucket[2] += n(count)
            bucket[3] += n(bad)

    def model_stat(name: str | None, v: Sequence[int]) -> ModelStat:
        share = v[3] / (v[0] + v[3]) if v[0] + v[3] else 0.0
        return ModelStat(
            model=name,
            turns=v[0],
            calls=v[1],
            attempts=v[2],
            incomplete=v[3],
            incomplete_share=round(share, 6),
            prompt_tokens=v[4],
            completion_tokens=v[5],
            total_tokens=v[6],
        )

    models = [model_stat(k, v) for k, v in by_model.items()]
    models.sort(key=lambda s: (-s.turns, s.model or ""))
    totals = model_stat(None, [sum(v[i] for v in by_model.values()) for i in range(7)])
    days = [
        DayStat(
            day=k,
            turns=v[0],
            calls=v[1],
            incomplete=v[3],
            prompt_tokens=v[4],
            completion_tokens=v[5],
            total_tokens=v[6],
        )
        for k, v in sorted(by_day.items())
    ]
    tools = [
        ToolStat(name=k, calls=n(per_tool.get(k)), failed=n(per_tool_failed.get(k)))
        for k in set(per_tool) | set(per_tool_failed)
    ]
    tools.sort(key=lambda s: (-s.calls, -s.failed, s.name))
    return Stats(
        tools=tools, models=models, days=days, totals=totals, unreadable_usage=unreadable_usage
    )
