"""Audit queries over the conversation store: plain functions that return rows.

.. code-block:: python

    from fsm.store import audit

    engine = audit.open_readonly("sqlite:///chat.db")       # refuses every write
    for call in audit.tool_calls(engine, name="get_weather", args=[("city", "Paris")]):
        print(call.conversation_id, call.seq, call.arguments, call.result)
    print(audit.failure_counts(engine))                       # by model, state and reason
    print(audit.stats(engine).models)                         # calls, tokens, incomplete share
    bad = list(audit.check(engine))                           # [] when the contract holds

Every function takes an :class:`~sqlalchemy.engine.Engine` (a connection is opened for the call
and closed when the result is consumed) or a :class:`~sqlalchemy.engine.Connection` (used as it
is, inside the caller's transaction). None of them writes. :func:`open_readonly` opens a store so
that the database itself refuses writes: SQLite through a ``mode=ro`` URI (a missing file is an
error, never created), PostgreSQL with ``default_transaction_read_only``.

* :func:`tool_calls` lists calls of history (state ``finished``) and of recorded attempts (any
  state), filtered by tool, state, conversation, model, time and argument content, a page at a
  time, in key order (conversation, seq, then attempts before the committed turn at the same
  seq, position). Pages continue with ``after=row.key`` (keyset) or ``offset``.
* :func:`failures` lists the truncated and aborted calls of attempts with reasons and anomalies;
  :func:`failure_counts` groups them by model, state and reason.
* :func:`stats` counts calls per tool, per model and per day, tokens from the assistant messages'
  usage, and the share of incomplete turns per model.
* :func:`check` re-verifies the whole history contract of ``spec/store.md`` and every rule the
  database enforces (keys, foreign keys, checks, column types) with set-based SQL over batches
  of conversations, streaming :class:`Violation` rows (see :data:`VIOLATION_KINDS`): a database
  edited with its enforcement switched off is reported, never called clean.

Every filter is served by an index (migration ``0002``) except the argument-content filters: a
JSON path or a substring of the arguments cannot be indexed, so those are checked on the rows the
other filters (or the key order, with the page's ``LIMIT``) lead to.

**Any committed value can be read.** Rows written with the enforcement off can hold anything
(SQLite: a blob in a text column, text that is not UTF-8, malformed JSON, a created_at that is
not a time); one such value never makes a query over the whole store fail. Values are selected
raw and read leniently: text stored marked by :mod:`fsm.store.codec` (U+0000, lone surrogates)
is decoded, a blob is shown as UTF-8 (errors replaced), a JSON column that is not JSON Python can
hold exactly is shown as its text, a time that is not one as ``None``. JSON functions only see
what the engine can parse (SQLite ``json_valid``; PostgreSQL ``fsm_try_jsonb`` after rewriting
the escapes ``jsonb`` cannot hold, see :func:`_arg_condition` and :func:`stats`).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Final, Literal, TypeAlias, cast

import sqlalchemy as sa
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, Connection, Engine

from fsm.states import ToolCallState
from fsm.store.codec import MARK, decode_text, encode_text, needs_marking
from fsm.store.engine import create_readonly_engine, display_url, normalize_url
from fsm.store.errors import (
    AuditError,
    DatabaseNotFoundError,
    InvalidFilterError,
    SchemaNotAtHeadError,
)
from fsm.store.migrate import alembic_config, head_revision
from fsm.store.models import Attempt, AttemptCall, Conversation, Message, ToolCallRow

__all__ = [
    "TOKEN_MAX",
    "VIOLATION_KINDS",
    "ArgFilter",
    "AuditError",
    "Bind",
    "CallKey",
    "CallRow",
    "DatabaseNotFoundError",
    "DayStat",
    "FailureCount",
    "FailureRow",
    "InvalidFilterError",
    "ModelStat",
    "Stats",
    "ToolStat",
    "Violation",
    "check",
    "failure_counts",
    "failures",
    "open_readonly",
    "parse_json_path",
    "stats",
    "tool_calls",
]

#: an engine (a connection is opened per call) or a connection (used as is).
Bind: TypeAlias = Engine | Connection
#: where a listed call sits: (conversation id, seq, rank, attempt id, position); ``rank`` is 0 for
#: a call of an attempt (``seq`` is where the attempt would have gone, ``at_seq``) and 1 for a call
#: of history (``seq`` is its assistant message's; ``attempt id`` is 0).
CallKey: TypeAlias = tuple[str, int, int, int, int]
#: an argument filter: a JSON path (``city``, ``a.b[0]``, ``$."odd key"``) and a scalar value.
ArgFilter: TypeAlias = tuple[str, "str | int | float | bool | None"]
Source: TypeAlias = Literal["all", "history", "attempts"]
#: ``progress(done, total)``, in conversations.
Progress: TypeAlias = Callable[[int, int], None]

_MESSAGES = cast(sa.Table, Message.__table__)
_CALLS = cast(sa.Table, ToolCallRow.__table__)
_ATTEMPTS = cast(sa.Table, Attempt.__table__)
_ATTEMPT_CALLS = cast(sa.Table, AttemptCall.__table__)
_CONVERSATIONS = cast(sa.Table, Conversation.__table__)

_STATES: Final = tuple(s.value for s in ToolCallState)
_FAILED_STATES: Final = (ToolCallState.TRUNCATED.value, ToolCallState.ABORTED.value)
_PAGE: Final = 1000


# -- opening a store read-only -----------------------------------------------------------------
def open_readonly(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """An engine on the store at ``url`` (``None``: the default store) that cannot write.

    SQLite is opened through a ``file:PATH?mode=ro`` URI: a missing file raises
    :class:`DatabaseNotFoundError` (it is never created), and every write fails with "attempt to
    write a readonly database". PostgreSQL sessions get ``default_transaction_read_only = on``
    (and ``plan_cache_mode = force_custom_plan``, as the store's engine): every write fails with
    "cannot execute ... in a read-only transaction". Transactions begin with a plain ``BEGIN``
    (SQLite) so all statements of one see the same snapshot.

    The schema must be fsm's (any known revision: the queries only need revision 0001; 0002 adds
    the indexes that make them fast), else :class:`~fsm.store.errors.SchemaNotAtHeadError` says
    which command to run. Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """
    parsed = normalize_url(url)
    engine = create_readonly_engine(parsed, **kwargs)
    try:
        _require_schema(engine, display_url(parsed))
    except BaseException:
        engine.dispose()
        raise
    return engine


def _require_schema(engine: Engine, url: str) -> None:
    """Raise :class:`SchemaNotAtHeadError` unless the database has an fsm schema fsm knows."""
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_heads()
    except sa.exc.DBAPIError as exc:
        raise AuditError(f"cannot read the store {url}: {_one_line(exc)}") from exc
    head = head_revision()
    if not current:
        raise SchemaNotAtHeadError(url, None, head)
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current[0] not in known:
        raise SchemaNotAtHeadError(url, current[0], head, unknown=True)


def _one_line(exc: sa.exc.DBAPIError) -> str:
    return " ".join(str(exc.orig).split())


@contextmanager
def _connect(bind: Bind, *, snapshot: bool = False) -> Iterator[Connection]:
    """A connection for one audit call: the given one, or a new one from an engine (inside one
    transaction; ``snapshot`` asks PostgreSQL for REPEATABLE READ, so every statement sees the
    same commits, as SQLite's transactions always do)."""
    if isinstance(bind, Connection):
        yield bind
        return
    with bind.connect() as conn:
        if snapshot and conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            yield conn


# -- values ------------------------------------------------------------------------------------
def _utc(value: datetime | date | str | None, what: str) -> datetime | None:
    """A time bound as an aware UTC datetime (naive means UTC; a date means its midnight)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise InvalidFilterError(
                f"{what} must be an ISO 8601 date or time (2026-11-30, 2026-11-30T14:00:00Z), "
                f"not {value!r}"
            ) from None
    if not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _as_utc(value: Any) -> datetime | None:
    """A timestamp read from either engine, as an aware UTC datetime (``None`` for a value that
    is not a time: raw SQL can store anything in a SQLite column)."""
    if isinstance(value, str):  # SQLite keeps text; read raw (see _raw)
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _raw(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``column`` selected as the engine stores it, without the type's result processing (a
    StoredText decode, a JSON parse, a datetime parse, an enum lookup), any of which fails on a
    value raw SQL wrote; the caller reads it with :func:`_text`, :func:`_json_value` or
    :func:`_as_utc`. PostgreSQL gets JSON columns as their text (the driver would parse them)."""
    if conn.dialect.name == "postgresql" and isinstance(column.type, sa.JSON):
        return sa.cast(column, sa.Text)
    return sa.type_coerce(column, sa.Text)


def _text(value: Any) -> str:
    """A text value read raw, as the string it stands for: a value stored marked by
    :mod:`fsm.store.codec` decoded; a blob (SQLite, raw SQL) decoded as UTF-8 (errors
    replaced); anything else as its ``str``."""
    if isinstance(value, str):
        return decode_text(value) if value.startswith(MARK) else value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _opt_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _int(value: Any) -> int | None:
    """``value`` when it is an integer (not a bool), else ``None``."""
    return value if type(value) is int else None


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is not a finite double")
    return number


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _json_value(value: Any) -> Any:
    """A JSON column's value read raw (:func:`_raw`): the value it holds, or its text when that
    is not JSON Python can hold exactly (malformed, ``NaN``/``Infinity``, a number beyond a
    double or too long for an int, nested too deep)."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    text = _text(value)
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return text


def _time_bound(conn: Connection, column: sa.ColumnElement[Any], value: datetime) -> Any:
    """``value`` as the engine compares it with ``column``: SQLite keeps timestamps as text
    (``YYYY-MM-DD HH:MM:SS`` in UTC, as ``CURRENT_TIMESTAMP`` writes them), so it gets the same
    text; PostgreSQL gets the aware datetime."""
    if conn.dialect.name == "sqlite":
        text = value.strftime("%Y-%m-%d %H:%M:%S")
        if value.microsecond:
            text += f".{value.microsecond:06d}"
        return sa.literal(text, sa.String)
    return sa.literal(value, sa.DateTime(timezone=True))


def _time_column(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.type_coerce(column, sa.String) if conn.dialect.name == "sqlite" else column


def _time_filters(
    conn: Connection,
    column: sa.ColumnElement[Any],
    since: datetime | None,
    until: datetime | None,
) -> list[sa.ColumnElement[bool]]:
    """``since <= column < until``."""
    target = _time_column(conn, column)
    out: list[sa.ColumnElement[bool]] = []
    if since is not None:
        out.append(target >= _time_bound(conn, column, since))
    if until is not None:
        out.append(target < _time_bound(conn, column, until))
    return out


def _state(value: str | ToolCallState | None) -> str | None:
    if value is None:
        return None
    text = value.value if isinstance(value, ToolCallState) else str(value)
    if text not in _STATES:
        raise InvalidFilterError(f"unknown state {text!r}: one of {', '.join(_STATES)}")
    return text


# -- argument filters --------------------------------------------------------------------------
_KEY = re.compile(r"[^.\[\]\"]+")


def parse_json_path(path: str) -> tuple[str | int, ...]:
    """Parse a JSON path into keys and indexes.

    ``city``, ``.city``, ``$.city``, ``user.address.city``, ``items[0].sku``, ``$."a.b"`` (a
    quoted key may hold dots or brackets, not ``"``), and ``$`` (the whole document). Raises
    :class:`InvalidFilterError` for anything else.
    """
    text = path.strip()
    rest = text[1:] if text.startswith("$") else ("" if not text else "." + text.lstrip("."))
    parts: list[str | int] = []
    i = 0
    while i < len(rest):
        if rest[i] == "." and rest[i + 1 : i + 2] == '"':
            end = rest.find('"', i + 2)
            if end < 0:
                raise InvalidFilterError(f"JSON path {path!r}: unterminated quoted key")
            parts.append(rest[i + 2 : end])
            i = end + 1
        elif rest[i] == ".":
            match = _KEY.match(rest, i + 1)
            if match is None:
                raise InvalidFilterError(f"JSON path {path!r}: empty key at offset {i}")
            parts.append(match.group())
            i = match.end()
        elif rest[i] == "[":
            end = rest.find("]", i)
            index = rest[i + 1 : end] if end > 0 else ""
            if not index.isdigit():
                raise InvalidFilterError(f"JSON path {path!r}: [{index}] is not an array index")
            parts.append(int(index))
            i = end + 1
        else:
            raise InvalidFilterError(
                f"JSON path {path!r}: expected '.key', '.\"key\"' or '[N]' at offset {i}"
            )
    return tuple(parts)


def _sqlite_path(parts: Sequence[str | int]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f'."{p}"' for p in parts)


def _arg_condition(
    conn: Connection,
    arguments: sa.ColumnElement[str],
    state: sa.ColumnElement[Any] | None,
    path: str,
    value: Any,
    *,
    try_jsonb: bool = False,
) -> sa.ColumnElement[bool]:
    """The SQL test "the arguments hold ``value`` at ``path``" for this engine.

    Only finished calls have JSON arguments (a truncated or aborted call's text is cut); empty or
    whitespace-only arguments (no arguments) have no value at any path. Neither ever raises, on
    any committed value: SQLite's JSON functions only see text that ``json_valid`` accepts, and
    PostgreSQL reads the arguments through ``fsm_try_jsonb`` (migration 0003: ``NULL`` for a text
    ``jsonb`` cannot hold, such as a lone surrogate escape or ``1e1000000``), so such a call
    simply does not match. ``jsonb`` cannot hold ``\\u0000`` either: that escape is read as
    U+FFFD, on both sides of the comparison (for matching only). ``try_jsonb`` says whether the
    function exists; a schema older than 0003 gets a guard that skips the values known to fail
    the cast (surrogate escapes, exponents of six digits or more, documents over 20,000
    characters).
    """
    parts = parse_json_path(path)
    if value is not None and not isinstance(value, str | int | float | bool):
        raise InvalidFilterError(
            f"argument filter {path!r}: compare a scalar (string, number, true/false, null), "
            f"not {type(value).__name__}; point the path at a value inside it instead"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidFilterError(f"argument filter {path!r}: {value} is not a finite number")
    finished = state == ToolCallState.FINISHED if state is not None else None
    # a string with a lone surrogate is in no document either engine's JSON functions can read
    unmatchable = isinstance(value, str) and _has_lone_surrogate(value)
    if conn.dialect.name == "sqlite":
        sqlite_path = _sqlite_path(parts)
        json_type = sa.case(
            (sa.func.json_valid(arguments) == 1, sa.func.json_type(arguments, sqlite_path)),
            else_=sa.null(),
        )
        extracted = sa.case(
            (sa.func.json_valid(arguments) == 1, sa.func.json_extract(arguments, sqlite_path)),
            else_=sa.null(),
        )
        condition: sa.ColumnElement[bool]
        if unmatchable:
            condition = sa.false()
        elif value is None:
            condition = json_type == "null"
        elif isinstance(value, bool):
            condition = json_type == ("true" if value else "false")
        elif isinstance(value, str):
            condition = sa.and_(json_type == "text", extracted == sa.literal(value, sa.String))
        else:
            condition = sa.and_(json_type.in_(["integer", "real"]), extracted == sa.literal(value))
        return condition if finished is None else sa.and_(finished, condition)
    if unmatchable:
        return sa.false()
    # PostgreSQL: read the text as jsonb only when it is a document (non-blank) of a finished
    # call, through the guard (never a raw cast: one value jsonb cannot hold would fail the
    # whole query)
    blank = sa.func.btrim(arguments, sa.literal(" \t\n\r"))
    readable = sa.and_(blank != "", *([finished] if finished is not None else []))
    document = sa.case((readable, _pg_jsonb(arguments, try_jsonb=try_jsonb)), else_=sa.null())
    path_array = sa.cast(
        sa.literal([str(p) for p in parts], pg.ARRAY(sa.Text)),
        pg.ARRAY(sa.Text),
    )
    found = document.op("#>")(path_array)
    literal = json.dumps(value).replace("\\u0000", "\\ufffd")
    return found == sa.cast(sa.literal(literal), pg.JSONB)


#: the JSON escapes ``jsonb`` cannot hold: ``\\u0000`` and surrogates (a lone one cannot be
#: decoded; a pair is rewritten too, which only loses the character for matching)
_PG_UNHELD_ESCAPES: Final = r"\\u(0000|[dD][89a-fA-F][0-9a-fA-F]{2})"


def _pg_jsonb(text: sa.ColumnElement[Any], *, try_jsonb: bool) -> sa.ColumnElement[Any]:
    """A stored text as ``jsonb`` for matching, or NULL when it cannot be one; never an error.

    The escapes ``jsonb`` cannot hold are read as U+FFFD first (so one such value in a document
    does not hide the rest of it), then ``fsm_try_jsonb`` (migration 0003) casts what is left,
    NULL for anything else it cannot hold (invalid JSON, numbers beyond ``numeric``, nesting
    deeper than the server's stack). Without the function (a schema before 0003) the cast is
    guarded instead: texts over 20,000 characters or with an exponent of five digits or more
    are not read.
    """
    held = sa.func.regexp_replace(
        text, sa.literal(_PG_UNHELD_ESCAPES), sa.literal(r"\\ufffd"), sa.literal("g")
    )
    if try_jsonb:
        return sa.func.fsm_try_jsonb(held, type_=pg.JSONB)
    risky = sa.or_(
        sa.func.length(text) > 20_000, text.bool_op("~")(sa.literal(r"[eE][-+]?[0-9]{5}"))
    )
    return sa.case((risky, sa.null()), else_=sa.cast(held, pg.JSONB))


def _has_lone_surrogate(text: str) -> bool:
    return not text.isascii() and any("\ud800" <= ch <= "\udfff" for ch in text)


def _pg_function(conn: Connection, signature: str) -> bool:
    """Whether the PostgreSQL function ``signature`` (``name(argtypes)``) is on the search path."""
    found = conn.execute(
        sa.text("SELECT to_regprocedure(:signature) IS NOT NULL"), {"signature": signature}
    ).scalar()
    return bool(found)


def _contains(conn: Connection, arguments: sa.ColumnElement[str], text: str) -> Any:
    """``text`` occurs in the arguments, byte for byte (no wildcards, case-sensitive).

    Values stored marked (:mod:`fsm.store.codec`: a text with U+0000 or a lone surrogate, which
    only the cut arguments of an attempt can hold) are searched in their escaped form; a search
    text that itself needs marking can only occur in those.
    """
    function = sa.func.instr if conn.dialect.name == "sqlite" else sa.func.strpos
    escaped = encode_text(MARK + text)[2:]  # the text as marked values spell it
    marked = sa.and_(
        sa.func.substr(arguments, 1, 1) == sa.literal(MARK, sa.Text),
        function(arguments, sa.literal(escaped, sa.Text)) > 0,
    )
    if needs_marking(text) and not text.startswith(MARK):
        return marked
    plain = function(arguments, sa.literal(text, sa.Text)) > 0
    return plain if escaped == text else sa.or_(plain, marked)


# -- tool calls --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class CallRow:
    """One tool call, from history (``attempt_id is None``) or from a recorded attempt.

    ``seq`` is the assistant message's seq for a call of history, and for a call of an attempt
    the seq its turn would have had (``at_seq``). ``result`` is the content of the call's tool
    message (a string, or a list of content parts), ``None`` for attempts. ``reason`` says why a
    call of an attempt is truncated or aborted.
    """

    conversation_id: str
    seq: int
    position: int
    call_id: str
    name: str
    arguments: str
    state: str
    model: str | None
    created_at: datetime | None
    result: str | list[Any] | None
    attempt_id: int | None
    reason: str | None

    @property
    def key(self) -> CallKey:
        """Where the row sits in the listing: pass it as ``after=`` for the next page."""
        if self.attempt_id is None:
            return (self.conversation_id, self.seq, 1, 0, self.position)
        return (self.conversation_id, self.seq, 0, self.attempt_id, self.position)

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _CallFilters:
    name: str | None
    state: str | None
    conversation: str | None
    model: str | None
    since: datetime | None
    until: datetime | None
    args: tuple[tuple[str, Any], ...]
    contains: str | None
    #: PostgreSQL: whether ``fsm_try_jsonb`` exists (migration 0003)
    try_jsonb: bool = False


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
    arguments). ``source`` picks history, attempts or both.

    ``limit`` rows at most (``None``: all of them, read a page at a time), after skipping
    ``offset`` rows, starting after the key ``after`` (keyset pagination: give the last row's
    :attr:`~CallRow.key` to get the next page; it stays right while rows are added).
    """
    filters = _CallFilters(
        name=name,
        state=_state(state),
        conversation=conversation,
        model=model,
        since=_utc(since, "since"),
        until=_utc(until, "until"),
        args=tuple((path, value) for path, value in args),
        contains=args_contains,
    )
    if source not in ("all", "history", "attempts"):
        raise InvalidFilterError(f"source must be all, history or attempts, not {source!r}")
    if (limit is not None and limit < 0) or offset < 0:
        raise InvalidFilterError("limit and offset must not be negative")
    for path, value in filters.args:  # validate before touching the database
        parse_json_path(path)
        if value is not None and not isinstance(value, str | int | float | bool):
            raise InvalidFilterError(f"argument filter {path!r}: the value must be a scalar")
    history = source != "attempts" and filters.state in (None, ToolCallState.FINISHED.value)
    attempts = source != "history"
    with _connect(bind, snapshot=True) as conn:
        if filters.args and conn.dialect.name == "postgresql":
            filters = replace(filters, try_jsonb=_pg_function(conn, "fsm_try_jsonb(text)"))
        if limit is not None:
            yield from _call_page(conn, filters, history, attempts, limit, offset, after)
            return
        skip = offset
        while True:
            page = _call_page(conn, filters, history, attempts, _PAGE, skip, after)
            yield from page
            if len(page) < _PAGE:
                return
            after, skip = page[-1].key, 0


_KEY_COLUMNS: Final = ("conversation_id", "seq", "rnk", "attempt_id", "position")


def _call_page(
    conn: Connection,
    f: _CallFilters,
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
         content, parts, reason) in conn.execute(query):  # fmt: skip
        rows.append(
            CallRow(
                conversation_id=_text(cid),
                seq=seq,
                position=position,
                call_id=_text(call_id),
                name=_text(name),
                arguments=_text(arguments),
                state=_text(state),
                model=_opt_text(model),
                created_at=_as_utc(created),
                result=_json_value(parts) if parts is not None else _opt_text(content),
                attempt_id=attempt if rank == 0 else None,
                reason=_opt_text(reason),
            )
        )
    return rows


def _history_arm(conn: Connection, keys: sa.Subquery) -> sa.Select[Any]:
    """The rows of history for ``keys``: the call, its assistant message, its result (every
    value read raw, see :func:`_raw`)."""
    t = _CALLS.alias("tc")
    a = _MESSAGES.alias("am")
    r = _MESSAGES.alias("rm")
    return sa.select(
        *(keys.c[c] for c in _KEY_COLUMNS),
        _raw(conn, t.c.call_id).label("call_id"),
        _raw(conn, t.c.name).label("name"),
        _raw(conn, t.c.arguments).label("arguments"),
        sa.literal(ToolCallState.FINISHED.value, sa.String).label("state"),
        _raw(conn, a.c.model).label("model"),
        _raw(conn, a.c.created_at).label("created_at"),
        _raw(conn, r.c.content).label("content"),
        _raw(conn, r.c.content_parts).label("content_parts"),
        sa.null().label("reason"),
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
    )


def _attempt_arm(conn: Connection, keys: sa.Subquery) -> sa.Select[Any]:
    """The rows of attempts for ``keys``: the call and its attempt (read raw, see :func:`_raw`)."""
    c_ = _ATTEMPT_CALLS.alias("acd")
    a = _ATTEMPTS.alias("atd")
    return sa.select(
        *(keys.c[c] for c in _KEY_COLUMNS),
        _raw(conn, c_.c.call_id).label("call_id"),
        _raw(conn, c_.c.name).label("name"),
        _raw(conn, c_.c.arguments).label("arguments"),
        _raw(conn, c_.c.state).label("state"),
        _raw(conn, a.c.model).label("model"),
        _raw(conn, a.c.created_at).label("created_at"),
        sa.null().label("content"),
        sa.null().label("content_parts"),
        _raw(conn, c_.c.reason).label("reason"),
    ).select_from(
        keys.join(
            c_,
            sa.and_(c_.c.attempt_id == keys.c.attempt_id, c_.c.position == keys.c.position),
        ).join(a, a.c.id == keys.c.attempt_id)
    )


def _history_keys(
    conn: Connection, f: _CallFilters, after: CallKey | None, limit: int
) -> sa.Select[Any]:
    t = _CALLS.alias("t")
    a = _MESSAGES.alias("m")
    conditions: list[sa.ColumnElement[bool]] = []
    source: sa.FromClause = t
    # the key columns: the call's, or its assistant message's (equal) when that message is read
    # first through an index of its own, so that the planner sees the page is in that order
    conversation, seq = t.c.conversation_id, t.c.assistant_seq
    if f.model is not None or f.since is not None or f.until is not None:
        source = t.join(
            a, sa.and_(a.c.conversation_id == t.c.conversation_id, a.c.seq == t.c.assistant_seq)
        )
        conditions.append(a.c.role == "assistant")  # what the partial indexes cover
        if f.model is not None:
            conditions.append(a.c.model == f.model)
        conditions += _time_filters(conn, a.c.created_at, f.since, f.until)
        if f.name is None and f.conversation is None:
            conversation, seq = a.c.conversation_id, a.c.seq
    if f.name is not None:
        conditions.append(t.c.name == f.name)
    if f.conversation is not None:
        conditions.append(t.c.conversation_id == f.conversation)
    for path, value in f.args:
        conditions.append(
            _arg_condition(conn, t.c.arguments, None, path, value, try_jsonb=f.try_jsonb)
        )
    if f.contains is not None:
        conditions.append(_contains(conn, t.c.arguments, f.contains))
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
    conn: Connection, f: _CallFilters, after: CallKey | None, limit: int
) -> sa.Select[Any]:
    c_ = _ATTEMPT_CALLS.alias("ac")
    a = _ATTEMPTS.alias("at")
    conditions: list[sa.ColumnElement[bool]] = []
    if f.name is not None:
        conditions.append(c_.c.name == f.name)
    if f.state is not None:
        conditions.append(c_.c.state == ToolCallState(f.state))
    if f.conversation is not None:
        conditions.append(a.c.conversation_id == f.conversation)
    if f.model is not None:
        conditions.append(a.c.model == f.model)
    conditions += _time_filters(conn, a.c.created_at, f.since, f.until)
    for path, value in f.args:
        conditions.append(
            _arg_condition(conn, c_.c.arguments, c_.c.state, path, value, try_jsonb=f.try_jsonb)
        )
    if f.contains is not None:
        conditions.append(_contains(conn, c_.c.arguments, f.contains))
    drive_from_attempts = f.name is None and f.state is None and not f.args and f.contains is None
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


# -- failures ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class FailureRow:
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

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureCount:
    """How many failed calls (and distinct attempts) share a model, a state and a reason."""

    model: str | None
    state: str
    reason: str | None
    calls: int
    attempts: int

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


def _failure_conditions(
    conn: Connection,
    c_: sa.FromClause,
    a: sa.FromClause,
    *,
    conversation: str | None,
    model: str | None,
    name: str | None,
    state: str | ToolCallState | None,
    reason: str | None,
    since: datetime | date | str | None,
    until: datetime | date | str | None,
) -> list[sa.ColumnElement[bool]]:
    wanted = _state(state)
    if wanted is not None and wanted not in _FAILED_STATES:
        raise InvalidFilterError(
            f"failed calls are {' or '.join(_FAILED_STATES)}, not {wanted!r} "
            "(list calls of any state with tool_calls())"
        )
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
    if conversation is not None:
        conditions.append(a.c.conversation_id == conversation)
    if model is not None:
        conditions.append(a.c.model == model)
    if name is not None:
        conditions.append(c_.c.name == name)
    if reason is not None:
        conditions.append(c_.c.reason == reason)
    conditions += _time_filters(conn, a.c.created_at, _utc(since, "since"), _utc(until, "until"))
    return conditions


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
    c_ = _ATTEMPT_CALLS.alias("ac")
    a = _ATTEMPTS.alias("at")
    with _connect(bind, snapshot=True) as conn:
        conditions = _failure_conditions(
            conn,
            c_,
            a,
            conversation=conversation,
            model=model,
            name=name,
            state=state,
            reason=reason,
            since=since,
            until=until,
        )
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
            .select_from(c_.join(a, a.c.id == c_.c.attempt_id))
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
    c_ = _ATTEMPT_CALLS.alias("ac")
    a = _ATTEMPTS.alias("at")
    with _connect(bind) as conn:
        conditions = _failure_conditions(
            conn,
            c_,
            a,
            conversation=conversation,
            model=model,
            name=name,
            state=state,
            reason=reason,
            since=since,
            until=until,
        )
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
            .select_from(c_.join(a, a.c.id == c_.c.attempt_id))
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


# -- statistics --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolStat:
    """Calls of one tool: in history, and failed (truncated / aborted) in attempts."""

    name: str
    calls: int
    failed: int

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStat:
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

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DayStat:
    """One UTC day: turns and calls of history, incomplete attempts, tokens."""

    day: str
    turns: int
    calls: int
    incomplete: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


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
    start, end = _utc(since, "since"), _utc(until, "until")
    m = _MESSAGES.alias("m")
    a = _ATTEMPTS.alias("at")
    t = _CALLS.alias("t")
    ac = _ATTEMPT_CALLS.alias("ac")
    with _connect(bind, snapshot=True) as conn:
        msg_where: list[sa.ColumnElement[bool]] = [m.c.role == "assistant"]
        att_where: list[sa.ColumnElement[bool]] = []
        if conversation is not None:
            msg_where.append(m.c.conversation_id == conversation)
            att_where.append(a.c.conversation_id == conversation)
        if model is not None:
            msg_where.append(m.c.model == model)
            att_where.append(a.c.model == model)
        msg_where += _time_filters(conn, m.c.created_at, start, end)
        att_where += _time_filters(conn, a.c.created_at, start, end)

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


# -- the integrity check -----------------------------------------------------------------------
#: Every kind of violation :func:`check` reports, with what it means.
VIOLATION_KINDS: Final[dict[str, str]] = {
    "seq_start": "a conversation's first message does not have seq 0 (rule 1)",
    "seq_gap": "seq numbers are missing between two messages (rule 1)",
    "seq_duplicate": "two messages of a conversation have the same seq (rule 1)",
    "invalid_row": "a row's own fields contradict each other or a check of the schema: an "
    "unknown role, tool calls on a non-assistant message, a tool result without its call's link, "
    "link fields on another role, both a text content and content parts, a call of an attempt "
    "with a negative position or an unknown state",
    "invalid_type": "a value of the wrong type for its column, which the schema's types check "
    "(SQLite: ck_<table>_types) refuses: text, a real or a blob in an integer column ('5x', 0.5, "
    "1e300), a boolean other than 0 and 1, a blob in a text column, invalid JSON in a JSON "
    "column; on either engine, NULL in a column the schema declares NOT NULL",
    "invalid_name": "a call in history whose name is empty or blank (only spaces, tabs, CR, LF): "
    "finished means a name (rule 4, ck_tool_calls_name)",
    "invalid_arguments": "a call in history whose arguments are neither blank nor valid JSON: "
    "finished means complete arguments (rule 4, ck_tool_calls_arguments)",
    "missing_content": "a system, developer, user or tool message without content (neither a "
    "text nor content parts; a tool result may be ''): ck_messages_content",
    "result_misplaced": "a tool result that is not in its call's slot "
    "(seq = assistant seq + 1 + position) (rule 2)",
    "duplicate_result": "a second tool result for a call whose slot holds its result (rule 2)",
    "interleaved": "a user, system or assistant message in the slot of a tool result, between "
    "an assistant message and the end of its results (rule 5)",
    "missing_result": "a tool call whose slot holds no result for it (rule 2)",
    "result_id_mismatch": "a tool result's tool_call_id differs from its call's id (rule 3)",
    "orphan_result": "a tool result for a call that does not exist (rules 2, 3)",
    "not_finished": "a call in history that is not in state finished (rule 4)",
    "call_count_mismatch": "an assistant message whose declared number of calls (n_calls) "
    "differs from its call rows (rule 2)",
    "orphan_call": "a tool call of a seq that is not an assistant message (rule 2)",
    "orphan_row": "messages or attempts of a conversation, or calls of an attempt, that does not "
    "exist",
    "duplicate_key": "rows that share a key the schema makes unique (a conversation's or an "
    "attempt's id, a call's position, an idempotency key), possible only once that key or its "
    "unique index is gone",
    "unenforced": "the database no longer enforces a rule of the schema (at head revision): a "
    "key, foreign key, check or unique index of the models is missing, NOT VALID, or its "
    "triggers are disabled (PostgreSQL ALTER TABLE ... DISABLE TRIGGER ALL); the rows were "
    "checked above, but later writes will not be refused",
    "bookkeeping": "the columns through which the database enforces the contract (prev_seq, "
    "prev_slots_left, slots_left, block_end_seq, assistant_n_calls, raw_arguments) disagree with "
    "the rows: later writes would not be checked right",
}


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: where (conversation, seq; ``None`` when not known), what, and details."""

    conversation_id: str | None
    seq: int | None
    kind: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(self)


# How the check covers the contract, per batch of conversations (a range of ids; RANGE(x) below
# restricts table alias x to it), with a few scans and lookups that only read indexes:
#
# * the row checks (_row_rules): every check of fsm/store/models.py that is about one row and
#   not about the history's structure, evaluated as the database evaluates it (a check passes
#   unless its expression is false): on SQLite each table's types check (so a text, real or blob
#   in an integer column is found, however the row got there), a finished call's name and
#   arguments, a message's content, an attempt call's position and state; on either engine a
#   NULL in a column the schema says NOT NULL when the database no longer refuses one.
# * _CHECK_SEQ: per conversation, count / min / max of seq over the primary key: dense from 0 iff
#   count = max + 1 and min = 0 (and count = distinct count when no key makes seq unique). Only
#   the conversations that fail are read again (_CHECK_SEQ_DETAIL, window functions) to say where.
# * _CHECK_MESSAGES: each message on its own (role, link fields, the slot formula of a result:
#   seq = assistant_seq + 1 + call_position, the enforcement columns); each result with the call
#   it names (exists, same id) and with its assistant message (its slots_left); each assistant
#   message with its calls (positions exactly 0 .. n_calls - 1).
# * _CHECK_CALLS: each call on its own (state, position below assistant_n_calls), with its
#   assistant message (exists, same n_calls) and with a result that names it.
# * duplicate keys, only where the database lost the key or unique index that keeps them out.
#
# Together: an assistant message with N calls has calls at positions 0 .. N-1, each has a
# result naming it with its id, and each result sits in its call's slot; as two messages cannot
# share a seq, the N slots after the assistant message hold exactly its results in call order
# and nothing else (rules 2, 3, 5). With dense seq (rule 1) and finished calls (rule 4) that is
# the whole contract. The enforcement columns are checked row by row and against the block
# (a result's slots_left = assistant seq + N - seq): with the structure right, that implies the
# foreign-key chain of prev_slots_left, so no pass over neighbouring rows is needed. Every
# foreign key of the schema is thereby re-verified by an anti-join, so PRAGMA foreign_keys=OFF
# (SQLite) and session_replication_role = replica (PostgreSQL) hide nothing.
#
# Values of the wrong type (SQLite with PRAGMA ignore_check_constraints=ON) are the row checks'
# finding; the structural scans compare with them without an error (SQLite compares any two
# values) and skip them in Python. SEQ_OK(m) keeps the grouped seq scan to integer seqs.
# BIG(x) widens an operand of arithmetic on PostgreSQL (int4 + int4 can overflow there when the
# checks are gone; SQLite's integers are 64-bit and overflow into reals, without an error).
_CHECK_SEQ = """
SELECT g.conversation_id, g.n, g.d, g.lo, g.hi, CASE WHEN c.id IS NULL THEN 1 ELSE 0 END
FROM (
  SELECT conversation_id, count(*) AS n, {distinct} AS d, min(seq) AS lo, max(seq) AS hi
  FROM messages m WHERE RANGE(m) AND SEQ_OK(m) GROUP BY conversation_id
) g LEFT JOIN conversations c ON c.id = g.conversation_id
WHERE g.n <> BIG(g.hi) + 1 OR g.lo <> 0 OR g.d <> g.n OR c.id IS NULL
"""

_CHECK_SEQ_DETAIL = """
SELECT conversation_id, seq, p_seq FROM (
  SELECT m.conversation_id, m.seq,
         lag(m.seq) OVER (PARTITION BY m.conversation_id ORDER BY m.seq) AS p_seq
  FROM messages m WHERE m.conversation_id IN :ids AND SEQ_OK(m)
) x
WHERE (p_seq IS NULL AND seq <> 0) OR seq = p_seq OR seq > BIG(p_seq) + 1
"""

# ``t`` and ``a`` are the checks (lookups that read only a unique index: the call with the
# result's link *and id*, the assistant message with the result's link *and* the n_calls its
# slots_left implies); the failing rows are set apart first (MATERIALIZED: on both engines the
# joins that describe them then run for those rows only). COUNT_CHECK(m) is true when an
# assistant message's call rows do not number its n_calls (see _COUNT_CHECKS).
_CHECK_MESSAGES = """
WITH bad AS MATERIALIZED (
  SELECT m.conversation_id, m.seq, m.role, m.n_calls, m.slots_left, m.prev_seq,
         m.prev_slots_left, m.tool_call_id, m.assistant_seq, m.call_position, m.block_end_seq
  FROM messages m
  LEFT JOIN tool_calls t
    ON t.conversation_id = m.conversation_id AND t.assistant_seq = m.assistant_seq
       AND t.position = m.call_position AND t.call_id = m.tool_call_id
       AND t.assistant_n_calls = BIG(m.slots_left) + m.call_position + 1 AND RANGE(t)
  COUNT_JOIN
  WHERE RANGE(m) AND (
    -- each role's own rules (one branch per row)
    CASE m.role
      WHEN 'tool' THEN CASE
        WHEN m.tool_call_id IS NULL
          OR COALESCE(BIG(m.assistant_seq) + 1 + m.call_position, -1) <> m.seq
          OR m.n_calls <> 0 OR m.block_end_seq IS NOT NULL
          OR COALESCE(m.prev_slots_left, 0) <= 0 OR m.slots_left <> BIG(m.prev_slots_left) - 1
          OR t.conversation_id IS NULL
        THEN 1 ELSE 0 END
      WHEN 'assistant' THEN CASE
        WHEN m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls < 0 OR m.slots_left <> m.n_calls
          OR COALESCE(m.block_end_seq, -1)
             <> CASE WHEN m.n_calls > 0 THEN BIG(m.seq) + m.n_calls ELSE -1 END
          OR COALESCE(m.prev_slots_left, 0) <> 0
          OR (m.n_calls > 0 AND COUNT_CHECK(m))
        THEN 1 ELSE 0 END
      ELSE CASE
        WHEN m.role NOT IN ('system', 'developer', 'user')
          OR m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls <> 0 OR m.slots_left <> 0
          OR m.block_end_seq IS NOT NULL OR COALESCE(m.prev_slots_left, 0) <> 0
        THEN 1 ELSE 0 END
    END = 1
    -- every role: the link to the previous row
    OR COALESCE(m.prev_seq, -1) <> BIG(m.seq) - 1
    OR (CASE WHEN m.prev_slots_left IS NULL THEN 0 ELSE 1 END)
       <> (CASE WHEN m.seq = 0 THEN 0 ELSE 1 END)
  )
)
SELECT bad.*,
       (SELECT t2.call_id FROM tool_calls t2
        WHERE t2.conversation_id = bad.conversation_id AND t2.assistant_seq = bad.assistant_seq
          AND t2.position = bad.call_position),
       (SELECT t2.assistant_n_calls FROM tool_calls t2
        WHERE t2.conversation_id = bad.conversation_id AND t2.assistant_seq = bad.assistant_seq
          AND t2.position = bad.call_position),
       (SELECT a2.role FROM messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT count(*) FROM tool_calls c
        WHERE c.conversation_id = bad.conversation_id AND c.assistant_seq = bad.seq),
       (SELECT s.role FROM messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position),
       (SELECT s.assistant_seq FROM messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position),
       (SELECT s.call_position FROM messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position)
FROM bad
"""

#: per engine: how _CHECK_MESSAGES counts an assistant message's calls. SQLite reads the
#: primary key's range of each assistant message (a nested loop is all it has); PostgreSQL
#: hash-joins the batch's counts.
_COUNT_CHECKS = {
    "sqlite": (
        "",
        "m.n_calls <> (SELECT count(*) FROM tool_calls c "
        "WHERE c.conversation_id = m.conversation_id AND c.assistant_seq = m.seq)",
    ),
    "postgresql": (
        "LEFT JOIN (SELECT c.conversation_id, c.assistant_seq, count(*) AS n FROM tool_calls c "
        "WHERE RANGE(c) GROUP BY c.conversation_id, c.assistant_seq) g "
        "ON g.conversation_id = m.conversation_id AND g.assistant_seq = m.seq",
        "m.n_calls <> COALESCE(g.n, 0)",
    ),
}

_CHECK_CALLS = """
WITH bad AS MATERIALIZED (
  SELECT t.conversation_id, t.assistant_seq, t.position, t.call_id, t.name, t.state,
         t.assistant_n_calls, t.repaired, CASE WHEN t.raw_arguments IS NULL THEN 1 ELSE 0 END
         AS no_raw, CASE WHEN r.conversation_id IS NULL THEN 0 ELSE 1 END AS has_result
  FROM tool_calls t
  LEFT JOIN (
    SELECT a.conversation_id, a.seq, a.n_calls FROM messages a WHERE a.n_calls > 0 AND RANGE(a)
  ) a
    ON a.conversation_id = t.conversation_id AND a.seq = t.assistant_seq
       AND a.n_calls = t.assistant_n_calls
  LEFT JOIN messages r
    ON r.conversation_id = t.conversation_id AND r.assistant_seq = t.assistant_seq
       AND r.call_position = t.position AND RANGE(r)
  WHERE RANGE(t) AND (
       a.conversation_id IS NULL OR r.conversation_id IS NULL OR t.state <> 'finished'
    OR t.position < 0 OR t.position >= t.assistant_n_calls
    OR (t.repaired AND t.raw_arguments IS NULL)
    OR (NOT t.repaired AND t.raw_arguments IS NOT NULL)
  )
)
SELECT bad.*,
       (SELECT a2.role FROM messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT a2.n_calls FROM messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT s.role FROM messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.position)
FROM bad
"""

_ORPHAN_ATTEMPTS = """
SELECT x.conversation_id, x.n FROM (
  SELECT conversation_id, count(*) AS n FROM attempts a WHERE RANGE(a) GROUP BY conversation_id
) x WHERE NOT EXISTS (SELECT 1 FROM conversations c WHERE c.id = x.conversation_id)
"""

_ORPHAN_ATTEMPT_CALLS = """
SELECT ac.attempt_id, count(*) FROM attempt_calls ac
WHERE NOT EXISTS (SELECT 1 FROM attempts a WHERE a.id = ac.attempt_id)
GROUP BY ac.attempt_id ORDER BY ac.attempt_id
"""


_RANGE = re.compile(r"RANGE\((\w+)(?:\.(\w+))?\)")
_BIG = re.compile(r"BIG\(([\w.]+)\)")
_SEQ_OK = re.compile(r"SEQ_OK\((\w+)\)")


def _ranged(sql: str, lo: str | None, hi: str | None) -> str:
    """``sql`` with each ``RANGE(alias)`` (or ``RANGE(alias.column)``) replaced by the batch's
    bounds on that alias's conversation id (or that column)."""

    def bounds(match: re.Match[str]) -> str:
        column = f"{match.group(1)}.{match.group(2) or 'conversation_id'}"
        parts = []
        if lo is not None:
            parts.append(f"{column} >= :lo")
        if hi is not None:
            parts.append(f"{column} < :hi")
        return " AND ".join(parts) or "1 = 1"

    return _RANGE.sub(bounds, sql)


def _engine_sql(sql: str, dialect: str) -> str:
    """``sql`` with the engine's ``BIG(x)`` and ``SEQ_OK(alias)``."""
    if dialect == "postgresql":
        sql = _BIG.sub(r"CAST(\1 AS BIGINT)", sql)
        return _SEQ_OK.sub(r"\1.seq IS NOT NULL", sql)
    sql = _BIG.sub(r"\1", sql)
    return _SEQ_OK.sub(r"typeof(\1.seq) = 'integer' AND typeof(\1.conversation_id) = 'text'", sql)


# -- the row checks ------------------------------------------------------------------------------
#: The checks of the models that the structural scans verify (with more precise kinds), by table.
_STRUCTURAL_CHECKS: Final = frozenset(
    {
        "ck_messages_seq",
        "ck_messages_role",
        "ck_messages_n_calls",
        "ck_messages_slots_left",
        "ck_messages_prev",
        "ck_messages_result_slot",
        "ck_messages_block_end",
        "ck_tool_calls_position",
        "ck_tool_calls_finished",
        "ck_tool_calls_tool_call_state",
        "ck_tool_calls_repaired",
    }
)

#: The kind of violation of every other check (a check added to the models later is verified
#: as ``invalid_row`` until it gets a kind of its own).
_CHECK_KINDS: Final = {
    "ck_conversations_types": "invalid_type",
    "ck_messages_types": "invalid_type",
    "ck_tool_calls_types": "invalid_type",
    "ck_attempts_types": "invalid_type",
    "ck_attempt_calls_types": "invalid_type",
    "ck_tool_calls_name": "invalid_name",
    "ck_tool_calls_arguments": "invalid_arguments",
    "ck_messages_content": "missing_content",
}

#: Per table: the columns that say where a row is (and what it is about), read raw.
_ROW_IDENTITY: Final = {
    "conversations": "conversations.id, NULL, NULL, NULL",
    "messages": "messages.conversation_id, messages.seq, messages.role, NULL",
    "tool_calls": "tool_calls.conversation_id, tool_calls.assistant_seq, tool_calls.position, "
    "tool_calls.call_id",
    "attempts": "attempts.conversation_id, attempts.id, attempts.at_seq, NULL",
    "attempt_calls": "(SELECT a.conversation_id FROM attempts a "
    "WHERE a.id = attempt_calls.attempt_id), attempt_calls.attempt_id, attempt_calls.position, "
    "attempt_calls.call_id",
}
_TABLES: Final = ("conversations", "messages", "tool_calls", "attempts", "attempt_calls")


@dataclass(frozen=True, slots=True)
class _Rule:
    """A check of one row: ``sql`` is false for a row that breaks it (true or NULL passes)."""

    name: str
    kind: str
    sql: str


@dataclass(frozen=True, slots=True)
class _Shape:
    """What one check run needs to know about the database it reads."""

    dialect: str
    #: messages has its primary key (conversation_id, seq): two rows cannot share a seq
    unique_seq: bool
    #: the row checks to evaluate, per table
    rules: dict[str, tuple[_Rule, ...]]
    #: (table, key columns, condition): unique keys whose key or index the database lost
    lost_keys: tuple[tuple[str, tuple[str, ...], str | None], ...]
    #: the columns of each table in the database
    columns: dict[str, frozenset[str]]


def _shape(conn: Connection) -> _Shape:
    dialect = conn.dialect.name
    inspector = sa.inspect(conn)
    pk = inspector.get_pk_constraint("messages")
    unique_seq = pk.get("constrained_columns") == ["conversation_id", "seq"]
    lost: list[tuple[str, tuple[str, ...], str | None]] = []
    for table in ("conversations", "tool_calls", "attempts", "attempt_calls"):
        columns = tuple(c.name for c in _TABLE[table].primary_key.columns)
        if tuple(inspector.get_pk_constraint(table).get("constrained_columns") or ()) != columns:
            lost.append((table, columns, None))
    indexes = {i["name"] for i in inspector.get_indexes("messages")}
    if "ix_messages_conversation_id_idempotency_key" not in indexes:
        lost.append(
            ("messages", ("conversation_id", "idempotency_key"), "idempotency_key IS NOT NULL")
        )
    enforced: set[str] = set()
    functions = {"fsm_json_valid": True}
    nullable: dict[str, set[str]] = {}
    if dialect == "postgresql":
        # a check PostgreSQL holds (present and validated) no session can have bypassed: only a
        # dropped or NOT VALID one needs its rows read
        enforced = set(
            conn.execute(
                sa.text(
                    "SELECT conname FROM pg_constraint WHERE contype = 'c' AND convalidated "
                    "AND conrelid = ANY(CAST(:tables AS regclass[]))"
                ),
                {"tables": list(_TABLES)},
            ).scalars()
        )
        functions["fsm_json_valid"] = _pg_function(conn, "fsm_json_valid(text)")
    reflected = {table: inspector.get_columns(table) for table in _TABLES}
    if dialect == "postgresql":
        # a NOT NULL dropped lets NULLs in (SQLite cannot drop one without rebuilding the table)
        nullable = {t: {c["name"] for c in cols if c["nullable"]} for t, cols in reflected.items()}
    present_columns = {t: frozenset(c["name"] for c in cols) for t, cols in reflected.items()}
    rules: dict[str, tuple[_Rule, ...]] = {}
    for table in _TABLES:
        # the columns the database has (a store at an older revision lacks the newer ones)
        present = present_columns[table]
        found = [
            rule
            for rule in _model_rules(_TABLE[table], dialect)
            if rule.name not in enforced
            and not rule.name.endswith("_types")
            and not any(f"{f}(" in rule.sql and not ok for f, ok in functions.items())
        ]
        if dialect == "sqlite":
            # the types check, term by term (the same terms, of the columns there are)
            terms = [ok for column, ok in _sqlite_type_terms(_TABLE[table]) if column in present]
            found.insert(0, _Rule(f"ck_{table}_types", "invalid_type", " AND ".join(terms)))
        for column in _TABLE[table].columns:
            if not column.nullable and column.name in nullable.get(table, ()):
                found.append(
                    _Rule(
                        f"{table}.{column.name} NOT NULL",
                        "invalid_type",
                        f"{column.name} IS NOT NULL",
                    )
                )
        rules[table] = tuple(found)
    return _Shape(
        dialect=dialect,
        unique_seq=unique_seq,
        rules=rules,
        lost_keys=tuple(lost),
        columns=present_columns,
    )


_TABLE: Final = {t.name: t for t in (_CONVERSATIONS, _MESSAGES, _CALLS, _ATTEMPTS, _ATTEMPT_CALLS)}


def _model_rules(table: sa.Table, dialect: str) -> Iterator[_Rule]:
    """The checks of ``table`` in the models that apply to ``dialect``, except the structural ones,
    as row checks."""
    compiler_dialect = _DIALECTS[dialect]
    for constraint in table.constraints:
        if not isinstance(constraint, sa.CheckConstraint) or not isinstance(constraint.name, str):
            continue
        name = str(constraint.name)
        only = getattr(getattr(constraint, "_ddl_if", None), "dialect", None)
        if name in _STRUCTURAL_CHECKS or (only is not None and only != dialect):
            continue
        text = str(
            constraint.sqltext.compile(
                dialect=compiler_dialect, compile_kwargs={"literal_binds": True}
            )
        )
        yield _Rule(name, _CHECK_KINDS.get(name, "invalid_row"), text)


_DIALECTS: Final[dict[str, Any]] = {
    "sqlite": sqlite_dialect.dialect(),
    "postgresql": pg.dialect(),  # type: ignore[no-untyped-call]
}


def _sqlite_type_terms(table: sa.Table) -> list[tuple[str, str]]:
    """(column, SQL that is true when its value has the column's type) for a SQLite table, the
    terms of its types check (:func:`fsm.store.models.sqlite_types_check`)."""
    terms = []
    for column in table.columns:
        name = column.name
        if isinstance(column.type, sa.Boolean):
            ok = f"(typeof({name}) = 'integer' AND {name} IN (0, 1))"
        elif isinstance(column.type, sa.Integer):
            ok = f"typeof({name}) = 'integer'"
        elif isinstance(column.type, sa.JSON):
            ok = f"(typeof({name}) = 'text' AND json_valid({name}))"
        else:
            ok = f"typeof({name}) = 'text'"
        if column.nullable:
            ok = f"({name} IS NULL OR {ok})"
        terms.append((name, ok))
    return terms


def _row_check_sql(table: str, rules: Sequence[_Rule], shape: _Shape, *, ranged: bool) -> str:
    """One scan of ``table`` that picks the rows breaking any of ``rules``: the row's identity,
    one flag per rule (1: broken), and on SQLite which columns have the wrong type."""
    # a check passes unless its expression is false (NULL passes): NOT (x) is true only then.
    # Conditions only (WHERE, CASE WHEN), never values: SQLite then evaluates AND and OR
    # lazily (as a value, both sides of each are computed: several times slower)
    flags = [f"CASE WHEN NOT ({r.sql}) THEN 1 ELSE 0 END" for r in rules]
    detail = "NULL"
    if shape.dialect == "sqlite":
        parts = [
            f"CASE WHEN {ok} THEN '' ELSE '{column} is ' || typeof({column}) || ' ' || "
            f"substr(quote({column}), 1, 40) || '; ' END"
            for column, ok in _sqlite_type_terms(_TABLE[table])
            if column in shape.columns[table]
        ]
        detail = "rtrim(" + " || ".join(parts) + ", '; ')"
    where = " AND ".join(f"({r.sql})" for r in rules)
    scope = f"RANGE({table}.{'id' if table == 'conversations' else 'conversation_id'})"
    return (
        f"SELECT {_ROW_IDENTITY[table]}, {detail}, {', '.join(flags)} FROM {table} "
        f"WHERE {scope if ranged else '1 = 1'} AND NOT ({where})"
    )


def _row_violations(table: str, rules: Sequence[_Rule], row: Any) -> Iterator[Violation]:
    cid, a, b, c, detail, *flags = row
    conversation = _opt_text(cid)
    seq: int | None = None
    if table == "conversations":
        where = f"conversation {conversation!r}"
    elif table == "messages":
        seq = _int(a)
        where = f"the {_text(b)} message at seq {_shown(a)}"
    elif table == "tool_calls":
        seq = _int(a)
        where = f"call {_shown(b)} (id {_shown(c, text=True)}) of the message at seq {_shown(a)}"
    elif table == "attempts":
        where = f"attempt {_shown(a)} (at seq {_shown(b)})"
    else:
        where = f"call {_shown(b)} (id {_shown(c, text=True)}) of attempt {_shown(a)}"
    for rule, broken in zip(rules, flags, strict=True):
        if not broken:
            continue
        text = _RULE_TEXT.get(rule.kind, f"breaks the check {rule.name}")
        if rule.kind == "invalid_type" and rule.name.endswith("NOT NULL"):
            text = f"{rule.name.split('.', 1)[1].split()[0]} is NULL (the column is NOT NULL)"
        elif rule.kind == "invalid_type" and detail:
            text = f"wrong type: {_text(detail)}"
        elif rule.name == "ck_messages_one_content":
            text = "has both a text content and content parts"
        elif rule.name == "ck_attempt_calls_position":
            text = "has a negative position"
        elif rule.name == "ck_attempt_calls_tool_call_state":
            text = "has an unknown state"
        yield Violation(conversation, seq, rule.kind, f"{where} {text} ({rule.name})")


_RULE_TEXT: Final = {
    "invalid_type": "holds a value of the wrong type",
    "invalid_name": "is finished with an empty or blank name",
    "invalid_arguments": "is finished with arguments that are neither blank nor valid JSON",
    "missing_content": "has no content",
}


def _shown(value: Any, *, text: bool = False) -> str:
    """A raw value for a detail: an integer as it is, text quoted, anything else with its type."""
    if type(value) is int and not text:
        return str(value)
    if isinstance(value, str):
        return repr(_text(value))
    if value is None:
        return "NULL"
    return f"{_text(value)!r} ({type(value).__name__})"


def _duplicates_sql(
    table: str, columns: Sequence[str], condition: str | None, *, ranged: bool
) -> str:
    cols = ", ".join(columns)
    where = [condition or "1 = 1"]
    if ranged:
        where.append(f"RANGE({table}.{'id' if table == 'conversations' else 'conversation_id'})")
    return (
        f"SELECT {cols}, count(*) FROM {table} WHERE {' AND '.join(where)} "
        f"GROUP BY {cols} HAVING count(*) > 1"
    )


def _duplicate_violations(table: str, columns: Sequence[str], row: Any) -> Violation:
    *key, n = row
    values = ", ".join(f"{c} {_shown(v)}" for c, v in zip(columns, key, strict=True))
    conversation = (
        _opt_text(key[0]) if table in ("conversations", "messages", "tool_calls") else None
    )
    seq = _int(key[1]) if table == "tool_calls" else None
    return Violation(
        conversation,
        seq,
        "duplicate_key",
        f"{n} {table} rows share the key ({values}), which the schema makes unique",
    )


# -- running the check ---------------------------------------------------------------------------
def check(
    bind: Bind,
    *,
    progress: Progress | None = None,
    batch_size: int = 10_000,
    workers: int | None = None,
) -> Iterator[Violation]:
    """Re-verify the history contract over the whole store; yield every violation found.

    The rules of ``spec/store.md`` ("The contract" 1-5), and every rule the database enforces:
    seq dense from 0, every assistant message with N calls followed by exactly its N results
    each in its slot, each result's ``tool_call_id`` equal to its call's id, only finished calls
    (with a name, and arguments blank or valid JSON), nothing between an assistant message and
    its results, content where the OpenAI format needs it, the enforcement columns consistent,
    every foreign key, unique key and check of the schema, and the types of every column (on
    SQLite, whose type affinity lets ``'5x'``, ``0.5`` or ``1e300`` into an INTEGER column when
    its types check is ignored). Each kind is in :data:`VIOLATION_KINDS`.

    A store written through fsm has none: they come only from writes made with the database's
    enforcement switched off, which are *not* checked when they happen: SQLite ``PRAGMA
    foreign_keys=OFF`` (every foreign key) or ``PRAGMA ignore_check_constraints=ON`` (every check,
    types included), PostgreSQL ``SET session_replication_role = replica`` or ``ALTER TABLE ...
    DISABLE TRIGGER ALL`` (foreign keys), constraints dropped or added back ``NOT VALID``, a
    broken migration. Any value such a session stored is read without an error: the check
    reports it, never crashes on it and never calls such a store clean.

    The work is set-based: per batch of ``batch_size`` conversations (a range of ids), a scan of
    each table for its row checks, a grouped scan of the seq numbers, one scan of the messages
    and one of the calls, joined to each other through indexes (no query per conversation). On
    PostgreSQL a check the database holds (present and validated) is not read again: no session
    can bypass it. Each batch runs in one read transaction, so it sees one snapshot; every rule
    is about one conversation, and a conversation is checked whole within one batch, so writers
    committing meanwhile cannot cause false violations.

    Given an engine, ``workers`` batches run at once on their own connections (default 2: the
    database does the work, in parallel); given a connection, the batches run one after the
    other on it, inside the caller's transaction. Violations come in batch order, sorted by
    conversation and seq within a batch; ``progress(done, total)`` is called after each batch,
    in conversations.
    """
    if batch_size < 1:
        raise InvalidFilterError("batch_size must be at least 1")
    if workers is not None and workers < 1:
        raise InvalidFilterError("workers must be at least 1")
    with _connect(bind, snapshot=True) as conn:
        total = int(conn.execute(sa.text("SELECT count(*) FROM conversations")).scalar_one())
        # batches are ranges of text ids (an id of another type, which only raw SQL on SQLite
        # can store, sorts after every text: it falls in the last batch)
        text_ids = "typeof(id) = 'text'" if conn.dialect.name == "sqlite" else "1 = 1"
        bounds = [
            str(b)
            for b in conn.execute(
                sa.text(
                    "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n "
                    f"FROM conversations WHERE {text_ids}) x "
                    "WHERE n > 1 AND (n - 1) % :size = 0 ORDER BY id"
                ),
                {"size": batch_size},
            ).scalars()
        ]
        shape = _shape(conn)
        edges: list[str | None] = [None, *bounds, None]
        ranges = list(itertools.pairwise(edges))
        if progress is not None:
            progress(0, total)
        tables = [t for t in _TABLES if shape.rules[t]]
        if isinstance(bind, Connection) or (workers or 2) == 1 or len(ranges) + len(tables) == 1:
            batches: Iterator[list[Violation]] = (
                _check_batch(conn, lo, hi, shape, own=False) for lo, hi in ranges
            )
            yield from _with_progress(batches, progress, batch_size, total)
            for table in tables:
                yield from _row_checks(conn, shape, table)
        else:
            engine = bind

            def run(bounds: tuple[str | None, str | None]) -> list[Violation]:
                with _connect(engine, snapshot=True) as worker:
                    return _check_batch(worker, *bounds, shape, own=True)

            def rows(table: str) -> list[Violation]:
                with _connect(engine) as worker:
                    return _row_checks(worker, shape, table)

            with ThreadPoolExecutor(workers or 2, thread_name_prefix="fsm-check") as pool:
                try:
                    # the whole-table row checks first: the biggest one runs beside the batches
                    row_results = [pool.submit(rows, table) for table in tables]
                    yield from _with_progress(pool.map(run, ranges), progress, batch_size, total)
                    for result in row_results:
                        yield from result.result()
                finally:
                    pool.shutdown(cancel_futures=True)
        yield from _check_global(conn, shape)


def _row_checks(conn: Connection, shape: _Shape, table: str) -> list[Violation]:
    """The row checks of ``table``, over the whole table (each is about one row), sorted.

    (Not ``PRAGMA quick_check``, although it evaluates the checks faster: it skips them, and
    says "ok", on a connection that ignores checks and on a read-only one, as audits are.)
    """
    rules = shape.rules[table]
    if not rules:
        return []
    sql = _row_check_sql(table, rules, shape, ranged=False)
    rows = conn.execute(sa.text(sql)).all()
    found = [v for row in rows for v in _row_violations(table, rules, row)]
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_global(conn: Connection, shape: _Shape) -> Iterator[Violation]:
    """The checks that are not ranged by conversation: the calls of attempts (they have no
    conversation id of their own), keys that span conversations, and the schema's enforcement
    itself."""
    found: list[Violation] = list(_unenforced(conn))
    for attempt_id, n in conn.execute(sa.text(_ORPHAN_ATTEMPT_CALLS)):
        found.append(
            Violation(
                None,
                None,
                "orphan_row",
                f"{n} attempt_calls row(s) of attempt {_shown(attempt_id)}, which does not exist",
            )
        )
    for table, columns, condition in shape.lost_keys:
        if table in ("attempts", "attempt_calls"):
            sql = _duplicates_sql(table, columns, condition, ranged=False)
            for row in conn.execute(sa.text(sql)):
                found.append(_duplicate_violations(table, columns, row))
    yield from found


_CONSTRAINT_KINDS: Final = (
    (sa.PrimaryKeyConstraint, "primary key"),
    (sa.ForeignKeyConstraint, "foreign key"),
    (sa.UniqueConstraint, "unique key"),
    (sa.CheckConstraint, "check"),
)


def _unenforced(conn: Connection) -> Iterator[Violation]:
    """What the database no longer enforces of the models' schema: a key, foreign key, check or
    unique index missing (dropped, or a table rebuilt without it), NOT VALID, or with its
    triggers disabled (PostgreSQL). Only at head: an older revision lacks newer rules by design
    (``fsm db upgrade`` adds them)."""
    if MigrationContext.configure(conn).get_current_heads() != (head_revision(),):
        return
    dialect = conn.dialect.name
    expected: dict[str, tuple[str, str]] = {}
    for table in _TABLES:
        for constraint in _TABLE[table].constraints:
            only = getattr(getattr(constraint, "_ddl_if", None), "dialect", None)
            if not isinstance(constraint.name, str) or (only is not None and only != dialect):
                continue
            what = next(w for cls, w in _CONSTRAINT_KINDS if isinstance(constraint, cls))
            expected[str(constraint.name)] = (table, what)
        for index in _TABLE[table].indexes:
            if index.unique and isinstance(index.name, str):
                expected[str(index.name)] = (table, "unique index")
    present: dict[str, bool] = {}  # name -> validated
    disabled: list[tuple[str, int]] = []
    if dialect == "postgresql":
        tables = {"tables": list(_TABLES)}
        present = dict(
            conn.execute(
                sa.text(
                    "SELECT conname, convalidated FROM pg_constraint "
                    "WHERE conrelid = ANY(CAST(:tables AS regclass[])) "
                    "UNION ALL SELECT c.relname, i.indisvalid FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE i.indrelid = ANY(CAST(:tables AS regclass[])) AND i.indisunique"
                ),
                tables,
            ).all()
        )
        disabled = [
            (str(t), int(n))
            for t, n in conn.execute(
                sa.text(
                    "SELECT tgrelid::regclass::text, count(*) FROM pg_trigger "
                    "WHERE tgrelid = ANY(CAST(:tables AS regclass[])) AND tgenabled = 'D' "
                    "GROUP BY 1 ORDER BY 1"
                ),
                tables,
            )
        ]
    else:
        for kind, name, sql in conn.exec_driver_sql(
            "SELECT type, name, sql FROM sqlite_master WHERE type IN ('table', 'index')"
        ):
            present[str(name)] = True
            if kind == "table":
                for found in re.findall(r'CONSTRAINT\s+"?(\w+)"?', str(sql or "")):
                    present[found] = True
    for name, (table, what) in expected.items():
        if name not in present:
            yield Violation(
                None,
                None,
                "unenforced",
                f"the {what} {name} of {table} is missing: the database does not refuse what "
                "it rules out",
            )
        elif not present[name]:
            yield Violation(
                None,
                None,
                "unenforced",
                f"the {what} {name} of {table} is NOT VALID: rows written before it was added "
                "back were never checked against it (VALIDATE CONSTRAINT once they are fixed)",
            )
    for table, n in disabled:
        yield Violation(
            None,
            None,
            "unenforced",
            f"{n} trigger(s) of {table} are disabled (its foreign keys are not checked): "
            f"ALTER TABLE {table} ENABLE TRIGGER ALL",
        )


def _with_progress(
    batches: Iterator[list[Violation]], progress: Progress | None, size: int, total: int
) -> Iterator[Violation]:
    for i, found in enumerate(batches):
        yield from found
        if progress is not None:
            progress(min(total, (i + 1) * size), total)


def _check_batch(
    conn: Connection, lo: str | None, hi: str | None, shape: _Shape, *, own: bool
) -> list[Violation]:
    """The violations of the conversations in [lo, hi), sorted by conversation and seq."""
    if own and conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))
    found = list(_check_range(conn, lo, hi, shape))
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_range(
    conn: Connection, lo: str | None, hi: str | None, shape: _Shape
) -> Iterator[Violation]:
    params = {k: v for k, v in (("lo", lo), ("hi", hi)) if v is not None}
    # two rows with one seq need the primary key gone: count distinct values only then
    distinct = "count(*)" if shape.unique_seq else "count(DISTINCT seq)"
    dialect = shape.dialect
    join, count_check = _COUNT_CHECKS.get(dialect, _COUNT_CHECKS["postgresql"])

    def run(sql: str) -> Iterable[Any]:
        sql = sql.replace("COUNT_JOIN", join).replace("COUNT_CHECK(m)", f"({count_check})")
        sql = _engine_sql(sql.replace("{distinct}", distinct), dialect)
        return conn.execute(sa.text(_ranged(sql, lo, hi)), params)

    unordered: list[str] = []
    for cid, n, n_distinct, first, last, orphan in run(_CHECK_SEQ):
        if orphan:
            yield Violation(
                _text(cid),
                None,
                "orphan_row",
                f"{n} message(s) of conversation {_text(cid)!r}, which does not exist",
            )
        if n != last + 1 or first != 0 or n_distinct != n:
            unordered.append(cid)
    for start in range(0, len(unordered), 500):
        ids = unordered[start : start + 500]
        detail = sa.text(_engine_sql(_CHECK_SEQ_DETAIL, dialect)).bindparams(
            sa.bindparam("ids", expanding=True)
        )
        for cid, seq, p_seq in conn.execute(detail, {"ids": ids}):
            cid = _text(cid)
            if p_seq is None:
                yield Violation(cid, seq, "seq_start", f"the first message has seq {seq}, not 0")
            elif seq == p_seq:
                yield Violation(cid, seq, "seq_duplicate", f"two messages have seq {seq}")
            else:
                missing = f"{p_seq + 1}" if seq == p_seq + 2 else f"{p_seq + 1}..{seq - 1}"
                yield Violation(
                    cid,
                    seq,
                    "seq_gap",
                    f"seq {missing} missing (the message before is at seq {p_seq})",
                )
    for row in run(_CHECK_MESSAGES):
        yield from _message_violations(row)
    for row in run(_CHECK_CALLS):
        yield from _call_violations(row)
    for cid, n in run(_ORPHAN_ATTEMPTS):
        yield Violation(
            _text(cid),
            None,
            "orphan_row",
            f"{n} attempt(s) of conversation {_text(cid)!r}, which does not exist",
        )
    for table, columns, condition in shape.lost_keys:
        if table not in ("attempts", "attempt_calls"):
            for row in run(_duplicates_sql(table, columns, condition, ranged=True)):
                yield _duplicate_violations(table, columns, row)


_ROLES: Final = ("system", "developer", "user", "assistant", "tool")


def _typed(*values: Any, nullable: Sequence[Any] = ()) -> bool:
    """Whether ``values`` are integers and ``nullable`` integers or NULL (on SQLite, a row with a
    value of another type is the types check's finding, and the structural rules skip it)."""
    return all(type(v) is int for v in values) and all(
        v is None or type(v) is int for v in nullable
    )


def _message_violations(row: Any) -> Iterator[Violation]:
    """The violations of one message row of _CHECK_MESSAGES (the SQL only picked it)."""
    (cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos, block_end,
     real_id, call_n, a_role, calls, s_role, s_aseq, s_pos) = row  # fmt: skip
    if not (
        isinstance(cid, str)
        and isinstance(role, str)
        and (call_id is None or isinstance(call_id, str))
        and _typed(seq, n_calls, slots_left, nullable=(prev_seq, prev_slots, aseq, pos, block_end))
    ):
        return
    found = list(
        _message_findings(
            cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos,
            block_end, real_id if isinstance(real_id, str) else None, _int(call_n),
            _opt_text(a_role), _int(calls) or 0, _opt_text(s_role), _int(s_aseq), _int(s_pos),
        )
    )  # fmt: skip
    if not found:  # the SQL picked it for a reason the findings do not name: never call it clean
        found.append(
            Violation(
                _text(cid),
                seq,
                "invalid_row",
                f"the {role} message at seq {seq} breaks a rule of the schema (n_calls {n_calls}, "
                f"slots_left {slots_left}, prev_seq {prev_seq}, prev_slots_left {prev_slots}, "
                f"tool_call_id {_opt_text(call_id)!r}, assistant_seq {aseq}, call_position {pos}, "
                f"block_end_seq {block_end})",
            )
        )
    yield from found


def _message_findings(
    cid: str,
    seq: int,
    role: str,
    n_calls: int,
    slots_left: int,
    prev_seq: int | None,
    prev_slots: int | None,
    call_id: str | None,
    aseq: int | None,
    pos: int | None,
    block_end: int | None,
    real_id: str | None,
    call_n: int | None,
    a_role: str | None,
    calls: int,
    s_role: str | None,
    s_aseq: int | None,
    s_pos: int | None,
) -> Iterator[Violation]:
    shown_id = _opt_text(call_id)
    conversation = _text(cid)
    tool = role == "tool"
    linked = aseq is not None and pos is not None
    if (
        role not in _ROLES
        or n_calls < 0
        or (role != "assistant" and n_calls != 0)
        or (tool and (call_id is None or not linked))
        or (not tool and (call_id is not None or aseq is not None or pos is not None))
    ):
        yield Violation(
            conversation,
            seq,
            "invalid_row",
            _invalid_row_detail(role, n_calls, shown_id, aseq, pos),
        )
    misplaced = tool and aseq is not None and pos is not None and seq != aseq + 1 + pos
    if misplaced and aseq is not None and pos is not None:
        slot = aseq + 1 + pos
        if s_role == "tool" and (s_aseq, s_pos) == (aseq, pos):
            yield Violation(
                conversation,
                seq,
                "duplicate_result",
                f"a second result (tool_call_id {shown_id!r}) for call {pos} of the assistant "
                f"message at seq {aseq}, whose slot (seq {slot}) holds its result",
            )
        else:
            yield Violation(
                conversation,
                seq,
                "result_misplaced",
                f"the result of call {pos} of the assistant message at seq {aseq} (tool_call_id "
                f"{shown_id!r}) is at seq {seq}, not in its slot (seq {slot})",
            )
    if tool and linked and (real_id is None or a_role != "assistant"):
        what = (
            "which does not exist"
            if real_id is None
            else "whose seq is missing"
            if a_role is None
            else f"whose seq is a {a_role} message"
        )
        yield Violation(
            conversation,
            seq,
            "orphan_result",
            f"the tool result at seq {seq} (tool_call_id {shown_id!r}) answers call {pos} of the "
            f"assistant message at seq {aseq}, {what}",
        )
    elif real_id is not None and real_id != call_id:
        yield Violation(
            conversation,
            seq,
            "result_id_mismatch",
            f"the tool result at seq {seq} has tool_call_id {shown_id!r}, but its call (position "
            f"{pos} of the assistant message at seq {aseq}) has id {_text(real_id)!r}",
        )
    if role == "assistant" and n_calls > 0 and calls != n_calls:
        yield Violation(
            conversation,
            seq,
            "call_count_mismatch",
            f"the assistant message at seq {seq} declares {n_calls} tool call(s) (n_calls) but "
            f"has {calls} call row(s)",
        )
    open_slots = None
    if tool and linked and not misplaced and call_n is not None and pos is not None:
        open_slots = call_n - 1 - pos
    wrong = _bookkeeping(
        role, seq, n_calls, slots_left, prev_seq, prev_slots, block_end, open_slots
    )
    if wrong:
        yield Violation(
            conversation, seq, "bookkeeping", f"{role} message: {wrong} disagree with the rows"
        )


def _bookkeeping(
    role: str,
    seq: int,
    n_calls: int,
    slots_left: int,
    prev_seq: int | None,
    prev_slots: int | None,
    block_end: int | None,
    open_slots: int | None,
) -> str:
    """Which enforcement columns of a message are wrong ("" when none); ``open_slots`` is the
    number of result slots its block really has after it (results only)."""
    wrong = []
    if (seq == 0) != (prev_seq is None) or (prev_seq is not None and prev_seq != seq - 1):
        wrong.append(f"prev_seq {prev_seq}")
    if (seq > 0) != (prev_slots is not None) or (
        prev_slots is not None and (prev_slots > 0) != (role == "tool")
    ):
        wrong.append(f"prev_slots_left {prev_slots}")
    expected = {"assistant": n_calls, "tool": None if prev_slots is None else prev_slots - 1}
    if slots_left != expected.get(role, 0) or (open_slots is not None and slots_left != open_slots):
        wrong.append(f"slots_left {slots_left}")
    expected_end = seq + n_calls if role == "assistant" and n_calls > 0 else None
    if block_end != expected_end:
        wrong.append(f"block_end_seq {block_end} (expected {expected_end})")
    return ", ".join(wrong)


def _call_violations(row: Any) -> Iterator[Violation]:
    """The violations of one call row of _CHECK_CALLS (the SQL only picked it)."""
    (cid, aseq, pos, call_id, name, state, n_decl, repaired, no_raw, has_result, a_role, a_n,
     s_role) = row  # fmt: skip
    if not (
        isinstance(cid, str)
        and isinstance(state, str)
        and repaired in (0, 1)
        and _typed(aseq, pos, n_decl)
    ):
        return
    found = list(
        _call_findings(
            _text(cid), aseq, pos, _text(call_id), _text(name), state, n_decl, bool(repaired),
            bool(no_raw), bool(has_result), _opt_text(a_role), _int(a_n), _opt_text(s_role),
        )
    )  # fmt: skip
    if not found:  # never call a row the SQL picked clean
        found.append(
            Violation(
                _text(cid),
                aseq,
                "invalid_row",
                f"call {pos} (id {_text(call_id)!r}) of the message at seq {aseq} breaks a rule "
                f"of the schema (assistant_n_calls {n_decl}, state {state!r})",
            )
        )
    yield from found


def _call_findings(
    cid: str,
    aseq: int,
    pos: int,
    call_id: str,
    name: str,
    state: str,
    n_decl: int,
    repaired: bool,
    no_raw: bool,
    has_result: bool,
    a_role: str | None,
    a_n: int | None,
    s_role: str | None,
) -> Iterator[Violation]:
    assistant = a_role == "assistant"
    where = f"call {pos} ({name}, id {call_id!r}) of the " + (
        f"assistant message at seq {aseq}" if assistant else f"message at seq {aseq}"
    )
    if not assistant:
        yield Violation(
            cid,
            aseq,
            "orphan_call",
            f"{where}: seq {aseq} is "
            + ("missing" if a_role is None else f"{_a(a_role)} message, not an assistant message"),
        )
    elif a_n is not None and (pos < 0 or pos >= a_n):
        yield Violation(
            cid, aseq, "call_count_mismatch", f"{where}: the message declares {a_n} call(s)"
        )
    if not has_result:
        held = (
            "is empty"
            if s_role is None
            else "holds the result of another call"
            if s_role == "tool"
            else f"holds {_a(s_role)} message"
        )
        yield Violation(
            cid,
            aseq,
            "missing_result",
            f"{where} has no result: its slot (seq {aseq + 1 + pos}) {held}",
        )
        if s_role is not None and s_role != "tool":
            yield Violation(
                cid,
                aseq + 1 + pos,
                "interleaved",
                f"{_a(s_role)} message sits in the slot of the result of {where}",
            )
    if state != ToolCallState.FINISHED.value:
        yield Violation(cid, aseq, "not_finished", f"{where} is {state}, not finished")
    wrong = []
    if assistant and n_decl != a_n:
        wrong.append(f"assistant_n_calls {n_decl} (the message has {a_n})")
    elif pos >= n_decl:
        wrong.append(f"assistant_n_calls {n_decl} (position {pos})")
    if repaired == no_raw:
        wrong.append(f"repaired {repaired} with raw_arguments {'NULL' if no_raw else 'set'}")
    if wrong:
        yield Violation(cid, aseq, "bookkeeping", f"{where}: {', '.join(wrong)} disagree")


def _a(word: str) -> str:
    """``word`` with its indefinite article."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _invalid_row_detail(
    role: str, n_calls: int, call_id: str | None, aseq: int | None, pos: int | None
) -> str:
    if role not in _ROLES:
        return f"unknown role {role!r}"
    if (n_calls and role != "assistant") or n_calls < 0:
        return f"{role} message with n_calls {n_calls}"
    if role == "tool":
        return (
            f"tool result without its call's link (tool_call_id {call_id!r}, assistant_seq "
            f"{aseq}, call_position {pos})"
        )
    return f"{role} message with a tool result's link fields"
