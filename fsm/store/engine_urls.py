"""The database URLs the store's engines take (:mod:`fsm.store.engine` re-exports these): the
default database, the forms a URL may be given in (a path, a multi-host PostgreSQL URL), how it
is displayed, a new SQLite file's lifetime, the engine options a URL carries, and its async, sync
and read-only forms."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import URL

from fsm.store.engine_config import ASYNC_SQLITE, POOL_SIZE, SYNC_POSTGRES
from fsm.store.errors import (
    AuditError,
    DatabaseNotFoundError,
    DatabaseUrlError,
)
from fsm.store.urls import sqlite_file


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


def async_url(url: str | URL | None) -> URL:
    """The asyncio form of a store URL (``None``: the default database): SQLite goes through
    ``aiosqlite``; ``postgresql+psycopg`` stays as it is (SQLAlchemy picks psycopg's async
    driver for an async engine)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.set(drivername=ASYNC_SQLITE)
    if parsed.drivername == "postgresql+psycopg_async":
        return parsed.set(drivername=SYNC_POSTGRES)
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
        return parsed.set(drivername=SYNC_POSTGRES)
    return parsed


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


def url_options(url: URL, kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
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


def readonly_sqlite_url(parsed: URL) -> URL:
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
