"""Reads: history() round-trips the real corpus byte-exact, is accepted by the ``openai``
package's request types, windows never split a tool block, and a 10,000-message conversation is
read in a bounded number of queries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from fsm import parse
from fsm.api import parse_file
from fsm.errors import IncompleteTurnError
from fsm.store import ConversationStore
from tests.helpers import CORPUS, corpus_expected, require_corpus
from tests.helpers.store import assert_blocks_whole, assert_openai_accepts, make_turn


def test_history_round_trips_every_complete_corpus_turn(store: ConversationStore) -> None:
    require_corpus()
    expected = corpus_expected()
    conv = store.create_conversation("corpus")
    committed = attempted = 0
    written: list[dict[str, Any]] = []
    for name in sorted(expected):
        result = parse_file(CORPUS / name)
        question = {"role": "user", "content": f"replay {name}"}
        store.append(conv, [question])
        written.append(question)
        for turn, want in zip(result.turns, expected[name]["choices"], strict=True):
            assert turn.complete == want["complete"], name
            calls = turn.tool_calls
            results = [f"result of {c.name} #{p} in {name}" for p, c in enumerate(calls)]
            if not turn.complete:
                with pytest.raises(IncompleteTurnError):
                    store.commit_turn(conv, turn, results)
                store.record_attempt(conv, turn)
                attempted += 1
                continue
            stored = store.commit_turn(conv, turn, results)
            written.extend(stored.messages)
            committed += 1
            # byte-exact: the assistant message is exactly what the parser would send, and the
            # ids/arguments are exactly the ones expected.json records for the file
            assert stored.messages[0] == turn.to_message(), name
            got = [
                (c["id"], c["function"]["arguments"])
                for c in stored.messages[0].get("tool_calls", [])
            ]
            assert got == [(c["id"], c["arguments"]) for c in want["tool_calls"]], name
    history = store.history(conv)
    assert committed >= 40 and attempted >= 1
    assert len(store.attempts(conv)) == attempted
    assert history == written
    assert_blocks_whole(history)
    assert_openai_accepts(history)


def test_history_is_accepted_by_openai_types(store: ConversationStore) -> None:
    conv = store.create_conversation()
    store.append(
        conv,
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"},
        ],
    )
    store.commit_turn(conv, make_turn([("", "f", "{}"), ("", "g", "")], content="c"), ["1", "2"])
    store.append(conv, [{"role": "assistant", "content": None, "refusal": "no"}])
    history = store.history(conv)
    assert_openai_accepts(history)
    with pytest.raises(ValueError):
        assert_openai_accepts([{"role": "tool", "content": "orphan"}])


def test_reasoning_only_when_asked(store: ConversationStore) -> None:
    conv = store.create_conversation()
    chunks = [
        {"id": "r", "choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
        {
            "id": "r",
            "choices": [{"index": 0, "delta": {"content": "done"}, "finish_reason": "stop"}],
        },
    ]
    turn = parse(chunks).turn(0)
    store.commit_turn(conv, turn)
    assert store.history(conv) == [turn.to_message()]
    assert store.history(conv, include_reasoning=True) == [turn.to_message(include_reasoning=True)]


# -- windows --------------------------------------------------------------------------------------
def _build(store: ConversationStore, shape: list[int]) -> str:
    """A conversation of user messages and turns: each entry is a number of tool calls
    (0 = a plain user message)."""
    conv = store.create_conversation()
    for i, n in enumerate(shape):
        if n == 0:
            store.append(conv, [{"role": "user", "content": f"u{i}"}])
        else:
            calls = [(f"id{i}_{p}", "f", "{}") for p in range(n)]
            store.commit_turn(
                conv, make_turn(calls, response_id=f"r{i}"), [f"r{p}" for p in range(n)]
            )
    return conv


@pytest.fixture
def windows_store(
    store: ConversationStore,
) -> Iterator[tuple[ConversationStore, str, list[dict[str, Any]]]]:
    conv = _build(store, [0, 3, 0, 1, 2, 0, 4, 0])
    yield store, conv, store.history(conv)


def test_windows_never_split_a_tool_block(
    windows_store: tuple[ConversationStore, str, list[dict[str, Any]]],
) -> None:
    store, conv, full = windows_store
    assert len(full) == 18
    for n in range(len(full) + 3):
        window = store.history(conv, last=n)
        assert len(window) >= min(n, len(full))
        assert window == full[len(full) - len(window) :]
        assert_blocks_whole(window)
        # the window is the smallest whole-block suffix of at least n messages (issue 12)
        start = len(full) - min(n, len(full))
        while 0 < start < len(full) and full[start]["role"] == "tool":
            start -= 1
        assert len(window) == len(full) - start
        assert n == 0 or window


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8), data=st.data()
)
def test_windows_on_random_conversations(
    shape: list[int], data: st.DataObject, windows_store: tuple[ConversationStore, str, Any]
) -> None:
    store = windows_store[0]
    conv = _build(store, shape)
    full = store.history(conv)
    n = data.draw(st.integers(min_value=0, max_value=len(full) + 1))
    window = store.history(conv, last=n)
    assert window == full[len(full) - len(window) :] and len(window) >= min(n, len(full))
    assert_blocks_whole(window)
    assert not window or window[0]["role"] != "tool"
    assert bool(window) == (n > 0)
    if len(window) > n > 0:  # grown only to reach the assistant message of a split block
        assert full[len(full) - n]["role"] == "tool"
        assert all(m["role"] == "tool" for m in window[1 : len(window) - n + 1])


def test_a_window_inside_a_final_tool_block_is_the_whole_block(store: ConversationStore) -> None:
    """The reported case (issue 12): a conversation that ends in a block of an assistant
    message with 4 calls and their 4 results; ``last=2`` used to give ``[]``."""
    conv = _build(store, [0, 4])
    full = store.history(conv)
    assert [m["role"] for m in full] == ["user", "assistant", "tool", "tool", "tool", "tool"]
    for n in (1, 2, 3, 4, 5):
        assert store.history(conv, last=n) == full[1:], n
    assert store.history(conv, last=6) == full
    assert store.history(conv, last=60) == full
    assert store.history(conv, last=0) == []


def test_async_windows_are_the_same(db_url: Any) -> None:
    import asyncio

    from fsm.store.aio import AsyncConversationStore

    with ConversationStore(db_url) as sync:
        conv = _build(sync, [0, 3, 0, 1, 2, 0, 4])
        full = sync.history(conv)
        want = {n: sync.history(conv, last=n) for n in range(len(full) + 2)}

    async def windows() -> dict[int, list[dict[str, Any]]]:
        async with AsyncConversationStore(db_url) as store:
            return {n: await store.history(conv, last=n) for n in want}

    got = asyncio.run(windows())
    assert got == want
    assert got[2] == full[-5:]  # the last 2 are results of the 4-call block: the whole block
    assert got[1] == full[-5:]


def test_last_must_be_a_non_negative_int(store: ConversationStore) -> None:
    conv = store.create_conversation()
    with pytest.raises(ValueError):
        store.history(conv, last=-1)
    with pytest.raises(ValueError):
        store.history(conv, last=True)


@pytest.mark.parametrize("last", [2**31 - 2, 2**31 - 1, 2**31, 2**63, 10**30])
def test_a_huge_last_is_the_whole_history(db_url: Any, last: int) -> None:
    """Issue 26 (10): ``last=10**30`` raised the driver's overflow; any size is the whole
    history, in the sync, bound and async stores and the CLI."""
    import asyncio

    from click.testing import CliRunner

    from fsm.cli.main import cli
    from fsm.store.aio import AsyncConversationStore

    with ConversationStore(db_url) as store:
        conv = _build(store, [0, 2, 0])
        full = store.history(conv)
        assert store.history(conv, last=last) == full
        with store.engine.begin() as conn:
            assert store.bind(conn).history(conv, last=last) == full

    async def read() -> list[Any]:
        async with AsyncConversationStore(db_url) as astore:
            return await astore.history(conv, last=last)

    assert asyncio.run(read()) == full
    db = db_url.render_as_string(hide_password=False)
    out = CliRunner().invoke(cli, ["history", "--db", db, conv, "--json", "--last", str(last)])
    if last < 2**63:
        assert out.exit_code == 0, out.output
        assert len(json.loads(out.output)) == len(full)
    else:  # the CLI's own range: a usage error, status 2, one line
        assert out.exit_code == 2 and "--last" in out.output


# -- bounded queries ------------------------------------------------------------------------------
def test_ten_thousand_messages_in_one_query(store: ConversationStore) -> None:
    conv = store.create_conversation()
    blocks = 0
    while store.next_seq(conv) < 9_000:
        store.append(conv, [{"role": "user", "content": f"q{i}"} for i in range(400)])
        n = 99
        calls = [(f"call_{blocks}_{p}", "lookup", f'{{"p": {p}}}') for p in range(n)]
        store.commit_turn(
            conv, make_turn(calls, response_id=f"r{blocks}"), [str(p) for p in range(n)]
        )
        blocks += 1
    rest = 10_000 - store.next_seq(conv)
    store.append(conv, [{"role": "user", "content": "x"} for _ in range(rest)])
    assert store.next_seq(conv) == 10_000

    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        history = store.history(conv)
        assert len(statements) == 2, statements  # messages, then tool calls
        window = store.history(conv, last=1100)
        assert len(statements) == 4, statements
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    assert len(history) == 10_000
    assert sum(len(m.get("tool_calls", [])) for m in history) == 99 * blocks
    assert_blocks_whole(history)
    assert window == history[-len(window) :] and 1100 <= len(window) <= 1100 + 99
    assert any(m.get("tool_calls") for m in window)
