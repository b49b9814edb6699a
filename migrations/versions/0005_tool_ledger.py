"""The tool ledger: pending turns and the execution of each of their calls.

Revision ID: 0005_tool_ledger
Revises: 0004_attempts_by_conversation
Create Date: 2026-12-02

Two new tables, keyed by conversation first (hash-partitionable like every fsm table):

* ``pending_turns``: a complete turn whose tools are running, outside history: its assistant
  message (content, reasoning, refusal, model, response id, choice, finish reason, usage,
  idempotency key), its number of calls, the seq it goes to (``at_seq``) and its state
  (``pending``, ``committed`` with ``committed_seq``, ``abandoned`` with a ``reason``) and
  its ``owner`` (the token of the process that began or claimed it: only it records). Key
  ``(conversation_id, id)``, ``id`` a ``bigint`` identity on PostgreSQL, the rowid on SQLite
  (with ``UNIQUE (conversation_id, id)``). At most one ``pending`` row per conversation: the
  partial unique index ``ix_pending_turns_conversation_id_pending``. A committed row's
  ``(conversation_id, committed_seq, n_calls)`` is a foreign key to its assistant message,
  indexed by ``ix_pending_turns_conversation_id_committed_seq`` (``fsm audit calls`` finds a
  call's execution through it).
* ``tool_executions``: one row per call of a pending turn (the call byte-exact, as history will
  hold it), its state (``not_started``, ``started``, ``succeeded``, ``failed``), the number of
  starts and the owner token of the latest (``started_by``), ``started_at`` / ``finished_at``,
  and the result (text or content parts) or the error text; a foreign key ``(conversation_id,
  pending_id, pending_n_calls)`` to its turn (``ON DELETE CASCADE``) and ``0 <= position <
  pending_n_calls``.

Checks pin what each state carries, the same on both engines; SQLite also pins its types
(``ck_<table>_types``). The downgrade drops both tables (and the ledger with them).

Revisions import nothing from fsm: the SQL below is the text ``fsm/store/models.py`` builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005_tool_ledger"
down_revision: str | Sequence[str] | None = "0004_attempts_by_conversation"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NOW = sa.text("CURRENT_TIMESTAMP")

_PENDING_STATE = (
    "(state = 'pending' AND resolved_at IS NULL AND reason IS NULL AND committed_seq IS NULL)"
    " OR (state = 'committed' AND resolved_at IS NOT NULL AND reason IS NULL"
    " AND committed_seq IS NOT NULL)"
    " OR (state = 'abandoned' AND resolved_at IS NOT NULL AND reason IS NOT NULL"
    " AND committed_seq IS NULL)"
)
_EXECUTION_STATE = (
    "(state = 'not_started' AND starts = 0 AND started_at IS NULL AND finished_at IS NULL"
    " AND result IS NULL AND result_parts IS NULL AND error IS NULL)"
    " OR (state = 'started' AND starts > 0 AND started_at IS NOT NULL AND finished_at IS NULL"
    " AND result IS NULL AND result_parts IS NULL AND error IS NULL)"
    " OR (state = 'succeeded' AND starts > 0 AND started_at IS NOT NULL"
    " AND finished_at IS NOT NULL AND error IS NULL"
    " AND (result IS NULL) <> (result_parts IS NULL))"
    " OR (state = 'failed' AND starts > 0 AND started_at IS NOT NULL"
    " AND finished_at IS NOT NULL AND error IS NOT NULL"
    " AND result IS NULL AND result_parts IS NULL)"
)
_PENDING_TYPES = (
    "typeof(id) = 'integer' AND typeof(at_seq) = 'integer' AND typeof(n_calls) = 'integer'"
    " AND (choice IS NULL OR typeof(choice) = 'integer')"
    " AND (committed_seq IS NULL OR typeof(committed_seq) = 'integer')"
    " AND typeof(conversation_id) = 'text' AND typeof(state) = 'text'"
    " AND typeof(created_at) = 'text' AND typeof(owner) = 'text'"
    " AND (resolved_at IS NULL OR typeof(resolved_at) = 'text')"
    " AND (reason IS NULL OR typeof(reason) = 'text')"
    " AND (content IS NULL OR typeof(content) = 'text')"
    " AND (reasoning IS NULL OR typeof(reasoning) = 'text')"
    " AND (refusal IS NULL OR typeof(refusal) = 'text')"
    " AND (model IS NULL OR typeof(model) = 'text')"
    " AND (response_id IS NULL OR typeof(response_id) = 'text')"
    " AND (finish_reason IS NULL OR typeof(finish_reason) = 'text')"
    " AND (idempotency_key IS NULL OR typeof(idempotency_key) = 'text')"
    " AND (usage IS NULL OR (typeof(usage) = 'text' AND json_valid(usage)))"
)
_EXECUTION_TYPES = (
    "typeof(pending_id) = 'integer' AND typeof(position) = 'integer'"
    " AND typeof(pending_n_calls) = 'integer' AND typeof(starts) = 'integer'"
    " AND (provider_index IS NULL OR typeof(provider_index) = 'integer')"
    " AND (typeof(repaired) = 'integer' AND repaired IN (0, 1))"
    " AND (typeof(legacy) = 'integer' AND legacy IN (0, 1))"
    " AND typeof(conversation_id) = 'text' AND typeof(call_id) = 'text'"
    " AND typeof(type) = 'text' AND typeof(name) = 'text' AND typeof(arguments) = 'text'"
    " AND typeof(state) = 'text'"
    " AND (raw_arguments IS NULL OR typeof(raw_arguments) = 'text')"
    " AND (started_by IS NULL OR typeof(started_by) = 'text')"
    " AND (started_at IS NULL OR typeof(started_at) = 'text')"
    " AND (finished_at IS NULL OR typeof(finished_at) = 'text')"
    " AND (result IS NULL OR typeof(result) = 'text')"
    " AND (error IS NULL OR typeof(error) = 'text')"
    " AND (result_parts IS NULL OR (typeof(result_parts) = 'text' AND json_valid(result_parts)))"
)
_SQLITE_NAME = "trim(name, ' ' || char(9, 10, 13)) <> ''"
_PG_NAME = r"btrim(name, E' \t\r\n') <> ''"


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        key: list[Any] = [
            sa.Column("id", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("id", name=op.f("pk_pending_turns")),
            sa.UniqueConstraint(
                "conversation_id", "id", name=op.f("uq_pending_turns_conversation_id_id")
            ),
            sa.CheckConstraint(_PENDING_TYPES, name=op.f("ck_pending_turns_types")),
        ]
    else:
        key = [
            sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
            sa.PrimaryKeyConstraint("conversation_id", "id", name=op.f("pk_pending_turns")),
        ]
    op.create_table(
        "pending_turns",
        sa.Column("conversation_id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(9), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("at_seq", sa.Integer(), nullable=False),
        sa.Column("committed_seq", sa.Integer(), nullable=True),
        sa.Column("content", sa.Text(), nullable=True),
        sa.Column("reasoning", sa.Text(), nullable=True),
        sa.Column("refusal", sa.Text(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("response_id", sa.Text(), nullable=True),
        sa.Column("choice", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("n_calls", sa.Integer(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        *key,
        sa.UniqueConstraint(
            "conversation_id",
            "id",
            "n_calls",
            name=op.f("uq_pending_turns_conversation_id_id_n_calls"),
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_pending_turns_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "committed_seq", "n_calls"],
            ["messages.conversation_id", "messages.seq", "messages.n_calls"],
            name="fk_pending_turns_committed",
        ),
        sa.CheckConstraint(
            "state IN ('pending', 'committed', 'abandoned')",
            name=op.f("ck_pending_turns_pending_state"),
        ),
        sa.CheckConstraint(_PENDING_STATE, name=op.f("ck_pending_turns_resolution")),
        sa.CheckConstraint("n_calls >= 0 AND at_seq >= 0", name=op.f("ck_pending_turns_counts")),
    )
    op.create_index(
        "ix_pending_turns_conversation_id_pending",
        "pending_turns",
        ["conversation_id"],
        unique=True,
        sqlite_where=sa.text("state = 'pending'"),
        postgresql_where=sa.text("state = 'pending'"),
    )
    op.create_index("ix_pending_turns_state_created_at", "pending_turns", ["state", "created_at"])
    # the committed turn of an assistant message (``fsm audit calls`` joins it), and the foreign
    # key's referencing side
    op.create_index(
        "ix_pending_turns_conversation_id_committed_seq",
        "pending_turns",
        ["conversation_id", "committed_seq"],
    )
    pending_id = sa.Integer() if sqlite else sa.BigInteger()
    checks: list[Any] = (
        [
            sa.CheckConstraint(_SQLITE_NAME, name=op.f("ck_tool_executions_name")),
            sa.CheckConstraint(_EXECUTION_TYPES, name=op.f("ck_tool_executions_types")),
        ]
        if sqlite
        else [sa.CheckConstraint(_PG_NAME, name=op.f("ck_tool_executions_name"))]
    )
    op.create_table(
        "tool_executions",
        sa.Column("conversation_id", sa.String(255), nullable=False),
        sa.Column("pending_id", pending_id, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("pending_n_calls", sa.Integer(), nullable=False),
        sa.Column("call_id", sa.Text(), nullable=False),
        sa.Column("provider_index", sa.Integer(), nullable=True),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("raw_arguments", sa.Text(), nullable=True),
        sa.Column("repaired", sa.Boolean(), nullable=False),
        sa.Column("legacy", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(11), nullable=False),
        sa.Column("starts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("started_by", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("result_parts", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint(
            "conversation_id", "pending_id", "position", name=op.f("pk_tool_executions")
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "pending_id", "pending_n_calls"],
            ["pending_turns.conversation_id", "pending_turns.id", "pending_turns.n_calls"],
            name="fk_tool_executions_pending",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint(
            "position >= 0 AND position < pending_n_calls",
            name=op.f("ck_tool_executions_position"),
        ),
        sa.CheckConstraint(
            "state IN ('not_started', 'started', 'succeeded', 'failed')",
            name=op.f("ck_tool_executions_execution_state"),
        ),
        sa.CheckConstraint(_EXECUTION_STATE, name=op.f("ck_tool_executions_outcome")),
        sa.CheckConstraint(
            "(repaired AND raw_arguments IS NOT NULL) OR (NOT repaired AND raw_arguments IS NULL)",
            name=op.f("ck_tool_executions_repaired"),
        ),
        *checks,
    )
    op.create_index("ix_tool_executions_state", "tool_executions", ["state"])


def downgrade() -> None:
    op.drop_index("ix_tool_executions_state", table_name="tool_executions")
    op.drop_table("tool_executions")
    op.drop_index("ix_pending_turns_conversation_id_committed_seq", table_name="pending_turns")
    op.drop_index("ix_pending_turns_state_created_at", table_name="pending_turns")
    op.drop_index("ix_pending_turns_conversation_id_pending", table_name="pending_turns")
    op.drop_table("pending_turns")
