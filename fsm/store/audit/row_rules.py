"""The rules the database enforces (keys, checks, column types), re-checked row by row from the schema's models and the database's own shape, for the integrity check (:mod:`fsm.store.audit.integrity`)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection

from fsm.store.audit.filters import pg_function
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    CALLS,
    CONVERSATIONS,
    MESSAGES,
    as_int,
    as_opt_text,
    as_text,
)
from fsm.store.audit.violations import Violation
from fsm.store.models import TABLES, PendingTurnRow, ToolExecution

# -- the row checks ------------------------------------------------------------------------------
#: The checks of the models that the structural scans verify (with more precise kinds), by table.
STRUCTURAL_CHECKS: Final = frozenset(
    {
        "ck_fsm_messages_seq",
        "ck_fsm_messages_role",
        "ck_fsm_messages_n_calls",
        "ck_fsm_messages_slots_left",
        "ck_fsm_messages_prev",
        "ck_fsm_messages_result_slot",
        "ck_fsm_messages_block_end",
        "ck_fsm_tool_calls_position",
        "ck_fsm_tool_calls_finished",
        "ck_fsm_tool_calls_tool_call_state",
        "ck_fsm_tool_calls_repaired",
    }
)

#: The kind of violation of every other check (a check added to the models later is verified
#: as ``invalid_row`` until it gets a kind of its own).
CHECK_KINDS: Final = {
    "ck_fsm_conversations_types": "invalid_type",
    "ck_fsm_messages_types": "invalid_type",
    "ck_fsm_tool_calls_types": "invalid_type",
    "ck_fsm_attempts_types": "invalid_type",
    "ck_fsm_attempt_calls_types": "invalid_type",
    "ck_fsm_tool_calls_name": "invalid_name",
    "ck_fsm_tool_calls_arguments": "invalid_arguments",
    "ck_fsm_messages_content": "missing_content",
}

#: Per table: the columns that say where a row is (and what it is about), read raw.
_ROW_IDENTITY: Final = {
    "fsm_conversations": "fsm_conversations.id, NULL, NULL, NULL",
    "fsm_messages": "fsm_messages.conversation_id, fsm_messages.seq, fsm_messages.role, NULL",
    "fsm_tool_calls": "fsm_tool_calls.conversation_id, fsm_tool_calls.assistant_seq, fsm_tool_calls.position, "
    "fsm_tool_calls.call_id",
    "fsm_attempts": "fsm_attempts.conversation_id, fsm_attempts.id, fsm_attempts.at_seq, NULL",
    "fsm_attempt_calls": "(SELECT a.conversation_id FROM fsm_attempts a "
    "WHERE a.id = fsm_attempt_calls.attempt_id), fsm_attempt_calls.attempt_id, fsm_attempt_calls.position, "
    "fsm_attempt_calls.call_id",
    # the tool ledger (migration 0005)
    "fsm_pending_turns": "fsm_pending_turns.conversation_id, fsm_pending_turns.id, fsm_pending_turns.state, NULL",
    "fsm_tool_executions": "fsm_tool_executions.conversation_id, fsm_tool_executions.pending_id, "
    "fsm_tool_executions.position, fsm_tool_executions.call_id",
}
CHECKED_TABLES: Final = TABLES
_PENDING = cast(sa.Table, PendingTurnRow.__table__)
_EXECUTIONS = cast(sa.Table, ToolExecution.__table__)


@dataclass(frozen=True, slots=True)
class _Rule:
    """A check of one row: ``sql`` is false for a row that breaks it (true or NULL passes)."""

    name: str
    kind: str
    sql: str


@dataclass(frozen=True, slots=True)
class Shape:
    """What one check run needs to know about the database it reads."""

    dialect: str
    #: messages has its primary key (conversation_id, seq): two rows cannot share a seq
    unique_seq: bool
    #: the row checks to evaluate, per table
    rules: dict[str, tuple[_Rule, ...]]
    #: (table, key columns, condition): unique keys whose key or index the database lost
    lost_keys: tuple[tuple[str, tuple[str, ...], str | None], ...]
    #: the columns of each table in the database
    columns: dict[str, frozenset[str]]


def read_shape(conn: Connection) -> Shape:
    dialect = conn.dialect.name
    inspector = sa.inspect(conn)
    pk = inspector.get_pk_constraint("fsm_messages")
    unique_seq = pk.get("constrained_columns") == ["conversation_id", "seq"]
    lost: list[tuple[str, tuple[str, ...], str | None]] = []
    for table in ("fsm_conversations", "fsm_tool_calls", "fsm_attempts", "fsm_attempt_calls"):
        columns = tuple(c.name for c in TABLE_BY_NAME[table].primary_key.columns)
        if tuple(inspector.get_pk_constraint(table).get("constrained_columns") or ()) != columns:
            lost.append((table, columns, None))
    with warnings.catch_warnings():  # SQLite: ix_fsm_messages_stats indexes an expression
        warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based")
        indexes = {i["name"] for i in inspector.get_indexes("fsm_messages")}
    if "ix_fsm_messages_conversation_id_idempotency_key" not in indexes:
        lost.append(
            ("fsm_messages", ("conversation_id", "idempotency_key"), "idempotency_key IS NOT NULL")
        )
    enforced: set[str] = set()
    functions = {"fsm_json_valid": True}
    nullable: dict[str, set[str]] = {}
    if dialect == "postgresql":
        # a check PostgreSQL holds (present and validated) no session can have bypassed: only a
        # dropped or NOT VALID one needs its rows read
        enforced = set(
            conn.execute(
                sa.text(
                    "SELECT conname FROM pg_constraint WHERE contype = 'c' AND convalidated "
                    "AND conrelid = ANY(CAST(:tables AS regclass[]))"
                ),
                {"tables": list(CHECKED_TABLES)},
            ).scalars()
        )
        functions["fsm_json_valid"] = pg_function(conn, "fsm_json_valid(text)")
    reflected = {table: inspector.get_columns(table) for table in CHECKED_TABLES}
    if dialect == "postgresql":
        # a NOT NULL dropped lets NULLs in (SQLite cannot drop one without rebuilding the table)
        nullable = {t: {c["name"] for c in cols if c["nullable"]} for t, cols in reflected.items()}
    present_columns = {t: frozenset(c["name"] for c in cols) for t, cols in reflected.items()}
    rules: dict[str, tuple[_Rule, ...]] = {}
    for table in CHECKED_TABLES:
        # the columns the database has (a store at an older revision lacks the newer ones)
        present = present_columns[table]
        missing = [c.name for c in TABLE_BY_NAME[table].columns if c.name not in present]
        found = [
            rule
            for rule in model_rules(TABLE_BY_NAME[table], dialect)
            if rule.name not in enforced
            # a check of columns the database does not have yet (the token columns of 0006)
            and not any(re.search(rf"\b{column}\b", rule.sql) for column in missing)
            and not rule.name.endswith("_types")
            and not any(f"{f}(" in rule.sql and not ok for f, ok in functions.items())
        ]
        if dialect == "sqlite":
            # the types check, term by term (the same terms, of the columns there are)
            terms = [
                ok for column, ok in sqlite_type_terms(TABLE_BY_NAME[table]) if column in present
            ]
            found.insert(0, _Rule(f"ck_{table}_types", "invalid_type", " AND ".join(terms)))
        for column in TABLE_BY_NAME[table].columns:
            if not column.nullable and column.name in nullable.get(table, ()):
                found.append(
                    _Rule(
                        f"{table}.{column.name} NOT NULL",
                        "invalid_type",
                        f"{column.name} IS NOT NULL",
                    )
                )
        rules[table] = tuple(found)
    return Shape(
        dialect=dialect,
        unique_seq=unique_seq,
        rules=rules,
        lost_keys=tuple(lost),
        columns=present_columns,
    )


TABLE_BY_NAME: Final = {
    t.name: t
    for t in (
        CONVERSATIONS,
        MESSAGES,
        CALLS,
        ATTEMPTS,
        ATTEMPT_CALLS,
        _PENDING,
        _EXECUTIONS,
    )
}


def model_rules(table: sa.Table, dialect: str) -> Iterator[_Rule]:
    """The checks of ``table`` in the models that apply to ``dialect``, except the structural ones,
    as row checks."""
    compiler_dialect = _DIALECTS[dialect]
    for constraint in table.constraints:
        if not isinstance(constraint, sa.CheckConstraint) or not isinstance(constraint.name, str):
            continue
        name = str(constraint.name)
        only = getattr(getattr(constraint, "_ddl_if", None), "dialect", None)
        if name in STRUCTURAL_CHECKS or (only is not None and only != dialect):
            continue
        text = str(
            constraint.sqltext.compile(
                dialect=compiler_dialect, compile_kwargs={"literal_binds": True}
            )
        )
        yield _Rule(name, CHECK_KINDS.get(name, "invalid_row"), text)


_DIALECTS: Final[dict[str, Any]] = {
    "sqlite": sqlite_dialect.dialect(),
    "postgresql": pg.dialect(),  # type: ignore[no-untyped-call]
}


def sqlite_type_terms(table: sa.Table) -> list[tuple[str, str]]:
    """(column, SQL that is true when its value has the column's type) for a SQLite table, the
    terms of its types check (:func:`fsm.store.models.sqlite_types_check`)."""
    terms = []
    for column in table.columns:
        name = column.name
        # a decorated type (fsm.store.codec's StoredText, StoredJSON) is checked as its impl
        kind = column.type.impl if isinstance(column.type, sa.types.TypeDecorator) else column.type
        if isinstance(kind, sa.Boolean):
            ok = f"(typeof({name}) = 'integer' AND {name} IN (0, 1))"
        elif isinstance(kind, sa.Integer):
            ok = f"typeof({name}) = 'integer'"
        elif isinstance(kind, sa.JSON):
            ok = f"(typeof({name}) = 'text' AND json_valid({name}))"
        else:
            ok = f"typeof({name}) = 'text'"
        if column.nullable:
            ok = f"({name} IS NULL OR {ok})"
        terms.append((name, ok))
    return terms


def row_check_sql(table: str, rules: Sequence[_Rule], shape: Shape, *, ranged: bool) -> str:
    """One scan of ``table`` that picks the rows breaking any of ``rules``: the row's identity,
    one flag per rule (1: broken), and on SQLite which columns have the wrong type."""
    # a check passes unless its expression is false (NULL passes): NOT (x) is true only then.
    # Conditions only (WHERE, CASE WHEN), never values: SQLite then evaluates AND and OR
    # lazily (as a value, both sides of each are computed: several times slower)
    flags = [f"CASE WHEN NOT ({r.sql}) THEN 1 ELSE 0 END" for r in rules]
    detail = "NULL"
    if shape.dialect == "sqlite":
        parts = [
            f"CASE WHEN {ok} THEN '' ELSE '{column} is ' || typeof({column}) || ' ' || "
            f"substr(quote({column}), 1, 40) || '; ' END"
            for column, ok in sqlite_type_terms(TABLE_BY_NAME[table])
            if column in shape.columns[table]
        ]
        detail = "rtrim(" + " || ".join(parts) + ", '; ')"
    where = " AND ".join(f"({r.sql})" for r in rules)
    scope = f"RANGE({table}.{'id' if table == 'fsm_conversations' else 'conversation_id'})"
    return (
        f"SELECT {_ROW_IDENTITY[table]}, {detail}, {', '.join(flags)} FROM {table} "
        f"WHERE {scope if ranged else '1 = 1'} AND NOT ({where})"
    )


def row_violations(table: str, rules: Sequence[_Rule], row: Any) -> Iterator[Violation]:
    cid, a, b, c, detail, *flags = row
    conversation = as_opt_text(cid)
    seq: int | None = None
    if table == "fsm_conversations":
        where = f"conversation {conversation!r}"
    elif table == "fsm_messages":
        seq = as_int(a)
        where = f"the {as_text(b)} message at seq {shown(a)}"
    elif table == "fsm_tool_calls":
        seq = as_int(a)
        where = f"call {shown(b)} (id {shown(c, text=True)}) of the message at seq {shown(a)}"
    elif table == "fsm_attempts":
        where = f"attempt {shown(a)} (at seq {shown(b)})"
    elif table == "fsm_pending_turns":
        where = f"pending turn {shown(a)} ({shown(b, text=True)}) of the tool ledger"
    elif table == "fsm_tool_executions":
        where = (
            f"the execution of call {shown(b)} (id {shown(c, text=True)}) of pending turn "
            f"{shown(a)}"
        )
    else:
        where = f"call {shown(b)} (id {shown(c, text=True)}) of attempt {shown(a)}"
    for rule, broken in zip(rules, flags, strict=True):
        if not broken:
            continue
        text = _RULE_TEXT.get(rule.kind, f"breaks the check {rule.name}")
        if rule.kind == "invalid_type" and rule.name.endswith("NOT NULL"):
            text = f"{rule.name.split('.', 1)[1].split()[0]} is NULL (the column is NOT NULL)"
        elif rule.kind == "invalid_type" and detail:
            text = f"wrong type: {as_text(detail)}"
        elif rule.name == "ck_fsm_messages_one_content":
            text = "has both a text content and content parts"
        elif rule.name == "ck_fsm_attempt_calls_position":
            text = "has a negative position"
        elif rule.name == "ck_fsm_attempt_calls_tool_call_state":
            text = "has an unknown state"
        yield Violation(conversation, seq, rule.kind, f"{where} {text} ({rule.name})")


_RULE_TEXT: Final = {
    "invalid_type": "holds a value of the wrong type",
    "invalid_name": "is finished with an empty or blank name",
    "invalid_arguments": "is finished with arguments that are neither blank nor valid JSON",
    "missing_content": "has no content",
}


def shown(value: Any, *, text: bool = False) -> str:
    """A raw value for a detail: an integer as it is, text quoted, anything else with its type."""
    if type(value) is int and not text:
        return str(value)
    if isinstance(value, str):
        return repr(as_text(value))
    if value is None:
        return "NULL"
    return f"{as_text(value)!r} ({type(value).__name__})"


def duplicates_sql(
    table: str, columns: Sequence[str], condition: str | None, *, ranged: bool
) -> str:
    cols = ", ".join(columns)
    where = [condition or "1 = 1"]
    if ranged:
        where.append(
            f"RANGE({table}.{'id' if table == 'fsm_conversations' else 'conversation_id'})"
        )
    return (
        f"SELECT {cols}, count(*) FROM {table} WHERE {' AND '.join(where)} "
        f"GROUP BY {cols} HAVING count(*) > 1"
    )


def duplicate_violations(table: str, columns: Sequence[str], row: Any) -> Violation:
    *key, n = row
    values = ", ".join(f"{c} {shown(v)}" for c, v in zip(columns, key, strict=True))
    conversation = (
        as_opt_text(key[0])
        if table in ("fsm_conversations", "fsm_messages", "fsm_tool_calls")
        else None
    )
    seq = as_int(key[1]) if table == "fsm_tool_calls" else None
    return Violation(
        conversation,
        seq,
        "duplicate_key",
        f"{n} {table} rows share the key ({values}), which the schema makes unique",
    )
