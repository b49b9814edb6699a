"""The audit's filters: one :class:`Filters` value, checked before any I/O, and the SQL
conditions built from it (tool, state, conversation, model, time, argument content).

Every filter is served by an index (migration ``0002``) except the argument-content filters: a
JSON path or a substring of the arguments cannot be indexed, so those are checked on the rows the
other filters (or the key order, with the page's ``LIMIT``) lead to. JSON functions only see what
the engine can parse (SQLite ``json_valid``; PostgreSQL ``fsm_try_jsonb`` after rewriting the
escapes ``jsonb`` cannot hold, see :func:`arg_condition`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Final, TypeAlias

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Connection

from fsm.states import ToolCallState
from fsm.store.audit.read import CALL_STATES
from fsm.store.codec import MARK, encode_text, needs_marking
from fsm.store.errors import InvalidFilterError

#: an argument filter: a JSON path (``city``, ``a.b[0]``, ``$."odd key"``) and a scalar value.
ArgFilter: TypeAlias = tuple[str, "str | int | float | bool | None"]


#: what no conversation id holds (and no driver can send as one)
_NOT_AN_ID: Final = re.compile("[\x00\ud800-\udfff]")

#: the whole numbers both engines hold (BIGINT): a key part outside them is no row's.
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


def row_key(value: Any, shape: str, listing: str) -> tuple[Any, ...] | None:
    """``value`` (``None``, or a listing's ``after=``) checked against the shape of that
    listing's row keys, one letter a part: ``s`` text, ``i`` a whole number both engines hold
    (not a bool), ``b`` 0 or 1; :class:`InvalidFilterError` when it cannot be the key of any of its rows (a
    forged or garbled cursor), before any I/O."""
    if value is None:
        return None
    parts = tuple(value) if isinstance(value, list | tuple) else None
    if parts is not None and len(parts) == len(shape):
        fits = all(
            isinstance(p, str)
            if kind == "s"
            else type(p) is int and (p in (0, 1) if kind == "b" else INT64_MIN <= p <= INT64_MAX)
            for kind, p in zip(shape, parts, strict=True)
        )
        if fits:
            return parts
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:79] + "\u2026"
    raise InvalidFilterError(
        f"after={shown} is not the key of a row of {listing}: pass a row's .key (the CLI and the "
        "viewer print it as a cursor)"
    )


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
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        # a time whose UTC falls outside years 1-9999 (0001-01-01T00:00+01:00): the nearest
        # time a datetime holds bounds the same rows (nothing is stored outside that range)
        nearest = datetime.min if value.year == 1 else datetime.max
        return nearest.replace(tzinfo=UTC)


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


def time_column(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.type_coerce(column, sa.String) if conn.dialect.name == "sqlite" else column


def time_filters(
    conn: Connection,
    column: sa.ColumnElement[Any],
    since: datetime | None,
    until: datetime | None,
) -> list[sa.ColumnElement[bool]]:
    """``since <= column < until``."""
    target = time_column(conn, column)
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
    if text not in CALL_STATES:
        raise InvalidFilterError(f"unknown state {text!r}: one of {', '.join(CALL_STATES)}")
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


def arg_condition(
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


def pg_function(conn: Connection, signature: str) -> bool:
    """Whether the PostgreSQL function ``signature`` (``name(argtypes)``) is on the search path."""
    found = conn.execute(
        sa.text("SELECT to_regprocedure(:signature) IS NOT NULL"), {"signature": signature}
    ).scalar()
    return bool(found)


def contains_text(conn: Connection, arguments: sa.ColumnElement[str], text: str) -> Any:
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


def like_pattern(text: str) -> str:
    """``%text%`` for ``LIKE ... ESCAPE '\\'``: the user's ``%``, ``_`` and ``\\`` are literal."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def search_condition(text: str, *columns: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """``text`` occurs in one of ``columns``, case-insensitively (both sides lowered by the
    engine: SQLite's ``lower`` folds ASCII letters only, PostgreSQL's every letter), with the
    LIKE wildcards ``%`` and ``_`` of ``text`` taken literally."""
    pattern = sa.func.lower(sa.literal(like_pattern(text), sa.Text))
    return sa.or_(
        *(sa.func.lower(sa.cast(column, sa.Text)).like(pattern, escape="\\") for column in columns)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Filters:
    """What an audit query is narrowed to: the one filters type of
    :func:`~fsm.store.audit.tool_calls`, :func:`~fsm.store.audit.failures`,
    :func:`~fsm.store.audit.failure_counts` and :func:`~fsm.store.audit.stats` (each reads the
    fields it supports). Build it with :meth:`of`, which checks and normalises every value
    before any I/O."""

    name: str | None = None
    state: str | None = None
    conversation: str | None = None
    model: str | None = None
    reason: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    args: tuple[tuple[str, Any], ...] = ()
    contains: str | None = None
    #: the stream format of the call's message or attempt (migration 0007)
    format: str | None = None
    #: text searched case-insensitively in the call's tool name, call id, conversation id and
    #: arguments (:func:`search_condition`)
    search: str | None = None
    #: PostgreSQL: whether ``fsm_try_jsonb`` exists (migration 0003)
    try_jsonb: bool = False

    @classmethod
    def of(
        cls,
        *,
        name: str | None = None,
        state: str | ToolCallState | None = None,
        conversation: str | None = None,
        model: str | None = None,
        reason: str | None = None,
        since: datetime | date | str | None = None,
        until: datetime | date | str | None = None,
        args: Iterable[ArgFilter] = (),
        args_contains: str | None = None,
        format: str | None = None,
        search: str | None = None,
    ) -> Filters:
        """The filters given as the audit functions take them: ``state`` one of the states
        (:class:`InvalidFilterError` otherwise); ``since`` <= created_at < ``until`` as
        datetimes, dates or ISO strings (naive means UTC); ``args`` ``(json_path, value)``
        pairs; ``args_contains`` a substring of the raw arguments; ``format`` ``chat``,
        ``responses`` or ``anthropic``; ``search`` a text searched case-insensitively (see
        :func:`search_condition`)."""
        if search is not None and (not isinstance(search, str) or _NOT_AN_ID.search(search)):
            raise InvalidFilterError(
                f"search {search!r} cannot be searched for (text without U+0000 or surrogates)"
            )
        if format not in (None, "chat", "responses", "anthropic"):
            raise InvalidFilterError(f"format must be chat, responses or anthropic, not {format!r}")
        if conversation is not None and (
            not isinstance(conversation, str) or _NOT_AN_ID.search(conversation)
        ):
            raise InvalidFilterError(
                f"conversation {conversation!r} is not a conversation id (ids are text without "
                "U+0000 or surrogates)"
            )
        return cls(
            name=name,
            state=_state(state),
            conversation=conversation,
            model=model,
            reason=reason,
            since=_utc(since, "since"),
            until=_utc(until, "until"),
            args=tuple((path, value) for path, value in args),
            contains=args_contains,
            format=format,
            search=search or None,
        )
