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

Inside a host application: ``ConversationStore(engine=host_engine)`` borrows the host's engine
(set it up with :func:`configure_engine` first), and ``store.bind(conn)`` writes inside the
host's own transaction (:class:`BoundStore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm.lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from fsm.store.engine import (
        WRITE,
        EngineNotConfiguredError,
        configure_engine,
        create_engine,
        default_url,
    )
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
        HostTransactionError,
        IdempotencyMismatchError,
        InvalidConversationIdError,
        InvalidIdempotencyKeyError,
        InvalidMessageError,
        InvalidTurnError,
        LedgerStateError,
        MigrationsNotFoundError,
        PendingTurnError,
        PoolerError,
        ReadOnlyNodeError,
        ResultsError,
        RetryableStoreError,
        SchemaNotAtHeadError,
        ServerFullError,
        StorageFullError,
        StoreBusyError,
        StoreError,
        StoreLayoutError,
        StoreUnavailableError,
        TurnInProgressError,
        UnknownRevisionError,
        UnsupportedValueError,
        ValueRejectedError,
    )
    from fsm.store.ledger import Execution, LedgerCall, PendingTurn
    from fsm.store.migrate import current_revision, head_revision, upgrade
    from fsm.store.models import Base
    from fsm.store.store import (
        BoundStore,
        CommittedTurn,
        ConversationInfo,
        ConversationStore,
        Results,
    )

__all__ = [
    "WRITE",
    "Base",
    "BoundStore",
    "CommitOutcomeUnknownError",
    "CommittedTurn",
    "ConflictError",
    "ConversationExistsError",
    "ConversationInfo",
    "ConversationNotFoundError",
    "ConversationStore",
    "CorruptStoreError",
    "DatabaseCorruptError",
    "DatabaseFileError",
    "DatabaseUrlError",
    "DriverMissingError",
    "EngineNotConfiguredError",
    "Execution",
    "HostTransactionError",
    "IdempotencyMismatchError",
    "InvalidConversationIdError",
    "InvalidIdempotencyKeyError",
    "InvalidMessageError",
    "InvalidTurnError",
    "LedgerCall",
    "LedgerStateError",
    "MigrationsNotFoundError",
    "PendingTurn",
    "PendingTurnError",
    "PoolerError",
    "ReadOnlyNodeError",
    "Results",
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
    "configure_engine",
    "create_engine",
    "current_revision",
    "default_url",
    "head_revision",
    "upgrade",
]

#: where each exported name lives: imported on first use (PEP 562), not by ``import fsm.store``
_EXPORTS: dict[str, tuple[str, ...]] = {
    "fsm.store.engine": (
        "WRITE",
        "EngineNotConfiguredError",
        "configure_engine",
        "create_engine",
        "default_url",
    ),
    "fsm.store.errors": (
        "CommitOutcomeUnknownError",
        "ConflictError",
        "ConversationExistsError",
        "ConversationNotFoundError",
        "CorruptStoreError",
        "DatabaseCorruptError",
        "DatabaseFileError",
        "DatabaseUrlError",
        "DriverMissingError",
        "HostTransactionError",
        "IdempotencyMismatchError",
        "InvalidConversationIdError",
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
    ),
    "fsm.store.ledger": (
        "Execution",
        "LedgerCall",
        "PendingTurn",
    ),
    "fsm.store.migrate": (
        "current_revision",
        "head_revision",
        "upgrade",
    ),
    "fsm.store.models": ("Base",),
    "fsm.store.store": (
        "BoundStore",
        "CommittedTurn",
        "ConversationInfo",
        "ConversationStore",
        "Results",
    ),
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
