"""The agent loop's errors, and the text it makes of an exception (for a reason, an attempt's
``error``, an abort)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fsm.clients import CANCELLED
from fsm.errors import FsmError

if TYPE_CHECKING:
    from fsm.parser import ParseResult, Turn

__all__ = [
    "AgentError",
    "AgentStoreError",
    "ToolError",
    "TurnFailedError",
    "TurnNotRecordedError",
    "UnknownOutcomeError",
]


class AgentError(FsmError):
    """Base class of the agent loop's errors."""


class ToolError(AgentError):
    """Raised by a tool to give the model an error result worded by the tool: the result is
    the exception's message as it is (``raise ToolError("error: no such city")``), where any
    other exception becomes ``error: <type>: <message>``. The call counts as failed
    (``ToolExecuted.error``, the tool ledger's ``failed``), the loop goes on."""


class TurnFailedError(AgentError):
    """A request's turn did not make it into history, so the loop stopped.

    Two cases, told apart by ``results``:

    * the request did not give a complete turn (``results is None``): ``reason`` is why
      (``length``, ``eof``, ``invalid_json``, the provider's error message, the transport's
      error, ...); no tool ran;
    * the turn was complete and its tools ran, but committing it failed (``results`` holds what
      the tools returned, in call order): ``reason`` is ``commit_failed: <the error, one line>``
      and ``__cause__`` is the store's (or the driver's) exception. The attempt was recorded with
      the results and the error text, so nothing the tools did is lost. The turn can be
      committed later as it is, without running a tool again:
      ``store.commit_turn(conversation, error.turn, error.results,
      expected_seq=error.expected_seq)`` (safe even if the connection failed during the
      database's own COMMIT and it was applied: a turn with a response id is idempotent, and
      ``expected_seq`` refuses a second copy of one without). ``retryable`` says whether the
      store called its error retryable (a conflict, a busy database).

    Attributes: ``step`` (1-based request number), ``reason``, ``result`` (the
    :class:`~fsm.parser.ParseResult`: every call with its final state and reason),
    ``attempt_ids`` (the recorded attempts; empty when ``record_attempts`` is false), ``turn``
    (choice 0, when it was complete), ``results`` and ``expected_seq`` (the seq the turn was to
    be committed at). The transport's or the store's exception, if any, is ``__cause__``.
    """

    def __init__(
        self,
        step: int,
        reason: str,
        result: ParseResult,
        attempt_ids: Sequence[int],
        *,
        turn: Turn | None = None,
        results: Sequence[str] | None = None,
        expected_seq: int | None = None,
    ) -> None:
        self.step = step
        self.reason = reason
        self.result = result
        self.attempt_ids = list(attempt_ids)
        self.turn = turn
        self.results = list(results) if results is not None else None
        self.expected_seq = expected_seq
        super().__init__(self._describe())

    @property
    def retryable(self) -> bool:
        """Whether the cause is an error the store calls retryable (``ConflictError``,
        ``StoreBusyError``): the same write may succeed later."""
        return bool(getattr(self.__cause__, "retryable", False))

    def _recorded(self) -> str:
        if self.attempt_ids:
            return f"recorded as attempt {', '.join(map(str, self.attempt_ids))}"
        return "not recorded"

    def _describe(self) -> str:
        if self.results is None:
            return (
                f"request {self.step} did not give a complete turn ({self.reason}); nothing was "
                f"written to history ({self._recorded()})"
            )
        if not self.results:
            return (
                f"request {self.step} gave a complete turn without tool calls, but committing it "
                f"failed ({self.reason}); it is not in history ({self._recorded()})"
            )
        return (
            f"{_ran(self.step, len(self.results))}, but committing it failed ({self.reason}); "
            f"it is not in history ({self._recorded()}"
            + (" with the tool results" if self.attempt_ids else "")
            + "); the tool results are on this error (results)"
        )


class TurnNotRecordedError(TurnFailedError):
    """A turn did not make it into history, and recording it as an attempt failed too.

    Everything of :class:`TurnFailedError` (``attempt_ids`` is empty), plus ``record_error``: the
    exception ``record_attempt`` raised (its text is in the message). ``__cause__`` is the turn's
    own failure: the commit's error when the tools ran (then ``results`` is the only copy of what
    they returned), else the transport's error, or the recording error when there is neither.
    """

    def __init__(
        self,
        step: int,
        reason: str,
        result: ParseResult,
        record_error: BaseException,
        *,
        turn: Turn | None = None,
        results: Sequence[str] | None = None,
        expected_seq: int | None = None,
    ) -> None:
        self.record_error = record_error
        super().__init__(
            step, reason, result, (), turn=turn, results=results, expected_seq=expected_seq
        )

    def _describe(self) -> str:
        recording = f"recording it as an attempt failed too ({one_line(self.record_error)})"
        if self.results is None:
            return (
                f"request {self.step} did not give a complete turn ({self.reason}); nothing was "
                f"written to history, and {recording}"
            )
        if not self.results:
            return (
                f"request {self.step} gave a complete turn without tool calls, but committing it "
                f"failed ({self.reason}) and {recording}: the turn is only on this error (turn)"
            )
        return (
            f"{_ran(self.step, len(self.results))}, but committing it failed ({self.reason}) and "
            f"{recording}: the tool results exist only on this error (results)"
        )


def _ran(step: int, calls: int) -> str:
    return f"request {step} gave a complete turn and its {calls} tool call(s) ran"


class AgentStoreError(AgentError):
    """A store operation of the loop outside a turn's commit (checking or creating the
    conversation, appending the first messages, reading the history) failed with an exception
    that is not one of fsm's typed errors (the database is unreachable, a connection dropped).

    Attributes: ``operation`` (the store method: ``history``, ``append``, ...), ``step`` (the
    request it was for; 0 before the first). ``__cause__`` is the driver's exception. fsm's own
    typed errors (:class:`~fsm.store.errors.StoreError` and its subclasses) propagate as they
    are; no tool had run when this is raised.
    """

    def __init__(self, operation: str, step: int, cause: BaseException) -> None:
        self.operation = operation
        self.step = step
        when = f"before request {step}" if step else "before the first request"
        super().__init__(f"the store's {operation}() failed {when}: {one_line(cause)}")


# -- an exception as text --------------------------------------------------------------------------
#: the longest error text recorded with an attempt (a driver's message is far shorter)
_ERROR_TEXT_LIMIT = 8000
#: the longest error text in a ``reason``
_REASON_LIMIT = 300


def note_not_recorded(
    exc: BaseException, record_error: BaseException, results: Sequence[str] | None = None
) -> None:
    """Say on ``exc`` (re-raised as it is) that recording its turn failed."""
    note = f"fsm: recording the turn as an attempt failed too: {one_line(record_error)}"
    if results is not None:
        note += f"; the tools had run, their results: {list(results)!r}"
    exc.add_note(note)


def error_text(exc: BaseException) -> str:
    """The exception as text for an attempt's ``error``: its type and message, without the SQL
    statement, parameters and link that a SQLAlchemy error appends."""
    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED
    text = describe(exc)
    for marker in ("\n[SQL: ", "\n(Background on this error at: "):
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text[:_ERROR_TEXT_LIMIT]


def one_line(exc: BaseException) -> str:
    """The first line of :func:`error_text`, at most :data:`_REASON_LIMIT` characters."""
    lines = error_text(exc).strip().splitlines()
    line = lines[0].strip() if lines else type(exc).__name__
    return line if len(line) <= _REASON_LIMIT else line[: _REASON_LIMIT - 3] + "..."


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class UnknownOutcomeError(AgentError):
    """A pending turn's call was started before its owner went away and has no recorded
    outcome, and its tool is not declared idempotent: it may or may not have run, and the loop
    never runs it twice. Raised only once the owner is gone: its lease ran out (no heartbeat
    for ``ledger_lease`` seconds, by the database's clock); while the owner lives the loop
    raises :class:`~fsm.store.errors.TurnInProgressError` instead. This run now owns the turn.

    Decide, then run the loop again (it resumes the turn): ``error.resolve(call, result)``
    records the call's outcome (what the tool did, looked up by you: a string, or
    ``error=True`` for an error result), ``error.abandon(reason)`` gives the turn up (kept for
    audit; the next run asks the model again). With the async store, await what they return.
    Decide inside ``with error.hold():`` (``async with`` for the async store): it keeps the
    turn (renews this run's lease) while you look, so no other process takes it over.

    Attributes: ``conversation``, ``pending`` (the store's pending turn, owned by this run),
    ``call`` (the call: ``position``, ``id``, ``name``, ``arguments``), ``store``.
    """

    def __init__(self, store: Any, pending: Any, call: Any) -> None:
        self.store = store
        self.pending = pending
        self.call = call
        self.conversation: str = pending.conversation_id
        super().__init__(
            f"call {call.position} ({call.name}, id {call.id!r}) of the pending turn of "
            f"conversation {self.conversation!r} was started but has no recorded outcome, and "
            f"its tool is not idempotent: it may have run. Find out what it did, then "
            "error.resolve(call, result) or error.abandon(reason), and run the loop again"
        )

    def resolve(self, call: Any, result: Any, *, error: bool = False) -> Any:
        """Record ``call``'s outcome as found by the caller (``error``: an error result), then
        end this run's lease (``store.release``) so that the next run resumes the turn at
        once."""
        record = self.store.failed if error else self.store.succeeded
        done = record(self.pending, call, result)
        if inspect.isawaitable(done):
            return self._aresolve(done)
        release_lease(self.store, self.pending)
        return done

    async def _aresolve(self, done: Awaitable[Any]) -> Any:
        out = await done
        await arelease_lease(self.store, self.pending)
        return out

    def abandon(self, reason: str) -> Any:
        """Give the pending turn up (kept in the ledger for audit with ``reason``)."""
        return self.store.abandon(self.pending, reason)

    def hold(self) -> Any:
        """A context (``with``; ``async with`` for the async store) that keeps the pending
        turn while the body decides: the store's heartbeat renews this run's lease, and ends
        it when the body is done (so the next run resumes at once)."""
        beat = getattr(self.store, "heartbeat", None)
        if not callable(beat):
            return contextlib.nullcontext()
        if inspect.iscoroutinefunction(getattr(self.store, "renew", None)):
            return self._aheld(beat)
        return self._held(beat)

    @contextlib.contextmanager
    def _held(self, beat: Any) -> Iterator[None]:
        with beat(self.pending):
            yield
        release_lease(self.store, self.pending)

    @contextlib.asynccontextmanager
    async def _aheld(self, beat: Any) -> AsyncIterator[None]:
        async with beat(self.pending):
            yield
        await arelease_lease(self.store, self.pending)


def release_lease(store: Any, pending: Any) -> None:
    """End ``pending``'s lease (``store.release``) if the store has leases, so that the next
    run resumes the turn at once; a failure only leaves the lease to run out."""
    release = getattr(store, "release", None)
    if callable(release):
        with contextlib.suppress(Exception):
            release(pending)


async def arelease_lease(store: Any, pending: Any) -> None:
    """The async twin of :func:`_release`."""
    release = getattr(store, "release", None)
    if callable(release):
        with contextlib.suppress(Exception):
            await release(pending)
