"""The tool ledger's methods of the sync and async stores (:mod:`fsm.store.ledger`): thin drivers over the transaction bodies, and the heartbeat that renews leases."""

import asyncio
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from sqlalchemy.engine import Connection

from fsm.parser import ParseResult, Turn
from fsm.store import plans
from fsm.store.errors import (
    CommitOutcomeUnknownError,
    ConversationNotFoundError,
    LedgerStateError,
    PendingTurnError,
)
from fsm.store.history import (
    CommittedTurn,
    StoreCoreLike,
)
from fsm.store.ledger.bodies import (
    CommitFailed,
    abandon_body,
    begin_at_once,
    begin_body,
    claim_body,
    commit_at_once,
    commit_body,
    commit_recording_body,
    finished_body,
    pending_body,
    release_body,
    renew_body,
    started_body,
)
from fsm.store.ledger.statements import check_lease
from fsm.store.ledger.types import (
    DEFAULT_LEASE,
    LedgerCall,
    Outcome,
    PendingTurn,
    call_position,
    check_error,
    check_reason,
    plan_begin,
    plan_result,
    start_position,
    to_recording,
)
from fsm.toolcall import ToolCall

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

_T = TypeVar("_T")


# -- the stores' methods -------------------------------------------------------------------------
class _Heartbeats:
    """One daemon thread per store renews the leases of the turns registered with it (a
    thread per turn would cost more than the turn's transactions): each every third of its
    lease. The thread ends after a while with nothing to renew; the next turn starts it
    again. It holds the store weakly."""

    #: seconds the thread waits with nothing to renew before it ends
    LINGER = 30.0

    def __init__(self, renew: Any) -> None:
        self._renew = weakref.WeakMethod(renew)
        self._cond = threading.Condition()
        self._due: dict[int, tuple[PendingTurn, float, float]] = {}  # key: turn, every, next
        self._busy: set[int] = set()  # keys whose renewal is running
        self._thread: threading.Thread | None = None
        self._key = 0
        self._until = 0.0  # when the thread wakes up next (it is woken only to come sooner)

    def add(self, pending: PendingTurn, every: float) -> int:
        with self._cond:
            self._key += 1
            at = time.monotonic() + every
            self._due[self._key] = (pending, every, at)
            if self._thread is None or not self._thread.is_alive():  # (none yet; or forked)
                self._until = at
                self._thread = threading.Thread(
                    target=self._run, name="fsm-ledger-heartbeat", daemon=True
                )
                self._thread.start()
            elif at < self._until:
                self._cond.notify_all()
            return self._key

    def remove(self, key: int) -> None:
        """Stop renewing ``key``; returns once no renewal of it is running (a renewal that
        ended after the owner released its lease would take the lease back)."""
        with self._cond:
            self._due.pop(key, None)
            while key in self._busy:
                self._cond.wait()

    def _run(self) -> None:
        idle = time.monotonic()
        while True:
            with self._cond:
                now = time.monotonic()
                if not self._due:
                    if now - idle > self.LINGER:
                        self._thread = None
                        return
                    self._until = now + self.LINGER
                    self._cond.wait(self.LINGER)
                    continue
                due = [(k, p, e) for k, (p, e, at) in self._due.items() if at <= now]
                if not due:
                    self._until = min(at for _, _, at in self._due.values())
                    self._cond.wait(self._until - now)
                    continue
                for key, turn, every in due:
                    self._due[key] = (turn, every, now + every)
                    self._busy.add(key)
            renew = self._renew()
            for key, turn, _every in due:
                try:
                    if renew is not None:
                        renew(turn)
                except (PendingTurnError, LedgerStateError, ConversationNotFoundError):
                    with self._cond:
                        self._due.pop(key, None)  # taken over or resolved: nothing to keep
                except Exception:  # a brief fault: the next beat tries again
                    pass
                finally:
                    with self._cond:
                        self._busy.discard(key)
                        self._cond.notify_all()
            del renew
            idle = time.monotonic()


_HEARTBEATS_LOCK = threading.Lock()


#: how often a begin whose COMMIT's answer was lost is tried again (with its owner token).
_BEGIN_TRIES = 3
_BEGIN_PAUSE = 0.2


class LedgerMethods:
    """The ledger's methods of :class:`~fsm.store.ConversationStore` (see the module)."""

    _core: StoreCoreLike

    #: seconds an owner holds a pending turn without renewing it (``begin``, ``claim``,
    #: ``started``, ``renew`` and the heartbeat each give it this long, by the database's
    #: clock); set it on the store (``store.ledger_lease = 10``). A crashed owner's turn can be
    #: claimed this long after its last renewal; a tool that runs longer needs the heartbeat.
    ledger_lease: float = DEFAULT_LEASE

    #: :class:`Outcome`, the type of ``started``'s and ``commit``'s ``recording`` (here for
    #: callers that do not import the store's modules, such as the agent loop)
    ledger_outcome: ClassVar[type[Outcome]] = Outcome

    if TYPE_CHECKING:

        def _write(self) -> AbstractContextManager[Connection]: ...
        def _reader(self) -> AbstractContextManager[Connection]: ...
        def _write_at_once(
            self,
            at_once: Callable[[Connection], _T | None],
            stepwise: Callable[[Connection], _T],
        ) -> _T: ...

    def begin(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        *,
        idempotency_key: str | None = None,
        expected_seq: int | None = None,
        start: int | ToolCall | None = None,
    ) -> PendingTurn:
        """Store a complete ``turn`` as the conversation's pending turn, before its tools run.

        Returns the :class:`PendingTurn` (its calls ``not_started``; the caller owns it and
        holds its lease). ``start`` (a call's position): also record that this call starts, in
        the same transaction (one transaction less before the first tool runs). A begin whose
        COMMIT's answer was lost is retried here with the same owner token. The same turn
        begun again elsewhere raises :class:`~fsm.store.errors.TurnInProgressError` while its
        owner's lease holds, and takes it over once the lease ran out (as :meth:`claim`).
        Another pending turn raises :class:`~fsm.store.errors.PendingTurnError`; an incomplete
        turn :class:`~fsm.errors.IncompleteTurnError`; a stale ``expected_seq``
        :class:`~fsm.store.errors.ConflictError`.
        """
        single, calls = plan_begin(conversation_id, turn, idempotency_key)
        first = start_position(calls, start)
        lease = check_lease(self.ledger_lease)
        owner = secrets.token_hex(16)  # kept across tries: a retry recognises its own begin
        args = (conversation_id, single, calls, idempotency_key, expected_seq, owner, lease)
        for tried in range(1, _BEGIN_TRIES + 1):
            try:
                with self._core.translate():
                    return self._write_at_once(
                        lambda conn: begin_at_once(conn, *args, first),
                        lambda conn: begin_body(self._core, conn, *args, first),
                    )
            except CommitOutcomeUnknownError:
                if tried == _BEGIN_TRIES:
                    raise
                time.sleep(_BEGIN_PAUSE * tried)
        raise AssertionError("unreachable")  # pragma: no cover

    def pending(self, conversation_id: str) -> PendingTurn | None:
        """The conversation's pending turn with each call's recorded state and result, or
        ``None``: what a restarted process needs to resume (then :meth:`claim` it)."""
        plans.check_conversation_id(conversation_id)
        with self._core.translate(), self._reader() as conn:
            return pending_body(conn, conversation_id)

    def claim(self, pending: PendingTurn) -> PendingTurn:
        """Become the owner of ``pending`` (read by :meth:`pending`) to resume it, once its
        owner is gone. Raises :class:`~fsm.store.errors.TurnInProgressError` while the owner's
        lease holds (it is alive: retry after ``error.retry_after``),
        :class:`~fsm.store.errors.PendingTurnError` if another process claimed it since it was
        read, and :class:`~fsm.store.errors.LedgerStateError` if it was committed or abandoned.
        Retrying with the same ``pending`` (after a lost answer) returns the claimed turn."""
        lease = check_lease(self.ledger_lease)
        with self._core.translate(), self._write() as conn:
            return claim_body(self._core, conn, pending, lease)

    def renew(self, pending: PendingTurn) -> datetime:
        """Renew the owner's lease on ``pending`` (``ledger_lease`` seconds from now, by the
        database's clock); the new end of the lease. Raises
        :class:`~fsm.store.errors.PendingTurnError` if another process took the turn over,
        :class:`~fsm.store.errors.LedgerStateError` if it was resolved."""
        lease = check_lease(self.ledger_lease)
        with self._core.translate(), self._write() as conn:
            return renew_body(self._core, conn, pending, lease)

    def release(self, pending: PendingTurn) -> PendingTurn:
        """End the owner's lease on ``pending`` now, without resolving it: the next
        :meth:`claim` (this process's next run, or another's) takes it at once. For an owner
        that stops working on the turn while it stays pending (the agent loop does this when
        it raises after ``begin``/``claim``). Raises as :meth:`renew` does."""
        with self._core.translate(), self._write() as conn:
            return release_body(self._core, conn, pending)

    @contextmanager
    def heartbeat(self, pending: PendingTurn) -> Iterator[None]:
        """Keep ``pending`` while the body runs (its tools): the store's heartbeat thread
        renews the lease every third of ``ledger_lease``. A renewal that fails on a brief fault
        is tried at the next beat; renewing stops when the turn is taken over or resolved (the
        owner's next step then raises), and when the body ends (after a renewal in flight)."""
        lease = check_lease(self.ledger_lease)
        with _HEARTBEATS_LOCK:
            beats = self.__dict__.get("_fsm_heartbeats")
            if beats is None:
                beats = self.__dict__["_fsm_heartbeats"] = _Heartbeats(self.renew)
        key = beats.add(pending, lease / 3)
        try:
            yield
        finally:
            beats.remove(key)

    def started(
        self,
        pending: PendingTurn,
        call: int | ToolCall | LedgerCall,
        *,
        recording: Outcome | None = None,
    ) -> PendingTurn:
        """Record that ``call`` (a position, or the call) starts, before its tool runs, and
        renew the owner's lease; the ledger's new state. A retry by the same owner changes
        nothing. ``recording``: the previous tool's :class:`Outcome`, recorded first in the
        same transaction (one transaction per call instead of two)."""
        position = call_position(pending, call)
        lease = check_lease(self.ledger_lease)
        outcome = None if recording is None else to_recording(pending, recording)
        with self._core.translate(), self._write() as conn:
            return started_body(self._core, conn, pending, position, lease, outcome)

    def succeeded(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, result: Any
    ) -> PendingTurn:
        """Record ``call``'s result (a string, or a list of content parts, as ``commit_turn``
        takes it). The same result again changes nothing; another raises
        :class:`~fsm.store.errors.LedgerStateError`."""
        position = call_position(pending, call)
        text, parts = plan_result(pending.executions[position].call, result)
        with self._core.translate(), self._write() as conn:
            return finished_body(self._core, conn, pending, position, "succeeded", text, parts)

    def failed(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, error: str
    ) -> PendingTurn:
        """Record that ``call``'s tool failed with ``error`` (its text is the result history
        gets, as the agent loop sends a tool's error back to the model)."""
        position = call_position(pending, call)
        text = check_error(error)
        with self._core.translate(), self._write() as conn:
            return finished_body(self._core, conn, pending, position, "failed", text, None)

    def commit(self, pending: PendingTurn, *, recording: Outcome | None = None) -> CommittedTurn:
        """Move the pending turn and every call's outcome into history in one transaction
        (``commit_turn``'s contract); a committed turn committed again returns the stored one
        (``created=False``). Every call must have an outcome first. ``recording``: the last
        tool's :class:`Outcome`, recorded in the same transaction; it stays recorded when the
        commit itself fails (that error is raised once the outcome is stored)."""
        if recording is None:
            with self._core.translate(), self._write() as conn:
                return commit_body(self._core, conn, pending)
        outcome = to_recording(pending, recording)
        with self._core.translate():
            try:
                return self._write_at_once(
                    lambda conn: commit_at_once(self._core, conn, pending, outcome),
                    lambda conn: commit_recording_body(self._core, conn, pending, outcome),
                )
            except CommitFailed as failed:
                failure = failed
            if failure.recorded:  # rolled back with the commit: recorded alone
                with self._write() as conn:
                    finished_body(self._core, conn, pending, *outcome)
            raise failure.cause

    def abandon(self, pending: PendingTurn, reason: str) -> PendingTurn:
        """Give up the pending turn: it stays in the ledger for audit (with ``reason``), and
        the conversation takes writes again."""
        why = check_reason(reason)
        with self._core.translate(), self._write() as conn:
            return abandon_body(self._core, conn, pending, why)


class AsyncLedgerMethods:
    """The ledger's methods of :class:`~fsm.store.aio.AsyncConversationStore` (awaited)."""

    _core: StoreCoreLike

    #: :attr:`LedgerMethods.ledger_lease`.
    ledger_lease: float = DEFAULT_LEASE

    #: :attr:`LedgerMethods.ledger_outcome`.
    ledger_outcome: ClassVar[type[Outcome]] = Outcome

    if TYPE_CHECKING:

        async def open(self) -> Any: ...
        def _write(self) -> AbstractAsyncContextManager[AsyncConnection]: ...
        def _reader(self) -> AbstractAsyncContextManager[AsyncConnection]: ...
        async def _write_at_once(
            self,
            at_once: Callable[[Connection], _T | None],
            stepwise: Callable[[Connection], _T],
        ) -> _T: ...

    async def begin(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        *,
        idempotency_key: str | None = None,
        expected_seq: int | None = None,
        start: int | ToolCall | None = None,
    ) -> PendingTurn:
        """:meth:`ConversationStore.begin <fsm.store.ConversationStore.begin>`, awaited."""
        single, calls = plan_begin(conversation_id, turn, idempotency_key)
        first = start_position(calls, start)
        lease = check_lease(self.ledger_lease)
        owner = secrets.token_hex(16)
        args = (conversation_id, single, calls, idempotency_key, expected_seq, owner, lease)
        await self.open()
        for tried in range(1, _BEGIN_TRIES + 1):
            try:
                with self._core.translate():
                    return await self._write_at_once(
                        lambda conn: begin_at_once(conn, *args, first),
                        lambda conn: begin_body(self._core, conn, *args, first),
                    )
            except CommitOutcomeUnknownError:
                if tried == _BEGIN_TRIES:
                    raise
                await asyncio.sleep(_BEGIN_PAUSE * tried)
        raise AssertionError("unreachable")  # pragma: no cover

    async def pending(self, conversation_id: str) -> PendingTurn | None:
        """:meth:`ConversationStore.pending <fsm.store.ConversationStore.pending>`, awaited."""
        plans.check_conversation_id(conversation_id)
        await self.open()
        with self._core.translate():
            async with self._reader() as conn:
                return await conn.run_sync(pending_body, conversation_id)

    async def claim(self, pending: PendingTurn) -> PendingTurn:
        """:meth:`ConversationStore.claim <fsm.store.ConversationStore.claim>`, awaited."""
        lease = check_lease(self.ledger_lease)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: claim_body(self._core, c, pending, lease))

    async def renew(self, pending: PendingTurn) -> datetime:
        """:meth:`ConversationStore.renew <fsm.store.ConversationStore.renew>`, awaited."""
        lease = check_lease(self.ledger_lease)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: renew_body(self._core, c, pending, lease))

    async def release(self, pending: PendingTurn) -> PendingTurn:
        """:meth:`ConversationStore.release <fsm.store.ConversationStore.release>`, awaited."""
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: release_body(self._core, c, pending))

    @asynccontextmanager
    async def heartbeat(self, pending: PendingTurn) -> AsyncIterator[None]:
        """:meth:`ConversationStore.heartbeat <fsm.store.ConversationStore.heartbeat>`, as a
        task of the running event loop (``async with``). A tool that blocks the event loop
        (a plain function doing I/O) blocks the heartbeat too: make long tools ``async`` (or
        run them with ``asyncio.to_thread``), or raise ``ledger_lease`` above their run time."""
        lease = check_lease(self.ledger_lease)

        async def beat() -> None:
            while True:
                await asyncio.sleep(lease / 3)
                try:
                    await self.renew(pending)
                except (PendingTurnError, LedgerStateError, ConversationNotFoundError):
                    return
                except Exception:  # a brief fault: the next beat tries again
                    continue

        task = asyncio.ensure_future(beat())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def started(
        self,
        pending: PendingTurn,
        call: int | ToolCall | LedgerCall,
        *,
        recording: Outcome | None = None,
    ) -> PendingTurn:
        """:meth:`ConversationStore.started <fsm.store.ConversationStore.started>`, awaited."""
        position = call_position(pending, call)
        lease = check_lease(self.ledger_lease)
        outcome = None if recording is None else to_recording(pending, recording)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(
                    lambda c: started_body(self._core, c, pending, position, lease, outcome)
                )

    async def succeeded(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, result: Any
    ) -> PendingTurn:
        """:meth:`ConversationStore.succeeded <fsm.store.ConversationStore.succeeded>`,
        awaited."""
        position = call_position(pending, call)
        text, parts = plan_result(pending.executions[position].call, result)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(
                    lambda c: finished_body(
                        self._core, c, pending, position, "succeeded", text, parts
                    )
                )

    async def failed(
        self, pending: PendingTurn, call: int | ToolCall | LedgerCall, error: str
    ) -> PendingTurn:
        """:meth:`ConversationStore.failed <fsm.store.ConversationStore.failed>`, awaited."""
        position = call_position(pending, call)
        text = check_error(error)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(
                    lambda c: finished_body(self._core, c, pending, position, "failed", text, None)
                )

    async def commit(
        self, pending: PendingTurn, *, recording: Outcome | None = None
    ) -> CommittedTurn:
        """:meth:`ConversationStore.commit <fsm.store.ConversationStore.commit>`, awaited."""
        outcome = None if recording is None else to_recording(pending, recording)
        await self.open()
        if outcome is None:
            with self._core.translate():
                async with self._write() as conn:
                    return await conn.run_sync(lambda c: commit_body(self._core, c, pending))
        with self._core.translate():
            try:
                return await self._write_at_once(
                    lambda conn: commit_at_once(self._core, conn, pending, outcome),
                    lambda conn: commit_recording_body(self._core, conn, pending, outcome),
                )
            except CommitFailed as failed:
                failure = failed
            if failure.recorded:  # rolled back with the commit: recorded alone
                async with self._write() as conn:
                    await conn.run_sync(lambda c: finished_body(self._core, c, pending, *outcome))
            raise failure.cause

    async def abandon(self, pending: PendingTurn, reason: str) -> PendingTurn:
        """:meth:`ConversationStore.abandon <fsm.store.ConversationStore.abandon>`, awaited."""
        why = check_reason(reason)
        await self.open()
        with self._core.translate():
            async with self._write() as conn:
                return await conn.run_sync(lambda c: abandon_body(self._core, c, pending, why))
