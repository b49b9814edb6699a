"""Count the round trips a PostgreSQL engine makes: libpq traces every message of the
connections the engine checks out (``PGconn.trace``), and each round trip ends with one
``ReadyForQuery`` from the server (after a simple query, or after the ``Sync`` of an extended
one). The BEGIN and COMMIT psycopg sends on its own count too: they are round trips that
SQLAlchemy's statement events never see.

Usage::

    with round_trips(store.engine) as counted:
        store.commit_turn(...)
    counted.total  # the round trips made while the block ran
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import sqlalchemy as sa

__all__ = ["Counted", "round_trips"]


@dataclass
class Counted:
    """The round trips counted, and the frontend messages that opened each (``Query`` text
    or the statement of a ``Parse``)."""

    total: int = 0
    trace: list[str] = field(default_factory=list)


@contextmanager
def round_trips(engine: Any) -> Iterator[Counted]:
    """Count the round trips of ``engine``'s connections (psycopg: a sync engine, or an
    asyncio one) while the block runs."""
    import psycopg

    engine = getattr(engine, "sync_engine", engine)
    counted = Counted()
    traced: dict[int, IO[str]] = {}

    def on_checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by _read at checkin)
        traced[id(dbapi_connection)] = out
        pgconn = _driver(dbapi_connection).pgconn
        pgconn.trace(out.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)

    def on_checkin(dbapi_connection: Any, _record: Any) -> None:
        out = traced.pop(id(dbapi_connection), None)
        if out is None:
            return
        _driver(dbapi_connection).pgconn.untrace()
        _read(out, counted)

    sa.event.listen(engine, "checkout", on_checkout)
    sa.event.listen(engine, "checkin", on_checkin)
    try:
        yield counted
    finally:
        sa.event.remove(engine, "checkout", on_checkout)
        sa.event.remove(engine, "checkin", on_checkin)


def _driver(dbapi_connection: Any) -> Any:
    """psycopg's connection: itself, or the one SQLAlchemy's asyncio adaptation wraps."""
    return getattr(dbapi_connection, "driver_connection", dbapi_connection)


def _read(out: IO[str], counted: Counted) -> None:
    out.seek(0)
    for line in out:
        fields = line.rstrip("\n").split("\t")
        if len(fields) < 3:
            continue  # a statement's text goes on over several lines
        direction, _length, message, *rest = fields
        if direction == "B" and message == "ReadyForQuery":
            counted.total += 1
        elif direction == "F" and message in ("Query", "Parse"):
            counted.trace.append(" ".join(" ".join(rest).split())[:72])
    out.close()
