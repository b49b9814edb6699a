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

from fsm.errors import FsmError

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
    "IdempotencyMismatchError",
    "InvalidConversationIdError",
    "InvalidFilterError",
    "InvalidIdempotencyKeyError",
    "InvalidMessageError",
    "InvalidTurnError",
    "LedgerStateError",
    "MigrationsNotFoundError",
    "PendingTurnError",
    "ResultsError",
    "RetryableStoreError",
    "SchemaNotAtHeadError",
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


class StoreUnavailableError(RetryableStoreError):
    """The database could not be reached or stopped answering: the connection was refused or
    reset, the server shut down, or an operation passed its deadline.

    The fault came before COMMIT was sent, so nothing of the call was written; retrying later
    is safe. The driver's error is chained as ``__cause__``.
    """


class CommitOutcomeUnknownError(StoreUnavailableError):
    """The connection was lost while COMMIT was in flight: the write may or may not be stored.

    Retry the same call with the same idempotency key (a turn's ``response_id`` or
    ``idempotency_key``): the store then commits it exactly once, or returns the stored turn.
    """


class StorageFullError(StoreError):
    """The database has no room left (SQLite: the disk or the file size limit is full;
    PostgreSQL: ``disk_full``/``out_of_memory``-class errors). Nothing of the call was written;
    free space, then retry."""


class DatabaseUrlError(StoreError, ValueError):
    """A database URL cannot be used: it does not parse, or names an engine fsm does not store
    to. The message shows what a valid URL looks like."""


class DriverMissingError(StoreError, ImportError):
    """The database driver the URL needs is not installed (the message names the package)."""


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


class ConversationNotFoundError(StoreError, LookupError):
    """No conversation has this id."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        super().__init__(
            f"no conversation {conversation_id!r} in the store "
            "(create it first with create_conversation())"
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
    """

    def __init__(self, conversation_id: str, url: str, problem: str) -> None:
        self.conversation_id = conversation_id
        self.url = url
        self.problem = problem
        super().__init__(
            f"conversation {conversation_id!r} in {url} breaks the history contract ({problem}): "
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


class MigrationsNotFoundError(StoreError):
    """The Alembic migration scripts are not where fsm looks for them (a broken install)."""


class StoreLayoutError(StoreError, ValueError):
    """Where or how fsm's tables would be laid out cannot be done on this database: a schema
    name that is not a plain identifier, a schema on SQLite, partitions on SQLite or on a
    database already created unpartitioned, a partition count out of range."""


# -- the audit's errors (fsm.store.audit) -------------------------------------------------------
class AuditError(StoreError):
    """An audit query cannot run as asked (the CLI prints it as one line)."""


class DatabaseNotFoundError(AuditError, FileNotFoundError):
    """The database to read does not exist: a SQLite file that reading commands and audits
    never create, or a PostgreSQL database missing on its server."""


class InvalidFilterError(AuditError, ValueError):
    """A filter is malformed: an unknown state, a bad JSON path, a non-scalar value, ..."""


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
