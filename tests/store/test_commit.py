"""Writes through the API: atomic turns, idempotency, conflicts, results, attempts, deletion."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from fsm import parse
from fsm.errors import IncompleteTurnError
from fsm.store import (
    ConflictError,
    ConversationExistsError,
    ConversationNotFoundError,
    ConversationStore,
    IdempotencyMismatchError,
    InvalidConversationIdError,
    InvalidMessageError,
    InvalidTurnError,
    ResultsError,
    StoreBusyError,
)
from tests.helpers.store import make_turn

TWO_CALLS = [("call_a", "add", '{"a": 2, "b": 3}'), ("call_m", "multiply", '{"a": 2, "b": 3}')]


def dump(store: ConversationStore) -> dict[str, list[Any]]:
    with store.engine.connect() as conn:
        return {
            table: sorted(
                (
                    tuple(str(v) for v in row)
                    for row in conn.execute(sa.text(f"SELECT * FROM {table}"))
                ),
            )
            for table in (
                "fsm_conversations",
                "fsm_messages",
                "fsm_tool_calls",
                "fsm_attempts",
                "fsm_attempt_calls",
            )
        }


@pytest.fixture
def conv(store: ConversationStore) -> str:
    cid = store.create_conversation("conv-1")
    store.append(cid, [{"role": "user", "content": "What is 2+3 and 2*3?"}])
    return cid


# -- committing a turn ---------------------------------------------------------------------------
def test_commit_turn_stores_assistant_and_results(store: ConversationStore, conv: str) -> None:
    turn = make_turn(TWO_CALLS, content="Let me compute.")
    committed = store.commit_turn(conv, turn, ["5", {"content": "6", "tool_call_id": "call_m"}])
    assert committed.created and committed.seq == 1 and committed.next_seq == 4
    history = store.history(conv)
    assert history[1] == turn.to_message()
    assert history[2:] == [
        {"role": "tool", "tool_call_id": "call_a", "content": "5"},
        {"role": "tool", "tool_call_id": "call_m", "content": "6"},
    ]
    assert committed.messages == history[1:]
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT model, response_id, choice, finish_reason, n_calls FROM fsm_messages "
                "WHERE conversation_id = 'conv-1' AND seq = 1"
            )
        ).one()
    assert tuple(row) == ("test-model", "chatcmpl-1", 0, "tool_calls", 2)


def test_results_keyed_by_id(store: ConversationStore, conv: str) -> None:
    store.commit_turn(conv, make_turn(TWO_CALLS), {"call_m": "6", "call_a": "5"})
    assert [m["content"] for m in store.history(conv)[2:]] == ["5", "6"]


def test_turn_without_tool_calls(store: ConversationStore, conv: str) -> None:
    turn = make_turn([], content="5 and 6.", finish_reason="stop")
    committed = store.commit_turn(conv, turn)
    assert committed.messages == [{"role": "assistant", "content": "5 and 6."}]
    assert store.history(conv)[-1] == turn.to_message()


def test_parse_result_with_one_choice_is_accepted(store: ConversationStore, conv: str) -> None:
    chunks = [
        {"id": "r", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
    ]
    store.commit_turn(conv, parse(chunks))
    assert store.history(conv)[-1] == {"role": "assistant", "content": "hi"}
    two = [
        {"id": "r2", "choices": [{"index": i, "delta": {"content": "x"}, "finish_reason": "stop"}]}
        for i in (0, 1)
    ]
    with pytest.raises(InvalidTurnError, match="2 choices"):
        store.commit_turn(conv, parse(two))


def test_incomplete_turn_is_refused_and_writes_nothing(store: ConversationStore, conv: str) -> None:
    turn = make_turn([("call_a", "add", '{"a": 2, "b"')], finish_reason="length")
    before = dump(store)
    with pytest.raises(IncompleteTurnError, match="truncated") as caught:
        store.commit_turn(conv, turn, ["5"])
    assert caught.value.states == {0: ("truncated", "length")}
    assert dump(store) == before


@pytest.mark.parametrize(
    ("results", "message"),
    [
        (["5"], "2 tool call"),
        (["5", "6", "7"], "3 result"),
        ("56", "not str"),
        ({"call_a": "5"}, "missing \\['call_m'\\]"),
        ({"call_a": "5", "call_m": "6", "x": "7"}, "unknown \\['x'\\]"),
        (["5", {"content": "6", "tool_call_id": "call_a"}], "out of order"),
        (["5", {"text": "6"}], "keys fsm does not store"),
        (["5", {"role": "user", "content": "6"}], "role 'user'"),
        (["5", {"tool_call_id": "call_m"}], "no content"),
        (["5", 6], "must be a string or a dict"),
        (None, "0 result"),
    ],
)
def test_results_that_do_not_match_raise(
    store: ConversationStore, conv: str, results: Any, message: str
) -> None:
    before = dump(store)
    with pytest.raises(ResultsError, match=message):
        store.commit_turn(conv, make_turn(TWO_CALLS), results)
    assert dump(store) == before


@pytest.mark.parametrize("ids", [("", ""), ("dup", "dup"), ("", "x")])
def test_results_by_id_are_ambiguous_for_empty_or_repeated_ids(
    store: ConversationStore, conv: str, ids: tuple[str, str]
) -> None:
    turn = make_turn([(ids[0], "f", "{}"), (ids[1], "g", "{}")])
    with pytest.raises(ResultsError, match="ambiguous"):
        store.commit_turn(conv, turn, {ids[0]: "1", ids[1]: "2"})


def test_empty_and_repeated_ids_link_by_row(store: ConversationStore, conv: str) -> None:
    """Ids "" and repeated ids (within a turn and across turns) stay byte-exact and each result
    is linked to its own call row."""
    store.commit_turn(conv, make_turn([("", "f", '{"n": 1}'), ("", "g", '{"n": 2}')]), ["r1", "r2"])
    store.commit_turn(
        conv,
        make_turn([("dup", "f", "{}"), ("dup", "g", "[]")], response_id="chatcmpl-2"),
        ["r3", "r4"],
    )
    store.commit_turn(conv, make_turn([("dup", "h", "{}")], response_id="chatcmpl-3"), ["r5"])
    history = store.history(conv)
    assert [c["id"] for c in history[1]["tool_calls"]] == ["", ""]
    assert [(m["tool_call_id"], m["content"]) for m in history[2:4]] == [("", "r1"), ("", "r2")]
    assert [c["function"]["name"] for c in history[4]["tool_calls"]] == ["f", "g"]
    assert [(m["tool_call_id"], m["content"]) for m in history[5:7]] == [
        ("dup", "r3"),
        ("dup", "r4"),
    ]
    assert history[8] == {"role": "tool", "tool_call_id": "dup", "content": "r5"}
    with store.engine.connect() as conn:
        links = conn.execute(
            sa.text(
                "SELECT m.content, c.name FROM fsm_messages m JOIN fsm_tool_calls c"
                " ON c.conversation_id = m.conversation_id AND c.assistant_seq = m.assistant_seq"
                " AND c.position = m.call_position"
                " WHERE m.conversation_id = 'conv-1' ORDER BY m.seq"
            )
        ).all()
    assert [tuple(row) for row in links] == [
        ("r1", "f"),
        ("r2", "g"),
        ("r3", "f"),
        ("r4", "g"),
        ("r5", "h"),
    ]


def test_content_parts_round_trip(store: ConversationStore, conv: str) -> None:
    parts = [{"type": "text", "text": "sunny"}]
    store.commit_turn(conv, make_turn(TWO_CALLS), ["5", {"content": parts}])
    assert store.history(conv)[-1] == {"role": "tool", "tool_call_id": "call_m", "content": parts}


# -- atomicity ------------------------------------------------------------------------------------
class Boom(RuntimeError):
    pass


@pytest.fixture
def statement_counter(store: ConversationStore) -> Iterator[dict[str, int]]:
    """Counts statements; raises Boom at statement number ``fail_at`` (1-based) if set."""
    state = {"count": 0, "fail_at": 0}

    def before(*_args: Any) -> None:
        state["count"] += 1
        if state["count"] == state["fail_at"]:
            raise Boom(f"injected failure at statement {state['count']}")

    event.listen(store.engine, "before_cursor_execute", before)
    yield state
    event.remove(store.engine, "before_cursor_execute", before)


def test_a_failure_at_any_statement_leaves_the_store_unchanged(
    store: ConversationStore, conv: str, statement_counter: dict[str, int]
) -> None:
    turn = make_turn(TWO_CALLS, content="x")
    statement_counter["count"] = 0
    probe_store = dump(store)
    statement_counter["count"] = 0
    # count the statements of one commit on a throwaway conversation
    store.create_conversation("probe")
    statement_counter["count"] = 0
    store.commit_turn("probe", turn, ["5", "6"])
    total = statement_counter["count"]
    # PostgreSQL: one statement (the settings, the lock, the state and the rows, sent as one
    # query that the server commits as it ends); SQLite: BEGIN IMMEDIATE, the state, one insert
    # per table
    assert total == (1 if store.dialect == "postgresql" else 5), total
    store.delete_conversation("probe")
    assert dump(store) == probe_store
    before = dump(store)
    for k in range(1, total + 1):
        statement_counter["count"] = 0
        statement_counter["fail_at"] = k
        with pytest.raises(Boom):
            store.commit_turn(conv, turn, ["5", "6"])
        assert dump(store) == before, f"failure at statement {k} of {total} left a trace"
    statement_counter["fail_at"] = 0
    assert store.commit_turn(conv, turn, ["5", "6"]).created
    assert len(store.history(conv)) == 4


def test_a_failure_at_commit_leaves_the_store_unchanged(
    store: ConversationStore, conv: str
) -> None:
    before = dump(store)

    def fail(_conn: Any) -> None:
        raise Boom("injected failure at COMMIT")

    event.listen(store.engine, "commit", fail)
    turn = make_turn(TWO_CALLS)
    try:
        with pytest.raises(Boom):
            store.commit_turn(conv, turn, ["5", "6"])
    finally:
        event.remove(store.engine, "commit", fail)
    if store.dialect == "postgresql":
        # the server committed the turn as its one statement ended (no COMMIT is sent): whole,
        # and a retry finds it
        assert dump(store) != before
        assert not store.commit_turn(conv, turn, ["5", "6"]).created
        assert len(store.history(conv)) == 4
        return
    assert dump(store) == before


# -- idempotency and conflicts --------------------------------------------------------------------
def test_committing_the_same_turn_twice_stores_it_once(store: ConversationStore, conv: str) -> None:
    turn = make_turn(TWO_CALLS)
    first = store.commit_turn(conv, turn, ["5", "6"])
    again = store.commit_turn(conv, turn, ["5", "6"], expected_seq=first.seq)
    assert not again.created
    assert again.seq == first.seq and again.messages == first.messages
    # the stored results win over different ones given on a retry
    third = store.commit_turn(conv, turn, ["50", "60"])
    assert [m["content"] for m in third.messages[1:]] == ["5", "6"]
    assert len(store.history(conv)) == 4


def test_idempotency_key(store: ConversationStore, conv: str) -> None:
    turn = make_turn(TWO_CALLS, response_id=None)
    first = store.commit_turn(conv, turn, ["5", "6"], idempotency_key="k1")
    assert not store.commit_turn(conv, turn, ["5", "6"], idempotency_key="k1").created
    assert len(store.history(conv)) == 4
    # no response id and no key: nothing identifies the turn, so it is written again
    assert store.commit_turn(conv, turn, ["5", "6"]).seq == first.next_seq


def test_same_key_for_a_different_turn_is_an_error(store: ConversationStore, conv: str) -> None:
    store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"], idempotency_key="k1")
    other = make_turn([("call_z", "zap", "{}")], response_id="chatcmpl-other")
    before = dump(store)
    with pytest.raises(IdempotencyMismatchError, match="different turn"):
        store.commit_turn(conv, other, ["z"], idempotency_key="k1")
    assert dump(store) == before


def test_a_server_that_reuses_response_ids_needs_keys(store: ConversationStore, conv: str) -> None:
    first = make_turn([("c1", "f", "{}")], response_id="chatcmpl-123")
    second = make_turn([("c2", "g", "{}")], response_id="chatcmpl-123")
    store.commit_turn(conv, first, ["1"])
    with pytest.raises(IdempotencyMismatchError, match="idempotency_key"):
        store.commit_turn(conv, second, ["2"])
    store.commit_turn(conv, second, ["2"], idempotency_key="request-2")
    assert not store.commit_turn(conv, second, ["2"], idempotency_key="request-2").created
    assert [m["content"] for m in store.history(conv) if m["role"] == "tool"] == ["1", "2"]


def test_an_empty_response_id_identifies_nothing(store: ConversationStore, conv: str) -> None:
    turn = make_turn([("c1", "f", "{}")], response_id="")
    store.commit_turn(conv, turn, ["1"])
    assert store.commit_turn(conv, turn, ["1"]).created
    assert len(store.history(conv)) == 5


def test_stale_expected_seq_raises_a_retryable_conflict(
    store: ConversationStore, conv: str
) -> None:
    seq = store.next_seq(conv)
    assert seq == 1
    store.append(conv, [{"role": "user", "content": "hurry"}], expected_seq=seq)
    before = dump(store)
    with pytest.raises(ConflictError) as caught:
        store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"], expected_seq=seq)
    assert caught.value.retryable
    assert (caught.value.expected_seq, caught.value.actual_seq) == (1, 2)
    assert dump(store) == before
    with pytest.raises(ConflictError):
        store.append(conv, [{"role": "user", "content": "late"}], expected_seq=seq)
    assert store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"], expected_seq=2).seq == 2


# -- plain messages -------------------------------------------------------------------------------
def test_append_plain_messages(store: ConversationStore) -> None:
    cid = store.create_conversation()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": None, "refusal": "No."},
    ]
    assert store.append(cid, messages) == 5
    assert store.history(cid) == messages
    assert store.append(cid, []) == 5


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "tool", "tool_call_id": "x", "content": "r"}, "commit_turn"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
            "with tool calls",
        ),
        ({"role": "function", "content": "x"}, "role 'function'"),
        ({"role": "user"}, "no content"),
        ({"role": "user", "content": "x", "audio": {}}, "audio"),
        ({"role": "user", "content": 5}, "content must be"),
        ("hello", "not a dict"),
    ],
)
def test_append_rejects_what_cannot_go_to_history(
    store: ConversationStore, conv: str, message: Any, match: str
) -> None:
    before = dump(store)
    with pytest.raises(InvalidMessageError, match=match):
        store.append(conv, [{"role": "user", "content": "ok"}, message])
    assert dump(store) == before


# -- conversations, attempts, deletion ------------------------------------------------------------
def test_conversation_lifecycle(store: ConversationStore) -> None:
    cid = store.create_conversation("c1", metadata={"user": "ann"})
    with pytest.raises(ConversationExistsError):
        store.create_conversation("c1")
    assert store.create_conversation("c1", exist_ok=True) == "c1"
    with pytest.raises(ConversationNotFoundError):
        store.history("nope")
    with pytest.raises(ConversationNotFoundError):
        store.append("nope", [{"role": "user", "content": "x"}])
    with pytest.raises(ConversationNotFoundError):
        store.commit_turn("nope", make_turn(), ["r"])
    assert store.history(cid) == []
    assert store.history(cid, last=3) == []
    for bad in ("", "x" * 256):
        with pytest.raises(InvalidConversationIdError):
            store.create_conversation(bad)


def test_attempts_keep_every_call_and_the_anomalies(store: ConversationStore, conv: str) -> None:
    chunks = [
        {
            "id": "resp-x",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "ok", "function": {"name": "f", "arguments": "{}"}},
                            {
                                "index": 1,
                                "id": "cut",
                                "function": {"name": "g", "arguments": '{"a'},
                            },
                        ]
                    },
                    "finish_reason": None,
                }
            ],
        },
        {
            "id": "resp-x",
            "choices": [{"index": 0, "delta": {"content": "late"}, "finish_reason": "length"}],
        },
        {
            "id": "resp-x",
            "choices": [{"index": 0, "delta": {"content": "after"}, "finish_reason": None}],
        },
    ]
    result = parse(chunks)
    assert not result.complete and result.anomalies
    before_history = store.history(conv)
    [attempt_id] = store.record_attempt(conv, result)
    assert store.history(conv) == before_history
    [attempt] = store.attempts(conv)
    assert attempt["id"] == attempt_id and attempt["at_seq"] == 1
    assert (attempt["response_id"], attempt["model"], attempt["complete"]) == ("resp-x", "m", False)
    assert attempt["finish_reason"] == "length"
    assert [
        (c["id"], c["state"], c["reason"], c["raw_arguments"]) for c in attempt["tool_calls"]
    ] == [
        ("ok", "truncated", "length", "{}"),
        ("cut", "truncated", "length", '{"a'),
    ]
    assert {a["kind"] for a in attempt["anomalies"]} == {a.kind for a in result.anomalies}


def test_attempt_of_a_stream_without_choices(store: ConversationStore, conv: str) -> None:
    result = parse([b'data: {"error": {"message": "overloaded"}}\n\n'])
    assert len(store.record_attempt(conv, result)) == 1
    [attempt] = store.attempts(conv)
    assert attempt["choice"] is None and attempt["tool_calls"] == []
    assert "overloaded" in (attempt["end_reason"] or "")


def test_delete_conversation_removes_everything(store: ConversationStore, conv: str) -> None:
    store.commit_turn(conv, make_turn(TWO_CALLS), ["5", "6"])
    store.record_attempt(conv, make_turn([("c", "f", "{")], finish_reason="length"))
    other = store.create_conversation("keep")
    store.append(other, [{"role": "user", "content": "stay"}])
    assert store.delete_conversation(conv)
    assert not store.delete_conversation(conv)
    remaining = dump(store)
    assert remaining["fsm_conversations"] == [tuple(remaining["fsm_conversations"][0])]
    assert all("conv-1" not in row for rows in remaining.values() for row in rows)
    assert remaining["fsm_attempts"] == [] and remaining["fsm_attempt_calls"] == []
    assert store.history(other) == [{"role": "user", "content": "stay"}]


def test_a_writer_that_waits_too_long_gets_a_retryable_busy_error(db_url: sa.URL) -> None:
    if db_url.get_backend_name() != "sqlite":
        pytest.skip("SQLite's database-wide write lock; PostgreSQL writers wait on a row lock")
    with ConversationStore(db_url, busy_timeout=0.2) as store:
        cid = store.create_conversation()
        blocker = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        with blocker.connect() as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            with pytest.raises(StoreBusyError) as caught:
                store.append(cid, [{"role": "user", "content": "x"}])
            assert caught.value.retryable
            conn.rollback()
        blocker.dispose()
        assert store.append(cid, [{"role": "user", "content": "x"}]) == 1


def test_text_with_nul(store: ConversationStore, conv: str) -> None:
    """U+0000 and lone surrogates are stored losslessly on both engines (the codec's marked
    form on the way in, decoded on the way out): history gives back the same strings."""
    turn = make_turn([("call_\x00\ud83d", "f\x00", '{"a": "\\u0000"}')])
    store.commit_turn(conv, turn, ["r\x00\udfff"])
    store.append(conv, [{"role": "user", "content": "a\x00b\ud800", "name": "n\x00"}])
    assert store.history(conv)[-3:] == [
        turn.to_message(),
        {"role": "tool", "tool_call_id": "call_\x00\ud83d", "content": "r\x00\udfff"},
        {"role": "user", "content": "a\x00b\ud800", "name": "n\x00"},
    ]
