"""Token columns on messages, and the index ``fsm audit stats`` reads instead of the table.

Revision ID: 0006_token_columns
Revises: 0005_tool_ledger
Create Date: 2026-12-02

``stats()`` used to parse every assistant message's ``usage`` JSON on each call: seconds on a
million calls. Its counts now live in integer columns of ``messages``, written with the row by
the store (``fsm.store.plans.usage_columns``):

* ``prompt_tokens``, ``completion_tokens``, ``total_tokens``: the usage's value when it is an
  integer from 0 to 999,999,999 (not a fraction, a string, a bool or a bigger number), else
  NULL; each with a check ``ck_messages_<column>`` (NULL or in that range; on SQLite also
  ``typeof() = 'integer'``, since ALTER TABLE cannot extend ``ck_messages_types`` without
  rebuilding the table);
* ``usage_unreadable``: 1 when the message has a usage that is not a JSON object, else NULL
  (check ``ck_messages_usage_unreadable``).

The upgrade adds the columns (NULL: no table rewrite on either engine), then **backfills** the
assistant messages that have a usage with one ``UPDATE``, which computes the columns exactly as
``stats()`` read the JSON before this revision (SQLite: ``json_valid`` / ``json_type`` /
``json_extract``; PostgreSQL: the ``json`` operators, and for a usage they could fail on, an
escape ``jsonb`` cannot hold or 10,000 characters or more, its ``jsonb`` reading with those
escapes replaced, as ``fsm.store.audit.summary`` did), then creates ``ix_messages_stats``, a
partial index of the assistant messages: on SQLite ``(model, substr(created_at, 1, 10),
n_calls, <token columns>)`` (grouped in index order, no sort), on PostgreSQL ``(model,
created_at) INCLUDE (n_calls, <token columns>)`` (an index-only scan, aggregated by hash).
PostgreSQL's index-only scan needs the visibility map the next (auto)vacuum sets after the
backfill's UPDATE. On a partitioned database every statement applies to the partitions.

Revisions import nothing from fsm: the SQL below is the text ``fsm/store/models.py`` builds.
The downgrade drops the index and the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_token_columns"
down_revision: str | Sequence[str] | None = "0005_tool_ledger"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TOKENS = ("prompt_tokens", "completion_tokens", "total_tokens")
_COLUMNS = (*_TOKENS, "usage_unreadable")
_TOKEN_MAX = 999_999_999
_INDEX = "ix_messages_stats"
_INDEX_DDL = {
    "sqlite": (
        f"CREATE INDEX {_INDEX} ON messages (model, substr(created_at, 1, 10), n_calls, "
        "prompt_tokens, completion_tokens, total_tokens, usage_unreadable) "
        "WHERE role = 'assistant'"
    ),
    "postgresql": (
        f"CREATE INDEX {_INDEX} ON messages (model, created_at) INCLUDE (n_calls, "
        "prompt_tokens, completion_tokens, total_tokens, usage_unreadable) "
        "WHERE role = 'assistant'"
    ),
}


def _check(column: str, *, sqlite: bool) -> str:
    bound = "= 1" if column == "usage_unreadable" else f"BETWEEN 0 AND {_TOKEN_MAX}"
    typed = f"typeof({column}) = 'integer' AND " if sqlite else ""
    return f"{column} IS NULL OR ({typed}{column} {bound})"


# -- the backfill -------------------------------------------------------------------------------
def _sqlite_count(key: str) -> str:
    path = f"'$.\"{key}\"'"
    return (
        f"CASE WHEN json_valid(usage) THEN CASE WHEN json_type(usage, {path}) = 'integer'"
        f" AND json_extract(usage, {path}) BETWEEN 0 AND {_TOKEN_MAX}"
        f" THEN json_extract(usage, {path}) END END"
    )


_SQLITE_BACKFILL = (
    "UPDATE messages SET "
    + ", ".join(f"{key} = {_sqlite_count(key)}" for key in _TOKENS)
    + ", usage_unreadable = CASE WHEN json_valid(usage) AND json_type(usage) = 'object'"
    " THEN NULL ELSE 1 END"
    " WHERE role = 'assistant' AND usage IS NOT NULL"
)

#: PostgreSQL: a usage the ``json`` operators may fail on (an escape they cannot decode, or
#: nesting deeper than the server's stack, which needs 10,000 characters), read as ``jsonb``
#: instead: the escapes jsonb cannot hold read as U+FFFD, exponents of five digits or more
#: (beyond ``numeric``) as null, 10,000 characters or more not read.
_PG_TEXT = "CAST(usage AS text)"
_PG_RISKY = f"(strpos({_PG_TEXT}, '\\u') > 0 OR octet_length({_PG_TEXT}) >= 10000)"
_PG_DOCUMENT = (
    f"CASE WHEN length({_PG_TEXT}) >= 10000 THEN NULL"
    f" WHEN strpos({_PG_TEXT}, '\\u') = 0 AND NOT ({_PG_TEXT} ~ :big_exponent_digit)"
    f" THEN CAST({_PG_TEXT} AS jsonb)"
    f" ELSE CAST(regexp_replace(regexp_replace({_PG_TEXT}, :unheld, :fffd, 'g'),"
    " :big_exponent, 'null', 'g') AS jsonb) END"
)


def _pg_count(key: str) -> str:
    value = (
        f"CASE WHEN {_PG_RISKY} THEN CAST(({_PG_DOCUMENT}) -> '{key}' AS text)"
        f" ELSE CAST(usage -> '{key}' AS text) END"
    )
    return f"CASE WHEN ({value}) ~ '^[0-9]{{1,9}}$' THEN CAST(({value}) AS integer) END"


_PG_KIND = f"CASE WHEN {_PG_RISKY} THEN jsonb_typeof({_PG_DOCUMENT}) ELSE json_typeof(usage) END"
_PG_BACKFILL = (
    "UPDATE messages SET "
    + ", ".join(f"{key} = {_pg_count(key)}" for key in _TOKENS)
    + f", usage_unreadable = CASE WHEN ({_PG_KIND}) = 'object' THEN NULL ELSE 1 END"
    " WHERE role = 'assistant' AND usage IS NOT NULL"
)
_PG_PARAMS = {
    "big_exponent_digit": r"[0-9][eE][-+]?[0-9]{5}",
    "big_exponent": r"-?[0-9]+(\.[0-9]+)?[eE][-+]?[0-9]{5,}",
    "unheld": r"\\u(0000|[dD][89a-fA-F][0-9a-fA-F]{2})",
    "fffd": r"\\ufffd",
}


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        # a table rebuild, each column with a table check (a column check added by ALTER TABLE
        # is misread by the SQLite reflection of SQLAlchemy 2.0.33, which later rebuilds use).
        # The copy keeps rows as they are: a row that broke another check (written with the
        # checks off, which fsm audit check reports) must not stop the upgrade
        op.execute("PRAGMA ignore_check_constraints = ON")
        try:
            with op.batch_alter_table("messages", recreate="always") as batch:
                for column in _COLUMNS:
                    batch.add_column(sa.Column(column, sa.Integer(), nullable=True))
                    batch.create_check_constraint(
                        op.f(f"ck_messages_{column}"), sa.text(_check(column, sqlite=True))
                    )
        finally:
            op.execute("PRAGMA ignore_check_constraints = OFF")
        # an UPDATE evaluates only the checks of the columns it sets: the new ones
        op.execute(_SQLITE_BACKFILL)
    else:
        for column in _COLUMNS:
            op.add_column("messages", sa.Column(column, sa.Integer(), nullable=True))
        op.execute(sa.text(_PG_BACKFILL).bindparams(**_PG_PARAMS))
        for column in _COLUMNS:
            op.create_check_constraint(
                op.f(f"ck_messages_{column}"), "messages", _check(column, sqlite=False)
            )
    op.execute(_INDEX_DDL["sqlite" if sqlite else "postgresql"])


def downgrade() -> None:
    op.execute(f"DROP INDEX {_INDEX}")
    if op.get_bind().dialect.name == "sqlite":
        # a table rebuild: once a later revision has rebuilt messages (0007), each column's
        # check is a table check, and ALTER TABLE DROP COLUMN refuses a column a table check uses
        with op.batch_alter_table("messages", recreate="always") as batch:
            for column in reversed(_COLUMNS):
                batch.drop_constraint(op.f(f"ck_messages_{column}"), type_="check")
                batch.drop_column(column)
        return
    for column in reversed(_COLUMNS):
        op.drop_constraint(op.f(f"ck_messages_{column}"), "messages", type_="check")
        op.drop_column("messages", column)
