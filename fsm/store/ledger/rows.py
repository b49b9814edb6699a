"""The rows of the tool ledger's begin and the statement that inserts them (PostgreSQL: the
pending turn with its executions in one statement, read and inserted at once in the common
case), shared by :func:`fsm.store.ledger.bodies.begin_body` and
:func:`~fsm.store.ledger.bodies.begin_at_once`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from fsm.parser import Turn
from fsm.states import execution_next
from fsm.store import plans, writes
from fsm.store.engine_config import FIRST
from fsm.store.ledger.statements import built_turn, execution_of
from fsm.store.ledger.types import PendingTurn
from fsm.store.render import stored_items
from fsm.toolcall import ToolCall

__all__ = ["begin_reading", "begin_rows", "insert_pending"]


def begin_reading(
    conversation_id: str, turn: Turn, idempotency_key: str | None
) -> tuple[str, dict[str, Any]]:
    """How begin finds an earlier ledger commit of ``turn`` (:func:`fsm.store.writes.same_turn`,
    ``"none"`` for neither: see :func:`fsm.store.writes.begin_state`), with the binds of that
    reading and the conversation (``c``)."""
    same, params = writes.same_turn(turn, idempotency_key)
    return same or "none", {"c": conversation_id, **params}


def begin_rows(
    conversation_id: str,
    turn: Turn,
    calls: Sequence[ToolCall],
    idempotency_key: str | None,
    owner: str,
    start: int | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``pending_turns`` row of ``turn`` (all but its ``at_seq``) and the
    ``tool_executions`` rows of its calls (all but the turn's keys), call ``start`` started."""
    turn_row = {
        "conversation_id": conversation_id,
        "state": "pending",
        "owner": owner,
        "content": turn.content,
        "reasoning": turn.reasoning,
        "refusal": turn.refusal,
        "model": turn.model,
        "response_id": turn.response_id or None,
        "choice": turn.index,
        "finish_reason": turn.finish_reason,
        "usage": plans.json_safe(turn.usage),
        "idempotency_key": idempotency_key,
        "n_calls": len(calls),
        **dict(zip(("format", "provider_items"), stored_items(turn), strict=True)),
    }
    # the call ``start`` is inserted started (by this owner, now): one statement less than
    # inserting it not started and starting it (the INSERT gave the turn its lease)
    call_rows = [
        {
            "position": p,
            **plans.call_columns(call),
            "legacy": call.legacy,
            "state": execution_next("not_started", "start") if p == start else "not_started",
            "starts": int(p == start),
            "started_by": owner if p == start else None,
        }
        for p, call in enumerate(calls)
    ]
    return turn_row, call_rows


def insert_pending(
    conn: Connection,
    row: dict[str, Any],
    call_rows: list[dict[str, Any]],
    start: int | None,
    lease: float,
    same: str | None = None,
    reading: dict[str, Any] | None = None,
    *,
    at_once: bool = False,
) -> tuple[PendingTurn | None, tuple[Any, ...]]:
    """PostgreSQL: the pending turn ``row`` and its executions ``call_rows`` inserted by one
    statement (:func:`fsm.store.writes.insert_pending`), the call ``start`` started: the
    :class:`PendingTurn`. With ``same`` (and the ``reading``'s binds) the statement reads the
    conversation first and inserts only in the common case: also what it read (pending id,
    done id, last seq, open slots), and ``None`` for the turn when it did not go in;
    ``at_once``: sent after the conversation's lock in one query, and only if the conversation
    exists."""
    columns = tuple(call_rows[0]) if call_rows else ()
    schema = writes.schema(conn)
    rows = conn.execute(
        writes.insert_pending(schema, tuple(row), columns, same=same, exists=at_once),
        {
            **{f"t_{column}": value for column, value in row.items()},
            **writes.turn_params("e", columns, call_rows),
            "e_started": [call["position"] == start for call in call_rows],
            "lease": float(lease),
            **(reading or {}),
        },
        execution_options={FIRST: writes.lock_first(schema, "c")} if at_once else {},
    ).all()
    first = rows[0]._mapping
    read = tuple(first[c] for c in ("p", "d", "l", "sl")) if same is not None else ()
    if first["id"] is None:
        return None, read
    executions = tuple(
        execution_of({c.name: found._mapping[f"e_{c.name}"] for c in writes.EXECUTIONS.c})
        for found in rows
        if found._mapping["e_position"] is not None
    )
    return built_turn(row["conversation_id"], first, (), handled=executions), read
