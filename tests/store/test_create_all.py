"""A store created at head on PostgreSQL, then one on SQLite in the same process: the SQLite
store keeps every foreign key.

SQLAlchemy adds the key that closes the messages <-> tool_calls cycle (``use_alter``) on
PostgreSQL with an ``ALTER TABLE`` and marks the constraint object "not inline" for good; SQLite
writes every constraint inline, so a later create there dropped the key without a word (found
when the whole suite ran in one process: the demo's audit found the key "unenforced").
The key is a ``fsm.store.models.AlterForeignKey``, whose rule cannot be switched off.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import sqlalchemy as sa

from fsm.store import upgrade
from fsm.store.audit import check
from fsm.store.models import Base
from tests.helpers.store import pg_schema_url, postgres_server


def _sqlite_foreign_keys(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            sql = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE name = 'fsm_messages'"
            ).scalar_one()
    finally:
        engine.dispose()
    return {part.split()[0] for part in sql.split("CONSTRAINT ")[1:] if "FOREIGN KEY" in part}


def test_sqlite_after_postgresql_keeps_every_foreign_key(tmp_path: Path) -> None:
    server = postgres_server()
    pg_url, drop = pg_schema_url(server)
    twice = f"fsm_twice_{uuid.uuid4().hex[:8]}"
    try:
        upgrade(pg_url.render_as_string(hide_password=False))  # created at head on PostgreSQL
        engine = sa.create_engine(pg_url)
        try:
            with engine.begin() as conn:  # as a host's own create_all would, too
                conn.exec_driver_sql(f"CREATE SCHEMA {twice}")
                conn.exec_driver_sql(f"SET LOCAL search_path TO {twice}")
                Base.metadata.create_all(conn)
        finally:
            engine.dispose()
    finally:
        drop()
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {twice} CASCADE")
        admin.dispose()
    url = f"sqlite:///{tmp_path / 'after.db'}"
    upgrade(url)
    assert "fk_fsm_messages_result_call" in _sqlite_foreign_keys(url)
    engine = sa.create_engine(url)
    try:
        assert list(check(engine)) == []
    finally:
        engine.dispose()
