"""What a caller's transaction (:meth:`ConversationStore.bind
<fsm.store.ConversationStore.bind>`) can do to a store operation, as typed errors: the raw driver
errors a host's transaction gives, turned into the store's own.

* :func:`check_schema`: the database behind a bound connection is at the revision this fsm
  needs (:class:`~fsm.store.errors.SchemaNotAtHeadError` naming ``fsm db upgrade`` otherwise),
  read once per database and schema, in a savepoint (the caller's transaction is untouched);
* :func:`host_error`: the typed error for a driver error raised in the caller's transaction:
  :class:`~fsm.store.errors.HostTransactionError` for a transaction that had already failed
  (PostgreSQL SQLSTATE 25P02), :class:`~fsm.store.errors.StoreBusyError` (retryable) for a
  serialization failure or deadlock (class 40), and for a write's unique key broken by a turn
  that another transaction committed after this one's snapshot was taken (REPEATABLE READ and
  SERIALIZABLE on PostgreSQL, where the lock fsm takes does not make that turn visible).
"""

from __future__ import annotations

import threading
from typing import Final

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from fsm.store.engine import display_url, schema_of
from fsm.store.errors import (
    HostTransactionError,
    SchemaNotAtHeadError,
    StoreBusyError,
    StoreError,
    ValueRejectedError,
)
from fsm.store.migrate import head_revision, revision_of

__all__ = ["check_schema", "host_error", "lost_snapshot_race"]

#: the databases (URL and schema) a bound connection was found at head on, in this process
_AT_HEAD: set[tuple[str, str | None]] = set()
_AT_HEAD_LOCK: Final = threading.Lock()
#: the isolation levels whose snapshot is the transaction's first statement's
_SNAPSHOT_LEVELS: Final = ("REPEATABLE READ", "SERIALIZABLE")


def _sqlstate(exc: BaseException) -> str:
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    state = getattr(orig, "sqlstate", None)
    return state if isinstance(state, str) else ""


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_schema(connection: Connection) -> None:
    """Raise :class:`~fsm.store.errors.SchemaNotAtHeadError` unless the database (and schema)
    of ``connection`` is at this fsm's revision; :class:`~fsm.store.errors.HostTransactionError`
    if its transaction has already failed. Read once per database and schema (then
    remembered), in a savepoint."""
    url = display_url(connection.engine.url)
    key = (url, schema_of(connection))
    with _AT_HEAD_LOCK:
        if key in _AT_HEAD:
            return
    head = head_revision()
    try:
        # in a savepoint of the caller's transaction; with none begun yet, in a transaction of
        # its own, ended here (the caller begins its own as it would have)
        with connection.begin_nested() if connection.in_transaction() else connection.begin():
            current = revision_of(connection)
    except sa_exc.DBAPIError as exc:
        mapped = host_error(exc, connection)
        if mapped is None:
            raise
        raise mapped from exc
    if current != head:
        raise SchemaNotAtHeadError(url, current, head, schema=key[1])
    with _AT_HEAD_LOCK:
        _AT_HEAD.add(key)


def host_error(exc: sa_exc.DBAPIError, connection: Connection) -> StoreError | None:
    """The typed error for the driver error ``exc`` raised in the caller's transaction on
    ``connection``, or ``None`` to let it out as it is."""
    state = _sqlstate(exc)
    url = display_url(connection.engine.url)
    if state == "25P02":  # in_failed_sql_transaction
        return HostTransactionError(
            f"the transaction given to bind() on {url} has already failed (an earlier "
            "statement in it raised; PostgreSQL refuses every later one: SQLSTATE 25P02): "
            "nothing was written; roll the transaction back and run the unit of work again"
        )
    if state.startswith("40"):  # serialization_failure, deadlock_detected, ...
        return StoreBusyError(
            f"the transaction given to bind() on {url} lost a race with another transaction "
            f"({_first_line(exc.orig)}; SQLSTATE {state}): roll it back and run the unit of "
            "work again"
        )
    if state in ("42P01", "42703") or (
        connection.dialect.name == "sqlite"
        and ("no such table" in str(exc.orig) or "no such column" in str(exc.orig))
    ):
        # a table or column this fsm needs is missing: the schema is older (or not fsm's)
        schema = schema_of(connection)
        with _AT_HEAD_LOCK:
            _AT_HEAD.discard((url, schema))
        try:
            with connection.begin_nested():
                current = revision_of(connection)
        except sa_exc.DBAPIError:
            # the transaction is aborted (a read outside a savepoint): the revision is unknown
            return SchemaNotAtHeadError(url, "(unreadable)", head_revision(), schema=schema)
        if current != head_revision():
            return SchemaNotAtHeadError(url, current, head_revision(), schema=schema)
    return None


def lost_snapshot_race(exc: ValueRejectedError, connection: Connection) -> StoreBusyError | None:
    """For a write rejected by a unique key (PostgreSQL SQLSTATE 23505) in a caller's
    transaction at REPEATABLE READ or SERIALIZABLE: the retryable error of a lost race (another
    transaction committed to the conversation after this one's snapshot was taken, so the next
    seq or the idempotency check fsm read was stale), else ``None``. Under READ COMMITTED every
    statement after fsm's lock sees the latest commits, so a broken unique key is not a race."""
    cause = exc.__cause__
    if connection.dialect.name != "postgresql" or not isinstance(cause, sa_exc.IntegrityError):
        return None
    if _sqlstate(cause) != "23505":
        return None
    try:
        level = str(connection.get_isolation_level()).upper()
    except sa_exc.DBAPIError:
        return None
    if level not in _SNAPSHOT_LEVELS:
        return None
    return StoreBusyError(
        f"another transaction committed to this conversation after the snapshot of the "
        f"transaction given to bind() on {display_url(connection.engine.url)} was taken "
        f"({level}): this write cannot see that commit (a serialization failure); roll the "
        "transaction back and run the unit of work again"
    )
