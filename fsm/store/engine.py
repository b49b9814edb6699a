"""Database URLs and the engine factory of the store.

The database used when none is named is, in order:

* ``$FSM_DB_URL`` (any SQLAlchemy URL) if set, else
* the embedded SQLite file at ``$FSM_DB`` if set, else
* the embedded SQLite file ``./fsm.db`` in the current directory.

SQLite engines made here turn on, for every connection: ``PRAGMA foreign_keys=ON`` (the store's
contract lives partly in foreign keys), WAL journaling (readers never block the writer),
``synchronous=NORMAL`` (safe with WAL; a power loss can lose the last commits, never corrupt),
and a busy timeout. Transactions are begun by fsm itself: ``BEGIN IMMEDIATE`` for writes (so two
writers queue instead of failing half-way) and ``BEGIN`` for reads.

Every engine made here writes JSON columns with :func:`dumps_json`: ASCII-only text (U+0000 and
lone surrogates become ``\\u`` escapes, which PostgreSQL's ``json`` and SQLite's JSON functions
accept) and no ``NaN`` / ``Infinity`` (which neither accepts): a value that is not strict JSON
raises ``ValueError`` instead of being stored invalid.

PostgreSQL goes through psycopg 3 (``postgresql+psycopg://``; plain ``postgresql://`` URLs are
mapped to it), with ``plan_cache_mode = force_custom_plan`` for every session (see
:func:`_configure_postgres`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine

__all__ = [
    "BUSY_TIMEOUT_SECONDS",
    "WRITE",
    "create_engine",
    "default_url",
    "display_url",
    "dumps_json",
    "normalize_url",
]

#: how long (seconds) a SQLite writer waits for another writer's lock by default.
BUSY_TIMEOUT_SECONDS = 30.0

#: execution option that makes fsm begin a SQLite transaction with ``BEGIN IMMEDIATE``.
WRITE = "fsm_write"


def dumps_json(value: Any) -> str:
    """The JSON text stored for ``value`` (the engines' ``json_serializer``): ASCII escapes,
    ``ValueError`` for NaN and infinities."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


def default_url() -> str:
    """The database used when none is given (see the module docstring for the order)."""
    url = os.environ.get("FSM_DB_URL")
    if url:
        return url
    path = os.environ.get("FSM_DB") or "fsm.db"
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def normalize_url(url: str | URL | None) -> URL:
    """Parse ``url`` (``None`` means :func:`default_url`); ``postgresql://`` and
    ``postgres://`` select the psycopg 3 driver."""
    parsed = sa.make_url(default_url() if url is None else url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def display_url(url: str | URL) -> str:
    """The URL as text with any password masked (for messages)."""
    return sa.make_url(url).render_as_string(hide_password=True)


def create_engine(
    url: str | URL | None = None,
    *,
    foreign_keys: bool = True,
    busy_timeout: float = BUSY_TIMEOUT_SECONDS,
    **kwargs: Any,
) -> Engine:
    """Create an engine for the store (``None`` means :func:`default_url`).

    ``busy_timeout``: how many seconds a SQLite writer waits for another writer's lock.
    ``foreign_keys=False`` leaves SQLite's foreign keys off (only migrations want that: Alembic's
    batch mode copies tables). Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """
    parsed = normalize_url(url)
    kwargs.setdefault("json_serializer", dumps_json)
    if parsed.get_backend_name() == "postgresql":
        engine = sa.create_engine(parsed, **kwargs)
        _configure_postgres(engine)
        return engine
    if parsed.get_backend_name() != "sqlite":
        return sa.create_engine(parsed, **kwargs)
    database = parsed.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", busy_timeout)
    engine = sa.create_engine(parsed, connect_args=connect_args, **kwargs)
    _configure_sqlite(engine, foreign_keys=foreign_keys, busy_timeout=busy_timeout)
    return engine


def _configure_sqlite(engine: Engine, *, foreign_keys: bool, busy_timeout: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # fsm emits BEGIN itself (below); the driver must not begin transactions on its own.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        immediate = connection.get_execution_options().get(WRITE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _configure_postgres(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Plan each statement for the data at hand. PostgreSQL otherwise caches a generic plan
        # per session, and the foreign-key checks of a table that was tiny when the session
        # started keep a sequential scan as it grows: quadratic inserts on a fresh database.
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SET plan_cache_mode = force_custom_plan")
        finally:
            dbapi_connection.autocommit = autocommit
