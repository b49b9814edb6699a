"""Where a database URL points, read from the URL alone (no engine, no connection): shared by
:mod:`fsm.store.engine` and :mod:`fsm.store.faults`, which translates driver errors and must not
import the engine factory (the engine installs it)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL

__all__ = ["sqlite_file"]


def sqlite_file(url: str | URL) -> Path | None:
    """The file of a SQLite URL (``None``: another engine, or an in-memory database)."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if not database or database == ":memory:" or "mode=memory" in database:
        return None
    if database.startswith("file:"):
        database = database[len("file:") :].split("?", 1)[0]
    return Path(database).expanduser()
