"""The store opened read-only for a reading command (``fsm audit ...``, ``fsm conversations``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["read_only_store"]


@contextmanager
def read_only_store(url: str | None) -> Iterator[Any]:
    """The store opened read-only (a missing SQLite file is an error, never created); driver
    errors become one-line typed errors."""
    import sqlalchemy as sa

    from fsm.store import audit as audit_api
    from fsm.store.engine import display_url, normalize_url

    engine = audit_api.open_readonly(url)
    try:
        yield engine
    except sa.exc.DBAPIError as exc:
        reason = " ".join(str(exc.orig).split())
        raise audit_api.AuditError(
            f"cannot read the store {display_url(normalize_url(url))}: {reason}"
        ) from exc
    finally:
        engine.dispose()
