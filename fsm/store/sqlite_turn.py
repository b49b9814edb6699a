"""SQLite: a turn's rows bound before ``BEGIN IMMEDIATE``, so that the write lock is held for
the inserts and little else.

SQLite has one writer at a time, and every other writer (threads of this process, other
processes) waits while the lock is held. SQLAlchemy's execution of a Core ``INSERT`` (the
compiled cache, the bind processing of each value: JSON, the codec's text) costs several
times SQLite's own work for it; done under the lock, that Python work is what the others wait
for. :func:`bind_turn` does it before the transaction: each table's rows built for seq 1,
every value processed as its column's type, the ``INSERT`` written once per table and set of
columns. Under the lock :meth:`BoundTurn.write` only moves the seq columns to the seq the
conversation's state gives (:func:`fsm.store.writes.at_seq`) and sends each table's rows with
``executemany`` through :meth:`~sqlalchemy.engine.Connection.exec_driver_sql` (the engine's
events and error handling see them as any statement).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect

from fsm.store import writes
from fsm.store.core import turn_rows
from fsm.store.plans import TurnPlan

__all__ = ["BoundTurn", "bind_turn"]


@dataclass(frozen=True, slots=True)
class _Insert:
    """One table's rows of a turn: the statement, and each row's values in its order (the seq
    columns as built for seq 1, the others processed as their column's type)."""

    sql: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True, slots=True)
class BoundTurn:
    """A turn's rows, bound (see the module): :meth:`write` inserts them at a seq."""

    inserts: tuple[_Insert, ...]

    def write(self, conn: Connection, seq: int) -> None:
        """Insert the turn at ``seq``: the assistant message, its calls, their results."""
        for insert in self.inserts:
            rows = [writes.at_seq(insert.columns, row, seq) for row in insert.rows]
            conn.exec_driver_sql(insert.sql, rows if len(rows) > 1 else rows[0])


def bind_turn(
    dialect: Dialect,
    schema: str | None,
    conversation_id: str,
    plan: TurnPlan,
    idempotency_key: str | None,
) -> BoundTurn:
    """The rows of ``plan`` bound for ``dialect`` (SQLite), in ``schema`` (``None``: the
    main database): see the module. A value its column's type cannot take raises
    :class:`sqlalchemy.exc.StatementError`, as it would at execution."""
    message, call_rows, result_rows = turn_rows(conversation_id, plan, 1, idempotency_key)
    tables: list[tuple[sa.Table, list[dict[str, Any]]]] = [(writes.MESSAGES, [message])]
    if call_rows:
        tables += [(writes.TOOL_CALLS, call_rows), (writes.MESSAGES, result_rows)]
    inserts = []
    for table, rows in tables:
        columns = tuple(rows[0])
        sql = writes.insert_values(schema, table, columns)
        inserts.append(_Insert(sql, columns, _bound(dialect, table, columns, rows)))
    return BoundTurn(tuple(inserts))


def _bound(
    dialect: Dialect, table: sa.Table, columns: tuple[str, ...], rows: list[dict[str, Any]]
) -> tuple[tuple[Any, ...], ...]:
    """``rows``' values of ``columns``, each processed as its column's type."""
    processors = _processors(dialect, table, columns)
    try:
        return tuple(
            tuple(
                value if process is None or value is None else process(value)
                for process, value in zip(processors, (row[c] for c in columns), strict=True)
            )
            for row in rows
        )
    except Exception as exc:  # as SQLAlchemy raises it at execution
        raise sa.exc.StatementError(str(exc), None, None, exc) from exc


@functools.lru_cache(maxsize=64)
def _processors(
    dialect: Dialect, table: sa.Table, columns: tuple[str, ...]
) -> tuple[Callable[[Any], Any] | None, ...]:
    """Each column's bind processor for ``dialect`` (``None``: the value goes as it is; the seq
    columns are integers, which SQLite's driver takes as they are)."""
    found = tuple(table.c[c].type.bind_processor(dialect) for c in columns)
    moved = [
        c
        for c, p in zip(columns, found, strict=True)
        if p is not None and c in writes.MOVED_COLUMNS
    ]
    assert not moved, f"a seq column with a bind processor: {moved}"
    return found
