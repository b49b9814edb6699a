"""Many processes, many turns, shared and private conversations: nothing lost, nothing extra.

``PROCESSES`` processes (default 4; ``$FSM_LOAD_PROCS``) each run ``ROUNDS`` rounds (default 15;
``$FSM_LOAD_ROUNDS``) of the soak's mixed load (:func:`bench.soak.worker`): a turn committed to
one conversation shared by all, optimistically (``expected_seq``, retried on
:class:`~fsm.store.ConflictError`); a turn committed to the process's own conversation; now and
then an idempotent retry (a lost acknowledgement), a user message, an incomplete turn refused and
recorded as an attempt, and reads of the shared history while others write. Turns carry 0 to 3
tool calls, with empty and repeated call ids.

Each process reports every (conversation, response id, seq) it got acknowledged. Then
(:func:`bench.soak.verify`): each is stored exactly once at that seq, nothing else is stored (no
duplicate, no refused turn), seqs are dense, the attempts and user messages are all there, and
:func:`fsm.store.audit.check` finds nothing. Turns/s and the conflict rate are printed (``-s``)
and recorded as properties of the test (``--junitxml``).

``test_concurrency.py`` covers one conversation under both locking modes; this file adds the
mixed load, the accounting of acknowledgements against the whole store, and the figures.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from bench.soak import run
from fsm.store import ConversationStore, audit

PROCESSES = int(os.environ.get("FSM_LOAD_PROCS", "4"))
ROUNDS = int(os.environ.get("FSM_LOAD_ROUNDS", "15"))


def test_mixed_load_loses_and_duplicates_nothing(
    store: ConversationStore,
    db_url: sa.URL,
    engine_name: str,
    record_property: Callable[[str, Any], None],
) -> None:
    url = db_url.render_as_string(hide_password=False)
    store.engine.dispose()  # no connection of ours may be inherited by the children
    summary = run(url, PROCESSES, rounds=ROUNDS, start_method="fork", run_id="load")
    print(f"\n[{engine_name}] " + "\n  ".join(summary.lines()))
    record_property("turns_per_second", round(summary.turns_per_second, 1))
    record_property("conflict_rate", round(summary.conflict_rate, 3))
    record_property("conflicts", summary.conflicts)
    record_property("p99_commit_ms", round(summary.p99_ms, 1))
    assert summary.problems == []
    # every round of every process committed two turns, each acknowledged once
    assert summary.turns == PROCESSES * ROUNDS * 2
    assert summary.retries == PROCESSES * len(range(0, ROUNDS, 3))
    assert summary.attempts == PROCESSES * len(range(2, ROUNDS, 5))
    # the conversations are whole and the store is sound, seen from a fresh connection
    history = store.history("soak-load-shared")
    assert sum(1 for m in history if m["role"] == "assistant") == PROCESSES * ROUNDS
    assert list(audit.check(store.engine)) == []
