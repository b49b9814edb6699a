"""Schema migrations from Python: upgrade, current revision, and the at-head check.

The Alembic environment and revisions live in the repository's top-level ``migrations/``
directory (what ``alembic.ini`` points at). The package reaches them through
``fsm/store/_migrations``, a symbolic link to ``../../migrations`` in the repository; building a
wheel follows the link, so an installed (non-editable) fsm carries a real copy of the same files
at that path. There is one source for the revisions, and ``fsm db upgrade``, ``alembic upgrade
head`` and the store's own check all read it. (A checkout where the link is not a link, such as
Git on Windows without symlink support, falls back to the top-level directory.)

**Sharing a database.** fsm keeps its revision in its own version table,
:data:`VERSION_TABLE` (``fsm_alembic_version``), so a host application's Alembic history (in
``alembic_version``) and fsm's live side by side. On PostgreSQL every fsm object (tables,
indexes, sequences, the functions of migration 0003, the version table) can live in a schema of
its own (``schema=`` here and on the stores, ``fsm db upgrade --schema``, or ``$FSM_SCHEMA``);
the schema is created by the upgrade if it does not exist. A database upgraded by an fsm that
used ``alembic_version`` moves its revision to :data:`VERSION_TABLE` on the next upgrade (only a
revision of fsm's own history, with fsm's tables present, is moved; a host's is left alone).
A host's ``env.py`` passes :func:`include_object` to ``context.configure`` so its autogenerate
never sees fsm's tables.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, Engine

from fsm.store.engine import (
    WRITE,
    create_engine,
    create_probe_engine,
    display_url,
    new_sqlite_file,
    normalize_url,
    schema_of,
    store_schema,
)
from fsm.store.errors import (
    MigrationsNotFoundError,
    SchemaNotAtHeadError,
    StoreLayoutError,
    UnknownRevisionError,
)
from fsm.store.models import TABLES

__all__ = [
    "FSM_TABLES",
    "LEGACY_VERSION_TABLE",
    "MAX_PARTITIONS",
    "VERSION_TABLE",
    "alembic_config",
    "check_revision",
    "current_revision",
    "downgrade",
    "ensure_at_head",
    "head_revision",
    "include_object",
    "is_fsm_table",
    "is_partition",
    "legacy_revision",
    "migrations_dir",
    "revision_of",
    "upgrade",
    "upgrade_statements",
]

#: the table holding fsm's revision (a host application's Alembic keeps ``alembic_version``).
VERSION_TABLE = "fsm_alembic_version"
#: where fsm kept its revision before it had a table of its own.
LEGACY_VERSION_TABLE = "alembic_version"
#: fsm's tables (with :data:`VERSION_TABLE`; partitions are named ``<table>_p<N>``).
FSM_TABLES: frozenset[str] = frozenset({*TABLES, VERSION_TABLE})
#: the most hash partitions ``fsm db upgrade --partitions N`` creates per table.
MAX_PARTITIONS = 1024

_PARTITION = re.compile(r"(?P<table>[a-z_]+)_p[0-9]+\Z")


def is_partition(name: str | None) -> bool:
    """Whether ``name`` is a hash partition of one of fsm's tables (``<table>_p<N>``)."""
    match = _PARTITION.match(name or "")
    return match is not None and match["table"] in FSM_TABLES


def is_fsm_table(name: str | None) -> bool:
    """Whether ``name`` is one of fsm's tables, its version table, or a hash partition of one."""
    if name is None:
        return False
    return name in FSM_TABLES or is_partition(name)


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """An Alembic ``include_object`` hook for a *host* application sharing fsm's database.

    It leaves out fsm's tables (:data:`FSM_TABLES`, their partitions and fsm's version table)
    and everything on them (columns, indexes, constraints), so the host's ``alembic revision
    --autogenerate`` and ``alembic check`` neither drop nor recreate them::

        from fsm.store.migrate import include_object
        context.configure(connection=..., target_metadata=..., include_object=include_object)

    (With fsm in a schema of its own and the host's ``include_schemas`` off, the host never
    reflects fsm's tables anyway; the hook costs nothing there.) Combine it with a host hook by
    calling both.
    """
    if type_ == "table":
        return not is_fsm_table(name)
    table = getattr(obj, "table", None)
    if table is None and type_ == "foreign_key_constraint":
        table = getattr(obj, "parent", None)
    return not is_fsm_table(getattr(table, "name", None))


_HERE = Path(__file__).resolve().parent
_log = logging.getLogger(__name__)


def migrations_dir() -> Path:
    """The directory holding ``env.py`` and ``versions/`` (see the module docstring)."""
    for candidate in (_HERE / "_migrations", _HERE.parents[1] / "migrations"):
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return candidate
    raise MigrationsNotFoundError(
        f"the Alembic migrations of fsm are missing (looked in {_HERE / '_migrations'} and "
        f"{_HERE.parents[1] / 'migrations'}); reinstall fsm"
    )


def alembic_config(
    url: str | URL | None = None,
    *,
    connection: Connection | None = None,
    schema: str | None = None,
    partitions: int | None = None,
) -> Config:
    """An Alembic :class:`~alembic.config.Config` for the store's migrations.

    ``connection`` (handed to ``env.py`` through ``config.attributes["connection"]``) wins over
    ``url``; with neither, ``env.py`` uses ``$FSM_DB_URL`` or the default SQLite file. Logging is
    left as the caller configured it. ``schema``: the PostgreSQL schema of fsm's objects (see
    :func:`fsm.store.engine.store_schema`; ``None``: ``$FSM_SCHEMA``, else the search path).
    ``partitions``: create a new database with every table hash-partitioned by conversation
    into that many partitions (PostgreSQL; see :func:`upgrade`).
    """
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["configure_logger"] = False
    if connection is not None:
        config.attributes["connection"] = connection
        config.attributes["schema"] = store_schema(schema, connection.engine.url)
    elif url is not None:
        config.attributes["url"] = normalize_url(url)
        config.attributes["schema"] = store_schema(schema, url)
    elif schema is not None:
        config.attributes["schema"] = store_schema(schema, None)
    # else: env.py resolves $FSM_SCHEMA against the default database, if it ever connects
    if partitions is not None:
        config.attributes["partitions"] = partitions
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


def check_partitions(partitions: int | None, url: str | URL | None) -> None:
    """Refuse a partition count out of ``2..MAX_PARTITIONS``, or partitions off PostgreSQL
    (:class:`~fsm.store.errors.StoreLayoutError`)."""
    if partitions is None:
        return
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise StoreLayoutError(
            f"the number of partitions must be a whole number, not {partitions!r}"
        )
    if not 2 <= partitions <= MAX_PARTITIONS:
        raise StoreLayoutError(
            f"the number of partitions must be between 2 and {MAX_PARTITIONS}, not {partitions}"
        )
    backend = normalize_url(url).get_backend_name()
    if backend != "postgresql":
        raise StoreLayoutError(
            f"hash partitions are a PostgreSQL feature: {backend} keeps each table whole; "
            "drop --partitions"
        )


def upgrade(
    url: str | URL | None = None,
    revision: str = "head",
    *,
    schema: str | None = None,
    partitions: int | None = None,
    connection: Connection | None = None,
) -> None:
    """Upgrade the database at ``url`` (``None``: the default) to ``revision``.

    ``schema``: the PostgreSQL schema of fsm's objects (created if missing; ``None``:
    ``$FSM_SCHEMA``, else the search path). ``partitions``: on PostgreSQL, a database with no fsm
    tables yet is created at head with every table hash-partitioned by conversation into that
    many partitions (``<table>_p0`` ...); a database already created unpartitioned, or with
    another number of partitions, is refused (:class:`~fsm.store.errors.StoreLayoutError`); one
    created with the same number is upgraded as usual. ``connection``: run in the caller's
    connection and transaction (committing is then the caller's business), e.g. right after the
    host application's own ``alembic upgrade`` in one transaction.
    """
    check_partitions(partitions, connection.engine.url if connection is not None else url)
    _log.info("migrating %s to %s", display_url(normalize_url(url)), revision)
    config = alembic_config(url, connection=connection, schema=schema, partitions=partitions)
    command.upgrade(config, check_revision(revision))


#: the first words of the statements that change a database (what ``--sql`` prints)
_CHANGES = frozenset(
    {"CREATE", "ALTER", "DROP", "INSERT", "UPDATE", "DELETE", "COMMENT", "GRANT", "TRUNCATE"}
)


def upgrade_statements(
    url: str | URL | None = None, revision: str = "head", *, schema: str | None = None
) -> list[str]:
    """The SQL an :func:`upgrade` of the database at ``url`` to ``revision`` would run, from
    its current revision, for a DBA to review (``fsm db upgrade --sql``).

    The upgrade runs for real, in one transaction that is rolled back: nothing is changed, and
    the statements are exactly those the database would get (the migrations read what is there,
    which a script written offline cannot). Only the statements that change the database are
    listed (``CREATE``, ``ALTER``, ``DROP``, ``INSERT``, ``UPDATE``, ``DELETE``, ...; not what the
    migrations read). A SQLite file that does not exist yet is not created: the statements of a
    new database are read from an in-memory one. Each statement ends with ``;``; its
    parameters, if any, follow it as a comment.
    """
    target = normalize_url(url)
    if new_sqlite_file(target) is not None:
        target = URL.create(target.drivername)  # sqlite:// (in memory): a new database's DDL
    engine = create_engine(
        target,
        foreign_keys=False,
        poolclass=sa.pool.NullPool,
        schema=store_schema(schema, target),
    )
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        text = statement.strip().rstrip(";")
        first = text.split(None, 1)[0].upper() if text else ""
        if first not in _CHANGES and not (first == "PRAGMA" and "=" in text):
            return  # what the migrations read (introspection, settings) is not the change
        if parameters:
            text += f";  -- parameters: {parameters!r}"
        else:
            text += ";"
        statements.append(text)

    try:
        with engine.connect() as connection:
            connection = connection.execution_options(**{WRITE: True})
            transaction = connection.begin()
            try:
                sa.event.listen(connection, "before_cursor_execute", record)
                upgrade(revision=revision, schema=schema, connection=connection)
            finally:
                sa.event.remove(connection, "before_cursor_execute", record)
                transaction.rollback()
    finally:
        engine.dispose()
    return statements


def downgrade(url: str | URL | None, revision: str, *, schema: str | None = None) -> None:
    """Downgrade the database at ``url`` to ``revision`` (``"base"`` drops every table)."""
    _log.info("downgrading %s to %s", display_url(normalize_url(url)), revision)
    command.downgrade(alembic_config(url, schema=schema), revision)


def _version_context(connection: Connection, schema: str | None) -> MigrationContext:
    return MigrationContext.configure(
        connection, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
    )


def _current(connection: Connection, schema: str | None) -> str | None:
    heads = _version_context(connection, schema).get_current_heads()
    return heads[0] if heads else None


def legacy_revision(connection: Connection, schema: str | None = None) -> str | None:
    """fsm's revision if the database still keeps it in :data:`LEGACY_VERSION_TABLE` (fsm
    before it had its own version table): a revision of fsm's history, with fsm's tables
    present; ``None`` otherwise (a host application's revision there is not fsm's)."""
    inspector = sa.inspect(connection)
    if not inspector.has_table(LEGACY_VERSION_TABLE, schema=schema):
        return None
    if not all(inspector.has_table(t, schema=schema) for t in ("conversations", "messages")):
        return None
    table = sa.table(LEGACY_VERSION_TABLE, sa.column("version_num"), schema=schema)
    known = _known_revisions()
    found = [v for v in connection.execute(sa.select(table.c.version_num)).scalars() if v in known]
    return found[0] if len(found) == 1 else None


def revision_of(connection: Connection) -> str | None:
    """The fsm revision of the database ``connection`` is on, read in its schema
    (:func:`fsm.store.engine.schema_of`): from :data:`VERSION_TABLE`, else one of fsm's own
    revisions still in :data:`LEGACY_VERSION_TABLE`; ``None`` if it has no fsm schema."""
    schema = schema_of(connection)
    return _current(connection, schema) or legacy_revision(connection, schema)


def current_revision(url: str | URL | None = None, *, schema: str | None = None) -> str | None:
    """The database's revision, or ``None`` if it has no fsm schema (or does not exist yet).

    Read from :data:`VERSION_TABLE` (in ``schema``), else from :data:`LEGACY_VERSION_TABLE` when
    that holds one of fsm's own revisions (see :func:`legacy_revision`). A SQLite file that does
    not exist is reported as ``None`` without being created.
    """
    parsed = normalize_url(url)
    in_schema = store_schema(schema, parsed)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not Path(database).exists():
            return None
    engine = create_probe_engine(parsed)
    try:
        with engine.connect() as connection:
            return _current(connection, in_schema) or legacy_revision(connection, in_schema)
    finally:
        engine.dispose()


def ensure_at_head(engine: Engine, *, auto_upgrade: bool, upgrade_empty: bool = False) -> None:
    """Check that ``engine``'s database is at :func:`head_revision`.

    If it is not and ``auto_upgrade`` is true, upgrade it; if it is empty (no table at all) and
    ``upgrade_empty`` is true, create the schema; otherwise raise
    :class:`~fsm.store.errors.SchemaNotAtHeadError` naming the command (and the Python call)
    to run. The revision is read in the engine's schema (:func:`fsm.store.engine.schema_of`); a
    revision still in the legacy table counts as not at head (the upgrade moves it).
    """
    head = head_revision()
    schema = schema_of(engine)
    with engine.connect() as connection:
        current = _current(connection, schema)
        if current is None:
            current = legacy_revision(connection, schema)
            legacy = current is not None
        else:
            legacy = False
        empty = current is None and upgrade_empty and not sa.inspect(connection).get_table_names()
    if current == head and not legacy:
        return
    unknown = current is not None and current not in _known_revisions()
    if (auto_upgrade and not unknown) or empty:
        try:
            upgrade(engine.url, schema=schema)
        except Exception:
            # another process opening the same new database may have upgraded it first
            with engine.connect() as connection:
                if _current(connection, schema) != head:
                    raise
        return
    raise SchemaNotAtHeadError(
        display_url(engine.url), current, head, unknown=unknown, schema=schema
    )
