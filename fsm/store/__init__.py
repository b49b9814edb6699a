"""The conversation store: history that can always be sent back to the model as it is.

.. code-block:: python

    from fsm import parse
    from fsm.store import ConversationStore

    with ConversationStore("sqlite:///chat.db") as store:   # fsm db upgrade --db ... first
        cid = store.create_conversation()
        store.append(cid, [{"role": "user", "content": "Weather in Paris?"}])
        turn = parse(stream).turn(0)
        if turn.complete:
            store.commit_turn(cid, turn, ["18 C, sunny"])   # one result per call, in order
        else:
            store.record_attempt(cid, turn)                 # audit only, never history
        messages = store.history(cid)                       # ready for the next request

The database enforces the contract itself (see :mod:`fsm.store.models`); this package also
holds the engine factory (:mod:`fsm.store.engine`) and the migration helpers
(:mod:`fsm.store.migrate`).
"""

from __future__ import annotations

from fsm.store.engine import create_engine, default_url
from fsm.store.errors import (
    CommitOutcomeUnknownError,
    ConflictError,
    ConversationExistsError,
    ConversationNotFoundError,
    CorruptStoreError,
    DatabaseCorruptError,
    DatabaseFileError,
    DatabaseUrlError,
    DriverMissingError,
    IdempotencyMismatchError,
    InvalidConversationIdError,
    InvalidIdempotencyKeyError,
    InvalidMessageError,
    InvalidTurnError,
    MigrationsNotFoundError,
    ResultsError,
    RetryableStoreError,
    SchemaNotAtHeadError,
    StorageFullError,
    StoreBusyError,
    StoreError,
    StoreUnavailableError,
    UnsupportedValueError,
    ValueRejectedError,
)
from fsm.store.migrate import current_revision, head_revision, upgrade
from fsm.store.models import Base
from fsm.store.store import CommittedTurn, ConversationStore, Results

__all__ = [
    "Base",
    "CommitOutcomeUnknownError",
    "CommittedTurn",
    "ConflictError",
    "ConversationExistsError",
    "ConversationNotFoundError",
    "ConversationStore",
    "CorruptStoreError",
    "DatabaseCorruptError",
    "DatabaseFileError",
    "DatabaseUrlError",
    "DriverMissingError",
    "IdempotencyMismatchError",
    "InvalidConversationIdError",
    "InvalidIdempotencyKeyError",
    "InvalidMessageError",
    "InvalidTurnError",
    "MigrationsNotFoundError",
    "Results",
    "ResultsError",
    "RetryableStoreError",
    "SchemaNotAtHeadError",
    "StorageFullError",
    "StoreBusyError",
    "StoreError",
    "StoreUnavailableError",
    "UnsupportedValueError",
    "ValueRejectedError",
    "create_engine",
    "current_revision",
    "default_url",
    "head_revision",
    "upgrade",
]
