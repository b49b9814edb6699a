"""``AsyncConversationStore``: the conversation store for asyncio code.

The same API and the same semantics as :class:`~fsm.store.ConversationStore` (every method is
awaited), on SQLAlchemy's asyncio engine: ``aiosqlite`` for SQLite, psycopg 3's async driver for
PostgreSQL (``postgresql+psycopg://`` selects it by itself). Nothing is copied from the sync
store: validation runs before any I/O through the shared :class:`~fsm.store.store.StoreCore`,
and every transaction body is the sync store's own function, run on the async connection with
:meth:`AsyncConnection.run_sync <sqlalchemy.ext.asyncio.AsyncConnection.run_sync>`. Idempotency,
``expected_seq`` conflicts, locking (``BEGIN IMMEDIATE`` on SQLite, the conversation row's
``FOR UPDATE`` lock on PostgreSQL) and the database's own constraints are therefore the same.

.. code-block:: python

    from fsm.store.aio import AsyncConversationStore

    async with AsyncConversationStore("sqlite:///chat.db") as store:
        cid = await store.create_conversation()
        await store.append(cid, [{"role": "user", "content": "Weather in Paris?"}])
        if turn.complete:
            await store.commit_turn(cid, turn, ["18 C, sunny"])
        else:
            await store.record_attempt(cid, turn)
        messages = await store.history(cid)

URLs: ``sqlite:///path.db`` (or ``sqlite+aiosqlite:///path.db``) and
``postgresql+psycopg://user@host/db`` (or ``postgresql://``). Needs ``aiosqlite`` for SQLite and
``greenlet`` (SQLAlchemy's asyncio layer).

The schema check (and the embedded default's auto-upgrade) happens on first use, or on
``async with``; Alembic itself is synchronous, so that one-time check runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Literal, TypeVar, cast, overload

from sqlalchemy import exc as sa_exc
from sqlalchemy import pool
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from fsm.parser import Anomaly, ParseResult, Turn
from fsm.store.aio_bound import AsyncBoundStore
from fsm.store.bound import BoundStore
from fsm.store.core import ConversationInfo, StoreCore
from fsm.store.deadline import DEFAULT_TIMEOUT, Deadline, check_timeout
from fsm.store.engine import (
    BUSY_TIMEOUT_SECONDS,
    WRITE,
    NewFile,
    async_url,
    create_async_engine,
    create_engine,
    display_url,
    new_sqlite_file,
    removed_if_failed,
    require_configured,
    sqlite_file,
    store_schema,
    sync_url,
)
from fsm.store.engine_config import AT_ONCE, at_once_engines, began_at_once
from fsm.store.errors import (
    ConversationExistsError,
    ConversationNotFoundError,
    StoreBusyError,
    StoreLayoutError,
)
from fsm.store.history import CommittedTurn
from fsm.store.importing import plan_import
from fsm.store.ledger import AsyncLedgerMethods
from fsm.store.migrate import ensure_at_head
from fsm.store.render import HistoryFormat, check_format
from fsm.store.store import READ_SNAPSHOT, Results, check_listing
from fsm.store.transaction import check_schema
from fsm.telemetry import store_write
from fsm.types import AnthropicMessage, Message, ResponsesItem

__all__ = [
    "AsyncBoundStore",
    "AsyncConversationStore",
    "async_url",
    "create_async_engine",
    "sync_url",
]

_T = TypeVar("_T")


class AsyncConversationStore(AsyncLedgerMethods):
    """Conversation history in SQLite or PostgreSQL, valid by construction, for asyncio.

    The asyncio twin of :class:`~fsm.store.ConversationStore`: the same arguments, methods,
    errors and guarantees, each method a coroutine. Several tasks may use one store at once
    (each operation takes its own pooled connection); writers of one conversation queue on its
    lock exactly as with the sync store, and ``expected_seq`` conflicts raise
    :class:`~fsm.store.errors.ConflictError`.

    Args:
        url: a SQLAlchemy URL, or a filesystem path taken as a SQLite file; ``None`` means the
            embedded default (``$FSM_DB_URL``, else the SQLite file ``$FSM_DB``, else
            ``./fsm.db``). A string that is neither raises
            :class:`~fsm.store.errors.DatabaseUrlError`.
        auto_upgrade: migrate the schema to the current revision on first use. The default
            (``None``) does so for the embedded default database, and creates the schema in a
            new or empty SQLite file; any other database not at the current revision raises
            :class:`~fsm.store.errors.SchemaNotAtHeadError`.
        busy_timeout: SQLite only: seconds a write waits for another writer before raising
            :class:`~fsm.store.errors.StoreBusyError` (the wait happens in aiosqlite's thread,
            never blocking the event loop).
        engine: instead of ``url``, a host application's own
            :class:`~sqlalchemy.ext.asyncio.AsyncEngine`, borrowed as with the sync store's
            ``engine=`` (:meth:`close` leaves it open; on SQLite it must have been set up by
            :func:`~fsm.store.configure_engine`); :meth:`bind` writes inside the host's own
            transactions.
        schema: PostgreSQL only: the schema holding fsm's tables (``None``: ``$FSM_SCHEMA``, else
            the connection's ``search_path``).
        timeout: PostgreSQL: the deadline of each operation in seconds (default 30; ``None``:
            none), enforced by the server per transaction and by the client, as for
            :class:`~fsm.store.ConversationStore`.
        read_url: PostgreSQL: a reader database (a streaming replica) for the audit reads
            (:meth:`list_conversations`, :meth:`attempts`), as for
            :class:`~fsm.store.ConversationStore`; :meth:`history` and :meth:`next_seq` read
            the primary.

    Use it with ``async with`` (which checks the schema at once), or call :meth:`close` when
    done. Cancelling a task in the middle of a write rolls that write back: nothing is half
    written.
    """

    #: the store's core (the ledger's mixin declares the part of it that it uses)
    _core: StoreCore

    def __init__(
        self,
        url: str | URL | None = None,
        *,
        engine: AsyncEngine | None = None,
        auto_upgrade: bool | None = None,
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
        schema: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        read_url: str | URL | None = None,
    ) -> None:
        self._timeout = check_timeout(timeout)
        self._read_engine: AsyncEngine | None = None
        if engine is not None:
            if url is not None:
                raise TypeError("AsyncConversationStore takes a url or an engine, not both")
            if not isinstance(engine, AsyncEngine):
                raise TypeError(
                    f"engine must be a sqlalchemy AsyncEngine, not {type(engine).__name__} (an "
                    "Engine goes to fsm.store.ConversationStore)"
                )
            self._url = sync_url(engine.url)
            in_schema = store_schema(schema, self._url)
            self._engine = (
                engine
                if in_schema is None
                else engine.execution_options(schema_translate_map={None: in_schema})
            )
            self._new_file: NewFile | None = None
        else:
            self._url = sync_url(url)
            # the file (and its directory) appear with the engine; a failed open() removes them
            self._new_file = new_sqlite_file(self._url)
            self._engine = create_async_engine(
                self._url, busy_timeout=busy_timeout, schema=schema, timeout=self._timeout
            )
        self._owns_engine = engine is None
        self._schema = schema
        self._writer = self._engine.execution_options(**{WRITE: True})
        dialect = self._engine.dialect.name
        self._core = StoreCore(self._url, postgres=dialect == "postgresql")
        self._upgrade_empty = (
            engine is None and auto_upgrade is None and sqlite_file(self._url) is not None
        )
        self._auto_upgrade = self._core.auto_upgrade(
            url is not None or engine is not None, dialect, auto_upgrade
        )
        self._busy_timeout = busy_timeout
        self._ready = False
        self._ready_lock = asyncio.Lock()
        #: SQLite: the store's writers take turns (see :meth:`_write`)
        self._writers = asyncio.Lock()
        if read_url is not None:
            parsed = sync_url(read_url)
            if dialect != "postgresql" or parsed.get_backend_name() != "postgresql":
                raise StoreLayoutError(
                    "a reader database (read_url) is a PostgreSQL feature (a streaming replica "
                    "of a PostgreSQL primary): drop the option"
                )
            self._read_engine = create_async_engine(parsed, schema=schema, timeout=self._timeout)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def engine(self) -> AsyncEngine:
        """The SQLAlchemy asyncio engine (for inspection and raw SQL in tests)."""
        return self._engine

    @property
    def url(self) -> str:
        """The database URL, password masked."""
        return display_url(self._url)

    async def open(self) -> AsyncConversationStore:
        """Check (or, with ``auto_upgrade``, bring) the schema at the current revision.

        Called by ``async with`` and, once, by the first operation; raises
        :class:`~fsm.store.errors.SchemaNotAtHeadError` naming the command to run.
        """
        if self._ready:
            return self
        async with self._ready_lock:
            if not self._ready:
                if self._owns_engine:
                    await asyncio.to_thread(self._check_schema)
                else:
                    async with self._engine.connect() as conn:
                        await conn.run_sync(self._check_borrowed)
                self._ready = True
        return self

    def _check_borrowed(self, conn: Connection) -> None:
        """The schema check of a borrowed engine, on one of its own connections (the host's
        connection settings, whatever they are); an upgrade goes through its URL."""
        require_configured(conn)
        ensure_at_head(
            cast(Engine, _OneConnection(conn, self._url)), auto_upgrade=self._auto_upgrade
        )

    def _check_schema(self) -> None:
        with removed_if_failed(self._url, self._new_file):
            engine = create_engine(
                self._url,
                busy_timeout=self._busy_timeout,
                poolclass=pool.NullPool,
                schema=self._schema,
            )
            try:
                ensure_at_head(
                    engine, auto_upgrade=self._auto_upgrade, upgrade_empty=self._upgrade_empty
                )
            finally:
                engine.dispose()

    @property
    def owns_engine(self) -> bool:
        """Whether the store made its engine (and :meth:`close` disposes of it)."""
        return self._owns_engine

    @property
    def dialect(self) -> str:
        """The database's dialect: ``sqlite`` or ``postgresql``."""
        return str(self._engine.dialect.name)

    #: Whether the store writes inside a caller's transaction; never (see :meth:`bind`).
    caller_transaction = False

    @property
    def read_url(self) -> str | None:
        """The URL of the reader database (password masked), or ``None``."""
        return None if self._read_engine is None else display_url(sync_url(self._read_engine.url))

    async def close(self) -> None:
        """Release the store's connections (a borrowed engine is left as it is)."""
        if self._owns_engine:
            await self._engine.dispose()
        if self._read_engine is not None:
            await self._read_engine.dispose()

    async def bind(self, connection: AsyncConnection) -> AsyncBoundStore:
        """The store working inside ``connection``'s transaction (the caller's unit of work),
        with the semantics of :meth:`ConversationStore.bind <fsm.store.ConversationStore.bind>`
        and :class:`~fsm.store.store.BoundStore`: the caller's commit or rollback decides, each
        write runs in a savepoint, conflicts raise instead of being retried. Checks the schema
        first, as the store's first operation does."""
        if not isinstance(connection, AsyncConnection):
            raise TypeError(
                f"bind() takes a sqlalchemy AsyncConnection, not {type(connection).__name__}"
            )
        if connection.dialect.name != self._engine.dialect.name:
            raise TypeError(
                f"bind() got a {connection.dialect.name} connection for a "
                f"{self._engine.dialect.name} store"
            )
        await self.open()
        sync_conn = await connection.run_sync(_configured)
        return AsyncBoundStore(self._core, connection, BoundStore(self._core, sync_conn))

    async def __aenter__(self) -> AsyncConversationStore:
        try:
            return await self.open()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncConversationStore({self.url!r})"

    # -- conversations -----------------------------------------------------------------------
    async def create_conversation(
        self,
        conversation_id: str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        exist_ok: bool = False,
    ) -> str:
        """Create a conversation and return its id (see
        :meth:`ConversationStore.create_conversation <fsm.store.ConversationStore.create_conversation>`)."""
        row = self._core.conversation_row(conversation_id, metadata)
        await self.open()
        with self._core.translate():
            try:
                async with self._write() as conn:
                    await conn.run_sync(self._core.insert_conversation, row)
            except sa_exc.IntegrityError as exc:
                if exist_ok:
                    return str(row["id"])
                raise ConversationExistsError(row["id"]) from exc
        return str(row["id"])

    async def delete_conversation(self, conversation_id: str) -> bool:
        """Delete a conversation with all its messages, calls and attempts; whether it existed."""
        self._core.check_conversation_id(conversation_id)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(self._core.delete_conversation, conversation_id)

    async def list_conversations(
        self, *, limit: int | None = 100, after: str | None = None
    ) -> list[ConversationInfo]:
        """The conversations in id order, with their counts and last activity (see
        :meth:`ConversationStore.list_conversations
        <fsm.store.ConversationStore.list_conversations>`)."""
        check_listing(limit, after)
        await self.open()
        async with self._reader(replica=True) as conn:
            return await conn.run_sync(self._core.list_conversations, limit, after)

    async def next_seq(self, conversation_id: str) -> int:
        """The seq the next message of the conversation will get (its number of messages)."""
        self._core.check_conversation_id(conversation_id)
        await self.open()
        with self._core.translate():
            async with self._reader() as conn:
                return await conn.run_sync(self._core.next_seq, conversation_id)

    # -- writes ------------------------------------------------------------------------------
    @store_write("append")
    async def append(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        expected_seq: int | None = None,
    ) -> int:
        """Append plain messages; returns the next seq (see
        :meth:`ConversationStore.append <fsm.store.ConversationStore.append>`)."""
        rows = self._core.plan_append(conversation_id, messages)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(self._core.append, conversation_id, rows, expected_seq)

    @store_write("commit_turn")
    async def commit_turn(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        results: Results | None = None,
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommittedTurn:
        """Commit a complete turn and its tool results in one transaction (see
        :meth:`ConversationStore.commit_turn <fsm.store.ConversationStore.commit_turn>`:
        incomplete turns raise :class:`~fsm.errors.IncompleteTurnError`, retries are
        idempotent, a stale ``expected_seq`` raises :class:`~fsm.store.errors.ConflictError`)."""
        plan = self._core.plan_commit(conversation_id, turn, results, idempotency_key)
        args = (conversation_id, plan, expected_seq, idempotency_key)
        await self.open()
        with self._core.translate():
            return await self._write_at_once(
                lambda conn: self._core.commit_turn_at_once(conn, *args),
                lambda conn: self._core.commit_turn(conn, *args),
            )

    @store_write("import_history")
    async def import_history(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        format: str = "chat",
        expected_seq: int | None = None,
    ) -> int:
        """:meth:`ConversationStore.import_history <fsm.store.ConversationStore.import_history>`:
        a whole history, all or nothing, after the same checks."""
        plan = plan_import(conversation_id, messages, format)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                seq: int = await conn.run_sync(
                    self._core.import_history, conversation_id, plan, expected_seq
                )
                return seq

    @store_write("record_attempt")
    async def record_attempt(
        self,
        conversation_id: str,
        attempt: Turn | ParseResult,
        *,
        results: Results | None = None,
        error: str | None = None,
        anomalies: Sequence[Anomaly] = (),
    ) -> list[int]:
        """Record a turn that did not (or must not) go to history, for audit, with the results
        of the calls that ran and the ``error`` that stopped it; the new attempt ids (see
        :meth:`ConversationStore.record_attempt <fsm.store.ConversationStore.record_attempt>`:
        it never fails for the values of a failed turn)."""
        plan = self._core.plan_record(conversation_id, attempt, anomalies, results, error)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(self._core.record_attempt, conversation_id, plan)

    # -- reads -------------------------------------------------------------------------------
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["chat"] = ...,
    ) -> list[Message]: ...
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["responses"],
    ) -> list[ResponsesItem]: ...
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["anthropic"],
    ) -> list[AnthropicMessage]: ...
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: HistoryFormat = ...,
    ) -> list[Message] | list[ResponsesItem] | list[AnthropicMessage]: ...
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = None,
        include_reasoning: bool = False,
        format: HistoryFormat = "chat",
    ) -> list[Message] | list[ResponsesItem] | list[AnthropicMessage]:
        """The conversation as an OpenAI ``messages`` list, ready to send, or as the input of
        the API ``format`` names (see
        :meth:`ConversationStore.history <fsm.store.ConversationStore.history>`)."""
        self._core.check_conversation_id(conversation_id)
        self._core.check_last(last)
        fmt = check_format(format)
        await self.open()
        async with self._reader() as conn:
            return await conn.run_sync(
                self._core.history, conversation_id, last, include_reasoning, fmt
            )

    async def attempts(self, conversation_id: str) -> list[dict[str, Any]]:
        """The recorded attempts of a conversation, oldest first (see
        :meth:`ConversationStore.attempts <fsm.store.ConversationStore.attempts>`)."""
        self._core.check_conversation_id(conversation_id)
        await self.open()
        try:
            async with self._reader(replica=True) as conn:
                return await conn.run_sync(self._core.attempts, conversation_id)
        except ConversationNotFoundError as exc:
            if self.read_url is None:
                raise
            raise ConversationNotFoundError(conversation_id, replica=self.read_url) from exc

    # -- internals ---------------------------------------------------------------------------
    @asynccontextmanager
    async def _reader(self, *, replica: bool = False) -> AsyncIterator[AsyncConnection]:
        """A read transaction with one snapshot for all its statements (with ``replica``, on
        the reader database when there is one)."""
        engine = self._read_engine if replica and self._read_engine is not None else self._engine
        async with engine.connect() as conn:
            if self._core.postgres:
                conn = await conn.execution_options(isolation_level=READ_SNAPSHOT)
            async with self._transaction(conn, write=False) as conn:
                yield conn

    @property
    def _at_once(self) -> bool:
        """PostgreSQL, fsm's own engine on psycopg: a commit's common case is one statement
        sent in one round trip (:data:`~fsm.store.engine_config.AT_ONCE`)."""
        return self._engine.sync_engine in at_once_engines

    async def _write_at_once(
        self,
        at_once: Callable[[Connection], _T | None],
        stepwise: Callable[[Connection], _T],
    ) -> _T:
        """The sync store's ``_write_at_once``, awaited: ``at_once`` (run in the write's
        greenlet) sends the one statement of the common case and returns the result, or
        ``None`` when it wrote nothing; then ``stepwise`` decides in a transaction as any other
        (also where a transaction cannot begin at once, and on SQLite)."""
        if self._at_once:
            async with self._write(at_once=True) as conn:
                if not _began_at_once(conn):  # a transaction as any other
                    return await conn.run_sync(stepwise)
                done = await conn.run_sync(at_once)
            if done is not None:
                return done
        async with self._write() as conn:
            return await conn.run_sync(stepwise)

    @asynccontextmanager
    async def _write(self, *, at_once: bool = False) -> AsyncIterator[AsyncConnection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite), under the deadline.

        SQLite: the store's tasks take turns (an :class:`asyncio.Lock`) before ``BEGIN
        IMMEDIATE``, as the sync store's threads do, instead of sleeping and polling in
        SQLite's busy handler; other stores and processes queue on ``BEGIN IMMEDIATE``."""
        lock = None if self._core.postgres else self._writers
        if lock is not None:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the lock when
                # the acquire completes just as the task is cancelled, and the cancellation is
                # lost (a heartbeat cancelled then ran on forever)
                async with asyncio.timeout(self._busy_timeout):
                    await lock.acquire()
            except TimeoutError:
                raise StoreBusyError(
                    f"the database {self._core.url} stayed locked by another writer of this "
                    f"store for {self._busy_timeout:g} s (busy_timeout); retry later"
                ) from None
        try:
            async with (
                self._writer.connect() as conn,
                self._transaction(conn, write=True, at_once=at_once) as conn,
            ):
                yield conn
        finally:
            if lock is not None:
                lock.release()

    @asynccontextmanager
    async def _transaction(
        self, conn: AsyncConnection, *, write: bool, at_once: bool = False
    ) -> AsyncIterator[AsyncConnection]:
        """Begin, run the body, commit, under the deadline, as the sync store's
        ``_transaction`` (a lost connection is told apart by
        :meth:`~fsm.store.store.StoreCore.failed`; ``at_once`` as there)."""
        deadline = None
        if self._core.postgres:
            raw = await conn.get_raw_connection()
            deadline = Deadline(self._timeout, raw.driver_connection)
        if at_once:
            conn = await conn.execution_options(**{AT_ONCE: True})
        try:
            async with conn.begin():  # rolls back on any error, of COMMIT too
                if deadline is not None and at_once and _began_at_once(conn):
                    deadline.committing = True
                yield conn
                if deadline is not None:
                    deadline.committing = write
        except BaseException as exc:
            typed = self._core.failed(exc, deadline)
            if typed is None:
                raise
            raise typed from exc
        finally:
            if deadline is not None:
                deadline.cancel()
                if deadline.fired and not conn.invalidated:
                    # the deadline passed (maybe just as the call ended): the socket is shut
                    await conn.invalidate()


def _began_at_once(conn: AsyncConnection) -> bool:
    """:func:`~fsm.store.engine_config.began_at_once` of an asyncio connection."""
    sync = conn.sync_connection
    return sync is not None and began_at_once(sync)


def _configured(conn: Connection) -> Connection:
    """``conn`` (the sync side of an async connection), checked to be set up for fsm and on a
    schema at this fsm's revision."""
    require_configured(conn)
    check_schema(conn)
    return conn


class _OneConnection:
    """What :func:`~fsm.store.migrate.ensure_at_head` uses of an engine (``connect()`` and
    ``url``), served by one existing connection."""

    def __init__(self, conn: Connection, url: URL) -> None:
        self._conn = conn
        self.url = url

    def get_execution_options(self) -> Any:
        """The connection's execution options (its ``schema_translate_map`` names the schema)."""
        return self._conn.get_execution_options()

    @contextlib.contextmanager
    def connect(self) -> Iterator[Connection]:
        yield self._conn
