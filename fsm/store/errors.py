"""Typed errors of the conversation store.

Every class derives from :class:`StoreError`, itself an :class:`fsm.errors.FsmError`, so the
command line prints them as one line without a traceback. Errors a caller may simply retry
(a lost race, a busy database) derive from :class:`RetryableStoreError` and have
``retryable = True``. An incomplete turn given to :meth:`ConversationStore.commit_turn
<fsm.store.ConversationStore.commit_turn>` raises :class:`fsm.errors.IncompleteTurnError`, the
parser's own class. The audit's own errors (:mod:`fsm.store.audit`) derive from
:class:`AuditError`.
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from fsm.errors import FsmError
from fsm.exitstatus import (
    EXIT_CORRUPT,
    EXIT_FULL,
    EXIT_OUTCOME_UNKNOWN,
    EXIT_STORE,
    EXIT_UNAVAILABLE,
    EXIT_UNUSABLE,
)

__all__ = [
    "AuditError",
    "CommitOutcomeUnknownError",
    "ConflictError",
    "ConversationExistsError",
    "ConversationNotFoundError",
    "CorruptStoreError",
    "DatabaseCorruptError",
    "DatabaseFileError",
    "DatabaseNotFoundError",
    "DatabaseUrlError",
    "DriverMissingError",
    "HostTransactionError",
    "IdempotencyMismatchError",
    "InvalidConversationIdError",
    "InvalidFilterError",
    "InvalidIdempotencyKeyError",
    "InvalidMessageError",
    "InvalidTurnError",
    "LedgerStateError",
    "MigrationsNotFoundError",
    "PendingTurnError",
    "PoolerError",
    "ReadOnlyNodeError",
    "ResultsError",
    "RetryableStoreError",
    "SchemaNotAtHeadError",
    "ServerFullError",
    "StorageFullError",
    "StoreBusyError",
    "StoreError",
    "StoreLayoutError",
    "StoreUnavailableError",
    "TurnInProgressError",
    "UnknownRevisionError",
    "UnsupportedValueError",
    "ValueRejectedError",
]


class StoreError(FsmError):
    """Base class of every error the conversation store raises on purpose."""

    #: the command line's exit status: the store refused the request
    exit_code: ClassVar[int] = EXIT_STORE

    #: whether repeating the same call later may succeed.
    retryable: bool = False


class RetryableStoreError(StoreError):
    """A write lost a race or could not get the database in time; retrying may succeed."""

    retryable = True


class ConflictError(RetryableStoreError):
    """Another writer appended to the conversation first: ``expected_seq`` is stale.

    ``expected_seq`` is the position the caller expected to append at, ``actual_seq`` the
    conversation's real next position. Re-read the history, decide again, and retry with
    ``expected_seq=actual_seq``.
    """

    def __init__(self, conversation_id: str, expected_seq: int, actual_seq: int) -> None:
        self.conversation_id = conversation_id
        self.expected_seq = expected_seq
        self.actual_seq = actual_seq
        super().__init__(
            f"conversation {conversation_id!r} moved on: expected to append at seq "
            f"{expected_seq}, but the next seq is {actual_seq} (another writer committed first); "
            "re-read the history and retry"
        )


class StoreBusyError(RetryableStoreError):
    """The database stayed locked by another writer past the busy timeout (SQLite)."""

    #: the command line's exit status: nothing written, retry later
    exit_code: ClassVar[int] = EXIT_UNAVAILABLE


class StoreUnavailableError(RetryableStoreError):
    """The database could not be reached or stopped answering: the connection was refused or
    reset, the server shut down, or an operation passed its deadline.

    The fault came before COMMIT was sent, so nothing of the call was written; retrying later
    is safe. The driver's error is chained as ``__cause__``.
    """

    #: the command line's exit status: nothing written, retry later
    exit_code: ClassVar[int] = EXIT_UNAVAILABLE


class ServerFullError(StoreUnavailableError):
    """The server (or the pooler in front of it) is running but has no connection slot left:
    PostgreSQL's ``too_many_connections`` (SQLSTATE 53300: "sorry, too many clients already",
    "remaining connection slots are reserved"), PgBouncer's ``max_client_conn``. Nothing was
    written; retry later, and size the pools (each store's ``pool_size + max_overflow``, 16 + 10
    by default, times its processes) below the server's ``max_connections``."""


class ReadOnlyNodeError(StoreUnavailableError):
    """A write reached a server that accepts no writes (SQLSTATE 25006
    ``read_only_sql_transaction``): a hot standby, or the old primary after a failover. Nothing
    was written. The store dropped the connections of its pool, so a retry connects again (with
    ``target_session_attrs=read-write`` in a multi-host URL, to the new primary)."""


class PoolerError(StoreUnavailableError):
    """A connection pooler between fsm and the server broke the session fsm was given: a
    prepared statement of another client's session (SQLSTATE 26000, 42P05: server-side prepared
    statements behind a transaction-pooling PgBouncer), or the pooler's own refusal (08P01:
    ``query_wait_timeout``, a pooler that cannot reach the server). Nothing was written; the
    message names the cause and the fix; retrying may succeed."""


class CommitOutcomeUnknownError(StoreUnavailableError):
    """The connection was lost while COMMIT was in flight: the write may or may not be stored.

    On PostgreSQL a commit's common case is one query that the server commits as it ends (see
    :func:`fsm.store.create_engine`, ``one_query``): a connection lost while that query is in
    flight is this error too. Retry the same call with the same idempotency key (a turn's
    ``response_id`` or ``idempotency_key``): the store then commits it exactly once, or
    returns the stored turn.
    """

    #: the command line's exit status: retry with the same key
    exit_code: ClassVar[int] = EXIT_OUTCOME_UNKNOWN


class StorageFullError(StoreError):
    """The database has no room left (SQLite: the disk or the file size limit is full;
    PostgreSQL: ``disk_full``/``out_of_memory``-class errors). Nothing of the call was written;
    free space, then retry."""

    #: the command line's exit status: the disk or the database is full
    exit_code: ClassVar[int] = EXIT_FULL


class DatabaseUrlError(StoreError, ValueError):
    """A database URL cannot be used: it does not parse, or names an engine fsm does not store
    to. The message shows what a valid URL looks like."""

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE


class DriverMissingError(StoreError, ImportError):
    """The database driver the URL needs is not installed (the message names the package)."""

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE


class DatabaseFileError(StoreError):
    """A SQLite database file cannot be used: it is not a database, or it (or its folder) is
    read-only. ``path`` names the file."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class DatabaseCorruptError(StoreError):
    """The database engine reports its own storage corrupt (SQLite ``SQLITE_CORRUPT`` /
    ``quick_check``, PostgreSQL ``data_corrupted``/``index_corrupted``). Restore from a backup;
    ``fsm audit check --db URL`` lists what the engine found."""

    #: the command line's exit status: the database is corrupt
    exit_code: ClassVar[int] = EXIT_CORRUPT


class ConversationNotFoundError(StoreError, LookupError):
    """No conversation has this id. ``replica`` names the reader database it was looked up in
    when that was not the primary (``read_url=``): the message then says that replication lag
    may be why (a conversation just created on the primary may not have reached it yet)."""

    def __init__(self, conversation_id: str, *, replica: str | None = None) -> None:
        self.conversation_id = conversation_id
        self.replica = replica
        if replica is None:
            super().__init__(
                f"no conversation {conversation_id!r} in the store "
                "(create it first with create_conversation())"
            )
        else:
            super().__init__(
                f"no conversation {conversation_id!r} on the replica {replica}: replication "
                "lag may be why (it may exist on the primary and not have reached the replica "
                "yet); retry, or read it from the primary"
            )


class ConversationExistsError(StoreError):
    """``create_conversation`` was given an id that is already taken."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        super().__init__(f"conversation {conversation_id!r} already exists")


class InvalidConversationIdError(StoreError, ValueError):
    """A conversation id must be a non-empty string of at most 255 characters of clean text (no
    U+0000, no surrogate, not starting with U+FDD0)."""


class InvalidIdempotencyKeyError(StoreError, ValueError):
    """An idempotency key must be a string of clean text (no U+0000, no surrogate, not starting
    with U+FDD0) of at most 512 UTF-8 bytes."""


class InvalidMessageError(StoreError, ValueError):
    """A message given to :meth:`~fsm.store.ConversationStore.append` cannot go to history as is."""


class InvalidTurnError(StoreError, ValueError):
    """What was given as a turn is not one turn (a response with several choices, or no turn)."""


class ResultsError(StoreError, ValueError):
    """The tool results given with a turn do not match its calls one to one.

    Raised for a wrong count, a missing or unknown id, a result whose ``tool_call_id`` names
    another call, or results keyed by id when the turn's ids are empty or repeated (then the
    link is ambiguous: give a list in call order instead).
    """


class IdempotencyMismatchError(StoreError):
    """A turn was committed again under the same response id / idempotency key, but it is not
    the same turn (its assistant message differs from the stored one)."""


class UnsupportedValueError(StoreError, ValueError):
    """A value cannot be stored as it is: a key text longer than the store's limit (512 UTF-8
    bytes for ids, names, models and response ids, as the parser's), or content / metadata that
    is not JSON (NaN, a non-string key, an object that is not a dict, list, string, number,
    bool or None)."""


class ValueRejectedError(StoreError, ValueError):
    """The database refused a write: a check, a key or a type of the schema rejected a value.

    The store validates what it writes, so this means either a value the validation did not
    foresee or a database whose contents already break the contract (see
    :class:`CorruptStoreError`). ``constraint`` names the rule when the engine reports it.
    Nothing was written.
    """

    def __init__(self, message: str, *, constraint: str | None = None) -> None:
        self.constraint = constraint
        super().__init__(message)


class CorruptStoreError(StoreError):
    """The stored history of a conversation breaks the contract the database enforces.

    This happens only when the database was edited with its enforcement switched off (SQLite
    ``PRAGMA foreign_keys=OFF`` or ``PRAGMA ignore_check_constraints=ON``, PostgreSQL
    ``session_replication_role = replica`` or disabled triggers, constraints added ``NOT
    VALID``). The message names the check that lists every violation: ``fsm audit check --db
    URL``.

    ``kind`` names the rule broken, one of :data:`fsm.store.contract.RULES`: the kind under
    which ``fsm audit check`` reports the same violation (``None`` when not known).
    """

    #: the command line's exit status: the database is corrupt
    exit_code: ClassVar[int] = EXIT_CORRUPT

    def __init__(
        self, conversation_id: str, url: str, problem: str, kind: str | None = None
    ) -> None:
        self.conversation_id = conversation_id
        self.url = url
        self.problem = problem
        self.kind = kind
        rule = f"{kind}: " if kind else ""
        super().__init__(
            f"conversation {conversation_id!r} in {url} breaks the history contract "
            f"({rule}{problem}): "
            "the database was edited with its enforcement switched off; "
            f"run: fsm audit check --db '{url}'"
        )


class SchemaNotAtHeadError(StoreError):
    """The database schema is not at the revision this version of fsm needs.

    The message names the command that fixes it (``fsm db upgrade --db URL``) and the Python
    call (``fsm.store.upgrade(URL)``), or says to upgrade fsm when the database was migrated by
    a newer fsm (``unknown=True``).
    """

    def __init__(
        self,
        url: str,
        current: str | None,
        head: str,
        *,
        unknown: bool = False,
        schema: str | None = None,
    ) -> None:
        self.url = url
        self.current = current
        self.head = head
        state = "has no fsm schema" if current is None else f"is at revision {current}"
        if unknown:
            fix = (
                f"revision {current} is unknown to this fsm (a newer fsm upgraded the database): "
                "upgrade fsm"
            )
        elif schema is not None:
            fix = f"run: fsm db upgrade --db '{url}' --schema {schema}"
        else:
            fix = (
                f"run: fsm db upgrade --db '{url}' (from Python: fsm.store.upgrade('{url}'); "
                f"or: alembic -x db='{url}' upgrade head)"
            )
        where = url if schema is None else f"{url} (schema {schema})"
        super().__init__(f"the database {where} {state}, but this fsm needs revision {head}; {fix}")


class UnknownRevisionError(StoreError, ValueError):
    """A schema revision to upgrade to is not in fsm's migrations (the message lists them)."""

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE


class MigrationsNotFoundError(StoreError):
    """The Alembic migration scripts are not where fsm looks for them (a broken install)."""


class StoreLayoutError(StoreError, ValueError):
    """Where or how fsm's tables would be laid out cannot be done on this database: a schema
    name that is not a plain identifier, a schema on SQLite, partitions on SQLite or on a
    database already created unpartitioned, a partition count out of range."""

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE


# -- the audit's errors (fsm.store.audit) -------------------------------------------------------
class AuditError(StoreError):
    """An audit query cannot run as asked (the CLI prints it as one line)."""


class DatabaseNotFoundError(AuditError, FileNotFoundError):
    """The database to read does not exist: a SQLite file that reading commands and audits
    never create, or a PostgreSQL database missing on its server."""


class InvalidFilterError(AuditError, ValueError):
    """A filter is malformed: an unknown state, a bad JSON path, a non-scalar value, ..."""

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE


class PendingTurnError(ConflictError):
    """The conversation has a pending turn (begun in the tool ledger, neither committed nor
    abandoned), or another process now owns it: this write must wait.

    Resume the pending turn (``store.pending(conversation)``, then ``store.claim(...)``; the
    agent loop does this by itself), or ``abandon`` it, then retry. ``pending_id`` is the
    pending turn's id, ``actual_seq`` the seq it will take.
    """

    def __init__(self, conversation_id: str, pending_id: int, at_seq: int, why: str) -> None:
        self.conversation_id = conversation_id
        self.pending_id = pending_id
        self.expected_seq = at_seq
        self.actual_seq = at_seq
        StoreError.__init__(self, f"conversation {conversation_id!r}: {why}")


class HostTransactionError(StoreError):
    """The caller's transaction given to ``bind()`` has already failed: on PostgreSQL, a
    statement that raised aborts the whole transaction, and the server refuses every later one
    (SQLSTATE 25P02, "current transaction is aborted"). Nothing was written; roll the
    transaction back and run the unit of work again (or run the statement that may fail in a
    savepoint, ``connection.begin_nested()``, so that its failure leaves the transaction
    usable)."""


class TurnInProgressError(PendingTurnError):
    """The conversation's pending turn has a live owner: its lease (renewed by the owner's
    heartbeat while its tools run) has not run out, so its tools may be running right now and
    it is not taken over.

    Retryable: wait ``retry_after`` seconds (until the lease runs out, by the database's clock)
    and run again, or answer "busy" to whoever asked; the owner commits the turn or its lease
    runs out (the owner is gone) and the next claim takes it. ``owner`` is the owner's token,
    ``lease_expires_at`` the end of its lease (an aware UTC datetime), ``pending_id`` the turn.
    """

    def __init__(
        self,
        conversation_id: str,
        pending_id: int,
        at_seq: int,
        owner: str,
        lease_expires_at: datetime,
        retry_after: float,
    ) -> None:
        self.owner = owner
        self.lease_expires_at = lease_expires_at
        self.retry_after = max(0.0, retry_after)
        super().__init__(
            conversation_id,
            pending_id,
            at_seq,
            f"pending turn {pending_id} is in progress: its owner ({owner[:8]}...) holds it "
            f"until {lease_expires_at.isoformat(timespec='milliseconds')} (in "
            f"{self.retry_after:.1f} s) and its tools may be running; retry after that (the "
            "owner commits it, or it is gone and the turn can be resumed)",
        )


class LedgerStateError(StoreError):
    """A ledger step does not fit what the ledger recorded: a call finished with another
    outcome than the one given now, a step on a turn already committed or abandoned, or a commit
    before every call finished. Nothing was changed; the message says what is recorded."""
