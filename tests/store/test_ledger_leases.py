"""The tool ledger's leases (issue 26, findings 1 and 7), on both engines and both stores: a live
owner keeps its turn (``claim`` raises :class:`TurnInProgressError` until its lease, renewed by
``started`` and the heartbeat, runs out on the database's clock); a claim or a begin retried
after its COMMIT's answer was lost recognises its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import (
    CommitOutcomeUnknownError,
    ConversationStore,
    LedgerStateError,
    PendingTurnError,
    StoreError,
    TurnInProgressError,
)
from fsm.store.aio import AsyncConversationStore
from tests.helpers.store import make_turn

CALLS = (
    ("call_a", "pay", '{"invoice": 1}'),
    ("call_b", "email", '{"to": "x@y"}'),
)


def _conv(store: ConversationStore, cid: str = "c1") -> str:
    store.create_conversation(cid)
    store.append(cid, [{"role": "user", "content": "pay and tell"}])
    return cid


def test_a_live_owner_keeps_its_turn(store: ConversationStore) -> None:
    """The red team's finding 1 at the store: a second process that reads the pending turn
    while its owner's tool runs cannot claim it; once the owner is gone it can."""
    store.ledger_lease = 3.0
    cid = _conv(store)
    mine = store.started(store.begin(cid, make_turn(CALLS)), 0)  # pay is running
    seen = store.pending(cid)
    assert seen is not None and seen.lease_expires_at is not None
    with pytest.raises(TurnInProgressError) as caught:
        store.claim(seen)
    error = caught.value
    assert isinstance(error, PendingTurnError) and error.retryable
    assert error.owner == mine.owner and error.pending_id == mine.id
    assert error.lease_expires_at == seen.lease_expires_at
    assert 0 < error.retry_after <= 3.0
    assert "is in progress" in str(error) and "retry after" in str(error)
    # the owner goes on, undisturbed
    mine = store.succeeded(mine, 0, "paid")
    time.sleep(error.retry_after + 0.1)  # no renewal since: the owner is gone
    seen = store.pending(cid)
    assert seen is not None
    taken = store.claim(seen)
    assert taken.owner == seen.claim_token != mine.owner
    assert taken.executions[0].state == "succeeded"  # what the owner recorded is kept
    with pytest.raises(PendingTurnError, match="claimed by another process"):
        store.started(mine, 1)  # the old owner, back, is fenced off


def test_the_heartbeat_keeps_the_turn_while_the_tool_runs(store: ConversationStore) -> None:
    store.ledger_lease = 1.5
    cid = _conv(store)
    pending = store.started(store.begin(cid, make_turn(CALLS)), 0)
    with store.heartbeat(pending):
        time.sleep(3.5)  # over two leases long
        seen = store.pending(cid)
        assert seen is not None
        with pytest.raises(TurnInProgressError):
            store.claim(seen)
    time.sleep(1.6)  # the heartbeat stopped with the body: the lease runs out
    assert store.claim(seen).owner == seen.claim_token


def test_release_ends_the_lease_and_renew_moves_it(store: ConversationStore) -> None:
    store.ledger_lease = 60.0
    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS))
    assert pending.lease_expires_at is not None and pending.created_at is not None
    # the database's clock: created_at and the lease come from the same clock
    held = (pending.lease_expires_at - pending.created_at).total_seconds()
    assert 58 <= held <= 61.5, held
    later = store.renew(pending)
    assert later >= pending.lease_expires_at
    released = store.release(pending)
    assert released.lease_expires_at is not None and released.lease_expires_at < later
    seen = store.pending(cid)
    assert seen is not None
    assert store.claim(seen).owner == seen.claim_token  # at once
    with pytest.raises(PendingTurnError):
        store.renew(pending)  # taken over
    with pytest.raises(ValueError, match="ledger_lease"):
        store.ledger_lease = 0
        store.renew(seen)


def test_a_turn_written_before_leases_can_be_claimed_at_once(store: ConversationStore) -> None:
    cid = _conv(store)
    store.begin(cid, make_turn(CALLS))
    with store.engine.begin() as conn:  # as revision 0007 left it
        conn.execute(sa.text("UPDATE fsm_pending_turns SET lease_expires_at = NULL"))
    seen = store.pending(cid)
    assert seen is not None and seen.lease_expires_at is None
    assert store.claim(seen).lease_expires_at is not None


@contextmanager
def _answer_lost(store: ConversationStore) -> Iterator[None]:
    """The next write transaction of ``store`` commits, then its caller is told the COMMIT's
    outcome is unknown (the answer of a COMMIT that was stored, lost on the way back)."""
    real = store._write  # the test stands in for the network
    lost = {"once": False}

    @contextmanager
    def write(**kwargs: Any) -> Iterator[Any]:
        with real(**kwargs) as conn:
            yield conn
        if not lost["once"]:
            lost["once"] = True
            raise CommitOutcomeUnknownError("the connection was lost while COMMIT was in flight")

    store._write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        del store._write


def test_a_claim_retried_after_its_answer_was_lost_is_its_own(store: ConversationStore) -> None:
    """Finding 7: the retry of a claim whose COMMIT was stored used to say "claimed by another
    process" about its own claim."""
    store.ledger_lease = 0.2
    cid = _conv(store)
    first = store.started(store.begin(cid, make_turn(CALLS)), 0)
    time.sleep(0.3)  # the first owner is gone
    seen = store.pending(cid)
    assert seen is not None
    store.ledger_lease = 30.0
    with _answer_lost(store), pytest.raises(CommitOutcomeUnknownError):
        store.claim(seen)
    claimed = store.claim(seen)  # the same handle: recognised as its own claim
    assert claimed.owner == seen.claim_token != first.owner
    assert claimed == store.claim(seen)
    claimed = store.succeeded(store.started(claimed, 0), 0, "paid")
    other = store.pending(cid)
    assert other is not None
    with pytest.raises(TurnInProgressError):  # another handle still cannot take it
        store.claim(other)


def test_a_begin_whose_answer_was_lost_retries_with_its_own_token(
    store: ConversationStore,
) -> None:
    cid = _conv(store)
    with _answer_lost(store):
        pending = store.begin(cid, make_turn(CALLS))  # retried inside begin
    stored = store.pending(cid)
    assert stored is not None and stored.owner == pending.owner and stored.id == pending.id
    store.started(pending, 0)  # the caller owns it


def test_a_committed_turn_cannot_be_claimed(store: ConversationStore) -> None:
    store.ledger_lease = 0.2
    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS))
    seen = store.pending(cid)
    assert seen is not None
    for call in (0, 1):
        pending = store.succeeded(store.started(pending, call), call, "ok")
    store.commit(pending)
    with pytest.raises(LedgerStateError, match="committed"):
        store.claim(seen)


def test_the_async_store_has_the_same_leases(db_url: sa.URL) -> None:
    url = db_url.render_as_string(hide_password=False)

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            store.ledger_lease = 1.5
            cid = await store.create_conversation("a1")
            await store.append(cid, [{"role": "user", "content": "go"}])
            pending = await store.started(await store.begin(cid, make_turn(CALLS)), 0)
            async with store.heartbeat(pending):
                await asyncio.sleep(3.5)
                seen = await store.pending(cid)
                assert seen is not None
                with pytest.raises(TurnInProgressError) as caught:
                    await store.claim(seen)
                assert caught.value.owner == pending.owner
            released = await store.release(pending)
            assert released.owner == pending.owner
            taken = await store.claim(seen)
            assert taken.owner == seen.claim_token
            assert (await store.claim(seen)).owner == seen.claim_token  # a retry: its own
            with pytest.raises(PendingTurnError):
                await store.renew(pending)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_audit_pending_and_check_show_the_owner(store: ConversationStore, db_url: sa.URL) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fsm.store import audit

    store.ledger_lease = 60.0
    alive = store.begin(_conv(store, "alive"), make_turn(CALLS))
    gone = store.begin(_conv(store, "gone"), make_turn(CALLS))
    store.release(gone)  # as a crashed owner's lease ends
    abandoned = store.abandon(store.begin(_conv(store, "done"), make_turn(CALLS)), "no")
    rows = {r.conversation_id: r for r in audit.pending_turns(store.engine)}
    assert rows["alive"].owner == "alive" and rows["gone"].owner == "gone"
    assert rows["done"].owner is None and abandoned.state == "abandoned"
    assert rows["alive"].lease_expires_at == alive.lease_expires_at
    url = db_url.render_as_string(hide_password=False)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def fsm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fsm", "audit", *args, "--db", url],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    listed = fsm("pending", "--json")
    assert listed.returncode == 0, listed.stderr
    shown = {r["conversation_id"]: r for r in json.loads(listed.stdout)}
    assert (shown["alive"]["owner"], shown["gone"]["owner"], shown["done"]["owner"]) == (
        "alive",
        "gone",
        None,
    )
    assert shown["alive"]["lease_expires_at"] is not None
    checked = fsm("check", "--no-progress")
    assert checked.returncode == 0, checked.stderr
    assert "2 pending turn(s) in the tool ledger: 1 with a live owner" in checked.stderr
    assert "1 whose owner is gone" in checked.stderr


@pytest.mark.parametrize("engine_name", ["postgresql"], indirect=True)
def test_a_claim_whose_answer_is_lost_on_the_wire_is_its_own(db_url: sa.URL) -> None:
    """Finding 7 with a real network fault: the fault proxy lets the claim's COMMIT reach the
    server and loses its answer (CommitOutcomeUnknownError at the store's deadline); the retry
    with the same handle finds the claim it made."""
    from sqlalchemy import event

    from tests.helpers.faults import Proxy

    url = db_url.render_as_string(hide_password=False)
    with ConversationStore(url) as direct:
        direct.ledger_lease = 0.2
        cid = _conv(direct)
        first = direct.started(direct.begin(cid, make_turn(CALLS)), 0)
    time.sleep(0.3)  # the first owner is gone
    with (
        Proxy(db_url.host or "127.0.0.1", db_url.port or 5432) as proxy,
        ConversationStore(proxy.url(url), timeout=1.0) as store,
    ):
        seen = store.pending(cid)
        assert seen is not None

        def lose_the_answer(_conn: Any) -> None:
            proxy.blackhole_replies()

        event.listen(store.engine, "commit", lose_the_answer, once=True)
        with pytest.raises(CommitOutcomeUnknownError):
            store.claim(seen)
        proxy.forward()
        claimed = store.claim(seen)
        assert claimed.owner == seen.claim_token != first.owner
        claimed = store.succeeded(store.started(claimed, 0), 0, "paid")
        assert claimed.executions[0].starts == 2


# -- fewer transactions per turn (issue 27 item 6) ---------------------------------------------------
def test_an_outcome_is_recorded_with_the_next_step(store: ConversationStore) -> None:
    """begin(start=) starts the first call, started(recording=) records the previous outcome
    with the next start, commit(recording=) the last one with the commit: a turn of two calls
    in three write transactions instead of six, with the same history and ledger rows."""
    from sqlalchemy import event

    from fsm.store.ledger import Outcome

    cid = _conv(store)
    turn = make_turn(CALLS)
    begun: list[int] = []
    event.listen(store.engine, "begin", lambda _conn: begun.append(1))
    pending = store.begin(cid, turn, start=0)
    assert [e.state for e in pending.executions] == ["started", "not_started"]
    assert pending == store.pending(cid)  # what the step returns is what is stored
    begun.clear()
    assert pending.executions[0].started_by == pending.owner
    pending = store.started(pending, 1, recording=Outcome(0, result="paid"))
    assert [e.state for e in pending.executions] == ["succeeded", "started"]
    assert len(begun) == 1
    assert pending == store.pending(cid)
    begun.clear()
    done = store.commit(pending, recording=Outcome(1, error="SMTP down"))
    assert len(begun) == 1
    assert [m.get("content") for m in store.history(cid)[2:]] == ["paid", "SMTP down"]
    assert done.created
    # a retry of each after a lost answer changes nothing
    assert not store.commit(pending, recording=Outcome(1, error="SMTP down")).created


def test_steps_given_an_older_handle_do_what_the_store_holds(store: ConversationStore) -> None:
    """The steps read only the turn's row when the handle is the latest (the common case) and
    trust its calls' states; given an older handle (a step retried after its answer was lost),
    they find the store holds more and decide on what it holds: nothing started twice, no
    outcome recorded twice or changed, the commit whole."""
    from sqlalchemy import event

    from fsm.store.ledger import Outcome

    cid = _conv(store)
    first = store.begin(cid, make_turn(CALLS), start=0)
    latest = store.started(first, 1, recording=Outcome(0, result="paid"))
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    again = store.started(first, 1, recording=Outcome(0, result="paid"))  # the retry: a no-op
    assert [(e.state, e.starts) for e in again.executions] == [("succeeded", 1), ("started", 1)]
    assert again == latest == store.pending(cid)
    with pytest.raises(LedgerStateError, match="with another result"):
        store.started(first, 1, recording=Outcome(0, result="changed"))
    statements.clear()
    done = store.commit(first, recording=Outcome(1, error="SMTP down"))  # an older handle
    assert done.created
    assert [m.get("content") for m in store.history(cid)[2:]] == ["paid", "SMTP down"]
    assert any("SELECT" in s and "fsm_tool_executions" in s for s in statements)  # it read them
    # the latest handle: the turn's row only, the calls as the handle shows them
    cid2 = _conv(store, "c2")
    pending = store.started(
        store.begin(cid2, make_turn(CALLS), start=0), 1, recording=Outcome(0, result="x")
    )
    statements.clear()
    assert store.commit(pending, recording=Outcome(1, result="y")).created
    # (PostgreSQL: the statements of its one query)
    parts = [part for s in statements for part in s.split("; ")]
    reads = [s for s in parts if s.lstrip().upper().startswith("SELECT")]
    assert not any("fsm_tool_executions" in s for s in reads), reads
    assert [m.get("content") for m in store.history(cid2)[2:]] == ["x", "y"]


def test_a_step_that_records_and_starts_in_one_statement_meets_what_the_store_holds(
    store: ConversationStore,
) -> None:
    """started(recording=...) records the outcome and starts the next call with one statement
    (on PostgreSQL the owner's lease renewed by it too): when the store holds the outcome
    already (so only the start applies) it is a no-op there, a changed outcome rolls the start
    back, and a turn claimed by another process is left as the claimer has it."""
    from fsm.store.ledger import Outcome

    cid = _conv(store)
    first = store.begin(cid, make_turn(CALLS), start=0)
    assert [(e.state, e.starts, e.started_by) for e in first.executions] == [
        ("started", 1, first.owner),
        ("not_started", 0, None),
    ]
    assert first.executions[0].started_at is not None
    store.succeeded(first, 0, "paid")  # the store holds the outcome; the handle does not
    with pytest.raises(LedgerStateError, match="with another result"):
        store.started(first, 1, recording=Outcome(0, result="changed"))
    stored = store.pending(cid)
    assert stored is not None
    assert [(e.state, e.starts) for e in stored.executions] == [
        ("succeeded", 1),
        ("not_started", 0),  # rolled back with the refused outcome
    ]
    done = store.started(first, 1, recording=Outcome(0, result="paid"))
    assert [(e.state, e.starts) for e in done.executions] == [("succeeded", 1), ("started", 1)]
    assert done == store.pending(cid)
    assert done.lease_expires_at is not None and first.lease_expires_at is not None
    assert done.lease_expires_at >= first.lease_expires_at  # renewed
    # another owner claims the turn: the old owner's step changes nothing
    cid2 = _conv(store, "c2")
    mine = store.begin(cid2, make_turn(CALLS), start=0)
    store.release(mine)
    seen = store.pending(cid2)
    assert seen is not None
    taken = store.claim(seen)
    with pytest.raises(PendingTurnError, match="claimed by another process"):
        store.started(mine, 1, recording=Outcome(0, result="paid"))
    after = store.pending(cid2)
    assert after is not None and after.owner == taken.owner
    assert after.lease_expires_at == taken.lease_expires_at
    assert [(e.state, e.starts) for e in after.executions] == [
        ("started", 1),
        ("not_started", 0),
    ]


def test_begin_and_commit_are_one_statement_each_after_the_lock(store: ConversationStore) -> None:
    """On PostgreSQL begin reads the conversation and inserts the pending turn and its
    executions with one statement (after the lock), and
    commit(recording=) records the last outcome, resolves the pending turn and writes the turn
    to history with one statement (after the conversation's lock): what they return and
    what the store then holds is what the step-by-step path gives (SQLite: one statement per
    table under its write lock)."""
    from sqlalchemy import event

    from fsm.store.ledger import Outcome

    postgres = store.engine.dialect.name == "postgresql"
    statements: list[str] = []
    event.listen(
        store.engine, "before_cursor_execute", lambda *a: statements.append(" ".join(a[2].split()))
    )
    cid = _conv(store)
    statements.clear()
    pending = store.begin(cid, make_turn(CALLS), start=1)
    writes = [s for s in statements if not s.startswith("BEGIN")]
    # PostgreSQL: one query (the settings, the lock, then the reading and the insert, only if
    # the conversation exists); SQLite: the reading, 2 inserts
    assert len(writes) == (1 if postgres else 3), writes
    if postgres:
        parts = writes[0].split("; ")
        assert parts[0].startswith("SET LOCAL ") and parts[-2].endswith("FOR UPDATE"), parts
        assert parts[-1].startswith("WITH st (x, p, d, l, sl, e) AS"), parts
    assert [(e.state, e.starts, e.started_by) for e in pending.executions] == [
        ("not_started", 0, None),
        ("started", 1, pending.owner),
    ]
    assert [e.call.name for e in pending.executions] == ["pay", "email"]
    assert pending == store.pending(cid)  # the step's answer is what is stored
    assert pending.executions[1].started_at is not None and pending.lease_expires_at is not None
    # a turn without calls
    cid2 = _conv(store, "c2")
    empty = store.begin(cid2, make_turn((), content="the answer", finish_reason="stop"))
    assert empty.executions == () and empty == store.pending(cid2)
    assert store.commit(empty).messages[0]["content"] == "the answer"

    pending = store.started(pending, 0, recording=Outcome(1, result="sent"))
    statements.clear()
    done = store.commit(pending, recording=Outcome(0, error="card declined"))
    writes = [s for s in statements if not s.startswith("BEGIN")]
    if postgres:
        # one query: the settings, the turn with the conversation's lock, then everything else
        # (only while the turn is the holder's)
        assert len(writes) == 1, writes
        parts = writes[0].split("; ")
        assert parts[-2].startswith("SELECT 1 FROM fsm_pending_turns t JOIN"), parts
        assert parts[-2].endswith("FOR UPDATE"), parts
        assert parts[-1].startswith("WITH recorded AS (UPDATE fsm_tool_executions"), parts
    else:
        assert len(writes) == 5, writes  # the outcome, 3 inserts, the resolution
    assert done.created and done.seq == 1
    assert [m.get("content") for m in done.messages] == [None, "card declined", "sent"]
    assert store.history(cid)[1:] == done.messages
    assert store.pending(cid) is None
    with store.engine.connect() as conn:
        turns = conn.execute(
            sa.text(
                "SELECT state, committed_seq, resolved_at FROM fsm_pending_turns "
                "WHERE conversation_id = 'c1'"
            )
        ).all()
        executions = conn.execute(
            sa.text(
                "SELECT state, result, error, finished_at FROM fsm_tool_executions "
                "WHERE conversation_id = 'c1' ORDER BY position"
            )
        ).all()
    assert [(state, seq) for state, seq, _ in turns] == [("committed", 1)]
    assert turns[0][2] is not None
    assert [tuple(row[:3]) for row in executions] == [
        ("failed", None, "card declined"),
        ("succeeded", "sent", None),
    ]
    assert all(row[3] is not None for row in executions)
    assert not store.commit(pending, recording=Outcome(0, error="card declined")).created


def test_a_commit_given_a_call_the_store_holds_finished_decides_on_what_it_holds(
    store: ConversationStore,
) -> None:
    """The handle shows the last call started; the store holds its outcome (recorded by a
    step whose answer was lost): the one-statement commit writes nothing and the commit goes on
    from what the store holds: the same outcome commits once, another is refused with nothing
    written."""
    from fsm.store.ledger import Outcome

    for cid, result in (("c1", "sent"), ("c2", "other")):
        pending = store.started(store.begin(_conv(store, cid), make_turn(CALLS), start=0), 1)
        pending = store.started(pending, 1, recording=Outcome(0, result="paid"))
        store.succeeded(pending, 1, "sent")  # the handle still shows call 1 started
        if result == "sent":
            done = store.commit(pending, recording=Outcome(1, result=result))
            assert done.created
            assert [m.get("content") for m in store.history(cid)[2:]] == ["paid", "sent"]
            assert store.pending(cid) is None
            continue
        with pytest.raises(LedgerStateError, match="with another result"):
            store.commit(pending, recording=Outcome(1, result=result))
        assert len(store.history(cid)) == 1  # nothing written
        stored = store.pending(cid)
        assert stored is not None and stored.state == "pending"
        assert [e.result for e in stored.executions] == ["paid", "sent"]


def test_a_commit_whose_insert_fails_keeps_the_outcome_it_recorded(
    store: ConversationStore,
) -> None:
    """A raw write takes the turn's seq while its last tool runs: the commit (the outcome, the
    resolution and the turn in one statement on PostgreSQL) fails on the schema's keys as a
    typed error, and the outcome it carried is then stored on its own; the turn stays
    pending."""
    from fsm.store.ledger import Outcome

    cid = _conv(store)
    pending = store.started(
        store.begin(cid, make_turn(CALLS), start=0), 1, recording=Outcome(0, result="paid")
    )
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO fsm_messages (conversation_id, seq, role, content, n_calls, "
                "slots_left, prev_seq, prev_slots_left) VALUES ('c1', 1, 'user', 'raw', 0, 0, 0, 0)"
            )
        )
    with pytest.raises(StoreError) as caught:
        store.commit(pending, recording=Outcome(1, result="sent"))
    assert not isinstance(caught.value, LedgerStateError), caught.value
    assert [m.get("content") for m in store.history(cid)] == ["pay and tell", "raw"]
    stored = store.pending(cid)
    assert stored is not None and stored.state == "pending"
    assert [(e.state, e.result) for e in stored.executions] == [
        ("succeeded", "paid"),
        ("succeeded", "sent"),  # recorded on its own after the failed commit
    ]


def test_a_commit_that_fails_keeps_the_outcome_it_recorded(store: ConversationStore) -> None:
    from fsm.store.ledger import Outcome

    cid = _conv(store)
    pending = store.begin(cid, make_turn(CALLS), start=0)
    with pytest.raises(LedgerStateError, match="call 1 \\(email\\) is not_started"):
        store.commit(pending, recording=Outcome(0, result="paid"))
    stored = store.pending(cid)
    assert stored is not None and stored.executions[0].result == "paid"  # kept
    with pytest.raises(LedgerStateError, match=r"begin\(start=\.\.\.\)"):
        store.begin(_conv(store, "c2"), make_turn(CALLS), start=5)


def test_the_async_store_keeps_the_outcome_of_a_commit_that_fails(db_url: sa.URL) -> None:
    from fsm.store.ledger import Outcome

    async def body() -> None:
        async with AsyncConversationStore(db_url) as store:
            cid = await store.create_conversation("c1")
            await store.append(cid, [{"role": "user", "content": "go"}])
            pending = await store.begin(cid, make_turn(CALLS), start=0)
            with pytest.raises(LedgerStateError, match="call 1 \\(email\\) is not_started"):
                await store.commit(pending, recording=Outcome(0, result="paid"))
            stored = await store.pending(cid)
            assert stored is not None and stored.executions[0].result == "paid"  # kept
            pending = await store.started(stored, 1)
            done = await store.commit(pending, recording=Outcome(1, error="SMTP down"))
            assert done.created
            history = await store.history(cid)
            assert [m.get("content") for m in history[2:]] == ["paid", "SMTP down"]

    asyncio.run(asyncio.wait_for(body(), 60))


def test_one_heartbeat_thread_keeps_every_turn_of_the_store(store: ConversationStore) -> None:
    """Two requests of one process (two conversations) hold their turns at once: the store's
    heartbeat renews both; each turn's lease ends on its own once its body ends."""
    import threading

    store.ledger_lease = 1.0
    first = store.started(store.begin(_conv(store, "a"), make_turn(CALLS)), 0)
    second = store.started(store.begin(_conv(store, "b"), make_turn(CALLS)), 0)
    before = set(threading.enumerate())  # (other stores' heartbeats linger a while)
    with store.heartbeat(first):
        with store.heartbeat(second):
            time.sleep(2.5)
            for cid in ("a", "b"):
                seen = store.pending(cid)
                assert seen is not None
                with pytest.raises(TurnInProgressError):
                    store.claim(seen)
        beats = set(threading.enumerate()) - before
        assert [t.name for t in beats] == ["fsm-ledger-heartbeat"]  # one for both turns
        time.sleep(1.2)  # b's body ended: its lease runs out; a's is still renewed
        seen_b, seen_a = store.pending("b"), store.pending("a")
        assert seen_b is not None and seen_a is not None
        assert store.claim(seen_b).owner == seen_b.claim_token
        with pytest.raises(TurnInProgressError):
            store.claim(seen_a)
