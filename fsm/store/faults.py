"""Driver errors turned into the store's typed errors: one table, by code, never by message.

Every engine fsm builds (:mod:`fsm.store.engine`: the store's, the read-only, the async and the
probe engines) has a SQLAlchemy ``handle_error`` hook that calls :func:`translate` once for each
driver error, on connect and on every statement, sync or async. When the error has a typed
meaning the hook raises the typed error instead, with the driver's own error chained as
``__cause__``; otherwise the SQLAlchemy error goes on as it is (the store's own
``StoreCore.translate`` then types a refused value, a constraint or a lost race).

The decision is made by code, never by the message text:

* **SQLite**: the result code of the ``sqlite3`` exception (``sqlite_errorcode``; its primary
  code, the low byte), in :data:`SQLITE_FAULTS`; an I/O error (``SQLITE_IOERR``) is a full
  store when the file size limit or the filesystem's free space says so (the ``EFBIG`` of a
  write past ``RLIMIT_FSIZE`` reaches SQLite as an I/O error), else a file that cannot be used;
* **PostgreSQL**: the SQLSTATE of the psycopg exception (``sqlstate``), exact codes in
  :data:`SQLSTATE_FAULTS`, then whole classes (the first two characters) in
  :data:`SQLSTATE_CLASS_FAULTS`. A failed *connect* has no SQLSTATE (libpq reports it before
  any session exists): it is :class:`~fsm.store.errors.StoreUnavailableError`, unless a probe of
  the server's ``postgres`` database shows that the database named in the URL does not exist
  (:class:`~fsm.store.errors.DatabaseNotFoundError`), or the server (or PgBouncer) refused it
  for want of a connection slot (:class:`~fsm.store.errors.ServerFullError`). That last case is
  the one decision made on the text: libpq hands over the server's ``FATAL`` of a refused
  startup (SQLSTATE 53300 on the wire) as a message only, so :data:`_FULL_AT_CONNECT` lists the
  phrases of PostgreSQL 12-17 and PgBouncer (English server messages: ``lc_messages``).

Some outcomes also drop connections (:data:`DROP_CONNECTION`): a write on a read-only node
(25006, after a failover the old primary or a standby) invalidates the whole pool so that the
next call connects again (a multi-host URL with ``target_session_attrs=read-write`` then finds
the new primary); a prepared statement that a pooler mixed up (26000, 42P05) drops the one
connection.

A connection lost on a statement-less operation of an open connection (COMMIT or ROLLBACK) is
left untyped here: whether a COMMIT in flight was stored is its own question (issue 20).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import URL

from fsm.store.errors import (
    DatabaseCorruptError,
    DatabaseFileError,
    DatabaseNotFoundError,
    DatabaseUrlError,
    PoolerError,
    ReadOnlyNodeError,
    ServerFullError,
    StorageFullError,
    StoreBusyError,
    StoreError,
    StoreUnavailableError,
)
from fsm.store.urls import sqlite_file

__all__ = [
    "DROP_CONNECTION",
    "SQLITE_FAULTS",
    "SQLSTATE_CLASS_FAULTS",
    "SQLSTATE_FAULTS",
    "Fault",
    "driver_error",
    "hook",
    "sqlite_busy",
    "translate",
]


@dataclass(frozen=True, slots=True)
class Fault:
    """What :func:`translate` knows of one driver error when it builds the typed error."""

    #: the database URL, password masked
    url: str
    #: the SQLite file (``None``: PostgreSQL, or an in-memory database)
    path: Path | None
    #: the driver's message, on one line
    reason: str
    #: whether the error came from opening a connection (no session yet)
    connecting: bool


Make = Callable[[Fault], StoreError]


# -- the typed errors, one builder per outcome -----------------------------------------------
def _busy(fault: Fault) -> StoreError:
    return StoreBusyError(
        f"the database {fault.url} stayed locked by another writer ({fault.reason}); retry later"
    )


def _unavailable(fault: Fault) -> StoreError:
    where = "could not be reached" if fault.connecting else "stopped answering"
    return StoreUnavailableError(
        f"the database {fault.url} {where} ({fault.reason}): nothing was written; check that "
        "the server is running and the URL is right, then retry"
    )


def _server_full(fault: Fault) -> StoreError:
    return ServerFullError(
        f"the database server of {fault.url} is running but has no connection slot left "
        f"({fault.reason}): nothing was written; retry later, and keep the connections of every "
        "process (each store's pool_size + max_overflow, 16 + 10 by default) below the "
        "server's max_connections less superuser_reserved_connections, or put PgBouncer in "
        "front (see the production guide)"
    )


def _read_only_node(fault: Fault) -> StoreError:
    return ReadOnlyNodeError(
        f"the database server of {fault.url} accepts no writes ({fault.reason}): it is a hot "
        "standby, or was the primary before a failover; nothing was written. The store's "
        "connections were dropped: retry (a multi-host URL with target_session_attrs=read-write "
        "then connects to the new primary), and point writers at the primary, not a replica"
    )


def _pooler_prepared(fault: Fault) -> StoreError:
    return PoolerError(
        f"a prepared statement was missing or already there on the server session of "
        f"{fault.url} ({fault.reason}): a transaction-pooling proxy (PgBouncer pool_mode = "
        "transaction) handed this client another client's server session; nothing was "
        "written. fsm prepares no statement by default: remove prepare_threshold from the URL "
        "(or the engine's connect_args), or use PgBouncer 1.21+ with max_prepared_statements "
        "> 0; then retry"
    )


def _protocol(fault: Fault) -> StoreError:
    return PoolerError(
        f"the connection to {fault.url} was refused or ended by a pooler or a server that broke "
        f"the protocol ({fault.reason}): nothing was written; if PgBouncer sits in front, check "
        "its limits (max_client_conn, default_pool_size, query_wait_timeout) and that it "
        "reaches the server; then retry"
    )


def _full(fault: Fault) -> StoreError:
    return StorageFullError(
        f"the database {fault.url} is full ({fault.reason}): nothing was written; free disk "
        "space, then retry"
    )


def _corrupt(fault: Fault) -> StoreError:
    return DatabaseCorruptError(
        f"the database {fault.url} is corrupt ({fault.reason}): restore it from a backup "
        f"(fsm audit check --db '{fault.url}' lists what can still be read)"
    )


def _not_a_database(fault: Fault) -> StoreError:
    path = fault.path or fault.url
    return DatabaseFileError(
        f"{path} is not a SQLite database ({fault.reason}): give the path of an fsm database, "
        "or a new file name to create one",
        path=None if fault.path is None else str(fault.path),
    )


def _cannot_open(fault: Fault) -> StoreError:
    path = fault.path
    if path is None:
        return _unavailable(fault)
    if path.is_dir():
        why = "it is a directory"
    elif not path.exists():
        why = "it does not exist and its directory cannot be written"
    else:
        why = "it cannot be opened"
    return DatabaseFileError(
        f"cannot open the SQLite database {path}: {why} ({fault.reason}); give a file path "
        "you can write",
        path=str(path),
    )


def _read_only(fault: Fault) -> StoreError:
    path = fault.path or fault.url
    return DatabaseFileError(
        f"the SQLite database {path} is read-only ({fault.reason}): nothing was written; make "
        "the file and its directory writable, or give another --db",
        path=None if fault.path is None else str(fault.path),
    )


#: below this many free bytes a filesystem counts as full (SQLite writes pages of up to 64 KiB)
_NO_ROOM: Final = 64 * 1024


def _no_room(path: Path) -> str | None:
    """Why a write to the SQLite file ``path`` (or its WAL / journal) could not get room, or
    ``None``: the process's file size limit (``RLIMIT_FSIZE``: SQLite reports the ``EFBIG``
    of a write past it as an I/O error, not as ``SQLITE_FULL``) or a filesystem out of space
    for this user."""
    import resource

    sizes = []
    for suffix in ("", "-wal", "-journal"):
        with contextlib.suppress(OSError):
            sizes.append(Path(f"{path}{suffix}").stat().st_size)
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and sizes and max(sizes) + _NO_ROOM >= soft:
        return f"the file size limit of {soft} bytes (ulimit -f) is reached"
    with contextlib.suppress(OSError):
        stat = os.statvfs(path.parent)
        if stat.f_bavail * stat.f_frsize < _NO_ROOM:
            return f"the filesystem of {path.parent} has no space left"
    return None


def _io_error(fault: Fault) -> StoreError:
    """SQLITE_IOERR: :class:`StorageFullError` when :func:`_no_room` finds why, else
    :class:`DatabaseFileError` (the file could not be read or written)."""
    if fault.path is not None:
        why = _no_room(fault.path)
        if why is not None:
            return StorageFullError(
                f"the database {fault.url} is full: {why} ({fault.reason}); nothing was "
                "written; make room (or raise the limit), then retry"
            )
    path = fault.path or fault.url
    return DatabaseFileError(
        f"the SQLite database {path} could not be read or written ({fault.reason}): check the "
        "disk and the file system, then retry",
        path=None if fault.path is None else str(fault.path),
    )


def _timed_out(fault: Fault) -> StoreError:
    return StoreUnavailableError(
        f"the database {fault.url} did not finish within the store's deadline ({fault.reason}): "
        "nothing was written; retry later, or give the store a longer timeout="
    )


def _login_refused(fault: Fault) -> StoreError:
    return DatabaseUrlError(
        f"the server refused the login of {fault.url} ({fault.reason}): check the user and "
        "password in the URL"
    )


def _missing_database(fault: Fault) -> StoreError:
    return DatabaseNotFoundError(
        f"the database {fault.url} does not exist ({fault.reason}): create it "
        "(createdb NAME), or fix the database name in the URL"
    )


# -- the table -------------------------------------------------------------------------------
#: SQLite primary result codes (``sqlite_errorcode & 0xFF``) and what they mean.
SQLITE_FAULTS: Final[Mapping[int, Make]] = {
    5: _busy,  # SQLITE_BUSY
    6: _busy,  # SQLITE_LOCKED
    8: _read_only,  # SQLITE_READONLY
    10: _io_error,  # SQLITE_IOERR (full when the file size limit or the disk says so)
    11: _corrupt,  # SQLITE_CORRUPT
    13: _full,  # SQLITE_FULL
    14: _cannot_open,  # SQLITE_CANTOPEN
    26: _not_a_database,  # SQLITE_NOTADB
}
#: SQLite codes a read-only engine leaves untyped (its refusal of writes is the point).
_READONLY_EXPECTED: Final = frozenset({8})
#: the same for PostgreSQL SQLSTATEs (read_only_sql_transaction).
_READONLY_EXPECTED_SQLSTATES: Final = frozenset({"25006"})

#: PostgreSQL SQLSTATEs, exact.
SQLSTATE_FAULTS: Final[Mapping[str, Make]] = {
    "3D000": _missing_database,  # invalid_catalog_name
    "40001": _busy,  # serialization_failure
    "40P01": _busy,  # deadlock_detected
    "55P03": _busy,  # lock_not_available
    "53000": _full,  # insufficient_resources
    "53100": _full,  # disk_full
    "53200": _full,  # out_of_memory
    "53300": _server_full,  # too_many_connections
    "08P01": _protocol,  # protocol_violation: PgBouncer's own errors
    "25006": _read_only_node,  # read_only_sql_transaction (hot standby, demoted primary)
    "26000": _pooler_prepared,  # invalid_sql_statement_name: prepared statement missing
    "42P05": _pooler_prepared,  # duplicate_prepared_statement
    "57014": _timed_out,  # query_canceled (statement_timeout)
    "57P01": _unavailable,  # admin_shutdown
    "57P02": _unavailable,  # crash_shutdown
    "57P03": _unavailable,  # cannot_connect_now
    "57P05": _unavailable,  # idle_session_timeout
    "XX001": _corrupt,  # data_corrupted
    "XX002": _corrupt,  # index_corrupted
}
#: PostgreSQL SQLSTATE classes (the first two characters), when no exact code matched.
SQLSTATE_CLASS_FAULTS: Final[Mapping[str, Make]] = {
    "08": _unavailable,  # connection_exception
    "28": _login_refused,  # invalid_authorization_specification, invalid_password
}
#: the outcomes that mean "the connection is gone" (left untyped on COMMIT / ROLLBACK).
_CONNECTION_LOST: Final = frozenset({_unavailable})
#: SQLSTATEs whose connection is dropped: ``True`` drops every connection of the pool (the
#: server is the wrong one), ``False`` only the one that failed (its session is unusable).
DROP_CONNECTION: Final[Mapping[str, bool]] = {"25006": True, "26000": False, "42P05": False}
#: what a refused connect says when the server (or PgBouncer) has no slot left: PostgreSQL's
#: "sorry, too many clients already" and "remaining connection slots are reserved for ..."
#: (12-17), PgBouncer's "no more connections allowed (max_client_conn)"
_FULL_AT_CONNECT: Final = (
    "too many clients already",
    "remaining connection slots are reserved",
    "no more connections allowed",
)

#: what a refused login says at connect (libpq gives it no SQLSTATE): an unknown role, a wrong
#: password, no pg_hba.conf line for this client; retrying cannot help, the URL must change
_LOGIN_REFUSED_AT_CONNECT: Final = (
    "does not exist",  # FATAL:  role "x" does not exist (a missing database is told apart first)
    "password authentication failed",
    "no pg_hba.conf entry",
    "authentication failed",
)


# -- the translation -------------------------------------------------------------------------
def driver_error(exc: BaseException) -> BaseException:
    """The driver's own exception behind ``exc`` (``exc.orig`` of a SQLAlchemy error, followed
    through an async adapter's chain to the exception that carries the code)."""
    error: BaseException = getattr(exc, "orig", None) or exc
    seen = 0
    while seen < 5 and not _has_code(error):
        inner = error.__cause__ or error.__context__
        if inner is None:
            break
        error, seen = inner, seen + 1
    return error if _has_code(error) else getattr(exc, "orig", None) or exc


def sqlite_busy(exc: BaseException) -> bool:
    """Whether ``exc`` (the driver's error, or SQLAlchemy's or a typed one chained to it) is
    SQLite's: the database is locked by another connection (``SQLITE_BUSY``, ``SQLITE_LOCKED``),
    decided by its result code as :func:`translate` decides."""
    code = getattr(driver_error(exc), "sqlite_errorcode", None)
    return isinstance(code, int) and SQLITE_FAULTS.get(code & 0xFF) is _busy


def _has_code(error: BaseException) -> bool:
    return (
        getattr(error, "sqlite_errorcode", None) is not None
        or getattr(error, "sqlstate", None) is not None
    )


def translate(
    exc: sa.exc.DBAPIError,
    url: str | URL,
    *,
    connecting: bool = False,
    readonly: bool = False,
) -> StoreError | None:
    """The typed store error ``exc`` means, or ``None`` to let it go on as it is.

    ``url`` is the engine's URL; ``connecting`` says the error came from opening a connection;
    ``readonly`` that the engine refuses writes on purpose (its SQLITE_READONLY stays untyped).
    The caller raises the result ``from`` the driver's error.
    """
    parsed = sa.make_url(url)
    orig = driver_error(exc)
    fault = Fault(
        url=parsed.render_as_string(hide_password=True),
        path=_sqlite_path(parsed),
        reason=" ".join(str(orig).split()) or type(orig).__name__,
        connecting=connecting,
    )
    make = _lookup(orig, parsed, connecting=connecting, readonly=readonly)
    if make is None:
        return None
    if make in _CONNECTION_LOST and exc.statement is None and not connecting:
        return None  # COMMIT / ROLLBACK on a lost connection: not decided here (issue 20)
    return make(fault)


def _lookup(orig: BaseException, url: URL, *, connecting: bool, readonly: bool) -> Make | None:
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(code, int):
        primary = code & 0xFF
        if readonly and primary in _READONLY_EXPECTED:
            return None
        return SQLITE_FAULTS.get(primary)
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        if readonly and sqlstate in _READONLY_EXPECTED_SQLSTATES:
            return None
        return SQLSTATE_FAULTS.get(sqlstate) or SQLSTATE_CLASS_FAULTS.get(sqlstate[:2])
    if url.get_backend_name() == "postgresql" and _is_operational(orig):
        if connecting and any(phrase in str(orig) for phrase in _FULL_AT_CONNECT):
            return _server_full
        if connecting and _database_missing(url):
            return _missing_database
        if connecting and _login_refused_text(str(orig)):
            return _login_refused
        return _unavailable  # no session, no SQLSTATE: refused, unreachable, reset
    return None


def _login_refused_text(text: str) -> bool:
    return any(phrase in text for phrase in _LOGIN_REFUSED_AT_CONNECT) and (
        "role " in text or "authentication" in text or "pg_hba.conf" in text
    )


def _is_operational(orig: BaseException) -> bool:
    return type(orig).__name__ == "OperationalError" or any(
        cls.__name__ == "OperationalError" for cls in type(orig).__mro__
    )


def _sqlite_path(url: URL) -> Path | None:
    return sqlite_file(url)


def _database_missing(url: URL) -> bool:
    """Whether the server answers on its ``postgres`` database and has no database named as
    in ``url`` (a failed connect says nothing machine-readable about why)."""
    name = url.database
    if not name or name == "postgres":
        return False
    probe = sa.create_engine(
        url.set(database="postgres").update_query_dict({"connect_timeout": "5"}),
        poolclass=sa.pool.NullPool,
    )
    try:
        with probe.connect() as conn:
            found = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
    except Exception:  # the probe is best effort: the server is then unavailable
        return False
    finally:
        probe.dispose()
    return found is None


def hook(engine: sa.Engine, *, readonly: bool = False) -> None:
    """Install the ``handle_error`` hook on ``engine`` (an async engine's ``sync_engine``)."""

    @sa.event.listens_for(engine, "handle_error")
    def _on_error(context: Any) -> StoreError | None:
        error = context.sqlalchemy_exception
        if not isinstance(error, sa.exc.DBAPIError):
            return None
        drop = DROP_CONNECTION.get(getattr(driver_error(error), "sqlstate", None) or "")
        if drop is not None and context.connection is not None and not readonly:
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = drop
        return translate(
            error,
            engine.url,
            connecting=context.connection is None,
            readonly=readonly,
        )
