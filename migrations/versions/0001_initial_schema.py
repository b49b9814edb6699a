"""Initial schema: conversations, messages, tool_calls, attempts, attempt_calls.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

The history contract is carried by keys, foreign keys and checks only (no triggers), the same on
SQLite and PostgreSQL; see ``fsm/store/models.py`` for what each constraint guarantees.
``messages`` and ``tool_calls`` reference each other: SQLite accepts a foreign key to a table
created later, PostgreSQL gets that one key with ALTER TABLE once both tables exist.

Revisions import nothing from fsm: they must keep working when the models change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROLES = ("system", "developer", "user", "assistant", "tool")
_STATES = ("opened", "accumulating", "finished", "truncated", "aborted")
_NOW = sa.text("CURRENT_TIMESTAMP")


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _role() -> sa.Enum:
    return sa.Enum(*_ROLES, name="role", native_enum=False, create_constraint=False, length=9)


def _state() -> sa.Enum:
    return sa.Enum(
        *_STATES, name="tool_call_state", native_enum=False, create_constraint=False, length=12
    )


def _partial(condition: str) -> dict[str, Any]:
    return {"sqlite_where": sa.text(condition), "postgresql_where": sa.text(condition)}


#: a tool result's link to its call: (messages columns) -> (tool_calls columns).
_RESULT_COLUMNS = ["conversation_id", "assistant_seq", "call_position", "tool_call_id"]
_CALL_COLUMNS = ["conversation_id", "assistant_seq", "position", "call_id"]


def _result_call_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        _RESULT_COLUMNS, [f"tool_calls.{c}" for c in _CALL_COLUMNS], name="fk_messages_result_call"
    )


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conversations")),
    )
    op.create_table(
        "messages",
        sa.Column("conversation_id", sa.String(length=255), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("role", _role(), nullable=False),
        sa.Column("content", sa.Text(), nullable=True),
        sa.Column("content_parts", sa.JSON(), nullable=True),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("refusal", sa.Text(), nullable=True),
        sa.Column("reasoning", sa.Text(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("response_id", sa.Text(), nullable=True),
        sa.Column("choice", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(length=64), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("n_calls", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("slots_left", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("prev_seq", sa.Integer(), nullable=True),
        sa.Column("prev_slots_left", sa.Integer(), nullable=True),
        sa.Column("tool_call_id", sa.Text(), nullable=True),
        sa.Column("assistant_seq", sa.Integer(), nullable=True),
        sa.Column("call_position", sa.Integer(), nullable=True),
        sa.Column("block_end_seq", sa.Integer(), nullable=True),
        sa.CheckConstraint(_in("role", _ROLES), name=op.f("ck_messages_role")),
        sa.CheckConstraint("seq >= 0", name=op.f("ck_messages_seq")),
        sa.CheckConstraint(
            "content IS NULL OR content_parts IS NULL", name=op.f("ck_messages_one_content")
        ),
        sa.CheckConstraint(
            "n_calls >= 0 AND (role = 'assistant' OR n_calls = 0)", name=op.f("ck_messages_n_calls")
        ),
        sa.CheckConstraint(
            "slots_left >= 0 AND slots_left = CASE role"
            " WHEN 'assistant' THEN n_calls"
            " WHEN 'tool' THEN prev_slots_left - 1"
            " ELSE 0 END",
            name=op.f("ck_messages_slots_left"),
        ),
        sa.CheckConstraint(
            "(seq = 0 AND prev_seq IS NULL AND prev_slots_left IS NULL)"
            " OR (seq > 0 AND prev_seq IS NOT NULL AND prev_seq = seq - 1"
            " AND prev_slots_left IS NOT NULL"
            " AND ((role = 'tool' AND prev_slots_left > 0)"
            " OR (role <> 'tool' AND prev_slots_left = 0)))",
            name=op.f("ck_messages_prev"),
        ),
        sa.CheckConstraint(
            "(role = 'tool' AND tool_call_id IS NOT NULL AND assistant_seq IS NOT NULL"
            " AND call_position IS NOT NULL AND call_position >= 0"
            " AND seq = assistant_seq + 1 + call_position)"
            " OR (role <> 'tool' AND tool_call_id IS NULL AND assistant_seq IS NULL"
            " AND call_position IS NULL)",
            name=op.f("ck_messages_result_slot"),
        ),
        sa.CheckConstraint(
            "(role = 'assistant' AND n_calls > 0 AND block_end_seq IS NOT NULL"
            " AND block_end_seq = seq + n_calls)"
            " OR ((role <> 'assistant' OR n_calls = 0) AND block_end_seq IS NULL)",
            name=op.f("ck_messages_block_end"),
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_messages_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "prev_seq", "prev_slots_left"],
            ["messages.conversation_id", "messages.seq", "messages.slots_left"],
            name="fk_messages_prev",
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "block_end_seq"],
            ["messages.conversation_id", "messages.seq"],
            name="fk_messages_block_end",
            deferrable=True,
            initially="DEFERRED",
        ),
        *([_result_call_fk()] if sqlite else []),
        sa.PrimaryKeyConstraint("conversation_id", "seq", name=op.f("pk_messages")),
        sa.UniqueConstraint(
            "conversation_id",
            "seq",
            "n_calls",
            name=op.f("uq_messages_conversation_id_seq_n_calls"),
        ),
        sa.UniqueConstraint(
            "conversation_id",
            "seq",
            "slots_left",
            name=op.f("uq_messages_conversation_id_seq_slots_left"),
        ),
    )
    op.create_index(
        "ix_messages_conversation_id_prev_seq", "messages", ["conversation_id", "prev_seq"]
    )
    op.create_index(
        "ix_messages_conversation_id_assistant_seq_call_position",
        "messages",
        ["conversation_id", "assistant_seq", "call_position"],
        unique=True,
        **_partial("assistant_seq IS NOT NULL"),
    )
    op.create_index(
        "ix_messages_conversation_id_block_end_seq",
        "messages",
        ["conversation_id", "block_end_seq"],
        **_partial("block_end_seq IS NOT NULL"),
    )
    op.create_index(
        "ix_messages_conversation_id_response_id_choice",
        "messages",
        ["conversation_id", "response_id", "choice"],
        **_partial("response_id IS NOT NULL"),
    )
    op.create_index(
        "ix_messages_conversation_id_idempotency_key",
        "messages",
        ["conversation_id", "idempotency_key"],
        unique=True,
        **_partial("idempotency_key IS NOT NULL"),
    )

    op.create_table(
        "tool_calls",
        sa.Column("conversation_id", sa.String(length=255), nullable=False),
        sa.Column("assistant_seq", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("assistant_n_calls", sa.Integer(), nullable=False),
        sa.Column("call_id", sa.Text(), nullable=False),
        sa.Column("provider_index", sa.Integer(), nullable=True),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("raw_arguments", sa.Text(), nullable=True),
        sa.Column("repaired", sa.Boolean(), nullable=False),
        sa.Column("state", _state(), nullable=False),
        sa.CheckConstraint(_in("state", _STATES), name=op.f("ck_tool_calls_tool_call_state")),
        sa.CheckConstraint("state = 'finished'", name=op.f("ck_tool_calls_finished")),
        sa.CheckConstraint(
            "position >= 0 AND position < assistant_n_calls", name=op.f("ck_tool_calls_position")
        ),
        sa.CheckConstraint(
            "(repaired AND raw_arguments IS NOT NULL) OR (NOT repaired AND raw_arguments IS NULL)",
            name=op.f("ck_tool_calls_repaired"),
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_tool_calls_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "assistant_seq", "assistant_n_calls"],
            ["messages.conversation_id", "messages.seq", "messages.n_calls"],
            name="fk_tool_calls_assistant",
        ),
        sa.PrimaryKeyConstraint(
            "conversation_id", "assistant_seq", "position", name=op.f("pk_tool_calls")
        ),
        sa.UniqueConstraint(
            "conversation_id",
            "assistant_seq",
            "position",
            "call_id",
            name=op.f("uq_tool_calls_conversation_id_assistant_seq_position_call_id"),
        ),
    )
    op.create_index("ix_tool_calls_name", "tool_calls", ["name"])
    if not sqlite:
        op.create_foreign_key(
            "fk_messages_result_call", "messages", "tool_calls", _RESULT_COLUMNS, _CALL_COLUMNS
        )

    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("at_seq", sa.Integer(), nullable=False),
        sa.Column("response_id", sa.Text(), nullable=True),
        sa.Column("choice", sa.Integer(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("finish_reason", sa.String(length=64), nullable=True),
        sa.Column("complete", sa.Boolean(), nullable=False),
        sa.Column("end_how", sa.String(length=64), nullable=True),
        sa.Column("end_reason", sa.Text(), nullable=True),
        sa.Column("content", sa.Text(), nullable=True),
        sa.Column("reasoning", sa.Text(), nullable=True),
        sa.Column("refusal", sa.Text(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("anomalies", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_attempts_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
    )
    op.create_index("ix_attempts_conversation_id", "attempts", ["conversation_id"])
    op.create_table(
        "attempt_calls",
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("provider_index", sa.Integer(), nullable=True),
        sa.Column("call_id", sa.Text(), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("raw_arguments", sa.Text(), nullable=True),
        sa.Column("repaired", sa.Boolean(), nullable=False),
        sa.Column("state", _state(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint(_in("state", _STATES), name=op.f("ck_attempt_calls_tool_call_state")),
        sa.CheckConstraint("position >= 0", name=op.f("ck_attempt_calls_position")),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_attempt_calls_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("attempt_id", "position", name=op.f("pk_attempt_calls")),
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_messages_result_call", "messages", type_="foreignkey")
    op.drop_table("attempt_calls")
    op.drop_table("attempts")
    op.drop_table("tool_calls")
    op.drop_table("messages")
    op.drop_table("conversations")
