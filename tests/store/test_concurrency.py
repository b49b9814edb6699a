"""Several processes writing to one conversation never interleave, duplicate or leave gaps.

Real concurrent writers: 4 processes x 10 turns each (a turn with 2 tool calls and their results,
followed by a user message), on SQLite (BEGIN IMMEDIATE) and PostgreSQL (row lock). In the
optimistic variant each writer reads ``next_seq`` and commits with ``expected_seq``, retrying on
:class:`ConflictError`; a retry of an already committed turn must not duplicate it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConflictError, ConversationStore
from tests.helpers.store import assert_blocks_whole, make_turn

PROCESSES = 4
TURNS = 10


def _write(url: str, conv: str, proc: int, optimistic: bool, barrier: Any) -> int:
    conflicts = 0
    with ConversationStore(url) as store:
        barrier.wait()
        for i in range(TURNS):
            calls = [
                (f"p{proc}t{i}c{k}", f"tool{k}", f'{{"p": {proc}, "t": {i}}}') for k in range(2)
            ]
            turn = make_turn(calls, response_id=f"p{proc}-t{i}")
            results = [f"p{proc}t{i}r{k}" for k in range(2)]
            if optimistic:
                while True:
                    seq = store.next_seq(conv)
                    try:
                        store.commit_turn(conv, turn, results, expected_seq=seq)
                        break
                    except ConflictError:
                        conflicts += 1
            else:
                store.commit_turn(conv, turn, results)
            # a retry after a lost acknowledgement: must write nothing
            assert not store.commit_turn(conv, turn, results).created
            store.append(conv, [{"role": "user", "content": f"p{proc} after t{i}"}])
    return conflicts


def _child(url: str, conv: str, proc: int, optimistic: bool, barrier: Any, queue: Any) -> None:
    code = 0
    try:
        queue.put(_write(url, conv, proc, optimistic, barrier))
    except BaseException as exc:  # report, then leave without running the parent's cleanup
        queue.put(f"{type(exc).__name__}: {exc}")
        code = 1
    finally:
        queue.close()
        queue.join_thread()  # flush the report before leaving
        os._exit(code)


@pytest.mark.parametrize("optimistic", [False, True], ids=["locking", "expected_seq"])
def test_concurrent_writers(store: ConversationStore, db_url: sa.URL, optimistic: bool) -> None:
    conv = store.create_conversation()
    url = db_url.render_as_string(hide_password=False)
    store.engine.dispose()  # no connection of ours may be inherited by the children
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(PROCESSES)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(url, conv, p, optimistic, barrier, queue))
        for p in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    reports = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert all(isinstance(r, int) for r in reports), reports
    assert all(proc.exitcode == 0 for proc in procs)

    history = store.history(conv)
    assert len(history) == PROCESSES * TURNS * 4
    assert_blocks_whole(history)
    with store.engine.connect() as conn:
        seqs = [
            row[0]
            for row in conn.execute(
                sa.text("SELECT seq FROM fsm_messages WHERE conversation_id = :c ORDER BY seq"),
                {"c": conv},
            )
        ]
    assert seqs == list(range(len(history)))  # dense, no gaps, no duplicates
    turns_seen: dict[int, list[int]] = {p: [] for p in range(PROCESSES)}
    for at, message in enumerate(history):
        calls = message.get("tool_calls")
        if not calls:
            continue
        proc, turn = map(int, re.fullmatch(r"p(\d+)t(\d+)c0", calls[0]["id"]).groups())  # type: ignore[union-attr]
        turns_seen[proc].append(turn)
        # the turn's own results follow it, with the content given for each call
        assert [m["content"] for m in history[at + 1 : at + 3]] == [
            f"p{proc}t{turn}r{k}" for k in range(2)
        ]
    assert turns_seen == {p: list(range(TURNS)) for p in range(PROCESSES)}
