"""The tool ledger's two machines are data (``fsm.states``: ``LEDGER_TURN_TRANSITIONS``,
``EXECUTION_TRANSITIONS``), and the store follows them: every (state, trigger) pair of each
machine tried on a real store, on both engines; what the table allows happens and leads where the
table says, what it refuses is a ``LedgerStateError`` (or, for a resolving step retried, returns
the turn as it is); the schema's state checks and the manual's diagrams are built from the same
lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fsm.states import (
    EXECUTION_STATES,
    EXECUTION_TRANSITIONS,
    LEDGER_TURN_STATES,
    LEDGER_TURN_TRANSITIONS,
    execution_next,
    ledger_diagram,
    ledger_turn_next,
)
from fsm.store import ConversationStore, LedgerStateError, PendingTurn
from fsm.store.models import EXECUTION_STATES as SCHEMA_EXECUTION_STATES
from fsm.store.models import PENDING_STATES
from tests.helpers import docs_extension
from tests.helpers.store import make_turn

CALLS = (("call_a", "pay", '{"invoice": 1}'),)

#: How to bring call 0 of a fresh pending turn into each execution state.
TO_EXECUTION: dict[str, Callable[[ConversationStore, PendingTurn], PendingTurn]] = {
    "not_started": lambda store, p: p,
    "started": lambda store, p: store.started(p, 0),
    "succeeded": lambda store, p: store.succeeded(store.started(p, 0), 0, "paid"),
    "failed": lambda store, p: store.failed(store.started(p, 0), 0, "declined"),
}

#: Each execution trigger, as the store's step (with an outcome other than any recorded).
EXECUTION_STEPS: dict[str, Callable[[ConversationStore, PendingTurn], PendingTurn]] = {
    "start": lambda store, p: store.started(p, 0),
    "succeed": lambda store, p: store.succeeded(p, 0, "another result"),
    "fail": lambda store, p: store.failed(p, 0, "another error"),
}


def _pending(store: ConversationStore, cid: str = "c1") -> PendingTurn:
    store.create_conversation(cid)
    store.append(cid, [{"role": "user", "content": "pay"}])
    return store.begin(cid, make_turn(CALLS))


def test_the_tables_cover_their_states_and_the_schema_checks_them() -> None:
    assert set(PENDING_STATES) == set(LEDGER_TURN_STATES)
    assert set(SCHEMA_EXECUTION_STATES) == set(EXECUTION_STATES)
    for states, table in (
        (LEDGER_TURN_STATES, LEDGER_TURN_TRANSITIONS),
        (EXECUTION_STATES, EXECUTION_TRANSITIONS),
    ):
        for _trigger, sources, dest in table:
            assert set(sources) <= set(states) and dest in states
    assert set(TO_EXECUTION) == set(EXECUTION_STATES)
    assert set(EXECUTION_STEPS) == {t for t, _, _ in EXECUTION_TRANSITIONS}


@pytest.mark.parametrize("state", EXECUTION_STATES)
@pytest.mark.parametrize("trigger", [t for t, _, _ in EXECUTION_TRANSITIONS])
def test_every_execution_state_and_trigger(
    store: ConversationStore, state: str, trigger: str
) -> None:
    pending = TO_EXECUTION[state](store, _pending(store))
    assert pending.executions[0].state == state
    dest = execution_next(state, trigger)
    if dest is None:
        with pytest.raises(LedgerStateError, match=r"never started|already"):
            EXECUTION_STEPS[trigger](store, pending)
        after = store.pending("c1")
        assert after is not None and after.executions[0].state == state  # nothing changed
    else:
        assert EXECUTION_STEPS[trigger](store, pending).executions[0].state == dest


def _turn_in(store: ConversationStore, state: str) -> PendingTurn:
    """A pending turn in ``state``, its one call succeeded (so that ``commit`` may run)."""
    pending = store.succeeded(store.started(_pending(store), 0), 0, "paid")
    if state == "committed":
        store.commit(pending)
    elif state == "abandoned":
        store.abandon(pending, "given up")
    return pending


#: Each pending-turn trigger, as the store's step.
TURN_STEPS: dict[str, Callable[[ConversationStore, PendingTurn], Any]] = {
    "claim": lambda store, p: store.claim(store.release(p)),
    "renew": lambda store, p: store.renew(p),
    "release": lambda store, p: store.release(p),
    "record": lambda store, p: store.failed(p, 0, "another error"),
    "commit": lambda store, p: store.commit(p),
    "abandon": lambda store, p: store.abandon(p, "given up"),
}


@pytest.mark.parametrize("state", LEDGER_TURN_STATES)
@pytest.mark.parametrize("trigger", [t for t, _, _ in LEDGER_TURN_TRANSITIONS])
def test_every_pending_turn_state_and_trigger(
    store: ConversationStore, state: str, trigger: str
) -> None:
    if state == "pending" and trigger == "record":
        # recording needs a started call with no outcome: the turn's call is made so here
        pending = store.started(_pending(store), 0)
    else:
        pending = _turn_in(store, state)
    dest = ledger_turn_next(state, trigger)
    retried = state != "pending" and state == ledger_turn_next("pending", trigger)
    if dest is not None:
        TURN_STEPS[trigger](store, pending)
        assert _state(store, pending) == dest
    elif retried:  # the same resolving step again: answered as before, nothing changes
        TURN_STEPS[trigger](store, pending)
        assert _state(store, pending) == state
    else:
        with pytest.raises(LedgerStateError, match=state):
            TURN_STEPS[trigger](store, pending)
        assert _state(store, pending) == state


def _state(store: ConversationStore, pending: PendingTurn) -> str:
    """The turn's stored state, read through the audit (resolved turns included)."""
    from fsm.store import audit

    (row,) = [
        r
        for r in audit.pending_turns(store.engine, states=LEDGER_TURN_STATES)
        if r.pending_id == pending.id
    ]
    return row.state


def test_the_manual_draws_both_machines_from_their_tables() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "states.md").read_text()
    pages = docs_extension().generated_pages()
    for machine in ("turn", "execution"):
        name = f"ledger-{machine}-diagram.md"
        assert f"```{{include}} ../_generated/{name}" in page
        assert pages[name] == f"```{{mermaid}}\n{ledger_diagram(machine)}```\n"
    assert ledger_diagram("execution").splitlines()[1:] == [
        "    [*] --> not_started",
        "    not_started --> started: start",
        "    started --> started: start",
        "    started --> succeeded: succeed",
        "    started --> failed: fail",
        "    succeeded --> [*]",
        "    failed --> [*]",
    ]
    assert "    pending --> committed: commit" in ledger_diagram("turn").splitlines()
