"""The store's schema: typed SQLAlchemy models whose constraints enforce the history contract.

History is two tables. ``messages`` holds every message of every conversation, one row each,
numbered by ``seq`` (0, 1, 2, ... per conversation); ``tool_calls`` holds the calls of assistant
messages, one row each. A tool result is a ``messages`` row with role ``tool`` that points at its
call's row. ``attempts`` and ``attempt_calls`` keep incomplete turns for audit; they are never
part of history.

How the database itself enforces the contract of ``spec/store.md`` (the same on SQLite and
PostgreSQL, with no triggers: only keys, foreign keys and checks):

* **Dense seq, nothing between an assistant message and its results.** Every row with
  ``seq > 0`` carries ``prev_seq = seq - 1`` and ``prev_slots_left``, a foreign key to the
  previous row's ``(seq, slots_left)``. ``slots_left`` counts the result slots still open after a
  row: an assistant row opens ``n_calls`` slots, each tool row fills one
  (``slots_left = prev_slots_left - 1``), any other row has ``0``. A tool row needs an open slot
  before it (``prev_slots_left > 0``); any other row needs none (``prev_slots_left = 0``). So a
  row cannot skip a seq, a user/system/assistant row cannot sit inside a tool block, and a tool
  row cannot follow a closed block. Deleting or renumbering a row that has a successor breaks
  the successor's foreign key and is rejected.
* **A result sits in its slot and answers its own call.** A tool row carries
  ``(assistant_seq, call_position, tool_call_id)``, a foreign key to its call's row
  ``(assistant_seq, position, call_id)`` in the same conversation, and a check
  ``seq = assistant_seq + 1 + call_position``. The text ``tool_call_id`` is part of the key, so it
  must equal the call's id byte for byte (``""`` and repeated ids are fine: the link is the row).
  A second result for a call would need the same slot (unique ``seq``).
* **A call belongs to an assistant message of its conversation**: ``tool_calls`` has a foreign key
  ``(conversation_id, assistant_seq, assistant_n_calls)`` to the message's ``(seq, n_calls)`` and
  a check ``0 <= position < assistant_n_calls``; only assistant rows have ``n_calls > 0``.
* **Only finished calls**: ``tool_calls.state`` is checked to be ``finished``.
* **A block is complete when the transaction commits**: an assistant row with calls carries
  ``block_end_seq = seq + n_calls`` and a *deferred* foreign key to that row, checked at COMMIT.
  By the rules above that row can only be its last result, so a transaction that leaves an
  assistant message without all its results cannot commit.

On SQLite, foreign keys are enforced only on connections with ``PRAGMA foreign_keys=ON``; the
store's engine (:func:`fsm.store.engine.create_engine`) always sets it. Checks and unique keys
hold on every connection.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fsm.states import ToolCallState

__all__ = [
    "NAMING_CONVENTION",
    "ROLE",
    "TOOL_CALL_STATE",
    "Attempt",
    "AttemptCall",
    "Base",
    "Conversation",
    "Message",
    "ToolCallRow",
]

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of the store; its ``metadata`` is what Alembic compares against."""

    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: sa.JSON(none_as_null=True),
        list[Any]: sa.JSON(none_as_null=True),
    }


#: the tool-call state, mapped once (a VARCHAR with a CHECK of the allowed values).
TOOL_CALL_STATE = sa.Enum(
    ToolCallState,
    name="tool_call_state",
    native_enum=False,
    create_constraint=True,
    length=12,
    values_callable=lambda states: [s.value for s in states],
    validate_strings=True,
)

#: the message role, mapped once.
ROLE = sa.Enum(
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    name="role",
    native_enum=False,
    create_constraint=True,
    length=9,
)

_NOW = sa.text("CURRENT_TIMESTAMP")


def _partial(condition: str) -> dict[str, Any]:
    """Index options for a partial index (same predicate on both engines)."""
    return {"sqlite_where": sa.text(condition), "postgresql_where": sa.text(condition)}


class Conversation(Base):
    """A conversation: the owner of messages and attempts (deleting it deletes them)."""

    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)
    meta: Mapped[dict[str, Any] | None] = mapped_column()


class Message(Base):
    """One history message. Structural columns (``n_calls`` onwards) carry the contract."""

    __tablename__ = "messages"

    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(primary_key=True)
    role: Mapped[str] = mapped_column(ROLE)
    #: the text content; ``content_parts`` holds a list content instead (never both).
    content: Mapped[str | None] = mapped_column(sa.Text)
    content_parts: Mapped[list[Any] | None] = mapped_column()
    name: Mapped[str | None] = mapped_column(sa.Text)
    refusal: Mapped[str | None] = mapped_column(sa.Text)
    reasoning: Mapped[str | None] = mapped_column(sa.Text)
    model: Mapped[str | None] = mapped_column(sa.Text)
    response_id: Mapped[str | None] = mapped_column(sa.Text)
    choice: Mapped[int | None] = mapped_column()
    finish_reason: Mapped[str | None] = mapped_column(sa.String(64))
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    idempotency_key: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)

    #: assistant: the number of tool calls; every other role: 0.
    n_calls: Mapped[int] = mapped_column(server_default=sa.text("0"))
    #: result slots still open after this row (see the module docstring).
    slots_left: Mapped[int] = mapped_column(server_default=sa.text("0"))
    prev_seq: Mapped[int | None] = mapped_column()
    prev_slots_left: Mapped[int | None] = mapped_column()
    #: tool rows: the call answered, by its assistant's seq, its position and its id text.
    tool_call_id: Mapped[str | None] = mapped_column(sa.Text)
    assistant_seq: Mapped[int | None] = mapped_column()
    call_position: Mapped[int | None] = mapped_column()
    #: assistant rows with calls: the seq of the last result (``seq + n_calls``).
    block_end_seq: Mapped[int | None] = mapped_column()

    __table_args__ = (
        sa.UniqueConstraint("conversation_id", "seq", "slots_left"),
        sa.UniqueConstraint("conversation_id", "seq", "n_calls"),
        sa.ForeignKeyConstraint(
            ["conversation_id", "prev_seq", "prev_slots_left"],
            ["messages.conversation_id", "messages.seq", "messages.slots_left"],
            name="fk_messages_prev",
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "assistant_seq", "call_position", "tool_call_id"],
            [
                "tool_calls.conversation_id",
                "tool_calls.assistant_seq",
                "tool_calls.position",
                "tool_calls.call_id",
            ],
            name="fk_messages_result_call",
            use_alter=True,
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "block_end_seq"],
            ["messages.conversation_id", "messages.seq"],
            name="fk_messages_block_end",
            deferrable=True,
            initially="DEFERRED",
        ),
        sa.CheckConstraint("seq >= 0", name="seq"),
        sa.CheckConstraint("content IS NULL OR content_parts IS NULL", name="one_content"),
        sa.CheckConstraint(
            "n_calls >= 0 AND (role = 'assistant' OR n_calls = 0)",
            name="n_calls",
        ),
        sa.CheckConstraint(
            "slots_left >= 0 AND slots_left = CASE role"
            " WHEN 'assistant' THEN n_calls"
            " WHEN 'tool' THEN prev_slots_left - 1"
            " ELSE 0 END",
            name="slots_left",
        ),
        sa.CheckConstraint(
            "(seq = 0 AND prev_seq IS NULL AND prev_slots_left IS NULL)"
            " OR (seq > 0 AND prev_seq IS NOT NULL AND prev_seq = seq - 1"
            " AND prev_slots_left IS NOT NULL"
            " AND ((role = 'tool' AND prev_slots_left > 0)"
            " OR (role <> 'tool' AND prev_slots_left = 0)))",
            name="prev",
        ),
        sa.CheckConstraint(
            "(role = 'tool' AND tool_call_id IS NOT NULL AND assistant_seq IS NOT NULL"
            " AND call_position IS NOT NULL AND call_position >= 0"
            " AND seq = assistant_seq + 1 + call_position)"
            " OR (role <> 'tool' AND tool_call_id IS NULL AND assistant_seq IS NULL"
            " AND call_position IS NULL)",
            name="result_slot",
        ),
        sa.CheckConstraint(
            "(role = 'assistant' AND n_calls > 0 AND block_end_seq IS NOT NULL"
            " AND block_end_seq = seq + n_calls)"
            " OR ((role <> 'assistant' OR n_calls = 0) AND block_end_seq IS NULL)",
            name="block_end",
        ),
        sa.Index("ix_messages_conversation_id_prev_seq", "conversation_id", "prev_seq"),
        sa.Index(
            "ix_messages_conversation_id_assistant_seq_call_position",
            "conversation_id",
            "assistant_seq",
            "call_position",
            unique=True,
            **_partial("assistant_seq IS NOT NULL"),
        ),
        sa.Index(
            "ix_messages_conversation_id_block_end_seq",
            "conversation_id",
            "block_end_seq",
            **_partial("block_end_seq IS NOT NULL"),
        ),
        # not unique: some servers reuse response ids, and their users need idempotency keys
        sa.Index(
            "ix_messages_conversation_id_response_id_choice",
            "conversation_id",
            "response_id",
            "choice",
            **_partial("response_id IS NOT NULL"),
        ),
        sa.Index(
            "ix_messages_conversation_id_idempotency_key",
            "conversation_id",
            "idempotency_key",
            unique=True,
            **_partial("idempotency_key IS NOT NULL"),
        ),
        # audit (migration 0002): calls by model in key order, and by time, through their
        # assistant message; partial, so plain messages pay nothing for them
        sa.Index(
            "ix_messages_model_conversation_id_seq",
            "model",
            "conversation_id",
            "seq",
            **_partial("role = 'assistant'"),
        ),
        sa.Index("ix_messages_created_at", "created_at", **_partial("role = 'assistant'")),
    )


class ToolCallRow(Base):
    """A finished tool call of an assistant message in history."""

    __tablename__ = "tool_calls"

    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    assistant_seq: Mapped[int] = mapped_column(primary_key=True)
    #: 0-based place in the assistant message's ``tool_calls``.
    position: Mapped[int] = mapped_column(primary_key=True)
    assistant_n_calls: Mapped[int] = mapped_column()
    #: the provider's id, byte-exact (may be ``""``, may repeat).
    call_id: Mapped[str] = mapped_column(sa.Text)
    #: the provider's ``index`` for the call, if it sent one.
    provider_index: Mapped[int | None] = mapped_column()
    type: Mapped[str] = mapped_column(sa.String(64))
    name: Mapped[str] = mapped_column(sa.Text)
    #: the arguments sent back in history, byte-exact.
    arguments: Mapped[str] = mapped_column(sa.Text)
    #: the provider's arguments when opt-in repair appended to them, else NULL.
    raw_arguments: Mapped[str | None] = mapped_column(sa.Text)
    repaired: Mapped[bool] = mapped_column()
    state: Mapped[ToolCallState] = mapped_column(TOOL_CALL_STATE)

    __table_args__ = (
        sa.UniqueConstraint("conversation_id", "assistant_seq", "position", "call_id"),
        sa.ForeignKeyConstraint(
            ["conversation_id", "assistant_seq", "assistant_n_calls"],
            ["messages.conversation_id", "messages.seq", "messages.n_calls"],
            name="fk_tool_calls_assistant",
        ),
        sa.CheckConstraint("position >= 0 AND position < assistant_n_calls", name="position"),
        sa.CheckConstraint("state = 'finished'", name="finished"),
        sa.CheckConstraint(
            "(repaired AND raw_arguments IS NOT NULL) OR (NOT repaired AND raw_arguments IS NULL)",
            name="repaired",
        ),
        sa.Index("ix_tool_calls_name", "name"),
        # audit (migration 0002): the calls of one tool in key order (a LIMIT stops early)
        sa.Index(
            "ix_tool_calls_name_conversation_id_assistant_seq_position",
            "name",
            "conversation_id",
            "assistant_seq",
            "position",
        ),
    )


class Attempt(Base):
    """One choice of a response that was recorded for audit (typically an incomplete turn)."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)
    #: the conversation's next seq when the attempt was recorded (where it would have gone).
    at_seq: Mapped[int] = mapped_column()
    response_id: Mapped[str | None] = mapped_column(sa.Text)
    choice: Mapped[int | None] = mapped_column()
    model: Mapped[str | None] = mapped_column(sa.Text)
    finish_reason: Mapped[str | None] = mapped_column(sa.String(64))
    complete: Mapped[bool] = mapped_column()
    #: how the stream ended (``done``, ``eof``, ``error``, ``aborted``, ...) and why.
    end_how: Mapped[str | None] = mapped_column(sa.String(64))
    end_reason: Mapped[str | None] = mapped_column(sa.Text)
    content: Mapped[str | None] = mapped_column(sa.Text)
    reasoning: Mapped[str | None] = mapped_column(sa.Text)
    refusal: Mapped[str | None] = mapped_column(sa.Text)
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    #: the parser's anomalies: a list of ``{"kind", "detail", "choice"}`` objects.
    anomalies: Mapped[list[Any]] = mapped_column()

    # audit (migration 0002): attempts in key order, and failures by model and by time
    __table_args__ = (
        sa.Index("ix_attempts_conversation_id_at_seq_id", "conversation_id", "at_seq", "id"),
        sa.Index("ix_attempts_model", "model"),
        sa.Index("ix_attempts_created_at", "created_at"),
    )


class AttemptCall(Base):
    """A tool call of an attempt, in whatever final state it reached."""

    __tablename__ = "attempt_calls"

    attempt_id: Mapped[int] = mapped_column(
        sa.ForeignKey("attempts.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(primary_key=True)
    provider_index: Mapped[int | None] = mapped_column()
    call_id: Mapped[str] = mapped_column(sa.Text)
    type: Mapped[str] = mapped_column(sa.String(64))
    name: Mapped[str] = mapped_column(sa.Text)
    arguments: Mapped[str] = mapped_column(sa.Text)
    raw_arguments: Mapped[str | None] = mapped_column(sa.Text)
    repaired: Mapped[bool] = mapped_column()
    state: Mapped[ToolCallState] = mapped_column(TOOL_CALL_STATE)
    #: why the call is truncated or aborted.
    reason: Mapped[str | None] = mapped_column(sa.Text)

    __table_args__ = (
        sa.CheckConstraint("position >= 0", name="position"),
        # audit (migration 0002): calls of attempts by tool, state and reason
        sa.Index("ix_attempt_calls_name", "name"),
        sa.Index("ix_attempt_calls_state", "state"),
        sa.Index("ix_attempt_calls_reason", "reason"),
    )
