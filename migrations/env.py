"""Alembic environment of fsm's conversation store (one history for SQLite and PostgreSQL).

The database is, in order: a connection handed in through ``config.attributes["connection"]``
(tests), a URL in ``config.attributes["url"]`` (``fsm db``), ``-x db=URL``, ``sqlalchemy.url``
in the ini file (empty in fsm's), ``$FSM_DB_URL``, the default embedded SQLite file
(``$FSM_DB``, else ``./fsm.db``).

Migrations run in one transaction: ``BEGIN IMMEDIATE`` on SQLite (with foreign keys off, as
Alembic's batch mode needs) and under an advisory lock on PostgreSQL, so two processes upgrading
the same database at once run one after the other.

This module imports only the store's metadata (and its URL helpers) from fsm.
"""

from __future__ import annotations

from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from fsm.store.engine import WRITE, create_engine, normalize_url
from fsm.store.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata

#: an arbitrary constant: the PostgreSQL advisory lock that serializes concurrent upgrades.
_PG_MIGRATION_LOCK = 0x66736D5F6462  # "fsm_db"


def _url() -> sa.URL:
    x_args = context.get_x_argument(as_dictionary=True)
    given = config.attributes.get("url") or x_args.get("db")
    return normalize_url(given or config.get_main_option("sqlalchemy.url") or None)


def _run(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        # fsm's SQLite engines begin their own transactions, so DDL is transactional there too
        transactional_ddl=True,
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})"))
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit the SQL (``alembic upgrade head --sql``) instead of running it."""
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.get_backend_name() == "sqlite",
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on a live database."""
    handed_in = config.attributes.get("connection")
    if isinstance(handed_in, Connection):
        _run(handed_in)
        return
    engine = create_engine(_url(), foreign_keys=False, poolclass=NullPool)
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
