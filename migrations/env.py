"""Alembic environment of fsm's conversation store (one history for SQLite and PostgreSQL).

The database is, in order: a connection handed in through ``config.attributes["connection"]``
(tests), a URL in ``config.attributes["url"]`` (``fsm db``), ``-x db=URL``, ``sqlalchemy.url``
in the ini file (empty in fsm's), ``$FSM_DB_URL``, the default embedded SQLite file
(``$FSM_DB``, else ``./fsm.db``).

Migrations run in one transaction: ``BEGIN IMMEDIATE`` on SQLite (with foreign keys off, as
Alembic's batch mode needs) and under an advisory lock on PostgreSQL, so two processes upgrading
the same database at once run one after the other.

fsm's revision lives in its own version table, ``fsm_alembic_version``
(:data:`fsm.store.migrate.VERSION_TABLE`), so a host application's ``alembic_version`` is never
read or written; a database whose fsm revision is still in ``alembic_version`` (an older fsm)
has it moved first. The PostgreSQL schema of fsm's objects is ``config.attributes["schema"]``
(``fsm db upgrade --schema``, ``fsm.store.upgrade(schema=)``), else ``-x schema=NAME``, else
``$FSM_SCHEMA``; it is created if missing, fsm's tables are put there by a
``schema_translate_map``, and the migration transaction's ``search_path`` is that schema (set
with ``set_config(..., true)`` and put back afterwards), so the revisions' raw SQL and their
functions land there too. ``config.attributes["partitions"]`` (``fsm db upgrade --partitions
N``) creates a new database at head with every table hash-partitioned
(:mod:`fsm.store.partitions`).

This module imports only the store's metadata (and its URL helpers) from fsm.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

import fsm.store.partitions as fsm_partitions
from fsm.store.engine import WRITE, create_engine, normalize_url, store_schema
from fsm.store.errors import StoreLayoutError
from fsm.store.migrate import LEGACY_VERSION_TABLE, VERSION_TABLE, is_partition
from fsm.store.models import SQLITE_ROWID_KEY, STATS_INDEX, Base

config = context.config
# SQLite: SQLAlchemy cannot reflect ix_fsm_messages_stats (an index on an expression), which fsm's
# own comparison leaves out anyway (see _include)
warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index")
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata

#: an arbitrary constant: the PostgreSQL advisory lock that serializes concurrent upgrades.
_PG_MIGRATION_LOCK = 0x66736D5F6462  # "fsm_db"


def _url() -> sa.URL:
    x_args = context.get_x_argument(as_dictionary=True)
    given = config.attributes.get("url") or x_args.get("db")
    return normalize_url(given or config.get_main_option("sqlalchemy.url") or None)


def _schema(url: sa.URL) -> str | None:
    if "schema" in config.attributes:
        schema: str | None = config.attributes["schema"]
        return schema
    return store_schema(context.get_x_argument(as_dictionary=True).get("schema"), url)


def _include(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    """fsm's own autogenerate compares fsm's tables only: not a host's tables (or its
    ``alembic_version``) sharing the database, not the partitions of a partitioned database."""
    if type_ == "table" and reflected:
        return name in target_metadata.tables
    if type_ == "index" and reflected and name == STATS_INDEX:
        # created by DDL of its own per engine (models.STATS_INDEX_DDL, migration 0006), not a
        # model Index; tests/store/test_migrations.py compares its definition
        return False
    if type_ == "foreign_key_constraint" and reflected and compare_to is None:
        # PostgreSQL checks a foreign key to a partitioned table with one internal constraint
        # per partition (``conparentid`` set): not fsm's to compare
        return not is_partition(getattr(getattr(obj, "referred_table", None), "name", None))
    if type_ == "unique_constraint" and reflected and compare_to is None:
        # SQLite: the UNIQUE that stands for a rowid table's model key (models.SQLITE_ROWID_KEY)
        table = target_metadata.tables.get(getattr(getattr(obj, "table", None), "name", ""))
        spec = table.info.get(SQLITE_ROWID_KEY) if table is not None else None
        columns = tuple(c.name for c in getattr(obj, "columns", ()))
        return not (spec and columns == tuple(spec[1]))
    return True


def _enter_schema(connection: Connection, schema: str) -> str:
    """Create ``schema`` if missing and make it the transaction's ``search_path``; the old
    ``search_path``."""
    exists = connection.execute(
        sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :schema"), {"schema": schema}
    ).scalar()
    if not exists:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    old: str = connection.execute(sa.text("SELECT current_setting('search_path')")).scalar_one()
    connection.execute(sa.text(f"SELECT set_config('search_path', '\"{schema}\"', true)"))
    return old


def _adopt_legacy_version_table(connection: Connection, schema: str | None) -> None:
    """Move fsm's revision from ``alembic_version`` (an older fsm) to fsm's version table:
    only a revision of fsm's own history with fsm's tables present; a host's is left alone."""
    inspector = sa.inspect(connection)
    if inspector.has_table(VERSION_TABLE, schema=schema):
        return
    if not inspector.has_table(LEGACY_VERSION_TABLE, schema=schema):
        return
    if not all(inspector.has_table(t, schema=schema) for t in ("conversations", "messages")):
        return
    legacy = sa.table(LEGACY_VERSION_TABLE, sa.column("version_num"), schema=schema)
    known = {script.revision for script in context.script.walk_revisions()}
    ours = [v for v in connection.execute(sa.select(legacy.c.version_num)).scalars() if v in known]
    if len(ours) != 1:
        return
    version = sa.Table(
        VERSION_TABLE,
        sa.MetaData(),
        sa.Column("version_num", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("version_num", name=f"{VERSION_TABLE}_pkc"),
        schema=schema,
    )
    version.create(connection)
    connection.execute(sa.insert(version).values(version_num=ours[0]))
    connection.execute(sa.delete(legacy).where(legacy.c.version_num == ours[0]))
    if connection.execute(sa.select(sa.func.count()).select_from(legacy)).scalar_one() == 0:
        sa.Table(LEGACY_VERSION_TABLE, sa.MetaData(), schema=schema).drop(connection)


#: fsm's tables before revision 0009 (``messages``, ...), which the revisions up to it create
#: and rename: a database that gets them by running those revisions must not have them already.
LEGACY_TABLES = (
    "conversations",
    "messages",
    "tool_calls",
    "attempts",
    "attempt_calls",
    "pending_turns",
    "tool_executions",
)


def _refuse_clashes(
    connection: Connection, schema: str | None, names: Collection[str] = ()
) -> None:
    """A database with no fsm revision whose tables already use fsm's names (a host's own
    ``fsm_messages``, ...; with ``names``, those too): a typed error naming them, nothing
    changed (creating fsm's tables there would fail half-way, or worse, adopt the host's)."""
    inspector = sa.inspect(connection)
    if inspector.has_table(VERSION_TABLE, schema=schema):
        return
    ours = {*target_metadata.tables, *names}
    clash = sorted(set(inspector.get_table_names(schema=schema)) & ours)
    if clash:
        where = f"schema {schema!r}" if schema else "the database"
        found = ", ".join(clash)
        raise StoreLayoutError(
            f"{where} already has table(s) named {found}, which fsm did not create (no fsm "
            "revision is recorded there): fsm's tables would collide with them; nothing was "
            "changed. Give fsm a database of its own, or on PostgreSQL a schema of its own "
            "(fsm db upgrade --schema fsm)"
        )


def _new_at_head() -> bool:
    """Whether this is ``upgrade`` to head of a database with no fsm revision: it is created
    from the models at head (which the revisions are tested to build identically) and stamped,
    so it never has the names of older revisions (a host's own ``messages`` is left alone)."""
    migration = context.get_context()
    if getattr(migration.opts.get("fn"), "__name__", None) != "upgrade":
        return False  # stamp, check, current, downgrade: as Alembic does them
    if migration.get_current_revision() is not None:
        return False
    return context.get_revision_argument() in ("head", context.script.get_current_head())


def _run(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    schema = _schema(connection.engine.url)
    partitions: int | None = config.attributes.get("partitions")
    if schema is not None:
        connection = connection.execution_options(schema_translate_map={None: schema})
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        # fsm's SQLite engines begin their own transactions, so DDL is transactional there too
        transactional_ddl=True,
        compare_type=True,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        include_object=_include,
    )
    with context.begin_transaction():
        old_path = None
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})"))
            if schema is not None:
                old_path = _enter_schema(connection, schema)
        _adopt_legacy_version_table(connection, schema)
        _refuse_clashes(connection, schema)
        if partitions is not None and fsm_partitions.prepare(connection, schema, partitions):
            target = context.get_revision_argument()
            if target not in ("head", context.script.get_current_head()):
                raise StoreLayoutError(
                    f"a partitioned database is created at head, not at revision {target}: "
                    "upgrade to head (the default)"
                )
            fsm_partitions.create_at_head(connection, schema, partitions)
            context.get_context().stamp(context.script, "head")
        elif _new_at_head():
            target_metadata.create_all(connection)
            context.get_context().stamp(context.script, "head")
        else:
            if context.get_context().get_current_revision() is None:
                _refuse_clashes(connection, schema, LEGACY_TABLES)
            context.run_migrations()
        if old_path is not None:
            connection.execute(
                sa.text("SELECT set_config('search_path', :path, true)"), {"path": old_path}
            )


def run_migrations_offline() -> None:
    """Emit the SQL (``alembic upgrade head --sql``) instead of running it."""
    url = _url()
    schema = _schema(url)
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.get_backend_name() == "sqlite",
        dialect_opts={"paramstyle": "named"},
        version_table=VERSION_TABLE,
        version_table_schema=schema,
    )
    with context.begin_transaction():
        if schema is not None:
            context.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            context.execute(f'SET search_path TO "{schema}"')
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on a live database."""
    handed_in = config.attributes.get("connection")
    if isinstance(handed_in, Connection):
        _run(handed_in)
        return
    url = _url()
    engine = create_engine(url, foreign_keys=False, poolclass=NullPool, schema=_schema(url))
    try:
        with engine.connect() as connection:
            _run(connection.execution_options(**{WRITE: True}))
            if connection.in_transaction():
                connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
