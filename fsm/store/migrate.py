"""Schema migrations from Python: upgrade, current revision, and the at-head check.

The Alembic environment and revisions live in the repository's top-level ``migrations/``
directory (what ``alembic.ini`` points at). The package reaches them through
``fsm/store/_migrations``, a symbolic link to ``../../migrations`` in the repository; building a
wheel follows the link, so an installed (non-editable) fsm carries a real copy of the same files
at that path. There is one source for the revisions, and ``fsm db upgrade``, ``alembic upgrade
head`` and the store's own check all read it. (A checkout where the link is not a link, such as
Git on Windows without symlink support, falls back to the top-level directory.)
"""

from __future__ import annotations

import functools
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, Engine

from fsm.store.engine import create_probe_engine, display_url, normalize_url
from fsm.store.errors import (
    MigrationsNotFoundError,
    SchemaNotAtHeadError,
    UnknownRevisionError,
)

__all__ = [
    "alembic_config",
    "check_revision",
    "current_revision",
    "downgrade",
    "ensure_at_head",
    "head_revision",
    "migrations_dir",
    "upgrade",
]

_HERE = Path(__file__).resolve().parent


def migrations_dir() -> Path:
    """The directory holding ``env.py`` and ``versions/`` (see the module docstring)."""
    for candidate in (_HERE / "_migrations", _HERE.parents[1] / "migrations"):
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return candidate
    raise MigrationsNotFoundError(
        f"the Alembic migrations of fsm are missing (looked in {_HERE / '_migrations'} and "
        f"{_HERE.parents[1] / 'migrations'}); reinstall fsm"
    )


def alembic_config(url: str | URL | None = None, *, connection: Connection | None = None) -> Config:
    """An Alembic :class:`~alembic.config.Config` for the store's migrations.

    ``connection`` (handed to ``env.py`` through ``config.attributes["connection"]``) wins over
    ``url``; with neither, ``env.py`` uses ``$FSM_DB_URL`` or the default SQLite file. Logging is
    left as the caller configured it.
    """
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["configure_logger"] = False
    if connection is not None:
        config.attributes["connection"] = connection
    elif url is not None:
        config.attributes["url"] = normalize_url(url)
    return config


@functools.cache
def head_revision() -> str:
    """The revision this version of fsm needs (the single head of the history)."""
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise MigrationsNotFoundError(f"the migration history has {len(heads)} heads: {heads}")
    return heads[0]


def _known_revisions() -> set[str]:
    script = ScriptDirectory.from_config(alembic_config())
    return {rev.revision for rev in script.walk_revisions()}


def check_revision(revision: str) -> str:
    """``revision`` if Alembic can upgrade to it (``head``, ``heads``, or a revision id of
    fsm's history), else :class:`~fsm.store.errors.UnknownRevisionError`."""
    if revision in ("head", "heads") or revision in _known_revisions():
        return revision
    known = ", ".join(sorted(_known_revisions()))
    raise UnknownRevisionError(
        f"no revision {revision!r} in fsm's migrations: give head (the default) or one of {known}"
    )


def upgrade(url: str | URL | None = None, revision: str = "head") -> None:
    """Upgrade the database at ``url`` (``None``: the default) to ``revision``
    (:class:`~fsm.store.errors.UnknownRevisionError` for one fsm does not know)."""
    command.upgrade(alembic_config(url), check_revision(revision))


def downgrade(url: str | URL | None, revision: str) -> None:
    """Downgrade the database at ``url`` to ``revision`` (``"base"`` drops every table)."""
    command.downgrade(alembic_config(url), revision)


def _current(connection: Connection) -> str | None:
    heads = MigrationContext.configure(connection).get_current_heads()
    return heads[0] if heads else None


def current_revision(url: str | URL | None = None) -> str | None:
    """The database's revision, or ``None`` if it has no fsm schema (or does not exist yet).

    A SQLite file that does not exist is reported as ``None`` without being created.
    """
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not Path(database).exists():
            return None
    engine = create_probe_engine(parsed)
    try:
        with engine.connect() as connection:
            return _current(connection)
    finally:
        engine.dispose()


def ensure_at_head(engine: Engine, *, auto_upgrade: bool, upgrade_empty: bool = False) -> None:
    """Check that ``engine``'s database is at :func:`head_revision`.

    If it is not and ``auto_upgrade`` is true, upgrade it; if it is empty (no table at all) and
    ``upgrade_empty`` is true, create the schema; otherwise raise
    :class:`~fsm.store.errors.SchemaNotAtHeadError` naming the command (and the Python call)
    to run.
    """
    head = head_revision()
    with engine.connect() as connection:
        current = _current(connection)
        empty = current is None and upgrade_empty and not sa.inspect(connection).get_table_names()
    if current == head:
        return
    unknown = current is not None and current not in _known_revisions()
    if (auto_upgrade and not unknown) or empty:
        try:
            upgrade(engine.url)
        except Exception:
            # another process opening the same new database may have upgraded it first
            with engine.connect() as connection:
                if _current(connection) != head:
                    raise
        return
    raise SchemaNotAtHeadError(display_url(engine.url), current, head, unknown=unknown)
