"""The tool ledger: a complete turn is stored *pending* while its tools run, each tool's outcome
is recorded as it finishes, and ``commit`` moves it into history in one transaction.

::

    pending = store.begin(cid, turn)                      # durable: the turn and its calls
    for call in pending.calls:
        pending = store.started(pending, call)            # before the tool runs
        content = run(call)
        pending = store.succeeded(pending, call, content) # or store.failed(pending, call, text)
    done = store.commit(pending)                          # history: the existing commit path

After a crash, ``store.pending(cid)`` returns the pending turn with each call's recorded state
(``not_started``, ``started``, ``succeeded``, ``failed``) and result; ``store.claim(pending)``
makes the caller its owner (compare-and-set on the owner token: of two processes resuming the
same turn, one wins, the other gets :class:`~fsm.store.errors.PendingTurnError`). Only the
owner records.

**Leases** (issue 26). The owner holds the turn until ``lease_expires_at``, by the database's
clock (PostgreSQL's ``clock_timestamp()``, SQLite's ``'now'``: one clock for every process
that shares the database): ``begin`` and ``claim`` set it to now + :attr:`ledger_lease
<LedgerMethods.ledger_lease>` seconds, ``started`` and :meth:`~LedgerMethods.renew` move it on,
and :meth:`~LedgerMethods.heartbeat` renews it every third of the lease while the tools run.
``claim`` takes a turn over only once its lease has run out (its owner is gone); before that it
raises :class:`~fsm.store.errors.TurnInProgressError` (retryable, with ``retry_after``), so a
live owner keeps its turn. A retried ``claim`` of the same handle (after a lost COMMIT reply)
recognises its own claim: the handle carries the token it claims with. While a turn is pending, ``append`` and ``commit_turn`` on its conversation raise
:class:`~fsm.store.errors.PendingTurnError`.

Every step is its own short transaction and idempotent: repeating it after a lost
acknowledgement changes nothing (``begin`` of the same turn returns the pending one, ``started``
of a call this owner already started is a no-op, ``succeeded``/``failed`` with the recorded
outcome is a no-op and with another one raises :class:`~fsm.store.errors.LedgerStateError`,
``commit`` of a committed turn returns the stored turn, ``abandon`` with the same reason is a
no-op). The database enforces at most one pending turn per conversation (a partial unique
index) and what each state carries (checks: :mod:`fsm.store.models`).
"""

from __future__ import annotations

from fsm.store.ledger.facades import AsyncLedgerMethods, LedgerMethods
from fsm.store.ledger.types import (
    DEFAULT_LEASE,
    Execution,
    ExecutionState,
    LedgerCall,
    Outcome,
    PendingTurn,
    check_no_pending,
    pending_error,
)

__all__ = [
    "DEFAULT_LEASE",
    "AsyncLedgerMethods",
    "Execution",
    "ExecutionState",
    "LedgerCall",
    "LedgerMethods",
    "Outcome",
    "PendingTurn",
    "check_no_pending",
    "pending_error",
]
