"""How the audit reads a store: read-only engines, one connection per call, raw values.

:func:`open_readonly` opens a store so that the database itself refuses writes (built by
:func:`fsm.store.engine.create_readonly_engine`): SQLite through a ``mode=ro`` URI (a missing file
is an error, never created), PostgreSQL with ``default_transaction_read_only``. Every audit
function takes a :data:`Bind`: an :class:`~sqlalchemy.engine.Engine` (a connection is opened for
the call and closed when the result is consumed) or a :class:`~sqlalchemy.engine.Connection`
(used as it is, inside the caller's transaction); :func:`connect` is that rule.

**Any committed value can be read.** Rows written with the enforcement off can hold anything
(SQLite: a blob in a text column, text that is not UTF-8, malformed JSON, a created_at that is
not a time); one such value never makes a query over the whole store fail. Values are selected
raw (:func:`raw_column`) and read leniently: text stored marked by :mod:`fsm.store.codec` (U+0000, lone
surrogates) is decoded, a blob is shown as UTF-8 (errors replaced), a JSON column that is not JSON
Python can hold exactly is shown as its text, a time that is not one as ``None``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Final, TypeAlias, cast

import sqlalchemy as sa
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, Engine

from fsm.states import FAILED_STATES, ToolCallState
from fsm.store.codec import MARK, decode_json, decode_text
from fsm.store.engine import create_readonly_engine, display_url, normalize_url
from fsm.store.errors import (
    AuditError,
    SchemaNotAtHeadError,
)
from fsm.store.migrate import alembic_config, head_revision, revision_of
from fsm.store.models import Attempt, AttemptCall, Conversation, Message, ToolCallRow

#: an engine (a connection is opened per call) or a connection (used as is).
Bind: TypeAlias = Engine | Connection

MESSAGES = cast(sa.Table, Message.__table__)
CALLS = cast(sa.Table, ToolCallRow.__table__)
ATTEMPTS = cast(sa.Table, Attempt.__table__)
ATTEMPT_CALLS = cast(sa.Table, AttemptCall.__table__)
CONVERSATIONS = cast(sa.Table, Conversation.__table__)

CALL_STATES: Final = tuple(s.value for s in ToolCallState)
FAILED_STATE_VALUES: Final = tuple(s.value for s in FAILED_STATES)
PAGE_SIZE: Final = 1000


# -- opening a store read-only -----------------------------------------------------------------
def open_readonly(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """An engine on the store at ``url`` (``None``: the default store) that cannot write.

    SQLite is opened through a ``file:PATH?mode=ro`` URI: a missing file raises
    :class:`DatabaseNotFoundError` (it is never created), and every write fails with "attempt to
    write a readonly database". PostgreSQL transactions begin with ``SET TRANSACTION READ ONLY``
    (per transaction, so a pooling proxy never hands it to another client): every write fails
    with "cannot execute ... in a read-only transaction". Transactions begin with a plain ``BEGIN``
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
            current = revision_of(conn)
    except sa.exc.DBAPIError as exc:
        raise AuditError(f"cannot read the store {url}: {_one_line(exc)}") from exc
    head = head_revision()
    if not current:
        raise SchemaNotAtHeadError(url, None, head)
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current not in known:
        raise SchemaNotAtHeadError(url, current, head, unknown=True)


def _one_line(exc: sa.exc.DBAPIError) -> str:
    return " ".join(str(exc.orig).split())


@contextmanager
def connect(bind: Bind, *, snapshot: bool = False) -> Iterator[Connection]:
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


class Row:
    """The base of the audit's row dataclasses (slotted, frozen): :meth:`as_dict`."""

    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in column order."""
        return asdict(cast(Any, self))


# -- values read raw ---------------------------------------------------------------------------
def raw_column(conn: Connection, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``column`` selected as the engine stores it, without the type's result processing (a
    StoredText decode, a JSON parse, a datetime parse, an enum lookup), any of which fails on a
    value raw SQL wrote; the caller reads it with :func:`as_text`, :func:`json_value` or
    :func:`~fsm.store.codec.as_utc`. PostgreSQL gets JSON columns as their text (the driver
    would parse them)."""
    kind = column.type.impl if isinstance(column.type, sa.types.TypeDecorator) else column.type
    if conn.dialect.name == "postgresql" and isinstance(kind, sa.JSON):
        return sa.cast(column, sa.Text)
    return sa.type_coerce(column, sa.Text)


def raw_columns(conn: Connection, **columns: sa.ColumnElement[Any]) -> list[sa.Label[Any]]:
    """Each column selected raw (:func:`raw_column`), labelled with its keyword's name."""
    return [raw_column(conn, column).label(name) for name, column in columns.items()]


def as_text(value: Any) -> str:
    """A text value read raw, as the string it stands for: a value stored marked by
    :mod:`fsm.store.codec` decoded; a blob (SQLite, raw SQL) decoded as UTF-8 (errors
    replaced); anything else as its ``str``."""
    if isinstance(value, str):
        return decode_text(value) if value.startswith(MARK) else value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def as_opt_text(value: Any) -> str | None:
    return None if value is None else as_text(value)


def as_int(value: Any) -> int | None:
    """``value`` when it is an integer (not a bool), else ``None``."""
    return value if type(value) is int else None


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is not a finite double")
    return number


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def json_value(value: Any) -> Any:
    """A JSON column's value read raw (:func:`raw_column`): the value it holds, or its text when that
    is not JSON Python can hold exactly (malformed, ``NaN``/``Infinity``, a number beyond a
    double or too long for an int, nested too deep)."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    text = as_text(value)
    try:
        parsed = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return text
    # strings fsm.store.codec.StoredJSON marked (their escapes are ASCII: the mark is "\ufdd0")
    return decode_json(parsed) if "\\ufdd0" in text or MARK in text else parsed
