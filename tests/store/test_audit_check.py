"""``check()`` finds every kind of violation, forced in by writing around the constraints.

A valid store is built through ``ConversationStore`` (the real parser on the corpus and on
hand-built streams). Each case then breaks one thing inside a transaction where the schema's
enforcement is off: SQLite with ``PRAGMA foreign_keys=OFF`` and ``ignore_check_constraints=ON``
(and an index dropped where a case needs it), PostgreSQL with the foreign keys and checks of the
tables dropped (``ALTER TABLE ... DROP CONSTRAINT``, transactional). ``check()`` runs on that
connection, inside the transaction, which is then rolled back; the same store checked without
the change has no violation, so each finding is due to the one thing the case breaks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm import parse
from fsm.api import parse_text
from fsm.cli.main import cli
from fsm.store import ConversationStore
from fsm.store import audit as A
from fsm.store.engine import create_engine
from tests.helpers import CORPUS, chunk, require_corpus, sse, tc

TABLES = (
    "fsm_conversations",
    "fsm_messages",
    "fsm_tool_calls",
    "fsm_attempts",
    "fsm_attempt_calls",
)


def build(store: ConversationStore) -> None:
    """Conversation c: 0 user, 1 assistant (calls x, y), 2 result x, 3 result y, 4 assistant
    text, 5 user, 6 assistant (call z), 7 result z; one failed attempt. Conversation d: 0 user,
    1 assistant (call from the corpus), 2 result; one failed attempt."""
    store.create_conversation("c")
    store.append("c", [{"role": "user", "content": "hi"}])
    turn = parse(
        sse(
            chunk(tc(0, "x", "get_weather", '{"city": "Paris"}', "function")),
            chunk(tc(1, "y", "get_time", "", "function")),
            chunk(finish="tool_calls"),
        )
    ).turn(0)
    store.commit_turn("c", turn, ["18 C", "12:00"])
    store.append("c", [{"role": "assistant", "content": "18 C at noon"}])
    store.append("c", [{"role": "user", "content": "and tomorrow?"}])
    again = parse(
        sse(chunk(tc(0, "z", "get_weather", '{"day": 2}', "function")), chunk(finish="tool_calls"))
    )
    store.commit_turn("c", again.turn(0), ["rain"], idempotency_key="second")
    store.record_attempt(
        "c", parse(sse(chunk(tc(0, "w", "get_weather", '{"ci')), chunk(finish="length")))
    )
    store.create_conversation("d")
    store.append("d", [{"role": "user", "content": "weather?"}])
    data = (CORPUS / "openai/openai-gpt-5_single_tool_call.sse").read_bytes()
    store.commit_turn("d", parse_text(data).turn(0), ["sunny"])
    store.record_attempt("d", parse_text(data[: len(data) // 2]))


@pytest.fixture
def url(db_url: sa.URL) -> sa.URL:
    require_corpus()
    with ConversationStore(db_url) as store:
        build(store)
    return db_url


@contextmanager
def unguarded(url: sa.URL, *, keys: bool = False) -> Iterator[sa.Connection]:
    """A connection in a transaction where the constraints are off, rolled back afterwards.

    ``keys`` also drops the primary and unique keys of ``messages`` (PostgreSQL only: SQLite
    cannot drop a table's keys without rebuilding it).
    """
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, foreign_keys=False)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA ignore_check_constraints=ON")
                conn.commit()
                transaction = conn.begin()
                try:
                    yield conn
                finally:
                    transaction.rollback()
        finally:
            engine.dispose()
        return
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            transaction = conn.begin()
            try:
                kinds = ["f", "c", "p", "u"] if keys else ["f", "c"]
                constraints = conn.execute(
                    sa.text(
                        "SELECT conrelid::regclass::text, conname FROM pg_constraint "
                        "WHERE conrelid = ANY(CAST(:tables AS regclass[])) AND conparentid = 0 "
                        'AND contype = ANY(CAST(:kinds AS "char"[])) ORDER BY contype DESC'
                    ),
                    {"tables": list(TABLES), "kinds": kinds},
                ).all()
                for table, name in constraints:
                    conn.execute(
                        sa.text(f'ALTER TABLE {table} DROP CONSTRAINT IF EXISTS "{name}" CASCADE')
                    )
                yield conn
            finally:
                transaction.rollback()
    finally:
        engine.dispose()


@dataclass(frozen=True)
class Case:
    kind: str
    sql: list[str]
    #: (conversation, seq) where the violation of ``kind`` must be reported
    at: tuple[str | None, int | None]
    keys: bool = False
    sqlite: bool = True
    postgres: bool = True


def message(seq: int, role: str = "user", **cols: object) -> str:
    """An INSERT of a message of conversation c (the enforcement columns made plausible)."""
    row: dict[str, object] = {
        "conversation_id": "'c'",
        "seq": seq,
        "role": f"'{role}'",
        "content": "'forced'",
        "n_calls": 0,
        "slots_left": 0,
        "prev_seq": seq - 1,
        "prev_slots_left": 0,
        "created_at": "CURRENT_TIMESTAMP",
    }
    row.update(cols)
    return (
        f"INSERT INTO fsm_messages ({', '.join(row)}) VALUES ({', '.join(map(str, row.values()))})"
    )


CASES = [
    Case(
        "seq_start", ["DELETE FROM fsm_messages WHERE conversation_id = 'c' AND seq = 0"], ("c", 1)
    ),
    Case("seq_gap", ["DELETE FROM fsm_messages WHERE conversation_id = 'c' AND seq = 5"], ("c", 6)),
    Case(
        "seq_duplicate",
        [message(5, content="'twin'")],
        ("c", 5),
        keys=True,
        sqlite=False,
    ),
    Case(
        "invalid_row",
        ["UPDATE fsm_messages SET n_calls = 2 WHERE conversation_id = 'c' AND seq = 0"],
        ("c", 0),
    ),
    Case(
        "invalid_row",
        ["UPDATE fsm_messages SET role = 'robot' WHERE conversation_id = 'c' AND seq = 5"],
        ("c", 5),
    ),
    Case(
        "result_misplaced",  # the two results of seq 1 swapped
        [
            "UPDATE fsm_messages SET seq = 100 WHERE conversation_id = 'c' AND seq = 2",
            "UPDATE fsm_messages SET seq = 2 WHERE conversation_id = 'c' AND seq = 3",
            "UPDATE fsm_messages SET seq = 3 WHERE conversation_id = 'c' AND seq = 100",
        ],
        ("c", 2),
    ),
    Case(
        "duplicate_result",  # a second result for call x, after the last message
        [
            "DROP INDEX ix_fsm_messages_conversation_id_assistant_seq_call_position",
            message(
                8, "tool", tool_call_id="'x'", assistant_seq=1, call_position=0, prev_slots_left=1
            ),
        ],
        ("c", 8),
    ),
    Case(
        "interleaved",  # the result of y turned into a user message
        [
            "UPDATE fsm_messages SET role = 'user', tool_call_id = NULL, assistant_seq = NULL, "
            "call_position = NULL, prev_slots_left = 0, slots_left = 0 "
            "WHERE conversation_id = 'c' AND seq = 3"
        ],
        ("c", 3),
    ),
    Case(
        "missing_result",
        ["DELETE FROM fsm_messages WHERE conversation_id = 'c' AND seq = 7"],
        ("c", 6),
    ),
    Case(
        "result_id_mismatch",
        ["UPDATE fsm_messages SET tool_call_id = 'not-x' WHERE conversation_id = 'c' AND seq = 2"],
        ("c", 2),
    ),
    Case(
        "orphan_result",
        ["DELETE FROM fsm_tool_calls WHERE conversation_id = 'c' AND assistant_seq = 6"],
        ("c", 7),
    ),
    Case(
        "not_finished",
        [
            "UPDATE fsm_tool_calls SET state = 'truncated' WHERE conversation_id = 'c' AND assistant_seq = 6"
        ],
        ("c", 6),
    ),
    Case(
        "call_count_mismatch",  # declares 3 calls, has 2
        [
            "UPDATE fsm_messages SET n_calls = 3, slots_left = 3, block_end_seq = 4 "
            "WHERE conversation_id = 'c' AND seq = 1"
        ],
        ("c", 1),
    ),
    Case(
        "call_count_mismatch",  # a call beyond the declared count
        [
            "INSERT INTO fsm_tool_calls (conversation_id, assistant_seq, position, assistant_n_calls, "
            "call_id, type, name, arguments, repaired, state) VALUES "
            "('c', 6, 1, 2, 'extra', 'function', 'f', '{}', false, 'finished')"
        ],
        ("c", 6),
    ),
    Case(
        "orphan_call",  # a call of the user message at seq 0
        [
            "INSERT INTO fsm_tool_calls (conversation_id, assistant_seq, position, assistant_n_calls, "
            "call_id, type, name, arguments, repaired, state) VALUES "
            "('c', 0, 0, 1, 'ghost', 'function', 'f', '{}', false, 'finished')"
        ],
        ("c", 0),
    ),
    Case("orphan_row", ["DELETE FROM fsm_conversations WHERE id = 'd'"], ("d", None)),
    Case("orphan_row", ["DELETE FROM fsm_attempts WHERE conversation_id = 'd'"], (None, None)),
    Case(
        "invalid_type",  # SQLite's type affinity keeps a text in an INTEGER column
        ["UPDATE fsm_messages SET n_calls = '2x' WHERE conversation_id = 'c' AND seq = 0"],
        ("c", 0),
        postgres=False,
    ),
    Case(
        "invalid_type",  # a NOT NULL dropped
        [
            "ALTER TABLE fsm_tool_calls ALTER COLUMN type DROP NOT NULL",
            "UPDATE fsm_tool_calls SET type = NULL WHERE conversation_id = 'c' AND assistant_seq = 6",
        ],
        ("c", 6),
        sqlite=False,
    ),
    Case(
        "invalid_name",
        ["UPDATE fsm_tool_calls SET name = ' ' WHERE conversation_id = 'c' AND assistant_seq = 6"],
        ("c", 6),
    ),
    Case(
        "invalid_arguments",
        [
            "UPDATE fsm_tool_calls SET arguments = '{' WHERE conversation_id = 'c' AND assistant_seq = 6"
        ],
        ("c", 6),
    ),
    Case(
        "missing_content",
        ["UPDATE fsm_messages SET content = NULL WHERE conversation_id = 'c' AND seq = 5"],
        ("c", 5),
    ),
    Case(
        "duplicate_key",  # the idempotency key of seq 6 given to seq 1 too
        [
            "DROP INDEX ix_fsm_messages_conversation_id_idempotency_key",
            "UPDATE fsm_messages SET idempotency_key = 'second' WHERE conversation_id = 'c' AND seq = 1",
        ],
        ("c", None),
    ),
    Case(
        "unenforced",
        ["DROP INDEX ix_fsm_messages_conversation_id_assistant_seq_call_position"],
        (None, None),
    ),
    Case(
        "bookkeeping",
        ["UPDATE fsm_messages SET prev_slots_left = 1 WHERE conversation_id = 'c' AND seq = 5"],
        ("c", 5),
    ),
    Case(
        "bookkeeping",  # a result's open slots that disagree with its block
        [
            "UPDATE fsm_messages SET slots_left = 4, prev_slots_left = 5 "
            "WHERE conversation_id = 'c' AND seq = 2"
        ],
        ("c", 2),
    ),
]


def test_every_kind_has_a_case() -> None:
    # "corrupt" is the engine's own storage damaged, which no SQL can cause: its cases flip
    # bytes of a file (tests/store/test_real_faults.py)
    assert {case.kind for case in CASES} == set(A.VIOLATION_KINDS) - {"corrupt"}


def test_a_valid_store_has_no_violation(url: sa.URL) -> None:
    engine = A.open_readonly(url)
    try:
        assert list(A.check(engine)) == []
        assert list(A.check(engine, batch_size=1, workers=2)) == []
    finally:
        engine.dispose()
    with unguarded(url) as conn:  # turning the guards off breaks no rule by itself...
        found = list(A.check(conn))
    assert [v for v in found if v.kind != "unenforced"] == []
    # ...but dropped constraints (PostgreSQL) are reported: the database no longer enforces them
    dropped = url.get_backend_name() == "postgresql"
    assert bool(found) == dropped
    assert all("fk_" in v.detail or "ck_" in v.detail for v in found)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}-{i}" for i, c in enumerate(CASES)])
def test_check_finds(url: sa.URL, case: Case) -> None:
    if url.get_backend_name() == "sqlite" and not case.sqlite:
        pytest.skip("SQLite cannot drop a table's primary key or a NOT NULL")
    if url.get_backend_name() == "postgresql" and not case.postgres:
        pytest.skip("PostgreSQL's column types refuse the value")
    with unguarded(url, keys=case.keys) as conn:
        for statement in case.sql:
            conn.execute(sa.text(statement))
        found = list(A.check(conn, batch_size=1))
    assert found, case
    where = {(v.conversation_id, v.seq) for v in found if v.kind == case.kind}
    assert case.at in where, found
    assert all(v.kind in A.VIOLATION_KINDS and v.detail for v in found)


def test_progress_and_batches(url: sa.URL) -> None:
    calls: list[tuple[int, int]] = []
    with unguarded(url) as conn:
        conn.execute(sa.text("DELETE FROM fsm_messages WHERE conversation_id = 'd' AND seq = 2"))
        found = list(
            A.check(conn, progress=lambda done, total: calls.append((done, total)), batch_size=1)
        )
    assert [(v.conversation_id, v.kind) for v in found if v.kind != "unenforced"] == [
        ("d", "missing_result")
    ]
    assert calls == [(0, 2), (1, 2), (2, 2)]  # one batch per conversation


def test_the_check_command_exits_1_and_lists_violations(url: sa.URL) -> None:
    if url.get_backend_name() != "sqlite":
        pytest.skip(
            "the command reads committed data: the per-test SQLite copy can be broken for good"
        )
    engine = create_engine(url, foreign_keys=False)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM fsm_messages WHERE conversation_id = 'c' AND seq = 7")
            )
            conn.execute(
                sa.text(
                    "UPDATE fsm_messages SET tool_call_id = 'zz' WHERE conversation_id = 'd' AND seq = 2"
                )
            )
    finally:
        engine.dispose()
    text = url.render_as_string(hide_password=False)
    result = CliRunner().invoke(cli, ["audit", "check", "--db", text, "--nl"])
    assert result.exit_code == 1
    rows = [__import__("json").loads(line) for line in result.stdout.splitlines()]
    assert [(r["conversation_id"], r["seq"], r["kind"]) for r in rows] == [
        ("c", 6, "missing_result"),
        ("d", 2, "result_id_mismatch"),
    ]
    assert "2 violation(s)" in result.stderr and "missing_result" in result.stderr
    table = CliRunner().invoke(cli, ["audit", "check", "--db", text])
    assert table.exit_code == 1 and table.stdout.splitlines()[0].split() == [
        "conversation_id",
        "seq",
        "kind",
        "detail",
    ]
