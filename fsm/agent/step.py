"""The agent loop without I/O: every rule of the loop, in one place (h11's idea applied to it).

:class:`AgentLoop` is fed what happened and says what to do next; the drivers
(:func:`~fsm.agent.run_agent_loop`, :func:`~fsm.agent.arun_agent_loop`) only do the I/O around
it (the store, the stream, the tools)::

    loop = AgentLoop(conversation, max_turns=..., record_attempts=...)
    for step in loop.steps():                   # at most max_turns requests
        history = store.history(conversation)
        parser, sent = loop.send(history)       # a fresh parser, and the RequestSent event
        ...stream the answer into parser...     # it raised: record loop.interrupted(parser, exc)
        action = loop.decide(parser.result(), failure)
        if isinstance(action, Record):          # incomplete: record it, raise its error
            ...
        ...run action.calls; commit action.turn and their results at action.expected_seq...
                                                # it raised: record action.failed(results, exc)
        event, stop = loop.committed(action, done)  # TurnCommitted; an AgentResult: stop
    return loop.out_of_turns()                  # status "max_turns"

A :class:`Record` says what to record as an attempt and, through :meth:`Record.recorded`,
:meth:`Record.skipped` or :meth:`Record.not_recorded`, which event to emit and which exception
to raise. This module does no I/O: it reads and aborts the (sans-IO) parser and builds events,
results and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fsm.agent.errors import (
    AgentStoreError,
    TurnFailedError,
    TurnNotRecordedError,
    UnknownOutcomeError,
    describe,
    error_text,
    note_not_recorded,
    one_line,
)
from fsm.agent.events import AgentResult, AttemptRecorded, RequestSent, ToolExecuted, TurnCommitted
from fsm.agent.tools import Tool, function_tool, is_idempotent, refusal, tool_spec
from fsm.clients import CANCELLED
from fsm.errors import FsmError
from fsm.parser import ParseResult, StreamParser, Turn
from fsm.states import EXECUTION_OUTCOMES, ending
from fsm.toolcall import ToolCall

#: The APIs the loop speaks.
StreamFormat = Literal["chat", "responses", "anthropic"]
FORMATS: tuple[StreamFormat, ...] = ("chat", "responses", "anthropic")

if TYPE_CHECKING:
    from fsm.store.store import CommittedTurn

_log = logging.getLogger("fsm.agent")

__all__ = [
    "AgentLoop",
    "Commit",
    "Record",
    "RecordingFailed",
    "abort",
    "build_request",
    "executed",
    "forget_in_hand",
    "heartbeat",
    "in_hand",
    "keep_in_hand",
    "ledger_plan",
    "no_stream",
    "record_budget",
    "started_here",
    "store_operation",
    "transient",
    "uses_ledger",
    "why_incomplete",
]


class AgentLoop:
    """The state of one run of the loop: the step, the committed turns, the seq expected next."""

    def __init__(
        self,
        conversation: str,
        *,
        max_turns: int,
        record_attempts: bool,
        format: StreamFormat = "chat",
        tools: Mapping[str, Tool] | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive integer, not {max_turns!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be 'chat', 'responses' or 'anthropic', not {format!r}")
        self.conversation = conversation
        #: the API the loop speaks (the request's shape and the stream's format)
        self.format: StreamFormat = format
        #: the registered tools (only they run)
        self.tools: Mapping[str, Tool] = tools or {}
        self.max_turns = max_turns
        self.record_attempts = record_attempts
        #: the request being made (1-based; 0 before the first)
        self.step = 0
        #: the turns committed so far, in order
        self.turns: list[CommittedTurn] = []
        self._expected_seq = 0

    def steps(self) -> Iterator[int]:
        """The request numbers, 1 to ``max_turns``; the driver stops early when told to."""
        while self.step < self.max_turns:
            self.step += 1
            yield self.step

    def send(self, history: Sequence[Mapping[str, Any]]) -> tuple[StreamParser, RequestSent]:
        """A request goes out with ``history``: a parser for its answer, and the event."""
        # a history rendered for another API than Chat says how many messages it holds
        self._expected_seq = getattr(history, "message_count", len(history))
        _log.debug("request %d of %s: %d messages", self.step, self.conversation, len(history))
        return StreamParser(format=self.format), RequestSent(self.step, len(history))

    def request(self, base: Mapping[str, Any], history: Sequence[Any]) -> dict[str, Any]:
        """The request of this step: ``base`` (:func:`build_request`) with the history under
        the key its API reads: ``messages`` (Chat Completions, Anthropic) or ``input``
        (Responses)."""
        key = "input" if self.format == "responses" else "messages"
        return {**base, key: list(history)}

    def interrupted(self, parser: StreamParser, exc: BaseException) -> Record:
        """The stream (or ``on_event``) raised ``exc``, which is not a transport failure
        (``KeyboardInterrupt``, a cancellation, a failing callback): the turn ends with it, is
        recorded as it is, and ``exc`` is re-raised."""
        abort(parser, exc)
        result = parser.result()
        return Record("interrupted", self, why_incomplete(result), result, result, exc)

    def decide(self, result: ParseResult, failure: Exception | None) -> Commit | Record:
        """What to do with a streamed answer (``failure``: the transport's exception, if any).

        Choice 0 complete and the transport fine: :class:`Commit` it (its tools run first; a
        turn without tool calls is the answer). Anything else: :class:`Record` it as an
        attempt, nothing in history, and raise :class:`~fsm.agent.TurnFailedError`.
        """
        turn = None if failure is not None else _choice_0(result)
        if result.anomaly_counts:  # counts by kind only (details: the fsm.parser DEBUG records)
            _log.info("request %d: anomalies %s", self.step, result.anomaly_counts)
        if turn is None or not turn.complete:
            return Record("incomplete", self, why_incomplete(result), result, result, failure)
        return Commit(self, result, turn, self._expected_seq)

    def committed(
        self, commit: Commit, done: CommittedTurn
    ) -> tuple[TurnCommitted, AgentResult | None]:
        """``commit``'s turn is in history as ``done``: the event, and the loop's result when
        the turn had no tool calls (the answer)."""
        self.turns.append(done)
        event = TurnCommitted(self.step, done)
        if commit.calls:  # their results are in history too: the next request goes out
            return event, None
        return event, AgentResult(self.conversation, "completed", self.turns)

    def resumed(self, done: CommittedTurn) -> TurnCommitted:
        """A pending turn of an earlier run (the tool ledger) is in history as ``done``: its
        event (step 0: no request of this run made it)."""
        self.turns.append(done)
        return TurnCommitted(0, done)

    def out_of_turns(self) -> AgentResult:
        """``max_turns`` requests were made and the last turn still had tool calls."""
        return AgentResult(self.conversation, "max_turns", self.turns)


@dataclass(frozen=True, slots=True)
class Commit:
    """Run the tools of ``turn`` (in call order), then commit it with their results at
    ``expected_seq``, the seq history had when the request went out."""

    loop: AgentLoop
    result: ParseResult
    turn: Turn
    expected_seq: int

    @property
    def calls(self) -> list[ToolCall]:
        return self.turn.tool_calls

    def executed(self, position: int, call: ToolCall, content: str, error: bool) -> ToolExecuted:
        """The event of a tool that ran for call ``position``."""
        _log.debug("tool %s ran for call %r (error result: %s)", call.name, call.id, error)
        refused = refusal(self.loop.tools, call) is not None
        return ToolExecuted(
            self.loop.step, position, call.id, call.name, call.arguments, content, error, refused
        )

    def failed(self, contents: Sequence[str], exc: BaseException) -> Record:
        """Committing raised ``exc`` after the tools ran: record the turn with their results
        and the error text. An ``Exception`` becomes :class:`~fsm.agent.TurnFailedError`
        (reason ``commit_failed: ...``); anything else (``KeyboardInterrupt``, a cancellation)
        is re-raised as it is."""
        result = self.result
        return Record(
            "commit_failed",
            self.loop,
            f"commit_failed: {one_line(exc)}",
            result,
            # the whole response when it is this one turn (it brings the stream's end and
            # anomalies), else the turn
            result if len(result.turns) == 1 else self.turn,
            exc,
            turn=self.turn,
            results=list(contents),
            expected_seq=self.expected_seq,
        )


@dataclass(frozen=True, slots=True)
class Record:
    """Record ``attempt`` as an attempt (when the loop records attempts), then raise.

    ``kind``: ``interrupted`` (``cause`` is re-raised), ``incomplete`` (no complete turn; the
    transport's exception, if any, is ``cause``) or ``commit_failed`` (the tools ran: ``results``
    are recorded with the attempt; ``cause`` is the store's exception).
    """

    kind: Literal["interrupted", "incomplete", "commit_failed"]
    loop: AgentLoop
    reason: str
    result: ParseResult
    attempt: Turn | ParseResult
    cause: BaseException | None
    turn: Turn | None = None
    results: list[str] | None = None
    expected_seq: int | None = None

    @property
    def wanted(self) -> bool:
        """Whether to call ``record_attempt`` at all (``record_attempts``)."""
        return self.loop.record_attempts

    @property
    def options(self) -> dict[str, Any]:
        """``record_attempt``'s keyword arguments besides the attempt."""
        if self.results is None or self.cause is None:
            return {}
        return {
            "anomalies": self.result.anomalies,
            "results": self.results,
            "error": error_text(self.cause),
        }

    @property
    def _details(self) -> dict[str, Any]:
        """The error's keyword arguments: the turn, its tool results, its expected seq."""
        return {"turn": self.turn, "results": self.results, "expected_seq": self.expected_seq}

    @property
    def _reraise(self) -> bool:
        if self.kind == "interrupted":
            return True
        return self.cause is not None and not isinstance(self.cause, Exception)

    def recorded(self, ids: Sequence[int]) -> tuple[AttemptRecorded, BaseException]:
        """``record_attempt`` gave ``ids``: the event to emit, then the exception to raise."""
        _log.warning(
            "turn %d of %s failed (%s): %s",
            self.loop.step,
            self.loop.conversation,
            self.kind,
            self.reason[:300],
        )
        event = AttemptRecorded(self.loop.step, list(ids), self.reason)
        if self._reraise:
            assert self.cause is not None
            return event, self.cause
        error = TurnFailedError(self.loop.step, self.reason, self.result, ids, **self._details)
        error.__cause__ = self.cause  # as ``raise error from cause``
        return event, error

    def skipped(self) -> tuple[AttemptRecorded | None, BaseException]:
        """Attempts are not recorded: the event (none when interrupted), then the exception."""
        event, error = self.recorded(())
        return (None if self.kind == "interrupted" else event), error

    def not_recorded(self, record_error: Exception) -> BaseException:
        """``record_attempt`` raised ``record_error``: the exception to raise (no event). A
        re-raised exception gets a note saying so (with the tool results, if any)."""
        _log.error(
            "turn %d of %s failed and was not recorded: %s",
            self.loop.step,
            self.loop.conversation,
            one_line(record_error),
        )
        if self._reraise:
            assert self.cause is not None
            note_not_recorded(self.cause, record_error, self.results)
            return self.cause
        error = TurnNotRecordedError(
            self.loop.step, self.reason, self.result, record_error, **self._details
        )
        error.__cause__ = self.cause or record_error
        return error


def why_incomplete(result: ParseResult) -> str:
    """Why a response is not a usable turn, in a few words: the stream's end when it did not end
    normally, else the reasons of choice 0's unfinished calls, else its finish_reason (``length``,
    ``content_filter``) or ``eof``.

    The cut reasons come from the parser's ending table (:func:`fsm.states.ending`), the one
    definition ``Turn.incomplete_reason`` is also set from.
    """
    turn = _choice_0(result)
    if result.end_how not in ("done", "eof"):
        return result.end_reason or result.end_how or "the stream did not end"
    if turn is None:
        return "the response has no choice 0"
    reasons = []
    for call in turn.unfinished_calls:
        if call.reason and call.reason not in reasons:
            reasons.append(call.reason)
    if reasons:
        return ", ".join(reasons)
    row = ending(result.end_how, turn.finish_reason)
    if row.trigger is not None and row.reason is not None:
        return row.reason  # length, content_filter, eof
    return result.end_reason or "incomplete"


def build_request(
    model: str,
    tools: Mapping[str, Tool],
    tool_specs: Sequence[Mapping[str, Any]] | None,
    options: Mapping[str, Any] | None,
    format: StreamFormat = "chat",
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The arguments of every request but its history: ``chat.completions.create``,
    ``responses.create`` or ``messages.create`` as ``format`` says. Chat function tools (the
    derived ones, or ``tool_specs`` in the Chat shape) are converted to the API's shape
    (:func:`~fsm.agent.tools.tool_spec`); Anthropic gets ``max_tokens`` (1024 unless given,
    the API requires it)."""
    request: dict[str, Any] = dict(options or {})
    request.update(model=model, stream=True)
    specs = (
        [dict(s) for s in tool_specs]
        if tool_specs is not None
        else [dict(function_tool(f, n)) for n, f in tools.items()]
    )
    if specs:
        request["tools"] = [tool_spec(s, format) for s in specs]
    if format == "anthropic":
        request.setdefault("max_tokens", max_tokens if max_tokens is not None else 1024)
    elif max_tokens is not None:
        key = "max_output_tokens" if format == "responses" else "max_completion_tokens"
        request[key] = max_tokens
    return request


def abort(parser: StreamParser, exc: BaseException) -> None:
    """End a stream that has not ended with ``exc`` as reason (``cancelled`` for a
    cancellation)."""
    if not parser.ended:
        parser.abort(CANCELLED if isinstance(exc, asyncio.CancelledError) else describe(exc))


def no_stream(parser: StreamParser, exc: Exception) -> Exception:
    """The request raised ``exc`` before any stream (an HTTP error, a refused connection): the
    turn ends with it; ``exc`` is the transport failure to give :meth:`AgentLoop.decide`."""
    parser.abort(describe(exc))
    return exc


@contextlib.contextmanager
def store_operation(operation: str, step: int) -> Iterator[None]:
    """Around a store operation before any tool ran (sync or awaited): fsm's typed errors as they
    are, anything else (a driver's error) as :class:`~fsm.agent.AgentStoreError`."""
    try:
        yield
    except (FsmError, LookupError):
        raise
    except Exception as exc:
        raise AgentStoreError(operation, step, exc) from exc


def _choice_0(result: ParseResult) -> Turn | None:
    return next((t for t in result.turns if t.index == 0), None)


#: the tool ledger's methods a store must have for the loop to use it.
_LEDGER = ("begin", "pending", "claim", "started", "succeeded", "failed", "commit", "abandon")


def uses_ledger(store: object) -> bool:
    """Whether the loop runs tools through ``store``'s tool ledger (a store with ``begin``,
    ``pending``, ``claim``, ``started``, ``succeeded``, ``failed``, ``commit``, ``abandon``, as
    :class:`~fsm.store.ConversationStore` has): the turn is stored pending before its tools
    run, each outcome as it finishes, and a crashed run is resumed by the next."""
    return all(callable(getattr(store, name, None)) for name in _LEDGER)


def ledger_plan(
    store: Any, pending: Any, tools: Mapping[str, Tool]
) -> list[tuple[int, Any, str | None]]:
    """What to do with each call of a pending turn: ``(position, call, content)``, where
    ``content`` is the recorded outcome to reuse (a result, or a failed tool's error text), or
    ``None`` to run the tool (it never started, or it started with no outcome and its tool is
    declared idempotent). A call started with no outcome whose tool is not idempotent raises
    :class:`~fsm.agent.UnknownOutcomeError` (nothing is run)."""
    plan: list[tuple[int, Any, str | None]] = []
    for position, execution in enumerate(pending.executions):
        call = execution.call
        if execution.state in EXECUTION_OUTCOMES:
            plan.append((position, call, execution.content))
        elif (
            execution.state == "not_started"
            or started_here(pending, position)
            or is_idempotent(tools.get(call.name))
        ):
            plan.append((position, call, None))
        else:
            raise UnknownOutcomeError(store, pending, call)
    return plan


def started_here(pending: Any, position: int) -> bool:
    """Whether call ``position`` was started by this very handle's owner with no outcome yet:
    ``begin(..., start=position)`` started it before its tool ran (a claim always takes a new
    owner token, so a call a crashed owner started never counts)."""
    execution = pending.executions[position]
    return execution.state == "started" and getattr(execution, "started_by", None) == getattr(
        pending, "owner", object()
    )


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a brief store fault that the same ledger step may simply retry: a
    retryable fsm error (busy, unreachable, a COMMIT whose answer was lost) that is not a
    conflict (a conflict, a pending turn, a turn in progress: retrying changes nothing). Every
    ledger step is idempotent, so retrying one after a fault records it once."""
    return (
        isinstance(exc, FsmError)
        and bool(getattr(exc, "retryable", False))
        and not hasattr(exc, "expected_seq")
    )


def record_budget(store: Any) -> float:
    """How long the loop retries recording a tool's outcome through brief store faults: two
    thirds of the store's lease (at least 2 s, at most 20 s)."""
    lease = getattr(store, "ledger_lease", 30.0)
    lease = float(lease) if isinstance(lease, int | float) else 30.0
    return min(20.0, max(2.0, lease * 2 / 3))


def heartbeat(store: Any, pending: Any) -> Any:
    """``store.heartbeat(pending)`` (the owner's lease renewed while the tools run), or a
    context that does nothing for a store without one: ``with`` for the sync store, ``async
    with`` for the async one."""
    beat = getattr(store, "heartbeat", None)
    return beat(pending) if callable(beat) else contextlib.nullcontext()


class RecordingFailed(Exception):
    """A tool ran but its outcome could not be recorded (the store's error is ``cause``):
    ``contents`` are the turn's results in hand so far. The outcome is kept in hand
    (:func:`keep_in_hand`) for the next run on the same store."""

    def __init__(self, contents: Sequence[str], cause: BaseException) -> None:
        self.contents = list(contents)
        self.cause = cause
        super().__init__(one_line(cause))


#: outcomes of tools that ran but could not be recorded, per store (weakly): the next run on
#: the store records them instead of raising UnknownOutcomeError for a result it had in hand
_IN_HAND: weakref.WeakKeyDictionary[Any, dict[tuple[str, int, int, str], tuple[str, bool]]] = (
    weakref.WeakKeyDictionary()
)


def keep_in_hand(store: Any, pending: Any, position: int, content: str, error: bool) -> None:
    """Keep the outcome of call ``position`` of ``pending`` (its tool ran; recording it
    failed) for the next run on ``store``."""
    call = pending.executions[position].call
    try:
        kept = _IN_HAND.setdefault(store, {})
    except TypeError:  # a store that cannot be referenced weakly: nothing kept
        return
    kept[(pending.conversation_id, pending.id, position, call.id)] = (content, error)


def in_hand(store: Any, pending: Any) -> dict[int, tuple[str, bool]]:
    """The outcomes kept in hand for ``pending``'s calls that are ``started`` with no recorded
    outcome: position -> (content, error)."""
    try:
        kept = _IN_HAND.get(store) or {}
    except TypeError:
        return {}
    out: dict[int, tuple[str, bool]] = {}
    for position, execution in enumerate(pending.executions):
        key = (pending.conversation_id, pending.id, position, execution.call.id)
        if key in kept and execution.state == "started":
            out[position] = kept[key]
    return out


def forget_in_hand(store: Any, pending: Any, position: int) -> None:
    """Drop the outcome kept for call ``position`` of ``pending`` (it is recorded now)."""
    try:
        kept = _IN_HAND.get(store)
    except TypeError:
        return
    if kept:
        call = pending.executions[position].call
        kept.pop((pending.conversation_id, pending.id, position, call.id), None)


def executed(
    step: int, position: int, call: Any, content: str, error: bool, refused: bool = False
) -> ToolExecuted:
    """The event of a tool that ran (or was refused) for call ``position`` of a ledger turn."""
    _log.debug("tool %s ran for call %r (error result: %s)", call.name, call.id, error)
    return ToolExecuted(step, position, call.id, call.name, call.arguments, content, error, refused)
