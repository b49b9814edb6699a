"""``ConversationStore``: conversation history that can always be sent back to the model.

The store's logic lives in one place, :class:`~fsm.store.core.StoreCore`, shared by this
synchronous store and by :class:`~fsm.store.aio.AsyncConversationStore`: validation that needs no database (it runs
before any transaction), and *transaction bodies*, plain functions of a synchronous
:class:`~sqlalchemy.engine.Connection` inside an open transaction. The sync store calls them
directly; the async store runs the very same functions through
:meth:`AsyncConnection.run_sync <sqlalchemy.ext.asyncio.AsyncConnection.run_sync>`, SQLAlchemy's
documented way to share synchronous code with asyncio.

Each store owns its transactions: writes begin with ``BEGIN IMMEDIATE`` on SQLite (one writer per
database at a time, across processes) and take the conversation row's lock (``SELECT ... FOR
UPDATE``) on PostgreSQL. Inside, the next ``seq`` is read, ``expected_seq`` is checked, and the
rows are inserted; the database's constraints (see :mod:`fsm.store.models`) reject anything that
breaks the contract, so even a bug here could not store an invalid history.

Every operation runs under a deadline (``timeout=``, :data:`~fsm.store.deadline.DEFAULT_TIMEOUT`
seconds by default; PostgreSQL): the server is told it per transaction, and the client arms a
:class:`~fsm.store.deadline.Deadline` on the connection, so a silent network fails the call in
time. A failed write says whether it may have been stored: a connection lost before COMMIT was
sent raises :class:`~fsm.store.errors.StoreUnavailableError` (nothing was written), one lost
while COMMIT was in flight :class:`~fsm.store.errors.CommitOutcomeUnknownError` (retry with the
same idempotency key: the turn lands exactly once).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, overload

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine

from fsm.parser import Anomaly, ParseResult, Turn
from fsm.store import transaction, writes
from fsm.store.bound import BoundStore
from fsm.store.core import ConversationInfo, StoreCore
from fsm.store.deadline import DEFAULT_TIMEOUT, Deadline, check_timeout
from fsm.store.engine import (
    BUSY_TIMEOUT_SECONDS,
    WRITE,
    create_engine,
    display_url,
    normalize_url,
    removed_if_failed,
    require_configured,
    sqlite_file,
    store_schema,
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
from fsm.store.ledger import LedgerMethods
from fsm.store.migrate import ensure_at_head
from fsm.store.plans import (
    MAX_KEY_BYTES,
    Results,
)
from fsm.store.render import HistoryFormat, check_format
from fsm.store.sqlite_turn import bind_turn
from fsm.telemetry import store_write
from fsm.types import AnthropicMessage, ResponsesItem
from fsm.types import Message as HistoryMessage

__all__ = [
    "MAX_KEY_BYTES",
    "BoundStore",
    "CommittedTurn",
    "ConversationInfo",
    "ConversationStore",
    "Results",
    "StoreCore",
]

_T = TypeVar("_T")

#: The isolation level of PostgreSQL read transactions: one snapshot for every statement.
READ_SNAPSHOT = "REPEATABLE READ"


def check_listing(limit: int | None, after: str | None) -> None:
    """``list_conversations`` takes ``limit`` ``None`` or a non-negative int, ``after`` ``None``
    or a string."""
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be None or a non-negative integer, not {limit!r}")
    if after is not None and not isinstance(after, str):
        raise TypeError(f"after must be a conversation id (a str), not {type(after).__name__}")


class ConversationStore(LedgerMethods):
    """Conversation history in SQLite or PostgreSQL, valid by construction.

    Args:
        url: a SQLAlchemy URL (``sqlite:///path.db``, ``postgresql+psycopg://user@host/db``),
            or a filesystem path, taken as a SQLite file (``"chat.db"``, ``Path("~/x.db")``).
            ``None`` means the embedded default: ``$FSM_DB_URL`` if set, else the SQLite file
            ``$FSM_DB``, else ``./fsm.db``. A string that is neither raises
            :class:`~fsm.store.errors.DatabaseUrlError`; a driver that is not installed
            :class:`~fsm.store.errors.DriverMissingError`.
        engine: instead of ``url``, a host application's own
            :class:`~sqlalchemy.engine.Engine` (its pool, its proxy settings, its
            instrumentation). The store borrows it: :meth:`close` leaves it open, and the host
            disposes of it. On SQLite it must have been set up by
            :func:`~fsm.store.configure_engine` (else
            :class:`~fsm.store.EngineNotConfiguredError`); on PostgreSQL that is optional
            (fsm's write transactions then plan their statements as the host's sessions do).
            The schema must be at head unless ``auto_upgrade`` is true (the upgrade then
            connects through the engine's URL). See :meth:`bind` to write inside the host's own
            transactions.
        auto_upgrade: migrate the schema to the current revision when opening. The default
            (``None``) does so for the embedded default database (``url=None`` resolving to
            SQLite), and creates the schema in a new or empty SQLite file; any other database
            not at the current revision raises :class:`~fsm.store.errors.SchemaNotAtHeadError`,
            which names the command to run (``fsm db upgrade --db URL``) and the Python call
            (``fsm.store.upgrade(URL)``). A SQLite file this constructor created is removed
            again if opening fails.
        busy_timeout: SQLite only: seconds a write waits for another process's write to finish
            before raising :class:`~fsm.store.errors.StoreBusyError` (retryable).
        schema: PostgreSQL only: the schema holding fsm's tables (``None``: ``$FSM_SCHEMA``, else
            the connection's ``search_path``); see :func:`fsm.store.engine.store_schema`.
        timeout: PostgreSQL: the deadline of each operation in seconds (default 30; ``None``:
            none). The server gets it per transaction (``statement_timeout``, ``lock_timeout``,
            ``idle_in_transaction_session_timeout``), the client enforces it too (a silent
            network fails the call in time with
            :class:`~fsm.store.errors.StoreUnavailableError`), and it bounds connecting, TCP
            keepalives and ``tcp_user_timeout``.
        read_url: PostgreSQL: a second database to send the store's audit reads to
            (:meth:`list_conversations`, :meth:`attempts`), typically a streaming replica
            (hot standby) of ``url``; the store owns its engine (same ``schema`` and
            ``timeout``). :meth:`history` and :meth:`next_seq` always read the primary: what
            goes back to a model, or decides the next write, must include every acknowledged
            turn, and a replica lags (milliseconds idle, seconds under load). A conversation
            missing on the replica raises :class:`~fsm.store.errors.ConversationNotFoundError`
            saying that replication lag may be why.
        read_engine: instead of ``read_url``, a host's own engine for those reads (borrowed,
            as ``engine=``).

    A store built from a URL owns its engine; call :meth:`close` (or use it as a context
    manager) when done. Methods are safe to call from several threads and processes at once.
    For asyncio code, see :class:`~fsm.store.aio.AsyncConversationStore` (the same API,
    awaited).
    """

    #: the store's core (the ledger's mixin declares the part of it that it uses)
    _core: StoreCore

    def __init__(
        self,
        url: str | URL | None = None,
        *,
        engine: Engine | None = None,
        auto_upgrade: bool | None = None,
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
        schema: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        read_url: str | URL | None = None,
        read_engine: Engine | None = None,
    ) -> None:
        self._timeout = check_timeout(timeout)
        self._busy_timeout = busy_timeout
        self._read_engine: Engine | None = None
        self._owns_read_engine = False
        if read_url is not None and read_engine is not None:
            raise TypeError("ConversationStore takes a read_url or a read_engine, not both")
        if engine is not None:
            if url is not None:
                raise TypeError("ConversationStore takes a url or an engine, not both")
            if not isinstance(engine, Engine):
                raise TypeError(
                    f"engine must be a sqlalchemy Engine, not {type(engine).__name__} (an "
                    "AsyncEngine goes to fsm.store.aio.AsyncConversationStore)"
                )
            self._url = engine.url
            in_schema = store_schema(schema, self._url)
            self._engine = (
                engine
                if in_schema is None
                else engine.execution_options(schema_translate_map={None: in_schema})
            )
            self._owns_engine = False
            self._open_borrowed(auto_upgrade)
            self._open_reader(read_url, read_engine, schema)
            return
        self._url = normalize_url(url)
        self._owns_engine = True
        with removed_if_failed(self._url):
            self._engine = create_engine(
                self._url, busy_timeout=busy_timeout, schema=schema, timeout=self._timeout
            )
            self._writer = self._engine.execution_options(**{WRITE: True})
            dialect = self._engine.dialect.name
            self._core = StoreCore(self._url, postgres=dialect == "postgresql")
            upgrade_empty = auto_upgrade is None and sqlite_file(self._url) is not None
            auto_upgrade = self._core.auto_upgrade(url is not None, dialect, auto_upgrade)
            try:
                ensure_at_head(self._engine, auto_upgrade=auto_upgrade, upgrade_empty=upgrade_empty)
                self._open_reader(read_url, read_engine, schema)
            except BaseException:
                self._engine.dispose()
                raise

    def _open_reader(
        self, read_url: str | URL | None, read_engine: Engine | None, schema: str | None
    ) -> None:
        """Set up the engine of the audit reads (``read_url`` / ``read_engine``), if any: on
        the same engine kind as the primary, PostgreSQL only."""
        if read_url is None and read_engine is None:
            return
        if read_engine is not None and not isinstance(read_engine, Engine):
            raise TypeError(
                f"read_engine must be a sqlalchemy Engine, not {type(read_engine).__name__}"
            )
        if self._engine.dialect.name != "postgresql":
            raise StoreLayoutError(
                "a reader database (read_url / read_engine) is a PostgreSQL feature (a "
                f"streaming replica); {self._engine.dialect.name} has none: drop the option"
            )
        if read_engine is not None:
            in_schema = store_schema(schema, read_engine.url)
            self._read_engine = (
                read_engine
                if in_schema is None
                else read_engine.execution_options(schema_translate_map={None: in_schema})
            )
            return
        parsed = normalize_url(read_url)
        if parsed.get_backend_name() != "postgresql":
            raise StoreLayoutError(
                f"the reader database {display_url(parsed)} is not PostgreSQL: give the URL of "
                "a replica of the primary"
            )
        self._read_engine = create_engine(parsed, schema=schema, timeout=self._timeout)
        self._owns_read_engine = True

    def _open_borrowed(self, auto_upgrade: bool | None) -> None:
        """Set up the store over a host's engine: its schema must be at head (or upgraded when
        ``auto_upgrade`` is true); SQLite engines must have been set up for fsm."""
        self._writer = self._engine.execution_options(**{WRITE: True})
        dialect = self._engine.dialect.name
        self._core = StoreCore(self._url, postgres=dialect == "postgresql")
        with self._engine.connect() as conn:
            require_configured(conn)
        ensure_at_head(
            self._engine, auto_upgrade=self._core.auto_upgrade(True, dialect, auto_upgrade)
        )

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for inspection, events and raw SQL in tests)."""
        return self._engine

    @property
    def url(self) -> str:
        """The database URL, password masked."""
        return display_url(self._url)

    @property
    def owns_engine(self) -> bool:
        """Whether the store made its engine (and :meth:`close` disposes of it); false for a
        host's engine given as ``engine=``."""
        return self._owns_engine

    @property
    def read_url(self) -> str | None:
        """The URL of the reader database (password masked), or ``None``: reads go to the
        primary."""
        return None if self._read_engine is None else display_url(self._read_engine.url)

    def close(self) -> None:
        """Release the store's connections (a borrowed engine is left as it is)."""
        if self._owns_engine:
            self._engine.dispose()
        if self._owns_read_engine and self._read_engine is not None:
            self._read_engine.dispose()

    def bind(self, connection: Connection) -> BoundStore:
        """The store working inside ``connection``'s transaction: the caller's unit of work.

        ``with engine.begin() as conn: conn.execute(...); store.bind(conn).commit_turn(...)``
        commits the host's own rows and the turn together, or neither: the caller's commit or
        rollback decides, and nothing fsm writes there is visible to others before it. The
        view has the store's methods (``create_conversation``, ``append``, ``commit_turn``,
        ``record_attempt``, ``delete_conversation``, ``next_seq``, ``history``, ``attempts``)
        with the same validation, idempotency and typed errors; reads see the transaction's
        own uncommitted writes. See :class:`BoundStore` for what changes (no retry, savepoints,
        locks held until the caller's commit).
        """
        if not isinstance(connection, Connection):
            raise TypeError(
                f"bind() takes a sqlalchemy Connection, not {type(connection).__name__}"
            )
        if connection.dialect.name != self._engine.dialect.name:
            raise TypeError(
                f"bind() got a {connection.dialect.name} connection for a "
                f"{self._engine.dialect.name} store"
            )
        require_configured(connection)
        transaction.check_schema(connection)
        return BoundStore(self._core, connection)

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ConversationStore({self.url!r})"

    # -- conversations -----------------------------------------------------------------------
    def create_conversation(
        self,
        conversation_id: str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        exist_ok: bool = False,
    ) -> str:
        """Create a conversation and return its id (a new random hex id when none is given).

        An id that exists raises :class:`~fsm.store.errors.ConversationExistsError`, unless
        ``exist_ok`` (then the existing conversation is kept as it is).
        """
        row = self._core.conversation_row(conversation_id, metadata)
        with self._core.translate():
            try:
                with self._write() as conn:
                    self._core.insert_conversation(conn, row)
            except sa_exc.IntegrityError as exc:
                if exist_ok:
                    return str(row["id"])
                raise ConversationExistsError(row["id"]) from exc
        return str(row["id"])

    def list_conversations(
        self, *, limit: int | None = 100, after: str | None = None
    ) -> list[ConversationInfo]:
        """The conversations in id order, with their counts and last activity.

        At most ``limit`` of them (``None``: all); ``after`` continues after that id (pass the
        last row's ``key``, or ``id``): keyset pages, stable while conversations are added.
        One query, whatever the number of conversations: each row's counts are read through
        the primary keys and the attempts' conversation index.
        """
        check_listing(limit, after)
        with self._reader(replica=True) as conn:
            return self._core.list_conversations(conn, limit, after)

    def delete_conversation(self, conversation_id: str) -> bool:
        """Delete a conversation with all its messages, calls and attempts.

        Returns whether it existed.
        """
        self._core.check_conversation_id(conversation_id)
        with self._core.translate(), self._write() as conn:
            return self._core.delete_conversation(conn, conversation_id)

    def next_seq(self, conversation_id: str) -> int:
        """The seq the next message of the conversation will get (its number of messages).

        Pass it as ``expected_seq`` to a later write to detect that someone wrote in between.
        """
        self._core.check_conversation_id(conversation_id)
        with self._core.translate(), self._reader() as conn:
            return self._core.next_seq(conn, conversation_id)

    # -- writes ------------------------------------------------------------------------------
    @store_write("append")
    def append(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        expected_seq: int | None = None,
    ) -> int:
        """Append plain messages (system, developer, user, assistant without tool calls).

        Each message is an OpenAI message dict: ``role``, ``content`` (a string, or a list of
        content parts), optionally ``name``; an assistant message may also have ``refusal`` and
        ``reasoning_content``. An assistant message with tool calls must go through
        :meth:`commit_turn` together with its results, and ``tool`` messages only come with
        their turn: both raise :class:`~fsm.store.errors.InvalidMessageError`.

        ``expected_seq``: the seq the first message must get; if another writer appended first,
        :class:`~fsm.store.errors.ConflictError` is raised and nothing is written.
        Returns the conversation's next seq after the write.
        """
        rows = self._core.plan_append(conversation_id, messages)
        with self._core.translate(), self._write() as conn:
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
        """Commit an assistant turn and the results of its tool calls, atomically.

        ``turn`` is a complete :class:`~fsm.parser.Turn` (or a :class:`~fsm.parser.ParseResult`
        with exactly one choice). An incomplete turn raises
        :class:`~fsm.errors.IncompleteTurnError` and writes nothing: record it with
        :meth:`record_attempt` instead. ``results`` holds one result per tool call: a list in
        call order (each a string, or a dict with ``content`` and optionally ``tool_call_id``,
        which must then be the call's id), or a mapping from call id to result, allowed only when
        the turn's ids are unique and non-empty. Anything else raises
        :class:`~fsm.store.errors.ResultsError`.

        The assistant message (content, reasoning, refusal, tool calls byte-exact, model,
        response id, finish reason, usage) and every result are written in one transaction:
        all or nothing.

        Idempotent: if the conversation already holds this turn (the same ``idempotency_key``
        when one is given, else the same non-empty response id and choice), nothing is written
        and the stored turn is returned with ``created=False``; its stored results win over the
        ones given now. If the stored assistant message differs,
        :class:`~fsm.store.errors.IdempotencyMismatchError` is raised (a server that reuses
        response ids needs an idempotency key per request). A turn with neither is always
        written.

        ``expected_seq``: the seq the assistant message must get; if another writer appended
        first, :class:`~fsm.store.errors.ConflictError` (retryable) is raised.
        """
        plan = self._core.plan_commit(conversation_id, turn, results, idempotency_key)
        args = (conversation_id, plan, expected_seq, idempotency_key)
        with self._core.translate():
            bound = None
            if not self._core.postgres:  # the rows bound before BEGIN IMMEDIATE takes the lock
                bound = bind_turn(
                    self._engine.dialect,
                    writes.schema(self._writer),
                    conversation_id,
                    plan,
                    idempotency_key,
                )
            return self._write_at_once(
                lambda conn: self._core.commit_turn_at_once(conn, *args),
                lambda conn: self._core.commit_turn(conn, *args, bound=bound),
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
        """Import a whole existing history, all or nothing, and return the next seq.

        ``messages`` is a conversation as one of the three APIs takes it (``format``:
        ``"chat"``, Chat Completions messages; ``"responses"``, Responses input items;
        ``"anthropic"``, Anthropic messages). Plain messages go in as :meth:`append` writes them;
        each assistant message with tool calls goes in as :meth:`commit_turn` writes a turn,
        with the results that follow it. The same contract the database enforces is checked
        first, and a history that breaks it raises a typed error naming the message, with
        nothing written: a result for no call, a call with no result, a result out of its slot
        (results follow their assistant message, one per call, in call order, each with its
        call's id) are :class:`~fsm.store.errors.ResultsError`; a call whose arguments are not
        JSON or that has no name, or a message fsm cannot store, is
        :class:`~fsm.store.errors.InvalidMessageError`.

        What was imported reads back equal through :meth:`history` in the same format, for
        content as fsm renders it (Responses ``input_image`` parts come back with
        ``detail: "auto"``; an Anthropic user message that holds tool results and text comes
        back as the results' message and a user message of its own). ``expected_seq`` as in
        :meth:`append`.
        """
        plan = plan_import(conversation_id, messages, format)
        with self._core.translate(), self._write() as conn:
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
        """Record a turn that did not (or must not) go to history, for audit.

        ``attempt`` is a :class:`~fsm.parser.Turn` or a whole :class:`~fsm.parser.ParseResult`
        (one attempt per choice; one attempt without a choice if the stream had none). Every
        call is kept with its final state, reason and raw arguments, with the parser's
        anomalies (a ``ParseResult`` brings its own; for a bare ``Turn`` pass ``anomalies``).
        Attempts are never part of history. Returns the new attempt ids.

        ``results``: the results of the calls that ran, in the shapes :meth:`commit_turn` takes
        (a list in call order, which may stop early, or a mapping from call id); each is kept
        with its call (``attempts()`` returns it as the call's ``result``: a string or a list
        of content parts). A result that matches no call is kept as an ``unmatched_result``
        anomaly. ``error``: why the turn failed after its tools ran (a commit that failed).

        Never fails for the values of a failed turn: text is stored losslessly (U+0000, lone
        surrogates, megabytes of reason), and JSON values that no engine stores as they are
        (NaN, infinities, integers beyond 64 bits, nesting deeper than 32) are kept as strings.
        """
        plan = self._core.plan_record(conversation_id, attempt, anomalies, results, error)
        with self._core.translate(), self._write() as conn:
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
        """The conversation as an OpenAI ``messages`` list, ready to send (or, with
        ``format``, as the input of another API).

        Tool call ids and arguments are byte-exact; each assistant message with tool calls is
        followed by its results in call order. ``last=N`` returns the smallest window of at
        least ``N`` messages (all of them when there are fewer) that does not split a tool
        block: the last ``N`` messages, or, when the first of those is a tool result, the window
        that starts at its assistant message instead (so a conversation that ends in a block
        of more than ``N`` messages gives that whole block, never ``[]``); ``last=0`` gives
        ``[]``. ``include_reasoning`` adds
        ``reasoning_content`` to assistant messages that have reasoning (some providers want it
        back). Two queries (messages, then tool calls) in one snapshot, whatever the length of
        the conversation.

        What is read is checked as it is merged (dense seqs, whole tool blocks, results that
        answer their calls, finished calls with a name and JSON arguments, values of the right
        types): a database edited with its enforcement switched off raises
        :class:`~fsm.store.errors.CorruptStoreError`, whose message names the command that lists
        every violation (``fsm audit check --db URL``). ``append``, ``commit_turn`` and
        ``next_seq`` raise it too when the conversation's last message is broken (a text seq,
        result slots left open).

        ``format`` names the API the history is for: ``"chat"`` (Chat Completions
        ``messages``, the default), ``"responses"`` (Responses API ``input`` items: messages,
        ``function_call`` / ``custom_tool_call`` items and one ``function_call_output`` per
        ``call_id``) or ``"anthropic"`` (Messages API ``messages``: each assistant message's
        content blocks, then ONE user message of ``tool_result`` blocks in call order;
        ``system`` and ``developer`` messages are left out, as the API takes them as
        ``system``). A turn read back in the format that wrote it is what its parser's
        ``Turn.to_items()`` / ``Turn.to_anthropic()`` gave, byte-exact (reasoning items with
        ``encrypted_content``, thinking signatures, built-in tool items); read in another
        format, only its text and calls remain (the rule: :mod:`fsm.store.render`). A format
        other than ``"chat"`` costs two more small queries in the same snapshot.
        """
        self._core.check_conversation_id(conversation_id)
        self._core.check_last(last)
        fmt = check_format(format)
        with self._reader() as conn:
            return self._core.history(conn, conversation_id, last, include_reasoning, fmt)

    def attempts(self, conversation_id: str) -> list[dict[str, Any]]:
        """The recorded attempts of a conversation, oldest first.

        Each is a dict of the ``attempts`` columns plus ``tool_calls``: one dict per call with
        ``position``, ``index`` (the provider's), ``id``, ``type``, ``name``, ``arguments``,
        ``raw_arguments`` (what the provider sent), ``state``, ``reason``, ``repaired`` and
        ``result`` (the result given to :meth:`record_attempt`, else ``None``); the attempt's
        ``error`` says why a commit failed after the tools ran.
        """
        self._core.check_conversation_id(conversation_id)
        try:
            with self._reader(replica=True) as conn:
                return self._core.attempts(conn, conversation_id)
        except ConversationNotFoundError as exc:
            if self._read_engine is None:
                raise
            replica = display_url(self._read_engine.url)
            raise ConversationNotFoundError(conversation_id, replica=replica) from exc

    @property
    def dialect(self) -> str:
        """The database's dialect: ``sqlite`` or ``postgresql``."""
        return str(self._engine.dialect.name)

    #: Whether the store writes inside a caller's transaction; never (see :meth:`bind`).
    caller_transaction = False

    # -- internals ---------------------------------------------------------------------------
    @contextmanager
    def _reader(self, *, replica: bool = False) -> Iterator[Connection]:
        """A read transaction with one snapshot for all its statements (SQLite gives that to
        every transaction; PostgreSQL needs REPEATABLE READ), under the deadline; with
        ``replica``, on the reader database when the store has one."""
        engine = self._read_engine if replica and self._read_engine is not None else self._engine
        with engine.connect() as conn:
            if self._core.postgres:
                conn = conn.execution_options(isolation_level=READ_SNAPSHOT)
            with self._transaction(conn, write=False) as conn:
                yield conn

    @functools.cached_property
    def _writers(self) -> threading.RLock | None:
        """SQLite: the lock this process's writers of the database take in turn (looked up
        once: finding the file's real path is a system call per write otherwise)."""
        return None if self._core.postgres else _sqlite_writer_lock(self._url)

    @functools.cached_property
    def _at_once(self) -> bool:
        """PostgreSQL, fsm's own engine on psycopg: a commit's common case is one statement
        sent in one round trip (:data:`~fsm.store.engine_config.AT_ONCE`)."""
        return self._engine in at_once_engines

    def _write_at_once(
        self,
        at_once: Callable[[Connection], _T | None],
        stepwise: Callable[[Connection], _T],
    ) -> _T:
        """A write whose common case is one query that the server commits as it ends
        (PostgreSQL, fsm's own engine: :data:`~fsm.store.engine_config.AT_ONCE`): ``at_once``
        sends that one statement and returns the result, or ``None`` when it wrote nothing;
        then ``stepwise`` decides in a transaction as any other (also where a transaction
        cannot begin at once, and on SQLite)."""
        if self._at_once:
            with self._write(at_once=True) as conn:
                if not began_at_once(conn):  # a transaction as any other
                    return stepwise(conn)
                done = at_once(conn)
            if done is not None:
                return done
        with self._write() as conn:
            return stepwise(conn)

    @contextmanager
    def _write(self, *, at_once: bool = False) -> Iterator[Connection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite), under the deadline.

        SQLite: the threads of this process take the database file's write lock in turn
        (:func:`_sqlite_writer_lock`) before ``BEGIN IMMEDIATE``: SQLite has one writer at a
        time, and its own busy handler makes a waiting writer sleep and poll (up to 100 ms
        between tries), which under contention costs more than the writes. Other processes
        still queue on ``BEGIN IMMEDIATE`` and its busy timeout."""
        lock = self._writers
        if lock is not None and not lock.acquire(timeout=self._busy_timeout):
            raise StoreBusyError(
                f"the database {self._core.url} stayed locked by another writer of this "
                f"process for {self._busy_timeout:g} s (busy_timeout); retry later"
            )
        try:
            with (
                self._writer.connect() as conn,
                self._transaction(conn, write=True, at_once=at_once) as conn,
            ):
                yield conn
        finally:
            if lock is not None:
                lock.release()

    @contextmanager
    def _transaction(
        self, conn: Connection, *, write: bool, at_once: bool = False
    ) -> Iterator[Connection]:
        """Begin, run the body, commit, all under the deadline; a failure that lost the
        connection raises :class:`~fsm.store.errors.StoreUnavailableError` before COMMIT and
        :class:`~fsm.store.errors.CommitOutcomeUnknownError` while the COMMIT of a ``write``
        was in flight (see :meth:`StoreCore.failed`). ``at_once``: the body is one statement
        that commits as it ends (:data:`~fsm.store.engine_config.AT_ONCE`), in flight as a
        COMMIT is."""
        deadline = (
            Deadline(self._timeout, conn.connection.driver_connection)
            if self._core.postgres
            else None
        )
        if at_once:
            conn = conn.execution_options(**{AT_ONCE: True})
        try:
            with conn.begin():  # rolls back on any error, of COMMIT too
                if deadline is not None and at_once and began_at_once(conn):
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
                    conn.invalidate()


# -- helpers -----------------------------------------------------------------------------------
#: one lock per SQLite database file (or in-memory URL) for the writers of this process
_SQLITE_WRITERS: dict[str, threading.RLock] = {}
_SQLITE_WRITERS_GUARD = threading.Lock()


def _sqlite_writer_lock(url: URL) -> threading.RLock:
    """The lock the writers of this process take, in turn, on the SQLite database of ``url``
    (re-entrant: a write inside another one of the same thread does not wait for itself)."""
    path = sqlite_file(url)
    key = str(path.resolve()) if path is not None else url.render_as_string()
    with _SQLITE_WRITERS_GUARD:
        lock = _SQLITE_WRITERS.get(key)
        if lock is None:
            lock = _SQLITE_WRITERS[key] = threading.RLock()
        return lock
