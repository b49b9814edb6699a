"""Audit queries over the conversation store: plain functions that return rows.

.. code-block:: python

    from fsm.store import audit

    engine = audit.open_readonly("sqlite:///chat.db")       # refuses every write
    for call in audit.tool_calls(engine, name="get_weather", args=[("city", "Paris")]):
        print(call.conversation_id, call.seq, call.arguments, call.result)
    print(audit.failure_counts(engine))                       # by model, state and reason
    print(audit.stats(engine).models)                         # calls, tokens, incomplete share
    bad = list(audit.check(engine))                           # [] when the contract holds

Every function takes an :class:`~sqlalchemy.engine.Engine` (a connection is opened for the call
and closed when the result is consumed) or a :class:`~sqlalchemy.engine.Connection` (used as it
is, inside the caller's transaction). None of them writes. :func:`open_readonly` opens a store so
that the database itself refuses writes.

* :func:`tool_calls` lists calls of history (state ``finished``) and of recorded attempts (any
  state), filtered by tool, state, conversation, model, time and argument content, a page at a
  time, in key order (conversation, seq, then attempts before the committed turn at the same
  seq, position). Pages continue with ``after=row.key`` (keyset) or ``offset``.
* :func:`failures` lists the failed turns of recorded attempts: each truncated or aborted call
  with its reason and anomalies, and each attempt without one (a provider's error event, a text
  turn cut by ``length``, a stream cut before any call) as a row of its own, with the attempt's
  reason (:func:`attempt_reason`); :func:`failure_counts` groups them by model, state and
  reason.
* :func:`pending_turns` lists the tool ledger's pending and abandoned turns with their age and
  their calls' executions;
* :func:`stats` counts calls per tool, per model and per day, tokens from the assistant messages'
  usage, and the share of incomplete turns per model.
* :func:`check` re-verifies the whole history contract of ``spec/store.md`` and every rule the
  database enforces (keys, foreign keys, checks, column types) with set-based SQL over batches
  of conversations, streaming :class:`Violation` rows (see :data:`VIOLATION_KINDS`): a database
  edited with its enforcement switched off is reported, never called clean.

The package, one module per job (everything public is re-exported here):

* :mod:`~fsm.store.audit.read`: :func:`open_readonly`, one connection per call, and reading any
  committed value (values selected raw and read leniently: a store edited with its enforcement
  off never makes a query fail);
* :mod:`~fsm.store.audit.filters`: the one :class:`~fsm.store.audit.filters.Filters` type every
  query takes, checked before any I/O, and its SQL (times, states, JSON paths, substrings);
* :mod:`~fsm.store.audit.calls`: :func:`tool_calls`;
* :mod:`~fsm.store.audit.failed`: :func:`failures`, :func:`failure_counts`;
* :mod:`~fsm.store.audit.summary`: :func:`stats`;
* :mod:`~fsm.store.audit.integrity`: :func:`check`, :data:`VIOLATION_KINDS`.

The audit's errors (:class:`AuditError`, :class:`DatabaseNotFoundError`,
:class:`InvalidFilterError`) live in :mod:`fsm.store.errors` with the store's others.
"""

from __future__ import annotations

from fsm.store.audit.calls import CallKey, CallRow, call_key, tool_calls
from fsm.store.audit.failed import (
    FailureCount,
    FailureRow,
    attempt_reason,
    failure_counts,
    failure_key,
    failures,
)
from fsm.store.audit.filters import ArgFilter, parse_json_path
from fsm.store.audit.integrity import VIOLATION_KINDS, Violation, check
from fsm.store.audit.pending import LEDGER_STATES, PendingRow, pending_turns
from fsm.store.audit.read import Bind, open_readonly
from fsm.store.audit.summary import TOKEN_MAX, DayStat, ModelStat, Stats, ToolStat, stats
from fsm.store.errors import AuditError, DatabaseNotFoundError, InvalidFilterError

__all__ = [
    "LEDGER_STATES",
    "TOKEN_MAX",
    "VIOLATION_KINDS",
    "ArgFilter",
    "AuditError",
    "Bind",
    "CallKey",
    "CallRow",
    "DatabaseNotFoundError",
    "DayStat",
    "FailureCount",
    "FailureRow",
    "InvalidFilterError",
    "ModelStat",
    "PendingRow",
    "Stats",
    "ToolStat",
    "Violation",
    "attempt_reason",
    "call_key",
    "check",
    "failure_counts",
    "failure_key",
    "failures",
    "open_readonly",
    "parse_json_path",
    "pending_turns",
    "stats",
    "tool_calls",
]
