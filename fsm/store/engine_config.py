"""How the store's engines are configured (:mod:`fsm.store.engine`): the connection settings written once (per-engine profiles, PostgreSQL's per-transaction settings, SQLite's pragmas), the pool and driver arguments, and the connect and transaction hooks."""

from __future__ import annotations

import collections
import functools
import json
import math
import random
import re
import select
import sqlite3
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine

from fsm.store import faults
from fsm.store.deadline import DEFAULT_TIMEOUT, socket_fd
from fsm.store.errors import (
    DriverMissingError,
    StoreBusyError,
    StoreError,
)
from fsm.store.urls import sqlite_file

if TYPE_CHECKING:
    pass

#: what an SQLAlchemy engine factory returns
_T = TypeVar("_T")


#: how long (seconds) a SQLite writer waits for another writer's lock by default.
BUSY_TIMEOUT_SECONDS = 30.0

#: the longest a PostgreSQL connection attempt waits (seconds; less when the timeout is less).
CONNECT_TIMEOUT_SECONDS = 10

#: connections a store engine keeps open in its pool (SQLAlchemy's default is 5, and each
#: connection past them, up to 10 more, is closed when it is returned): 16 threads or tasks
#: writing at once keep their connections instead of reconnecting for every write
#: (bench/floor.py). A ``pool_size`` (or ``poolclass``) given to the factory wins.
POOL_SIZE = 16

#: execution option that makes fsm begin a SQLite transaction with ``BEGIN IMMEDIATE``.
WRITE = "fsm_write"

#: execution option of a connection, set before its transaction begins (PostgreSQL, an engine
#: in :data:`at_once_engines`): the transaction is one statement, sent in one round trip
#: together with the transaction's settings, and the server commits it as the statement ends
#: (no ``BEGIN``, no ``COMMIT``: a query of several statements is one implicit transaction).
#: See :func:`_at_once_statement`. When the connection cannot (a socket the server already
#: closed, a connection in autocommit) the transaction begins as any other
#: (:func:`began_at_once` tells which).
AT_ONCE: Final = "fsm_at_once"
#: execution option of the statement of an :data:`AT_ONCE` transaction: SQL run before it in
#: the same round trip, with the statement's own binds (``%(name)s``), as the
#: conversation's lock before the statement that reads and writes under it (each statement of
#: a query reads a fresh snapshot under READ COMMITTED, so the second sees what the writer the
#: lock waited for committed)
FIRST: Final = "fsm_first"

ASYNC_SQLITE: Final = "sqlite+aiosqlite"
SYNC_POSTGRES: Final = "postgresql+psycopg"

# -- the connection settings, written once -----------------------------------------------------
#: PostgreSQL, every session of the store's engines (sync and async): none. A session-level
#: ``SET`` does not survive transaction pooling (PgBouncer), so what fsm needs is set inside its
#: own transactions instead (:data:`_POSTGRES_WRITE_TRANSACTION`).
_POSTGRES_SETTINGS: Final[tuple[str, ...]] = ()
#: PostgreSQL, first in every write transaction of fsm (a connection with the :data:`WRITE`
#: option; never a host's own transaction): no sequential scan where an index serves. A commit
#: runs some 18 foreign-key checks, and PostgreSQL caches a generic plan for each, per session;
#: one planned after the table was analyzed while tiny is a sequential scan, and stays one as
#: the table grows (a bulk load, until autovacuum analyzes it again): every check then reads the
#: whole table. Every key fsm checks has its index, so with sequential scans off each cached
#: plan is an index probe whatever the statistics said (tests/store/test_write_path.py shows
#: it on a grown table), and the plans stay cached: replanning every check
#: (``plan_cache_mode = force_custom_plan``, the setting before) cost the server about twice the
#: work of the inserts themselves (bench/floor.py).
_POSTGRES_WRITE_TRANSACTION: Final = "SET LOCAL enable_seqscan = off"
#: PostgreSQL, first in every transaction of the store's engines, reads included: no JIT. The
#: store's transactions are short lookups and small inserts; on a hash-partitioned store the
#: planner's cost estimate of a listing (a subquery per partition) passes ``jit_above_cost``
#: and compiling it cost 25-30 times the query itself (bench/store.py ``--partitions``). Sent
#: in the same round trip as the transaction's other ``SET LOCAL``s.
_POSTGRES_EVERY_TRANSACTION: Final = "SET LOCAL jit = off"
#: PostgreSQL, every transaction of a read-only engine (run first, inside it, so a pooling proxy
#: cannot carry them over to another client): writes refused, and no JIT (compiling a query costs
#: more than these scans and lookups ever win back).
_POSTGRES_READONLY_TRANSACTION: Final = "SET TRANSACTION READ ONLY; SET LOCAL jit = off"

#: ``Connection.info`` key set on every connection of an engine fsm set up (its own engines, and
#: a host's engine given to :func:`configure_engine`).
CONFIGURED: Final = "fsm_configured"

#: The engines :func:`configure_engine` set up (so a second call is a no-op).
configured_engines: weakref.WeakSet[Engine] = weakref.WeakSet()

#: fsm's own PostgreSQL engines on psycopg (sync, and the sync side of asyncio ones): the ones
#: whose connections take the :data:`AT_ONCE` and :data:`FIRST` options.
at_once_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class EngineNotConfiguredError(StoreError, ValueError):
    """An engine (or connection) handed to fsm was not set up for it: on SQLite its connections
    have foreign keys off and the driver's own transaction handling, so the store's contract
    would not hold. Call :func:`fsm.store.configure_engine` on the engine before its first
    connection."""


@dataclass(frozen=True, slots=True)
class _Profile:
    """How the engines of one kind set up every new connection."""

    #: SQLite: the pragmas run on each connection
    sqlite_pragmas: tuple[str, ...]
    #: PostgreSQL: the ``SET`` statements run on each session
    postgres_settings: tuple[str, ...]
    #: PostgreSQL: the statement run first in every transaction (``None``: nothing)
    postgres_transaction: str | None = None
    #: PostgreSQL: run ``postgres_transaction`` only on connections with the :data:`WRITE` option
    postgres_writes_only: bool = False
    #: SQLite: how text values are decoded (``None``: the driver's strict UTF-8)
    text_factory: Callable[[bytes], str] | None = None
    #: SQLite: begin a connection with the :data:`WRITE` option with ``BEGIN IMMEDIATE``
    immediate_writes: bool = True
    #: PostgreSQL: the per-transaction deadline (``statement_timeout``, ``lock_timeout``,
    #: ``idle_in_transaction_session_timeout``) in milliseconds, or ``None`` for none
    postgres_deadline_ms: int | None = None
    #: PostgreSQL: run first in every transaction, writes or not (``None``: nothing)
    postgres_every_transaction: str | None = None
    #: SQLite (the sync driver): how long a writer waits for another process's write lock, in
    #: seconds, polling with :func:`_begin_immediate`'s jittered backoff (``None``: SQLite's
    #: own busy handler, as the pragmas set it)
    sqlite_write_wait: float | None = None
    #: PostgreSQL (psycopg): fsm sends each transaction's ``BEGIN`` itself, in the same round
    #: trip as its settings (:func:`_begin_statement`); only on fsm's own engines, never on a
    #: host's engine given to :func:`configure_engine`
    postgres_own_begin: bool = False
    #: PostgreSQL (psycopg, with ``postgres_own_begin``; asyncio engines as
    #: :func:`_async_one_query` says): a write's common case may be one query that the server
    #: commits as it ends (:data:`AT_ONCE`)
    postgres_one_query: bool = False


def store_profile(
    *,
    foreign_keys: bool,
    busy_timeout: float,
    wal: bool = True,
    timeout: float | None = None,
    one_query: bool = True,
) -> _Profile:
    """The store's engines (sync and async): foreign keys, the busy timeout, WAL (readers never
    block the writer), ``synchronous=NORMAL``; on PostgreSQL the per-transaction deadline, and
    with ``one_query`` writes whose common case is one query (:data:`AT_ONCE`)."""
    journal = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL") if wal else ()
    return _Profile(
        sqlite_pragmas=(
            f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}",
            f"PRAGMA busy_timeout={int(busy_timeout * 1000)}",
            *journal,
        ),
        postgres_settings=_POSTGRES_SETTINGS,
        postgres_transaction=_POSTGRES_WRITE_TRANSACTION,
        postgres_writes_only=True,
        postgres_deadline_ms=None if timeout is None else server_deadline_ms(timeout),
        postgres_every_transaction=_POSTGRES_EVERY_TRANSACTION,
        postgres_own_begin=True,
        postgres_one_query=one_query,
        sqlite_write_wait=busy_timeout,
    )


def server_deadline_ms(timeout: float) -> int:
    """The server's per-transaction deadline for a store ``timeout`` (seconds), in ms: the
    timeout less a margin (a fifth, at most 1 s), so that a server that is reachable answers
    with its own error (``lock_timeout``: :class:`~fsm.store.errors.StoreBusyError`;
    ``statement_timeout``) before the client's deadline gives up on the connection."""
    return max(1, math.ceil((timeout - min(1.0, timeout / 5)) * 1000))


def postgres_connect_args(timeout: float | None) -> dict[str, int]:
    """The libpq settings of every PostgreSQL connection fsm makes, for a deadline of
    ``timeout`` seconds (``None``: :data:`DEFAULT_TIMEOUT`).

    ``connect_timeout`` (the timeout, at most :data:`CONNECT_TIMEOUT_SECONDS`, at least 2:
    libpq's minimum), TCP keepalives (first probe after a third of the timeout, then every
    sixth, three lost probes end the connection) and ``tcp_user_timeout`` (sent data not
    acknowledged within the timeout ends the connection). A URL's own query parameters win.
    """
    seconds = DEFAULT_TIMEOUT if timeout is None else timeout
    return {
        "connect_timeout": max(2, math.ceil(min(seconds, CONNECT_TIMEOUT_SECONDS))),
        "keepalives": 1,
        "keepalives_idle": max(1, int(seconds // 3)),
        "keepalives_interval": max(1, int(seconds // 6)),
        "keepalives_count": 3,
        "tcp_user_timeout": max(1, math.ceil(seconds * 1000)),
    }


def _lenient_text(raw: bytes) -> str:
    """A SQLite text value as ``str``: one that is not UTF-8 (raw SQL can store one) is decoded
    with errors replaced, never an error."""
    return raw.decode("utf-8", "replace")


#: Read-only engines: writes refused (``query_only``), and large scans (check, stats) read the
#: file through the page cache and mmap (clamped to the build's maximum); text that is not UTF-8
#: reads as text.
READONLY_PROFILE: Final = _Profile(
    sqlite_pragmas=(
        "PRAGMA query_only=ON",
        f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_SECONDS * 1000)}",
        "PRAGMA cache_size=-65536",
        "PRAGMA mmap_size=17179869184",
    ),
    postgres_settings=(),
    postgres_transaction=_POSTGRES_READONLY_TRANSACTION,
    text_factory=_lenient_text,
    immediate_writes=False,
    postgres_own_begin=True,
)


def dumps_json(value: Any) -> str:
    """The JSON text stored for ``value`` (the engines' ``json_serializer``): ASCII escapes,
    ``ValueError`` for NaN and infinities."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


# -- shared plumbing ---------------------------------------------------------------------------
def build_engine(
    url: URL, profile: _Profile, kwargs: dict[str, Any], busy_timeout: float
) -> Engine:
    """The one place a synchronous engine is made and set up."""
    if url.get_backend_name() == "sqlite":
        kwargs = sqlite_kwargs(kwargs, busy_timeout)
    engine = sa_engine(sa.create_engine, url, kwargs)
    configure(engine, profile)
    faults.hook(engine, readonly=profile is READONLY_PROFILE)
    return engine


#: the package that provides each driver fsm uses, for :class:`DriverMissingError`.
_DRIVER_PACKAGES: Final = {
    "psycopg": ("psycopg", "pip install 'fsm-toolcalls[postgres]'"),
    "psycopg_async": ("psycopg", "pip install 'fsm-toolcalls[postgres]'"),
    "aiosqlite": ("aiosqlite", "pip install 'fsm-toolcalls[async]'"),
}


def sa_engine(factory: Callable[..., _T], url: URL, kwargs: dict[str, Any]) -> _T:
    """``factory(url, **kwargs)``; a driver that is not installed raises
    :class:`~fsm.store.errors.DriverMissingError` naming the package to install."""
    try:
        return factory(url, **kwargs)
    except ImportError as exc:
        driver = url.get_driver_name()
        package, fix = _DRIVER_PACKAGES.get(driver, (driver, f"pip install {driver}"))
        raise DriverMissingError(
            f"the database driver {package} is not installed, and "
            f"{url.render_as_string(hide_password=True)} needs it: {fix}"
        ) from exc


def configure(engine: Engine, profile: _Profile) -> None:
    """Set up every new connection of ``engine`` (sync, or an async engine's ``sync_engine``)
    as ``profile`` says, for SQLite and PostgreSQL (other backends are left as they are)."""
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine, profile)
    elif engine.dialect.name == "postgresql":
        _configure_postgres(engine, profile)


def make_parent(parsed: URL) -> None:
    """Create the directory of a SQLite file (not of ``:memory:`` or a ``file:`` URI)."""
    database = parsed.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def pool_kwargs(url: URL, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``pool_size`` :data:`POOL_SIZE` for a pooled engine (PostgreSQL, a
    SQLite file) unless the caller chose a pool or its size."""
    if "poolclass" in kwargs or "pool" in kwargs or "pool_size" in kwargs:
        return kwargs
    if url.get_backend_name() == "sqlite" and sqlite_file(url) is None:
        return kwargs  # in memory: SQLAlchemy's single-connection pools
    pool_class: type[Any] = url.get_dialect().get_pool_class(url)  # type: ignore[attr-defined]
    if not issubclass(pool_class, sa.pool.QueuePool):
        return kwargs  # e.g. aiosqlite's NullPool in older SQLAlchemy 2.0: no size to set
    return {**kwargs, "pool_size": POOL_SIZE}


def sqlite_kwargs(kwargs: dict[str, Any], busy_timeout: float) -> dict[str, Any]:
    """``kwargs`` with the driver's own lock timeout set in ``connect_args`` (unless given)."""
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", busy_timeout)
    return {"connect_args": connect_args, **kwargs}


def postgres_kwargs(url: URL, kwargs: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``kwargs`` with :func:`postgres_connect_args` in ``connect_args`` for a psycopg URL
    (what the URL's query or the caller's ``connect_args`` set is kept), and
    ``prepare_threshold=None``: psycopg prepares nothing on the server (safe behind PgBouncer's
    transaction pooling; ``?prepare_threshold=N`` or ``connect_args`` ask for it)."""
    if url.get_backend_name() != "postgresql" or not url.get_driver_name().startswith("psycopg"):
        return kwargs
    connect_args = dict(kwargs.pop("connect_args", {}))
    for key, value in postgres_connect_args(timeout).items():
        if key not in url.query:
            connect_args.setdefault(key, value)
    # no server-side prepared statements unless asked for (``?prepare_threshold=N``): a
    # transaction-pooling proxy hands a prepared server session to other clients
    connect_args.setdefault("prepare_threshold", None)
    return {"connect_args": connect_args, **kwargs}


def _configure_sqlite(engine: Engine, profile: _Profile) -> None:
    """Run the profile's pragmas on every new connection, and let fsm begin every transaction
    itself: ``BEGIN IMMEDIATE`` for a connection with the :data:`WRITE` option (when the profile
    has ``immediate_writes``), else ``BEGIN``."""
    pragmas, text_factory = profile.sqlite_pragmas, profile.text_factory
    immediate_writes = profile.immediate_writes

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        # fsm emits BEGIN itself (below); the driver must not begin transactions on its own.
        dbapi_connection.isolation_level = None
        record.info[CONFIGURED] = True
        if text_factory is not None:
            dbapi_connection.text_factory = text_factory
        cursor = dbapi_connection.cursor()
        try:
            for pragma in pragmas:
                cursor.execute(pragma)
        finally:
            cursor.close()

    # the sync driver only: the asyncio one runs SQLite in a thread of its own, where its busy
    # handler's sleeps block nothing else (a sleep here would block the event loop)
    wait = profile.sqlite_write_wait if engine.dialect.driver == "pysqlite" else None

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        immediate = immediate_writes and connection.get_execution_options().get(WRITE, False)
        if not immediate:
            connection.exec_driver_sql("BEGIN")
        elif wait is None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            _begin_immediate(connection, wait)


#: the backoff of a writer waiting for another process's write lock (seconds): the first
#: wait, and the longest (each wait is drawn at random up to the bound, which doubles)
_FIRST_WAIT: Final = 0.001
_LONGEST_WAIT: Final = 0.008


def _begin_immediate(connection: Connection, wait: float) -> None:
    """``BEGIN IMMEDIATE``, retried with a jittered backoff while another process holds the
    database's write lock, for at most ``wait`` seconds (then the busy error, typed
    :class:`~fsm.store.errors.StoreBusyError`).

    SQLite's own busy handler sleeps 1, 2, 5, 10 ... up to 100 ms between tries whatever the
    lock's holder does: a writer that misses a 1 ms transaction waits tens of milliseconds,
    and the 99th percentile of 16 writer processes reached hundreds. Here the waits stay short
    (at most :data:`_LONGEST_WAIT`) and random (writers that missed the same commit do not
    retry together). The connection's busy handler is off only for the ``BEGIN IMMEDIATE``
    (its reads keep it: a WAL reader can meet a brief lock too)."""
    raw = connection.connection.dbapi_connection
    assert raw is not None
    give_up = time.monotonic() + wait
    bound = _FIRST_WAIT
    raw.execute("PRAGMA busy_timeout = 0")
    try:
        try:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
            return
        except (StoreBusyError, sa.exc.OperationalError) as exc:
            # typed by the store's error hook (a host's engine has none: the driver's code)
            if not faults.sqlite_busy(exc) or wait <= 0:
                raise
        # the tries in between go to the driver (a busy one costs microseconds, not an
        # exception through SQLAlchemy's error handling); the last one through SQLAlchemy,
        # whose error is typed
        while True:
            time.sleep(random.uniform(bound / 2, bound))
            bound = min(bound * 2, _LONGEST_WAIT)
            if time.monotonic() >= give_up:
                break
            try:
                raw.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not faults.sqlite_busy(exc):
                    break
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    finally:
        raw.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")


def _configure_postgres(engine: Engine, profile: _Profile) -> None:
    """Set up every PostgreSQL session of ``engine`` as ``profile`` says.

    Nothing is set on the session itself unless the profile has ``postgres_settings`` (none of
    fsm's profiles do: a session-level ``SET`` does not survive a transaction pooler). Every
    transaction (or, with ``postgres_writes_only``, every write transaction) begins with the
    profile's ``postgres_transaction``, and with ``postgres_deadline_ms`` also sets its
    ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout``
    locally: one round trip for all of them. With ``postgres_own_begin`` (fsm's own engines
    on psycopg) that round trip carries the ``BEGIN`` too: the driver connection is switched to
    autocommit (psycopg then sends no ``BEGIN`` of its own; its ``commit()`` and
    ``rollback()`` still end the transaction the server has open) and fsm begins the
    transaction with the isolation level, read-only and deferrable modes SQLAlchemy set on the
    connection (:func:`_begin_statement`): one round trip less per transaction.

    A session whose own value is shorter (set for the role or the database, or in the URL's
    ``options=-c lock_timeout=...``) keeps it: the deadline only ever shortens a wait."""
    settings: Sequence[str] = profile.postgres_settings
    transaction, writes_only = profile.postgres_transaction, profile.postgres_writes_only
    every = profile.postgres_every_transaction
    deadline_ms = profile.postgres_deadline_ms
    own_begin = profile.postgres_own_begin and engine.dialect.driver.startswith("psycopg")
    wanted: dict[str, int] = {}
    if deadline_ms is not None:
        # Several rows go in one INSERT ... VALUES statement, not through psycopg's pipelined
        # executemany: after a pipeline the server does not arm its idle-in-transaction timer
        # (PostgreSQL 15, seen with a black-holed client), so a client lost right after one
        # would hold the conversation's lock until the server's TCP gives up.
        engine.dialect.use_insertmanyvalues_wo_returning = True
        wanted = {
            "statement_timeout": deadline_ms,
            # a little shorter: a wait for a lock then ends as a lock timeout (StoreBusyError),
            # not as the statement's timeout
            "lock_timeout": max(1, deadline_ms * 9 // 10),
            "idle_in_transaction_session_timeout": deadline_ms,
        }
    if (
        own_begin
        and profile.postgres_one_query
        and (not engine.dialect.is_async or _async_one_query())
    ):
        at_once_engines.add(engine)
        event.listen(engine, "before_cursor_execute", _at_once_statement, retval=True)
        event.listen(engine, "after_cursor_execute", _at_once_result)
    if transaction is not None or wanted or every is not None or own_begin:

        @event.listens_for(engine, "begin")
        def _on_begin(connection: Connection) -> None:
            begin = _begin_statement(connection) if own_begin else None
            statements = [] if begin is None else [begin]
            if transaction is not None and (
                not writes_only or connection.get_execution_options().get(WRITE, False)
            ):
                statements.append(transaction)
            if every is not None:
                statements.append(every)
            info = connection.connection.info
            local = info.get(_LOCAL_DEADLINE)
            if local:
                statements.append(local)
            info.pop(_AT_ONCE_SETTINGS, None)
            if (
                begin is not None
                and connection.get_execution_options().get(AT_ONCE)
                and _open(connection)
            ):
                # the query's implicit transaction takes the BEGIN's modes as SET TRANSACTION
                modes = begin.removeprefix("BEGIN")
                first = [f"SET TRANSACTION{modes}"] if modes else []
                info[_AT_ONCE_SETTINGS] = "; ".join(first + statements[1:])  # sent with it
                return
            if statements:
                # one round trip: without parameters psycopg sends them as one query
                connection.exec_driver_sql("; ".join(statements))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        record.info[CONFIGURED] = True
        if not settings and not wanted:
            return
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        # not ``with cursor``: the asyncio adaptation of psycopg's cursor is not a context manager
        # before SQLAlchemy 2.1
        cursor = dbapi_connection.cursor()
        try:
            for setting in settings:
                cursor.execute(setting)
            if wanted:
                cursor.execute(
                    "SELECT name, setting::bigint FROM pg_settings WHERE name = ANY(%s)",
                    (list(wanted),),
                )
                session = {str(name): int(value) for name, value in cursor.fetchall()}
                # one round trip: without parameters psycopg sends them as one query
                record.info[_LOCAL_DEADLINE] = "; ".join(
                    f"SET LOCAL {name} = {ms}"
                    for name, ms in wanted.items()
                    if not 0 < session.get(name, 0) <= ms
                )
        finally:
            cursor.close()
            dbapi_connection.autocommit = autocommit


def _begin_statement(connection: Connection) -> str | None:
    """The ``BEGIN`` psycopg would send for ``connection`` (its isolation level, read-only and
    deferrable modes, as SQLAlchemy set them on the driver connection), after switching the
    driver connection to autocommit so that psycopg sends none itself; ``None`` for a
    connection the caller asked to be in autocommit (``isolation_level="AUTOCOMMIT"``)."""
    level_option = connection.get_execution_options().get(
        "isolation_level", getattr(connection.dialect, "isolation_level", None)
    )
    if level_option == "AUTOCOMMIT":
        return None
    dbapi = connection.connection.dbapi_connection
    driver = connection.connection.driver_connection
    assert dbapi is not None and driver is not None
    parts = ["BEGIN"]
    level = driver.isolation_level
    if level is not None:
        parts.append(f"ISOLATION LEVEL {level.name.replace('_', ' ')}")
    if driver.read_only is not None:
        parts.append("READ ONLY" if driver.read_only else "READ WRITE")
    if driver.deferrable is not None:
        parts.append("DEFERRABLE" if driver.deferrable else "NOT DEFERRABLE")
    if not driver.autocommit:
        # SQLAlchemy turns it off again when it resets a connection's isolation level
        dbapi.autocommit = True
    return " ".join(parts)


def began_at_once(connection: Connection) -> bool:
    """Whether the transaction ``connection`` just began is :data:`AT_ONCE`: its one
    statement still to send, with the settings (else it began as any other)."""
    settings = connection.connection.info.get(_AT_ONCE_SETTINGS)
    return settings is not None and settings is not _SENT


def _open(connection: Connection) -> bool:
    """Whether the server has sent nothing on ``connection``'s socket since its last answer
    (an idle session it closed, by a restart or a failover, has: an end of file or a
    termination notice). A statement sent on such a socket fails without having run, but the
    driver cannot tell that from a connection lost while the server ran it; so the transaction
    begins with its own round trip, which fails first: nothing was written."""
    fd = socket_fd(connection.connection.driver_connection)
    if fd is None:
        return False
    try:
        if hasattr(select, "poll"):  # any descriptor (select() takes none above 1023)
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return not poller.poll(0)
        readable, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _at_once_statement(
    conn: Connection,
    cursor: Any,
    statement: str,
    parameters: Any,
    context: Any,
    executemany: bool,
) -> tuple[str, Any]:
    """``before_cursor_execute`` (retval) of the engines in :data:`at_once_engines`: the
    statement of an :data:`AT_ONCE` transaction is sent after the transaction's settings
    (``SET TRANSACTION`` with the modes its ``BEGIN`` would have had, the ``SET LOCAL``s) and
    its :data:`FIRST`, in one query: one round trip. The values are bound in the query's text
    by psycopg (``ClientCursor``: a query of several statements takes no parameters). A second
    statement in such a transaction, or a :data:`FIRST` in another, is an error of fsm's."""
    info = conn.connection.info
    settings = info.get(_AT_ONCE_SETTINGS)
    first = context.execution_options.get(FIRST)
    if settings is None and first is None:
        return statement, parameters
    if settings is None or settings is _SENT:
        raise RuntimeError("fsm: a transaction begun at once holds one statement, sent at once")
    import psycopg  # only engines on psycopg are here

    driver = conn.connection.driver_connection
    if isinstance(driver, psycopg.AsyncConnection):
        bind = psycopg.AsyncClientCursor(driver).mogrify  # binds in text: nothing awaited
    else:
        assert isinstance(driver, psycopg.Connection)
        bind = psycopg.ClientCursor(driver).mogrify
    parts = [bind(statement, parameters)]
    if first is not None:
        parts.insert(0, bind(first, parameters))
    if settings:
        parts.insert(0, settings)
    info[_AT_ONCE_SETTINGS] = _SENT
    return "; ".join(parts), None


def _at_once_result(conn: Connection, cursor: Any, *_args: Any) -> None:
    """``after_cursor_execute`` of :func:`_at_once_statement`: the result SQLAlchemy reads is
    the last statement's (psycopg has them all, positioned on the first). The query just sent
    is the only statement of its transaction: any other would have been refused."""
    if conn.connection.info.get(_AT_ONCE_SETTINGS) is not _SENT:
        return
    if not conn.dialect.is_async:
        while cursor.nextset():
            pass
        return
    # SQLAlchemy's asyncio adaptation of psycopg's cursor fetched the rows of the first result
    # as the query ended (``_rows``, read by its fetch methods); its ``nextset`` cannot move
    # (SQLAlchemy 2.0 leaves ``_rows`` as they were, 2.1 awaits psycopg's synchronous
    # ``nextset``). So psycopg's own cursor moves, and the rows of the last result are fetched
    # for the adaptation as it fetches them: its layout is checked once, when an engine is set
    # up (:func:`_async_one_query`; an engine where it is not so sends no one query).
    raw = cursor._cursor
    while raw.nextset():
        pass
    cursor._rows = collections.deque(_awaiter()(raw.fetchall()) if raw.description else ())


@functools.cache
def _awaiter() -> Callable[[Any], Any]:
    """SQLAlchemy's ``await_``: an awaitable's result, from the synchronous code its asyncio
    layer runs in a greenlet (as its adaptations of the drivers do)."""
    try:
        from sqlalchemy.util import await_  # SQLAlchemy 2.1
    except ImportError:  # 2.0
        from sqlalchemy.util import await_only as await_
    return cast("Callable[[Any], Any]", await_)


#: the first psycopg that cancels the server's query when the task awaiting it is cancelled
_ASYNC_CANCELS: Final = (3, 1, 9)


@functools.cache
def _async_one_query() -> bool:
    """Whether an asyncio engine's writes can be one query (:data:`AT_ONCE`):

    * psycopg cancels the query on the server when the task awaiting it is cancelled (3.1.9
      and later). Before, the query runs on, and one query commits on its own once it has the
      conversation's lock: a task cancelled while it waited would write anyway. (Statement by
      statement, the cancelled transaction's connection is dropped and nothing is written.)
    * SQLAlchemy's asyncio adaptation of psycopg's cursor has the layout
      :func:`_at_once_result` reads: psycopg's cursor as ``_cursor``, the fetched rows as
      ``_rows`` (SQLAlchemy 2.0.33 to 2.1 have it).

    Where either is not so, the asyncio store writes statement by statement."""
    import psycopg

    release = tuple(int(part) for part in re.findall(r"\d+", psycopg.__version__)[:3])
    if release < _ASYNC_CANCELS:
        return False
    try:
        from sqlalchemy.dialects.postgresql.psycopg import AsyncAdapt_psycopg_cursor
    except ImportError:  # pragma: no cover - every supported SQLAlchemy has it
        return False
    return all(
        isinstance(getattr(AsyncAdapt_psycopg_cursor, name, None), types.MemberDescriptorType)
        for name in ("_cursor", "_rows")
    )


def search_path_per_transaction(engine: Engine, schema: str) -> None:
    """Make ``schema`` the ``search_path`` of every transaction of ``engine`` (PostgreSQL), for
    raw SQL that names fsm's tables and functions without a schema."""

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql(f"SELECT set_config('search_path', '\"{schema}\"', true)")


#: key of a pooled PostgreSQL connection's ``info``: its per-transaction ``SET LOCAL``s
_LOCAL_DEADLINE: Final = "fsm_local_deadline"
#: key of a PostgreSQL connection's ``info`` in an :data:`AT_ONCE` transaction: the settings
#: its statement is sent after, then :data:`_SENT`
_AT_ONCE_SETTINGS: Final = "fsm_at_once_settings"
_SENT: Final = "sent"
