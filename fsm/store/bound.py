"""A store's view inside a caller's transaction: :class:`BoundStore`
(:meth:`ConversationStore.bind <fsm.store.store.ConversationStore.bind>`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, overload

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from fsm.parser import Anomaly, ParseResult, Turn
from fsm.store import transaction
from fsm.store.core import StoreCore
from fsm.store.errors import (
    ConversationExistsError,
    ValueRejectedError,
)
from fsm.store.history import CommittedTurn
from fsm.store.importing import plan_import
from fsm.store.plans import (
    Results,
)
from fsm.store.render import HistoryFormat, check_format
from fsm.telemetry import store_write
from fsm.types import AnthropicMessage, ResponsesItem
from fsm.types import Message as HistoryMessage

__all__ = ["BoundStore"]


class BoundStore:
    """A store's view inside a caller's :class:`~sqlalchemy.engine.Connection`
    (:meth:`ConversationStore.bind`): fsm's writes join the caller's transaction.

    .. code-block:: python

        store = ConversationStore(engine=engine)   # the host's engine (configure_engine first)
        with engine.begin() as conn:               # the host's unit of work
            conn.execute(orders.insert().values(id=7, status="paid"))
            store.bind(conn).commit_turn(cid, turn, results)
        # committed together; an exception in the block rolls back both

    With an ORM session, bind its connection: ``store.bind(session.connection())`` (the
    session's commit then commits the turn too).

    What differs from the store's own methods:

    * **The caller's commit decides.** Nothing is committed here; the returned values (a
      :class:`CommittedTurn`, attempt ids, the next seq) describe rows that exist only if the
      caller commits. A transaction is begun on ``connection`` if none is (SQLAlchemy's
      autobegin).
    * **All or nothing, per call.** Each write runs in a ``SAVEPOINT``: if it raises, what it
      wrote is rolled back to that savepoint and the caller's transaction goes on (on
      PostgreSQL too, where an error otherwise aborts the whole transaction), so the caller may,
      say, record an attempt instead and still commit its own rows.
    * **No retry.** fsm cannot retry inside a transaction it does not own: a stale
      ``expected_seq`` raises :class:`~fsm.store.errors.ConflictError`, a lock that could not be
      had (SQLite busy, a PostgreSQL deadlock or serialization failure) raises
      :class:`~fsm.store.errors.StoreBusyError`, both retryable: roll the whole unit of work
      back and run it again. On SQLite, begin the caller's transaction with ``BEGIN IMMEDIATE``
      when it writes fsm rows (``engine.connect().execution_options(fsm_write=True)``, with
      an engine set up by :func:`~fsm.store.configure_engine`): a deferred transaction that
      read first cannot wait for another writer and fails with ``StoreBusyError`` at once.
    * **Locks last until the caller's commit**: on PostgreSQL the conversation's row lock
      (``FOR UPDATE``), on SQLite the database's write lock. Keep the transaction short.
    * **Deferred checks run at the caller's COMMIT**: a tool block is complete by then (fsm
      writes whole blocks), so they hold; a raw write by the caller that breaks the contract
      fails that COMMIT.
    * Reads (``history``, ``attempts``, ``next_seq``) run in the caller's transaction at its
      isolation level, and see its own uncommitted writes.
    * On PostgreSQL, the caller's transaction is not given ``enable_seqscan = off``
      (fsm's own write transactions are): its settings are the caller's.
    """

    caller_transaction = True

    def __init__(self, core: StoreCore, connection: Connection) -> None:
        self._core = core
        self._conn = connection

    @property
    def connection(self) -> Connection:
        """The caller's connection."""
        return self._conn

    @property
    def dialect(self) -> str:
        """The database's dialect: ``sqlite`` or ``postgresql``."""
        return str(self._conn.dialect.name)

    def __repr__(self) -> str:
        return f"BoundStore({self._core.url!r})"

    @contextmanager
    def _savepoint(self, *, race: bool = False) -> Iterator[Connection]:
        """A write in a savepoint of the caller's transaction, its driver errors typed (see
        :mod:`fsm.store.transaction`); ``race``: a broken unique key at REPEATABLE READ or
        SERIALIZABLE is a lost race (retryable), not a rejected value."""
        with self._guard():
            try:
                with self._core.translate(), self._conn.begin_nested():
                    yield self._conn
            except ValueRejectedError as exc:
                lost = transaction.lost_snapshot_race(exc, self._conn) if race else None
                if lost is None:
                    raise
                raise lost from exc.__cause__

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """The driver errors of the caller's transaction as typed errors: already failed,
        a serialization failure or deadlock, a schema older than this fsm."""
        try:
            yield
        except sa_exc.DBAPIError as exc:
            typed = transaction.host_error(exc, self._conn)
            if typed is None:
                raise
            raise typed from exc

    # -- conversations -----------------------------------------------------------------------
    def create_conversation(
        self,
        conversation_id: str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        exist_ok: bool = False,
    ) -> str:
        """:meth:`ConversationStore.create_conversation`, in the caller's transaction."""
        row = self._core.conversation_row(conversation_id, metadata)
        try:
            with self._savepoint() as conn:
                self._core.insert_conversation(conn, row)
        except ValueRejectedError as exc:
            if not isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise
            if exist_ok:
                return str(row["id"])
            raise ConversationExistsError(row["id"]) from exc.__cause__
        return str(row["id"])

    def delete_conversation(self, conversation_id: str) -> bool:
        """:meth:`ConversationStore.delete_conversation`, in the caller's transaction."""
        self._core.check_conversation_id(conversation_id)
        with self._savepoint() as conn:
            return self._core.delete_conversation(conn, conversation_id)

    def next_seq(self, conversation_id: str) -> int:
        """:meth:`ConversationStore.next_seq`, in the caller's transaction."""
        self._core.check_conversation_id(conversation_id)
        with self._guard():
            return self._core.next_seq(self._conn, conversation_id)

    # -- writes ------------------------------------------------------------------------------
    @store_write("append")
    def append(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        expected_seq: int | None = None,
    ) -> int:
        """:meth:`ConversationStore.append`, in the caller's transaction."""
        rows = self._core.plan_append(conversation_id, messages)
        with self._savepoint(race=True) as conn:
            return self._core.append(conn, conversation_id, rows, expected_seq)

    @store_write("commit_turn")
    def commit_turn(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        results: Results | None = None,
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommittedTurn:
        """:meth:`ConversationStore.commit_turn`, in the caller's transaction (written, not
        committed: the caller's commit makes it part of history)."""
        plan = self._core.plan_commit(conversation_id, turn, results, idempotency_key)
        with self._savepoint(race=True) as conn:
            return self._core.commit_turn(
                conn, conversation_id, plan, expected_seq, idempotency_key
            )

    @store_write("import_history")
    def import_history(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        format: str = "chat",
        expected_seq: int | None = None,
    ) -> int:
        """:meth:`ConversationStore.import_history`, in the caller's transaction."""
        plan = plan_import(conversation_id, messages, format)
        with self._savepoint() as conn:
            return self._core.import_history(conn, conversation_id, plan, expected_seq)

    @store_write("record_attempt")
    def record_attempt(
        self,
        conversation_id: str,
        attempt: Turn | ParseResult,
        *,
        results: Results | None = None,
        error: str | None = None,
        anomalies: Sequence[Anomaly] = (),
    ) -> list[int]:
        """:meth:`ConversationStore.record_attempt`, in the caller's transaction."""
        plan = self._core.plan_record(conversation_id, attempt, anomalies, results, error)
        with self._savepoint(race=True) as conn:
            return self._core.record_attempt(conn, conversation_id, plan)

    # -- reads -------------------------------------------------------------------------------
    @overload
    def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["chat"] = ...,
    ) -> list[HistoryMessage]: ...
    @overload
    def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["responses"],
    ) -> list[ResponsesItem]: ...
    @overload
    def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["anthropic"],
    ) -> list[AnthropicMessage]: ...
    @overload
    def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: HistoryFormat = ...,
    ) -> list[HistoryMessage] | list[ResponsesItem] | list[AnthropicMessage]: ...
    def history(
        self,
        conversation_id: str,
        *,
        last: int | None = None,
        include_reasoning: bool = False,
        format: HistoryFormat = "chat",
    ) -> list[HistoryMessage] | list[ResponsesItem] | list[AnthropicMessage]:
        """:meth:`ConversationStore.history`, in the caller's transaction."""
        self._core.check_conversation_id(conversation_id)
        self._core.check_last(last)
        fmt = check_format(format)
        with self._guard():
            return self._core.history(self._conn, conversation_id, last, include_reasoning, fmt)

    def attempts(self, conversation_id: str) -> list[dict[str, Any]]:
        """:meth:`ConversationStore.attempts`, in the caller's transaction."""
        self._core.check_conversation_id(conversation_id)
        with self._guard():
            return self._core.attempts(self._conn, conversation_id)
