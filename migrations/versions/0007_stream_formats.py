"""Three stream formats: a message's format and provider-only items, free-text (custom) calls.

Revision ID: 0007_stream_formats
Revises: 0005_tool_ledger
Create Date: 2026-12-02

History rows stay format-neutral (issue 17); what only one provider understands is kept beside
them:

* ``messages.format`` (nullable text): the API whose stream wrote an assistant message
  (``chat``, ``responses`` or ``anthropic``; NULL for every other row and for assistant rows
  written before this revision, which are Chat Completions). Checked by ``ck_messages_format``:
  only an assistant row has one, and only one of the three.
* ``messages.provider_items`` (nullable JSON): the assistant message's provider-only items
  verbatim, in output order (Responses reasoning items with ``encrypted_content``, Anthropic
  ``thinking`` blocks with their signatures, ``redacted_thinking``, built-in tool items), with
  each tool call and the text standing as a reference to the format-neutral row that holds
  it. Only on assistant rows (``ck_messages_format``).
* ``attempts.format`` (nullable text): the API of an attempt's stream (``ck_attempts_format``).
* ``pending_turns.format`` and ``pending_turns.provider_items`` (nullable): a turn run through
  the tool ledger keeps them until its commit writes them to its ``messages`` row (whose checks
  then apply). Plain ``ADD COLUMN`` on both engines (no SQLite rebuild of the ledger's table).
* ``ix_messages_format_conversation_id_seq``: ``fsm audit calls --format`` finds the assistant
  messages of one format through it (partial: assistant rows only).
* ``ck_tool_calls_arguments`` now exempts calls whose ``type`` is ``custom`` (a Responses
  ``custom_tool_call``: its input is free text, never JSON); every other call still has blank
  or valid JSON arguments.

SQLite pins the types of the new columns in checks of their own,
``ck_messages_format_types`` and ``ck_attempts_format_types``, so that this revision does not depend on the text of
``ck_messages_types`` (which other revisions may extend). SQLite cannot alter a check: batch
mode rebuilds ``messages``, ``tool_calls`` and ``attempts`` (foreign keys off, as ``fsm db upgrade`` has
them). The downgrade drops the columns and restores the old arguments check (a custom call whose
input is not JSON then stops it, naming the check).

Revisions import nothing from fsm: the SQL below is the text ``fsm/store/models.py`` builds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0007_stream_formats"
down_revision: str | Sequence[str] | None = "0006_token_columns"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_BLANK = "' ' || char(9, 10, 13)"
_PG_BLANK = r"E' \t\r\n'"
_SQLITE_ARGUMENTS_0003 = (
    f"trim(arguments, {_SQLITE_BLANK}) = '' OR json_valid(arguments)"
    " OR (substr(arguments, 1, 1) = char(64976)"
    r" AND instr(replace(substr(arguments, 2), '\\', char(55296)), '\0') = 0"
    r" AND json_valid(replace(replace(replace(substr(arguments, 2), '\\', char(55296)), '\u', 'x'),"
    r" char(55296), '\')))"
)
_PG_ARGUMENTS_0003 = f"btrim(arguments, {_PG_BLANK}) = '' OR fsm_json_valid(arguments)"
_SQLITE_ARGUMENTS = f"type = 'custom' OR {_SQLITE_ARGUMENTS_0003}"
_PG_ARGUMENTS = f"type = 'custom' OR {_PG_ARGUMENTS_0003}"
_FORMAT = (
    "(format IS NULL OR (role = 'assistant' AND format IN ('chat', 'responses', 'anthropic')))"
    " AND (provider_items IS NULL OR role = 'assistant')"
)
_ATTEMPT_FORMAT = "format IS NULL OR format IN ('chat', 'responses', 'anthropic')"
_ATTEMPT_FORMAT_TYPES = "(format IS NULL OR typeof(format) = 'text')"
_INDEX = "ix_messages_format_conversation_id_seq"
_FORMAT_TYPES = (
    "(format IS NULL OR typeof(format) = 'text')"
    " AND (provider_items IS NULL OR (typeof(provider_items) = 'text'"
    " AND json_valid(provider_items)))"
)


def _columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("format", sa.Text(), nullable=True),
        sa.Column("provider_items", sa.JSON(), nullable=True),
    ]


#: migration 0006's index for audit stats, on an expression: a batch rebuild of ``messages``
#: cannot reflect it, so it drops it, and each rebuild here creates it again (the text of 0006)
_STATS_INDEX = "ix_messages_stats"
_SQLITE_STATS_INDEX_DDL = (
    f"CREATE INDEX IF NOT EXISTS {_STATS_INDEX} ON messages (model, substr(created_at, 1, 10), "
    "n_calls, prompt_tokens, completion_tokens, total_tokens, usage_unreadable) "
    "WHERE role = 'assistant'"
)


def _require_foreign_keys_off() -> None:
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError(
            "revision 0007_stream_formats rebuilds SQLite tables and needs foreign keys off on "
            "the migrating connection: run it with `fsm db upgrade` or `alembic upgrade head`"
        )


@contextmanager
def _checks_off() -> Iterator[None]:
    """SQLite: a table rebuild copies every row into a table with the checks; a row that broke
    a check (written with the checks off, which ``fsm audit check`` reports) would stop the
    migration, so the copy keeps rows as they are (as migration 0006 does)."""
    op.execute("PRAGMA ignore_check_constraints = ON")
    try:
        yield
    finally:
        op.execute("PRAGMA ignore_check_constraints = OFF")


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with _checks_off():
            _sqlite_upgrade()
        return
    for column in _columns():
        op.add_column("messages", column)
        op.add_column("pending_turns", sa.Column(column.name, column.type, nullable=True))
    op.create_check_constraint(op.f("ck_messages_format"), "messages", sa.text(_FORMAT))
    op.add_column("attempts", sa.Column("format", sa.Text(), nullable=True))
    op.create_check_constraint(op.f("ck_attempts_format"), "attempts", sa.text(_ATTEMPT_FORMAT))
    _create_index()
    op.drop_constraint(op.f("ck_tool_calls_arguments"), "tool_calls", type_="check")
    op.create_check_constraint(
        op.f("ck_tool_calls_arguments"), "tool_calls", sa.text(_PG_ARGUMENTS)
    )


def _sqlite_upgrade() -> None:
    with op.batch_alter_table("messages", recreate="always") as batch:
        for column in _columns():
            batch.add_column(column)
        batch.create_check_constraint(op.f("ck_messages_format"), sa.text(_FORMAT))
        batch.create_check_constraint(op.f("ck_messages_format_types"), sa.text(_FORMAT_TYPES))
    op.execute(_SQLITE_STATS_INDEX_DDL)
    with op.batch_alter_table("tool_calls", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_tool_calls_arguments"), type_="check")
        batch.create_check_constraint(op.f("ck_tool_calls_arguments"), sa.text(_SQLITE_ARGUMENTS))
    with op.batch_alter_table("attempts", recreate="always") as batch:
        batch.add_column(sa.Column("format", sa.Text(), nullable=True))
        batch.create_check_constraint(op.f("ck_attempts_format"), sa.text(_ATTEMPT_FORMAT))
        batch.create_check_constraint(
            op.f("ck_attempts_format_types"), sa.text(_ATTEMPT_FORMAT_TYPES)
        )
    _create_index()
    for column in _columns():
        op.add_column("pending_turns", column)


def _create_index() -> None:
    where = sa.text("role = 'assistant'")
    op.create_index(
        _INDEX,
        "messages",
        ["format", "conversation_id", "seq"],
        sqlite_where=where,
        postgresql_where=where,
    )


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="messages")
    for column in reversed(_columns()):  # ALTER TABLE DROP COLUMN (SQLite 3.35+ too)
        op.execute(f"ALTER TABLE pending_turns DROP COLUMN {column.name}")
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with _checks_off():
            _sqlite_downgrade()
        return
    op.drop_constraint(op.f("ck_tool_calls_arguments"), "tool_calls", type_="check")
    op.create_check_constraint(
        op.f("ck_tool_calls_arguments"), "tool_calls", sa.text(_PG_ARGUMENTS_0003)
    )
    op.drop_constraint(op.f("ck_attempts_format"), "attempts", type_="check")
    op.drop_column("attempts", "format")
    op.drop_constraint(op.f("ck_messages_format"), "messages", type_="check")
    for column in reversed(_columns()):
        op.drop_column("messages", column.name)


def _sqlite_downgrade() -> None:
    with op.batch_alter_table("attempts", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_attempts_format_types"), type_="check")
        batch.drop_constraint(op.f("ck_attempts_format"), type_="check")
        batch.drop_column("format")
    with op.batch_alter_table("tool_calls", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_tool_calls_arguments"), type_="check")
        batch.create_check_constraint(
            op.f("ck_tool_calls_arguments"), sa.text(_SQLITE_ARGUMENTS_0003)
        )
    with op.batch_alter_table("messages", recreate="always") as batch:
        batch.drop_constraint(op.f("ck_messages_format_types"), type_="check")
        batch.drop_constraint(op.f("ck_messages_format"), type_="check")
        for column in reversed(_columns()):
            batch.drop_column(column.name)
    op.execute(_SQLITE_STATS_INDEX_DDL)
