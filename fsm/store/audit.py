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
* :func:`check` re-verifies the whole history contract of ``spec/store.md`` with set-based SQL
  over batches of conversations, streaming :class:`Violation` rows (see :data:`VIOLATION_KINDS`).

Every filter is served by an index (migration ``0002``) except the argument-content filters: a
JSON path or a substring of the arguments cannot be indexed, so those are checked on the rows the
other filters (or the key order, with the page's ``LIMIT``) lead to.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias, cast

import sqlalchemy as sa
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import URL, Connection, Engine

from fsm.states import ToolCallState
from fsm.store.engine import BUSY_TIMEOUT_SECONDS, display_url, normalize_url
from fsm.store.errors import SchemaNotAtHeadError, StoreError
from fsm.store.migrate import alembic_config, head_revision
from fsm.store.models import Attempt, AttemptCall, Conversation, Message, ToolCallRow

__all__ = [
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


# -- errors ------------------------------------------------------------------------------------
class AuditError(StoreError):
    """An audit query cannot run as asked (the CLI prints it as one line)."""


class DatabaseNotFoundError(AuditError, FileNotFoundError):
    """The SQLite file to audit does not exist (audits open it read-only and never create it)."""


class InvalidFilterError(AuditError, ValueError):
    """A filter is malformed: an unknown state, a bad JSON path, a non-scalar value, ..."""


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
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        engine = _sqlite_readonly(parsed, **kwargs)
    elif backend == "postgresql":
        engine = sa.create_engine(parsed, **kwargs)
        _configure_postgres_readonly(engine)
    else:
        raise AuditError(f"fsm audits SQLite and PostgreSQL stores, not {backend} ({parsed})")
    try:
        _require_schema(engine, display_url(parsed))
    except BaseException:
        engine.dispose()
        raise
    return engine


def _sqlite_readonly(parsed: URL, **kwargs: Any) -> Engine:
    database = parsed.database or ""
    if not database or database == ":memory:" or "mode=memory" in database:
        raise AuditError("an in-memory SQLite database has nothing to audit: give a file")
    if database.startswith("file:"):
        # already a URI: keep it, forcing read-only
        uri = database if "mode=ro" in database else _with_mode_ro(database)
        path = Path(uri[len("file:") :].split("?", 1)[0])
    else:
        path = Path(database).expanduser().resolve()
        uri = f"file:{_uri_path(path)}?mode=ro"
    if not path.is_file():
        raise DatabaseNotFoundError(
            f"no SQLite database at {path}: audits open the store read-only and never create "
            f"it (create one with: fsm db upgrade --db 'sqlite:///{path}')"
        )
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", BUSY_TIMEOUT_SECONDS)
    readonly = URL.create("sqlite", database=uri, query={"uri": "true"})
    engine = sa.create_engine(readonly, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # fsm emits BEGIN itself (below)
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA query_only=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_SECONDS * 1000)}")
            # large scans (check, stats) read the file through the page cache and mmap
            cursor.execute("PRAGMA cache_size=-65536")
            cursor.execute("PRAGMA mmap_size=17179869184")  # clamped to the build's maximum
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")

    return engine


def _uri_path(path: Path) -> str:
    """``path`` for a SQLite ``file:`` URI (``%``, ``?`` and ``#`` escaped)."""
    return str(path).replace("%", "%25").replace("?", "%3f").replace("#", "%23")


def _with_mode_ro(uri: str) -> str:
    base, _, query = uri.partition("?")
    params = [p for p in query.split("&") if p and not p.startswith("mode=")]
    return f"{base}?{'&'.join([*params, 'mode=ro'])}"


def _configure_postgres_readonly(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SET default_transaction_read_only = on")
                cursor.execute("SET plan_cache_mode = force_custom_plan")
                # compiling a query costs more than these scans and lookups ever win back
                cursor.execute("SET jit = off")
        finally:
            dbapi_connection.autocommit = autocommit


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
    """A timestamp read from either engine, as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, str):  # SQLite text that SQLAlchemy did not process
        value = datetime.fromisoformat(value)
    dt = cast(datetime, value)
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


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
) -> sa.ColumnElement[bool]:
    """The SQL test "the arguments hold ``value`` at ``path``" for this engine.

    Only finished calls have JSON arguments (a truncated or aborted call's text is cut); empty or
    whitespace-only arguments (no arguments) have no value at any path. Neither ever raises: the
    engine's JSON parser only sees text that is a JSON document.
    """
    parts = parse_json_path(path)
    if value is not None and not isinstance(value, str | int | float | bool):
        raise InvalidFilterError(
            f"argument filter {path!r}: compare a scalar (string, number, true/false, null), "
            f"not {type(value).__name__}; point the path at a value inside it instead"
        )
    finished = state == ToolCallState.FINISHED if state is not None else None
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
        if value is None:
            condition = json_type == "null"
        elif isinstance(value, bool):
            condition = json_type == ("true" if value else "false")
        elif isinstance(value, str):
            condition = sa.and_(json_type == "text", extracted == sa.literal(value, sa.String))
        else:
            condition = sa.and_(json_type.in_(["integer", "real"]), extracted == sa.literal(value))
        return condition if finished is None else sa.and_(finished, condition)
    # PostgreSQL: cast the text to jsonb only when it is a document (non-blank) of a finished
    # call; jsonb cannot hold \u0000, so that escape is read as U+FFFD (for matching only).
    blank = sa.func.btrim(arguments, sa.literal(" \t\n\r"))
    readable = sa.and_(blank != "", *([finished] if finished is not None else []))
    document = sa.case(
        (
            readable,
            sa.cast(
                sa.func.replace(arguments, sa.literal("\\u0000"), sa.literal("\\ufffd")),
                pg.JSONB,
            ),
        ),
        else_=sa.null(),
    )
    path_array = sa.cast(
        sa.literal([str(p) for p in parts], pg.ARRAY(sa.Text)),
        pg.ARRAY(sa.Text),
    )
    found = document.op("#>")(path_array)
    return found == sa.cast(sa.literal(json.dumps(value)), pg.JSONB)


def _contains(conn: Connection, arguments: sa.ColumnElement[str], text: str) -> Any:
    """``text`` occurs in the arguments, byte for byte (no wildcards, case-sensitive)."""
    function = sa.func.instr if conn.dialect.name == "sqlite" else sa.func.strpos
    return function(arguments, sa.literal(text, sa.Text)) > 0


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
        arms.append(_history_arm(_history_keys(conn, f, after, limit + offset).subquery("hk")))
    if attempts:
        arms.append(_attempt_arm(_attempt_keys(conn, f, after, limit + offset).subquery("ak")))
    page = (arms[0] if len(arms) == 1 else sa.union_all(*arms)).subquery("page")
    query = sa.select(page).order_by(*(page.c[c] for c in _KEY_COLUMNS)).limit(limit).offset(offset)
    rows = []
    for (cid, seq, rank, attempt, position, call_id, name, arguments, state, model, created,
         content, parts, reason) in conn.execute(query):  # fmt: skip
        rows.append(
            CallRow(
                conversation_id=cid,
                seq=seq,
                position=position,
                call_id=call_id,
                name=name,
                arguments=arguments,
                state=state,
                model=model,
                created_at=_as_utc(created),
                result=parts if parts is not None else content,
                attempt_id=attempt if rank == 0 else None,
                reason=reason,
            )
        )
    return rows


def _history_arm(keys: sa.Subquery) -> sa.Select[Any]:
    """The rows of history for ``keys``: the call, its assistant message, its result."""
    t = _CALLS.alias("tc")
    a = _MESSAGES.alias("am")
    r = _MESSAGES.alias("rm")
    return sa.select(
        *(keys.c[c] for c in _KEY_COLUMNS),
        t.c.call_id,
        t.c.name,
        t.c.arguments,
        sa.literal(ToolCallState.FINISHED.value, sa.String).label("state"),
        a.c.model,
        a.c.created_at,
        r.c.content,
        r.c.content_parts,
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


def _attempt_arm(keys: sa.Subquery) -> sa.Select[Any]:
    """The rows of attempts for ``keys``: the call and its attempt."""
    c_ = _ATTEMPT_CALLS.alias("acd")
    a = _ATTEMPTS.alias("atd")
    return sa.select(
        *(keys.c[c] for c in _KEY_COLUMNS),
        c_.c.call_id,
        c_.c.name,
        c_.c.arguments,
        sa.type_coerce(c_.c.state, sa.String).label("state"),
        a.c.model,
        a.c.created_at,
        sa.null().label("content"),
        sa.null().label("content_parts"),
        c_.c.reason,
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
        conditions.append(_arg_condition(conn, t.c.arguments, None, path, value))
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
        conditions.append(_arg_condition(conn, c_.c.arguments, c_.c.state, path, value))
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
        query = (
            sa.select(
                a.c.id,
                a.c.conversation_id,
                a.c.at_seq,
                c_.c.position,
                c_.c.call_id,
                c_.c.name,
                c_.c.state,
                c_.c.reason,
                a.c.model,
                a.c.finish_reason,
                a.c.end_how,
                a.c.end_reason,
                a.c.anomalies,
                a.c.created_at,
                c_.c.arguments,
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
                yield FailureRow(
                    attempt_id=row[0],
                    conversation_id=row[1],
                    seq=row[2],
                    position=row[3],
                    call_id=row[4],
                    name=row[5],
                    state=row[6].value,
                    reason=row[7],
                    model=row[8],
                    finish_reason=row[9],
                    end_how=row[10],
                    end_reason=row[11],
                    anomalies=[str(a.get("kind")) for a in (row[12] or []) if isinstance(a, dict)],
                    created_at=_as_utc(row[13]),
                    arguments=row[14],
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
        query = (
            sa.select(
                a.c.model,
                c_.c.state,
                c_.c.reason,
                calls,
                sa.func.count(sa.distinct(c_.c.attempt_id)),
            )
            .select_from(c_.join(a, a.c.id == c_.c.attempt_id))
            .where(*conditions)
            .group_by(a.c.model, c_.c.state, c_.c.reason)
        )
        rows = conn.execute(query).all()
    out = [
        FailureCount(model=m, state=s.value, reason=r, calls=int(n), attempts=int(k))
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


def _token(conn: Connection, usage: sa.ColumnElement[Any], key: str) -> sa.ColumnElement[Any]:
    """The number at ``usage.key`` (``NULL`` when absent; never an error).

    SQLite: ``json_extract`` (a text that is not a number adds 0, as ``sum`` reads text).
    PostgreSQL: the value only when JSON says it is a number.
    """
    if conn.dialect.name == "sqlite":
        return sa.func.json_extract(usage, f'$."{key}"')
    field_ = sa.type_coerce(usage, pg.JSON)[key]
    return sa.case(
        (sa.func.json_typeof(field_) == "number", sa.cast(field_.astext, sa.Numeric)),
        else_=sa.null(),
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
        return sa.func.substr(sa.type_coerce(column, sa.String), 1, 10)
    return sa.func.to_char(sa.func.timezone("UTC", column), "YYYY-MM-DD")


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

        prompt = _token(conn, m.c.usage, "prompt_tokens")
        completion = _token(conn, m.c.usage, "completion_tokens")
        total = sa.func.coalesce(_token(conn, m.c.usage, "total_tokens"), prompt + completion)
        day = _day(conn, m.c.created_at)
        turns_query = (
            sa.select(
                m.c.model,
                day,
                sa.func.count(),
                sa.func.sum(m.c.n_calls),
                sa.func.sum(prompt),
                sa.func.sum(completion),
                sa.func.sum(total),
            )
            .where(*msg_where)
            .group_by(m.c.model, day)
        )
        unfiltered = len(msg_where) == 1
        if conn.dialect.name == "sqlite" and unfiltered and not isinstance(bind, Connection):
            turns = _sqlite_halves(bind, conn, turns_query)
        else:
            if conn.dialect.name == "postgresql" and not isinstance(bind, Connection):
                conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))  # sort in memory
            turns = list(conn.execute(turns_query).all())
        attempt_day = _day(conn, a.c.created_at)
        incomplete = sa.func.sum(sa.case((a.c.complete, 0), else_=1))
        attempts = conn.execute(
            sa.select(a.c.model, attempt_day, sa.func.count(), incomplete)
            .where(*att_where)
            .group_by(a.c.model, attempt_day)
        ).all()

        calls_query = sa.select(t.c.name, sa.func.count())
        if len(msg_where) > 1:
            calls_query = calls_query.select_from(
                t.join(
                    m,
                    sa.and_(
                        m.c.conversation_id == t.c.conversation_id, m.c.seq == t.c.assistant_seq
                    ),
                )
            ).where(*msg_where)
        per_tool: dict[str, int] = dict(conn.execute(calls_query.group_by(t.c.name)).all())
        failed_query = (
            sa.select(ac.c.name, sa.func.count())
            .where(ac.c.state.in_([ToolCallState(s) for s in _FAILED_STATES]))
            .group_by(ac.c.name)
        )
        if att_where:
            failed_query = failed_query.select_from(ac.join(a, a.c.id == ac.c.attempt_id)).where(
                *att_where
            )
        per_tool_failed: dict[str, int] = dict(conn.execute(failed_query).all())

    def n(value: Any) -> int:
        return int(value) if isinstance(value, int | float | Decimal) else 0

    by_model: dict[str | None, list[int]] = {}
    by_day: dict[str, list[int]] = {}
    # [turns, calls, attempts, incomplete, prompt, completion, total]
    for model_name, day_text, count, n_calls, p, c, tt in turns:
        for bucket in (
            by_model.setdefault(model_name, [0] * 7),
            by_day.setdefault(day_text, [0] * 7),
        ):
            bucket[0] += n(count)
            bucket[1] += n(n_calls)
            bucket[4] += n(p)
            bucket[5] += n(c)
            bucket[6] += n(tt)
    for model_name, day_text, count, bad in attempts:
        for bucket in (
            by_model.setdefault(model_name, [0] * 7),
            by_day.setdefault(day_text, [0] * 7),
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
    return Stats(tools=tools, models=models, days=days, totals=totals)


# -- the integrity check -----------------------------------------------------------------------
#: Every kind of violation :func:`check` reports, with what it means.
VIOLATION_KINDS: Final[dict[str, str]] = {
    "seq_start": "a conversation's first message does not have seq 0 (rule 1)",
    "seq_gap": "seq numbers are missing between two messages (rule 1)",
    "seq_duplicate": "two messages of a conversation have the same seq (rule 1)",
    "invalid_row": "a message's own fields contradict each other: an unknown role, tool calls on "
    "a non-assistant message, a tool result without its call's link, link fields on another role",
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
# restricts table alias x to it), with three scans and lookups that only read indexes:
#
# * _CHECK_SEQ: per conversation, count / min / max of seq over the primary key: dense from 0 iff
#   count = max + 1 and min = 0 (and count = distinct count when no key makes seq unique). Only
#   the conversations that fail are read again (_CHECK_SEQ_DETAIL, window functions) to say where.
# * _CHECK_MESSAGES: each message on its own (role, link fields, the slot formula of a result:
#   seq = assistant_seq + 1 + call_position, the enforcement columns); each result with the call
#   it names (exists, same id) and with its assistant message (its slots_left); each assistant
#   message with its calls (positions exactly 0 .. n_calls - 1).
# * _CHECK_CALLS: each call on its own (state, position below assistant_n_calls), with its
#   assistant message (exists, same n_calls) and with a result that names it.
#
# Together: an assistant message with N calls has calls at positions 0 .. N-1, each has a
# result naming it with its id, and each result sits in its call's slot; as two messages cannot
# share a seq, the N slots after the assistant message hold exactly its results in call order
# and nothing else (rules 2, 3, 5). With dense seq (rule 1) and finished calls (rule 4) that is
# the whole contract. The enforcement columns are checked row by row and against the block
# (a result's slots_left = assistant seq + N - seq): with the structure right, that implies the
# foreign-key chain of prev_slots_left, so no pass over neighbouring rows is needed.
_CHECK_SEQ = """
SELECT g.conversation_id, g.n, g.d, g.lo, g.hi, CASE WHEN c.id IS NULL THEN 1 ELSE 0 END
FROM (
  SELECT conversation_id, count(*) AS n, {distinct} AS d, min(seq) AS lo, max(seq) AS hi
  FROM messages m WHERE RANGE(m) GROUP BY conversation_id
) g LEFT JOIN conversations c ON c.id = g.conversation_id
WHERE g.n <> g.hi + 1 OR g.lo <> 0 OR g.d <> g.n OR c.id IS NULL
"""

_CHECK_SEQ_DETAIL = """
SELECT conversation_id, seq, p_seq FROM (
  SELECT conversation_id, seq,
         lag(seq) OVER (PARTITION BY conversation_id ORDER BY seq) AS p_seq
  FROM messages WHERE conversation_id IN :ids
) x
WHERE (p_seq IS NULL AND seq <> 0) OR seq = p_seq OR seq > p_seq + 1
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
       AND t.assistant_n_calls = m.slots_left + m.call_position + 1 AND RANGE(t)
  COUNT_JOIN
  WHERE RANGE(m) AND (
    -- each role's own rules (one branch per row)
    CASE m.role
      WHEN 'tool' THEN CASE
        WHEN m.tool_call_id IS NULL
          OR COALESCE(m.assistant_seq + 1 + m.call_position, -1) <> m.seq
          OR m.n_calls <> 0 OR m.block_end_seq IS NOT NULL
          OR COALESCE(m.prev_slots_left, 0) <= 0 OR m.slots_left <> m.prev_slots_left - 1
          OR t.conversation_id IS NULL
        THEN 1 ELSE 0 END
      WHEN 'assistant' THEN CASE
        WHEN m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls < 0 OR m.slots_left <> m.n_calls
          OR COALESCE(m.block_end_seq, -1)
             <> CASE WHEN m.n_calls > 0 THEN m.seq + m.n_calls ELSE -1 END
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
    OR COALESCE(m.prev_seq, -1) <> m.seq - 1
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
          AND s.seq = bad.assistant_seq + 1 + bad.call_position),
       (SELECT s.assistant_seq FROM messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = bad.assistant_seq + 1 + bad.call_position),
       (SELECT s.call_position FROM messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = bad.assistant_seq + 1 + bad.call_position)
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
          AND s.seq = bad.assistant_seq + 1 + bad.position)
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


_RANGE = re.compile(r"RANGE\((\w+)\)")


def _ranged(sql: str, lo: str | None, hi: str | None) -> str:
    """``sql`` with each ``RANGE(alias)`` replaced by the batch's bounds on that alias."""

    def bounds(match: re.Match[str]) -> str:
        column = f"{match.group(1)}.conversation_id"
        parts = []
        if lo is not None:
            parts.append(f"{column} >= :lo")
        if hi is not None:
            parts.append(f"{column} < :hi")
        return " AND ".join(parts) or "1 = 1"

    return _RANGE.sub(bounds, sql)


def check(
    bind: Bind,
    *,
    progress: Progress | None = None,
    batch_size: int = 10_000,
    workers: int | None = None,
) -> Iterator[Violation]:
    """Re-verify the history contract over the whole store; yield every violation found.

    The rules of ``spec/store.md`` ("The contract" 1-5) and more: seq dense from 0, every
    assistant message with N calls followed by exactly its N results each in its slot, each
    result's ``tool_call_id`` equal to its call's id, only finished calls, nothing between an
    assistant message and its results, and the enforcement columns consistent. Each kind is in
    :data:`VIOLATION_KINDS`. A store written through fsm has none: they can only come from writes
    that bypassed the constraints (foreign keys off, dropped constraints, a broken migration).

    The work is set-based: per batch of ``batch_size`` conversations (a range of ids), a grouped
    scan of the seq numbers, one scan of the messages and one of the calls, joined to each other
    through indexes (no query per conversation). Each batch runs in one read transaction, so
    it sees one snapshot; every rule is about one conversation, and a conversation is checked
    whole within one batch, so writers committing meanwhile cannot cause false violations.

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
        bounds = [
            str(b)
            for b in conn.execute(
                sa.text(
                    "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n "
                    "FROM conversations) x WHERE n > 1 AND (n - 1) % :size = 0 ORDER BY id"
                ),
                {"size": batch_size},
            ).scalars()
        ]
        pk = sa.inspect(conn).get_pk_constraint("messages")
        unique_seq = pk.get("constrained_columns") == ["conversation_id", "seq"]
        edges: list[str | None] = [None, *bounds, None]
        ranges = list(itertools.pairwise(edges))
        if progress is not None:
            progress(0, total)
        if isinstance(bind, Connection) or (workers or 2) == 1 or len(ranges) == 1:
            batches: Iterator[list[Violation]] = (
                _check_batch(conn, lo, hi, unique_seq=unique_seq, own=False) for lo, hi in ranges
            )
            yield from _with_progress(batches, progress, batch_size, total)
        else:
            engine = bind

            def run(bounds: tuple[str | None, str | None]) -> list[Violation]:
                with _connect(engine, snapshot=True) as worker:
                    return _check_batch(worker, *bounds, unique_seq=unique_seq, own=True)

            with ThreadPoolExecutor(workers or 2, thread_name_prefix="fsm-check") as pool:
                try:
                    yield from _with_progress(pool.map(run, ranges), progress, batch_size, total)
                finally:
                    pool.shutdown(cancel_futures=True)
        for attempt_id, n in conn.execute(sa.text(_ORPHAN_ATTEMPT_CALLS)):
            yield Violation(
                None,
                None,
                "orphan_row",
                f"{n} attempt_calls row(s) of attempt {attempt_id}, which does not exist",
            )


def _with_progress(
    batches: Iterator[list[Violation]], progress: Progress | None, size: int, total: int
) -> Iterator[Violation]:
    for i, found in enumerate(batches):
        yield from found
        if progress is not None:
            progress(min(total, (i + 1) * size), total)


def _check_batch(
    conn: Connection, lo: str | None, hi: str | None, *, unique_seq: bool, own: bool
) -> list[Violation]:
    """The violations of the conversations in [lo, hi), sorted by conversation and seq."""
    if own and conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))
    found = list(_check_range(conn, lo, hi, unique_seq=unique_seq))
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_range(
    conn: Connection, lo: str | None, hi: str | None, *, unique_seq: bool
) -> Iterator[Violation]:
    params = {k: v for k, v in (("lo", lo), ("hi", hi)) if v is not None}
    # two rows with one seq need the primary key gone: count distinct values only then
    distinct = "count(*)" if unique_seq else "count(DISTINCT seq)"

    join, count_check = _COUNT_CHECKS.get(conn.dialect.name, _COUNT_CHECKS["postgresql"])

    def run(sql: str) -> Iterable[Any]:
        sql = sql.replace("COUNT_JOIN", join).replace("COUNT_CHECK(m)", f"({count_check})")
        return conn.execute(sa.text(_ranged(sql.replace("{distinct}", distinct), lo, hi)), params)

    unordered: list[str] = []
    for cid, n, n_distinct, first, last, orphan in run(_CHECK_SEQ):
        if orphan:
            yield Violation(
                cid,
                None,
                "orphan_row",
                f"{n} message(s) of conversation {cid!r}, which does not exist",
            )
        if n != last + 1 or first != 0 or n_distinct != n:
            unordered.append(cid)
    for start in range(0, len(unordered), 500):
        ids = unordered[start : start + 500]
        detail = sa.text(_CHECK_SEQ_DETAIL).bindparams(sa.bindparam("ids", expanding=True))
        for cid, seq, p_seq in conn.execute(detail, {"ids": ids}):
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
            cid, None, "orphan_row", f"{n} attempt(s) of conversation {cid!r}, which does not exist"
        )


_ROLES: Final = ("system", "developer", "user", "assistant", "tool")


def _message_violations(row: Any) -> Iterator[Violation]:
    """The violations of one message row of _CHECK_MESSAGES (the SQL only picked it)."""
    (cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos, block_end,
     real_id, call_n, a_role, calls, s_role, s_aseq, s_pos) = row  # fmt: skip
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
            cid, seq, "invalid_row", _invalid_row_detail(role, n_calls, call_id, aseq, pos)
        )
    misplaced = tool and linked and seq != aseq + 1 + pos
    if misplaced:
        slot = aseq + 1 + pos
        if s_role == "tool" and (s_aseq, s_pos) == (aseq, pos):
            yield Violation(
                cid,
                seq,
                "duplicate_result",
                f"a second result (tool_call_id {call_id!r}) for call {pos} of the assistant "
                f"message at seq {aseq}, whose slot (seq {slot}) holds its result",
            )
        else:
            yield Violation(
                cid,
                seq,
                "result_misplaced",
                f"the result of call {pos} of the assistant message at seq {aseq} (tool_call_id "
                f"{call_id!r}) is at seq {seq}, not in its slot (seq {slot})",
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
            cid,
            seq,
            "orphan_result",
            f"the tool result at seq {seq} (tool_call_id {call_id!r}) answers call {pos} of the "
            f"assistant message at seq {aseq}, {what}",
        )
    elif real_id is not None and real_id != call_id:
        yield Violation(
            cid,
            seq,
            "result_id_mismatch",
            f"the tool result at seq {seq} has tool_call_id {call_id!r}, but its call (position "
            f"{pos} of the assistant message at seq {aseq}) has id {real_id!r}",
        )
    if role == "assistant" and n_calls > 0 and calls != n_calls:
        yield Violation(
            cid,
            seq,
            "call_count_mismatch",
            f"the assistant message at seq {seq} declares {n_calls} tool call(s) (n_calls) but "
            f"has {calls} call row(s)",
        )
    open_slots = None
    if tool and linked and not misplaced and call_n is not None:
        open_slots = call_n - 1 - pos
    wrong = _bookkeeping(
        role, seq, n_calls, slots_left, prev_seq, prev_slots, block_end, open_slots
    )
    if wrong:
        yield Violation(cid, seq, "bookkeeping", f"{role} message: {wrong} disagree with the rows")


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
    elif pos < 0 or pos >= a_n:
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
    if bool(repaired) == bool(no_raw):
        wrong.append(f"repaired {bool(repaired)} with raw_arguments {'NULL' if no_raw else 'set'}")
    if wrong:
        yield Violation(cid, aseq, "bookkeeping", f"{where}: {', '.join(wrong)} disagree")


def _a(word: str) -> str:
    """``word`` with its indefinite article."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _invalid_row_detail(
    role: str, n_calls: int, call_id: str | None, aseq: int | None, pos: int | None
) -> str:
    if role not in ("system", "developer", "user", "assistant", "tool"):
        return f"unknown role {role!r}"
    if (n_calls and role != "assistant") or n_calls < 0:
        return f"{role} message with n_calls {n_calls}"
    if role == "tool":
        return (
            f"tool result without its call's link (tool_call_id {call_id!r}, assistant_seq "
            f"{aseq}, call_position {pos})"
        )
    return f"{role} message with a tool result's link fields"
