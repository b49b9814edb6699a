"""The store's logic, shared by the sync and the async store: :class:`StoreCore`, and the rows
it lists (:class:`ConversationInfo`, public as ``fsm.store.ConversationInfo``).

Its plans (validation and row building, no I/O) come from :mod:`fsm.store.plans`; its
transaction bodies are plain functions of a synchronous
:class:`~sqlalchemy.engine.Connection` inside an open transaction, which
:class:`~fsm.store.store.ConversationStore` calls directly and
:class:`~fsm.store.aio.AsyncConversationStore` through ``run_sync``. :class:`StoreCore` is not part of the public API.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection

from fsm.states import ToolCallState
from fsm.store import plans, writes
from fsm.store.codec import as_utc
from fsm.store.deadline import Deadline, server_refused
from fsm.store.engine import display_url
from fsm.store.engine_config import FIRST
from fsm.store.errors import (
    CommitOutcomeUnknownError,
    ConversationNotFoundError,
    CorruptStoreError,
    IdempotencyMismatchError,
    StoreBusyError,
    StoreError,
    StoreUnavailableError,
    ValueRejectedError,
)
from fsm.store.history import BoundRows, CommittedTurn, WriteState
from fsm.store.history import Corrupt as _Corrupt
from fsm.store.history import check_expected as _check_expected
from fsm.store.history import first_line as _first_line
from fsm.store.history import is_int as _is_int
from fsm.store.history import next_seq as _next_seq
from fsm.store.history import read_history as _read
from fsm.store.history import read_provider as _read_provider
from fsm.store.history import require_conversation as _require
from fsm.store.importing import ImportPlan
from fsm.store.ledger import pending_error
from fsm.store.models import Attempt, AttemptCall, Conversation, Message
from fsm.store.plans import (
    AttemptPlan,
    TurnPlan,
    json_safe,
    show,
    tool_message,
)
from fsm.store.render import HistoryFormat, render
from fsm.types import Message as HistoryMessage

__all__ = ["ConversationInfo", "StoreCore", "assistant_row", "turn_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationInfo:
    """One conversation as :meth:`ConversationStore.list_conversations` lists it.

    ``messages`` is its number of history messages (its next seq), ``turns`` how many of them
    are assistant messages, ``attempts`` how many failed turns were recorded for it;
    ``last_activity`` is the time of its newest message or attempt (its ``created_at`` when it
    has neither). Times are aware UTC datetimes on every engine.
    """

    id: str
    created_at: datetime | None
    messages: int
    turns: int
    attempts: int
    last_activity: datetime | None
    metadata: dict[str, Any] | None

    @property
    def key(self) -> str:
        """The id: pass it as ``after=`` for the next page."""
        return self.id

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class StoreCore:
    """The logic of the conversation store, shared by the sync and the async store.

    Two kinds of methods:

    * **plans** (``conversation_row``, ``plain_rows``, ``plan_turn``, ``plan_attempt``, the
      ``check_*`` functions): validation and row building, no I/O, defined in
      :mod:`fsm.store.plans`; they raise the store's typed errors before any transaction
      begins;
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
        """Turn driver errors a caller can act on into typed store errors: a lost race or a
        busy database into :class:`~fsm.store.errors.StoreBusyError` (retryable), a value the
        database refuses (a constraint, a type, a size limit) into
        :class:`~fsm.store.errors.ValueRejectedError`, with a one-line message."""
        try:
            yield
        except sa_exc.OperationalError as exc:
            text = str(exc.orig).lower()
            # SQLite: "database is locked"; PostgreSQL: deadlock, serialization, lock timeout
            sqlstate = getattr(exc.orig, "sqlstate", None) or ""
            if "locked" in text or "busy" in text or sqlstate in ("40P01", "40001", "55P03"):
                raise StoreBusyError(
                    f"the database {self.url} stayed locked by another writer "
                    f"({_first_line(exc.orig)}); retry later"
                ) from exc
            if sqlstate.startswith("54") or "too big" in text or "too large" in text:
                # PostgreSQL program limits (an index row too large), SQLite "string or blob
                # too big"
                raise self._rejected(exc) from exc
            raise
        except (sa_exc.IntegrityError, sa_exc.DataError) as exc:
            raise self._rejected(exc) from exc
        except sa_exc.StatementError as exc:
            if isinstance(exc, sa_exc.DBAPIError):
                raise
            # a bind parameter that could not be converted (say, JSON that is not strict)
            raise ValueRejectedError(
                f"a value could not be written to {self.url}: {_first_line(exc.orig)}"
            ) from exc

    def failed(self, exc: BaseException, deadline: Deadline | None) -> StoreError | None:
        """The error a failed transaction raises instead of ``exc``, or ``None`` to keep it.

        Only a lost connection is decided here (anything else keeps its own error): on
        PostgreSQL, lost while COMMIT was in flight (``deadline.committing``) it is
        :class:`~fsm.store.errors.CommitOutcomeUnknownError`, whatever the driver said, since
        the server may have committed before the connection went; lost earlier, and through
        the client's deadline, it is :class:`~fsm.store.errors.StoreUnavailableError` naming
        the deadline. (SQLite commits in-process: a failed COMMIT there is never unknown.)
        """
        if deadline is None or isinstance(exc, CommitOutcomeUnknownError):
            return None
        if deadline.committing and server_refused(exc):
            # the server answered the statement that commits with an error of its own: it
            # rolled the transaction back (a transaction begun at once: a read-only node, ...)
            deadline.committing = False
        lost = (
            deadline.fired
            or isinstance(exc, StoreUnavailableError)
            or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)
        )
        if not lost:
            return None
        cause = (
            f"no answer within the deadline of {deadline.seconds:g} s (timeout=)"
            if deadline.fired
            else _first_line(exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc)
        )
        if deadline.committing:
            return CommitOutcomeUnknownError(
                f"the connection to {self.url} was lost while COMMIT was in flight (or the "
                f"one query of a commit, which commits as it ends) ({cause}): "
                "the write may or may not be stored; retry the same call with the same "
                "idempotency key (response id or idempotency_key), which stores it exactly once"
            )
        if deadline.fired:
            return StoreUnavailableError(
                f"the database {self.url} did not answer within {deadline.seconds:g} s "
                "(the network or the server is down or overloaded): nothing was written; "
                "retry later"
            )
        if isinstance(exc, StoreUnavailableError):
            return None  # typed already, by the statement that failed
        # a connection lost on a statement-less step (the COMMIT of a read, a ROLLBACK): the
        # driver's error says nothing typed, and a read never wrote anything
        return StoreUnavailableError(
            f"the connection to {self.url} was lost ({cause}), at the end of a read or while "
            "a transaction was rolled back: nothing was written; retry (after a failover the "
            "pool connects again)"
        )

    def _rejected(self, exc: sa_exc.DBAPIError) -> ValueRejectedError:
        diag = getattr(exc.orig, "diag", None)
        constraint = getattr(diag, "constraint_name", None)
        text = _first_line(exc.orig)
        if constraint is None:
            found = re.search(r"constraint failed: (\w+)", text)
            constraint = found.group(1) if found else None
        return ValueRejectedError(
            f"the database {self.url} refused the write ({text}); nothing was written"
            + (
                ""
                if constraint is None
                else f" (if the store's data was edited by hand, run: fsm audit check --db "
                f"'{self.url}')"
            ),
            constraint=constraint,
        )

    @contextmanager
    def reading(self, conversation_id: str) -> Iterator[None]:
        """Turn a broken stored history found while reading into
        :class:`~fsm.store.errors.CorruptStoreError` (which names the check to run)."""
        try:
            yield
        except _Corrupt as exc:
            raise CorruptStoreError(conversation_id, self.url, exc.problem, exc.kind) from None

    # -- plans (no I/O): fsm.store.plans ------------------------------------------------------
    check_conversation_id = staticmethod(plans.check_conversation_id)
    check_idempotency_key = staticmethod(plans.check_idempotency_key)
    check_last = staticmethod(plans.check_last)
    conversation_row = staticmethod(plans.conversation_row)
    plain_rows = staticmethod(plans.plain_rows)
    plan_turn = staticmethod(plans.plan_turn)
    plan_append = staticmethod(plans.plan_append)
    plan_commit = staticmethod(plans.plan_commit)
    plan_record = staticmethod(plans.plan_record)
    auto_upgrade = staticmethod(plans.auto_upgrade)
    plan_attempt = staticmethod(plans.plan_attempt)

    # -- transaction bodies ------------------------------------------------------------------
    def insert_conversation(self, conn: Connection, row: Mapping[str, Any]) -> None:
        """Insert a conversation row (an existing id raises ``IntegrityError``)."""
        conn.execute(sa.insert(Conversation), dict(row))

    def delete_conversation(self, conn: Connection, conversation_id: str) -> bool:
        """Delete a conversation and everything of it; whether it existed."""
        deleted = conn.execute(
            sa.delete(Conversation).where(Conversation.id == conversation_id)
        ).rowcount
        return bool(deleted)

    def list_conversations(
        self, conn: Connection, limit: int | None, after: str | None
    ) -> list[ConversationInfo]:
        """A page of conversations (see :meth:`ConversationStore.list_conversations`)."""
        if limit == 0:
            return []
        c, m, a = Conversation, Message, Attempt
        last_seq = sa.select(sa.func.max(m.seq)).where(m.conversation_id == c.id)
        turns = sa.select(sa.func.count()).where(
            m.conversation_id == c.id, sa.type_coerce(m.role, sa.String) == "assistant"
        )
        attempts = sa.select(sa.func.count()).where(a.conversation_id == c.id)
        last_message = sa.select(sa.func.max(m.created_at)).where(m.conversation_id == c.id)
        last_attempt = sa.select(sa.func.max(a.created_at)).where(a.conversation_id == c.id)
        query = sa.select(
            c.id,
            c.created_at,
            c.meta,
            last_seq.scalar_subquery(),
            turns.scalar_subquery(),
            attempts.scalar_subquery(),
            last_message.scalar_subquery(),
            last_attempt.scalar_subquery(),
        ).order_by(c.id)
        if after is not None:
            query = query.where(c.id > after)
        if limit is not None:
            query = query.limit(limit)
        out = []
        for cid, created, meta, seq, n_turns, n_attempts, at_m, at_a in conn.execute(query):
            created_at = as_utc(created)
            times = [t for t in (as_utc(at_m), as_utc(at_a)) if t is not None]
            out.append(
                ConversationInfo(
                    id=cid,
                    created_at=created_at,
                    messages=0 if seq is None else int(seq) + 1,
                    turns=int(n_turns),
                    attempts=int(n_attempts),
                    last_activity=max(times) if times else created_at,
                    metadata=meta if isinstance(meta, dict) else None,
                )
            )
        return out

    def next_seq(self, conn: Connection, conversation_id: str) -> int:
        """The conversation's next seq (``ConversationNotFoundError`` if it does not exist)."""
        _require(conn, conversation_id)
        with self.reading(conversation_id):
            return _next_seq(conn, conversation_id)

    def append(
        self,
        conn: Connection,
        conversation_id: str,
        prepared: Sequence[Mapping[str, Any]],
        expected_seq: int | None,
    ) -> int:
        """Append rows from :meth:`plain_rows`; returns the next seq after them."""
        found = self.write_state(conn, conversation_id)
        if found.pending is not None:
            raise pending_error(conversation_id, *found.pending)
        with self.reading(conversation_id):
            seq = found.next_seq()
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
        conn.execute(_INSERT_MESSAGE, rows)
        return seq + len(rows)

    def commit_turn(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        expected_seq: int | None,
        idempotency_key: str | None,
        *,
        ledger: bool = False,
        bound: BoundRows | None = None,
    ) -> CommittedTurn:
        """Write a planned turn and its results (or return the stored copy of the same turn);
        ``ledger``: the tool ledger's commit of the conversation's pending turn, which it holds
        under the conversation's lock at ``expected_seq`` (any other commit waits while one is
        pending): nothing is read first, the rows are inserted.

        Statements: on PostgreSQL the conversation's lock, then the query of
        :func:`write_state` and the ``INSERT`` of all the turn's rows in one statement (which
        inserts only in the common case: no pending turn, no earlier commit of the same turn,
        the expected seq; else the state it read decides as below); on SQLite (whose ``BEGIN
        IMMEDIATE`` already holds the database's write lock) the query and one ``INSERT`` per
        table, of the rows ``bound`` before the transaction when given
        (:func:`fsm.store.sqlite_turn.bind_turn`)."""
        turn, assistant = plan.turn, plan.assistant
        if ledger and expected_seq is not None:
            # the tool ledger's commit of the pending turn it holds, under the conversation's
            # lock: that turn has blocked every other write since begin() read the
            # conversation, its earlier commits and the turn's seq, so nothing is read again
            # (a raw write in between still meets the schema's keys)
            self._insert_committed(conn, conversation_id, plan, expected_seq, idempotency_key)
            return self._committed(conversation_id, plan, expected_seq)
        same, params = writes.same_turn(plan.turn, idempotency_key)
        if self.postgres:
            checked = self._checked_insert(
                conn, conversation_id, plan, same, params, expected_seq, idempotency_key
            )
            if isinstance(checked, CommittedTurn):
                return checked
            found = checked
        else:
            found = self.write_state(conn, conversation_id, same, params)
        if not ledger and found.pending is not None:
            raise pending_error(conversation_id, *found.pending)
        with self.reading(conversation_id):
            if found.stored_at is not None and not _is_int(found.stored_at):
                raise _Corrupt(
                    "invalid_type", f"a message has seq {show(found.stored_at)}, not an integer"
                )
            stored_at = cast("int | None", found.stored_at)
            seq = found.next_seq()
            if stored_at is not None:
                stored = _read(conn, conversation_id, turn_at=stored_at, include_reasoning=False)
        if stored_at is not None:
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
            return CommittedTurn(
                conversation_id, stored_at, cast("list[HistoryMessage]", stored), False
            )
        _check_expected(conversation_id, expected_seq, seq)
        if bound is not None:  # SQLite: bound before the transaction
            bound.write(conn, seq)
        else:
            self._insert_committed(conn, conversation_id, plan, seq, idempotency_key)
        return self._committed(conversation_id, plan, seq)

    def _checked_insert(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        same: str | None,
        params: Mapping[str, Any],
        expected_seq: int | None,
        idempotency_key: str | None,
        *,
        at_once: bool = False,
    ) -> CommittedTurn | WriteState:
        """PostgreSQL: after the conversation's lock, the state a commit needs and the turn's
        rows in one statement (:func:`fsm.store.writes.checked_insert_turn`), which inserts
        them in the common case: the :class:`CommittedTurn`; else (nothing written) the
        :class:`WriteState` for the caller to decide on. ``at_once``: the lock is sent with the
        statement, in the one query of an :data:`~fsm.store.engine_config.AT_ONCE` transaction
        (and the rows go in only if the conversation exists)."""
        if not at_once:
            _require(conn, conversation_id, lock=True)
        message, call_rows, result_rows = turn_rows(conversation_id, plan, 1, idempotency_key)
        columns, call_columns = _columns(message, call_rows, result_rows)
        schema = writes.schema(conn)
        row = conn.execute(
            writes.checked_insert_turn(schema, same, columns, call_columns, exists=at_once),
            {
                "cid": conversation_id,
                **params,
                "expected": expected_seq,
                **writes.turn_params("m", columns, [message, *result_rows]),
                **writes.turn_params("c", call_columns, call_rows),
            },
            execution_options={FIRST: writes.lock_first(schema)} if at_once else {},
        ).one()
        found = WriteState.read(row[:-1])
        if row[-1]:  # written, at the next seq
            return self._committed(conversation_id, plan, found.next_seq())
        return found

    def commit_turn_at_once(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        expected_seq: int | None,
        idempotency_key: str | None,
    ) -> CommittedTurn | None:
        """PostgreSQL, on a connection whose transaction is one statement
        (:data:`fsm.store.engine_config.AT_ONCE`): the conversation's lock and the statement of
        :meth:`commit_turn`'s common case in one round trip, committed by the server as it
        ends: the :class:`CommittedTurn`, or ``None`` when it wrote nothing (not the common
        case: the caller runs :meth:`commit_turn`, which decides)."""
        same, params = writes.same_turn(plan.turn, idempotency_key)
        checked = self._checked_insert(
            conn, conversation_id, plan, same, params, expected_seq, idempotency_key, at_once=True
        )
        return checked if isinstance(checked, CommittedTurn) else None

    def commit_ledger_turn(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        seq: int,
        idempotency_key: str | None,
        outcome: Mapping[str, Any],
        holder: str | None = None,
    ) -> CommittedTurn | None:
        """PostgreSQL: the tool ledger's commit of the pending turn it holds (under the
        conversation's lock, at ``seq``) in one statement: ``outcome`` (the binds ``l_c``,
        ``l_p``, ``l_pos``, ``l_state``, ``l_result``, ``l_parts``, ``l_error`` of
        :func:`fsm.store.writes.insert_turn`) recorded on its last call, the pending turn
        marked committed, the turn's rows inserted; ``None`` when that call was not
        ``started`` (nothing written: the caller reads the store and decides).

        ``holder``: on a connection whose transaction is one statement
        (:data:`fsm.store.engine_config.AT_ONCE`), the statement is sent after the lock of the
        conversation and the turn, in one round trip, and writes only if the turn is still
        pending and ``holder``'s (else ``None``, nothing written)."""
        message, call_rows, result_rows = turn_rows(conversation_id, plan, seq, idempotency_key)
        ledger = {**outcome, "l_seq": seq}
        if holder is not None:
            ledger["l_holder"] = holder
        written = self.insert_turn(conn, message, call_rows, result_rows, ledger=ledger)
        return self._committed(conversation_id, plan, seq) if written else None

    def _insert_committed(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        seq: int,
        idempotency_key: str | None,
    ) -> None:
        """Insert a planned turn at ``seq``: its assistant message, calls and results."""
        self.insert_turn(conn, *turn_rows(conversation_id, plan, seq, idempotency_key))

    @staticmethod
    def _committed(conversation_id: str, plan: TurnPlan, seq: int) -> CommittedTurn:
        """The :class:`CommittedTurn` of a planned turn just inserted at ``seq``."""
        messages = [plan.assistant] + [
            tool_message(call, text, parts)
            for call, (text, parts) in zip(plan.calls, plan.contents, strict=True)
        ]
        return CommittedTurn(
            conversation_id, seq, cast("list[HistoryMessage]", messages), created=True
        )

    def import_history(
        self,
        conn: Connection,
        conversation_id: str,
        plan: ImportPlan,
        expected_seq: int | None,
    ) -> int:
        """Write an imported history's steps in order (each as :meth:`append` and
        :meth:`commit_turn` write theirs), all in ``conn``'s transaction; returns the next seq."""
        seq = expected_seq
        for kind, step in plan.steps:
            if kind == "append":
                seq = self.append(conn, conversation_id, step, seq)
            else:
                seq = self.commit_turn(conn, conversation_id, step, seq, None).next_seq
        return self.next_seq(conn, conversation_id) if seq is None else seq

    def write_state(
        self,
        conn: Connection,
        conversation_id: str,
        same: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> WriteState:
        """What a write needs before it inserts (see :func:`fsm.store.writes.state`): on
        PostgreSQL the conversation's row lock is taken first, by its own statement, so the
        query after it reads what the writer it waited for committed. Raises
        :class:`~fsm.store.errors.ConversationNotFoundError`."""
        if self.postgres:
            _require(conn, conversation_id, lock=True)
        row = tuple(
            conn.execute(
                writes.state(writes.schema(conn), exists=not self.postgres, same=same),
                {"cid": conversation_id, **(params or {})},
            ).one()
        )
        if not self.postgres:
            if row[0] is None:
                raise ConversationNotFoundError(conversation_id)
            row = row[1:]
        return WriteState.read(row)

    def insert_turn(
        self,
        conn: Connection,
        message: dict[str, Any],
        call_rows: list[dict[str, Any]],
        result_rows: list[dict[str, Any]],
        *,
        ledger: Mapping[str, Any] | None = None,
    ) -> bool:
        """Insert a turn's rows: on PostgreSQL in one statement (one round trip), on SQLite
        one statement per table (assistant message, calls, results: each table's foreign keys
        are checked at the end of its statement). ``ledger`` (PostgreSQL): the tool ledger's
        commit in the same statement (see :func:`fsm.store.writes.insert_turn`), which writes
        nothing unless its last outcome is recorded. Whether the rows were written."""
        n = len(call_rows)
        if self.postgres:
            columns, call_columns = _columns(message, call_rows, result_rows)
            schema = writes.schema(conn)
            held = ledger is not None and "l_holder" in ledger
            result = conn.execute(
                writes.insert_turn(
                    schema, columns, call_columns, ledger=ledger is not None, held=held
                ),
                {
                    **writes.turn_params("m", columns, [message, *result_rows]),
                    **writes.turn_params("c", call_columns, call_rows),
                    **(ledger or {}),
                },
                execution_options={FIRST: writes.lock_held_first(schema)} if held else {},
            )
            return ledger is None or bool(result.all())
        assert ledger is None, "the ledger's one-statement commit is PostgreSQL's"
        conn.execute(writes.insert_row(writes.MESSAGES), message)
        if n:
            conn.execute(writes.insert_row(writes.TOOL_CALLS), call_rows)
            conn.execute(writes.insert_row(writes.MESSAGES), result_rows)
        return True

    def record_attempt(
        self, conn: Connection, conversation_id: str, plan: AttemptPlan
    ) -> list[int]:
        """Insert planned attempts at the conversation's current position; their ids."""
        found = self.write_state(conn, conversation_id)
        with self.reading(conversation_id):
            at_seq = found.next_seq()
        ids: list[int] = []
        for row, calls in plan:
            attempt_id = conn.execute(
                sa.insert(Attempt).returning(Attempt.id),
                {**row, "conversation_id": conversation_id, "at_seq": at_seq},
            ).scalar_one()
            ids.append(attempt_id)
            if calls:
                conn.execute(
                    sa.insert(AttemptCall),
                    [
                        {**call, "conversation_id": conversation_id, "attempt_id": attempt_id}
                        for call in calls
                    ],
                )
        return ids

    def history(
        self,
        conn: Connection,
        conversation_id: str,
        last: int | None,
        include_reasoning: bool,
        fmt: HistoryFormat = "chat",
    ) -> list[HistoryMessage]:
        """The history (see :meth:`ConversationStore.history`), in a read transaction."""
        with self.reading(conversation_id):
            messages = _read(conn, conversation_id, last=last, include_reasoning=include_reasoning)
            if fmt != "chat" and messages:
                seqs, provider = _read_provider(conn, conversation_id, len(messages))
                messages = render(messages, provider, fmt, seqs)
        if not messages:
            _require(conn, conversation_id)
        return cast("list[HistoryMessage]", messages)  # checked against the contract as it was read

    def attempts(self, conn: Connection, conversation_id: str) -> list[dict[str, Any]]:
        """The attempts (see :meth:`ConversationStore.attempts`), in a read transaction."""
        _require(conn, conversation_id)
        with self.reading(conversation_id):
            return _read_attempts(conn, conversation_id)


def _read_attempts(conn: Connection, conversation_id: str) -> list[dict[str, Any]]:
    """The attempts of a conversation with their calls (``_Corrupt`` if a stored value cannot
    be read back)."""
    try:
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
                .where(AttemptCall.conversation_id == conversation_id)
                .order_by(AttemptCall.attempt_id, AttemptCall.position)
            )
            .mappings()
            .all()
        )
    except (ValueError, TypeError, LookupError) as exc:
        # a value SQLAlchemy cannot convert back (JSON that is not JSON, an unknown state)
        raise _Corrupt(
            "invalid_type", f"a stored attempt cannot be read back: {_first_line(exc)}"
        ) from None
    by_attempt: dict[Any, list[dict[str, Any]]] = {}
    for call in calls:
        state = call["state"]
        by_attempt.setdefault(call["attempt_id"], []).append(
            {
                "position": call["position"],
                "index": call["provider_index"],
                "id": call["call_id"],
                "type": call["type"],
                "name": call["name"],
                "arguments": call["arguments"],
                "raw_arguments": call["raw_arguments"] or call["arguments"],
                "state": state.value if isinstance(state, ToolCallState) else state,
                "reason": call["reason"],
                "repaired": call["repaired"],
                "result": call["result"],
            }
        )
    return [{**row, "tool_calls": by_attempt.get(row["id"], [])} for row in rows]


def turn_rows(
    conversation_id: str, plan: TurnPlan, seq: int, idempotency_key: str | None
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """A planned turn's rows at ``seq``: its assistant message, its calls, its results."""
    calls, contents = plan.calls, plan.contents
    n = len(calls)
    message = assistant_row(conversation_id, seq, plan, idempotency_key)
    call_rows = [
        {
            "conversation_id": conversation_id,
            "assistant_seq": seq,
            "position": p,
            "assistant_n_calls": n,
            **plans.call_columns(call),
            "state": call.state,
        }
        for p, call in enumerate(calls)
    ]
    result_rows = [
        {
            "conversation_id": conversation_id,
            "seq": seq + 1 + p,
            "role": "tool",
            "content": text,
            "content_parts": parts,
            "tool_call_id": call.id,
            # a legacy call's result is a "function" message: it keeps the name
            "name": call.name if call.legacy else None,
            "assistant_seq": seq,
            "call_position": p,
            "n_calls": 0,
            "slots_left": n - 1 - p,
            "prev_seq": seq + p,
            "prev_slots_left": n - p,
        }
        for p, (call, (text, parts)) in enumerate(zip(calls, contents, strict=True))
    ]
    return message, call_rows, result_rows


def _columns(
    message: dict[str, Any], call_rows: list[dict[str, Any]], result_rows: list[dict[str, Any]]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The ``messages`` columns of a turn's rows (the assistant message's, then the results'
    own) and its ``tool_calls`` columns, for PostgreSQL's array inserts."""
    columns = tuple(message)
    if not call_rows:
        return columns, ()
    return columns + tuple(c for c in result_rows[0] if c not in message), tuple(call_rows[0])


def assistant_row(
    conversation_id: str, seq: int, plan: TurnPlan, idempotency_key: str | None
) -> dict[str, Any]:
    """The ``messages`` row of a planned turn's assistant message at ``seq``: the one place its
    columns are built."""
    turn, n = plan.turn, len(plan.calls)
    return {
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
        "usage": json_safe(turn.usage),
        **plans.usage_columns(turn.usage, plan.format),
        "idempotency_key": idempotency_key,
        "format": plan.format,
        "provider_items": plan.provider_items,
        "n_calls": n,
        "slots_left": n,
        "prev_seq": seq - 1 if seq else None,
        "prev_slots_left": 0 if seq else None,
        "block_end_seq": seq + n if n else None,
    }


#: ``append``'s insert (its rows all have the same keys)
_INSERT_MESSAGE = sa.insert(Message)
