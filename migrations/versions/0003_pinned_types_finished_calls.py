"""Pinned types on SQLite, what ``finished`` means, texts of any length, attempts of failed commits.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

* **SQLite pins its types**: each table gets a check ``ck_<table>_types`` (``typeof(x) =
  'integer'`` on every integer column, ``IN (0, 1)`` on booleans, ``typeof(x) = 'text'`` on
  texts, ``json_valid`` on JSON columns), so type affinity can no longer store ``'5x'``, ``0.5``,
  ``1e300`` or a blob in a key or count column. SQLite cannot add a check to a table: Alembic's
  batch mode rebuilds each table (foreign keys must be off, as ``fsm db upgrade`` has them).
* **Both engines**: a finished call has a non-blank name (``ck_tool_calls_name``) and blank or
  valid JSON arguments (``ck_tool_calls_arguments``: ``json_valid`` on SQLite, the new IMMUTABLE
  function ``fsm_json_valid(text)`` on PostgreSQL, which has no ``IS JSON`` before version 16);
  system, developer, user and tool messages have content (``ck_messages_content``). PostgreSQL
  also gets ``fsm_try_jsonb(text)`` (the text as ``jsonb``, or NULL) for JSON queries that must
  survive any stored value.
* ``finish_reason``, ``type`` and ``end_how`` become TEXT (no provider value is too long).
* ``attempts.model``, ``attempt_calls.name`` and ``attempt_calls.reason`` are indexed by hash on
  PostgreSQL, whose b-tree entries cannot exceed about 2.7 KB (a provider's error message can be
  megabytes); SQLite's b-trees have no such limit and keep their indexes.
* New nullable columns: ``attempts.error`` (why a commit failed after the tools ran) and
  ``attempt_calls.result`` (JSON: the result that would have been committed).
* Text now goes through ``fsm.store.codec``: values stored before this revision that hold U+0000
  (SQLite could store it) or start with U+FDD0 are rewritten in the codec's marked form, so they
  read back as they were and compare equal to the same value written now. (A downgrade leaves
  marked values as they are.)

Rows that break a new check (written with raw SQL, or by an older fsm: ``Infinity`` in a SQLite
``usage`` is rewritten as the string ``"inf"`` instead) stop the upgrade with a message
naming the check; nothing is changed then.

Revisions import nothing from fsm: the SQL below is the text ``fsm/store/models.py`` builds
(a test compares them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MARK = "\ufdd0"

# -- the checks (the same text as fsm/store/models.py) ---------------------------------------
_SQLITE_BLANK = "' ' || char(9, 10, 13)"
_PG_BLANK = r"E' \t\r\n'"
_SQLITE_NAME = f"trim(name, {_SQLITE_BLANK}) <> ''"
_PG_NAME = f"btrim(name, {_PG_BLANK}) <> ''"
_SQLITE_ARGUMENTS = (
    f"trim(arguments, {_SQLITE_BLANK}) = '' OR json_valid(arguments)"
    " OR (substr(arguments, 1, 1) = char(64976)"
    r" AND instr(replace(substr(arguments, 2), '\\', char(55296)), '\0') = 0"
    r" AND json_valid(replace(replace(replace(substr(arguments, 2), '\\', char(55296)), '\u', 'x'),"
    r" char(55296), '\')))"
)
_PG_ARGUMENTS = f"btrim(arguments, {_PG_BLANK}) = '' OR fsm_json_valid(arguments)"
_CONTENT = (
    "role NOT IN ('system', 'developer', 'user', 'tool')"
    " OR content IS NOT NULL OR content_parts IS NOT NULL"
)

#: the columns of each table's SQLite types check, by kind.
_TYPES: dict[str, dict[str, list[str]]] = {
    "conversations": {"texts": ["id", "created_at"], "nullable_jsons": ["meta"]},
    "messages": {
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
    },
    "tool_calls": {
        "ints": ["assistant_seq", "position", "assistant_n_calls"],
        "nullable_ints": ["provider_index"],
        "bools": ["repaired"],
        "texts": ["conversation_id", "call_id", "type", "name", "arguments", "state"],
        "nullable_texts": ["raw_arguments"],
    },
    "attempts": {
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
    },
    "attempt_calls": {
        "ints": ["attempt_id", "position"],
        "nullable_ints": ["provider_index"],
        "bools": ["repaired"],
        "texts": ["call_id", "type", "name", "arguments", "state"],
        "nullable_texts": ["raw_arguments", "reason"],
        "nullable_jsons": ["result"],
    },
}


def _types_check(kinds: dict[str, list[str]]) -> str:
    terms = [f"typeof({c}) = 'integer'" for c in kinds.get("ints", [])]
    terms += [f"({c} IS NULL OR typeof({c}) = 'integer')" for c in kinds.get("nullable_ints", [])]
    terms += [f"(typeof({c}) = 'integer' AND {c} IN (0, 1))" for c in kinds.get("bools", [])]
    terms += [f"typeof({c}) = 'text'" for c in kinds.get("texts", [])]
    terms += [f"({c} IS NULL OR typeof({c}) = 'text')" for c in kinds.get("nullable_texts", [])]
    terms += [f"(typeof({c}) = 'text' AND json_valid({c}))" for c in kinds.get("jsons", [])]
    terms += [
        f"({c} IS NULL OR (typeof({c}) = 'text' AND json_valid({c})))"
        for c in kinds.get("nullable_jsons", [])
    ]
    return " AND ".join(terms)


#: (table, name, SQLite text, PostgreSQL text) of the checks of both engines.
_CHECKS = [
    ("messages", "ck_messages_content", _CONTENT, _CONTENT),
    ("tool_calls", "ck_tool_calls_name", _SQLITE_NAME, _PG_NAME),
    ("tool_calls", "ck_tool_calls_arguments", _SQLITE_ARGUMENTS, _PG_ARGUMENTS),
]

#: columns that become TEXT (were VARCHAR(64)), by table.
_WIDENED = {
    "messages": ["finish_reason"],
    "tool_calls": ["type"],
    "attempts": ["finish_reason", "end_how"],
    "attempt_calls": ["type"],
}


def _new_columns() -> list[tuple[str, sa.Column[Any]]]:
    """(table, column) of the new columns (new objects each time: a column joins one table)."""
    return [
        ("attempts", sa.Column("error", sa.Text(), nullable=True)),
        ("attempt_calls", sa.Column("result", sa.JSON(), nullable=True)),
    ]


#: indexes of texts of any length: hash on PostgreSQL (b-tree on SQLite, unchanged).
_HASHED = [
    ("ix_attempts_model", "attempts", "model"),
    ("ix_attempt_calls_name", "attempt_calls", "name"),
    ("ix_attempt_calls_reason", "attempt_calls", "reason"),
]

#: texts written through the codec from this revision on, by table.
_CODEC_TEXTS = {
    "messages": [
        "content",
        "name",
        "refusal",
        "reasoning",
        "model",
        "response_id",
        "finish_reason",
        "tool_call_id",
    ],
    "tool_calls": ["call_id", "type", "name", "arguments", "raw_arguments"],
    "attempts": [
        "response_id",
        "model",
        "finish_reason",
        "end_how",
        "end_reason",
        "content",
        "reasoning",
        "refusal",
    ],
    "attempt_calls": ["call_id", "type", "name", "arguments", "raw_arguments", "reason"],
}

#: JSON columns that an older fsm could fill with NaN / Infinity on SQLite.
_SQLITE_JSONS = [
    ("conversations", "meta"),
    ("messages", "content_parts"),
    ("messages", "usage"),
    ("attempts", "usage"),
    ("attempts", "anomalies"),
]

_FUNCTIONS = {
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


class RevisionBlockedError(RuntimeError):
    """Rows of the database break a rule this revision adds: the upgrade changed nothing."""


def _blocked(exc: sa.exc.DBAPIError) -> RevisionBlockedError:
    first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
    return RevisionBlockedError(
        f"revision 0003 cannot be applied: rows written before it break one of its checks "
        f"({first}); nothing was changed. List them with `fsm audit check --db URL`, fix or "
        "delete them, and upgrade again"
    )


# -- upgrade ---------------------------------------------------------------------------------
def upgrade() -> None:
    try:
        if op.get_bind().dialect.name == "sqlite":
            _upgrade_sqlite()
        else:
            _upgrade_postgres()
    except sa.exc.IntegrityError as exc:
        raise _blocked(exc) from exc


def _require_foreign_keys_off() -> None:
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError(
            "revision 0003 rebuilds SQLite tables and needs foreign keys off on the migrating "
            "connection: run it with `fsm db upgrade` or `alembic upgrade head`"
        )


def _finite(value: Any, depth: int = 0) -> Any:
    """``value`` with NaN / Infinity (which an older fsm wrote on SQLite) as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if depth > 64:
        return value
    if isinstance(value, list):
        return [_finite(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v, depth + 1) for k, v in value.items()}
    return value


def _sqlite_fix_json() -> None:
    """Rewrite JSON values that SQLite's ``json_valid`` refuses (NaN / Infinity) as valid JSON."""
    bind = op.get_bind()
    for table, column in _SQLITE_JSONS:
        rows = bind.execute(
            sa.text(
                f"SELECT rowid, {column} FROM {table}"
                f" WHERE {column} IS NOT NULL AND NOT json_valid({column})"
            )
        ).all()
        for rowid, text in rows:
            try:
                fixed = json.dumps(_finite(json.loads(text)), allow_nan=False)
            except (ValueError, TypeError, RecursionError):
                continue  # not JSON at all: the types check names it
            bind.execute(
                sa.text(f"UPDATE {table} SET {column} = :fixed WHERE rowid = :rowid"),
                {"fixed": fixed, "rowid": rowid},
            )


def _mark(text: str) -> str:
    """fsm.store.codec's marked form of a text that holds U+0000 or starts with U+FDD0 (SQLite
    never held a lone surrogate)."""
    return _MARK + text.replace("\\", "\\\\").replace("\x00", "\\0")


def _sqlite_mark_legacy_texts() -> None:
    """Values with U+0000 or a leading U+FDD0 in the codec's marked form (foreign keys are off,
    so a call's id and its result's ``tool_call_id`` are rewritten alike). SQLite's
    ``replace()`` cannot take U+0000 as a pattern: the rows are rewritten from Python."""
    bind = op.get_bind()
    for table, columns in _CODEC_TEXTS.items():
        for column in columns:
            rows = bind.execute(
                sa.text(
                    f"SELECT rowid, {column} FROM {table} WHERE typeof({column}) = 'text'"
                    f" AND (substr({column}, 1, 1) = char(64976)"
                    f" OR instr(CAST({column} AS BLOB), X'00') > 0)"
                )
            ).all()
            for rowid, text in rows:
                bind.execute(
                    sa.text(f"UPDATE {table} SET {column} = :text WHERE rowid = :rowid"),
                    {"text": _mark(text), "rowid": rowid},
                )


def _upgrade_sqlite() -> None:
    _require_foreign_keys_off()
    _sqlite_fix_json()
    _sqlite_mark_legacy_texts()
    new_columns: dict[str, list[sa.Column[Any]]] = {}
    for table, new_column in _new_columns():
        new_columns.setdefault(table, []).append(new_column)
    for table in ("conversations", "messages", "tool_calls", "attempts", "attempt_calls"):
        with op.batch_alter_table(table, recreate="always") as batch:
            for column in _WIDENED.get(table, []):
                batch.alter_column(column, type_=sa.Text(), existing_type=sa.String(64))
            for new in new_columns.get(table, []):
                batch.add_column(new)
            for check_table, name, sqlite_text, _pg in _CHECKS:
                if check_table == table:
                    batch.create_check_constraint(op.f(name), sa.text(sqlite_text))
            batch.create_check_constraint(
                op.f(f"ck_{table}_types"), sa.text(_types_check(_TYPES[table]))
            )


def _postgres_mark_legacy_texts() -> None:
    """Values with a leading U+FDD0 in the codec's marked form (PostgreSQL never held U+0000).
    A call id and its result's ``tool_call_id`` change together, under their foreign key
    dropped for the moment (only if there is such a value at all)."""
    bind = op.get_bind()
    marked = "left({c}, 1) = chr(64976)"
    encode = r"chr(64976) || replace({c}, '\', '\\')"
    ids = bind.execute(
        sa.text(f"SELECT EXISTS (SELECT 1 FROM tool_calls WHERE {marked.format(c='call_id')})")
    ).scalar()
    if ids:
        op.drop_constraint("fk_messages_result_call", "messages", type_="foreignkey")
    for table, columns in _CODEC_TEXTS.items():
        for column in columns:
            bind.execute(
                sa.text(
                    f"UPDATE {table} SET {column} = {encode.format(c=column)}"
                    f" WHERE {marked.format(c=column)}"
                )
            )
    if ids:
        op.create_foreign_key(
            "fk_messages_result_call",
            "messages",
            "tool_calls",
            ["conversation_id", "assistant_seq", "call_position", "tool_call_id"],
            ["conversation_id", "assistant_seq", "position", "call_id"],
        )


def _upgrade_postgres() -> None:
    for sql in _FUNCTIONS.values():
        op.execute(sql)
    _postgres_mark_legacy_texts()
    for table, columns in _WIDENED.items():
        for column in columns:
            op.alter_column(table, column, type_=sa.Text(), existing_type=sa.String(64))
    for table, new_column in _new_columns():
        op.add_column(table, new_column)
    for table, name, _sqlite, pg_text in _CHECKS:
        op.create_check_constraint(op.f(name), table, sa.text(pg_text))
    for name, table, column in _HASHED:
        op.drop_index(name, table_name=table)
        op.create_index(name, table, [column], postgresql_using="hash")


# -- downgrade -------------------------------------------------------------------------------
def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _downgrade_sqlite()
    else:
        _downgrade_postgres()


def _downgrade_sqlite() -> None:
    _require_foreign_keys_off()
    for table in ("attempt_calls", "attempts", "tool_calls", "messages", "conversations"):
        with op.batch_alter_table(table, recreate="always") as batch:
            batch.drop_constraint(op.f(f"ck_{table}_types"), type_="check")
            for check_table, name, _sqlite, _pg in reversed(_CHECKS):
                if check_table == table:
                    batch.drop_constraint(op.f(name), type_="check")
            for new_table, new_column in reversed(_new_columns()):
                if new_table == table:
                    batch.drop_column(new_column.name)
            for column in _WIDENED.get(table, []):
                batch.alter_column(column, type_=sa.String(64), existing_type=sa.Text())


def _downgrade_postgres() -> None:
    for name, table, column in reversed(_HASHED):
        op.drop_index(name, table_name=table)
        op.create_index(name, table, [column])
    for table, name, _sqlite, _pg in reversed(_CHECKS):
        op.drop_constraint(op.f(name), table, type_="check")
    for table, new_column in reversed(_new_columns()):
        op.drop_column(table, new_column.name)
    for table, columns in _WIDENED.items():
        for column in columns:
            # a longer value than the old type takes is cut (the downgrade must not fail on it)
            op.alter_column(
                table,
                column,
                type_=sa.String(64),
                existing_type=sa.Text(),
                postgresql_using=f"left({column}, 64)",
            )
    for signature in reversed(_FUNCTIONS):
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
