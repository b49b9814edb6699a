"""The tool ledger's leases: a pending turn's owner holds it until ``lease_expires_at``.

Revision ID: 0008_ledger_leases
Revises: 0007_stream_formats
Create Date: 2026-12-03

``pending_turns.lease_expires_at`` (nullable timestamp, the database's clock): ``begin`` and
``claim`` set it to now + the lease, ``started`` and the owner's heartbeat (``renew``) move it
on while the tools run. ``claim`` takes a pending turn over only once its lease has run out
(its owner is gone); before that it raises ``TurnInProgressError`` (issue 26). Rows written
before this revision have none: their owner ran a version without heartbeats, and they may be
claimed at once, as before.

Plain ``ADD COLUMN`` / ``DROP COLUMN`` on both engines (SQLite 3.35+ drops a column in place):
no table rebuild, no new check.

Revisions import nothing from fsm.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_ledger_leases"
down_revision: str | Sequence[str] | None = "0007_stream_formats"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "pending_turns",
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.execute("ALTER TABLE pending_turns DROP COLUMN lease_expires_at")
