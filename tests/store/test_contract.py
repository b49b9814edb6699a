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
from fsm.store.codec import encode_text
from tests.helpers.store import (
    Row,
    assistant_row,
    call_row,
    dump,
    make_turn,
    pg_constraint,
    result_row,
    user_row,
)

Step = tuple[str, Row] | str


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


@dataclass
class Case:
    steps: list[Step]
    #: constraint names PostgreSQL may report (several when two checks catch the same row).
    pg: set[str]
    #: substring of SQLite's message.
    sqlite: str
    #: expected contract rule, for the report.
    rule: str = ""


A4 = ("fsm_messages", assistant_row("c", 4, 2))
P = ("fsm_tool_calls", call_row("c", 4, 0, 2, "p"))
Q = ("fsm_tool_calls", call_row("c", 4, 1, 2, "q"))
R5 = ("fsm_messages", result_row("c", 5, 4, 0, 2, "p"))

CASES: dict[str, Case] = {
    "a_result_for_no_call": Case(
        [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_messages", result_row("c", 5, 4, 0, 1, "zz")),
        ],
        {"fk_fsm_messages_result_call"},
        "FOREIGN KEY",
        "(a)",
    ),
    "a_result_for_call_of_other_conversation": Case(
        # d has a call at (assistant_seq 4, position 0, id d0); c's row cannot reach it
        [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_messages", result_row("c", 5, 4, 0, 1, "d0")),
        ],
        {"fk_fsm_messages_result_call"},
        "FOREIGN KEY",
        "(a)",
    ),
    "b_second_result_in_the_slot": Case(
        [("fsm_messages", result_row("c", 2, 1, 0, 2, "x"))],
        {"pk_fsm_messages", "ix_fsm_messages_conversation_id_assistant_seq_call_position"},
        "UNIQUE constraint failed: fsm_messages.conversation_id, fsm_messages.",
        "(b)",
    ),
    "b_second_result_after_the_block": Case(
        [("fsm_messages", result_row("c", 4, 1, 0, 2, "x"))],
        {"ck_fsm_messages_result_slot"},
        "CHECK constraint failed: ck_fsm_messages_result_slot",
        "(b)",
    ),
    "c_tool_call_id_differs": Case(
        [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_tool_calls", call_row("c", 4, 0, 1, "good")),
            ("fsm_messages", result_row("c", 5, 4, 0, 1, "bad")),
        ],
        {"fk_fsm_messages_result_call"},
        "FOREIGN KEY",
        "(c)",
    ),
    "c_tool_call_id_updated": Case(
        ["UPDATE fsm_messages SET tool_call_id = 'other' WHERE conversation_id = 'c' AND seq = 2"],
        {"fk_fsm_messages_result_call"},
        "FOREIGN KEY",
        "(c)",
    ),
    "c_call_id_updated_under_its_result": Case(
        [
            "UPDATE fsm_tool_calls SET call_id = 'other'"
            " WHERE conversation_id = 'c' AND assistant_seq = 1 AND position = 0"
        ],
        {"fk_fsm_messages_result_call"},
        "FOREIGN KEY",
        "(c)",
    ),
    "d_result_out_of_its_slot": Case(
        [A4, P, Q, ("fsm_messages", result_row("c", 5, 4, 1, 2, "q"))],
        {"ck_fsm_messages_result_slot"},
        "CHECK constraint failed: ck_fsm_messages_result_slot",
        "(d)",
    ),
    "d_result_claiming_another_slot": Case(
        # seq 5 = 3 + 1 + 1 adds up, but there is no call (3, 1) in c
        [A4, P, Q, ("fsm_messages", result_row("c", 5, 3, 1, 2, "q"))],
        {"fk_fsm_messages_result_call", "fk_fsm_messages_prev"},
        "FOREIGN KEY",
        "(d)",
    ),
    "e_two_messages_same_seq": Case(
        [("fsm_messages", user_row("c", 3))],
        {"pk_fsm_messages"},
        "UNIQUE constraint failed: fsm_messages.conversation_id, fsm_messages.seq",
        "(e)",
    ),
    "f_truncated_call_into_history": Case(
        [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_tool_calls", call_row("c", 4, 0, 1, "t", "truncated")),
        ],
        {"ck_fsm_tool_calls_finished"},
        "CHECK constraint failed: ck_fsm_tool_calls_finished",
        "(f)",
    ),
    "f_call_updated_to_aborted": Case(
        ["UPDATE fsm_tool_calls SET state = 'aborted' WHERE conversation_id = 'c'"],
        {"ck_fsm_tool_calls_finished"},
        "CHECK constraint failed: ck_fsm_tool_calls_finished",
        "(f)",
    ),
    "f_unknown_state": Case(
        [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_tool_calls", call_row("c", 4, 0, 1, "t", "done")),
        ],
        {"ck_fsm_tool_calls_finished", "ck_fsm_tool_calls_tool_call_state"},
        "CHECK constraint failed: ck_fsm_tool_calls_",
        "(f)",
    ),
    "5_user_inside_a_tool_block": Case(
        [A4, P, Q, R5, ("fsm_messages", user_row("c", 6))],
        {"fk_fsm_messages_prev"},
        "FOREIGN KEY",
        "rule 5",
    ),
    "5_user_inside_a_tool_block_admitting_it": Case(
        [A4, P, Q, R5, ("fsm_messages", user_row("c", 6, prev_slots_left=1))],
        {"ck_fsm_messages_prev"},
        "CHECK constraint failed: ck_fsm_messages_prev",
        "rule 5",
    ),
    "5_assistant_right_after_an_assistant_with_calls": Case(
        [A4, P, Q, ("fsm_messages", assistant_row("c", 5, 0))],
        {"fk_fsm_messages_prev"},
        "FOREIGN KEY",
        "rule 5",
    ),
    "5_block_left_incomplete_at_commit": Case(
        [A4, P, Q, R5],
        {"fk_fsm_messages_block_end"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "5_assistant_with_calls_but_no_rows": Case(
        [("fsm_messages", assistant_row("c", 4, 1))],
        {"fk_fsm_messages_block_end"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "2_call_beyond_n_calls": Case(
        [("fsm_tool_calls", call_row("c", 1, 2, 2, "z"))],
        {"ck_fsm_tool_calls_position"},
        "CHECK constraint failed: ck_fsm_tool_calls_position",
        "rule 2",
    ),
    "2_call_lying_about_n_calls": Case(
        [("fsm_tool_calls", call_row("c", 1, 2, 3, "z"))],
        {"fk_fsm_tool_calls_assistant"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "2_call_on_a_user_message": Case(
        [("fsm_tool_calls", call_row("c", 0, 0, 1, "u"))],
        {"fk_fsm_tool_calls_assistant"},
        "FOREIGN KEY",
        "rule 2",
    ),
    "1_gap_in_seq": Case(
        [("fsm_messages", user_row("c", 5))],
        {"fk_fsm_messages_prev"},
        "FOREIGN KEY",
        "rule 1",
    ),
    "1_delete_in_the_middle": Case(
        ["DELETE FROM fsm_messages WHERE conversation_id = 'c' AND seq = 0"],
        {"fk_fsm_messages_prev"},
        "FOREIGN KEY",
        "rule 1",
    ),
    "1_delete_a_result": Case(
        ["DELETE FROM fsm_messages WHERE conversation_id = 'c' AND seq = 3"],
        {"fk_fsm_messages_block_end"},
        "FOREIGN KEY",
        "rule 1",
    ),
    "1_renumber": Case(
        ["UPDATE fsm_messages SET seq = seq + 10 WHERE conversation_id = 'c' AND seq = 0"],
        {"ck_fsm_messages_prev"},
        "CHECK constraint failed: ck_fsm_messages_prev",
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
        name = orig.diag.constraint_name  # type: ignore[union-attr]
        assert pg_constraint(seeded, name) in case.pg, str(orig)
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
                ("fsm_messages", result_row("c", 6, 4, 1, 2, "q")),
                ("fsm_messages", user_row("c", 7)),
            ],
        )
    history = seeded.history("c")
    assert [m["role"] for m in history[4:]] == ["assistant", "tool", "tool", "user"]
    assert [c["id"] for c in history[4]["tool_calls"]] == ["p", "q"]
    assert [m["tool_call_id"] for m in history[5:7]] == ["p", "q"]
    assert seeded.next_seq("c") == 8


def test_deleting_the_conversation_with_raw_sql_cascades(seeded: ConversationStore) -> None:
    with seeded.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM fsm_conversations WHERE id = 'c'"))
    with seeded.engine.connect() as conn:
        for table in ("fsm_messages", "fsm_tool_calls"):
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


# -- round 2: what "finished" means, content, and pinned types ---------------------------------
def _call_with(conv: str, seq: int, **values: Any) -> list[Step]:
    """An assistant at ``seq`` with one call (its values overridden) and its result."""
    return [
        ("fsm_messages", assistant_row(conv, seq, 1)),
        ("fsm_tool_calls", {**call_row(conv, seq, 0, 1, "p"), **values}),
        ("fsm_messages", result_row(conv, seq + 1, seq, 0, 1, "p")),
    ]


_MARKED = "\ufdd0"
FINISHED_CASES: dict[str, tuple[list[Step], str]] = {
    "empty_name": (_call_with("c", 4, name=""), "ck_fsm_tool_calls_name"),
    "blank_name": (_call_with("c", 4, name=" \t\r\n"), "ck_fsm_tool_calls_name"),
    "invalid_json_arguments": (
        _call_with("c", 4, arguments='{"a": 1'),
        "ck_fsm_tool_calls_arguments",
    ),
    "nan_arguments": (_call_with("c", 4, arguments='{"a": NaN}'), "ck_fsm_tool_calls_arguments"),
    "bare_nan_arguments": (_call_with("c", 4, arguments="NaN"), "ck_fsm_tool_calls_arguments"),
    "infinity_arguments": (
        _call_with("c", 4, arguments="[Infinity]"),
        "ck_fsm_tool_calls_arguments",
    ),
    "single_quoted_arguments": (
        _call_with("c", 4, arguments="{'a': 1}"),
        "ck_fsm_tool_calls_arguments",
    ),
    "trailing_garbage_arguments": (
        _call_with("c", 4, arguments="{} x"),
        "ck_fsm_tool_calls_arguments",
    ),
    "marked_invalid_arguments": (
        _call_with("c", 4, arguments=encode_text("{\ud83d")),
        "ck_fsm_tool_calls_arguments",
    ),
    "marked_nul_arguments": (
        _call_with("c", 4, arguments=encode_text('"\x00\ud83d"')),
        "ck_fsm_tool_calls_arguments",
    ),
    "marked_surrogate_outside_a_string": (
        _call_with("c", 4, arguments=encode_text("[\ud83d]")),
        "ck_fsm_tool_calls_arguments",
    ),
    "marked_surrogate_after_a_backslash": (
        # the original is {"a": "\<U+D83D>"}: a backslash escaping a raw surrogate
        _call_with("c", 4, arguments=encode_text('{"a": "\\\ud83d"}')),
        "ck_fsm_tool_calls_arguments",
    ),
    "marked_text_that_is_not_the_codec_s": (
        _call_with("c", 4, arguments=_MARKED + "not json"),
        "ck_fsm_tool_calls_arguments",
    ),
    "null_user_content": (
        [("fsm_messages", {**user_row("c", 4), "content": None})],
        "ck_fsm_messages_content",
    ),
    "null_system_content": (
        [("fsm_messages", {**user_row("c", 4), "role": "system", "content": None})],
        "ck_fsm_messages_content",
    ),
    "null_developer_content": (
        [("fsm_messages", {**user_row("c", 4), "role": "developer", "content": None})],
        "ck_fsm_messages_content",
    ),
    "null_tool_content": (
        [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_tool_calls", call_row("c", 4, 0, 1, "p")),
            ("fsm_messages", {**result_row("c", 5, 4, 0, 1, "p"), "content": None}),
        ],
        "ck_fsm_messages_content",
    ),
    "null_user_content_by_update": (
        ["UPDATE fsm_messages SET content = NULL WHERE conversation_id = 'c' AND seq = 0"],
        "ck_fsm_messages_content",
    ),
    "blank_name_by_update": (
        ["UPDATE fsm_tool_calls SET name = '  ' WHERE conversation_id = 'c' AND position = 0"],
        "ck_fsm_tool_calls_name",
    ),
    "invalid_arguments_by_update": (
        ["UPDATE fsm_tool_calls SET arguments = '{' WHERE conversation_id = 'c' AND position = 0"],
        "ck_fsm_tool_calls_arguments",
    ),
}


@pytest.mark.parametrize("name", sorted(FINISHED_CASES))
def test_finished_means_name_and_json_and_content(seeded: ConversationStore, name: str) -> None:
    steps, constraint = FINISHED_CASES[name]
    before = dump(seeded)
    with pytest.raises(sa.exc.IntegrityError) as caught, seeded.engine.begin() as conn:
        run_steps(conn, steps)
    orig = caught.value.orig
    if seeded.engine.dialect.name == "postgresql":
        name = orig.diag.constraint_name  # type: ignore[union-attr]
        assert pg_constraint(seeded, name) == constraint, str(orig)
    else:
        assert f"CHECK constraint failed: {constraint}" in str(orig), str(orig)
    assert dump(seeded) == before


ACCEPTED_ARGUMENTS = [
    "",
    "  \t\r\n",
    "{}",
    ' {"a": [1, 2.5e-3, true, null]} ',
    '"\\ud800"',  # a lone surrogate escape: valid JSON text
    '"\\u0000"',
    "1e1000000",
    "1" * 5000,
    "[" * 500 + "]" * 500,
    # stored marked by the codec (what a split surrogate pair gives): a raw lone surrogate in
    # a string, after an escaped backslash, and next to text that looks like the codec's escapes
    encode_text('{"a": "\ud83d\ude00"}'),
    encode_text('{"a": "\\\\\ud83d"}'),
    encode_text('{"\\\\u0041": "\\\\0 \ud800", "b": "\\u00e9"}'),
]


@pytest.mark.parametrize("arguments", ACCEPTED_ARGUMENTS, ids=range(len(ACCEPTED_ARGUMENTS)))
def test_blank_or_valid_json_arguments_are_accepted(
    seeded: ConversationStore, arguments: str
) -> None:
    """Control: what the checks accept (stored text, as the codec writes it)."""
    with seeded.engine.begin() as conn:
        run_steps(conn, _call_with("c", 4, arguments=arguments, name=" f "))
        conn.execute(
            sa.text(
                "INSERT INTO fsm_messages (conversation_id, seq, role, content, n_calls, slots_left,"
                " prev_seq, prev_slots_left, tool_call_id, assistant_seq, call_position)"
                " VALUES ('c', 6, 'assistant', NULL, 0, 0, 5, 0, NULL, NULL, NULL)"
            )
        )
    assert seeded.next_seq("c") == 7


def test_a_tool_result_may_be_empty_and_an_assistant_may_have_no_content(
    seeded: ConversationStore,
) -> None:
    with seeded.engine.begin() as conn:
        run_steps(
            conn,
            [
                ("fsm_messages", assistant_row("c", 4, 1)),
                ("fsm_tool_calls", call_row("c", 4, 0, 1, "p")),
                ("fsm_messages", {**result_row("c", 5, 4, 0, 1, "p"), "content": ""}),
            ],
        )
    assert seeded.history("c")[-1] == {"role": "tool", "tool_call_id": "p", "content": ""}


# -- wrong types in every integer column -------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """An SQL literal written into a statement as it is."""

    sql: str


def _literal(value: Any, postgres: bool) -> str:
    if isinstance(value, Raw):
        return value.sql
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return ("true" if value else "false") if postgres else str(int(value))
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def _literal_insert(table: str, row: Row, postgres: bool) -> str:
    values = ", ".join(_literal(v, postgres) for v in row.values())
    return f"INSERT INTO {table} ({', '.join(row)}) VALUES ({values})"


def _attempt(attempt_id: Any = 1000, **values: Any) -> Row:
    return {
        "id": attempt_id,
        "conversation_id": "c",
        "at_seq": 4,
        "choice": 0,
        "complete": False,
        "anomalies": "[]",
        **values,
    }


def _attempt_call(**values: Any) -> Row:
    return {
        "conversation_id": "c",
        "attempt_id": 1000,
        "position": 0,
        "provider_index": 0,
        "call_id": "a",
        "type": "function",
        "name": "f",
        "arguments": "{",
        "repaired": False,
        "state": "truncated",
        **values,
    }


def _type_steps(table: str, column: str, value: Any) -> list[tuple[str, Row]]:
    """Otherwise valid rows with ``value`` in ``table.column``."""
    if table == "fsm_messages":
        if column in ("assistant_seq", "call_position"):
            return [
                ("fsm_messages", assistant_row("c", 4, 1)),
                ("fsm_tool_calls", call_row("c", 4, 0, 1, "p")),
                ("fsm_messages", {**result_row("c", 5, 4, 0, 1, "p"), column: value}),
            ]
        if column in ("n_calls", "slots_left", "block_end_seq"):
            return [
                ("fsm_messages", {**assistant_row("c", 4, 1), column: value}),
                ("fsm_tool_calls", call_row("c", 4, 0, 1, "p")),
                ("fsm_messages", result_row("c", 5, 4, 0, 1, "p")),
            ]
        return [("fsm_messages", {**user_row("c", 4), column: value})]
    if table == "fsm_tool_calls":
        return [
            ("fsm_messages", assistant_row("c", 4, 1)),
            ("fsm_tool_calls", {**call_row("c", 4, 0, 1, "p"), column: value}),
            ("fsm_messages", result_row("c", 5, 4, 0, 1, "p")),
        ]
    if table == "fsm_attempts":
        return [("fsm_attempts", _attempt(**{column: value}))]
    return [("fsm_attempts", _attempt()), ("fsm_attempt_calls", _attempt_call(**{column: value}))]


INTEGER_COLUMNS = {
    "fsm_messages": [
        "seq",
        "choice",
        "n_calls",
        "slots_left",
        "prev_seq",
        "prev_slots_left",
        "assistant_seq",
        "call_position",
        "block_end_seq",
    ],
    "fsm_tool_calls": ["assistant_seq", "position", "assistant_n_calls", "provider_index"],
    "fsm_attempts": ["id", "at_seq", "choice"],
    "fsm_attempt_calls": ["attempt_id", "position", "provider_index"],
}
BOOLEAN_COLUMNS = {
    "fsm_tool_calls": ["repaired"],
    "fsm_attempts": ["complete"],
    "fsm_attempt_calls": ["repaired"],
}

#: (label, SQLite literal, PostgreSQL literal): text, real and blob values
WRONG_INTEGERS = [
    ("text '4x'", Raw("'4x'"), Raw("'4x'")),
    ("text '0.5'", Raw("'0.5'"), Raw("'0.5'")),
    ("real 0.5", Raw("0.5"), Raw("'0.5'::float8::text")),
    ("real 1e300", Raw("1e300"), Raw("1e300")),
    ("blob X'00'", Raw("X'00'"), Raw("'\\x00'::bytea")),
]
WRONG_BOOLEANS = [
    ("integer 2", Raw("2"), Raw("2")),
    ("text 'x'", Raw("'x'"), Raw("'x'")),
    ("real 0.5", Raw("0.5"), Raw("0.5")),
    ("blob X'01'", Raw("X'01'"), Raw("'\\x01'::bytea")),
]


def _rejected(store: ConversationStore, steps: list[tuple[str, Row]]) -> BaseException | None:
    """Run ``steps`` in one transaction: the error that rejected them, or ``None``."""
    postgres = store.engine.dialect.name == "postgresql"
    try:
        with store.engine.begin() as conn:
            for table, row in steps:
                conn.exec_driver_sql(_literal_insert(table, row, postgres))
    except sa.exc.DBAPIError as exc:
        return exc
    return None


@pytest.mark.parametrize(
    ("table", "column"),
    [(t, c) for t, cs in INTEGER_COLUMNS.items() for c in cs],
    ids=[f"{t}.{c}" for t, cs in INTEGER_COLUMNS.items() for c in cs],
)
def test_wrong_types_in_every_integer_column_are_rejected(
    seeded: ConversationStore, table: str, column: str
) -> None:
    """Text, real and blob values in each integer column: SQLite's types check (or another
    check) rejects them, PostgreSQL's column type does; the store is unchanged."""
    postgres = seeded.engine.dialect.name == "postgresql"
    before = dump(seeded)
    for label, sqlite_value, pg_value in WRONG_INTEGERS:
        value = pg_value if postgres else sqlite_value
        error = _rejected(seeded, _type_steps(table, column, value))
        assert error is not None, f"{table}.{column} = {label} was accepted"
        assert isinstance(error, sa.exc.IntegrityError | sa.exc.DataError | sa.exc.ProgrammingError)
        assert dump(seeded) == before


@pytest.mark.parametrize(
    ("table", "column"),
    [(t, c) for t, cs in BOOLEAN_COLUMNS.items() for c in cs],
    ids=[f"{t}.{c}" for t, cs in BOOLEAN_COLUMNS.items() for c in cs],
)
def test_wrong_values_in_boolean_columns_are_rejected(
    seeded: ConversationStore, table: str, column: str
) -> None:
    postgres = seeded.engine.dialect.name == "postgresql"
    extra = {"raw_arguments": "{"} if column == "repaired" else {}
    for label, sqlite_value, pg_value in WRONG_BOOLEANS:
        steps = _type_steps(table, column, pg_value if postgres else sqlite_value)
        steps = [(t, {**r, **extra} if t.endswith("calls") else r) for t, r in steps]
        assert _rejected(seeded, steps) is not None, f"{table}.{column} = {label} was accepted"
    # control: a valid value goes in
    valid = _type_steps(table, column, True)
    valid = [(t, {**r, **extra} if t.endswith("calls") else r) for t, r in valid]
    assert _rejected(seeded, valid) is None
    _undo(seeded)


def test_the_type_steps_are_valid_with_valid_values(seeded: ConversationStore) -> None:
    """Control: each template with an ordinary value of its column is accepted (so the
    rejections above are the value's doing)."""
    normal = {
        ("fsm_messages", "seq"): 4,
        ("fsm_messages", "choice"): 0,
        ("fsm_messages", "prev_seq"): 3,
        ("fsm_messages", "prev_slots_left"): 0,
        ("fsm_messages", "n_calls"): 1,
        ("fsm_messages", "slots_left"): 1,
        ("fsm_messages", "block_end_seq"): 5,
        ("fsm_messages", "assistant_seq"): 4,
        ("fsm_messages", "call_position"): 0,
        ("fsm_tool_calls", "assistant_seq"): 4,
        ("fsm_tool_calls", "position"): 0,
        ("fsm_tool_calls", "assistant_n_calls"): 1,
        ("fsm_tool_calls", "provider_index"): 7,
        ("fsm_attempts", "id"): 1000,
        ("fsm_attempts", "at_seq"): 4,
        ("fsm_attempts", "choice"): 0,
        ("fsm_attempt_calls", "attempt_id"): 1000,
        ("fsm_attempt_calls", "position"): 0,
        ("fsm_attempt_calls", "provider_index"): 3,
    }
    before = dump(seeded)
    for (table, column), value in normal.items():
        assert _rejected(seeded, _type_steps(table, column, value)) is None, (table, column)
        _undo(seeded)
        assert dump(seeded) == before


def _undo(store: ConversationStore) -> None:
    """Remove what a template wrote: results (which point at their calls), calls (which point
    at their assistant message), then the other messages."""
    where = "conversation_id = 'c' AND seq >= 4"
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM fsm_messages WHERE {where} AND role = 'tool'"))
        conn.execute(
            sa.text("DELETE FROM fsm_tool_calls WHERE conversation_id = 'c' AND assistant_seq >= 4")
        )
        conn.execute(sa.text(f"DELETE FROM fsm_messages WHERE {where}"))
        conn.execute(sa.text("DELETE FROM fsm_attempts WHERE id = 1000"))


def test_sqlite_text_keys_refuse_blobs(seeded: ConversationStore) -> None:
    """A blob in a text key (SQLite would store it: TEXT affinity converts numbers, not
    blobs) is refused by the types check."""
    if seeded.engine.dialect.name != "sqlite":
        pytest.skip("SQLite only: PostgreSQL's text columns hold text")
    cases: list[list[tuple[str, Row]]] = [
        [("fsm_messages", {**user_row("c", 4), "role": Raw("X'75736572'")})],
        [("fsm_messages", {**user_row("c", 4), "content": Raw("X'00'")})],
        *[
            _type_steps("fsm_tool_calls", column, Raw("X'66'"))
            for column in ("call_id", "name", "arguments", "type", "state")
        ],
        [("fsm_attempts", _attempt(conversation_id=Raw("X'63'")))],
    ]
    for steps in cases:
        error = _rejected(seeded, steps)
        assert error is not None, steps
        assert "CHECK constraint failed" in str(error.orig) or "FOREIGN KEY" in str(error.orig)
