""":func:`check` re-verifies the whole history contract of ``spec/store.md`` and every
rule the database enforces (keys, foreign keys, checks, column types) with set-based SQL over
batches of conversations, streaming :class:`Violation` rows (see :data:`VIOLATION_KINDS`): a
database edited with its enforcement switched off is reported, never called clean.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection

from fsm.states import ToolCallState
from fsm.store.audit.filters import pg_function
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    CALLS,
    CONVERSATIONS,
    MESSAGES,
    Bind,
    Row,
    as_int,
    as_opt_text,
    as_text,
    connect,
)
from fsm.store.errors import (
    DatabaseCorruptError,
    DatabaseFileError,
    InvalidFilterError,
    StoreError,
)
from fsm.store.migrate import head_revision, revision_of
from fsm.store.models import TABLES, PendingTurnRow, ToolExecution

#: ``progress(done, total)``, in conversations.
Progress: TypeAlias = Callable[[int, int], None]
#: ``note(text)``: what the check could not do (amcheck missing, say), for the user.
Note: TypeAlias = Callable[[str], None]


# -- the integrity check -----------------------------------------------------------------------
#: Every kind of violation :func:`check` reports, with what it means.
VIOLATION_KINDS: Final[dict[str, str]] = {
    "seq_start": "a conversation's first message does not have seq 0 (rule 1)",
    "seq_gap": "seq numbers are missing between two messages (rule 1)",
    "seq_duplicate": "two messages of a conversation have the same seq (rule 1)",
    "invalid_row": "a row's own fields contradict each other or a check of the schema: an "
    "unknown role, tool calls on a non-assistant message, a tool result without its call's link, "
    "link fields on another role, both a text content and content parts, a call of an attempt "
    "with a negative position or an unknown state",
    "invalid_type": "a value of the wrong type for its column, which the schema's types check "
    "(SQLite: ck_<table>_types) refuses: text, a real or a blob in an integer column ('5x', 0.5, "
    "1e300), a boolean other than 0 and 1, a blob in a text column, invalid JSON in a JSON "
    "column; on either engine, NULL in a column the schema declares NOT NULL",
    "invalid_name": "a call in history whose name is empty or blank (only spaces, tabs, CR, LF): "
    "finished means a name (rule 4, ck_fsm_tool_calls_name)",
    "invalid_arguments": "a call in history whose arguments are neither blank nor valid JSON: "
    "finished means complete arguments (rule 4, ck_fsm_tool_calls_arguments)",
    "missing_content": "a system, developer, user or tool message without content (neither a "
    "text nor content parts; a tool result may be ''): ck_fsm_messages_content",
    "result_misplaced": "a tool result that is not in its call's slot "
    "(seq = assistant seq + 1 + position) (rule 2)",
    "duplicate_result": "a second tool result for a call whose slot holds its result (rule 2)",
    "interleaved": "a user, system or assistant message in the slot of a tool result, between "
    "an assistant message and the end of its results (rule 5)",
    "missing_result": "a tool call whose slot holds no result for it (rule 2)",
    "result_id_mismatch": "a tool result's tool_call_id differs from its call's id (rule 3)",
    "orphan_result": "a tool result for a call that does not exist (rules 2, 3)",
    "not_finished": "a call in history that is not in state finished (rule 4)",
    "call_count_mismatch": "an assistant message whose declared number of calls (n_calls) "
    "differs from its call rows (rule 2)",
    "orphan_call": "a tool call of a seq that is not an assistant message (rule 2)",
    "orphan_row": "messages or attempts of a conversation, or calls of an attempt, that does not "
    "exist",
    "duplicate_key": "rows that share a key the schema makes unique (a conversation's or an "
    "attempt's id, a call's position, an idempotency key), possible only once that key or its "
    "unique index is gone",
    "unenforced": "the database no longer enforces a rule of the schema (at head revision): a "
    "key, foreign key, check or unique index of the models is missing, NOT VALID, or its "
    "triggers are disabled (PostgreSQL ALTER TABLE ... DISABLE TRIGGER ALL); the rows were "
    "checked above, but later writes will not be refused",
    "bookkeeping": "the columns through which the database enforces the contract (prev_seq, "
    "prev_slots_left, slots_left, block_end_seq, assistant_n_calls, raw_arguments) disagree with "
    "the rows: later writes would not be checked right",
    "corrupt": "the database engine finds its own storage damaged: SQLite's PRAGMA quick_check "
    "(--deep: integrity_check) reports a broken page, b-tree or index, or the file cannot be "
    "read; PostgreSQL's amcheck (bt_index_check) finds an fsm index corrupt; the history "
    "contract is then not checked (its rows cannot be trusted): restore from a backup",
}


@dataclass(frozen=True, slots=True)
class Violation(Row):
    """One broken rule: where (conversation, seq; ``None`` when not known), what, and details."""

    conversation_id: str | None
    seq: int | None
    kind: str
    detail: str


# How the check covers the contract, per batch of conversations (a range of ids; RANGE(x) below
# restricts table alias x to it), with a few scans and lookups that only read indexes:
#
# * the row checks (_row_rules): every check of fsm/store/models.py that is about one row and
#   not about the history's structure, evaluated as the database evaluates it (a check passes
#   unless its expression is false): on SQLite each table's types check (so a text, real or blob
#   in an integer column is found, however the row got there), a finished call's name and
#   arguments, a message's content, an attempt call's position and state; on either engine a
#   NULL in a column the schema says NOT NULL when the database no longer refuses one.
# * _CHECK_SEQ: per conversation, count / min / max of seq over the primary key: dense from 0 iff
#   count = max + 1 and min = 0 (and count = distinct count when no key makes seq unique). Only
#   the conversations that fail are read again (_CHECK_SEQ_DETAIL, window functions) to say where.
# * _CHECK_MESSAGES: each message on its own (role, link fields, the slot formula of a result:
#   seq = assistant_seq + 1 + call_position, the enforcement columns); each result with the call
#   it names (exists, same id) and with its assistant message (its slots_left); each assistant
#   message with its calls (positions exactly 0 .. n_calls - 1).
# * _CHECK_CALLS: each call on its own (state, position below assistant_n_calls), with its
#   assistant message (exists, same n_calls) and with a result that names it.
# * duplicate keys, only where the database lost the key or unique index that keeps them out.
#
# Together: an assistant message with N calls has calls at positions 0 .. N-1, each has a
# result naming it with its id, and each result sits in its call's slot; as two messages cannot
# share a seq, the N slots after the assistant message hold exactly its results in call order
# and nothing else (rules 2, 3, 5). With dense seq (rule 1) and finished calls (rule 4) that is
# the whole contract. The enforcement columns are checked row by row and against the block
# (a result's slots_left = assistant seq + N - seq): with the structure right, that implies the
# foreign-key chain of prev_slots_left, so no pass over neighbouring rows is needed. Every
# foreign key of the schema is thereby re-verified by an anti-join, so PRAGMA foreign_keys=OFF
# (SQLite) and session_replication_role = replica (PostgreSQL) hide nothing.
#
# Values of the wrong type (SQLite with PRAGMA ignore_check_constraints=ON) are the row checks'
# finding; the structural scans compare with them without an error (SQLite compares any two
# values) and skip them in Python. SEQ_OK(m) keeps the grouped seq scan to integer seqs.
# BIG(x) widens an operand of arithmetic on PostgreSQL (int4 + int4 can overflow there when the
# checks are gone; SQLite's integers are 64-bit and overflow into reals, without an error).
_CHECK_SEQ = """
SELECT g.conversation_id, g.n, g.d, g.lo, g.hi, CASE WHEN c.id IS NULL THEN 1 ELSE 0 END
FROM (
  SELECT conversation_id, count(*) AS n, {distinct} AS d, min(seq) AS lo, max(seq) AS hi
  FROM fsm_messages m WHERE RANGE(m) AND SEQ_OK(m) GROUP BY conversation_id
) g LEFT JOIN fsm_conversations c ON c.id = g.conversation_id
WHERE g.n <> BIG(g.hi) + 1 OR g.lo <> 0 OR g.d <> g.n OR c.id IS NULL
"""

_CHECK_SEQ_DETAIL = """
SELECT conversation_id, seq, p_seq FROM (
  SELECT m.conversation_id, m.seq,
         lag(m.seq) OVER (PARTITION BY m.conversation_id ORDER BY m.seq) AS p_seq
  FROM fsm_messages m WHERE m.conversation_id IN :ids AND SEQ_OK(m)
) x
WHERE (p_seq IS NULL AND seq <> 0) OR seq = p_seq OR seq > BIG(p_seq) + 1
"""

# ``t`` and ``a`` are the checks (lookups that read only a unique index: the call with the
# result's link *and id*, the assistant message with the result's link *and* the n_calls its
# slots_left implies); the failing rows are set apart first (MATERIALIZED: on both engines the
# joins that describe them then run for those rows only). COUNT_CHECK(m) is true when an
# assistant message's call rows do not number its n_calls (see _COUNT_CHECKS).
_CHECK_MESSAGES = """
WITH bad AS MATERIALIZED (
  SELECT m.conversation_id, m.seq, m.role, m.n_calls, m.slots_left, m.prev_seq,
         m.prev_slots_left, m.tool_call_id, m.assistant_seq, m.call_position, m.block_end_seq
  FROM fsm_messages m
  LEFT JOIN fsm_tool_calls t
    ON t.conversation_id = m.conversation_id AND t.assistant_seq = m.assistant_seq
       AND t.position = m.call_position AND t.call_id = m.tool_call_id
       AND t.assistant_n_calls = BIG(m.slots_left) + m.call_position + 1 AND RANGE(t)
  COUNT_JOIN
  WHERE RANGE(m) AND (
    -- each role's own rules (one branch per row)
    CASE m.role
      WHEN 'tool' THEN CASE
        WHEN m.tool_call_id IS NULL
          OR COALESCE(BIG(m.assistant_seq) + 1 + m.call_position, -1) <> m.seq
          OR m.n_calls <> 0 OR m.block_end_seq IS NOT NULL
          OR COALESCE(m.prev_slots_left, 0) <= 0 OR m.slots_left <> BIG(m.prev_slots_left) - 1
          OR t.conversation_id IS NULL
        THEN 1 ELSE 0 END
      WHEN 'assistant' THEN CASE
        WHEN m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls < 0 OR m.slots_left <> m.n_calls
          OR COALESCE(m.block_end_seq, -1)
             <> CASE WHEN m.n_calls > 0 THEN BIG(m.seq) + m.n_calls ELSE -1 END
          OR COALESCE(m.prev_slots_left, 0) <> 0
          OR (m.n_calls > 0 AND COUNT_CHECK(m))
        THEN 1 ELSE 0 END
      ELSE CASE
        WHEN m.role NOT IN ('system', 'developer', 'user')
          OR m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls <> 0 OR m.slots_left <> 0
          OR m.block_end_seq IS NOT NULL OR COALESCE(m.prev_slots_left, 0) <> 0
        THEN 1 ELSE 0 END
    END = 1
    -- every role: the link to the previous row
    OR COALESCE(m.prev_seq, -1) <> BIG(m.seq) - 1
    OR (CASE WHEN m.prev_slots_left IS NULL THEN 0 ELSE 1 END)
       <> (CASE WHEN m.seq = 0 THEN 0 ELSE 1 END)
  )
)
SELECT bad.*,
       (SELECT t2.call_id FROM fsm_tool_calls t2
        WHERE t2.conversation_id = bad.conversation_id AND t2.assistant_seq = bad.assistant_seq
          AND t2.position = bad.call_position),
       (SELECT t2.assistant_n_calls FROM fsm_tool_calls t2
        WHERE t2.conversation_id = bad.conversation_id AND t2.assistant_seq = bad.assistant_seq
          AND t2.position = bad.call_position),
       (SELECT a2.role FROM fsm_messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT count(*) FROM fsm_tool_calls c
        WHERE c.conversation_id = bad.conversation_id AND c.assistant_seq = bad.seq),
       (SELECT s.role FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position),
       (SELECT s.assistant_seq FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position),
       (SELECT s.call_position FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position)
FROM bad
"""

#: per engine: how _CHECK_MESSAGES counts an assistant message's calls. SQLite reads the
#: primary key's range of each assistant message (a nested loop is all it has); PostgreSQL
#: hash-joins the batch's counts.
_COUNT_CHECKS = {
    "sqlite": (
        "",
        "m.n_calls <> (SELECT count(*) FROM fsm_tool_calls c "
        "WHERE c.conversation_id = m.conversation_id AND c.assistant_seq = m.seq)",
    ),
    "postgresql": (
        "LEFT JOIN (SELECT c.conversation_id, c.assistant_seq, count(*) AS n FROM fsm_tool_calls c "
        "WHERE RANGE(c) GROUP BY c.conversation_id, c.assistant_seq) g "
        "ON g.conversation_id = m.conversation_id AND g.assistant_seq = m.seq",
        "m.n_calls <> COALESCE(g.n, 0)",
    ),
}

_CHECK_CALLS = """
WITH bad AS MATERIALIZED (
  SELECT t.conversation_id, t.assistant_seq, t.position, t.call_id, t.name, t.state,
         t.assistant_n_calls, t.repaired, CASE WHEN t.raw_arguments IS NULL THEN 1 ELSE 0 END
         AS no_raw, CASE WHEN r.conversation_id IS NULL THEN 0 ELSE 1 END AS has_result
  FROM fsm_tool_calls t
  LEFT JOIN (
    SELECT a.conversation_id, a.seq, a.n_calls FROM fsm_messages a WHERE a.n_calls > 0 AND RANGE(a)
  ) a
    ON a.conversation_id = t.conversation_id AND a.seq = t.assistant_seq
       AND a.n_calls = t.assistant_n_calls
  LEFT JOIN fsm_messages r
    ON r.conversation_id = t.conversation_id AND r.assistant_seq = t.assistant_seq
       AND r.call_position = t.position AND RANGE(r)
  WHERE RANGE(t) AND (
       a.conversation_id IS NULL OR r.conversation_id IS NULL OR t.state <> 'finished'
    OR t.position < 0 OR t.position >= t.assistant_n_calls
    OR (t.repaired AND t.raw_arguments IS NULL)
    OR (NOT t.repaired AND t.raw_arguments IS NOT NULL)
  )
)
SELECT bad.*,
       (SELECT a2.role FROM fsm_messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT a2.n_calls FROM fsm_messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT s.role FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.position)
FROM bad
"""

_ORPHAN_ATTEMPTS = """
SELECT x.conversation_id, x.n FROM (
  SELECT conversation_id, count(*) AS n FROM fsm_attempts a WHERE RANGE(a) GROUP BY conversation_id
) x WHERE NOT EXISTS (SELECT 1 FROM fsm_conversations c WHERE c.id = x.conversation_id)
"""

_ORPHAN_ATTEMPT_CALLS = """
SELECT ac.attempt_id, count(*) FROM fsm_attempt_calls ac
WHERE NOT EXISTS (SELECT 1 FROM fsm_attempts a WHERE a.id = ac.attempt_id)
GROUP BY ac.attempt_id ORDER BY ac.attempt_id
"""


_RANGE = re.compile(r"RANGE\((\w+)(?:\.(\w+))?\)")
_BIG = re.compile(r"BIG\(([\w.]+)\)")
_SEQ_OK = re.compile(r"SEQ_OK\((\w+)\)")


def _ranged(sql: str, lo: str | None, hi: str | None) -> str:
    """``sql`` with each ``RANGE(alias)`` (or ``RANGE(alias.column)``) replaced by the batch's
    bounds on that alias's conversation id (or that column)."""

    def bounds(match: re.Match[str]) -> str:
        column = f"{match.group(1)}.{match.group(2) or 'conversation_id'}"
        parts = []
        if lo is not None:
            parts.append(f"{column} >= :lo")
        if hi is not None:
            parts.append(f"{column} < :hi")
        return " AND ".join(parts) or "1 = 1"

    return _RANGE.sub(bounds, sql)


def _engine_sql(sql: str, dialect: str) -> str:
    """``sql`` with the engine's ``BIG(x)`` and ``SEQ_OK(alias)``."""
    if dialect == "postgresql":
        sql = _BIG.sub(r"CAST(\1 AS BIGINT)", sql)
        return _SEQ_OK.sub(r"\1.seq IS NOT NULL", sql)
    sql = _BIG.sub(r"\1", sql)
    return _SEQ_OK.sub(r"typeof(\1.seq) = 'integer' AND typeof(\1.conversation_id) = 'text'", sql)


# -- the row checks ------------------------------------------------------------------------------
#: The checks of the models that the structural scans verify (with more precise kinds), by table.
_STRUCTURAL_CHECKS: Final = frozenset(
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
_CHECK_KINDS: Final = {
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
_TABLES: Final = TABLES
_PENDING = cast(sa.Table, PendingTurnRow.__table__)
_EXECUTIONS = cast(sa.Table, ToolExecution.__table__)


@dataclass(frozen=True, slots=True)
class _Rule:
    """A check of one row: ``sql`` is false for a row that breaks it (true or NULL passes)."""

    name: str
    kind: str
    sql: str


@dataclass(frozen=True, slots=True)
class _Shape:
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


def _shape(conn: Connection) -> _Shape:
    dialect = conn.dialect.name
    inspector = sa.inspect(conn)
    pk = inspector.get_pk_constraint("fsm_messages")
    unique_seq = pk.get("constrained_columns") == ["conversation_id", "seq"]
    lost: list[tuple[str, tuple[str, ...], str | None]] = []
    for table in ("fsm_conversations", "fsm_tool_calls", "fsm_attempts", "fsm_attempt_calls"):
        columns = tuple(c.name for c in _TABLE[table].primary_key.columns)
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
                {"tables": list(_TABLES)},
            ).scalars()
        )
        functions["fsm_json_valid"] = pg_function(conn, "fsm_json_valid(text)")
    reflected = {table: inspector.get_columns(table) for table in _TABLES}
    if dialect == "postgresql":
        # a NOT NULL dropped lets NULLs in (SQLite cannot drop one without rebuilding the table)
        nullable = {t: {c["name"] for c in cols if c["nullable"]} for t, cols in reflected.items()}
    present_columns = {t: frozenset(c["name"] for c in cols) for t, cols in reflected.items()}
    rules: dict[str, tuple[_Rule, ...]] = {}
    for table in _TABLES:
        # the columns the database has (a store at an older revision lacks the newer ones)
        present = present_columns[table]
        missing = [c.name for c in _TABLE[table].columns if c.name not in present]
        found = [
            rule
            for rule in _model_rules(_TABLE[table], dialect)
            if rule.name not in enforced
            # a check of columns the database does not have yet (the token columns of 0006)
            and not any(re.search(rf"\b{column}\b", rule.sql) for column in missing)
            and not rule.name.endswith("_types")
            and not any(f"{f}(" in rule.sql and not ok for f, ok in functions.items())
        ]
        if dialect == "sqlite":
            # the types check, term by term (the same terms, of the columns there are)
            terms = [ok for column, ok in _sqlite_type_terms(_TABLE[table]) if column in present]
            found.insert(0, _Rule(f"ck_{table}_types", "invalid_type", " AND ".join(terms)))
        for column in _TABLE[table].columns:
            if not column.nullable and column.name in nullable.get(table, ()):
                found.append(
                    _Rule(
                        f"{table}.{column.name} NOT NULL",
                        "invalid_type",
                        f"{column.name} IS NOT NULL",
                    )
                )
        rules[table] = tuple(found)
    return _Shape(
        dialect=dialect,
        unique_seq=unique_seq,
        rules=rules,
        lost_keys=tuple(lost),
        columns=present_columns,
    )


_TABLE: Final = {
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


def _model_rules(table: sa.Table, dialect: str) -> Iterator[_Rule]:
    """The checks of ``table`` in the models that apply to ``dialect``, except the structural ones,
    as row checks."""
    compiler_dialect = _DIALECTS[dialect]
    for constraint in table.constraints:
        if not isinstance(constraint, sa.CheckConstraint) or not isinstance(constraint.name, str):
            continue
        name = str(constraint.name)
        only = getattr(getattr(constraint, "_ddl_if", None), "dialect", None)
        if name in _STRUCTURAL_CHECKS or (only is not None and only != dialect):
            continue
        text = str(
            constraint.sqltext.compile(
                dialect=compiler_dialect, compile_kwargs={"literal_binds": True}
            )
        )
        yield _Rule(name, _CHECK_KINDS.get(name, "invalid_row"), text)


_DIALECTS: Final[dict[str, Any]] = {
    "sqlite": sqlite_dialect.dialect(),
    "postgresql": pg.dialect(),  # type: ignore[no-untyped-call]
}


def _sqlite_type_terms(table: sa.Table) -> list[tuple[str, str]]:
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


def _row_check_sql(table: str, rules: Sequence[_Rule], shape: _Shape, *, ranged: bool) -> str:
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
            for column, ok in _sqlite_type_terms(_TABLE[table])
            if column in shape.columns[table]
        ]
        detail = "rtrim(" + " || ".join(parts) + ", '; ')"
    where = " AND ".join(f"({r.sql})" for r in rules)
    scope = f"RANGE({table}.{'id' if table == 'fsm_conversations' else 'conversation_id'})"
    return (
        f"SELECT {_ROW_IDENTITY[table]}, {detail}, {', '.join(flags)} FROM {table} "
        f"WHERE {scope if ranged else '1 = 1'} AND NOT ({where})"
    )


def _row_violations(table: str, rules: Sequence[_Rule], row: Any) -> Iterator[Violation]:
    cid, a, b, c, detail, *flags = row
    conversation = as_opt_text(cid)
    seq: int | None = None
    if table == "fsm_conversations":
        where = f"conversation {conversation!r}"
    elif table == "fsm_messages":
        seq = as_int(a)
        where = f"the {as_text(b)} message at seq {_shown(a)}"
    elif table == "fsm_tool_calls":
        seq = as_int(a)
        where = f"call {_shown(b)} (id {_shown(c, text=True)}) of the message at seq {_shown(a)}"
    elif table == "fsm_attempts":
        where = f"attempt {_shown(a)} (at seq {_shown(b)})"
    elif table == "fsm_pending_turns":
        where = f"pending turn {_shown(a)} ({_shown(b, text=True)}) of the tool ledger"
    elif table == "fsm_tool_executions":
        where = (
            f"the execution of call {_shown(b)} (id {_shown(c, text=True)}) of pending turn "
            f"{_shown(a)}"
        )
    else:
        where = f"call {_shown(b)} (id {_shown(c, text=True)}) of attempt {_shown(a)}"
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


def _shown(value: Any, *, text: bool = False) -> str:
    """A raw value for a detail: an integer as it is, text quoted, anything else with its type."""
    if type(value) is int and not text:
        return str(value)
    if isinstance(value, str):
        return repr(as_text(value))
    if value is None:
        return "NULL"
    return f"{as_text(value)!r} ({type(value).__name__})"


def _duplicates_sql(
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


def _duplicate_violations(table: str, columns: Sequence[str], row: Any) -> Violation:
    *key, n = row
    values = ", ".join(f"{c} {_shown(v)}" for c, v in zip(columns, key, strict=True))
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


# -- running the check ---------------------------------------------------------------------------
def check(
    bind: Bind,
    *,
    progress: Progress | None = None,
    batch_size: int = 10_000,
    workers: int | None = None,
    deep: bool = False,
    note: Note | None = None,
) -> Iterator[Violation]:
    """Re-verify the history contract over the whole store; yield every violation found.

    First the engine's own integrity (:func:`engine_check`: SQLite ``PRAGMA quick_check``, with
    ``deep`` ``integrity_check``; PostgreSQL ``amcheck`` over fsm's indexes when the extension
    is installed, else ``note`` is told so): damage there yields ``corrupt`` violations and
    stops the check, since rows read from a damaged file cannot be trusted.

    The rules of ``spec/store.md`` ("The contract" 1-5), and every rule the database enforces:
    seq dense from 0, every assistant message with N calls followed by exactly its N results
    each in its slot, each result's ``tool_call_id`` equal to its call's id, only finished calls
    (with a name, and arguments blank or valid JSON), nothing between an assistant message and
    its results, content where the OpenAI format needs it, the enforcement columns consistent,
    every foreign key, unique key and check of the schema, and the types of every column (on
    SQLite, whose type affinity lets ``'5x'``, ``0.5`` or ``1e300`` into an INTEGER column when
    its types check is ignored). Each kind is in :data:`VIOLATION_KINDS`.

    A store written through fsm has none: they come only from writes made with the database's
    enforcement switched off, which are *not* checked when they happen: SQLite ``PRAGMA
    foreign_keys=OFF`` (every foreign key) or ``PRAGMA ignore_check_constraints=ON`` (every check,
    types included), PostgreSQL ``SET session_replication_role = replica`` or ``ALTER TABLE ...
    DISABLE TRIGGER ALL`` (foreign keys), constraints dropped or added back ``NOT VALID``, a
    broken migration. Any value such a session stored is read without an error: the check
    reports it, never crashes on it and never calls such a store clean.

    The work is set-based: per batch of ``batch_size`` conversations (a range of ids), a scan of
    each table for its row checks, a grouped scan of the seq numbers, one scan of the messages
    and one of the calls, joined to each other through indexes (no query per conversation). On
    PostgreSQL a check the database holds (present and validated) is not read again: no session
    can bypass it. Each batch runs in one read transaction, so it sees one snapshot; every rule
    is about one conversation, and a conversation is checked whole within one batch, so writers
    committing meanwhile cannot cause false violations.

    Given an engine, ``workers`` batches run at once on their own connections (default 2: the
    database does the work, in parallel); given a connection, the batches run one after the
    other on it, inside the caller's transaction. Violations come in batch order, sorted by
    conversation and seq within a batch; ``progress(done, total)`` is called after each batch,
    in conversations.
    """
    if batch_size < 1:
        raise InvalidFilterError("batch_size must be at least 1")
    if workers is not None and workers < 1:
        raise InvalidFilterError("workers must be at least 1")
    damaged = engine_check(bind, deep=deep, note=note)
    if damaged:
        yield from damaged
        return
    with connect(bind, snapshot=True) as conn:
        total = int(conn.execute(sa.text("SELECT count(*) FROM fsm_conversations")).scalar_one())
        # batches are ranges of text ids (an id of another type, which only raw SQL on SQLite
        # can store, sorts after every text: it falls in the last batch)
        text_ids = "typeof(id) = 'text'" if conn.dialect.name == "sqlite" else "1 = 1"
        bounds = [
            str(b)
            for b in conn.execute(
                sa.text(
                    "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n "
                    f"FROM fsm_conversations WHERE {text_ids}) x "
                    "WHERE n > 1 AND (n - 1) % :size = 0 ORDER BY id"
                ),
                {"size": batch_size},
            ).scalars()
        ]
        shape = _shape(conn)
        edges: list[str | None] = [None, *bounds, None]
        ranges = list(itertools.pairwise(edges))
        if progress is not None:
            progress(0, total)
        tables = [t for t in _TABLES if shape.rules[t]]
        if isinstance(bind, Connection) or (workers or 2) == 1 or len(ranges) + len(tables) == 1:
            batches: Iterator[list[Violation]] = (
                _check_batch(conn, lo, hi, shape, own=False) for lo, hi in ranges
            )
            yield from _with_progress(batches, progress, batch_size, total)
            for table in tables:
                yield from _row_checks(conn, shape, table)
        else:
            engine = bind

            def run(bounds: tuple[str | None, str | None]) -> list[Violation]:
                with connect(engine, snapshot=True) as worker:
                    return _check_batch(worker, *bounds, shape, own=True)

            def rows(table: str) -> list[Violation]:
                with connect(engine) as worker:
                    return _row_checks(worker, shape, table)

            with ThreadPoolExecutor(workers or 2, thread_name_prefix="fsm-check") as pool:
                try:
                    # the whole-table row checks first: the biggest one runs beside the batches
                    row_results = [pool.submit(rows, table) for table in tables]
                    yield from _with_progress(pool.map(run, ranges), progress, batch_size, total)
                    for result in row_results:
                        yield from result.result()
                finally:
                    pool.shutdown(cancel_futures=True)
        yield from _check_global(conn, shape)


#: SQLite result codes of a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB
_SQLITE_DAMAGED: Final = (11, 26)
#: PostgreSQL SQLSTATEs of damaged storage: data_corrupted, index_corrupted
_POSTGRES_DAMAGED: Final = ("XX001", "XX002")
#: at most this many problems are listed by SQLite's checks
_SQLITE_MAX_ERRORS: Final = 100


def engine_check(bind: Bind, *, deep: bool = False, note: Note | None = None) -> list[Violation]:
    """The database engine's own integrity check; a ``corrupt`` violation per problem found.

    SQLite: ``PRAGMA quick_check`` (b-trees, pages, record formats, ``NOT NULL``; linear in the
    file), or with ``deep`` ``PRAGMA integrity_check`` (also that every index matches its
    table), at most 100 problems; a file SQLite cannot read at all (not a database, a damaged
    header or schema) is one violation. PostgreSQL: ``bt_index_check`` of the ``amcheck``
    extension on every b-tree index of fsm's tables (with ``deep``, ``heapallindexed``: every
    row is found in each index), when the extension is installed and may be run; otherwise
    ``note`` is told why it was skipped (the audit is read-only: it never creates the
    extension) and nothing is reported. Other engines: nothing.
    """
    found: list[Violation] = []
    try:
        with connect(bind) as conn:
            if conn.dialect.name == "sqlite":
                pragma = "integrity_check" if deep else "quick_check"
                lines = conn.exec_driver_sql(f"PRAGMA {pragma}({_SQLITE_MAX_ERRORS})").scalars()
                # one row may hold several lines ("*** in database main ***\nPage 3: ...")
                found = [
                    Violation(None, None, "corrupt", f"SQLite {pragma}: {line}")
                    for row in lines
                    if str(row) != "ok"
                    for line in str(row).splitlines()
                    if line.strip() and not line.startswith("*** in database")
                ]
            elif conn.dialect.name == "postgresql":
                found = _amcheck(conn, deep, note)
    except (sa.exc.DBAPIError, DatabaseCorruptError, DatabaseFileError) as exc:
        if _damage_code(exc) is None:
            raise
        found = [Violation(None, None, "corrupt", f"the database cannot be read: {_reason(exc)}")]
    return found


def _driver(exc: BaseException) -> BaseException:
    """The driver's exception behind ``exc`` (a SQLAlchemy error's ``orig``, or the cause of a
    typed store error), or ``exc`` itself."""
    error: BaseException | None = exc
    for _ in range(6):
        if error is None:
            break
        if getattr(error, "sqlite_errorcode", None) is not None or getattr(error, "sqlstate", None):
            return error
        error = getattr(error, "orig", None) or error.__cause__
    return exc


def _reason(exc: BaseException) -> str:
    """The driver's message of ``exc``, on one line."""
    return " ".join(str(_driver(exc)).split())


def _damage_code(exc: BaseException) -> int | str | None:
    """The engine's code of a damaged-storage error, or ``None`` for any other error."""
    driver = _driver(exc)
    code = getattr(driver, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in _SQLITE_DAMAGED:
        return code
    sqlstate = getattr(driver, "sqlstate", None)
    return sqlstate if sqlstate in _POSTGRES_DAMAGED else None


def _amcheck(conn: Connection, deep: bool, note: Note | None) -> list[Violation]:
    """``bt_index_check`` on each b-tree index of fsm's tables (see :func:`engine_check`)."""
    installed = conn.execute(
        sa.text(
            "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
            "WHERE e.extname = 'amcheck'"
        )
    ).scalar()
    if installed is None:
        if note is not None:
            note(
                "PostgreSQL's index check was skipped: the amcheck extension is not installed "
                "in this database (a superuser can run: CREATE EXTENSION amcheck)"
            )
        return []
    indexes = conn.execute(
        sa.text(
            "SELECT c.oid::regclass::text FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
            "WHERE i.indrelid = ANY(CAST(:tables AS regclass[])) AND am.amname = 'btree' "
            "ORDER BY 1"
        ),
        {"tables": list(_TABLES)},
    ).scalars()
    function = f"{_quote_ident(str(installed))}.bt_index_check"
    found: list[Violation] = []
    for index in list(indexes):
        try:
            with conn.begin_nested():
                conn.execute(
                    sa.text(f"SELECT {function}(CAST(:index AS regclass), :deep)"),
                    {"index": index, "deep": deep},
                )
        except (sa.exc.DBAPIError, StoreError) as exc:
            if _damage_code(exc) is not None:
                found.append(
                    Violation(None, None, "corrupt", f"amcheck of {index}: {_reason(exc)}")
                )
                continue
            if getattr(_driver(exc), "sqlstate", None) == "42501":  # insufficient_privilege
                if note is not None:
                    note(
                        "PostgreSQL's index check was skipped: this role may not run amcheck "
                        "(GRANT EXECUTE ON FUNCTION bt_index_check(regclass, boolean) to it)"
                    )
                return found
            raise
    return found


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _row_checks(conn: Connection, shape: _Shape, table: str) -> list[Violation]:
    """The row checks of ``table``, over the whole table (each is about one row), sorted.

    (Not ``PRAGMA quick_check``, although it evaluates the checks faster: it skips them, and
    says "ok", on a connection that ignores checks and on a read-only one, as audits are.)
    """
    rules = shape.rules[table]
    if not rules:
        return []
    sql = _row_check_sql(table, rules, shape, ranged=False)
    rows = conn.execute(sa.text(sql)).all()
    found = [v for row in rows for v in _row_violations(table, rules, row)]
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_global(conn: Connection, shape: _Shape) -> Iterator[Violation]:
    """The checks that are not ranged by conversation: the calls of attempts (they have no
    conversation id of their own), keys that span conversations, and the schema's enforcement
    itself."""
    found: list[Violation] = list(_unenforced(conn))
    for attempt_id, n in conn.execute(sa.text(_ORPHAN_ATTEMPT_CALLS)):
        found.append(
            Violation(
                None,
                None,
                "orphan_row",
                f"{n} fsm_attempt_calls row(s) of attempt {_shown(attempt_id)}, which does not exist",
            )
        )
    for table, columns, condition in shape.lost_keys:
        if table in ("fsm_attempts", "fsm_attempt_calls"):
            sql = _duplicates_sql(table, columns, condition, ranged=False)
            for row in conn.execute(sa.text(sql)):
                found.append(_duplicate_violations(table, columns, row))
    yield from found


_CONSTRAINT_KINDS: Final = (
    (sa.PrimaryKeyConstraint, "primary key"),
    (sa.ForeignKeyConstraint, "foreign key"),
    (sa.UniqueConstraint, "unique key"),
    (sa.CheckConstraint, "check"),
)


def _unenforced(conn: Connection) -> Iterator[Violation]:
    """What the database no longer enforces of the models' schema: a key, foreign key, check or
    unique index missing (dropped, or a table rebuilt without it), NOT VALID, or with its
    triggers disabled (PostgreSQL). Only at head: an older revision lacks newer rules by design
    (``fsm db upgrade`` adds them)."""
    if revision_of(conn) != head_revision():
        return
    dialect = conn.dialect.name
    expected: dict[str, tuple[str, str]] = {}
    for table in _TABLES:
        for constraint in _TABLE[table].constraints:
            only = getattr(getattr(constraint, "_ddl_if", None), "dialect", None)
            if not isinstance(constraint.name, str) or (only is not None and only != dialect):
                continue
            what = next(w for cls, w in _CONSTRAINT_KINDS if isinstance(constraint, cls))
            expected[str(constraint.name)] = (table, what)
        for index in _TABLE[table].indexes:
            if index.unique and isinstance(index.name, str):
                expected[str(index.name)] = (table, "unique index")
    present: dict[str, bool] = {}  # name -> validated
    disabled: list[tuple[str, int]] = []
    if dialect == "postgresql":
        tables = {"tables": list(_TABLES)}
        present = dict(
            conn.execute(
                sa.text(
                    "SELECT conname, convalidated FROM pg_constraint "
                    "WHERE conrelid = ANY(CAST(:tables AS regclass[])) "
                    "UNION ALL SELECT c.relname, i.indisvalid FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE i.indrelid = ANY(CAST(:tables AS regclass[])) AND i.indisunique"
                ),
                tables,
            ).all()
        )
        disabled = [
            (str(t), int(n))
            for t, n in conn.execute(
                sa.text(
                    "SELECT tgrelid::regclass::text, count(*) FROM pg_trigger "
                    "WHERE tgrelid = ANY(CAST(:tables AS regclass[])) AND tgenabled = 'D' "
                    "GROUP BY 1 ORDER BY 1"
                ),
                tables,
            )
        ]
    else:
        for kind, name, sql in conn.exec_driver_sql(
            "SELECT type, name, sql FROM sqlite_master WHERE type IN ('table', 'index')"
        ):
            present[str(name)] = True
            if kind == "table":
                for found in re.findall(r'CONSTRAINT\s+"?(\w+)"?', str(sql or "")):
                    present[found] = True
    for name, (table, what) in expected.items():
        if name not in present:
            yield Violation(
                None,
                None,
                "unenforced",
                f"the {what} {name} of {table} is missing: the database does not refuse what "
                "it rules out",
            )
        elif not present[name]:
            yield Violation(
                None,
                None,
                "unenforced",
                f"the {what} {name} of {table} is NOT VALID: rows written before it was added "
                "back were never checked against it (VALIDATE CONSTRAINT once they are fixed)",
            )
    for table, n in disabled:
        yield Violation(
            None,
            None,
            "unenforced",
            f"{n} trigger(s) of {table} are disabled (its foreign keys are not checked): "
            f"ALTER TABLE {table} ENABLE TRIGGER ALL",
        )


def _with_progress(
    batches: Iterator[list[Violation]], progress: Progress | None, size: int, total: int
) -> Iterator[Violation]:
    for i, found in enumerate(batches):
        yield from found
        if progress is not None:
            progress(min(total, (i + 1) * size), total)


def _check_batch(
    conn: Connection, lo: str | None, hi: str | None, shape: _Shape, *, own: bool
) -> list[Violation]:
    """The violations of the conversations in [lo, hi), sorted by conversation and seq."""
    if own and conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))
    found = list(_check_range(conn, lo, hi, shape))
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_range(
    conn: Connection, lo: str | None, hi: str | None, shape: _Shape
) -> Iterator[Violation]:
    params = {k: v for k, v in (("lo", lo), ("hi", hi)) if v is not None}
    # two rows with one seq need the primary key gone: count distinct values only then
    distinct = "count(*)" if shape.unique_seq else "count(DISTINCT seq)"
    dialect = shape.dialect
    join, count_check = _COUNT_CHECKS.get(dialect, _COUNT_CHECKS["postgresql"])

    def run(sql: str) -> Iterable[Any]:
        sql = sql.replace("COUNT_JOIN", join).replace("COUNT_CHECK(m)", f"({count_check})")
        sql = _engine_sql(sql.replace("{distinct}", distinct), dialect)
        return conn.execute(sa.text(_ranged(sql, lo, hi)), params)

    unordered: list[str] = []
    for cid, n, n_distinct, first, last, orphan in run(_CHECK_SEQ):
        if orphan:
            yield Violation(
                as_text(cid),
                None,
                "orphan_row",
                f"{n} message(s) of conversation {as_text(cid)!r}, which does not exist",
            )
        if n != last + 1 or first != 0 or n_distinct != n:
            unordered.append(cid)
    for start in range(0, len(unordered), 500):
        ids = unordered[start : start + 500]
        detail = sa.text(_engine_sql(_CHECK_SEQ_DETAIL, dialect)).bindparams(
            sa.bindparam("ids", expanding=True)
        )
        for cid, seq, p_seq in conn.execute(detail, {"ids": ids}):
            cid = as_text(cid)
            if p_seq is None:
                yield Violation(cid, seq, "seq_start", f"the first message has seq {seq}, not 0")
            elif seq == p_seq:
                yield Violation(cid, seq, "seq_duplicate", f"two messages have seq {seq}")
            else:
                missing = f"{p_seq + 1}" if seq == p_seq + 2 else f"{p_seq + 1}..{seq - 1}"
                yield Violation(
                    cid,
                    seq,
                    "seq_gap",
                    f"seq {missing} missing (the message before is at seq {p_seq})",
                )
    for row in run(_CHECK_MESSAGES):
        yield from _message_violations(row)
    for row in run(_CHECK_CALLS):
        yield from _call_violations(row)
    for cid, n in run(_ORPHAN_ATTEMPTS):
        yield Violation(
            as_text(cid),
            None,
            "orphan_row",
            f"{n} attempt(s) of conversation {as_text(cid)!r}, which does not exist",
        )
    for table, columns, condition in shape.lost_keys:
        if table not in ("fsm_attempts", "fsm_attempt_calls"):
            for row in run(_duplicates_sql(table, columns, condition, ranged=True)):
                yield _duplicate_violations(table, columns, row)


_ROLES: Final = ("system", "developer", "user", "assistant", "tool")


def _typed(*values: Any, nullable: Sequence[Any] = ()) -> bool:
    """Whether ``values`` are integers and ``nullable`` integers or NULL (on SQLite, a row with a
    value of another type is the types check's finding, and the structural rules skip it)."""
    return all(type(v) is int for v in values) and all(
        v is None or type(v) is int for v in nullable
    )


def _message_violations(row: Any) -> Iterator[Violation]:
    """The violations of one message row of _CHECK_MESSAGES (the SQL only picked it)."""
    (cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos, block_end,
     real_id, call_n, a_role, calls, s_role, s_aseq, s_pos) = row  # fmt: skip
    if not (
        isinstance(cid, str)
        and isinstance(role, str)
        and (call_id is None or isinstance(call_id, str))
        and _typed(seq, n_calls, slots_left, nullable=(prev_seq, prev_slots, aseq, pos, block_end))
    ):
        return
    found = list(
        _message_findings(
            cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos,
            block_end, real_id if isinstance(real_id, str) else None, as_int(call_n),
            as_opt_text(a_role), as_int(calls) or 0, as_opt_text(s_role), as_int(s_aseq), as_int(s_pos),
        )
    )  # fmt: skip
    if not found:  # the SQL picked it for a reason the findings do not name: never call it clean
        found.append(
            Violation(
                as_text(cid),
                seq,
                "invalid_row",
                f"the {role} message at seq {seq} breaks a rule of the schema (n_calls {n_calls}, "
                f"slots_left {slots_left}, prev_seq {prev_seq}, prev_slots_left {prev_slots}, "
                f"tool_call_id {as_opt_text(call_id)!r}, assistant_seq {aseq}, call_position {pos}, "
                f"block_end_seq {block_end})",
            )
        )
    yield from found


def _message_findings(
    cid: str,
    seq: int,
    role: str,
    n_calls: int,
    slots_left: int,
    prev_seq: int | None,
    prev_slots: int | None,
    call_id: str | None,
    aseq: int | None,
    pos: int | None,
    block_end: int | None,
    real_id: str | None,
    call_n: int | None,
    a_role: str | None,
    calls: int,
    s_role: str | None,
    s_aseq: int | None,
    s_pos: int | None,
) -> Iterator[Violation]:
    shown_id = as_opt_text(call_id)
    conversation = as_text(cid)
    tool = role == "tool"
    linked = aseq is not None and pos is not None
    if (
        role not in _ROLES
        or n_calls < 0
        or (role != "assistant" and n_calls != 0)
        or (tool and (call_id is None or not linked))
        or (not tool and (call_id is not None or aseq is not None or pos is not None))
    ):
        yield Violation(
            conversation,
            seq,
            "invalid_row",
            _invalid_row_detail(role, n_calls, shown_id, aseq, pos),
        )
    misplaced = tool and aseq is not None and pos is not None and seq != aseq + 1 + pos
    if misplaced and aseq is not None and pos is not None:
        slot = aseq + 1 + pos
        if s_role == "tool" and (s_aseq, s_pos) == (aseq, pos):
            yield Violation(
                conversation,
                seq,
                "duplicate_result",
                f"a second result (tool_call_id {shown_id!r}) for call {pos} of the assistant "
                f"message at seq {aseq}, whose slot (seq {slot}) holds its result",
            )
        else:
            yield Violation(
                conversation,
                seq,
                "result_misplaced",
                f"the result of call {pos} of the assistant message at seq {aseq} (tool_call_id "
                f"{shown_id!r}) is at seq {seq}, not in its slot (seq {slot})",
            )
    if tool and linked and (real_id is None or a_role != "assistant"):
        what = (
            "which does not exist"
            if real_id is None
            else "whose seq is missing"
            if a_role is None
            else f"whose seq is a {a_role} message"
        )
        yield Violation(
            conversation,
            seq,
            "orphan_result",
            f"the tool result at seq {seq} (tool_call_id {shown_id!r}) answers call {pos} of the "
            f"assistant message at seq {aseq}, {what}",
        )
    elif real_id is not None and real_id != call_id:
        yield Violation(
            conversation,
            seq,
            "result_id_mismatch",
            f"the tool result at seq {seq} has tool_call_id {shown_id!r}, but its call (position "
            f"{pos} of the assistant message at seq {aseq}) has id {as_text(real_id)!r}",
        )
    if role == "assistant" and n_calls > 0 and calls != n_calls:
        yield Violation(
            conversation,
            seq,
            "call_count_mismatch",
            f"the assistant message at seq {seq} declares {n_calls} tool call(s) (n_calls) but "
            f"has {calls} call row(s)",
        )
    open_slots = None
    if tool and linked and not misplaced and call_n is not None and pos is not None:
        open_slots = call_n - 1 - pos
    wrong = _bookkeeping(
        role, seq, n_calls, slots_left, prev_seq, prev_slots, block_end, open_slots
    )
    if wrong:
        yield Violation(
            conversation, seq, "bookkeeping", f"{role} message: {wrong} disagree with the rows"
        )


def _bookkeeping(
    role: str,
    seq: int,
    n_calls: int,
    slots_left: int,
    prev_seq: int | None,
    prev_slots: int | None,
    block_end: int | None,
    open_slots: int | None,
) -> str:
    """Which enforcement columns of a message are wrong ("" when none); ``open_slots`` is the
    number of result slots its block really has after it (results only)."""
    wrong = []
    if (seq == 0) != (prev_seq is None) or (prev_seq is not None and prev_seq != seq - 1):
        wrong.append(f"prev_seq {prev_seq}")
    if (seq > 0) != (prev_slots is not None) or (
        prev_slots is not None and (prev_slots > 0) != (role == "tool")
    ):
        wrong.append(f"prev_slots_left {prev_slots}")
    expected = {"assistant": n_calls, "tool": None if prev_slots is None else prev_slots - 1}
    if slots_left != expected.get(role, 0) or (open_slots is not None and slots_left != open_slots):
        wrong.append(f"slots_left {slots_left}")
    expected_end = seq + n_calls if role == "assistant" and n_calls > 0 else None
    if block_end != expected_end:
        wrong.append(f"block_end_seq {block_end} (expected {expected_end})")
    return ", ".join(wrong)


def _call_violations(row: Any) -> Iterator[Violation]:
    """The violations of one call row of _CHECK_CALLS (the SQL only picked it)."""
    (cid, aseq, pos, call_id, name, state, n_decl, repaired, no_raw, has_result, a_role, a_n,
     s_role) = row  # fmt: skip
    if not (
        isinstance(cid, str)
        and isinstance(state, str)
        and repaired in (0, 1)
        and _typed(aseq, pos, n_decl)
    ):
        return
    found = list(
        _call_findings(
            as_text(cid), aseq, pos, as_text(call_id), as_text(name), state, n_decl, bool(repaired),
            bool(no_raw), bool(has_result), as_opt_text(a_role), as_int(a_n), as_opt_text(s_role),
        )
    )  # fmt: skip
    if not found:  # never call a row the SQL picked clean
        found.append(
            Violation(
                as_text(cid),
                aseq,
                "invalid_row",
                f"call {pos} (id {as_text(call_id)!r}) of the message at seq {aseq} breaks a rule "
                f"of the schema (assistant_n_calls {n_decl}, state {state!r})",
            )
        )
    yield from found


def _call_findings(
    cid: str,
    aseq: int,
    pos: int,
    call_id: str,
    name: str,
    state: str,
    n_decl: int,
    repaired: bool,
    no_raw: bool,
    has_result: bool,
    a_role: str | None,
    a_n: int | None,
    s_role: str | None,
) -> Iterator[Violation]:
    assistant = a_role == "assistant"
    where = f"call {pos} ({name}, id {call_id!r}) of the " + (
        f"assistant message at seq {aseq}" if assistant else f"message at seq {aseq}"
    )
    if not assistant:
        yield Violation(
            cid,
            aseq,
            "orphan_call",
            f"{where}: seq {aseq} is "
            + ("missing" if a_role is None else f"{_a(a_role)} message, not an assistant message"),
        )
    elif a_n is not None and (pos < 0 or pos >= a_n):
        yield Violation(
            cid, aseq, "call_count_mismatch", f"{where}: the message declares {a_n} call(s)"
        )
    if not has_result:
        held = (
            "is empty"
            if s_role is None
            else "holds the result of another call"
            if s_role == "tool"
            else f"holds {_a(s_role)} message"
        )
        yield Violation(
            cid,
            aseq,
            "missing_result",
            f"{where} has no result: its slot (seq {aseq + 1 + pos}) {held}",
        )
        if s_role is not None and s_role != "tool":
            yield Violation(
                cid,
                aseq + 1 + pos,
                "interleaved",
                f"{_a(s_role)} message sits in the slot of the result of {where}",
            )
    if state != ToolCallState.FINISHED.value:
        yield Violation(cid, aseq, "not_finished", f"{where} is {state}, not finished")
    wrong = []
    if assistant and n_decl != a_n:
        wrong.append(f"assistant_n_calls {n_decl} (the message has {a_n})")
    elif pos >= n_decl:
        wrong.append(f"assistant_n_calls {n_decl} (position {pos})")
    if repaired == no_raw:
        wrong.append(f"repaired {repaired} with raw_arguments {'NULL' if no_raw else 'set'}")
    if wrong:
        yield Violation(cid, aseq, "bookkeeping", f"{where}: {', '.join(wrong)} disagree")


def _a(word: str) -> str:
    """``word`` with its indefinite article."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _invalid_row_detail(
    role: str, n_calls: int, call_id: str | None, aseq: int | None, pos: int | None
) -> str:
    if role not in _ROLES:
        return f"unknown role {role!r}"
    if (n_calls and role != "assistant") or n_calls < 0:
        return f"{role} message with n_calls {n_calls}"
    if role == "tool":
        return (
            f"tool result without its call's link (tool_call_id {call_id!r}, assistant_seq "
            f"{aseq}, call_position {pos})"
        )
    return f"{role} message with a tool result's link fields"
