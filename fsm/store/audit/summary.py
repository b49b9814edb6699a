""":func:`stats`: calls per tool, per model and per day, tokens from the assistant
messages' usage, and the share of incomplete turns per model. Usage is read so that no stored
value makes the query fail (see :func:`_turns_query`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Connection, Engine

from fsm.store.audit.filters import (
    _PG_UNHELD_ESCAPES,
    Filters,
    _time_filters,
)
from fsm.store.audit.read import (
    _ATTEMPT_CALLS,
    _ATTEMPTS,
    _CALLS,
    _FAILED_STATES,
    _MESSAGES,
    Bind,
    _connect,
    _opt_text,
    _raw,
    _Row,
    _text,
)


# -- statistics --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolStat(_Row):
    """Calls of one tool: in history, and failed (truncated / aborted) in attempts."""

    name: str
    calls: int
    failed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStat(_Row):
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
class DayStat(_Row):
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
TOKEN_MAX: Final = 10**9 - 1
_TOKEN_KEYS: Final = ("prompt_tokens", "completion_tokens", "total_tokens")


def _pg_usage_risky(usage: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """PostgreSQL: a usage that the ``json`` operators may fail on (an escape they cannot
    decode, or nesting deeper than the server's stack, which needs 10,000 characters)."""
    text = sa.cast(usage, sa.Text)
    return sa.or_(sa.func.strpos(text, "\\u") > 0, sa.func.octet_length(text) >= 10_000)


def _turns_query(
    conn: Connection, m: sa.FromClause, where: Sequence[sa.ColumnElement[bool]]
) -> sa.Select[Any]:
    """The assistant messages of ``where`` grouped by (model, day): count, calls, prompt,
    completion and total tokens, and how many have a usage that is not a JSON object.

    A token count is an integer from 0 to :data:`TOKEN_MAX`; anything else (text, a fraction, a
    negative or huge number, ``true``, ``Infinity``) is left out, and no value stops the query.
    SQLite: the JSON functions only see text ``json_valid`` accepts. PostgreSQL (a ``json``
    column, which each operator parses again): each key's JSON text is read once per row in a
    derived table (``OFFSET 0`` keeps the planner from inlining it into every use), and a count
    is that text when it is at most nine digits (a string is quoted, so no cast can fail). A
    usage the ``json`` operators could fail on (:func:`_pg_usage_risky`) is read through its
    :func:`_pg_usage_document` instead: that test costs a read of each usage, so it is only
    made when an ``EXISTS`` finds such a usage at all.
    """
    day = _day(conn, m.c.created_at)
    model_ = _raw(conn, m.c.model)
    if conn.dialect.name == "sqlite":
        counts, unreadable = _sqlite_usage(m.c.usage)
        prompt, completion = counts["prompt_tokens"], counts["completion_tokens"]
        total = sa.func.coalesce(counts["total_tokens"], prompt + completion)
        return (
            sa.select(
                model_,
                day,
                sa.func.count(),
                sa.func.sum(_counted(conn, m.c.n_calls)),
                sa.func.sum(prompt),
                sa.func.sum(completion),
                sa.func.sum(total),
                sa.func.sum(unreadable),
            )
            .where(*where)
            .group_by(model_, day)
        )
    usage = m.c.usage
    risky_rows = sa.exists().where(*where, usage.is_not(None), _pg_usage_risky(usage))
    guarded = bool(conn.execute(sa.select(risky_rows)).scalar())
    as_json = sa.type_coerce(usage, pg.JSON)
    document = _pg_usage_document(usage)

    def guard(fast: sa.ColumnElement[Any], slow: sa.ColumnElement[Any]) -> Any:
        return sa.case((_pg_usage_risky(usage), slow), else_=fast) if guarded else fast

    values = [
        guard(
            sa.cast(as_json.op("->")(sa.literal(key)), sa.Text),
            sa.cast(document.op("->")(sa.literal(key)), sa.Text),
        ).label(key)
        for key in _TOKEN_KEYS
    ]
    kind = guard(sa.func.json_typeof(as_json), sa.func.jsonb_typeof(document))
    rows = (
        sa.select(
            model_.label("model"),
            day.label("day"),
            m.c.n_calls,
            usage.is_(None).label("no_usage"),
            kind.label("kind"),
            *values,
        )
        .where(*where)
        .offset(0)
        .subquery("x")
    )
    pattern = sa.literal(f"^[0-9]{{1,{len(str(TOKEN_MAX))}}}$")

    def count(key: str) -> sa.ColumnElement[Any]:
        text = rows.c[key]
        return sa.case((text.bool_op("~")(pattern), sa.cast(text, sa.BigInteger)), else_=sa.null())

    prompt, completion = count("prompt_tokens"), count("completion_tokens")
    unreadable = sa.case((rows.c.no_usage, 0), (rows.c.kind == "object", 0), else_=1)
    return sa.select(
        rows.c.model,
        rows.c.day,
        sa.func.count(),
        sa.func.sum(rows.c.n_calls),
        sa.func.sum(prompt),
        sa.func.sum(completion),
        sa.func.sum(sa.func.coalesce(count("total_tokens"), prompt + completion)),
        sa.func.sum(unreadable),
    ).group_by(rows.c.model, rows.c.day)


def _sqlite_usage(
    usage: sa.ColumnElement[Any],
) -> tuple[dict[str, sa.ColumnElement[Any]], sa.ColumnElement[Any]]:
    """SQLite: per token key, the count at ``usage.key`` (``NULL`` when absent or unusable), and
    1 when the usage is set but not a JSON object ``json_valid`` accepts. (Which token values
    were unusable is not counted: every further JSON function per row costs a read of the
    column, which a scan of millions of messages feels.)"""
    counts: dict[str, sa.ColumnElement[Any]] = {}
    valid = sa.func.json_valid(usage) == 1
    for key in _TOKEN_KEYS:
        path = f'$."{key}"'
        kind = sa.case((valid, sa.func.json_type(usage, path)), else_=sa.null())
        number = sa.func.json_extract(usage, path)
        counts[key] = sa.case(
            (kind == "integer", sa.case((number.between(0, TOKEN_MAX), number), else_=sa.null())),
            else_=sa.null(),
        )
    is_object = sa.and_(valid, sa.func.json_type(usage) == "object")
    return counts, sa.case((usage.is_(None), 0), (is_object, 0), else_=1)


#: an exponent of five digits or more: ``numeric`` may not hold the number (1e1000000)
_BIG_EXPONENT: Final = r"-?[0-9]+(\.[0-9]+)?[eE][-+]?[0-9]{5,}"


def _pg_usage_document(usage: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """A ``json`` usage as ``jsonb``, or NULL; never an error, and no plpgsql (parallel plans
    stay possible). A ``json`` value is valid JSON (PostgreSQL checks it on input); ``jsonb``
    refuses only the escapes it cannot hold (read as U+FFFD here), numbers beyond ``numeric``
    (an exponent of five digits or more: read as ``null``) and nesting deeper than the server's
    stack (a usage of 10,000 characters or more is not read: a real one is a few hundred)."""
    text = sa.cast(usage, sa.Text)
    plain = sa.and_(
        sa.func.strpos(text, "\\u") == 0,
        sa.not_(text.bool_op("~")(sa.literal(r"[0-9][eE][-+]?[0-9]{5}"))),
    )
    held = sa.func.regexp_replace(
        sa.func.regexp_replace(
            text, sa.literal(_PG_UNHELD_ESCAPES), sa.literal(r"\\ufffd"), sa.literal("g")
        ),
        sa.literal(_BIG_EXPONENT),
        sa.literal("null"),
        sa.literal("g"),
    )
    return sa.case(
        (sa.func.length(text) >= 10_000, sa.null()),
        (plain, sa.cast(text, pg.JSONB)),
        else_=sa.cast(held, pg.JSONB),
    )


def _sqlite_halves(engine: Engine, conn: Connection, query: sa.Select[Any]) -> list[Any]:
    """``query`` (a grouped scan of all messages) run on two halves of the table at once, each
    read in storage order on its own connection; the caller adds the groups up. (A whole-table
    scan is the work; SQLite does it on one core per connection.)"""
    last = conn.execute(sa.text("SELECT max(rowid) FROM messages")).scalar() or 0
    middle = last // 2
    rowid: sa.ColumnElement[int] = sa.literal_column("m.rowid", sa.Integer)  # stats() alias

    def half(bounds: tuple[int, int]) -> list[Any]:
        with engine.connect() as worker, worker.begin():
            return list(worker.execute(query.where(rowid.between(*bounds))).all())

    with ThreadPoolExecutor(2, thread_name_prefix="fsm-stats") as pool:
        parts = list(pool.map(half, [(0, middle), (middle + 1, last)]))
    return [row for part in parts for row in part]


def _day(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[str]:
    if conn.dialect.name == "sqlite":
        return sa.func.substr(sa.cast(column, sa.Text), 1, 10)
    return sa.func.to_char(sa.func.timezone("UTC", column), "YYYY-MM-DD")


def _counted(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """A count column as ``sum`` may add it up: on SQLite (where raw SQL can store any value)
    only an integer from 0 to :data:`TOKEN_MAX` (``sum`` fails on an integer overflow)."""
    if conn.dialect.name != "sqlite":
        return column
    return sa.case(
        (sa.func.typeof(column) != "integer", sa.null()),
        (column.between(0, TOKEN_MAX), column),
        else_=sa.null(),
    )


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
    m = _MESSAGES.alias("m")
    a = _ATTEMPTS.alias("at")
    t = _CALLS.alias("t")
    ac = _ATTEMPT_CALLS.alias("ac")
    with _connect(bind, snapshot=True) as conn:
        msg_where: list[sa.ColumnElement[bool]] = [m.c.role == "assistant"]
        att_where: list[sa.ColumnElement[bool]] = []
        if f.conversation is not None:
            msg_where.append(m.c.conversation_id == f.conversation)
            att_where.append(a.c.conversation_id == f.conversation)
        if f.model is not None:
            msg_where.append(m.c.model == f.model)
            att_where.append(a.c.model == f.model)
        msg_where += _time_filters(conn, m.c.created_at, f.since, f.until)
        att_where += _time_filters(conn, a.c.created_at, f.since, f.until)

        turns_query = _turns_query(conn, m, msg_where)
        unfiltered = len(msg_where) == 1
        if conn.dialect.name == "sqlite" and unfiltered and not isinstance(bind, Connection):
            turns = _sqlite_halves(bind, conn, turns_query)
        else:
            if conn.dialect.name == "postgresql" and not isinstance(bind, Connection):
                conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))  # sort in memory
            turns = list(conn.execute(turns_query).all())
        attempt_day = _day(conn, a.c.created_at)
        attempt_model = _raw(conn, a.c.model)
        incomplete = sa.func.sum(sa.case((a.c.complete, 0), else_=1))
        attempts = conn.execute(
            sa.select(attempt_model, attempt_day, sa.func.count(), incomplete)
            .where(*att_where)
            .group_by(attempt_model, attempt_day)
        ).all()

        tool = _raw(conn, t.c.name)
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
        per_tool = {_text(k): v for k, v in conn.execute(calls_query.group_by(tool)).all()}
        failed_tool = _raw(conn, ac.c.name)
        failed_query = (
            sa.select(failed_tool, sa.func.count())
            .where(_raw(conn, ac.c.state).in_(_FAILED_STATES))
            .group_by(failed_tool)
        )
        if att_where:
            failed_query = failed_query.select_from(ac.join(a, a.c.id == ac.c.attempt_id)).where(
                *att_where
            )
        per_tool_failed = {_text(k): v for k, v in conn.execute(failed_query).all()}

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
            by_model.setdefault(_opt_text(model_name), [0] * 7),
            by_day.setdefault(_text(day_text), [0] * 7),
        ):
            bucket[0] += n(count)
            bucket[1] += n(n_calls)
            bucket[4] += n(p)
            bucket[5] += n(c)
            bucket[6] += n(tt)
    for model_name, day_text, count, bad in attempts:
        for bucket in (
            by_model.setdefault(_opt_text(model_name), [0] * 7),
            by_day.setdefault(_text(day_text), [0] * 7),
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
