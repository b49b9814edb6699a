"""Database URLs and every engine of the store, built in one place.

The factories live here; the URLs they take are :mod:`fsm.store.engine_urls` and the settings
they configure an engine with :mod:`fsm.store.engine_config` (this module re-exports the public
names of both, so ``from fsm.store.engine import normalize_url`` works as before).

Four kinds of engine, each from one function here, sharing the connection settings below:

* :func:`create_engine`: the store's engine (writes; migrations use it with foreign keys off);
* :func:`create_readonly_engine`: an engine the database itself refuses writes on (audits,
  :func:`fsm.store.audit.open_readonly`);
* :func:`create_async_engine`: the asyncio engine of :mod:`fsm.store.aio`, configured like
  :func:`create_engine`;
* :func:`create_probe_engine`: no settings at all, one connection, for reading a database's
  revision without changing it (:func:`fsm.store.migrate.current_revision`).

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
mapped to it). Nothing is set per session: a setting made when a connection opens does not
survive a transaction-pooling proxy (PgBouncer's ``pool_mode = transaction`` hands each
transaction whatever server connection is free), so what fsm needs is set inside its own
transactions (``SET LOCAL``, ``SET TRANSACTION``; see :data:`_POSTGRES_SETTINGS`). Every
PostgreSQL connection made here has bounded waits (see :func:`postgres_connect_args`): a connect
timeout, TCP keepalives and ``tcp_user_timeout``, so a dead server or route is noticed by the
kernel; a store engine with a ``timeout`` also sets, per transaction with ``SET LOCAL``,
``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout`` to it (less
a margin: :func:`server_deadline_ms`), so the server gives up on its own and frees a vanished
client's locks. Each kind's settings are one ``_Profile``; :func:`build_engine` and
:func:`configure` are the only places an engine is made and set up.

A host application's own engine is set up for fsm by :func:`configure_engine` (SQLite: the same
pragmas and transaction handling as fsm's engines; PostgreSQL: nothing to do), which
``ConversationStore(engine=...)`` requires on SQLite.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING, Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy import pool
from sqlalchemy.engine import URL, Connection, Engine

from fsm.store import faults
from fsm.store.deadline import DEFAULT_TIMEOUT
from fsm.store.engine_config import (
    BUSY_TIMEOUT_SECONDS,
    CONFIGURED,
    READONLY_PROFILE,
    EngineNotConfiguredError,
    build_engine,
    configure,
    configured_engines,
    dumps_json,
    make_parent,
    pool_kwargs,
    postgres_kwargs,
    sa_engine,
    search_path_per_transaction,
    sqlite_kwargs,
    store_profile,
)

# defined in the modules of URLs and of engine configuration; importable from here as before
from fsm.store.engine_config import CONNECT_TIMEOUT_SECONDS as CONNECT_TIMEOUT_SECONDS
from fsm.store.engine_config import POOL_SIZE as POOL_SIZE
from fsm.store.engine_config import WRITE as WRITE
from fsm.store.engine_config import postgres_connect_args as postgres_connect_args
from fsm.store.engine_config import server_deadline_ms as server_deadline_ms
from fsm.store.engine_urls import ENGINE_URL_OPTIONS as ENGINE_URL_OPTIONS
from fsm.store.engine_urls import NewFile as NewFile
from fsm.store.engine_urls import async_url, normalize_url, readonly_sqlite_url, url_options
from fsm.store.engine_urls import default_url as default_url
from fsm.store.engine_urls import display_url as display_url
from fsm.store.engine_urls import display_url_text as display_url_text
from fsm.store.engine_urls import engine_url_options as engine_url_options
from fsm.store.engine_urls import new_sqlite_file as new_sqlite_file
from fsm.store.engine_urls import removed_if_failed as removed_if_failed
from fsm.store.engine_urls import require_existing as require_existing
from fsm.store.engine_urls import sync_url as sync_url
from fsm.store.errors import (
    AuditError,
    StoreLayoutError,
)
from fsm.store.urls import sqlite_file

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: an engine, sync or asyncio (what :func:`configure_engine` takes and returns)
_E = TypeVar("_E", "Engine", "AsyncEngine")


__all__ = [
    "BUSY_TIMEOUT_SECONDS",
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_TIMEOUT",
    "ENGINE_URL_OPTIONS",
    "POOL_SIZE",
    "SCHEMA_ENV",
    "WRITE",
    "EngineNotConfiguredError",
    "NewFile",
    "async_url",
    "configure_engine",
    "create_async_engine",
    "create_engine",
    "create_probe_engine",
    "create_readonly_engine",
    "default_url",
    "display_url",
    "display_url_text",
    "dumps_json",
    "engine_url_options",
    "is_configured",
    "new_sqlite_file",
    "normalize_url",
    "postgres_connect_args",
    "removed_if_failed",
    "require_existing",
    "schema_of",
    "server_deadline_ms",
    "sqlite_file",
    "store_schema",
    "sync_url",
]

# -- the PostgreSQL schema of fsm's tables -----------------------------------------------------
#: the environment variable naming the PostgreSQL schema of fsm's tables when ``schema=None``.
SCHEMA_ENV: Final = "FSM_SCHEMA"

#: a schema name fsm accepts: a lower-case SQL identifier (it is quoted in every statement).
_SCHEMA_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")


def store_schema(schema: str | None, url: str | URL | None) -> str | None:
    """The PostgreSQL schema holding fsm's tables, functions and version table.

    ``schema`` if given, else ``$FSM_SCHEMA`` if set, else ``None`` (the session's
    ``search_path`` decides, as before schemas existed). Raises
    :class:`~fsm.store.errors.StoreLayoutError` for a name that is not a lower-case identifier
    (at most 63 characters, not starting with ``pg_``) or for a schema on another engine than
    PostgreSQL (SQLite keeps fsm's tables in its own file: use a file of their own).
    """
    name = schema if schema is not None else (os.environ.get(SCHEMA_ENV) or None)
    if name is None:
        return None
    if not _SCHEMA_NAME.match(name) or name.startswith("pg_"):
        raise StoreLayoutError(
            f"the schema name {name!r} is not a lower-case identifier (a-z, 0-9, _; at most 63 "
            "characters, not starting with a digit or pg_): choose another"
        )
    backend = normalize_url(url).get_backend_name()
    if backend != "postgresql":
        raise StoreLayoutError(
            f"a schema for fsm's tables ({name!r}, from schema= or ${SCHEMA_ENV}) is a PostgreSQL "
            f"feature; {backend} keeps them in the database itself: give fsm a database (file) "
            f"of its own, or drop the schema option"
        )
    return name


def schema_of(connectable: Engine | Connection) -> str | None:
    """The schema an engine or connection made here puts fsm's tables in (``None``: the
    ``search_path``), as read from its ``schema_translate_map``."""
    translate = connectable.get_execution_options().get("schema_translate_map") or {}
    schema: str | None = translate.get(None)
    return schema


def _in_schema(engine: Engine, schema: str | None) -> Engine:
    """``engine`` with fsm's tables (which the models name without a schema) in ``schema``."""
    if schema is None:
        return engine
    return engine.execution_options(schema_translate_map={None: schema})


def create_engine(
    url: str | URL | None = None,
    *,
    foreign_keys: bool = True,
    busy_timeout: float = BUSY_TIMEOUT_SECONDS,
    schema: str | None = None,
    timeout: float | None = None,
    one_query: bool = True,
    **kwargs: Any,
) -> Engine:
    """Create an engine for the store (``None`` means :func:`default_url`).

    ``busy_timeout``: how many seconds a SQLite writer waits for another writer's lock.
    ``timeout``: PostgreSQL, the server-side deadline of every transaction in seconds
    (``statement_timeout``, ``lock_timeout``, ``idle_in_transaction_session_timeout``, set with
    ``SET LOCAL`` semantics), and the connect, keepalive and ``tcp_user_timeout`` bounds of
    :func:`postgres_connect_args`; ``None``: no per-transaction deadline (migrations).
    ``foreign_keys=False`` leaves SQLite's foreign keys off (only migrations want that: Alembic's
    batch mode copies tables). ``schema``: the PostgreSQL schema of fsm's tables (see
    :func:`store_schema`; applied as a ``schema_translate_map``, nothing is set on the session).
    ``one_query=False`` (PostgreSQL): every write goes statement by statement (``BEGIN``, the
    lock, the reading and the insert, ``COMMIT``) instead of the one query that the server
    commits as it ends in the common case of ``commit_turn`` and the tool ledger's ``begin``
    and ``commit``: 4 round trips instead of 1, and a connection lost before ``COMMIT`` is then
    a known outcome (nothing written) rather than :class:`~fsm.store.errors.CommitOutcomeUnknownError`
    (for turns with neither a response id nor an idempotency key, whose retry cannot be
    recognised). Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """
    parsed, kwargs = url_options(normalize_url(url), kwargs)
    in_schema = store_schema(schema, parsed)
    kwargs.setdefault("json_serializer", dumps_json)
    kwargs = pool_kwargs(parsed, kwargs)
    if parsed.get_backend_name() == "sqlite":
        make_parent(parsed)
    profile = store_profile(
        foreign_keys=foreign_keys, busy_timeout=busy_timeout, timeout=timeout, one_query=one_query
    )
    engine = build_engine(parsed, profile, postgres_kwargs(parsed, kwargs, timeout), busy_timeout)
    return _in_schema(engine, in_schema)


def create_readonly_engine(
    url: str | URL | None = None, *, schema: str | None = None, **kwargs: Any
) -> Engine:
    """An engine on the database at ``url`` (``None``: the default) that cannot write.

    SQLite is opened through a ``file:PATH?mode=ro`` URI: a missing file raises
    :class:`~fsm.store.errors.DatabaseNotFoundError` (it is never created), an in-memory database
    :class:`~fsm.store.errors.AuditError`, and every write fails with "attempt to write a
    readonly database"; text that is not UTF-8 reads as text (errors replaced), never an error.
    PostgreSQL transactions begin with ``SET TRANSACTION READ ONLY`` (see
    :data:`_POSTGRES_READONLY_TRANSACTION`; per transaction, so a pooling proxy never hands the
    setting to another client): every write fails with "cannot execute ... in a read-only
    transaction". Transactions begin with a plain ``BEGIN`` (SQLite) so all statements
    of one see the same snapshot. Other backends raise :class:`~fsm.store.errors.AuditError`.
    The schema is not checked here (:func:`fsm.store.audit.open_readonly` does). ``schema``
    (see :func:`store_schema`) is applied as a ``schema_translate_map`` and, for the audit's raw
    SQL, as the ``search_path`` of each transaction (``set_config(..., true)``: local to the
    transaction, safe behind a transaction pooler). Extra keyword arguments go to
    :func:`sqlalchemy.create_engine`.
    """
    parsed, kwargs = url_options(normalize_url(url), kwargs)
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise AuditError(f"fsm audits SQLite and PostgreSQL stores, not {backend} ({parsed})")
    in_schema = store_schema(schema, parsed)
    target = readonly_sqlite_url(parsed) if backend == "sqlite" else parsed
    # no per-transaction deadline (a check of a large store scans for minutes), but bounded
    # connects and a dead peer noticed
    kwargs = postgres_kwargs(target, kwargs, None)
    engine = build_engine(target, READONLY_PROFILE, kwargs, BUSY_TIMEOUT_SECONDS)
    if in_schema is not None:
        search_path_per_transaction(engine, in_schema)
    return _in_schema(engine, in_schema)


def create_async_engine(
    url: str | URL | None = None,
    *,
    busy_timeout: float = BUSY_TIMEOUT_SECONDS,
    schema: str | None = None,
    timeout: float | None = None,
    one_query: bool = True,
    **kwargs: Any,
) -> AsyncEngine:
    """An asyncio engine configured like :func:`create_engine` (``timeout`` and
    ``one_query`` as there).

    SQLite (``aiosqlite``): foreign keys on, WAL, ``synchronous=NORMAL``, the busy timeout, and
    transactions begun by fsm (``BEGIN IMMEDIATE`` for writes). PostgreSQL (psycopg): no
    session setting (transaction-pooling safe). JSON is written by :func:`dumps_json`. Extra
    keyword arguments go to SQLAlchemy's :func:`~sqlalchemy.ext.asyncio.create_async_engine`.
    ``schema``: as for :func:`create_engine`. (SQLAlchemy's asyncio layer is imported here, so a
    sync program never loads it.)
    """
    from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine

    parsed, kwargs = url_options(async_url(url), kwargs)
    in_schema = store_schema(schema, parsed)
    kwargs.setdefault("json_serializer", dumps_json)
    kwargs = pool_kwargs(parsed, kwargs)
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite:
        make_parent(parsed)
        kwargs = sqlite_kwargs(kwargs, busy_timeout)
    kwargs = postgres_kwargs(parsed, kwargs, timeout)
    engine = sa_engine(sa_create_async_engine, parsed, kwargs)
    if sqlite or engine.dialect.driver.startswith("psycopg"):  # not asyncpg: it differs
        profile = store_profile(
            foreign_keys=True, busy_timeout=busy_timeout, timeout=timeout, one_query=one_query
        )
        configure(engine.sync_engine, profile)
    faults.hook(engine.sync_engine)
    if in_schema is not None:
        engine = engine.execution_options(schema_translate_map={None: in_schema})
    return engine


def configure_engine(
    engine: _E, *, busy_timeout: float = BUSY_TIMEOUT_SECONDS, wal: bool = True
) -> _E:
    """Set up a host application's own engine (sync or asyncio) for fsm; returns it.

    Call it right after creating the engine. Called later, it still works: the connections the
    pool holds are closed (new ones get the settings), and a connection the host still has open
    is refused by the store with a message saying to open a new one. A second call on the same
    engine does nothing.

    SQLite (``pysqlite`` or ``aiosqlite``): every new connection gets ``PRAGMA foreign_keys=ON``
    (the store's contract lives partly in foreign keys) and ``PRAGMA busy_timeout`` (seconds a
    writer waits for another writer's lock); with ``wal`` (the default) also WAL journaling
    (readers never block the writer; it is a property of the database file) and
    ``synchronous=NORMAL``. The driver's own transaction handling is replaced by SQLAlchemy's
    documented recipe: transactions begin with a real ``BEGIN`` (so ``SAVEPOINT`` works, which
    the store uses inside a caller's transaction), and with ``BEGIN IMMEDIATE`` on a connection
    with the :data:`WRITE` execution option (``conn.execution_options(fsm_write=True)``), so
    two writers queue instead of one failing half-way. The host's own statements are unchanged.

    PostgreSQL: nothing to set. fsm sets what it needs inside its own transactions, so the
    engine may sit behind a transaction-pooling proxy (PgBouncer's ``pool_mode =
    transaction``). Other backends: nothing is done (fsm supports SQLite and PostgreSQL).

    fsm's JSON columns are written with the engine's ``json_serializer`` (SQLAlchemy's default,
    :func:`json.dumps`, is fine: the store never hands it NaN or infinities; a serializer that
    refuses lone surrogates makes such a value a ``ValueRejectedError``).
    """
    sync_engine = engine if isinstance(engine, Engine) else engine.sync_engine
    if sync_engine in configured_engines:
        return engine
    if sync_engine.dialect.name == "sqlite":
        configure(
            sync_engine,
            store_profile(foreign_keys=True, busy_timeout=busy_timeout, wal=wal),
        )
    elif sync_engine.dialect.name == "postgresql":
        # the host's own transactions keep their JIT setting: only fsm's write transactions
        # (the WRITE option) get a setting of fsm's
        profile = store_profile(foreign_keys=True, busy_timeout=busy_timeout)
        configure(
            sync_engine,
            dataclasses.replace(profile, postgres_every_transaction=None, postgres_own_begin=False),
        )
    # connections opened before this call lack the settings: the pool's are closed (a new
    # pool takes their place), one still checked out is refused by require_configured
    sync_engine.dispose()
    configured_engines.add(sync_engine)
    return engine


def is_configured(connection: Connection) -> bool:
    """Whether ``connection`` was opened by an engine set up for fsm (one of fsm's own, or one
    given to :func:`configure_engine`). PostgreSQL connections always are: fsm needs no session
    setting there."""
    if connection.dialect.name != "sqlite":
        return True
    return bool(connection.info.get(CONFIGURED))


def require_configured(connection: Connection) -> None:
    """Raise :class:`EngineNotConfiguredError` unless :func:`is_configured`."""
    if not is_configured(connection):
        if connection.engine in configured_engines:
            raise EngineNotConfiguredError(
                "this connection was opened before fsm.store.configure_engine(engine) was "
                "called, so it lacks fsm's settings (foreign keys, transactions): open a new one "
                "(engine.connect() / engine.begin()) for fsm's work"
            )
        raise EngineNotConfiguredError(
            "this SQLite engine was not set up for fsm (its connections have foreign keys off "
            "and the driver's own transaction handling): call "
            "fsm.store.configure_engine(engine) right after creating it"
        )


def create_probe_engine(url: str | URL | None = None) -> Engine:
    """An engine with no settings and no pool, for looking at a database without changing it
    (no journal mode, no foreign keys, no directory created): reading its revision."""
    parsed, kwargs = url_options(normalize_url(url), {"poolclass": pool.NullPool})
    engine = sa_engine(sa.create_engine, parsed, postgres_kwargs(parsed, kwargs, None))
    faults.hook(engine)
    return engine
