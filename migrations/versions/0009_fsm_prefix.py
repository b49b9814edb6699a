"""fsm's own names: every table, index, constraint and sequence of fsm's starts with ``fsm_``.

Revision ID: 0009_fsm_prefix
Revises: 0008_ledger_leases
Create Date: 2026-12-03

A host application's database often has its own ``messages`` or ``conversations`` (issue 29):
fsm's tables become ``fsm_conversations``, ``fsm_messages``, ``fsm_tool_calls``,
``fsm_attempts``, ``fsm_attempt_calls``, ``fsm_pending_turns`` and ``fsm_tool_executions``, and
every name derived from a table's follows it: ``pk_messages`` -> ``pk_fsm_messages``,
``ix_messages_stats`` -> ``ix_fsm_messages_stats``,
``fk_messages_conversation_id_conversations`` ->
``fk_fsm_messages_conversation_id_fsm_conversations`` (:func:`forward`). One constraint is
renamed outright: ``uq_tool_calls_conversation_id_assistant_seq_position_call_id`` becomes
``uq_fsm_tool_calls_call`` (its prefixed name would pass PostgreSQL's 63 characters).

PostgreSQL renames in place (``ALTER TABLE|INDEX|SEQUENCE ... RENAME``, ``RENAME CONSTRAINT``):
the tables and, in a partitioned database, their partitions (``messages_p0`` ->
``fsm_messages_p0``), every index and constraint on them, and the identity sequences
(``attempts_id_seq`` -> ``fsm_attempts_id_seq``). The functions ``fsm_json_valid`` and
``fsm_try_jsonb`` already carry fsm's name and name no table; there are no triggers.

SQLite cannot rename a constraint, so each table is rebuilt: its ``CREATE TABLE`` text with every
name renamed, the rows copied as they are (rowids included), the old table dropped, and its
indexes created again under their new names (as Alembic's batch mode does, with foreign keys and
checks off on the migrating connection).

The names come from the database (the catalog, ``sqlite_master``) and go through
:func:`forward` (downgrade: :func:`backward`), so a host's own objects, whose names are none of
fsm's, are never touched. Revisions import nothing from fsm.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from alembic import op

revision: str = "0009_fsm_prefix"
down_revision: str | Sequence[str] | None = "0008_ledger_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: fsm's tables before this revision, every table before the ones that reference it.
TABLES = (
    "conversations",
    "messages",
    "tool_calls",
    "attempts",
    "attempt_calls",
    "pending_turns",
    "tool_executions",
)
PREFIX = "fsm_"
#: names renamed outright, not by the rule (old -> new).
SPECIAL = {"uq_tool_calls_conversation_id_assistant_seq_position_call_id": "uq_fsm_tool_calls_call"}

_ALTERNATIVES = "|".join(sorted(TABLES, key=len, reverse=True))
#: a table's name where a name derived from it has it: the whole name, after a kind
#: (``pk_``, ``uq_``, ``ck_``, ``fk_``, ``ix_``), at the start (partitions, sequences,
#: PostgreSQL's own names) and at the end of a foreign key's name (its referred table).
_OLD = re.compile(rf"^(?:(?:pk|uq|ck|fk|ix)_)?({_ALTERNATIVES})(?=_|$)")
_NEW = re.compile(rf"^(?:(?:pk|uq|ck|fk|ix)_)?{PREFIX}({_ALTERNATIVES})(?=_|$)")
_FK_OLD = re.compile(rf"^(fk_{PREFIX}.*_)({_ALTERNATIVES})$")
_FK_NEW = re.compile(rf"^(fk_.*_){PREFIX}({_ALTERNATIVES})$")


def forward(name: str) -> str:
    """A name of fsm's before this revision -> after it (unchanged: not one of fsm's)."""
    if name in SPECIAL:
        return SPECIAL[name]
    match = _OLD.match(name)
    if match is None:
        return name
    new = name[: match.start(1)] + PREFIX + name[match.start(1) :]
    if new.startswith("fk_"):
        new = _FK_OLD.sub(rf"\g<1>{PREFIX}\g<2>", new)
    return new


def backward(name: str) -> str:
    """A name of fsm's after this revision -> before it (the inverse of :func:`forward`)."""
    for old, new in SPECIAL.items():
        if name == new:
            return old
    match = _NEW.match(name)
    if match is None:
        return name
    old = name[: match.start(1) - len(PREFIX)] + name[match.start(1) :]
    if old.startswith("fk_"):
        old = _FK_NEW.sub(r"\g<1>\g<2>", old)
    return old


def upgrade() -> None:
    _rename(forward, TABLES)


def downgrade() -> None:
    _rename(backward, tuple(PREFIX + t for t in TABLES))


def _rename(rename: Callable[[str], str], tables: tuple[str, ...]) -> None:
    if op.get_context().as_sql:
        raise RuntimeError(
            "revision 0009_fsm_prefix reads the names to rename from the database: review it "
            "with `fsm db upgrade --sql`, which runs against the database, not alembic --sql"
        )
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with _checks_off():
            _sqlite_rename(rename, tables)
    else:
        _postgres_rename(rename, tables)


# -- SQLite --------------------------------------------------------------------------------------
#: a quoted string (kept as it is), or a name (renamed), in a schema's SQL text
_SQL_TOKEN = re.compile(r"'(?:[^']|'')*'|\"((?:[^\"]|\"\")*)\"|\b([A-Za-z_][A-Za-z0-9_]*)\b")


def _rename_sql(sql: str, rename: Callable[[str], str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return '"' + rename(match.group(1)) + '"'
        if match.group(2) is not None:
            return rename(match.group(2))
        return match.group(0)

    return _SQL_TOKEN.sub(one, sql)


def _require_foreign_keys_off() -> None:
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError(
            "revision 0009_fsm_prefix rebuilds SQLite tables and needs foreign keys off on the "
            "migrating connection: run it with `fsm db upgrade` or `alembic upgrade head`"
        )


@contextmanager
def _checks_off() -> Iterator[None]:
    """The copy keeps every row as it is, including one that broke a check (written with the
    checks off, which ``fsm audit check`` reports), as migrations 0006 and 0007 do."""
    op.execute("PRAGMA ignore_check_constraints = ON")
    try:
        yield
    finally:
        op.execute("PRAGMA ignore_check_constraints = OFF")


def _sqlite_rename(rename: Callable[[str], str], tables: tuple[str, ...]) -> None:
    bind = op.get_bind()
    schema = {
        name: (kind, table, sql)
        for kind, name, table, sql in bind.exec_driver_sql(
            "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE sql IS NOT NULL"
        )
    }
    present = [t for t in tables if schema.get(t, ("",))[0] == "table"]
    indexes = [sql for kind, table, sql in schema.values() if kind == "index" and table in present]
    for table in present:
        op.execute(_rename_sql(schema[table][2], rename))
        op.execute(f'INSERT INTO "{rename(table)}" SELECT * FROM "{table}"')
    for table in reversed(present):
        op.execute(f'DROP TABLE "{table}"')
    for sql in indexes:
        op.execute(_rename_sql(sql, rename))


# -- PostgreSQL ----------------------------------------------------------------------------------
def _postgres_rename(rename: Callable[[str], str], tables: tuple[str, ...]) -> None:
    bind = op.get_bind()
    # fsm's tables in the migration's schema (env.py makes it the search_path) and their
    # partitions, the indexes on them and the sequences they own
    relations = bind.exec_driver_sql(
        """
        WITH RECURSIVE fsm(oid) AS (
            SELECT c.oid FROM pg_class c
             WHERE c.relnamespace = current_schema()::regnamespace
               AND c.relname = ANY(%(tables)s) AND c.relkind IN ('r', 'p')
            UNION
            SELECT i.inhrelid FROM pg_inherits i JOIN fsm ON i.inhparent = fsm.oid
        )
        SELECT c.relname, c.relkind FROM pg_class c JOIN fsm ON c.oid = fsm.oid
        UNION ALL
        SELECT x.relname, x.relkind FROM pg_index i JOIN fsm ON i.indrelid = fsm.oid
          JOIN pg_class x ON x.oid = i.indexrelid
        UNION ALL
        SELECT s.relname, s.relkind FROM pg_depend d JOIN fsm ON d.refobjid = fsm.oid
          JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
         WHERE d.classid = 'pg_class'::regclass
        """,
        {"tables": list(tables)},
    ).all()
    statements = {"r": "TABLE", "p": "TABLE", "i": "INDEX", "I": "INDEX", "S": "SEQUENCE"}
    for name, kind in relations:
        if rename(name) != name:
            op.execute(f'ALTER {statements[kind]} "{name}" RENAME TO "{rename(name)}"')
    # the checks and foreign keys (a key's or a unique constraint's name is its index's,
    # renamed above): renaming a table's check renames its partitions' copies too, so the list
    # is read again after each
    renamed = {rename(t) for t in tables}
    done: set[tuple[str, str]] = set()
    while True:
        todo = [
            (table, name)
            for table, name in bind.exec_driver_sql(
                """
                SELECT c.relname, k.conname FROM pg_constraint k
                  JOIN pg_class c ON c.oid = k.conrelid
                 WHERE c.relnamespace = current_schema()::regnamespace
                   AND k.contype IN ('c', 'f')
                 ORDER BY k.coninhcount, c.relispartition, c.relname, k.conname
                """
            ).all()
            if rename(name) != name and (table in renamed or _partition_of(table, renamed))
        ]
        if not todo:
            break
        table, name = todo[0]
        if (table, name) in done:
            raise RuntimeError(f"revision 0009_fsm_prefix could not rename {name} of {table}")
        done.add((table, name))
        op.execute(f'ALTER TABLE "{table}" RENAME CONSTRAINT "{name}" TO "{rename(name)}"')


def _partition_of(table: str, tables: set[str]) -> bool:
    return re.sub(r"_p[0-9]+$", "", table) in tables
