"""The history contract as one rule list: every way a stored history can break it, by kind.

The rules of ``spec/store.md`` ("The contract" 1-5) and every rule the schema enforces
(:mod:`fsm.store.models`), each named by a kind and said in words. One list read by all who
check the contract: the history reader (:mod:`fsm.store.history`) names the rule a corrupt
history breaks (the ``kind`` of :class:`~fsm.store.CorruptStoreError`), the integrity check
(:func:`fsm.store.audit.check`, ``fsm audit check``) reports violations by the same kinds, and the
tests break each rule on purpose and see both name it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["READER_RULES", "RULES"]

#: Every rule of the history contract, by the kind that names its violation, with what a
#: violation means.
RULES: Final[dict[str, str]] = {
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

#: The rules a history read can find broken (a read sees one conversation's messages and calls;
#: the others are about the whole store, its keys, its bookkeeping or its storage, which only
#: the integrity check reads).
READER_RULES: Final = frozenset(
    {
        "seq_start",
        "seq_gap",
        "seq_duplicate",
        "invalid_row",
        "invalid_type",
        "invalid_name",
        "invalid_arguments",
        "missing_content",
        "result_misplaced",
        "interleaved",
        "missing_result",
        "result_id_mismatch",
        "orphan_result",
        "not_finished",
        "call_count_mismatch",
        "orphan_call",
    }
)
assert RULES.keys() >= READER_RULES
