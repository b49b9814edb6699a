"""The store's schema: typed SQLAlchemy models whose constraints enforce the history contract.

History is two tables. ``fsm_messages`` holds every message of every conversation, one row each,
numbered by ``seq`` (0, 1, 2, ... per conversation); ``fsm_tool_calls`` holds the calls of assistant
messages, one row each. A tool result is a ``fsm_messages`` row with role ``tool`` that points at its
call's row. ``fsm_attempts`` and ``fsm_attempt_calls`` keep incomplete turns for audit; they are never
part of history.

How the database itself enforces the contract of ``spec/store.md`` (the same on SQLite and
PostgreSQL, with no triggers: only keys, foreign keys and checks, and one immutable function in a
PostgreSQL check):

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
* **A call belongs to an assistant message of its conversation**: ``fsm_tool_calls`` has a foreign key
  ``(conversation_id, assistant_seq, assistant_n_calls)`` to the message's ``(seq, n_calls)`` and
  a check ``0 <= position < assistant_n_calls``; only assistant rows have ``n_calls > 0``.
* **Only finished calls**: ``fsm_tool_calls.state`` is checked to be ``finished``.
* **A block is complete when the transaction commits**: an assistant row with calls carries
  ``block_end_seq = seq + n_calls`` and a *deferred* foreign key to that row, checked at COMMIT.
  By the rules above that row can only be its last result, so a transaction that leaves an
  assistant message without all its results cannot commit.
* **Types are pinned, on SQLite too.** PostgreSQL's column types reject a value of the wrong
  type. SQLite's type affinity would store ``'5x'``, ``0.5``, ``1e300`` or a blob in an INTEGER
  column (and a blob in a TEXT one), so every SQLite table has a check ``ck_<table>_types``:
  ``typeof(x) = 'integer'`` for every integer column (``x IS NULL OR ...`` when nullable),
  ``typeof(x) = 'integer' AND x IN (0, 1)`` for booleans, ``typeof(x) = 'text'`` for text and
  ``json_valid(x)`` for JSON columns. (``STRICT`` tables would do the same, but do not accept
  SQLAlchemy's type names.)
* **Finished means more than a label.** A row of ``fsm_tool_calls`` has a non-blank name (at least
  one character other than space, tab, CR and LF: ``ck_fsm_tool_calls_name``) and arguments that are
  blank or valid JSON (``ck_fsm_tool_calls_arguments``: SQLite's ``json_valid``; on PostgreSQL the
  function ``fsm_json_valid(text)`` of migration 0003, a cast to ``json`` in an exception block).
  Arguments stored marked by :mod:`fsm.store.codec` (a split surrogate pair) are checked as the
  text they stand for. A ``system``, ``developer``, ``user`` or ``tool`` message has non-null
  content (``ck_fsm_messages_content``; a tool result may be ``""``).

Text is stored through :class:`fsm.store.codec.StoredText`: U+0000 and lone surrogates, which
neither engine can store as they are, are written in a documented lossless encoding, and JSON
columns are written by :func:`fsm.store.engine.dumps_json` (ASCII escapes, no NaN/Infinity), so
every value is valid on both engines. Conversation ids and idempotency keys are kept clean
instead (no U+0000, no surrogate, no leading U+FDD0).

**Which switches bypass this enforcement.** The database enforces all of the above on every
connection that keeps its defaults. Some switches turn parts of it off for the session (or the
table) that uses them, and rows written that way are *not* checked afterwards:

* SQLite ``PRAGMA foreign_keys=OFF`` (SQLite's default on a new connection: the store's engine,
  :func:`fsm.store.engine.create_engine`, always turns them on; the ``sqlite3`` shell and other
  programs do not) ignores every foreign key: gaps, missing results, results of no call;
* SQLite ``PRAGMA ignore_check_constraints=ON`` ignores every check: wrong types, blank names,
  invalid arguments, a tool row out of its slot;
* PostgreSQL ``SET session_replication_role = replica`` disables the triggers that carry foreign
  keys for the session, and ``ALTER TABLE ... DISABLE TRIGGER ALL`` for the table (checks stay
  on: PostgreSQL's types and checks hold in both cases);
* a constraint dropped and added back ``NOT VALID`` (PostgreSQL) is not checked against the rows
  already there.

``fsm audit check`` re-verifies every rule the database enforces, types included, and reports
what such a session let in; the store's reads (``history``, ``append``) raise
:class:`~fsm.store.errors.CorruptStoreError`, which names that command, instead of returning or
extending a broken history.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fsm.states import EXECUTION_STATES as _EXECUTION_STATES
from fsm.states import LEDGER_TURN_STATES, ToolCallState
from fsm.store.codec import StoredJSON, StoredText

__all__ = [
    "ATTEMPT_ID",
    "FORMATS",
    "NAMING_CONVENTION",
    "PG_FUNCTIONS",
    "ROLE",
    "SQLITE_ROWID_KEY",
    "STATS_INDEX",
    "STATS_INDEX_DDL",
    "TABLES",
    "TOKEN_COLUMNS",
    "TOKEN_MAX",
    "TOOL_CALL_STATE",
    "Attempt",
    "AttemptCall",
    "Base",
    "Conversation",
    "Message",
    "PendingTurnRow",
    "ToolCallRow",
    "ToolExecution",
    "sqlite_types_check",
]

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: PostgreSQL functions the checks use (created by migration 0003, and before ``create_all``).
#: ``fsm_json_valid(text)``: whether a stored text is valid JSON (a cast to ``json``, which unlike
#: ``jsonb`` accepts ``\u0000``, lone surrogate escapes and any number; a value marked by
#: :mod:`fsm.store.codec` is checked as the text it stands for). ``fsm_try_jsonb(text)``: the
#: text as ``jsonb``, or NULL when it cannot be one (invalid JSON, ``\u0000``, lone surrogate
#: escapes, numbers beyond ``numeric``, a marked value): for JSON queries over any stored value.
PG_FUNCTIONS: dict[str, str] = {
    "fsm_json_valid(text)": r"""
CREATE OR REPLACE FUNCTION fsm_json_valid(value text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL UNSAFE AS $fsm$
DECLARE
    has_nul boolean;
BEGIN
    IF value IS NULL THEN
        RETURN NULL;
    END IF;
    IF left(value, 1) = chr(64976) THEN
        -- marked by fsm.store.codec: decode, a lone surrogate standing as 'x' (valid where a
        -- raw surrogate is, inside a string, and invalid everywhere else)
        SELECT coalesce(bool_or(m[1] = '\0'), false),
               coalesce(string_agg(CASE WHEN m[1] = '\\' THEN '\'
                                        WHEN left(m[1], 2) = '\u' THEN 'x'
                                        ELSE m[1] END, '' ORDER BY n), '')
          INTO has_nul, value
          FROM regexp_matches(substr(value, 2), '\\\\|\\0|\\u[0-9a-f]{4}|[^\\]+|\\', 'g')
               WITH ORDINALITY AS r(m, n);
        IF has_nul THEN
            RETURN false;
        END IF;
    END IF;
    PERFORM value::json;
    RETURN true;
EXCEPTION WHEN others THEN
    RETURN false;
END
$fsm$""",
    "fsm_try_jsonb(text)": r"""
CREATE OR REPLACE FUNCTION fsm_try_jsonb(value text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL UNSAFE AS $fsm$
BEGIN
    IF value IS NULL OR left(value, 1) = chr(64976) THEN
        RETURN NULL;
    END IF;
    RETURN value::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END
$fsm$""",
}


class Base(DeclarativeBase):
    """Declarative base of the store; its ``metadata`` is what Alembic compares against."""

    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: StoredJSON(),
        list[Any]: StoredJSON(),
    }


for _sql in PG_FUNCTIONS.values():
    _ddl = sa.DDL(_sql)  # type: ignore[no-untyped-call]
    sa.event.listen(Base.metadata, "before_create", _ddl.execute_if(dialect="postgresql"))


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

#: ``fsm_attempts.id`` and ``fsm_attempt_calls.attempt_id``: ``bigint`` (PostgreSQL); exactly
#: ``INTEGER`` on SQLite, where only that type makes a one-column primary key the rowid.
ATTEMPT_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

#: ``Table.info`` key: on SQLite, the table's primary key is ``(column,)`` (its rowid), and its
#: model key becomes a ``UNIQUE`` constraint; see :func:`_sqlite_rowid_key`.
SQLITE_ROWID_KEY = "fsm_sqlite_rowid_key"


class AlterForeignKey(sa.ForeignKeyConstraint):
    """A ``use_alter`` foreign key whose "create inline" rule cannot be switched off.

    On PostgreSQL, ``create_all`` adds such a key with an ``ALTER TABLE``, and SQLAlchemy's
    ``AddConstraint`` then marks the constraint object "not inline" for good (its
    ``_create_rule``). SQLite has no ``ALTER ... ADD CONSTRAINT`` and writes every key inline, so
    any later ``CREATE TABLE`` of the model on SQLite in the same process (``create_all``, the
    0009 migration's copy) left the key out without a word. The rule stays ``None`` here:
    PostgreSQL still adds the key by ``ALTER`` (``use_alter``), SQLite still writes it inline."""

    @property
    def _create_rule(self) -> None:
        return None

    @_create_rule.setter
    def _create_rule(self, value: object) -> None:
        pass


@compiles(sa.PrimaryKeyConstraint, "sqlite")
def _sqlite_rowid_key(constraint: sa.PrimaryKeyConstraint, compiler: Any, **kw: Any) -> str:
    """SQLite: a table whose ``info`` has :data:`SQLITE_ROWID_KEY` gets ``PRIMARY KEY (rowid
    column)`` (so SQLite numbers its rows, with no sequence) and ``UNIQUE`` on the model's key
    (which a foreign key to it needs). Every other table compiles as usual."""
    table = constraint.table
    spec = table.info.get(SQLITE_ROWID_KEY)
    if spec is None or len(constraint.columns) == 0:
        result: str = compiler.visit_primary_key_constraint(constraint, **kw)
        return result
    rowid, unique = spec
    quote = compiler.preparer.quote
    pk_name = f"pk_{table.name}"
    uq_name = f"uq_{table.name}_{'_'.join(unique)}"
    return (
        f"CONSTRAINT {quote(pk_name)} PRIMARY KEY ({quote(rowid)}), "
        f"CONSTRAINT {quote(uq_name)} UNIQUE ({', '.join(quote(c) for c in unique)})"
    )


def _partial(condition: str) -> dict[str, Any]:
    """Index options for a partial index (same predicate on both engines)."""
    return {"sqlite_where": sa.text(condition), "postgresql_where": sa.text(condition)}


def sqlite_types_check(
    *,
    ints: Sequence[str] = (),
    nullable_ints: Sequence[str] = (),
    bools: Sequence[str] = (),
    texts: Sequence[str] = (),
    nullable_texts: Sequence[str] = (),
    jsons: Sequence[str] = (),
    nullable_jsons: Sequence[str] = (),
) -> str:
    """The SQL of a table's SQLite ``types`` check (migration 0003 builds the same text)."""
    terms = [f"typeof({c}) = 'integer'" for c in ints]
    terms += [f"({c} IS NULL OR typeof({c}) = 'integer')" for c in nullable_ints]
    terms += [f"(typeof({c}) = 'integer' AND {c} IN (0, 1))" for c in bools]
    terms += [f"typeof({c}) = 'text'" for c in texts]
    terms += [f"({c} IS NULL OR typeof({c}) = 'text')" for c in nullable_texts]
    terms += [f"(typeof({c}) = 'text' AND json_valid({c}))" for c in jsons]
    terms += [
        f"({c} IS NULL OR (typeof({c}) = 'text' AND json_valid({c})))" for c in nullable_jsons
    ]
    return " AND ".join(terms)


def _sqlite_check(sql: str, name: str) -> sa.CheckConstraint:
    check = sa.CheckConstraint(sql, name=name)
    check.ddl_if(dialect="sqlite")
    return check


def _postgres_check(sql: str, name: str) -> sa.CheckConstraint:
    check = sa.CheckConstraint(sql, name=name)
    check.ddl_if(dialect="postgresql")
    return check


#: whitespace a name may not consist of, and blank arguments may (JSON's: space, tab, LF, CR).
_SQLITE_BLANK = "' ' || char(9, 10, 13)"
_PG_BLANK = r"E' \t\r\n'"

#: ``fsm_tool_calls.name`` has at least one character that is not JSON whitespace.
SQLITE_NAME_CHECK = f"trim(name, {_SQLITE_BLANK}) <> ''"
PG_NAME_CHECK = f"btrim(name, {_PG_BLANK}) <> ''"
#: ``fsm_tool_calls.arguments`` is blank or valid JSON. On SQLite a value marked by the codec (its
#: first character U+FDD0) is checked as the text it stands for: each ``\\`` is hidden as
#: U+D800 (which no stored text holds: the codec escapes surrogates, and U+0000, the obvious
#: choice, cannot be a ``replace()`` pattern), then each remaining ``\uXXXX`` (a lone surrogate)
#: becomes ``x``, which is valid where a raw surrogate is (inside a string) and nowhere else,
#: and ``\0`` (U+0000) is never valid.
SQLITE_ARGUMENTS_CHECK = (
    f"trim(arguments, {_SQLITE_BLANK}) = '' OR json_valid(arguments)"
    " OR (substr(arguments, 1, 1) = char(64976)"
    r" AND instr(replace(substr(arguments, 2), '\\', char(55296)), '\0') = 0"
    r" AND json_valid(replace(replace(replace(substr(arguments, 2), '\\', char(55296)), '\u', 'x'),"
    r" char(55296), '\')))"
)
PG_ARGUMENTS_CHECK = f"btrim(arguments, {_PG_BLANK}) = '' OR fsm_json_valid(arguments)"
#: ``ck_fsm_tool_calls_arguments`` (migration 0007): the checks above, except for a ``custom`` call
#: (a Responses ``custom_tool_call``), whose input is free text and never JSON.
SQLITE_CALL_ARGUMENTS_CHECK = f"type = 'custom' OR {SQLITE_ARGUMENTS_CHECK}"
PG_CALL_ARGUMENTS_CHECK = f"type = 'custom' OR {PG_ARGUMENTS_CHECK}"
#: The stream formats a message may come from (``fsm_messages.format``, migration 0007).
FORMATS = ("chat", "responses", "anthropic")
#: only an assistant row has a format (one of :data:`FORMATS`) or provider items.
MESSAGE_FORMAT_CHECK = (
    "(format IS NULL OR (role = 'assistant' AND format IN ('chat', 'responses', 'anthropic')))"
    " AND (provider_items IS NULL OR role = 'assistant')"
)
#: ``fsm_attempts.format`` (migration 0007): one of :data:`FORMATS`, or NULL.
ATTEMPT_FORMAT_CHECK = "format IS NULL OR format IN ('chat', 'responses', 'anthropic')"
#: the SQLite types of the columns of migration 0007 (a check of their own).
MESSAGE_FORMAT_TYPES: dict[str, list[str]] = {
    "nullable_texts": ["format"],
    "nullable_jsons": ["provider_items"],
}
#: roles whose messages always have content (a string, possibly ``""``, or content parts).
MESSAGE_CONTENT_CHECK = (
    "role NOT IN ('system', 'developer', 'user', 'tool')"
    " OR content IS NOT NULL OR content_parts IS NOT NULL"
)


#: the columns of each table's SQLite ``types`` check, by kind (migration 0003 lists the same).
MESSAGE_TYPES: dict[str, list[str]] = {
    "ints": ["seq", "n_calls", "slots_left"],
    "nullable_ints": [
        "choice",
        "prev_seq",
        "prev_slots_left",
        "assistant_seq",
        "call_position",
        "block_end_seq",
    ],
    "texts": ["conversation_id", "role", "created_at"],
    "nullable_texts": [
        "content",
        "name",
        "refusal",
        "reasoning",
        "model",
        "response_id",
        "finish_reason",
        "idempotency_key",
        "tool_call_id",
    ],
    "nullable_jsons": ["content_parts", "usage"],
}
TOOL_CALL_TYPES: dict[str, list[str]] = {
    "ints": ["assistant_seq", "position", "assistant_n_calls"],
    "nullable_ints": ["provider_index"],
    "bools": ["repaired"],
    "texts": ["conversation_id", "call_id", "type", "name", "arguments", "state"],
    "nullable_texts": ["raw_arguments"],
}
ATTEMPT_TYPES: dict[str, list[str]] = {
    "ints": ["id", "at_seq"],
    "nullable_ints": ["choice"],
    "bools": ["complete"],
    "texts": ["conversation_id", "created_at"],
    "nullable_texts": [
        "response_id",
        "model",
        "finish_reason",
        "end_how",
        "end_reason",
        "content",
        "reasoning",
        "refusal",
        "error",
    ],
    "jsons": ["anomalies"],
    "nullable_jsons": ["usage"],
}
ATTEMPT_CALL_TYPES: dict[str, list[str]] = {
    "ints": ["attempt_id", "position"],
    "nullable_ints": ["provider_index"],
    "bools": ["repaired"],
    "texts": ["conversation_id", "call_id", "type", "name", "arguments", "state"],
    "nullable_texts": ["raw_arguments", "reason"],
    "nullable_jsons": ["result"],
}


#: the largest token count the store keeps in the token columns of ``fsm_messages`` (and that
#: ``fsm audit stats`` adds up): a count is an integer from 0 to this.
TOKEN_MAX = 10**9 - 1
#: ``fsm_messages``' token columns (migration 0006), derived from ``usage`` when the row is written:
#: each count is the usage's value when it is an integer from 0 to :data:`TOKEN_MAX`, else NULL.
TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens", "total_tokens")


def token_check(column: str, *, sqlite: bool) -> str:
    """The check of one token column (``usage_unreadable``: NULL or 1); SQLite pins its type."""
    bound = "= 1" if column == "usage_unreadable" else f"BETWEEN 0 AND {TOKEN_MAX}"
    typed = f"typeof({column}) = 'integer' AND " if sqlite else ""
    return f"{column} IS NULL OR ({typed}{column} {bound})"


#: the index ``fsm audit stats`` reads instead of the table (migration 0006): every assistant
#: message's model, UTC day, number of calls and token columns, in (model, day) order. It is
#: not a model :class:`~sqlalchemy.schema.Index`: it differs per engine (SQLite indexes the day,
#: ``substr(created_at, 1, 10)``, so the grouped scan needs no sort; PostgreSQL, which
#: aggregates by hash, keeps ``created_at`` and INCLUDEs the rest, for an index-only scan), so
#: it is created by this DDL after the table (and by the migration), and left out of Alembic's
#: comparison (``migrations/env.py``).
STATS_INDEX = "ix_fsm_messages_stats"
STATS_INDEX_DDL: dict[str, str] = {
    "sqlite": (
        f"CREATE INDEX {STATS_INDEX} ON fsm_messages (model, substr(created_at, 1, 10), n_calls, "
        "prompt_tokens, completion_tokens, total_tokens, usage_unreadable) "
        "WHERE role = 'assistant'"
    ),
    "postgresql": (
        f"CREATE INDEX {STATS_INDEX} ON fsm_messages (model, created_at) INCLUDE (n_calls, "
        "prompt_tokens, completion_tokens, total_tokens, usage_unreadable) "
        "WHERE role = 'assistant'"
    ),
}


class Conversation(Base):
    """A conversation: the owner of messages and attempts (deleting it deletes them)."""

    __tablename__ = "fsm_conversations"

    #: clean text (no U+0000, no surrogate, no leading U+FDD0): stored as it is.
    id: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)
    meta: Mapped[dict[str, Any] | None] = mapped_column()

    __table_args__ = (
        _sqlite_check(
            sqlite_types_check(texts=["id", "created_at"], nullable_jsons=["meta"]), "types"
        ),
    )


class Message(Base):
    """One history message. Structural columns (``n_calls`` onwards) carry the contract."""

    __tablename__ = "fsm_messages"

    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("fsm_conversations.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(primary_key=True)
    role: Mapped[str] = mapped_column(ROLE)
    #: the text content; ``content_parts`` holds a list content instead (never both).
    content: Mapped[str | None] = mapped_column(StoredText)
    content_parts: Mapped[list[Any] | None] = mapped_column()
    name: Mapped[str | None] = mapped_column(StoredText)
    refusal: Mapped[str | None] = mapped_column(StoredText)
    reasoning: Mapped[str | None] = mapped_column(StoredText)
    model: Mapped[str | None] = mapped_column(StoredText)
    response_id: Mapped[str | None] = mapped_column(StoredText)
    choice: Mapped[int | None] = mapped_column()
    finish_reason: Mapped[str | None] = mapped_column(StoredText)
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    #: clean text of at most 512 UTF-8 bytes: stored as it is.
    idempotency_key: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)
    #: assistant rows: the API whose stream wrote it (``chat``, ``responses``, ``anthropic``;
    #: NULL: Chat Completions, or a row of another role). Migration 0007.
    format: Mapped[str | None] = mapped_column(sa.Text)
    #: assistant rows: the provider-only items of the turn, verbatim, in output order, each
    #: tool call and the text standing as a reference (see :mod:`fsm.store.render`).
    provider_items: Mapped[list[Any] | None] = mapped_column()
    #: the usage's token counts (:data:`TOKEN_COLUMNS`, migration 0006), written with the row
    #: (:func:`fsm.store.plans.usage_columns`): what ``fsm audit stats`` adds up.
    prompt_tokens: Mapped[int | None] = mapped_column()
    completion_tokens: Mapped[int | None] = mapped_column()
    total_tokens: Mapped[int | None] = mapped_column()
    #: 1 when the row has a usage that is not a JSON object (its tokens are not counted).
    usage_unreadable: Mapped[int | None] = mapped_column()

    #: assistant: the number of tool calls; every other role: 0.
    n_calls: Mapped[int] = mapped_column(server_default=sa.text("0"))
    #: result slots still open after this row (see the module docstring).
    slots_left: Mapped[int] = mapped_column(server_default=sa.text("0"))
    prev_seq: Mapped[int | None] = mapped_column()
    prev_slots_left: Mapped[int | None] = mapped_column()
    #: tool rows: the call answered, by its assistant's seq, its position and its id text.
    tool_call_id: Mapped[str | None] = mapped_column(StoredText)
    assistant_seq: Mapped[int | None] = mapped_column()
    call_position: Mapped[int | None] = mapped_column()
    #: assistant rows with calls: the seq of the last result (``seq + n_calls``).
    block_end_seq: Mapped[int | None] = mapped_column()

    __table_args__ = (
        sa.UniqueConstraint("conversation_id", "seq", "slots_left"),
        sa.UniqueConstraint("conversation_id", "seq", "n_calls"),
        sa.ForeignKeyConstraint(
            ["conversation_id", "prev_seq", "prev_slots_left"],
            ["fsm_messages.conversation_id", "fsm_messages.seq", "fsm_messages.slots_left"],
            name="fk_fsm_messages_prev",
        ),
        AlterForeignKey(
            ["conversation_id", "assistant_seq", "call_position", "tool_call_id"],
            [
                "fsm_tool_calls.conversation_id",
                "fsm_tool_calls.assistant_seq",
                "fsm_tool_calls.position",
                "fsm_tool_calls.call_id",
            ],
            name="fk_fsm_messages_result_call",
            use_alter=True,
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "block_end_seq"],
            ["fsm_messages.conversation_id", "fsm_messages.seq"],
            name="fk_fsm_messages_block_end",
            deferrable=True,
            initially="DEFERRED",
        ),
        sa.CheckConstraint("seq >= 0", name="seq"),
        sa.CheckConstraint("content IS NULL OR content_parts IS NULL", name="one_content"),
        sa.CheckConstraint(MESSAGE_CONTENT_CHECK, name="content"),
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
        _sqlite_check(sqlite_types_check(**MESSAGE_TYPES), "types"),
        sa.CheckConstraint(MESSAGE_FORMAT_CHECK, name="format"),
        _sqlite_check(sqlite_types_check(**MESSAGE_FORMAT_TYPES), "format_types"),
        # the token columns of migration 0006 (added with their checks: SQLite cannot change
        # ck_fsm_messages_types without rebuilding the table, so each pins its own type)
        *(
            _sqlite_check(token_check(column, sqlite=True), column)
            for column in (*TOKEN_COLUMNS, "usage_unreadable")
        ),
        *(
            _postgres_check(token_check(column, sqlite=False), column)
            for column in (*TOKEN_COLUMNS, "usage_unreadable")
        ),
        sa.Index("ix_fsm_messages_conversation_id_prev_seq", "conversation_id", "prev_seq"),
        sa.Index(
            "ix_fsm_messages_conversation_id_assistant_seq_call_position",
            "conversation_id",
            "assistant_seq",
            "call_position",
            unique=True,
            **_partial("assistant_seq IS NOT NULL"),
        ),
        sa.Index(
            "ix_fsm_messages_conversation_id_block_end_seq",
            "conversation_id",
            "block_end_seq",
            **_partial("block_end_seq IS NOT NULL"),
        ),
        # not unique: some servers reuse response ids, and their users need idempotency keys
        sa.Index(
            "ix_fsm_messages_conversation_id_response_id_choice",
            "conversation_id",
            "response_id",
            "choice",
            **_partial("response_id IS NOT NULL"),
        ),
        sa.Index(
            "ix_fsm_messages_conversation_id_idempotency_key",
            "conversation_id",
            "idempotency_key",
            unique=True,
            **_partial("idempotency_key IS NOT NULL"),
        ),
        # audit (migration 0002): calls by model in key order, and by time, through their
        # assistant message; partial, so plain messages pay nothing for them
        sa.Index(
            "ix_fsm_messages_model_conversation_id_seq",
            "model",
            "conversation_id",
            "seq",
            **_partial("role = 'assistant'"),
        ),
        sa.Index("ix_fsm_messages_created_at", "created_at", **_partial("role = 'assistant'")),
        # fsm audit calls --format (migration 0007)
        sa.Index(
            "ix_fsm_messages_format_conversation_id_seq",
            "format",
            "conversation_id",
            "seq",
            **_partial("role = 'assistant'"),
        ),
    )


class ToolCallRow(Base):
    """A finished tool call of an assistant message in history."""

    __tablename__ = "fsm_tool_calls"

    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("fsm_conversations.id", ondelete="CASCADE"), primary_key=True
    )
    assistant_seq: Mapped[int] = mapped_column(primary_key=True)
    #: 0-based place in the assistant message's ``fsm_tool_calls``.
    position: Mapped[int] = mapped_column(primary_key=True)
    assistant_n_calls: Mapped[int] = mapped_column()
    #: the provider's id, byte-exact (may be ``""``, may repeat).
    call_id: Mapped[str] = mapped_column(StoredText)
    #: the provider's ``index`` for the call, if it sent one.
    provider_index: Mapped[int | None] = mapped_column()
    type: Mapped[str] = mapped_column(StoredText)
    name: Mapped[str] = mapped_column(StoredText)
    #: the arguments sent back in history, byte-exact.
    arguments: Mapped[str] = mapped_column(StoredText)
    #: the provider's arguments when opt-in repair appended to them, else NULL.
    raw_arguments: Mapped[str | None] = mapped_column(StoredText)
    repaired: Mapped[bool] = mapped_column()
    state: Mapped[ToolCallState] = mapped_column(TOOL_CALL_STATE)

    __table_args__ = (
        # what a result's foreign key points at (fk_fsm_messages_result_call); named, as the
        # convention's name would pass PostgreSQL's 63 characters
        sa.UniqueConstraint(
            "conversation_id", "assistant_seq", "position", "call_id", name="uq_fsm_tool_calls_call"
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id", "assistant_seq", "assistant_n_calls"],
            ["fsm_messages.conversation_id", "fsm_messages.seq", "fsm_messages.n_calls"],
            name="fk_fsm_tool_calls_assistant",
        ),
        sa.CheckConstraint("position >= 0 AND position < assistant_n_calls", name="position"),
        sa.CheckConstraint("state = 'finished'", name="finished"),
        sa.CheckConstraint(
            "(repaired AND raw_arguments IS NOT NULL) OR (NOT repaired AND raw_arguments IS NULL)",
            name="repaired",
        ),
        _sqlite_check(SQLITE_NAME_CHECK, "name"),
        _postgres_check(PG_NAME_CHECK, "name"),
        _sqlite_check(SQLITE_CALL_ARGUMENTS_CHECK, "arguments"),
        _postgres_check(PG_CALL_ARGUMENTS_CHECK, "arguments"),
        _sqlite_check(sqlite_types_check(**TOOL_CALL_TYPES), "types"),
        sa.Index("ix_fsm_tool_calls_name", "name"),
        # audit (migration 0002): the calls of one tool in key order (a LIMIT stops early)
        sa.Index(
            "ix_fsm_tool_calls_name_conversation_id_assistant_seq_position",
            "name",
            "conversation_id",
            "assistant_seq",
            "position",
        ),
    )


class Attempt(Base):
    """One choice of a response that was recorded for audit (typically an incomplete turn).

    Keyed by ``(conversation_id, id)`` (migration 0004), as a table distributed or
    hash-partitioned by conversation needs; ``id`` is a ``bigint`` identity on PostgreSQL, unique
    over the whole table. SQLite keeps ``id`` as its rowid (``PRIMARY KEY (id)``, which numbers
    rows by itself) with ``UNIQUE (conversation_id, id)`` for the calls' foreign key: see
    :func:`_sqlite_rowid_key`.
    """

    __tablename__ = "fsm_attempts"

    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("fsm_conversations.id", ondelete="CASCADE"), index=True
    )
    id: Mapped[int] = mapped_column(ATTEMPT_ID, sa.Identity(always=False), nullable=False)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)
    #: the conversation's next seq when the attempt was recorded (where it would have gone).
    at_seq: Mapped[int] = mapped_column()
    response_id: Mapped[str | None] = mapped_column(StoredText)
    choice: Mapped[int | None] = mapped_column()
    model: Mapped[str | None] = mapped_column(StoredText)
    finish_reason: Mapped[str | None] = mapped_column(StoredText)
    complete: Mapped[bool] = mapped_column()
    #: how the stream ended (``done``, ``eof``, ``error``, ``aborted``, ...) and why.
    end_how: Mapped[str | None] = mapped_column(StoredText)
    end_reason: Mapped[str | None] = mapped_column(StoredText)
    content: Mapped[str | None] = mapped_column(StoredText)
    reasoning: Mapped[str | None] = mapped_column(StoredText)
    refusal: Mapped[str | None] = mapped_column(StoredText)
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    #: the parser's anomalies: a list of ``{"kind", "detail", "choice"}`` objects.
    anomalies: Mapped[list[Any]] = mapped_column()
    #: why the turn failed after its tools ran (a commit that failed), if it did.
    error: Mapped[str | None] = mapped_column(StoredText)
    #: the API of the attempt's stream (``chat``, ``responses``, ``anthropic``; migration
    #: 0007; NULL: unknown, or written before it).
    format: Mapped[str | None] = mapped_column(sa.Text)

    # audit (migration 0002): attempts in key order, and failures by model and by time; hash
    # indexes on PostgreSQL, whose b-tree entries cannot exceed ~2.7 KB (migration 0003)
    __table_args__ = (
        sa.PrimaryKeyConstraint("conversation_id", "id"),
        _sqlite_check(sqlite_types_check(**ATTEMPT_TYPES), "types"),
        sa.CheckConstraint(ATTEMPT_FORMAT_CHECK, name="format"),
        _sqlite_check(sqlite_types_check(nullable_texts=["format"]), "format_types"),
        sa.Index("ix_fsm_attempts_conversation_id_at_seq_id", "conversation_id", "at_seq", "id"),
        # an attempt by its id alone, as the audit joins calls to it (migration 0004: the key
        # now leads with conversation_id)
        sa.Index("ix_fsm_attempts_id", "id"),
        sa.Index("ix_fsm_attempts_model", "model", postgresql_using="hash"),
        sa.Index("ix_fsm_attempts_created_at", "created_at"),
        {"info": {SQLITE_ROWID_KEY: ("id", ("conversation_id", "id"))}},
    )


class AttemptCall(Base):
    """A tool call of an attempt, in whatever final state it reached."""

    __tablename__ = "fsm_attempt_calls"

    #: the attempt's conversation (migration 0004): the key leads with it, like every table's.
    conversation_id: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ATTEMPT_ID, primary_key=True)
    position: Mapped[int] = mapped_column(primary_key=True)
    provider_index: Mapped[int | None] = mapped_column()
    call_id: Mapped[str] = mapped_column(StoredText)
    type: Mapped[str] = mapped_column(StoredText)
    name: Mapped[str] = mapped_column(StoredText)
    arguments: Mapped[str] = mapped_column(StoredText)
    raw_arguments: Mapped[str | None] = mapped_column(StoredText)
    repaired: Mapped[bool] = mapped_column()
    state: Mapped[ToolCallState] = mapped_column(TOOL_CALL_STATE)
    #: why the call is truncated or aborted.
    reason: Mapped[str | None] = mapped_column(StoredText)
    #: the tool's result that would have been committed (a string or a content-parts list).
    result: Mapped[Any] = mapped_column(StoredJSON(), nullable=True)

    __table_args__ = (
        sa.ForeignKeyConstraint(
            ["conversation_id", "attempt_id"],
            ["fsm_attempts.conversation_id", "fsm_attempts.id"],
            name="fk_fsm_attempt_calls_attempt",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint("position >= 0", name="position"),
        _sqlite_check(sqlite_types_check(**ATTEMPT_CALL_TYPES), "types"),
        # audit (migration 0002): calls of attempts by tool, state and reason (hash indexes on
        # PostgreSQL for the texts of any length, migration 0003)
        # the calls of an attempt by its id alone, as the audit joins them (migration 0004: the
        # key now leads with conversation_id)
        sa.Index("ix_fsm_attempt_calls_attempt_id_position", "attempt_id", "position"),
        sa.Index("ix_fsm_attempt_calls_name", "name", postgresql_using="hash"),
        sa.Index("ix_fsm_attempt_calls_state", "state"),
        sa.Index("ix_fsm_attempt_calls_reason", "reason", postgresql_using="hash"),
    )


#: ``fsm_pending_turns.state``: waiting for its tools (at most one per conversation), moved into
#: history by ``commit``, or kept for audit only by ``abandon``.
PENDING_STATES = LEDGER_TURN_STATES
#: ``fsm_tool_executions.state``: never started, started (the tool may have run), and its outcome.
EXECUTION_STATES = _EXECUTION_STATES

PENDING_TURN_TYPES: dict[str, list[str]] = {
    "ints": ["id", "at_seq", "n_calls"],
    "nullable_ints": ["choice", "committed_seq"],
    "texts": ["conversation_id", "state", "created_at", "owner"],
    "nullable_texts": [
        "resolved_at",
        "reason",
        "content",
        "reasoning",
        "refusal",
        "model",
        "response_id",
        "finish_reason",
        "idempotency_key",
    ],
    "nullable_jsons": ["usage"],
}
TOOL_EXECUTION_TYPES: dict[str, list[str]] = {
    "ints": ["pending_id", "position", "pending_n_calls", "starts"],
    "nullable_ints": ["provider_index"],
    "bools": ["repaired", "legacy"],
    "texts": ["conversation_id", "call_id", "type", "name", "arguments", "state"],
    "nullable_texts": [
        "raw_arguments",
        "started_by",
        "started_at",
        "finished_at",
        "result",
        "error",
    ],
    "nullable_jsons": ["result_parts"],
}

#: the states of a pending turn and what each carries.
PENDING_STATE_CHECK = (
    "(state = 'pending' AND resolved_at IS NULL AND reason IS NULL AND committed_seq IS NULL)"
    " OR (state = 'committed' AND resolved_at IS NOT NULL AND reason IS NULL"
    " AND committed_seq IS NOT NULL)"
    " OR (state = 'abandoned' AND resolved_at IS NOT NULL AND reason IS NOT NULL"
    " AND committed_seq IS NULL)"
)
#: the states of an execution and what each carries: a start count and a start time once
#: started, a finish time and exactly one of a result (text or parts) or an error once finished.
EXECUTION_STATE_CHECK = (
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


class PendingTurnRow(Base):
    """A complete turn whose tools are running (the ledger, migration 0005): its assistant
    message and calls, outside history.

    At most one ``pending`` row per conversation (the partial unique index
    ``ix_fsm_pending_turns_conversation_id_pending``); ``commit`` moves it into history and marks it
    ``committed`` with the seq of its assistant message (a foreign key to that message, with the
    same number of calls); ``abandon`` marks it ``abandoned`` with a reason, for audit only.
    Keyed like ``fsm_attempts``: ``(conversation_id, id)``, ``id`` a ``bigint`` identity
    (SQLite: its rowid).
    """

    __tablename__ = "fsm_pending_turns"

    conversation_id: Mapped[str] = mapped_column(
        sa.String(255), sa.ForeignKey("fsm_conversations.id", ondelete="CASCADE")
    )
    id: Mapped[int] = mapped_column(ATTEMPT_ID, sa.Identity(always=False), nullable=False)
    state: Mapped[str] = mapped_column(sa.String(9))
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), server_default=_NOW)
    #: when it was committed or abandoned.
    resolved_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    #: abandoned: why.
    reason: Mapped[str | None] = mapped_column(StoredText)
    #: the conversation's next seq at ``begin`` (where the turn goes).
    at_seq: Mapped[int] = mapped_column()
    #: committed: the seq of its assistant message in history.
    committed_seq: Mapped[int | None] = mapped_column()
    content: Mapped[str | None] = mapped_column(StoredText)
    reasoning: Mapped[str | None] = mapped_column(StoredText)
    refusal: Mapped[str | None] = mapped_column(StoredText)
    model: Mapped[str | None] = mapped_column(StoredText)
    response_id: Mapped[str | None] = mapped_column(StoredText)
    choice: Mapped[int | None] = mapped_column()
    finish_reason: Mapped[str | None] = mapped_column(StoredText)
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    idempotency_key: Mapped[str | None] = mapped_column(sa.Text)
    n_calls: Mapped[int] = mapped_column()
    #: the token of the process that owns the turn (``begin`` or ``claim``): only it records.
    owner: Mapped[str] = mapped_column(sa.Text)
    #: the assistant message's ``format`` and ``provider_items``, as history will hold them
    #: (migration 0007; checked by ``fsm_messages`` when the turn is committed)
    format: Mapped[str | None] = mapped_column(sa.Text)
    provider_items: Mapped[list[Any] | None] = mapped_column()
    #: until when the owner holds the turn (the database's clock; migration 0008): ``begin``,
    #: ``claim``, ``started`` and the owner's heartbeat (``renew``) move it on; ``claim`` takes
    #: the turn over only after it (NULL: written before 0008, claimable at once)
    lease_expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))

    __table_args__ = (
        sa.PrimaryKeyConstraint("conversation_id", "id"),
        sa.UniqueConstraint("conversation_id", "id", "n_calls"),
        sa.ForeignKeyConstraint(
            ["conversation_id", "committed_seq", "n_calls"],
            ["fsm_messages.conversation_id", "fsm_messages.seq", "fsm_messages.n_calls"],
            name="fk_fsm_pending_turns_committed",
        ),
        sa.CheckConstraint("state IN ('pending', 'committed', 'abandoned')", name="pending_state"),
        sa.CheckConstraint(PENDING_STATE_CHECK, name="resolution"),
        sa.CheckConstraint("n_calls >= 0 AND at_seq >= 0", name="counts"),
        _sqlite_check(sqlite_types_check(**PENDING_TURN_TYPES), "types"),
        # at most one pending turn per conversation
        sa.Index(
            "ix_fsm_pending_turns_conversation_id_pending",
            "conversation_id",
            unique=True,
            **_partial("state = 'pending'"),
        ),
        sa.Index("ix_fsm_pending_turns_state_created_at", "state", "created_at"),
        sa.Index(
            "ix_fsm_pending_turns_conversation_id_committed_seq", "conversation_id", "committed_seq"
        ),
        {"info": {SQLITE_ROWID_KEY: ("id", ("conversation_id", "id"))}},
    )


class ToolExecution(Base):
    """One call of a pending turn and its execution: the call (as history will hold it), the
    state (``not_started``, ``started``, ``succeeded``, ``failed``), how many times it was
    started, when, and its result or error text."""

    __tablename__ = "fsm_tool_executions"

    conversation_id: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    pending_id: Mapped[int] = mapped_column(ATTEMPT_ID, primary_key=True)
    position: Mapped[int] = mapped_column(primary_key=True)
    pending_n_calls: Mapped[int] = mapped_column()
    call_id: Mapped[str] = mapped_column(StoredText)
    provider_index: Mapped[int | None] = mapped_column()
    type: Mapped[str] = mapped_column(StoredText)
    name: Mapped[str] = mapped_column(StoredText)
    arguments: Mapped[str] = mapped_column(StoredText)
    raw_arguments: Mapped[str | None] = mapped_column(StoredText)
    repaired: Mapped[bool] = mapped_column()
    legacy: Mapped[bool] = mapped_column()
    state: Mapped[str] = mapped_column(sa.String(11))
    starts: Mapped[int] = mapped_column(server_default=sa.text("0"))
    #: the owner token of the pending turn's latest start of this call.
    started_by: Mapped[str | None] = mapped_column(sa.Text)
    started_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    #: succeeded: the result text, or ``result_parts`` (a list of content parts).
    result: Mapped[str | None] = mapped_column(StoredText)
    result_parts: Mapped[list[Any] | None] = mapped_column()
    #: failed: the error text.
    error: Mapped[str | None] = mapped_column(StoredText)

    __table_args__ = (
        sa.ForeignKeyConstraint(
            ["conversation_id", "pending_id", "pending_n_calls"],
            [
                "fsm_pending_turns.conversation_id",
                "fsm_pending_turns.id",
                "fsm_pending_turns.n_calls",
            ],
            name="fk_fsm_tool_executions_pending",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint("position >= 0 AND position < pending_n_calls", name="position"),
        sa.CheckConstraint(
            "state IN ('not_started', 'started', 'succeeded', 'failed')",
            name="execution_state",
        ),
        sa.CheckConstraint(EXECUTION_STATE_CHECK, name="outcome"),
        sa.CheckConstraint(
            "(repaired AND raw_arguments IS NOT NULL) OR (NOT repaired AND raw_arguments IS NULL)",
            name="repaired",
        ),
        _sqlite_check(SQLITE_NAME_CHECK, "name"),
        _postgres_check(PG_NAME_CHECK, "name"),
        _sqlite_check(sqlite_types_check(**TOOL_EXECUTION_TYPES), "types"),
        sa.Index("ix_fsm_tool_executions_state", "state"),
    )


for _dialect, _sql in STATS_INDEX_DDL.items():
    _ddl = sa.DDL(_sql)  # type: ignore[no-untyped-call]
    sa.event.listen(Message.__table__, "after_create", _ddl.execute_if(dialect=_dialect))

#: fsm's tables, in the order they are declared (every table before the ones that reference it):
#: the one list the migrations' host filter and the audit check read.
TABLES: tuple[str, ...] = tuple(Base.metadata.tables)
