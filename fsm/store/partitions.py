"""Hash partitions by conversation on PostgreSQL (``fsm db upgrade --partitions N``).

Every key of every fsm table leads with the conversation (``fsm_conversations.id``, the others'
``conversation_id``; ``fsm_attempts`` and ``fsm_attempt_calls`` since migration 0004,
``fsm_pending_turns`` and ``fsm_tool_executions`` from migration 0005), so each table can
be ``PARTITION BY HASH`` on that column with every key, foreign key and check intact:
partitions ``<table>_p0`` ... ``<table>_p<N-1>`` (``FOR VALUES WITH (MODULUS N, REMAINDER
i)``), the same ``N`` for every table, so one conversation's rows sit in partitions of the same
remainder.

A partitioned database is created at head, from the models (which the migrations are tested to
build identically), in the migration transaction of ``migrations/env.py``, and stamped at head;
later revisions run on it as on any database (PostgreSQL applies an ``ALTER TABLE`` or a
``CREATE INDEX`` on a partitioned table to its partitions). An existing unpartitioned database
cannot be partitioned in place (dump it and load it into a new database created with
``--partitions``): :func:`prepare` refuses it, and a database created with another number of
partitions, with :class:`~fsm.store.errors.StoreLayoutError`.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.store.errors import StoreLayoutError
from fsm.store.migrate import VERSION_TABLE
from fsm.store.models import Base, Conversation

__all__ = ["PARTITION_KEYS", "create_at_head", "partition_count", "partition_names", "prepare"]

#: the partition (and Citus distribution) column of each table.
PARTITION_KEYS: dict[str, str] = {
    table.name: "id" if table.name == Conversation.__tablename__ else "conversation_id"
    for table in Base.metadata.sorted_tables
}


#: the conversations table before revision 0009 gave fsm's tables their prefix.
LEGACY_CONVERSATIONS = "conversations"


def partition_names(table: str, partitions: int) -> list[str]:
    """The names of ``table``'s partitions."""
    return [f"{table}_p{i}" for i in range(partitions)]


def partition_count(connection: Connection, schema: str | None, table: str) -> int | None:
    """How many hash partitions ``table`` has (``None``: it is not partitioned, or missing)."""
    row = connection.execute(
        sa.text(
            "SELECT p.partstrat, (SELECT count(*) FROM pg_inherits i WHERE i.inhparent = c.oid)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " LEFT JOIN pg_partitioned_table p ON p.partrelid = c.oid"
            " WHERE c.relname = :table AND n.nspname = coalesce(:schema, current_schema())"
        ),
        {"table": table, "schema": schema},
    ).first()
    if row is None or row[0] is None:
        return None
    return int(row[1])


def prepare(connection: Connection, schema: str | None, partitions: int) -> bool:
    """Whether the database must be created partitioned (it has no fsm tables yet); ``False``
    when it already is, with ``partitions`` partitions (upgrade it as usual). Raises
    :class:`~fsm.store.errors.StoreLayoutError` on SQLite, on a database created unpartitioned
    and on one with another number of partitions."""
    if connection.dialect.name != "postgresql":
        raise StoreLayoutError(
            f"hash partitions are a PostgreSQL feature: {connection.dialect.name} keeps each "
            "table whole; drop --partitions"
        )
    inspector = sa.inspect(connection)
    if not inspector.has_table(Conversation.__tablename__, schema=schema):
        if not inspector.has_table(VERSION_TABLE, schema=schema):
            return True  # no fsm revision: a new database (a host's own tables are its own)
        # an fsm database before revision 0009 (its tables without fsm's prefix)
        found = partition_count(connection, schema, LEGACY_CONVERSATIONS)
    else:
        found = partition_count(connection, schema, Conversation.__tablename__)
    if found is None:
        raise StoreLayoutError(
            "this database was created unpartitioned: fsm cannot partition its tables in place; "
            "create a new database with --partitions and copy the data into it, or drop "
            "--partitions"
        )
    if found != partitions:
        raise StoreLayoutError(
            f"this database is partitioned into {found} partitions per table, not {partitions}: "
            f"give --partitions {found} (or none)"
        )
    return False


def create_at_head(connection: Connection, schema: str | None, partitions: int) -> None:
    """Create fsm's functions and tables at head, every table hash-partitioned by conversation
    into ``partitions`` partitions (in the caller's transaction, whose ``search_path`` is
    ``schema`` when one is given)."""
    tables = Base.metadata.sorted_tables
    options = [table.dialect_options["postgresql"] for table in tables]
    saved = [opts["partition_by"] for opts in options]
    # the models' own tables (a copy would lose their per-engine checks), partitioned for this
    # create_all only (which also creates the functions the checks use)
    for table, opts in zip(tables, options, strict=True):
        opts["partition_by"] = f"HASH ({PARTITION_KEYS[table.name]})"
    try:
        Base.metadata.create_all(connection)
    finally:
        for opts, value in zip(options, saved, strict=True):
            opts["partition_by"] = value
    quote = connection.dialect.identifier_preparer.quote
    prefix = "" if schema is None else f"{quote(schema)}."
    for table in tables:
        for remainder, name in enumerate(partition_names(table.name, partitions)):
            connection.exec_driver_sql(
                f"CREATE TABLE {prefix}{quote(name)} PARTITION OF {prefix}{quote(table.name)}"
                f" FOR VALUES WITH (MODULUS {partitions}, REMAINDER {remainder})"
            )
