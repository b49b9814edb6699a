"""What the integrity check (:mod:`fsm.store.audit.integrity`) reports: the kinds of violation and a :class:`Violation` row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fsm.store.audit.read import (
    Row,
)
from fsm.store.contract import RULES

# -- the integrity check -----------------------------------------------------------------------
#: Every kind of violation :func:`check` reports, with what it means: the rules of the history
#: contract (:data:`fsm.store.contract.RULES`, one list for the reader, the check and the tests).
VIOLATION_KINDS: Final[dict[str, str]] = RULES


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
