"""Database URLs and every engine of the store, built in one place.

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
client's locks. Each kind's settings are one ``_Profile``; :func:`_build` and
:func:`_configure` are the only places an engine is made and set up.

A host application's own engine is set up for fsm by :func:`configure_engine` (SQLite: the same
pragmas and transaction handling as fsm's engines; PostgreSQL: nothing to do), which
``ConversationStore(engine=...)`` requires on SQLite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, pool
from sqlalchemy.engine import URL, Connection, Engine

from fsm.store import faults
from fsm.store.deadline import DEFAULT_TIMEOUT
from fsm.store.errors import (
    AuditError,
    DatabaseNotFoundError,
    DatabaseUrlError,
    DriverMissingError,
    StoreError,
    StoreLayoutError,
)
from fsm.store.urls import sqlite_file

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: an engine, sync or asyncio (what :func:`configure_engine` takes and returns)
_E = TypeVar("_E", "Engine", "AsyncEngine")
#: what an SQLAlchemy engine factory returns
_T = TypeVar("_T")

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

_ASYNC_SQLITE: Final = "sqlite+aiosqlite"
_SYNC_POSTGRES: Final = "postgresql+psycopg"

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
_CONFIGURED: Final = "fsm_configured"

#: The engines :func:`configure_engine` set up (so a second call is a no-op).
_configured_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


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


def _store_profile(
    *, foreign_keys: bool, busy_timeout: float, wal: bool = True, timeout: float | None = None
) -> _Profile:
    """The store's engines (sync and async): foreign keys, the busy timeout, WAL (readers never
    block the writer), ``synchronous=NORMAL``; on PostgreSQL the per-transaction deadline."""
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
_READONLY_PROFILE: Final = _Profile(
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
)


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


#: what a valid ``--db`` looks like, for the messages of :class:`DatabaseUrlError`.
_URL_FORMS: Final = (
    "give a SQLite file path (chat.db), a sqlite:///path.db URL or a "
    "postgresql+psycopg://user@host/db URL (several hosts: "
    "postgresql://user@host1:5432,host2:5432/db?target_session_attrs=read-write)"
)


def normalize_url(url: str | os.PathLike[str] | URL | None) -> URL:
    """Parse ``url`` (``None`` means :func:`default_url`); ``postgresql://`` and
    ``postgres://`` select the psycopg 3 driver.

    A filesystem path (``chat.db``, ``./x.db``, ``/abs/x.sqlite``, ``~/x.db``, a
    :class:`~pathlib.Path`) is taken as a SQLite file (made absolute, ``~`` expanded). Anything
    else that is not a URL of SQLite or PostgreSQL raises
    :class:`~fsm.store.errors.DatabaseUrlError`, whose message shows the valid forms.
    """
    if url is None:
        url = default_url()
    if isinstance(url, os.PathLike):
        return _path_url(os.fspath(url))
    if isinstance(url, str):
        text = url.strip()
        if not text or "\x00" in text or "\n" in text:
            raise DatabaseUrlError(f"{url!r} is not a database URL or file path: {_URL_FORMS}")
        if "://" not in text:
            if _looks_like_path(text):
                return _path_url(text)
            raise DatabaseUrlError(f"{url!r} is not a database URL or file path: {_URL_FORMS}")
        one_host = _multi_host_url(text)
        try:
            parsed = sa.make_url(one_host)
        except (sa.exc.ArgumentError, ValueError) as exc:
            raise DatabaseUrlError(
                f"{display_url_text(text)!r} is not a valid database URL: {_URL_FORMS}"
            ) from exc
    elif isinstance(url, URL):
        parsed = url
    else:
        raise DatabaseUrlError(
            f"a database URL is a str, a path or a sqlalchemy URL, not {type(url).__name__}"
        )
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise DatabaseUrlError(
            f"fsm stores to SQLite and PostgreSQL, not {backend} "
            f"({parsed.render_as_string(hide_password=True)}): {_URL_FORMS}"
        )
    if backend == "sqlite" and (parsed.host or parsed.port):
        # sqlite://x.db (two slashes, a common slip) reads x.db as a host SQLite has not
        name = parsed.host or ""
        raise DatabaseUrlError(
            f"{parsed.render_as_string(hide_password=True)!r} names a host, which SQLite has not "
            f"(two slashes after 'sqlite:'): a file is sqlite:///{name or 'x.db'} (three slashes, "
            f"relative to here), sqlite:////abs/path/{name or 'x.db'} (four, absolute), or just "
            "the path"
        )
    return parsed


#: a libpq multi-host URL (``postgresql://h1:5432,h2:5433/db?target_session_attrs=read-write``,
#: as pg_auto_failover prints it): scheme, user info, the comma-separated hosts, the rest.
_MULTI_HOST: Final = re.compile(
    r"(?P<scheme>[A-Za-z][\w+.-]*)://(?P<auth>[^@/?#]*@)?(?P<hosts>[^@/?#]*,[^@/?#]*)"
    r"(?P<path>/[^?#]*)?(?:\?(?P<query>[^#]*))?\Z"
)


def _multi_host_url(text: str) -> str:
    """``text`` with a libpq multi-host list (``h1:5432,h2:5433``) moved to the query as
    ``host=h1:5432&host=h2:5433``, the form SQLAlchemy's psycopg dialect takes (libpq then
    tries the hosts in order, with ``target_session_attrs``); any other text as it is."""
    found = _MULTI_HOST.match(text)
    if found is None:
        return text
    hosts = [host.strip() for host in found["hosts"].split(",")]
    if not all(hosts):
        raise DatabaseUrlError(
            f"{display_url_text(text)!r} has an empty host in its host list: give "
            "host1:port1,host2:port2"
        )
    query = "&".join([*(f"host={host}" for host in hosts), *filter(None, [found["query"]])])
    return f"{found['scheme']}://{found['auth'] or ''}{found['path'] or '/'}?{query}"


def display_url_text(text: str) -> str:
    """``text`` (a URL that may not parse) with the password of its user info masked."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", text)


def _looks_like_path(text: str) -> bool:
    """Whether ``text`` (no ``://``) reads as a file path: no ``scheme:`` prefix and no
    ``user@host`` before the first ``/`` (those are URLs with a typo)."""
    if ":" in text:
        return False
    head = text.split("/", 1)[0]
    return "@" not in head


def _path_url(path: str) -> URL:
    return URL.create("sqlite", database=str(Path(path).expanduser().resolve()))


def require_existing(url: str | URL, reader: str) -> None:
    """Raise :class:`~fsm.store.errors.DatabaseNotFoundError` if ``url`` is a SQLite file that
    does not exist (``reader`` names who reads it, for the message): reading never creates a
    database."""
    path = sqlite_file(url)
    if path is not None and not path.exists():
        raise DatabaseNotFoundError(
            f"no SQLite database at {path.resolve()}: {reader} reads a store and never creates "
            f"one; check --db, or create it with: fsm db upgrade --db '{path.resolve()}'"
        )


@dataclass(frozen=True, slots=True)
class NewFile:
    """A SQLite file that does not exist yet, and the directories to be made for it."""

    path: Path
    #: the directories that do not exist yet, deepest first
    directories: tuple[Path, ...]


def new_sqlite_file(url: str | URL) -> NewFile | None:
    """The SQLite file of ``url`` if it does not exist yet (``None``: it exists, or ``url`` is
    not a SQLite file)."""
    path = sqlite_file(url)
    if path is None or path.exists():
        return None
    made: list[Path] = []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        made.append(parent)
        parent = parent.parent
    return NewFile(path, tuple(made))


@contextmanager
def removed_if_failed(url: URL, new: NewFile | None = None) -> Iterator[None]:
    """Around opening a store on ``url``: a SQLite file that does not exist yet (``new``, as
    :func:`new_sqlite_file` found it before the engine was made; by default, now) is removed
    again, with its ``-wal``, ``-shm`` and ``-journal`` files and the directories made for it,
    if the body raises: a failed open leaves nothing behind. Dispose of the engine inside the
    body."""
    if new is None:
        new = new_sqlite_file(url)
    if new is None:
        yield
        return
    try:
        yield
    except BaseException:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(OSError):
                Path(f"{new.path}{suffix}").unlink(missing_ok=True)
        for directory in new.directories:
            try:
                directory.rmdir()
            except OSError:
                break
        raise


def display_url(url: str | URL) -> str:
    """The URL as text with any password masked (for messages)."""
    return sa.make_url(url).render_as_string(hide_password=True)


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
    Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """
    parsed, kwargs = _url_options(normalize_url(url), kwargs)
    in_schema = store_schema(schema, parsed)
    kwargs.setdefault("json_serializer", dumps_json)
    kwargs = _pool_kwargs(parsed, kwargs)
    if parsed.get_backend_name() == "sqlite":
        _make_parent(parsed)
    profile = _store_profile(foreign_keys=foreign_keys, busy_timeout=busy_timeout, timeout=timeout)
    engine = _build(parsed, profile, _postgres_kwargs(parsed, kwargs, timeout), busy_timeout)
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
    parsed, kwargs = _url_options(normalize_url(url), kwargs)
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise AuditError(f"fsm audits SQLite and PostgreSQL stores, not {backend} ({parsed})")
    in_schema = store_schema(schema, parsed)
    target = _readonly_sqlite_url(parsed) if backend == "sqlite" else parsed
    # no per-transaction deadline (a check of a large store scans for minutes), but bounded
    # connects and a dead peer noticed
    kwargs = _postgres_kwargs(target, kwargs, None)
    engine = _build(target, _READONLY_PROFILE, kwargs, BUSY_TIMEOUT_SECONDS)
    if in_schema is not None:
        _search_path_per_transaction(engine, in_schema)
    return _in_schema(engine, in_schema)


def create_async_engine(
    url: str | URL | None = None,
    *,
    busy_timeout: float = BUSY_TIMEOUT_SECONDS,
    schema: str | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> AsyncEngine:
    """An asyncio engine configured like :func:`create_engine` (``timeout`` as there).

    SQLite (``aiosqlite``): foreign keys on, WAL, ``synchronous=NORMAL``, the busy timeout, and
    transactions begun by fsm (``BEGIN IMMEDIATE`` for writes). PostgreSQL (psycopg): no
    session setting (transaction-pooling safe). JSON is written by :func:`dumps_json`. Extra
    keyword arguments go to SQLAlchemy's :func:`~sqlalchemy.ext.asyncio.create_async_engine`.
    ``schema``: as for :func:`create_engine`. (SQLAlchemy's asyncio layer is imported here, so a
    sync program never loads it.)
    """
    from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine

    parsed, kwargs = _url_options(async_url(url), kwargs)
    in_schema = store_schema(schema, parsed)
    kwargs.setdefault("json_serializer", dumps_json)
    kwargs = _pool_kwargs(parsed, kwargs)
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite:
        _make_parent(parsed)
        kwargs = _sqlite_kwargs(kwargs, busy_timeout)
    kwargs = _postgres_kwargs(parsed, kwargs, timeout)
    engine = _sa_engine(sa_create_async_engine, parsed, kwargs)
    if sqlite or engine.dialect.driver.startswith("psycopg"):  # not asyncpg: it differs
        profile = _store_profile(foreign_keys=True, busy_timeout=busy_timeout, timeout=timeout)
        _configure(engine.sync_engine, profile)
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
    if sync_engine in _configured_engines:
        return engine
    if sync_engine.dialect.name == "sqlite":
        _configure(
            sync_engine,
            _store_profile(foreign_keys=True, busy_timeout=busy_timeout, wal=wal),
        )
    elif sync_engine.dialect.name == "postgresql":
        # the host's own transactions keep their JIT setting: only fsm's write transactions
        # (the WRITE option) get a setting of fsm's
        profile = _store_profile(foreign_keys=True, busy_timeout=busy_timeout)
        _configure(sync_engine, dataclasses.replace(profile, postgres_every_transaction=None))
    # connections opened before this call lack the settings: the pool's are closed (a new
    # pool takes their place), one still checked out is refused by require_configured
    sync_engine.dispose()
    _configured_engines.add(sync_engine)
    return engine


def is_configured(connection: Connection) -> bool:
    """Whether ``connection`` was opened by an engine set up for fsm (one of fsm's own, or one
    given to :func:`configure_engine`). PostgreSQL connections always are: fsm needs no session
    setting there."""
    if connection.dialect.name != "sqlite":
        return True
    return bool(connection.info.get(_CONFIGURED))


def require_configured(connection: Connection) -> None:
    """Raise :class:`EngineNotConfiguredError` unless :func:`is_configured`."""
    if not is_configured(connection):
        if connection.engine in _configured_engines:
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
    parsed, kwargs = _url_options(normalize_url(url), {"poolclass": pool.NullPool})
    engine = _sa_engine(sa.create_engine, parsed, _postgres_kwargs(parsed, kwargs, None))
    faults.hook(engine)
    return engine


def async_url(url: str | URL | None) -> URL:
    """The asyncio form of a store URL (``None``: the default database): SQLite goes through
    ``aiosqlite``; ``postgresql+psycopg`` stays as it is (SQLAlchemy picks psycopg's async
    driver for an async engine)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.set(drivername=_ASYNC_SQLITE)
    if parsed.drivername == "postgresql+psycopg_async":
        return parsed.set(drivername=_SYNC_POSTGRES)
    return parsed


def sync_url(url: str | URL | None) -> URL:
    """The synchronous form of a store URL (for migrations and the sync store)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.set(drivername="sqlite")
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in (
        "psycopg_async",
        "asyncpg",
    ):
        return parsed.set(drivername=_SYNC_POSTGRES)
    return parsed


# -- shared plumbing ---------------------------------------------------------------------------
def _build(url: URL, profile: _Profile, kwargs: dict[str, Any], busy_timeout: float) -> Engine:
    """The one place a synchronous engine is made and set up."""
    if url.get_backend_name() == "sqlite":
        kwargs = _sqlite_kwargs(kwargs, busy_timeout)
    engine = _sa_engine(sa.create_engine, url, kwargs)
    _configure(engine, profile)
    faults.hook(engine, readonly=profile is _READONLY_PROFILE)
    return engine


#: the package that provides each driver fsm uses, for :class:`DriverMissingError`.
_DRIVER_PACKAGES: Final = {
    "psycopg": ("psycopg", "pip install 'fsm-toolcalls[postgres]'"),
    "psycopg_async": ("psycopg", "pip install 'fsm-toolcalls[postgres]'"),
    "aiosqlite": ("aiosqlite", "pip install 'fsm-toolcalls[async]'"),
}


def _sa_engine(factory: Callable[..., _T], url: URL, kwargs: dict[str, Any]) -> _T:
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


def _configure(engine: Engine, profile: _Profile) -> None:
    """Set up every new connection of ``engine`` (sync, or an async engine's ``sync_engine``)
    as ``profile`` says, for SQLite and PostgreSQL (other backends are left as they are)."""
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine, profile)
    elif engine.dialect.name == "postgresql":
        _configure_postgres(engine, profile)


def _make_parent(parsed: URL) -> None:
    """Create the directory of a SQLite file (not of ``:memory:`` or a ``file:`` URI)."""
    database = parsed.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


#: URL query parameters fsm reads itself and never hands to libpq (which would refuse them), so
#: that a ``--db`` URL or ``$FSM_DB_URL`` can set them: the pool of the engine and psycopg's
#: ``prepare_threshold`` (``none``: never prepare, fsm's default; ``N``: prepare a statement
#: run N times on a connection, which needs a direct connection or PgBouncer 1.21+ with
#: ``max_prepared_statements``). A keyword argument given to the factory wins over the URL.
ENGINE_URL_OPTIONS: Final[Mapping[str, str]] = {
    "prepare_threshold": "psycopg: prepare a statement after N runs (none: never, the default)",
    "pool_size": f"connections kept open by the engine's pool (default {POOL_SIZE})",
    "max_overflow": "connections opened past pool_size under load (default 10)",
    "pool_timeout": "seconds to wait for a free connection of the pool (default 30)",
    "pool_recycle": "seconds after which a pooled connection is opened again (default never)",
}


def _option_value(name: str, text: str) -> int | float | None:
    """The value of one of :data:`ENGINE_URL_OPTIONS` in a URL's query."""
    try:
        if name == "prepare_threshold":
            if text.strip().lower() in ("", "none", "null", "off"):
                return None
            value: int | float = int(text)
        elif name == "pool_timeout":
            value = float(text)
        else:
            value = int(text)
    except ValueError:
        value = -2
    # prepare_threshold=0 would prepare fsm's one-round-trip SET LOCAL statements, which
    # PostgreSQL cannot prepare (several commands); from 1 on, psycopg sees that first
    least = {"max_overflow": -1, "pool_recycle": -1, "prepare_threshold": 1}.get(name, 0)
    if value < least or (name == "pool_timeout" and not value > 0):
        kind = "none or a whole number from 1" if name == "prepare_threshold" else "a number"
        raise DatabaseUrlError(
            f"the URL option {name}={text!r} is not valid: give {kind} "
            f"({name}: {ENGINE_URL_OPTIONS[name]})"
        )
    return value


def engine_url_options(url: URL) -> tuple[URL, dict[str, Any], dict[str, Any]]:
    """Split :data:`ENGINE_URL_OPTIONS` off a PostgreSQL ``url``: the URL without them, the
    engine's keyword arguments (``pool_size``, ...) and the driver's ``connect_args``
    (``prepare_threshold``). A value that is not valid raises
    :class:`~fsm.store.errors.DatabaseUrlError`."""
    if url.get_backend_name() != "postgresql":
        return url, {}, {}
    given = [name for name in ENGINE_URL_OPTIONS if name in url.query]
    if not given:
        return url, {}, {}
    engine: dict[str, Any] = {}
    connect: dict[str, Any] = {}
    for name in given:
        raw = url.query[name]
        text = raw[-1] if isinstance(raw, tuple) else raw
        (connect if name == "prepare_threshold" else engine)[name] = _option_value(name, text)
    return url.difference_update_query(given), engine, connect


def _url_options(url: URL, kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
    """``url`` without fsm's own query options and ``kwargs`` with them (the caller's own
    keyword arguments win; pool options are dropped for an engine without a sized pool)."""
    url, engine, connect = engine_url_options(url)
    if not engine and not connect:
        return url, kwargs
    kwargs = dict(kwargs)
    if "poolclass" not in kwargs and "pool" not in kwargs:
        for key, value in engine.items():
            kwargs.setdefault(key, value)
    if connect:
        connect_args = dict(kwargs.pop("connect_args", {}))
        for key, value in connect.items():
            connect_args.setdefault(key, value)
        kwargs["connect_args"] = connect_args
    return url, kwargs


def _pool_kwargs(url: URL, kwargs: dict[str, Any]) -> dict[str, Any]:
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


def _sqlite_kwargs(kwargs: dict[str, Any], busy_timeout: float) -> dict[str, Any]:
    """``kwargs`` with the driver's own lock timeout set in ``connect_args`` (unless given)."""
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", busy_timeout)
    return {"connect_args": connect_args, **kwargs}


def _postgres_kwargs(url: URL, kwargs: dict[str, Any], timeout: float | None) -> dict[str, Any]:
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
        record.info[_CONFIGURED] = True
        if text_factory is not None:
            dbapi_connection.text_factory = text_factory
        cursor = dbapi_connection.cursor()
        try:
            for pragma in pragmas:
                cursor.execute(pragma)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        immediate = immediate_writes and connection.get_execution_options().get(WRITE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _configure_postgres(engine: Engine, profile: _Profile) -> None:
    """Set up every PostgreSQL session of ``engine`` as ``profile`` says.

    Nothing is set on the session itself unless the profile has ``postgres_settings`` (none of
    fsm's profiles do: a session-level ``SET`` does not survive a transaction pooler). Every
    transaction (or, with ``postgres_writes_only``, every write transaction) begins with the
    profile's ``postgres_transaction``, and with ``postgres_deadline_ms`` also sets its
    ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout``
    locally: one round trip for all of them.

    A session whose own value is shorter (set for the role or the database, or in the URL's
    ``options=-c lock_timeout=...``) keeps it: the deadline only ever shortens a wait."""
    settings: Sequence[str] = profile.postgres_settings
    transaction, writes_only = profile.postgres_transaction, profile.postgres_writes_only
    every = profile.postgres_every_transaction
    deadline_ms = profile.postgres_deadline_ms
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
    if transaction is not None or wanted or every is not None:

        @event.listens_for(engine, "begin")
        def _on_begin(connection: Connection) -> None:
            statements = []
            if transaction is not None and (
                not writes_only or connection.get_execution_options().get(WRITE, False)
            ):
                statements.append(transaction)
            if every is not None:
                statements.append(every)
            local = connection.connection.info.get(_LOCAL_DEADLINE)
            if local:
                statements.append(local)
            if statements:
                # one round trip: without parameters psycopg sends them as one query
                connection.exec_driver_sql("; ".join(statements))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        record.info[_CONFIGURED] = True
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


def _search_path_per_transaction(engine: Engine, schema: str) -> None:
    """Make ``schema`` the ``search_path`` of every transaction of ``engine`` (PostgreSQL), for
    raw SQL that names fsm's tables and functions without a schema."""

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql(f"SELECT set_config('search_path', '\"{schema}\"', true)")


#: key of a pooled PostgreSQL connection's ``info``: its per-transaction ``SET LOCAL``s
_LOCAL_DEADLINE: Final = "fsm_local_deadline"


def _readonly_sqlite_url(parsed: URL) -> URL:
    """The ``file:PATH?mode=ro`` URI of a SQLite file that must exist."""
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
    return URL.create("sqlite", database=uri, query={"uri": "true"})


def _uri_path(path: Path) -> str:
    """``path`` for a SQLite ``file:`` URI (``%``, ``?`` and ``#`` escaped)."""
    return str(path).replace("%", "%25").replace("?", "%3f").replace("#", "%23")


def _with_mode_ro(uri: str) -> str:
    base, _, query = uri.partition("?")
    params = [p for p in query.split("&") if p and not p.startswith("mode=")]
    return f"{base}?{'&'.join([*params, 'mode=ro'])}"
