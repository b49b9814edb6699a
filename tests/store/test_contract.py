"""The database itself rejects every raw-SQL write that would break the history contract.

Each case starts from a valid store written through the API, runs raw SQL in one transaction,
and must be rejected by the constraint named in the case (PostgreSQL reports the constraint
name; SQLite reports the kind of constraint, and the name for checks). A control case writes a
valid turn with the same row helpers, so the helpers are right and each rejection is due to the
one thing the case breaks. After a rejection the store is exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore
from tests.store.conftest import make_turn

Row = dict[str, Any]
Step = tuple[str, Row] | str


def user_row(conv: str, seq: int, *, prev_slots_left: int = 0) -> Row:
    return {
        "conversation_id": conv,
        "seq": seq,
        "role": "user",
        "content": "raw",
        "n_calls": 0,
        "slots_left": 0,
        "prev_seq": seq - 1 if seq else None,
        "prev_slots_left": prev_slots_left if seq else None,
        "tool_call_id": None,
        "assistant_seq": None,
        "call_position": None,
        "block_end_seq": None,
    }


def assistant_row(conv: str, seq: int, n_calls: int) -> Row:
    return {
        **user_row(conv, seq),
        "role": "assistant",
        "content": None,
        "n_calls": n_calls,
        "slots_left": n_calls,
        "block_end_seq": seq + n_calls if n_calls else None,
    }


def result_row(
    conv: str, seq: int, assistant_seq: int, position: int, n_calls: int, call_id: str
) -> Row:
    return {
        **user_row(conv, seq),
        "role": "tool",
        "content": "result",
        "slots_left": n_calls - 1 - position,
        "prev_slots_left": n_calls - position,
        "tool_call_id": call_id,
        "assistant_seq": assistant_seq,
        "call_position": position,
    }


def call_row(
    conv: str,
    assistant_seq: int,
    position: int,
    n_calls: int,
    call_id: str,
    state: str = "finished",
) -> Row:
    return {
        "conversation_id": conv,
        "assistant_seq": assistant_seq,
        "position": position,
        "assistant_n_calls": n_calls,
        "call_id": call_id,
        "type": "function",
        "name": "f",
        "arguments": "{}",
        "raw_arguments": None,
        "repaired": False,
        "state": state,
    }


def _insert(table: str, row: Row) -> sa.TextClause:
    columns = ", ".join(row)
    values = ", ".join(f":{key}" for key in row)
    return sa.text(f"INSERT INTO {table} ({columns}) VALUES ({values})")


def run_steps(conn: sa.Connection, steps: list[Step]) -> None:
    for step in steps:
        if isinstance(step, str):
            conn.execute(sa.text(step))
        else:
            table, row = step
            conn.execute(_insert(table, row), row)


@pytest.fixture
def seeded(store: ConversationStore) -> ConversationStore:
    """Conversation ``c``: user (0), assistant with calls x, y (1), results (2, 3).
    Conversation ``d``: users (0-3), assistant with call d0 (4), result (5)."""
    store.create_conversation("c")
    store.append("c", [{"role": "user", "content": "hi"}])
    store.commit_turn("c", make_turn([("x", "f", "{}"), ("y", "f", "{}")]), ["rx", "ry"])
    store.create_conversation("d")
    store.append("d", [{"role": "user", "content": str(i)} for i in range(4)])
    store.commit_turn("d", make_turn([("d0", "f", "{}")], response_id="r-d"), ["rd"])
    return store


def dump(store: ConversationStore) -> dict[str, list[Any]]:
    with store.engine.connect() as conn:
        return {
            table: [
                tuple(row) for row in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY {key}"))
            ]
            for table, key in (
                ("conversations", "id"),
                ("messages", "conversation_id, seq"),
                ("tool_calls", "conversation_id, assistant_seq, position"),
            )
        }


@dataclass
class Case:
    steps: list[Step]
    #: constraint names PostgreSQL may report (several when two checks catch the same row).
    pg: set[str]
    #: substring of SQLite's message.
    sqlite: str
    #: expected contract rule, for the report.
    rule: str = ""


A4 = ("messages", assistant_row("c", 4, 2))
P = ("tool_calls", call_row("c", 4, 0, 2, "p"))
Q = ("tool_calls", call_row("c", 4, 1, 2, "q"))
R5 = ("messages", result_row("c", 5, 4, 0, 2, "p"))

CASES: dict[str, Case] = {
    "a_result_for_no_call": Case(
        [("messages", assistant_row("c", 4, 1)), ("messages", result_row("c", 5, 4, 0, 1, "zz"))],
        {"fk_messages_result_call"},
        "FOREIGN KEY",
        "(a)",
    ),
    "a_result_for_call_of_other_conversation": Case(
        # d has a call at (assistant_seq 4, position 0, id d0); c's row cannot reach it
        [("messages", assistant_row("c", 4, 1)), ("messages", result_row("c", 5, 4, 0, 1, "d0"))],
        {"fk_messages_result_call"},
        "FOREIGN KEY",
        "(a)",
    ),
    "b_second_result_in_the_slot": Case(
        [("messages", result_row("c", 2, 1, 0, 2, "x"))],
        {"pk_messages", "ix_messages_conversation_id_assistant_seq_call_position"},
        "UNIQUE constraint failed: messages.conversation_id, messages.",
        "(b)",
    ),
    "b_second_result_after_the_block": Case(
        [("messages", result_row("c", 4, 1, 0, 2, "x"))],
        {"ck_messages_result_slot"},
        "CHECK constraint failed: ck_messages_result_slot",
        "(b)",
    ),
    "c_tool_call_id_differs": Case(
        [
            ("messages", assistant_row("c", 4, 1)),
            ("tool_calls", call_row("c", 4, 0, 1, "good")),
            ("messages", result_row("c", 5, 4, 0, 1, "bad")),
        ],
        {"fk_messages_result_call"},
        "FOREIGN KEY",
        "(c)",
    ),
    "c_tool_call_id_updated": Case(
        ["UPDATE messages SET tool_call_id = 'other' WHERE conversation_id = 'c' AND seq = 2"],
        {"fk_messages_result_call"},
        "FOREIGN KEY",
        "(c)",
    ),
    "c_call_id_updated_under_its_result": Case(
        [
            "UPDATE tool_calls SET call_id = 'other'"
            " WHERE conversation_id = 'c' AND assistant_seq = 1 AND position = 0"
        ],
        {"fk_messages_result_call"},
        "FOREIGN KEY",
        "(c)",
    ),
    "d_result_out_of_its_slot": Case(
        [A4, P, Q, ("messages", result_row("c", 5, 4, 1, 2, "q"))],
        {"ck_messages_result_slot"},
        "CHECK constraint failed: ck_messages_result_slot",
        "(d)",
    ),
    "d_result_claiming_another_slot": Case(
        # seq 5 = 3 + 1 + 1 adds up, but there is no call (3, 1) in c
        [A4, P, Q, ("messages", result_row("c", 5, 3, 1, 2, "q"))],
        {"fk_messages_result_call", "fk_messages_prev"},
        "FOREIGN KEY",
        "(d)",
    ),
    "e_two_messages_same_seq": Case(
        [("messages", user_row("c", 3))],
        {"pk_messages"},
        "UNIQUE constraint failed: messages.conversation_id, messages.seq",
        "(e)",
    ),
    "f_truncated_call_into_history": Case(
        [
            ("messages", assistant_row("c", 4, 1)),
            ("tool_calls", call_row("c", 4, 0, 1, "t", "truncated")),
        ],
        {"ck_tool_calls_finished"},
        "CHECK constraint failed: ck_tool_calls_finished",
        "(f)",
    ),
    "f_call_updated_to_aborted": Case(
        ["UPDATE tool_calls SET state = 'aborted' WHERE conversation_id = 'c'"],
        {"ck_tool_calls_finished"},
        "CHECK constraint failed: ck_tool_calls_finished",
        "(f)",
    ),
    "f_unknown_state": Case(
        [
            ("messages", assistant_row("c", 4, 1)),
            ("tool_calls", call_row("c", 4, 0, 1, "t", "done")),
        ],
        {"ck_tool_calls_finished", "ck_tool_calls_tool_call_state"},
        "CHECK constraint failed: ck_tool_calls_",
        "(f)",
    ),
    "5_user_inside_a_tool_block": Case(
        [A4, P, Q, R5, ("messages", user_row("c", 6))],
        {"fk_messages_prev"},
        "FOREIGN KEY",
        "rule 5",
    ),
    "5_user_inside_a_tool_block_admitting_it": Case(
        [A4, P, Q, R5, ("messages", user_row("c", 6, prev_slots_left=1))],
        {"ck_messages_prev"},
        "CHECK constraint failed: ck_messages_prev",
        "rule 5",
    ),
    "5_assistant_right_after_an_assistant_with_calls": Case(
        [A4, P, Q, ("messages", assistant_row("c", 5, 0))],
        {"fk_messages_prev"},
        "FOREIGN KEY",
        "rule 5",
    ),
    "5_block_left_incomplete_at_commit": Case(
        [A4, P, Q, R5],
        {"fk_messages_block_end"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "5_assistant_with_calls_but_no_rows": Case(
        [("messages", assistant_row("c", 4, 1))],
        {"fk_messages_block_end"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "2_call_beyond_n_calls": Case(
        [("tool_calls", call_row("c", 1, 2, 2, "z"))],
        {"ck_tool_calls_position"},
        "CHECK constraint failed: ck_tool_calls_position",
        "rule 2",
    ),
    "2_call_lying_about_n_calls": Case(
        [("tool_calls", call_row("c", 1, 2, 3, "z"))],
        {"fk_tool_calls_assistant"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "2_call_on_a_user_message": Case(
        [("tool_calls", call_row("c", 0, 0, 1, "u"))],
        {"fk_tool_calls_assistant"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "1_gap_in_seq": Case(
        [("messages", user_row("c", 5))],
        {"fk_messages_prev"},
        "FOREIGN KEY",
        "rule 1",
    ),
    "1_delete_in_the_middle": Case(
        ["DELETE FROM messages WHERE conversation_id = 'c' AND seq = 0"],
        {"fk_messages_prev"},
        "FOREIGN KEY",
        "rule 1",
    ),
    "1_delete_a_result": Case(
        ["DELETE FROM messages WHERE conversation_id = 'c' AND seq = 3"],
        {"fk_messages_block_end"},
        "FOREIGN KEY",
        "rule 1",
    ),
    "1_renumber": Case(
        ["UPDATE messages SET seq = seq + 10 WHERE conversation_id = 'c' AND seq = 0"],
        {"ck_messages_prev"},
        "CHECK constraint failed: ck_messages_prev",
        "rule 1",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_raw_sql_violation_is_rejected(seeded: ConversationStore, name: str) -> None:
    case = CASES[name]
    before = dump(seeded)
    history_before = seeded.history("c")
    with pytest.raises(sa.exc.IntegrityError) as caught, seeded.engine.begin() as conn:
        run_steps(conn, case.steps)
    orig = caught.value.orig
    if seeded.engine.dialect.name == "postgresql":
        assert orig.diag.constraint_name in case.pg, str(orig)  # type: ignore[union-attr]
    else:
        assert case.sqlite in str(orig), str(orig)
    assert dump(seeded) == before
    assert seeded.history("c") == history_before


def test_the_same_rows_written_correctly_are_accepted(seeded: ConversationStore) -> None:
    """Control: the row helpers write a valid turn, then a user message after it."""
    with seeded.engine.begin() as conn:
        run_steps(
            conn,
            [
                A4,
                P,
                Q,
                R5,
                ("messages", result_row("c", 6, 4, 1, 2, "q")),
                ("messages", user_row("c", 7)),
            ],
        )
    history = seeded.history("c")
    assert [m["role"] for m in history[4:]] == ["assistant", "tool", "tool", "user"]
    assert [c["id"] for c in history[4]["tool_calls"]] == ["p", "q"]
    assert [m["tool_call_id"] for m in history[5:7]] == ["p", "q"]
    assert seeded.next_seq("c") == 8


def test_deleting_the_conversation_with_raw_sql_cascades(seeded: ConversationStore) -> None:
    with seeded.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM conversations WHERE id = 'c'"))
    with seeded.engine.connect() as conn:
        for table in ("messages", "tool_calls"):
            count = conn.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE conversation_id = 'c'")
            ).scalar()
            assert count == 0
    assert len(seeded.history("d")) == 6


def test_sqlite_store_connections_enforce_foreign_keys(store: ConversationStore) -> None:
    if store.engine.dialect.name != "sqlite":
        pytest.skip("SQLite only")
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
