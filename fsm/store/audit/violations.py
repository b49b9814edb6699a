"""What the integrity check (:mod:`fsm.store.audit.integrity`) reports: the kinds of violation and a :class:`Violation` row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fsm.store.audit.read import (
    Row,
)

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
# * CHECK_SEQ: per conversation, count / min / max of seq over the primary key: dense from 0 iff
#   count = max + 1 and min = 0 (and count = distinct count when no key makes seq unique). Only
#   the conversations that fail are read again (CHECK_SEQ_DETAIL, window functions) to say where.
# * CHECK_MESSAGES: each message on its own (role, link fields, the slot formula of a result:
#   seq = assistant_seq + 1 + call_position, the enforcement columns); each result with the call
#   it names (exists, same id) and with its assistant message (its slots_left); each assistant
#   message with its calls (positions exactly 0 .. n_calls - 1).
# * CHECK_CALLS: each call on its own (state, position below assistant_n_calls), with its
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
