"""Issue 29, item 2: ``import_history`` takes a whole existing history in any of the three
formats, all or nothing, after the contract checks the database enforces; what it imported reads
back equal.

Real data: every complete turn of the Responses and Anthropic recordings, rendered with results as
each API takes it (``Turn.to_items`` / ``Turn.to_anthropic``) after a user message, is imported
and read back byte-equal in its own format; the Chat Completions recordings' complete turns as
chat messages likewise. Broken histories (a result for no call, a call with no result, a result
out of its slot, arguments that are not JSON) are refused with a typed error naming the message,
and nothing is written. Sync, async and bound (the caller's transaction) stores, both engines.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import fsm
from fsm.store import ConversationStore, InvalidMessageError, ResultsError
from fsm.store.aio import AsyncConversationStore
from fsm.store.audit import check
from tests.helpers import (
    FORMAT_CORPORA,
    corpus_bytes,
    corpus_params,
    need,
    recordings_of,
    require_recording,
)


def _recordings() -> list[Any]:
    return [
        pytest.param(fmt, path, id=f"{fmt}/{path.name}")
        for fmt, folder in FORMAT_CORPORA.items()
        for path in recordings_of(folder)
    ]


def _results(turn: fsm.Turn) -> list[str]:
    return [f"result of {call.name} #{n}" for n, call in enumerate(turn.tool_calls)]


def _history(fmt: str, turn: fsm.Turn) -> list[Any]:
    question = {"role": "user", "content": "a question"}
    if fmt == "responses":
        return [question, *turn.to_items(results=_results(turn))]
    return [question, *turn.to_anthropic(results=_results(turn))]


@pytest.mark.parametrize(("fmt", "path"), _recordings())
def test_a_recorded_turn_imports_and_reads_back_equal(
    store: ConversationStore, fmt: str, path: Path
) -> None:
    recorded = fsm.parse(require_recording(path, f"{fmt} recording"))
    turn = recorded.turns[0] if recorded.turns else None
    if turn is None or not turn.complete:
        pytest.skip("an incomplete turn has no history to import")
    history = _history(fmt, turn)
    cid = store.create_conversation()
    assert store.import_history(cid, history, format=fmt) == store.next_seq(cid)
    assert store.history(cid, format=fmt) == history
    assert list(check(store.engine)) == []


@pytest.mark.parametrize("name", corpus_params())
def test_a_recorded_chat_turn_imports_and_reads_back_equal(
    store: ConversationStore, name: str | None
) -> None:
    recorded = fsm.parse(corpus_bytes(need(name)))
    if len(recorded.turns) != 1 or not recorded.turns[0].complete:
        pytest.skip("one complete choice makes one history")
    turn = recorded.turns[0]
    history = [
        {"role": "user", "content": "a question"},
        turn.to_message(),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": result}
            for call, result in zip(turn.tool_calls, _results(turn), strict=True)
        ),
    ]
    cid = store.create_conversation()
    store.import_history(cid, history)
    assert store.history(cid) == history


def _call(cid: str, name: str = "add", arguments: str = '{"a": 1}') -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "1 + 2 and 3 * 4?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_a"), _call("call_b", "mul")]},
    {"role": "tool", "tool_call_id": "call_a", "content": "3"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12"},
    {"role": "assistant", "content": "3 and 12"},
    {"role": "user", "content": [{"type": "text", "text": "and 5 + 5?"}]},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_c")]},
    {"role": "tool", "tool_call_id": "call_c", "content": "10"},
]


def test_a_chat_history_imports_whole_and_reads_back_equal(store: ConversationStore) -> None:
    cid = store.create_conversation()
    assert store.import_history(cid, CHAT) == len(CHAT)
    assert store.history(cid) == CHAT
    # more history goes on after it as usual, at the seq import_history returned
    store.append(cid, [{"role": "user", "content": "thanks"}], expected_seq=len(CHAT))


def _broken(*changes: tuple[int, Any]) -> list[Any]:
    history = [dict(m) for m in CHAT]
    for index, value in sorted(changes, reverse=True):
        if value is None:
            del history[index]
        else:
            history[index] = value
    return history


BROKEN = {
    "a result for no call": (
        _broken((1, {"role": "tool", "tool_call_id": "call_z", "content": "?"})),
        ResultsError,
        "message 1 is a result for call 'call_z'",
    ),
    "a call with no result": (_broken((4, None)), ResultsError, "message 2: call 'call_b'"),
    "results out of their slots": (
        _broken(
            (3, {"role": "tool", "tool_call_id": "call_b", "content": "12"}),
            (4, {"role": "tool", "tool_call_id": "call_a", "content": "3"}),
        ),
        ResultsError,
        "message 3 answers call 'call_b', but its slot is call 'call_a'",
    ),
    "a call cut short": (
        _broken((7, {"role": "assistant", "tool_calls": [_call("call_c", arguments='{"a": ')]})),
        InvalidMessageError,
        "message 7 cannot go to history: call 'call_c' (add) is truncated",
    ),
    "a call without a name": (
        _broken((7, {"role": "assistant", "tool_calls": [_call("call_c", name="")]})),
        InvalidMessageError,
        "message 7",
    ),
    "a message that is no message": (_broken((5, "hello")), InvalidMessageError, "message 5"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_history_is_refused_whole_naming_the_message(
    store: ConversationStore, case: str
) -> None:
    history, error, says = BROKEN[case]
    cid = store.create_conversation()
    with pytest.raises(error, match=re.escape(says)):
        store.import_history(cid, history)
    assert store.history(cid) == []


def test_a_failure_in_the_database_writes_nothing(store: ConversationStore) -> None:
    """A check made in the transaction (the seq another writer moved: ``expected_seq``) refuses
    the whole import: the transaction is rolled back, nothing of it is written."""
    cid = store.create_conversation()
    store.append(cid, [{"role": "user", "content": "already here"}])
    with pytest.raises(fsm.store.ConflictError):
        store.import_history(cid, CHAT, expected_seq=0)
    assert len(store.history(cid)) == 1


RESPONSES = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": [{"type": "input_text", "text": "1 + 2?"}]},
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "add",
        "arguments": '{"a": 1, "b": 2}',
        "status": "completed",
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "3"},
    {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "3", "annotations": []}],
    },
]

ANTHROPIC = [
    {"role": "user", "content": "1 + 2?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Adding."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}},
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "3"}]},
]


@pytest.mark.parametrize(("fmt", "history"), [("responses", RESPONSES), ("anthropic", ANTHROPIC)])
def test_each_format_imports_and_reads_back_equal(
    store: ConversationStore, fmt: str, history: list[Any]
) -> None:
    cid = store.create_conversation()
    store.import_history(cid, history, format=fmt)
    assert store.history(cid, format=fmt) == history
    # and it is one history: readable in Chat Completions too, calls linked
    chat = store.history(cid)
    assert [m["tool_call_id"] for m in chat if m["role"] == "tool"] == [
        "call_1" if fmt == "responses" else "toolu_1"
    ]


def test_an_anthropic_result_for_another_call_is_refused(store: ConversationStore) -> None:
    history = [dict(m) for m in ANTHROPIC]
    history[2] = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "3"}],
    }
    cid = store.create_conversation()
    with pytest.raises(ResultsError, match=re.escape("message 2 answers call 'toolu_9'")):
        store.import_history(cid, history, format="anthropic")
    assert store.history(cid) == []


def test_a_responses_output_for_no_call_is_refused(store: ConversationStore) -> None:
    history = [RESPONSES[1], {"type": "function_call_output", "call_id": "call_1", "output": "3"}]
    cid = store.create_conversation()
    with pytest.raises(ResultsError, match=re.escape("message 1 is a result for call 'call_1'")):
        store.import_history(cid, history, format="responses")


def test_the_bound_store_imports_in_the_callers_transaction(store: ConversationStore) -> None:
    cid = store.create_conversation()
    with store.engine.connect() as conn:
        with conn.begin():
            store.bind(conn).import_history(cid, CHAT)
            conn.execute(sa.text("SELECT 1"))
        with conn.begin() as rolled_back:
            store.bind(conn).import_history(cid, [{"role": "user", "content": "gone"}])
            rolled_back.rollback()
    assert store.history(cid) == CHAT


def test_the_async_store_imports_the_same(db_url: sa.URL) -> None:
    async def run() -> list[Any]:
        async with AsyncConversationStore(db_url) as astore:
            cid = await astore.create_conversation()
            await astore.import_history(cid, ANTHROPIC, format="anthropic")
            return await astore.history(cid, format="anthropic")

    pytest.importorskip("aiosqlite")
    assert asyncio.run(run()) == ANTHROPIC
