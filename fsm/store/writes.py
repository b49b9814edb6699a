"""The statements of the store's write path, each built once (no I/O here).

Building a SQLAlchemy statement (``sa.select(...).where(...)``) costs several times what
executing it costs once it is compiled; so every statement a write sends is built once per
*shape*, with bind parameters, and SQLAlchemy's compiled cache does the rest. The shapes:

* :func:`lock`: the conversation's row lock (PostgreSQL: ``SELECT ... FOR UPDATE``), which
  serializes the writers of one conversation;
* :func:`state`: everything a write needs to know before it inserts, in one query: whether the
  conversation exists (when no lock query said so), its pending turn (the tool ledger), where an
  earlier commit of the same turn sits (idempotency), and its last message's seq and open slots.
  Run after the lock, as its own statement: under READ COMMITTED each statement reads a fresh
  snapshot, so it sees what the writer the lock waited for committed;
* :func:`insert_row`: ``INSERT`` into one table (SQLite: one per table; several rows go through
  ``executemany``);
* :func:`insert_turn`: PostgreSQL, a whole turn in one statement: the calls in a data-modifying
  ``WITH`` and the assistant message with its results in the ``INSERT`` (the foreign keys are
  checked at the end of the statement, when every row of it is there): one round trip.

The lookup of an earlier commit uses ``min(seq + 0)``, not ``min(seq)``: with a bare ``min(seq)``
SQLite (and PostgreSQL, by its estimates) may walk the primary key in seq order looking for the
first match, which for a new turn (no match) reads the whole conversation; ``seq + 0`` leaves the
planner only the index of the key looked up.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from fsm.store.models import Conversation, Message, PendingTurnRow, ToolCallRow

__all__ = [
    "BY_KEY",
    "BY_RESPONSE",
    "MESSAGES",
    "TOOL_CALLS",
    "insert_row",
    "insert_turn",
    "lock",
    "state",
    "turn_params",
]

#: the two tables of history
MESSAGES: Final = cast(sa.Table, Message.__table__)
TOOL_CALLS: Final = cast(sa.Table, ToolCallRow.__table__)

#: :func:`state`'s ways of finding an earlier commit of the same turn.
BY_KEY: Final = "key"
BY_RESPONSE: Final = "response"


def _cid() -> sa.BindParameter[str]:
    return sa.bindparam("cid", type_=Conversation.__table__.c.id.type)


@functools.cache
def lock(*, for_update: bool) -> sa.Select[Any]:
    """The conversation's id (bind ``cid``), with its row lock when ``for_update``."""
    query = sa.select(Conversation.id).where(Conversation.id == _cid())
    return query.with_for_update() if for_update else query


@functools.cache
def state(*, exists: bool, same: str | None) -> sa.Select[Any]:
    """One row about the conversation (bind ``cid``): ``[exists,] pending_id, pending_at_seq,
    stored_at, last_seq, last_slots_left``.

    ``exists`` (1 or NULL) is there when asked for; ``stored_at`` is the seq of an earlier commit
    of the same turn: by idempotency key (``same=BY_KEY``, bind ``key``), by response id and
    choice (``BY_RESPONSE``, binds ``response_id`` and ``choice``), or NULL (``None``)."""
    m, p = Message, PendingTurnRow
    cid = _cid()
    columns: list[Any] = []
    if exists:
        columns.append(sa.select(sa.literal(1)).where(Conversation.id == cid).scalar_subquery())
    pending = sa.select(p.id, p.at_seq).where(p.conversation_id == cid, p.state == "pending")
    columns += [
        pending.with_only_columns(p.id).scalar_subquery(),
        pending.with_only_columns(p.at_seq).scalar_subquery(),
    ]
    if same is None:
        columns.append(sa.null())
    else:
        if same == BY_KEY:
            found: sa.ColumnElement[bool] = m.idempotency_key == sa.bindparam("key")
        else:
            found = sa.and_(
                m.response_id == sa.bindparam("response_id"),
                m.choice == sa.bindparam("choice"),
                m.role == "assistant",
            )
        columns.append(
            sa.select(sa.func.min(m.seq + 0))
            .where(m.conversation_id == cid, found)
            .scalar_subquery()
        )
    last = sa.select(m.seq).where(m.conversation_id == cid).order_by(m.seq.desc()).limit(1)
    columns += [
        last.scalar_subquery(),
        last.with_only_columns(m.slots_left).scalar_subquery(),
    ]
    return sa.select(*columns)


@functools.cache
def insert_row(table: sa.Table) -> sa.Insert:
    """``INSERT INTO table``: one row, or several through ``executemany`` (cached compiled)."""
    return sa.insert(table)


@functools.lru_cache(maxsize=256)
def insert_turn(
    schema: str | None,
    message_columns: tuple[str, ...],
    call_columns: tuple[str, ...],
) -> sa.TextClause:
    """PostgreSQL: the ``messages`` rows (the assistant message, then one result per call) and
    the ``tool_calls`` rows of a turn, in one statement, in ``schema`` (``None``: the
    ``search_path``): each table's rows ``unnest``-ed from one array per column (binds
    ``m_{column}`` and ``c_{column}``; see :func:`turn_params`).

    An array per column, not a placeholder per value: the statement's text and its number of
    parameters stay the same whatever the number of calls and small enough (at most 50
    parameters) for psycopg to cache its conversion of the query, which for a
    placeholder per value (some 150 for a turn of 3 calls) it parsed again at every commit:
    more than half of a commit's time in Python. A text statement with typed binds
    (SQLAlchemy caches its compiled form); each element is bound as its column's type (the
    codec's encodings, JSON)."""
    quote = _QUOTE.quote

    def insert(table: sa.Table, columns: tuple[str, ...], prefix: str) -> str:
        name = quote(table.name) if schema is None else f"{quote(schema)}.{quote(table.name)}"
        arrays = ", ".join(f"CAST(:{prefix}_{c} AS {_array_type(table, c)})" for c in columns)
        return (
            f"INSERT INTO {name} ({', '.join(quote(c) for c in columns)}) "
            f"SELECT * FROM unnest({arrays})"
        )

    sql = insert(MESSAGES, message_columns, "m")
    binds = [_array_bind(MESSAGES, c, f"m_{c}") for c in message_columns]
    if call_columns:  # a turn with calls
        sql = f"WITH written_calls AS ({insert(TOOL_CALLS, call_columns, 'c')}) {sql}"
        binds += [_array_bind(TOOL_CALLS, c, f"c_{c}") for c in call_columns]
    return sa.text(sql).bindparams(*binds)


def _array_type(table: sa.Table, column: str) -> str:
    """The SQL type of an array of ``column``'s values (``TEXT[]``, ``JSON[]``, ...)."""
    return f"{table.c[column].type.compile(dialect=_PG)}[]"


def _array_bind(table: sa.Table, column: str, name: str) -> sa.BindParameter[Any]:
    """A bind of a list of ``column``'s values, each processed as the column's type."""
    # one dimension: a JSON value that is a list is an element, not a nested array
    return sa.bindparam(name, type_=postgresql.ARRAY(table.c[column].type, dimensions=1))


#: quotes identifiers as PostgreSQL needs them, and renders its types
_PG: Final = postgresql.dialect()  # type: ignore[no-untyped-call]
_QUOTE: Final = _PG.identifier_preparer


def turn_params(
    prefix: str, columns: Sequence[str], rows: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The bind values of ``rows`` for :func:`insert_turn` (``prefix`` ``m`` or ``c``): a list
    per column, a row's value or NULL where the row lacks the column."""
    return {f"{prefix}_{c}": [row.get(c) for row in rows] for c in columns}
