"""Indexes of the audit queries (``fsm.store.audit``).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

* ``messages (model, conversation_id, seq)`` and ``messages (created_at)``, both partial on
  ``role = 'assistant'``: tool calls filtered by model (in key order, so a page stops early) or by
  time, reached through their assistant message; plain messages (most rows) are not indexed.
* ``tool_calls (name, conversation_id, assistant_seq, position)``: the calls of one tool in key
  order (``ix_tool_calls_name`` of 0001 stays: dropping it is not this revision's business).
* ``attempts (conversation_id, at_seq, id)``: the calls of attempts in key order;
  ``attempts (model)``, ``attempts (created_at)``, ``attempt_calls (name)``,
  ``attempt_calls (state)``, ``attempt_calls (reason)``: calls of attempts by model, time,
  tool, state and reason.

Indexes only: no table is rewritten, and the same statements serve SQLite and PostgreSQL.
Revisions import nothing from fsm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _partial(condition: str) -> dict[str, Any]:
    return {"sqlite_where": sa.text(condition), "postgresql_where": sa.text(condition)}


_ASSISTANT = "role = 'assistant'"

#: (name, table, columns, options), created in this order and dropped in reverse.
_INDEXES: list[tuple[str, str, list[str], dict[str, Any]]] = [
    (
        "ix_messages_model_conversation_id_seq",
        "messages",
        ["model", "conversation_id", "seq"],
        _partial(_ASSISTANT),
    ),
    ("ix_messages_created_at", "messages", ["created_at"], _partial(_ASSISTANT)),
    (
        "ix_tool_calls_name_conversation_id_assistant_seq_position",
        "tool_calls",
        ["name", "conversation_id", "assistant_seq", "position"],
        {},
    ),
    (
        "ix_attempts_conversation_id_at_seq_id",
        "attempts",
        ["conversation_id", "at_seq", "id"],
        {},
    ),
    ("ix_attempts_model", "attempts", ["model"], {}),
    ("ix_attempts_created_at", "attempts", ["created_at"], {}),
    ("ix_attempt_calls_name", "attempt_calls", ["name"], {}),
    ("ix_attempt_calls_state", "attempt_calls", ["state"], {}),
    ("ix_attempt_calls_reason", "attempt_calls", ["reason"], {}),
]


def upgrade() -> None:
    for name, table, columns, options in _INDEXES:
        op.create_index(name, table, columns, **options)


def downgrade() -> None:
    for name, table, _columns, _options in reversed(_INDEXES):
        op.drop_index(name, table_name=table)
