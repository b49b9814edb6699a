"""The tool ledger (issue 14): begin, started, succeeded/failed, commit, abandon, pending, claim,
on both engines and both stores; every step idempotent; the database's own rules."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from fsm.errors import IncompleteTurnError
from fsm.store import (
    ConflictError,
    ConversationNotFoundError,
    ConversationStore,
    LedgerStateError,
    PendingTurnError,
    TurnInProgressError,
)
from fsm.store.aio import AsyncConversationStore
from tests.helpers.store import make_turn

T = TypeVar("T")

CALLS = (
    ("call_a", "pay", '{"invoice": 1}'),
    ("call_b", "email", '{"to": "x@y"}'),
)


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


def _conv(store: ConversationStore, cid: str = "c1") -> str:
    store.create_conversation(cid)
    store.append(cid, [{"role": "user", "content": "pay and tell"}])
    return cid


def test_a_turn_through_the_ledger_lands_in_history_as_commit_turn_would(
    store: ConversationStore,
) -> None:
    cid = _conv(store)
    turn = make_turn(CALLS)
    pending = store.begin(cid, turn)
    assert pending.state == "pending" and pending.at_seq == 1
    assert [e.state for e in pending.executions] == ["not_started", "not_started"]
    assert store.pending(cid) == pending
    pending = store.started(pending, 0)
    pending = store.succeeded(pending, 0, "paid\x00 \ud800")  # lossless, as other texts
    pending = store.started(pending, turn.tool_calls[1])
    pending = store.failed(pending, turn.tool_calls[1], "SMTP down")
    ex = pending.executions
    assert [e.state for e in ex] == ["succeeded", "failed"]
    assert ex[0].starts == 1 and ex[0].started_at is not None and ex[0].finished_at is not None
    assert ex[0].result == "paid\x00 \ud800" and ex[1].error == "SMTP down"
    done = store.commit(pending)
    assert done.created and done.seq == 1
    history = store.history(cid)
    assert history[1] == turn.to_message()
    assert [m.get("content") for m in history[2:]] == ["paid\x00 \ud800", "SMTP down"]
    assert store.pending(cid) is None
    # idempotent: the same commit again returns the stored turn, writes nothing
    again = store.commit(pending)
    assert not again.created and again.seq == 1 and again.messages == done.messages
    assert store.history(cid) == history
    # the conversation takes writes again
    store.append(cid, [{"role": "user", "content": "thanks"}])


def test_every_step_is_idempotent(store: ConversationStore) -> None:
    cid = _conv(store)
    turn = make_turn(CALLS)
    pending = store.begin(cid, turn)
    # the same turn begun by another request while its owner holds it: not taken over (a begin
    # retried after a lost acknowledgement retries inside begin, with its own owner token)
    with pytest.raises(TurnInProgressError) as caught:
        store.begin(cid, turn)
    assert caught.value.owner == pending.owner and caught.value.pending_id == pending.id
    pending = store.started(pending, 0)
    assert store.started(pending, 0) == pending  # a retry: not a second start
    assert pending.executions[0].starts == 1
    pending = store.succeeded(pending, 0, "ok")
    assert store.succeeded(pending, 0, "ok") == pending
    with pytest.raises(LedgerStateError, match="another result"):
        store.succeeded(pending, 0, "different")
    with pytest.raises(LedgerStateError, match="already succeeded"):
        store.started(pending, 0)
    with pytest.raises(LedgerStateError, match="never started"):
        store.succeeded(pending, 1, "x")
    with pytest.raises(LedgerStateError, match="call 1 \\(email\\) is not_started"):
        store.commit(pending)
    pending = store.started(pending, 1)
    pending = store.failed(pending, 1, "boom")
    assert store.failed(pending, 1, "boom") == pending
    with pytest.raises(LedgerStateError, match="already failed"):
        store.succeeded(pending, 1, "boom")
    store.commit(pending)
    # begin of the committed turn again (a retry after a lost acknowledgement) returns it
    assert store.begin(cid, turn).state == "committed"
    assert len(store.history(cid)) == 4


def test_a_pending_turn_blocks_other_writes(store: ConversationStore) -> None:
    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS))
    with pytest.raises(PendingTurnError, match="blocks other writes") as caught:
        store.append(cid, [{"role": "user", "content": "x"}])
    assert isinstance(caught.value, ConflictError) and caught.value.pending_id == pending.id
    with pytest.raises(PendingTurnError):
        store.commit_turn(cid, make_turn(response_id="other"), ["r"])
    with pytest.raises(PendingTurnError, match="another turn"):
        store.begin(cid, make_turn(response_id="other"))
    abandoned = store.abandon(pending, "the user cancelled")
    assert abandoned.state == "abandoned" and abandoned.reason == "the user cancelled"
    assert store.abandon(pending, "the user cancelled") == abandoned
    with pytest.raises(LedgerStateError, match="abandoned"):
        store.commit(pending)
    with pytest.raises(LedgerStateError, match="already abandoned"):
        store.started(pending, 0)
    assert store.pending(cid) is None
    store.append(cid, [{"role": "user", "content": "again"}])
    # a new turn may be begun now; the abandoned one stays for audit
    store.begin(cid, make_turn(response_id="chatcmpl-2"))


def test_claim_is_compare_and_set_on_the_owner(store: ConversationStore) -> None:
    store.ledger_lease = 5.0
    cid = _conv(store)
    first = store.begin(cid, make_turn(CALLS))
    first = store.started(first, 0)
    store.release(first)  # the first owner is gone (as when its lease runs out)
    seen_by_a = store.pending(cid)
    seen_by_b = store.pending(cid)
    assert seen_by_a is not None and seen_by_b is not None
    a = store.claim(seen_by_a)
    with pytest.raises(TurnInProgressError):  # a holds it now
        store.claim(seen_by_b)
    store.release(a)  # a's lease ended too, but b read the turn before a claimed it
    with pytest.raises(PendingTurnError, match="claimed by another process"):
        store.claim(seen_by_b)
    # the old owner (a crashed process that came back) may no longer record
    with pytest.raises(PendingTurnError):
        store.succeeded(first, 0, "late")
    # the new owner's start of call 0 counts as a second start
    a = store.started(a, 0)
    assert a.executions[0].starts == 2
    a = store.succeeded(a, 0, "ok")
    a = store.started(a, 1)
    a = store.succeeded(a, 1, "ok")
    assert store.commit(a).created


def test_begin_takes_only_complete_turns_and_checks_the_seq(store: ConversationStore) -> None:
    cid = _conv(store)
    turn = make_turn(CALLS, finish_reason="length")
    with pytest.raises(IncompleteTurnError):
        store.begin(cid, turn)
    with pytest.raises(ConflictError):
        store.begin(cid, make_turn(CALLS), expected_seq=0)
    assert store.pending(cid) is None
    pending = store.begin(cid, make_turn(CALLS), expected_seq=1)
    with pytest.raises(ValueError, match="reason"):
        store.abandon(pending, "  ")
    with pytest.raises(LedgerStateError, match="no call at position 5"):
        store.started(pending, 5)


def test_a_turn_without_calls_commits_at_once(store: ConversationStore) -> None:
    cid = _conv(store)
    turn = make_turn((), content="the answer", finish_reason="stop")
    pending = store.begin(cid, turn)
    assert pending.executions == ()
    assert store.commit(pending).messages == [turn.to_message()]


def test_the_database_allows_one_pending_turn_per_conversation(store: ConversationStore) -> None:
    """The partial unique index holds even for a writer that skips the store's checks."""
    cid = _conv(store)
    store.begin(cid, make_turn(CALLS))
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO fsm_pending_turns (conversation_id, state, owner, at_seq, n_calls)"
                " VALUES (:c, 'pending', 'x', 1, 0)"
            ),
            {"c": cid},
        )
    # a committed row must name its assistant message; an abandoned one its reason
    for values in (
        "'committed', 'x', 1, 0, CURRENT_TIMESTAMP, NULL, 7",
        "'abandoned', 'x', 1, 0, CURRENT_TIMESTAMP, NULL, NULL",
        "'finished', 'x', 1, 0, NULL, NULL, NULL",
    ):
        with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO fsm_pending_turns (conversation_id, state, owner, at_seq, n_calls,"
                    f" resolved_at, reason, committed_seq) VALUES (:c, {values})"
                ),
                {"c": cid},
            )


def test_the_database_checks_each_execution_state(store: ConversationStore) -> None:
    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS))
    bad = [
        "state = 'succeeded'",  # no start, no finish, no result
        "state = 'started'",  # no start count
        "state = 'failed', starts = 1, started_at = CURRENT_TIMESTAMP,"
        " finished_at = CURRENT_TIMESTAMP",  # no error text
        "position = 2",  # beyond the turn's calls
        "pending_n_calls = 3",  # not its turn's count
    ]
    for change in bad:
        with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE fsm_tool_executions SET {change}"
                    " WHERE conversation_id = :c AND pending_id = :p AND position = 0"
                ),
                {"c": cid, "p": pending.id},
            )


def test_deleting_the_conversation_deletes_its_ledger(store: ConversationStore) -> None:
    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS))
    store.delete_conversation(cid)
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM fsm_pending_turns")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM fsm_tool_executions")).scalar() == 0
    with pytest.raises(ConversationNotFoundError):
        store.started(pending, 0)


def test_results_are_checked_as_commit_turn_checks_them(store: ConversationStore) -> None:
    cid = _conv(store)
    pending = store.started(store.begin(cid, make_turn(CALLS)), 0)
    with pytest.raises(Exception, match="must be a string or a dict"):
        store.succeeded(pending, 0, 5)
    parts = [{"type": "text", "text": "part"}]
    pending = store.succeeded(pending, 0, {"content": parts})
    assert pending.executions[0].result == parts
    pending = store.failed(store.started(pending, 1), 1, "no")
    assert store.commit(pending).messages[1]["content"] == parts


def test_the_async_store_has_the_same_ledger(db_url: sa.URL) -> None:
    url = db_url.render_as_string(hide_password=False)
    turn = make_turn(CALLS)

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            cid = await store.create_conversation("a1")
            await store.append(cid, [{"role": "user", "content": "go"}])
            store.ledger_lease = 5.0
            pending = await store.begin(cid, turn)
            with pytest.raises(TurnInProgressError):
                await store.begin(cid, turn)
            with pytest.raises(PendingTurnError):
                await store.append(cid, [{"role": "user", "content": "x"}])
            for call in pending.calls:
                pending = await store.started(pending, call)
                pending = await store.succeeded(pending, call, f"did {call.name}")
            seen = await store.pending(cid)
            assert seen is not None
            with pytest.raises(TurnInProgressError):  # started() renewed the lease
                await store.claim(seen)
            await store.release(pending)  # the owner is gone (as when its lease runs out)
            pending = await store.claim(seen)
            done = await store.commit(pending)
            assert done.created
            assert not (await store.commit(pending)).created
            assert await store.pending(cid) is None
            other = await store.begin(cid, make_turn(response_id="chatcmpl-9"))
            assert (await store.abandon(other, "no")).state == "abandoned"
            history = await store.history(cid)
            assert [m.get("content") for m in history[2:]] == ["did pay", "did email"]

    run(body())


def test_audit_pending_lists_pending_and_abandoned_turns_with_age(
    store: ConversationStore, db_url: sa.URL
) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fsm.store import audit

    cid = _conv(store)
    abandoned = store.begin(cid, make_turn(CALLS, response_id="r-old"))
    store.abandon(abandoned, "the user said no")
    pending = store.started(store.begin(cid, make_turn(CALLS)), 0)
    rows = audit.pending_turns(store.engine)
    assert [(r.state, r.reason, r.started, r.not_started, r.starts) for r in rows] == [
        ("abandoned", "the user said no", 0, 2, 0),
        ("pending", None, 1, 1, 1),
    ]
    assert all(r.age_seconds is not None and r.age_seconds >= 0 for r in rows)
    assert [r.pending_id for r in audit.pending_turns(store.engine, states=["pending"])] == [
        pending.id
    ]
    with pytest.raises(audit.InvalidFilterError):
        audit.pending_turns(store.engine, states=["done"])
    url = db_url.render_as_string(hide_password=False)
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "fsm", "audit", "pending", "--db", url, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert [(r["conversation_id"], r["state"], r["calls"]) for r in listed] == [
        (cid, "abandoned", 2),
        (cid, "pending", 2),
    ]


@pytest.mark.parametrize("engine_name", ["sqlite"], indirect=True)
def test_audit_check_re_verifies_the_ledger_rows(store: ConversationStore) -> None:
    """Rows written with SQLite's checks off break the ledger's rules: the check finds them."""
    from fsm.store import audit

    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS))
    assert list(audit.check(store.engine)) == []
    with store.engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA ignore_check_constraints = ON")
        conn.execute(
            sa.text(
                "UPDATE fsm_tool_executions SET state = 'succeeded', starts = -3"
                " WHERE pending_id = :p AND position = 1"
            ),
            {"p": pending.id},
        )
        conn.exec_driver_sql("PRAGMA ignore_check_constraints = OFF")
    engine = audit.open_readonly(store.engine.url)
    try:
        found = list(audit.check(engine))
    finally:
        engine.dispose()
    assert [v.kind for v in found] == ["invalid_row"], found
    assert all("the execution of call 1 (id 'call_b')" in v.detail for v in found), found
