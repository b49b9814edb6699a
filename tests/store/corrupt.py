"""Databases edited with the store's enforcement switched off: one builder per violation.

The database enforces the history contract on every connection that keeps its defaults (see
``fsm/store/models.py``). These builders take the switches that bypass it, each on a connection
of its own, and write one violation each, so that tests can show what the store's reads do
(``history()`` raises :class:`~fsm.store.errors.CorruptStoreError`) and what ``fsm audit check``
reports:

* SQLite ``PRAGMA foreign_keys=OFF`` (every connection's default outside fsm),
* SQLite ``PRAGMA ignore_check_constraints=ON`` (foreign keys left on),
* PostgreSQL ``SET session_replication_role = replica`` (disables the foreign-key triggers),
* PostgreSQL ``ALTER TABLE ... DISABLE TRIGGER ALL``,
* PostgreSQL: a check dropped, broken, and added back ``NOT VALID``.

Use::

    from tests.store.corrupt import CORRUPTIONS, for_engine

    for corruption in for_engine("sqlite"):
        conversation = corruption.build(url)   # url: a database at head, no data, its own
        ...                                    # history(conversation) raises CorruptStoreError

Every builder first writes :data:`CONVERSATION` through the API (user 0, an assistant with two
calls ``x`` and ``y`` at 1, their results at 2 and 3, user 4), then breaks it. Builders that
change the schema (``NOT VALID``, triggers) leave it changed: give each one a database (or
PostgreSQL schema) of its own. ``kinds`` are the :data:`fsm.store.audit.VIOLATION_KINDS` the
integrity check should report (at least one of them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa

from fsm.store import ConversationStore
from tests.helpers.store import make_turn

__all__ = ["CONVERSATION", "CORRUPTIONS", "Corruption", "for_engine", "seed"]

#: the conversation every builder writes and then breaks.
CONVERSATION = "corrupt"


@dataclass(frozen=True)
class Corruption:
    """One violation written with one bypass switch."""

    name: str
    #: ``sqlite`` or ``postgresql``
    engine: str
    #: the switch that let it in
    bypass: str
    #: what the history breaks, in words
    rule: str
    #: kinds of ``fsm.store.audit.VIOLATION_KINDS`` the check should report (one at least)
    kinds: frozenset[str]
    #: writes the conversation, breaks it, returns its id
    build: Callable[[sa.URL | str], str]
    #: whether ``append``/``next_seq`` must raise ``CorruptStoreError`` too (the break is at
    #: the end of the conversation, where a write would go)
    breaks_the_tail: bool = False


def seed(url: sa.URL | str) -> str:
    """Write :data:`CONVERSATION` through the store's API (a valid history)."""
    with ConversationStore(url) as store:
        store.create_conversation(CONVERSATION)
        store.append(CONVERSATION, [{"role": "user", "content": "hi"}])
        turn = make_turn([("x", "f", '{"a": 1}'), ("y", "g", "{}")], response_id="r-corrupt")
        store.commit_turn(CONVERSATION, turn, ["rx", "ry"])
        store.append(CONVERSATION, [{"role": "user", "content": "thanks"}])
    return CONVERSATION


@contextmanager
def _raw(url: sa.URL | str, *setup: str) -> Iterator[sa.Connection]:
    """A connection outside fsm's engine (no pragmas of fsm's), ``setup`` run first, in one
    transaction that commits."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            for statement in setup:  # pragmas: outside the transaction
                conn.exec_driver_sql(statement)
            if conn.in_transaction():
                conn.commit()
            with conn.begin():
                yield conn
    finally:
        engine.dispose()


_C = f"conversation_id = '{CONVERSATION}'"

#: a result row for seq 6 whose predecessor does not exist (a gap)
_GAP_ROW = (
    "INSERT INTO fsm_messages (conversation_id, seq, role, content, n_calls, slots_left, prev_seq,"
    f" prev_slots_left) VALUES ('{CONVERSATION}', 6, 'user', 'after a gap', 0, 0, 5, 0)"
)
#: a call row on the user message at seq 0
_ORPHAN_CALL = (
    "INSERT INTO fsm_tool_calls (conversation_id, assistant_seq, position, assistant_n_calls,"
    " call_id, type, name, arguments, repaired, state)"
    f" VALUES ('{CONVERSATION}', 0, 0, 1, 'o', 'function', 'f', '{{}}', false, 'finished')"
)
_DROP_RESULT = f"DELETE FROM fsm_messages WHERE {_C} AND seq >= 3"
_MISMATCH = f"UPDATE fsm_messages SET tool_call_id = 'zz' WHERE {_C} AND seq = 2"


def _statements(
    name: str,
    engine: str,
    bypass: str,
    rule: str,
    kinds: set[str],
    statements: list[str],
    setup: tuple[str, ...] = (),
    *,
    tail: bool = False,
) -> Corruption:
    def build(url: sa.URL | str) -> str:
        seed(url)
        with _raw(url, *setup) as conn:
            for statement in statements:
                conn.exec_driver_sql(statement)
        return CONVERSATION

    return Corruption(name, engine, bypass, rule, frozenset(kinds), build, tail)


_FK_OFF = ("PRAGMA foreign_keys=OFF",)
_CK_OFF = ("PRAGMA foreign_keys=ON", "PRAGMA ignore_check_constraints=ON")
_BOTH_OFF = ("PRAGMA foreign_keys=OFF", "PRAGMA ignore_check_constraints=ON")
_REPLICA = "SET LOCAL session_replication_role = replica"


def _not_valid_builder(
    name: str, rule: str, kinds: set[str], table: str, constraint: str, statement: str
) -> Corruption:
    def build(url: sa.URL | str) -> str:
        seed(url)
        with _raw(url) as conn:
            definition = conn.execute(
                sa.text(
                    "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c"
                    " JOIN pg_class t ON t.oid = c.conrelid"
                    " WHERE c.conname = :name AND t.relname = :table"
                    " AND t.relnamespace = current_schema()::regnamespace"
                ),
                {"name": constraint, "table": table},
            ).scalar_one()
            conn.exec_driver_sql(f"ALTER TABLE {table} DROP CONSTRAINT {constraint}")
            conn.exec_driver_sql(statement)
            conn.exec_driver_sql(
                f"ALTER TABLE {table} ADD CONSTRAINT {constraint} {definition} NOT VALID"
            )
        return CONVERSATION

    return Corruption(
        name, "postgresql", f"{constraint} added back NOT VALID", rule, frozenset(kinds), build
    )


def _disabled_triggers(name: str, rule: str, kinds: set[str], table: str, sql: str) -> Corruption:
    def build(url: sa.URL | str) -> str:
        seed(url)
        with _raw(url) as conn:
            conn.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER ALL")
            conn.exec_driver_sql(sql)
            conn.exec_driver_sql(f"ALTER TABLE {table} ENABLE TRIGGER ALL")
        return CONVERSATION

    return Corruption(
        name,
        "postgresql",
        f"ALTER TABLE {table} DISABLE TRIGGER ALL",
        rule,
        frozenset(kinds),
        build,
    )


_LIST: list[Corruption] = [
    # -- SQLite, foreign keys off ------------------------------------------------------------
    _statements(
        "sqlite_foreign_keys_off_missing_result",
        "sqlite",
        "PRAGMA foreign_keys=OFF",
        "an assistant message with two calls keeps one result (rule 2)",
        {"missing_result"},
        [_DROP_RESULT],
        _FK_OFF,
        tail=True,
    ),
    _statements(
        "sqlite_foreign_keys_off_gap",
        "sqlite",
        "PRAGMA foreign_keys=OFF",
        "seq 5 is missing (rule 1)",
        {"seq_gap"},
        [_GAP_ROW],
        _FK_OFF,
    ),
    _statements(
        "sqlite_foreign_keys_off_result_id_mismatch",
        "sqlite",
        "PRAGMA foreign_keys=OFF",
        "a result's tool_call_id is not its call's id (rule 3)",
        {"result_id_mismatch", "orphan_result"},
        [_MISMATCH],
        _FK_OFF,
    ),
    _statements(
        "sqlite_foreign_keys_off_orphan_call",
        "sqlite",
        "PRAGMA foreign_keys=OFF",
        "a call on a user message (rule 2)",
        {"orphan_call"},
        [_ORPHAN_CALL],
        _FK_OFF,
    ),
    # -- SQLite, checks ignored --------------------------------------------------------------
    _statements(
        "sqlite_checks_ignored_text_seq",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        "the last message has seq '4x' (a text in an integer key)",
        {"invalid_type"},
        [f"UPDATE fsm_messages SET seq = '4x' WHERE {_C} AND seq = 4"],
        _CK_OFF,
        tail=True,
    ),
    _statements(
        "sqlite_checks_ignored_real_position",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        "a third call of a two-call message at position 1.5 (a real in an integer key)",
        {"invalid_type", "call_count_mismatch", "invalid_row"},
        [
            "INSERT INTO fsm_tool_calls (conversation_id, assistant_seq, position, assistant_n_calls,"
            " call_id, type, name, arguments, repaired, state)"
            f" VALUES ('{CONVERSATION}', 1, 1.5, 2, 'z', 'function', 'f', '{{}}', 0, 'finished')"
        ],
        _CK_OFF,
    ),
    _statements(
        "sqlite_checks_ignored_blob_content",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        "a user message's content is the blob X'00'",
        {"invalid_type"},
        [f"UPDATE fsm_messages SET content = X'00' WHERE {_C} AND seq = 0"],
        _CK_OFF,
    ),
    _statements(
        "sqlite_checks_ignored_blank_name",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        "a finished call named ' '",
        {"invalid_name"},
        [f"UPDATE fsm_tool_calls SET name = ' ' WHERE {_C} AND position = 1"],
        _CK_OFF,
    ),
    _statements(
        "sqlite_checks_ignored_invalid_arguments",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        'a finished call with arguments {"a": NaN}',
        {"invalid_arguments"},
        [f"""UPDATE fsm_tool_calls SET arguments = '{{"a": NaN}}' WHERE {_C} AND position = 0"""],
        _CK_OFF,
    ),
    _statements(
        "sqlite_checks_ignored_null_content",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        "a user message and a tool result without content",
        {"missing_content"},
        [f"UPDATE fsm_messages SET content = NULL WHERE {_C} AND seq IN (0, 2)"],
        _CK_OFF,
    ),
    _statements(
        "sqlite_checks_ignored_not_finished",
        "sqlite",
        "PRAGMA ignore_check_constraints=ON",
        "a call in history in state truncated (rule 4)",
        {"not_finished"},
        [f"UPDATE fsm_tool_calls SET state = 'truncated' WHERE {_C} AND position = 0"],
        _CK_OFF,
    ),
    # -- SQLite, both off: the rules only the reader and the check see ------------------------
    _statements(
        "sqlite_both_off_seq_start",
        "sqlite",
        "PRAGMA foreign_keys=OFF, ignore_check_constraints=ON",
        "the first message is gone: the history starts at seq 1 (rule 1)",
        {"seq_start"},
        [f"DELETE FROM fsm_messages WHERE {_C} AND seq = 0"],
        _BOTH_OFF,
    ),
    _statements(
        "sqlite_both_off_unknown_role",
        "sqlite",
        "PRAGMA foreign_keys=OFF, ignore_check_constraints=ON",
        "a message with the role 'robot'",
        {"invalid_row"},
        [f"UPDATE fsm_messages SET role = 'robot' WHERE {_C} AND seq = 4"],
        _BOTH_OFF,
    ),
    _statements(
        "sqlite_both_off_results_swapped",
        "sqlite",
        "PRAGMA foreign_keys=OFF, ignore_check_constraints=ON",
        "the two results of a block swapped between their slots (rule 2)",
        {"result_misplaced"},
        [  # in three steps: (assistant_seq, call_position) is unique
            f"UPDATE fsm_messages SET call_position = 9 WHERE {_C} AND seq = 2",
            f"UPDATE fsm_messages SET call_position = 0 WHERE {_C} AND seq = 3",
            f"UPDATE fsm_messages SET call_position = 1 WHERE {_C} AND seq = 2",
        ],
        _BOTH_OFF,
    ),
    _statements(
        "sqlite_both_off_result_outside_a_block",
        "sqlite",
        "PRAGMA foreign_keys=OFF, ignore_check_constraints=ON",
        "the last user message made the result of a third call of a two-call message, after "
        "its block (rules 2, 3)",
        {"orphan_result"},
        [
            "UPDATE fsm_messages SET role = 'tool', tool_call_id = 'z', assistant_seq = 1,"
            f" call_position = 2 WHERE {_C} AND seq = 4",
        ],
        _BOTH_OFF,
    ),
    _statements(
        "sqlite_both_off_user_in_a_result_slot",
        "sqlite",
        "PRAGMA foreign_keys=OFF, ignore_check_constraints=ON",
        "the result of call y made a user message, in that result's slot (rule 5)",
        {"interleaved"},
        [
            "UPDATE fsm_messages SET role = 'user', tool_call_id = NULL, assistant_seq = NULL,"
            f" call_position = NULL WHERE {_C} AND seq = 3",
        ],
        _BOTH_OFF,
    ),
    # -- PostgreSQL, replica role ------------------------------------------------------------
    _statements(
        "postgresql_replica_missing_result",
        "postgresql",
        "SET session_replication_role = replica",
        "an assistant message with two calls keeps one result (rule 2)",
        {"missing_result"},
        [_REPLICA, _DROP_RESULT],
        tail=True,
    ),
    _statements(
        "postgresql_replica_gap",
        "postgresql",
        "SET session_replication_role = replica",
        "seq 5 is missing (rule 1)",
        {"seq_gap"},
        [_REPLICA, _GAP_ROW],
    ),
    _statements(
        "postgresql_replica_result_id_mismatch",
        "postgresql",
        "SET session_replication_role = replica",
        "a result's tool_call_id is not its call's id (rule 3)",
        {"result_id_mismatch", "orphan_result"},
        [_REPLICA, _MISMATCH],
    ),
    # -- PostgreSQL, triggers disabled -------------------------------------------------------
    _disabled_triggers(
        "postgresql_disabled_triggers_orphan_call",
        "a call on a user message (rule 2)",
        {"orphan_call"},
        "fsm_tool_calls",
        _ORPHAN_CALL,
    ),
    _disabled_triggers(
        "postgresql_disabled_triggers_missing_result",
        "an assistant message with two calls keeps one result (rule 2)",
        {"missing_result"},
        "fsm_messages",
        _DROP_RESULT,
    ),
    _statements(
        "postgresql_key_dropped_seq_duplicate",
        "postgresql",
        "ALTER TABLE fsm_messages DROP CONSTRAINT: its primary and unique keys",
        "two messages with seq 4, once the key that made seqs unique is gone (rule 1)",
        {"seq_duplicate"},
        [
            # every key of the table (the others hold seq too), with the foreign keys on them
            "DO $$ DECLARE r record; BEGIN FOR r IN SELECT conname FROM pg_constraint"
            " WHERE conrelid = 'fsm_messages'::regclass AND contype IN ('p', 'u') LOOP"
            " EXECUTE format('ALTER TABLE fsm_messages DROP CONSTRAINT IF EXISTS %%I CASCADE',"
            " r.conname); END LOOP; END $$",
            _REPLICA,
            "INSERT INTO fsm_messages (conversation_id, seq, role, content, n_calls, slots_left,"
            f" prev_seq, prev_slots_left) VALUES ('{CONVERSATION}', 4, 'user', 'again', 0, 0, 3,"
            " 0)",
        ],
    ),
    # -- PostgreSQL, checks added back NOT VALID ---------------------------------------------
    _not_valid_builder(
        "postgresql_not_valid_blank_name",
        "a finished call named ' '",
        {"invalid_name"},
        "fsm_tool_calls",
        "ck_fsm_tool_calls_name",
        f"UPDATE fsm_tool_calls SET name = ' ' WHERE {_C} AND position = 1",
    ),
    _not_valid_builder(
        "postgresql_not_valid_invalid_arguments",
        "a finished call with arguments '{'",
        {"invalid_arguments"},
        "fsm_tool_calls",
        "ck_fsm_tool_calls_arguments",
        f"UPDATE fsm_tool_calls SET arguments = '{{' WHERE {_C} AND position = 0",
    ),
    _not_valid_builder(
        "postgresql_not_valid_null_content",
        "a user message and a tool result without content",
        {"missing_content"},
        "fsm_messages",
        "ck_fsm_messages_content",
        f"UPDATE fsm_messages SET content = NULL WHERE {_C} AND seq IN (0, 2)",
    ),
]

#: every corruption by name
CORRUPTIONS: dict[str, Corruption] = {c.name: c for c in _LIST}


def for_engine(engine: str) -> list[Corruption]:
    """The corruptions that can be built on ``engine`` (``sqlite`` or ``postgresql``)."""
    return [c for c in _LIST if c.engine == engine]
