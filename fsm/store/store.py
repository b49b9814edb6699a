"""``ConversationStore``: conversation history that can always be sent back to the model.

The store's logic lives in one place, :class:`StoreCore`, shared by this synchronous store and
by :class:`~fsm.store.aio.AsyncConversationStore`: validation that needs no database (it runs
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
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine

from fsm.errors import IncompleteTurnError
from fsm.parser import Anomaly, ParseResult, Turn
from fsm.states import ToolCallState
from fsm.store.engine import (
    BUSY_TIMEOUT_SECONDS,
    WRITE,
    create_engine,
    display_url,
    normalize_url,
)
from fsm.store.errors import (
    ConflictError,
    ConversationExistsError,
    ConversationNotFoundError,
    IdempotencyMismatchError,
    InvalidConversationIdError,
    InvalidMessageError,
    InvalidTurnError,
    ResultsError,
    StoreBusyError,
    UnsupportedValueError,
)
from fsm.store.migrate import ensure_at_head
from fsm.store.models import Attempt, AttemptCall, Conversation, Message, ToolCallRow
from fsm.toolcall import ToolCall

__all__ = ["CommittedTurn", "ConversationStore", "Results", "StoreCore"]

#: Tool results of a turn: one per call in call order (a string, or a dict with ``content``),
#: or a mapping from call id to result when the turn's ids are unique and non-empty.
Results = Sequence[str | Mapping[str, Any]] | Mapping[str, str | Mapping[str, Any]]

_PLAIN_ROLES = ("system", "developer", "user", "assistant")
_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "reasoning_content", "tool_calls"},
}
_RESULT_KEYS = {"role", "content", "tool_call_id"}

#: The isolation level of PostgreSQL read transactions: one snapshot for every statement.
READ_SNAPSHOT = "REPEATABLE READ"


@dataclass(frozen=True, slots=True)
class CommittedTurn:
    """What :meth:`ConversationStore.commit_turn` stored (or had stored before).

    ``messages`` is the assistant message followed by its tool results, exactly as
    :meth:`ConversationStore.history` returns them; ``seq`` is the assistant message's seq;
    ``created`` is false when the same turn had been committed before and the stored copy is
    returned (an idempotent retry).
    """

    conversation_id: str
    seq: int
    messages: list[dict[str, Any]]
    created: bool

    @property
    def next_seq(self) -> int:
        """The seq right after this turn's last result."""
        return self.seq + len(self.messages)


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """A turn validated for :meth:`StoreCore.commit_turn` (built by :meth:`StoreCore.plan_turn`
    before any transaction)."""

    turn: Turn
    calls: list[ToolCall]
    contents: list[tuple[str | None, list[Any] | None]]
    assistant: dict[str, Any]


#: The attempts of one :meth:`ConversationStore.record_attempt` call: one ``attempts`` row per
#: choice, each with the rows of its calls (built by :meth:`StoreCore.plan_attempt`).
AttemptPlan = list[tuple[dict[str, Any], list[dict[str, Any]]]]


class ConversationStore:
    """Conversation history in SQLite or PostgreSQL, valid by construction.

    Args:
        url: a SQLAlchemy URL (``sqlite:///path.db``, ``postgresql+psycopg://user@host/db``).
            ``None`` means the embedded default: ``$FSM_DB_URL`` if set, else the SQLite file
            ``$FSM_DB``, else ``./fsm.db``.
        auto_upgrade: migrate the schema to the current revision when opening. The default
            (``None``) does so only for the embedded default database (``url=None`` resolving to
            SQLite); any other database not at the current revision raises
            :class:`~fsm.store.errors.SchemaNotAtHeadError`, which names the command to run
            (``fsm db upgrade --db URL``).
        busy_timeout: SQLite only: seconds a write waits for another process's write to finish
            before raising :class:`~fsm.store.errors.StoreBusyError` (retryable).

    The store owns an engine; call :meth:`close` (or use it as a context manager) when done.
    Methods are safe to call from several threads and processes at once. For asyncio code, see
    :class:`~fsm.store.aio.AsyncConversationStore` (the same API, awaited).
    """

    def __init__(
        self,
        url: str | URL | None = None,
        *,
        auto_upgrade: bool | None = None,
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
    ) -> None:
        self._url = normalize_url(url)
        self._engine = create_engine(self._url, busy_timeout=busy_timeout)
        self._writer = self._engine.execution_options(**{WRITE: True})
        dialect = self._engine.dialect.name
        self._core = StoreCore(self._url, postgres=dialect == "postgresql")
        if auto_upgrade is None:
            auto_upgrade = url is None and dialect == "sqlite"
        try:
            ensure_at_head(self._engine, auto_upgrade=auto_upgrade)
        except BaseException:
            self._engine.dispose()
            raise

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for inspection, events and raw SQL in tests)."""
        return self._engine

    @property
    def url(self) -> str:
        """The database URL, password masked."""
        return display_url(self._url)

    def close(self) -> None:
        """Release the store's connections."""
        self._engine.dispose()

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
        try:
            with self._core.translate(), self._writer.begin() as conn:
                self._core.insert_conversation(conn, row)
        except sa_exc.IntegrityError as exc:
            if exist_ok:
                return str(row["id"])
            raise ConversationExistsError(row["id"]) from exc
        return str(row["id"])

    def delete_conversation(self, conversation_id: str) -> bool:
        """Delete a conversation with all its messages, calls and attempts.

        Returns whether it existed.
        """
        with self._core.translate(), self._writer.begin() as conn:
            return self._core.delete_conversation(conn, conversation_id)

    def next_seq(self, conversation_id: str) -> int:
        """The seq the next message of the conversation will get (its number of messages).

        Pass it as ``expected_seq`` to a later write to detect that someone wrote in between.
        """
        with self._engine.connect() as conn:
            return self._core.next_seq(conn, conversation_id)

    # -- writes ------------------------------------------------------------------------------
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
        rows = self._core.plain_rows(messages)
        with self._core.translate(), self._writer.begin() as conn:
            return self._core.append(conn, conversation_id, rows, expected_seq)

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
        plan = self._core.plan_turn(turn, results)
        with self._core.translate(), self._writer.begin() as conn:
            return self._core.commit_turn(
                conn, conversation_id, plan, expected_seq, idempotency_key
            )

    def record_attempt(
        self,
        conversation_id: str,
        attempt: Turn | ParseResult,
        *,
        anomalies: Sequence[Anomaly] = (),
    ) -> list[int]:
        """Record a turn that did not (or must not) go to history, for audit.

        ``attempt`` is a :class:`~fsm.parser.Turn` or a whole :class:`~fsm.parser.ParseResult`
        (one attempt per choice; one attempt without a choice if the stream had none). Every
        call is kept with its final state, reason and raw arguments, with the parser's
        anomalies (a ``ParseResult`` brings its own; for a bare ``Turn`` pass ``anomalies``).
        Attempts are never part of history. Returns the new attempt ids.
        """
        plan = self._core.plan_attempt(attempt, anomalies)
        with self._core.translate(), self._writer.begin() as conn:
            return self._core.record_attempt(conn, conversation_id, plan)

    # -- reads -------------------------------------------------------------------------------
    def history(
        self,
        conversation_id: str,
        *,
        last: int | None = None,
        include_reasoning: bool = False,
    ) -> list[dict[str, Any]]:
        """The conversation as an OpenAI ``messages`` list, ready to send.

        Tool call ids and arguments are byte-exact; each assistant message with tool calls is
        followed by its results in call order. ``last=N`` returns at most the last ``N``
        messages, starting at a message boundary: a window that would start inside a tool block
        starts after it instead, so a block is never split. ``include_reasoning`` adds
        ``reasoning_content`` to assistant messages that have reasoning (some providers want it
        back). Two queries (messages, then tool calls) in one snapshot, whatever the length of
        the conversation.
        """
        self._core.check_last(last)
        with self._reader() as conn:
            return self._core.history(conn, conversation_id, last, include_reasoning)

    def attempts(self, conversation_id: str) -> list[dict[str, Any]]:
        """The recorded attempts of a conversation, oldest first.

        Each is a dict of the ``attempts`` columns plus ``tool_calls``: one dict per call with
        ``position``, ``index`` (the provider's), ``id``, ``type``, ``name``, ``arguments``,
        ``raw_arguments`` (what the provider sent), ``state``, ``reason`` and ``repaired``.
        """
        with self._reader() as conn:
            return self._core.attempts(conn, conversation_id)

    # -- internals ---------------------------------------------------------------------------
    @contextmanager
    def _reader(self) -> Iterator[Connection]:
        """A read transaction with one snapshot for all its statements (SQLite gives that to
        every transaction; PostgreSQL needs REPEATABLE READ)."""
        with self._engine.connect() as conn:
            if self._core.postgres:
                conn = conn.execution_options(isolation_level=READ_SNAPSHOT)
            with conn.begin():
                yield conn


class StoreCore:
    """The logic of the conversation store, shared by the sync and the async store.

    Two kinds of methods:

    * **plans** (``conversation_row``, ``plain_rows``, ``plan_turn``, ``plan_attempt``):
      validation and row building, no I/O; they raise the store's typed errors before any
      transaction begins;
    * **transaction bodies** (``insert_conversation``, ``delete_conversation``, ``next_seq``,
      ``append``, ``commit_turn``, ``record_attempt``, ``history``, ``attempts``): each takes a
      synchronous :class:`~sqlalchemy.engine.Connection` as its first argument, inside a
      transaction the caller began (a write transaction from the store's writer engine for the
      writes), so that :meth:`AsyncConnection.run_sync
      <sqlalchemy.ext.asyncio.AsyncConnection.run_sync>` can run them unchanged. Writes take the
      conversation's lock first (``FOR UPDATE`` on PostgreSQL; SQLite's ``BEGIN IMMEDIATE``
      already holds the database's write lock).

    Not part of the public API: use :class:`ConversationStore` or
    :class:`~fsm.store.aio.AsyncConversationStore`.
    """

    def __init__(self, url: URL, *, postgres: bool) -> None:
        self.url = display_url(url)
        self.postgres = postgres

    # -- errors ------------------------------------------------------------------------------
    @contextmanager
    def translate(self) -> Iterator[None]:
        """Turn driver errors a caller can act on into typed store errors."""
        try:
            yield
        except sa_exc.OperationalError as exc:
            text = str(exc.orig).lower()
            # SQLite: "database is locked"; PostgreSQL: deadlock, serialization, lock timeout
            sqlstate = getattr(exc.orig, "sqlstate", None)
            if "locked" in text or "busy" in text or sqlstate in ("40P01", "40001", "55P03"):
                raise StoreBusyError(
                    f"the database {self.url} stayed locked by another writer ({exc.orig}); "
                    "retry later"
                ) from exc
            raise

    # -- plans (no I/O) ----------------------------------------------------------------------
    @staticmethod
    def check_last(last: int | None) -> None:
        """``history(last=...)`` takes ``None`` or a non-negative int."""
        if last is not None and (not isinstance(last, int) or last < 0):
            raise ValueError(f"last must be a non-negative integer, not {last!r}")

    def conversation_row(
        self, conversation_id: str | None, metadata: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """The ``conversations`` row to insert (a new random hex id when none is given)."""
        cid = uuid.uuid4().hex if conversation_id is None else conversation_id
        if not isinstance(cid, str) or not cid or len(cid) > 255:
            raise InvalidConversationIdError(
                f"a conversation id is a non-empty string of at most 255 characters, not {cid!r}"
            )
        self._check_text(cid, "the conversation id")
        return {"id": cid, "meta": dict(metadata) if metadata else None}

    def plain_rows(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The rows (without positions) of plain messages given to ``append``."""
        if isinstance(messages, Mapping):
            raise InvalidMessageError("append() takes a list of messages, not a single message")
        return [self._plain_row(i, message) for i, message in enumerate(messages)]

    def plan_turn(self, turn: Turn | ParseResult, results: Results | None) -> TurnPlan:
        """Check that ``turn`` is one complete turn and ``results`` match its calls."""
        single = _single_turn(turn)
        calls = _complete_calls(single)
        contents = _normalize_results(calls, results)
        assistant = _assistant_message(single, calls)
        self._check_values(assistant, contents)
        return TurnPlan(single, calls, contents, assistant)

    def plan_attempt(
        self, attempt: Turn | ParseResult, anomalies: Sequence[Anomaly] = ()
    ) -> AttemptPlan:
        """The ``attempts`` rows (one per choice) and their calls' rows."""
        if isinstance(attempt, ParseResult):
            result: ParseResult | None = attempt
            turns: list[Turn | None] = list(attempt.turns) or [None]
            found: Sequence[Anomaly] = attempt.anomalies
        elif isinstance(attempt, Turn):
            result, turns, found = None, [attempt], anomalies
        else:
            raise InvalidTurnError(
                f"record_attempt() takes a Turn or a ParseResult, not {type(attempt).__name__}"
            )
        plan: AttemptPlan = []
        for turn in turns:
            calls = turn.tool_calls if turn is not None else []
            plan.append(
                (
                    _attempt_row(result, turn, found),
                    [
                        {
                            "position": p,
                            "provider_index": call.index,
                            "call_id": call.id,
                            "type": call.type,
                            "name": call.name,
                            "arguments": call.arguments,
                            "raw_arguments": call.raw_arguments if call.repaired else None,
                            "repaired": call.repaired,
                            "state": call.state,
                            "reason": call.reason,
                        }
                        for p, call in enumerate(calls)
                    ],
                )
            )
        return plan

    # -- transaction bodies ------------------------------------------------------------------
    def insert_conversation(self, conn: Connection, row: Mapping[str, Any]) -> None:
        """Insert a conversation row (an existing id raises ``IntegrityError``)."""
        conn.execute(sa.insert(Conversation), dict(row))

    def delete_conversation(self, conn: Connection, conversation_id: str) -> bool:
        """Delete a conversation and everything of it; whether it existed."""
        if self.postgres:
            # the cascade runs thousands of identical foreign-key checks on large tables:
            # here a cached generic plan is right, and planning each one costs 3-5x
            conn.execute(sa.text("SET LOCAL plan_cache_mode = auto"))
        deleted = conn.execute(
            sa.delete(Conversation).where(Conversation.id == conversation_id)
        ).rowcount
        return bool(deleted)

    def next_seq(self, conn: Connection, conversation_id: str) -> int:
        """The conversation's next seq (``ConversationNotFoundError`` if it does not exist)."""
        _require(conn, conversation_id)
        return _next_seq(conn, conversation_id)

    def append(
        self,
        conn: Connection,
        conversation_id: str,
        prepared: Sequence[Mapping[str, Any]],
        expected_seq: int | None,
    ) -> int:
        """Append rows from :meth:`plain_rows`; returns the next seq after them."""
        _require(conn, conversation_id, lock=self.postgres)
        seq = _next_seq(conn, conversation_id)
        _check_expected(conversation_id, expected_seq, seq)
        if not prepared:
            return seq
        rows = []
        for offset, row in enumerate(prepared):
            at = seq + offset
            rows.append(
                {
                    **row,
                    "conversation_id": conversation_id,
                    "seq": at,
                    "prev_seq": at - 1 if at else None,
                    "prev_slots_left": 0 if at else None,
                }
            )
        conn.execute(sa.insert(Message), rows)
        return seq + len(rows)

    def commit_turn(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        expected_seq: int | None,
        idempotency_key: str | None,
    ) -> CommittedTurn:
        """Write a planned turn and its results (or return the stored copy of the same turn)."""
        _require(conn, conversation_id, lock=self.postgres)
        turn, calls, contents, assistant = plan.turn, plan.calls, plan.contents, plan.assistant
        n = len(calls)
        seq, stored_at = _position(conn, conversation_id, turn, idempotency_key)
        if stored_at is not None:
            stored = _read(conn, conversation_id, turn_at=stored_at, include_reasoning=False)
            if stored[0] != assistant:
                raise IdempotencyMismatchError(
                    f"conversation {conversation_id!r} already holds a different turn under "
                    + (
                        f"idempotency key {idempotency_key!r} (at seq {stored_at}): use a "
                        "new key for a new turn"
                        if idempotency_key is not None
                        else f"response id {turn.response_id!r}, choice {turn.index} (at seq "
                        f"{stored_at}); if the server reuses response ids, give each request "
                        "its own idempotency_key"
                    )
                )
            return CommittedTurn(conversation_id, stored_at, stored, created=False)
        _check_expected(conversation_id, expected_seq, seq)
        conn.execute(
            sa.insert(Message),
            {
                "conversation_id": conversation_id,
                "seq": seq,
                "role": "assistant",
                "content": turn.content,
                "refusal": turn.refusal,
                "reasoning": turn.reasoning,
                "model": turn.model,
                "response_id": turn.response_id or None,
                "choice": turn.index,
                "finish_reason": turn.finish_reason,
                "usage": turn.usage,
                "idempotency_key": idempotency_key,
                "n_calls": n,
                "slots_left": n,
                "prev_seq": seq - 1 if seq else None,
                "prev_slots_left": 0 if seq else None,
                "block_end_seq": seq + n if n else None,
            },
        )
        if n:
            conn.execute(
                sa.insert(ToolCallRow),
                [
                    {
                        "conversation_id": conversation_id,
                        "assistant_seq": seq,
                        "position": p,
                        "assistant_n_calls": n,
                        "call_id": call.id,
                        "provider_index": call.index,
                        "type": call.type,
                        "name": call.name,
                        "arguments": call.arguments,
                        "raw_arguments": call.raw_arguments if call.repaired else None,
                        "repaired": call.repaired,
                        "state": call.state,
                    }
                    for p, call in enumerate(calls)
                ],
            )
            conn.execute(
                sa.insert(Message),
                [
                    {
                        "conversation_id": conversation_id,
                        "seq": seq + 1 + p,
                        "role": "tool",
                        "content": text,
                        "content_parts": parts,
                        "tool_call_id": call.id,
                        "assistant_seq": seq,
                        "call_position": p,
                        "slots_left": n - 1 - p,
                        "prev_seq": seq + p,
                        "prev_slots_left": n - p,
                    }
                    for p, (call, (text, parts)) in enumerate(zip(calls, contents, strict=True))
                ],
            )
        messages = [assistant] + [
            _tool_message(call.id, text, parts)
            for call, (text, parts) in zip(calls, contents, strict=True)
        ]
        return CommittedTurn(conversation_id, seq, messages, created=True)

    def record_attempt(
        self, conn: Connection, conversation_id: str, plan: AttemptPlan
    ) -> list[int]:
        """Insert planned attempts at the conversation's current position; their ids."""
        _require(conn, conversation_id, lock=self.postgres)
        at_seq = _next_seq(conn, conversation_id)
        ids: list[int] = []
        for row, calls in plan:
            attempt_id = conn.execute(
                sa.insert(Attempt).returning(Attempt.id),
                {**row, "conversation_id": conversation_id, "at_seq": at_seq},
            ).scalar_one()
            ids.append(attempt_id)
            if calls:
                conn.execute(
                    sa.insert(AttemptCall), [{**call, "attempt_id": attempt_id} for call in calls]
                )
        return ids

    def history(
        self, conn: Connection, conversation_id: str, last: int | None, include_reasoning: bool
    ) -> list[dict[str, Any]]:
        """The history (see :meth:`ConversationStore.history`), in a read transaction."""
        messages = _read(conn, conversation_id, last=last, include_reasoning=include_reasoning)
        if not messages:
            _require(conn, conversation_id)
        return messages

    def attempts(self, conn: Connection, conversation_id: str) -> list[dict[str, Any]]:
        """The attempts (see :meth:`ConversationStore.attempts`), in a read transaction."""
        _require(conn, conversation_id)
        rows = (
            conn.execute(
                sa.select(Attempt)
                .where(Attempt.conversation_id == conversation_id)
                .order_by(Attempt.id)
            )
            .mappings()
            .all()
        )
        calls = (
            conn.execute(
                sa.select(AttemptCall)
                .join(Attempt, Attempt.id == AttemptCall.attempt_id)
                .where(Attempt.conversation_id == conversation_id)
                .order_by(AttemptCall.attempt_id, AttemptCall.position)
            )
            .mappings()
            .all()
        )
        by_attempt: dict[int, list[dict[str, Any]]] = {}
        for call in calls:
            by_attempt.setdefault(call["attempt_id"], []).append(
                {
                    "position": call["position"],
                    "index": call["provider_index"],
                    "id": call["call_id"],
                    "type": call["type"],
                    "name": call["name"],
                    "arguments": call["arguments"],
                    "raw_arguments": call["raw_arguments"] or call["arguments"],
                    "state": call["state"].value,
                    "reason": call["reason"],
                    "repaired": call["repaired"],
                }
            )
        return [{**row, "tool_calls": by_attempt.get(row["id"], [])} for row in rows]

    # -- validation --------------------------------------------------------------------------
    def _check_text(self, value: str | None, what: str) -> None:
        if self.postgres and value is not None and "\x00" in value:
            raise UnsupportedValueError(
                f"{what} contains the character U+0000, which PostgreSQL text cannot store; "
                "use SQLite or remove it"
            )

    def _check_values(
        self, assistant: Mapping[str, Any], contents: Sequence[tuple[str | None, Any]]
    ) -> None:
        if not self.postgres:
            return
        for key in ("content", "refusal"):
            self._check_text(assistant.get(key), f"the assistant {key}")
        for call in assistant.get("tool_calls", []):
            self._check_text(call["id"], "a tool call id")
            self._check_text(call["function"]["name"], "a tool call name")
            self._check_text(call["function"]["arguments"], "tool call arguments")
        for text, _parts in contents:
            self._check_text(text, "a tool result")

    def _plain_row(self, i: int, message: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(message, Mapping):
            raise InvalidMessageError(f"message {i} is not a dict: {message!r}")
        role = message.get("role")
        if role == "tool":
            raise InvalidMessageError(
                f"message {i} is a tool result: results go in with their turn, "
                "through commit_turn()"
            )
        if role not in _PLAIN_ROLES:
            raise InvalidMessageError(
                f"message {i} has role {role!r}; append() takes {', '.join(_PLAIN_ROLES)}"
            )
        extra = set(message) - _MESSAGE_KEYS[role]
        if extra:
            raise InvalidMessageError(
                f"message {i} ({role}) has keys fsm does not store: {sorted(extra)}"
            )
        if message.get("tool_calls"):
            raise InvalidMessageError(
                f"message {i} is an assistant message with tool calls: commit it with its "
                "results through commit_turn()"
            )
        content = message.get("content")
        refusal = message.get("refusal")
        text, parts = _content(content, f"message {i}")
        if content is None and not (role == "assistant" and refusal is not None):
            raise InvalidMessageError(f"message {i} ({role}) has no content")
        for key in ("name", "refusal", "reasoning_content"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise InvalidMessageError(f"message {i}: {key} must be a string, not {value!r}")
            self._check_text(value, f"message {i}'s {key}")
        self._check_text(text, f"message {i}'s content")
        return {
            "role": role,
            "content": text,
            "content_parts": parts,
            "name": message.get("name"),
            "refusal": refusal,
            "reasoning": message.get("reasoning_content"),
        }


# -- helpers -----------------------------------------------------------------------------------
def _require(conn: Connection, conversation_id: str, *, lock: bool = False) -> None:
    """Raise ConversationNotFoundError unless the conversation exists; ``lock`` takes its
    row lock (``SELECT ... FOR UPDATE``) for the rest of the transaction."""
    query = sa.select(Conversation.id).where(Conversation.id == conversation_id)
    if lock:
        query = query.with_for_update()
    if conn.execute(query).first() is None:
        raise ConversationNotFoundError(conversation_id)


def _next_seq(conn: Connection, conversation_id: str) -> int:
    last = conn.execute(
        sa.select(sa.func.max(Message.seq)).where(Message.conversation_id == conversation_id)
    ).scalar()
    return _after(last)


def _position(
    conn: Connection, conversation_id: str, turn: Turn, idempotency_key: str | None
) -> tuple[int, int | None]:
    """The next seq, and the seq of an earlier commit of the same turn (or ``None``): the
    same idempotency key if one is given, else the same response id and choice."""
    last_seq = (
        sa.select(sa.func.max(Message.seq))
        .where(Message.conversation_id == conversation_id)
        .scalar_subquery()
    )
    same: sa.ColumnElement[bool]
    if idempotency_key is not None:
        same = Message.idempotency_key == idempotency_key
    elif turn.response_id:
        same = sa.and_(
            Message.response_id == turn.response_id,
            Message.choice == turn.index,
            Message.role == "assistant",
        )
    else:
        return _next_seq(conn, conversation_id), None
    stored = (
        sa.select(sa.func.min(Message.seq))
        .where(Message.conversation_id == conversation_id, same)
        .scalar_subquery()
    )
    last, at = conn.execute(sa.select(last_seq, stored)).one()
    return _after(last), at


def _read(
    conn: Connection,
    conversation_id: str,
    *,
    turn_at: int | None = None,
    last: int | None = None,
    include_reasoning: bool,
) -> list[dict[str, Any]]:
    """The whole history, the window of the ``last`` messages, or the turn whose assistant
    message is at seq ``turn_at``.

    Two plain range scans of primary keys (messages, then tool calls), merged here: their
    cost is linear in what is read whatever the planner's statistics say (a join can be
    planned as a nested loop on tables that were never analyzed). Call it inside one
    transaction with a stable snapshot, so both scans see the same commits.
    """
    m, t = Message, ToolCallRow
    query = (
        sa.select(
            m.seq,
            sa.type_coerce(m.role, sa.String),  # plain text: no per-row enum processing
            m.content,
            m.content_parts,
            m.name,
            m.refusal,
            m.reasoning if include_reasoning else sa.null(),
            m.tool_call_id,
            m.n_calls,
        )
        .where(m.conversation_id == conversation_id)
        .order_by(m.seq)
    )
    if turn_at is not None:
        n_calls = (
            sa.select(m.n_calls)
            .where(m.conversation_id == conversation_id, m.seq == turn_at)
            .scalar_subquery()
        )
        query = query.where(m.seq >= turn_at, m.seq <= turn_at + n_calls)
    if last is not None:
        if last == 0:
            return []
        first = (
            sa.select(sa.func.max(m.seq) - (last - 1))
            .where(m.conversation_id == conversation_id)
            .scalar_subquery()
        )
        query = query.where(m.seq >= first)
    rows = conn.execute(query).all()
    start = 0
    if last is not None:
        # a window starts at a message boundary: drop results whose assistant is outside
        while start < len(rows) and rows[start][1] == "tool":
            start += 1
    messages: list[dict[str, Any]] = []
    calls_of: dict[int, list[dict[str, Any]]] = {}
    for seq, role, content, parts, name, refusal, reasoning, tool_call_id, n_calls in (
        rows[start:] if start else rows
    ):
        message: dict[str, Any]
        if role == "tool":
            message = {"role": role, "tool_call_id": tool_call_id, "content": content}
        else:
            message = {"role": role, "content": content}
            if name is not None:
                message["name"] = name
            if refusal is not None:
                message["refusal"] = refusal
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if n_calls:
                calls_of[seq] = message["tool_calls"] = []
        if parts is not None:
            message["content"] = parts
        messages.append(message)
    if calls_of:
        calls = conn.execute(
            sa.select(t.assistant_seq, t.call_id, t.type, t.name, t.arguments)
            .where(
                t.conversation_id == conversation_id,
                t.assistant_seq >= min(calls_of),
                t.assistant_seq <= max(calls_of),
            )
            .order_by(t.assistant_seq, t.position)
        )
        for assistant_seq, call_id, kind, name, arguments in calls:
            calls_of[assistant_seq].append(
                {
                    "id": call_id,
                    "type": kind,
                    "function": {"name": name, "arguments": arguments},
                }
            )
    return messages


def _after(last_seq: int | None) -> int:
    """The seq after ``last_seq`` (the max seq of a conversation, ``None`` when it is empty)."""
    return 0 if last_seq is None else int(last_seq) + 1


def _check_expected(conversation_id: str, expected: int | None, actual: int) -> None:
    if expected is not None and expected != actual:
        raise ConflictError(conversation_id, expected, actual)


def _single_turn(turn: Turn | ParseResult) -> Turn:
    if isinstance(turn, Turn):
        return turn
    if isinstance(turn, ParseResult):
        if len(turn.turns) == 1:
            return turn.turns[0]
        raise InvalidTurnError(
            f"the response has {len(turn.turns)} choices; pass the one to commit "
            "(result.turn(index))"
        )
    raise InvalidTurnError(f"commit_turn() takes a Turn, not {type(turn).__name__}")


def _complete_calls(turn: Turn) -> list[ToolCall]:
    calls = turn.tool_calls
    if turn.complete and all(c.state is ToolCallState.FINISHED for c in calls):
        return calls
    states = {p: (c.state.value, c.reason) for p, c in enumerate(calls)}
    bad = [
        f"call {p} ({c.name or 'no name'}) is {c.state.value}"
        + (f" ({c.reason})" if c.reason else "")
        for p, c in enumerate(calls)
        if c.state is not ToolCallState.FINISHED
    ]
    why = "; ".join(bad) if bad else f"the stream ended with {turn.end_reason or 'no end'}"
    raise IncompleteTurnError(
        f"choice {turn.index} is not a complete turn ({why}): nothing was written to history; "
        "record it with record_attempt() instead",
        choice=turn.index,
        states=states,
    )


def _content(value: Any, where: str) -> tuple[str | None, list[Any] | None]:
    """Split a message content into (text, parts)."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, list) and all(isinstance(part, Mapping) for part in value):
        return None, [dict(part) for part in value]
    raise InvalidMessageError(
        f"{where}: content must be a string or a list of content-part dicts, not {value!r}"
    )


def _normalize_results(
    calls: Sequence[ToolCall], results: Results | None
) -> list[tuple[str | None, list[Any] | None]]:
    """One (text, parts) per call, in call order; every mismatch is a ResultsError."""
    ids = [c.id for c in calls]
    if results is None:
        results = []
    if isinstance(results, Mapping):
        if not calls:
            ordered: list[Any] = list(results.values())
        else:
            if "" in ids or len(set(ids)) != len(ids):
                raise ResultsError(
                    f"results keyed by id are ambiguous for this turn: its call ids {ids!r} are "
                    "empty or repeated; give a list of results in call order instead"
                )
            unknown = [key for key in results if key not in ids]
            missing = [cid for cid in ids if cid not in results]
            if unknown or missing:
                raise ResultsError(
                    f"results do not match the turn's calls: missing {missing!r}, "
                    f"unknown {unknown!r} (call ids: {ids!r})"
                )
            ordered = [results[cid] for cid in ids]
    elif isinstance(results, str | bytes) or not isinstance(results, Sequence):
        raise ResultsError(
            f"results must be a list in call order or a dict keyed by call id, not "
            f"{type(results).__name__}"
        )
    else:
        ordered = list(results)
    if len(ordered) != len(calls):
        raise ResultsError(
            f"the turn has {len(calls)} tool call(s) but {len(ordered)} result(s) were given; "
            "give exactly one result per call"
        )
    out: list[tuple[str | None, list[Any] | None]] = []
    for p, (call, result) in enumerate(zip(calls, ordered, strict=True)):
        where = f"result {p} (call {call.id!r}, {call.name})"
        if isinstance(result, str):
            out.append((result, None))
            continue
        if not isinstance(result, Mapping):
            raise ResultsError(f"{where} must be a string or a dict, not {result!r}")
        extra = set(result) - _RESULT_KEYS
        if extra:
            raise ResultsError(f"{where} has keys fsm does not store: {sorted(extra)}")
        if result.get("role", "tool") != "tool":
            raise ResultsError(f"{where} has role {result['role']!r}, not 'tool'")
        if "tool_call_id" in result and result["tool_call_id"] != call.id:
            raise ResultsError(
                f"{where} says tool_call_id {result['tool_call_id']!r}: results are out of order "
                "or belong to another turn"
            )
        if result.get("content") is None:
            raise ResultsError(f"{where} has no content")
        try:
            out.append(_content(result["content"], where))
        except InvalidMessageError as exc:
            raise ResultsError(str(exc)) from None
    return out


def _assistant_message(turn: Turn, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The assistant message as history returns it (as ``Turn.to_message()`` builds it)."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.refusal is not None:
        message["refusal"] = turn.refusal
    if calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return message


def _tool_message(call_id: str, text: str | None, parts: list[Any] | None) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text if parts is None else parts}


def _attempt_row(
    result: ParseResult | None, turn: Turn | None, anomalies: Sequence[Anomaly]
) -> dict[str, Any]:
    """The ``attempts`` row of one choice (``turn``) of a response (``result``, if known)."""
    choice = turn.index if turn is not None else None
    row: dict[str, Any] = {
        "choice": choice,
        "anomalies": [
            dataclasses.asdict(a) for a in anomalies if a.choice is None or a.choice == choice
        ],
        "end_how": result.end_how if result is not None else None,
        "end_reason": result.end_reason if result is not None else None,
        "complete": False,
    }
    if result is not None:
        row.update(response_id=result.response_id, model=result.model, usage=result.usage)
    if turn is not None:
        row.update(
            response_id=turn.response_id,
            model=turn.model,
            usage=turn.usage,
            finish_reason=turn.finish_reason,
            complete=turn.complete,
            content=turn.content,
            reasoning=turn.reasoning,
            refusal=turn.refusal,
        )
        row["end_how"] = turn.end_reason or row["end_how"]
    return row
