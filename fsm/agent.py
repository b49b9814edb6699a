"""A tool-calling agent loop over the official ``openai`` client and fsm's store.

One step of the loop: read the conversation from the store, send it (``stream=True``), parse the
streamed answer with fsm as it arrives (:mod:`fsm.clients`), and then

* a **complete turn with tool calls**: run the tools (arguments JSON-decoded and passed as
  keyword arguments; an exception or an unknown tool becomes an error *result string*, so the
  model hears about it), commit the turn together with its results in one transaction, and go on;
* a **complete turn without tool calls** (the answer): commit it and stop;
* an **incomplete turn** (truncated, aborted, cut, a failed request): record it as an attempt
  (``record_attempts=True``, the default), write nothing to history, and raise
  :class:`TurnFailedError`, whose ``reason`` says why;
* a **commit that fails after the tools ran** (a conflict with another writer, a busy or
  unreachable database, a value the database refuses, an idempotency mismatch, a dropped
  connection): record the turn as an attempt *with the tool results* and the error text, and
  raise :class:`TurnFailedError` with reason ``commit_failed: <the error>``, its ``results``
  (what the tools returned) and the store's exception as ``__cause__``. A turn whose tools ran
  is never lost silently: if recording the attempt fails too, :class:`TurnNotRecordedError`
  (a ``TurnFailedError``) says both and still carries the results.

Every request's ``messages`` is ``store.history(conversation)``: what was committed, byte-exact,
tool results right after their assistant message. The loop stops after ``max_turns`` requests
with ``status="max_turns"``.

.. code-block:: python

    from openai import OpenAI
    from fsm.agent import run_agent_loop
    from fsm.store import ConversationStore

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    with ConversationStore("sqlite:///chat.db", auto_upgrade=True) as store:
        result = run_agent_loop(
            OpenAI(), store, "chat-1", {"add": add}, model="gpt-4o-mini",
            messages=[{"role": "user", "content": "What is 1234 + 5678?"}],
            on_event=print,                   # parser events as they stream, and the loop's
        )
    print(result.status, result.content)

:func:`arun_agent_loop` is the asyncio twin (``AsyncOpenAI``,
:class:`~fsm.store.aio.AsyncConversationStore`, tools that may be coroutine functions, run
concurrently). Cancelling its task mid-stream aborts the turn (reason ``cancelled``), records the
attempt when ``record_attempts`` is true, commits nothing, and re-raises
:class:`asyncio.CancelledError`. A cancellation while tools run commits nothing either; one
during the commit records the attempt with the results (error ``cancelled``) and re-raises.

Store errors before any tool runs (creating the conversation, appending ``messages``, reading the
history) propagate: fsm's typed store errors as they are, anything else (a driver's error) as
:class:`AgentStoreError`, naming the operation.

Progress: ``on_event`` receives the parser's events as they arrive
(:class:`~fsm.events.ToolCallOpened` carries a tool's name as soon as the stream names it) and the
loop's own: :class:`RequestSent`, :class:`ToolExecuted`, :class:`TurnCommitted`,
:class:`AttemptRecorded`. ``import fsm`` does not import this module; this module imports neither
``openai`` nor SQLAlchemy (it works on the client and store it is given).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from fsm.clients import CANCELLED, aiter_openai_events, iter_openai_events
from fsm.errors import FsmError
from fsm.events import Event
from fsm.parser import ParseResult, StreamParser, Turn
from fsm.states import ToolCallState
from fsm.toolcall import ToolCall

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

    from fsm.parser import Anomaly
    from fsm.store.store import CommittedTurn, Results

__all__ = [
    "AgentError",
    "AgentEvent",
    "AgentResult",
    "AgentStoreError",
    "AsyncStoreLike",
    "AttemptRecorded",
    "RequestSent",
    "StoreLike",
    "ToolExecuted",
    "TurnCommitted",
    "TurnFailedError",
    "TurnNotRecordedError",
    "arun_agent_loop",
    "function_tool",
    "run_agent_loop",
]

#: A tool: called with the call's JSON arguments as keyword arguments; a ``str`` result is sent
#: as it is, anything else as JSON. In :func:`arun_agent_loop` it may also be a coroutine
#: function.
Tool = Callable[..., Any]


# -- events --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestSent:
    """Request number ``step`` (1-based) is about to go out with ``messages`` messages."""

    step: int
    messages: int


@dataclass(frozen=True, slots=True)
class ToolExecuted:
    """A tool ran for call ``position`` of the turn: ``content`` is the result sent back;
    ``error`` says whether it is an error result (an exception, an unknown tool, arguments that
    are not a JSON object)."""

    step: int
    position: int
    call_id: str
    name: str
    arguments: str
    content: str
    error: bool


@dataclass(frozen=True, slots=True)
class TurnCommitted:
    """The turn of request ``step`` and its results are in history (``turn.messages``)."""

    step: int
    turn: CommittedTurn


@dataclass(frozen=True, slots=True)
class AttemptRecorded:
    """The turn of request ``step`` did not end complete: it was recorded as attempts
    ``attempt_ids`` (empty when ``record_attempts`` is false) and nothing went to history."""

    step: int
    attempt_ids: list[int]
    reason: str


#: What ``on_event`` receives: the parser's events (:mod:`fsm.events`) as they stream, and the
#: loop's own.
AgentEvent = Event | RequestSent | ToolExecuted | TurnCommitted | AttemptRecorded


# -- results and errors --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AgentResult:
    """How the loop ended: ``status`` is ``"completed"`` (a turn without tool calls was
    committed) or ``"max_turns"`` (the last request's turn still had tool calls; its results are
    committed, so the conversation can go on); ``turns`` holds every committed turn, in order."""

    conversation_id: str
    status: Literal["completed", "max_turns"]
    turns: list[CommittedTurn] = field(default_factory=list)

    @property
    def content(self) -> str | None:
        """The text of the last committed assistant message (the answer, when completed)."""
        if not self.turns:
            return None
        content = self.turns[-1].messages[0].get("content")
        return content if isinstance(content, str) else None


class AgentError(FsmError):
    """Base class of the agent loop's errors."""


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
        recording = f"recording it as an attempt failed too ({_one_line(self.record_error)})"
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
        super().__init__(f"the store's {operation}() failed {when}: {_one_line(cause)}")


# -- what the loop needs of a store --------------------------------------------------------------
class StoreLike(Protocol):
    """The methods of :class:`~fsm.store.ConversationStore` the loop uses."""

    def create_conversation(
        self, conversation_id: str | None = ..., *, metadata: Any = ..., exist_ok: bool = ...
    ) -> str: ...

    def next_seq(self, conversation_id: str) -> int: ...

    def append(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        expected_seq: Any = ...,
    ) -> int: ...

    def commit_turn(
        self,
        conversation_id: str,
        turn: Turn,
        results: Results | None = ...,
        *,
        expected_seq: int | None = ...,
        idempotency_key: str | None = ...,
    ) -> CommittedTurn: ...

    def record_attempt(
        self,
        conversation_id: str,
        attempt: Turn | ParseResult,
        *,
        anomalies: Sequence[Anomaly] = ...,
        results: Results | None = ...,
        error: str | None = ...,
    ) -> list[int]: ...

    def history(
        self, conversation_id: str, *, last: int | None = ..., include_reasoning: bool = ...
    ) -> list[dict[str, Any]]: ...


class AsyncStoreLike(Protocol):
    """The methods of :class:`~fsm.store.aio.AsyncConversationStore` the async loop uses."""

    async def create_conversation(
        self, conversation_id: str | None = ..., *, metadata: Any = ..., exist_ok: bool = ...
    ) -> str: ...

    async def next_seq(self, conversation_id: str) -> int: ...

    async def append(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        expected_seq: Any = ...,
    ) -> int: ...

    async def commit_turn(
        self,
        conversation_id: str,
        turn: Turn,
        results: Results | None = ...,
        *,
        expected_seq: int | None = ...,
        idempotency_key: str | None = ...,
    ) -> CommittedTurn: ...

    async def record_attempt(
        self,
        conversation_id: str,
        attempt: Turn | ParseResult,
        *,
        anomalies: Sequence[Anomaly] = ...,
        results: Results | None = ...,
        error: str | None = ...,
    ) -> list[int]: ...

    async def history(
        self, conversation_id: str, *, last: int | None = ..., include_reasoning: bool = ...
    ) -> list[dict[str, Any]]: ...


# -- the sync loop -------------------------------------------------------------------------------
def run_agent_loop(
    client: OpenAI,
    store: StoreLike,
    conversation: str,
    tools: Mapping[str, Tool],
    *,
    model: str,
    messages: Sequence[Mapping[str, Any]] = (),
    tool_specs: Sequence[Mapping[str, Any]] | None = None,
    max_turns: int = 10,
    on_event: Callable[[AgentEvent], object] | None = None,
    record_attempts: bool = True,
    request_options: Mapping[str, Any] | None = None,
) -> AgentResult:
    """Run the tool-calling loop on ``conversation`` until the model answers without tools.

    Args:
        client: an ``openai.OpenAI`` client (any OpenAI-compatible server, via ``base_url``).
        store: a :class:`~fsm.store.ConversationStore`; the conversation is created if it does
            not exist.
        conversation: the conversation id.
        tools: tool name -> function. The request's ``tools`` are built from the functions'
            signatures (:func:`function_tool`) unless ``tool_specs`` is given.
        model: the model name sent with every request.
        messages: plain messages appended before the first request (the user's question).
        tool_specs: the request's ``tools`` list as the API takes it, instead of the derived one.
        max_turns: the most requests to send.
        on_event: called with every :data:`AgentEvent`, as it happens.
        record_attempts: record an incomplete turn as an attempt (audit) before raising.
        request_options: more arguments for ``chat.completions.create`` (``temperature``, ...).

    Returns an :class:`AgentResult`. Raises :class:`TurnFailedError` for an incomplete turn or a
    failed request (nothing of it in history), and for a turn whose commit failed after its
    tools ran (reason ``commit_failed: ...``, the tool results on the error, the attempt
    recorded with them, the store's error as ``__cause__``: for instance a
    :class:`~fsm.store.errors.ConflictError` if another writer appended to the conversation
    while a turn streamed or its tools ran, since every commit names the seq it expects; then
    ``error.retryable`` is true). :class:`TurnNotRecordedError` when recording the attempt
    failed as well. Store errors before the tools run propagate as fsm's typed store errors, or
    as :class:`AgentStoreError` for a driver's error. ``KeyboardInterrupt`` during a stream or
    a commit records the attempt (reason ``KeyboardInterrupt``) and is re-raised.
    """
    _check_max_turns(max_turns)
    emit = on_event or _ignore
    request = _base_request(model, tools, tool_specs, request_options)
    try:
        _checked("next_seq", 0, store.next_seq, conversation)
    except LookupError:  # ConversationNotFoundError
        _checked("create_conversation", 0, store.create_conversation, conversation, exist_ok=True)
    if messages:
        _checked("append", 0, store.append, conversation, list(messages))
    committed: list[CommittedTurn] = []
    for step in range(1, max_turns + 1):
        history = _checked("history", step, store.history, conversation)
        emit(RequestSent(step, len(history)))
        parser = StreamParser()
        try:
            failure = _stream(client, {**request, "messages": history}, parser, emit)
        except BaseException as exc:  # KeyboardInterrupt, a failing on_event: record, re-raise
            _abort(parser, exc)
            if record_attempts:
                try:
                    ids = store.record_attempt(conversation, parser.result())
                except Exception as record_exc:
                    _note_not_recorded(exc, record_exc)
                else:
                    emit(AttemptRecorded(step, ids, _why(parser.result())))
            raise
        result = parser.result()
        turn = _usable_turn(result, failure)
        if turn is None:
            reason = _why(result)
            ids = []
            if record_attempts:
                try:
                    ids = store.record_attempt(conversation, result)
                except Exception as record_exc:
                    lost_too = TurnNotRecordedError(step, reason, result, record_exc)
                    raise lost_too from failure or record_exc
            emit(AttemptRecorded(step, ids, reason))
            raise TurnFailedError(step, reason, result, ids) from failure
        contents: list[str] = []
        for position, call in enumerate(turn.tool_calls):
            content, error = _run_tool(tools, call)
            contents.append(content)
            emit(_executed(step, position, call, content, error))
        try:
            done = store.commit_turn(conversation, turn, contents, expected_seq=len(history))
        except BaseException as exc:  # the tools ran: record the turn with their results
            lost = _Lost(step, result, turn, contents, len(history), exc)
            if record_attempts:
                try:
                    lost.ids = store.record_attempt(
                        conversation,
                        lost.attempt,
                        anomalies=result.anomalies,
                        results=contents,
                        error=lost.error_text,
                    )
                except Exception as record_exc:
                    lost.record_error = record_exc
            if lost.record_error is None:
                emit(AttemptRecorded(step, lost.ids, lost.reason))
            if not isinstance(exc, Exception):  # KeyboardInterrupt, cancelled: as it is
                lost.note_not_recorded()
                raise
            raise lost.error() from exc
        committed.append(done)
        emit(TurnCommitted(step, done))
        if not turn.tool_calls:
            return AgentResult(conversation, "completed", committed)
    return AgentResult(conversation, "max_turns", committed)


def _stream(
    client: OpenAI,
    request: dict[str, Any],
    parser: StreamParser,
    emit: Callable[[AgentEvent], object],
) -> Exception | None:
    """Send the request and feed the streamed answer to ``parser``; the transport's exception
    (the parser then has ended with its reason), or ``None``."""
    create: Any = client.chat.completions.create
    try:
        stream = create(**request)
    except Exception as exc:  # no stream at all: an HTTP error, a refused connection
        parser.abort(_describe(exc))
        return exc
    with stream:
        events = iter_openai_events(stream, parser=parser)
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration:
                    return None
                except Exception as exc:
                    return exc
                try:
                    emit(event)
                except BaseException as exc:  # the callback failed: the turn ends with it
                    _abort(parser, exc)
                    raise
        finally:
            events.close()


# -- the async loop ------------------------------------------------------------------------------
async def arun_agent_loop(
    client: AsyncOpenAI,
    store: AsyncStoreLike,
    conversation: str,
    tools: Mapping[str, Tool],
    *,
    model: str,
    messages: Sequence[Mapping[str, Any]] = (),
    tool_specs: Sequence[Mapping[str, Any]] | None = None,
    max_turns: int = 10,
    on_event: Callable[[AgentEvent], object] | None = None,
    record_attempts: bool = True,
    request_options: Mapping[str, Any] | None = None,
) -> AgentResult:
    """The asyncio twin of :func:`run_agent_loop`: an ``openai.AsyncOpenAI`` client and an
    :class:`~fsm.store.aio.AsyncConversationStore`.

    Tools may be plain or coroutine functions; the calls of one turn run concurrently
    (``asyncio.gather``), their results committed in call order. ``on_event`` may return an
    awaitable, which is awaited (the stream waits for it).

    Cancellation: cancelling the task while a turn streams aborts the turn with reason
    ``cancelled``, records it as an attempt when ``record_attempts`` is true, writes nothing to
    history and re-raises :class:`asyncio.CancelledError`. Cancelled while tools run, nothing is
    committed (the turn and its results only go in together); cancelled during the commit, the
    attempt is recorded with the results (error ``cancelled``) and the cancellation re-raised.
    Commit failures raise :class:`TurnFailedError` as in :func:`run_agent_loop`.
    """
    _check_max_turns(max_turns)
    request = _base_request(model, tools, tool_specs, request_options)

    async def emit(event: AgentEvent) -> None:
        if on_event is not None:
            outcome = on_event(event)
            if inspect.isawaitable(outcome):
                await outcome

    try:
        await _achecked("next_seq", 0, store.next_seq, conversation)
    except LookupError:
        await _achecked(
            "create_conversation", 0, store.create_conversation, conversation, exist_ok=True
        )
    if messages:
        await _achecked("append", 0, store.append, conversation, list(messages))
    committed: list[CommittedTurn] = []
    for step in range(1, max_turns + 1):
        history = await _achecked("history", step, store.history, conversation)
        await emit(RequestSent(step, len(history)))
        parser = StreamParser()
        try:
            failure = await _astream(client, {**request, "messages": history}, parser, emit)
        except BaseException as exc:  # cancelled, or on_event failed: record, re-raise
            _abort(parser, exc)
            if record_attempts:
                try:
                    ids = await store.record_attempt(conversation, parser.result())
                except Exception as record_exc:
                    _note_not_recorded(exc, record_exc)
                else:
                    await emit(AttemptRecorded(step, ids, _why(parser.result())))
            raise
        result = parser.result()
        turn = _usable_turn(result, failure)
        if turn is None:
            reason = _why(result)
            ids = []
            if record_attempts:
                try:
                    ids = await store.record_attempt(conversation, result)
                except Exception as record_exc:
                    lost_too = TurnNotRecordedError(step, reason, result, record_exc)
                    raise lost_too from failure or record_exc
            await emit(AttemptRecorded(step, ids, reason))
            raise TurnFailedError(step, reason, result, ids) from failure
        calls = turn.tool_calls
        contents = list(
            await asyncio.gather(*(_aexecute(tools, step, p, c, emit) for p, c in enumerate(calls)))
        )
        try:
            done = await store.commit_turn(conversation, turn, contents, expected_seq=len(history))
        except BaseException as exc:  # the tools ran (cancelled too): record them, then raise
            lost = _Lost(step, result, turn, contents, len(history), exc)
            if record_attempts:
                try:
                    lost.ids = await store.record_attempt(
                        conversation,
                        lost.attempt,
                        anomalies=result.anomalies,
                        results=contents,
                        error=lost.error_text,
                    )
                except Exception as record_exc:
                    lost.record_error = record_exc
            if lost.record_error is None:
                await emit(AttemptRecorded(step, lost.ids, lost.reason))
            if not isinstance(exc, Exception):  # KeyboardInterrupt, cancelled: as it is
                lost.note_not_recorded()
                raise
            raise lost.error() from exc
        committed.append(done)
        await emit(TurnCommitted(step, done))
        if not calls:
            return AgentResult(conversation, "completed", committed)
    return AgentResult(conversation, "max_turns", committed)


async def _astream(
    client: AsyncOpenAI,
    request: dict[str, Any],
    parser: StreamParser,
    emit: Callable[[AgentEvent], Awaitable[None]],
) -> Exception | None:
    """The async twin of :func:`_stream`."""
    create: Any = client.chat.completions.create
    try:
        stream = await create(**request)
    except Exception as exc:
        parser.abort(_describe(exc))
        return exc
    async with stream:
        events = aiter_openai_events(stream, parser=parser)
        try:
            while True:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return None
                except Exception as exc:
                    return exc
                try:
                    await emit(event)
                except BaseException as exc:  # the callback failed, or cancelled while in it
                    _abort(parser, exc)
                    raise
        finally:
            await events.aclose()


# -- tools ---------------------------------------------------------------------------------------
_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def function_tool(function: Tool, name: str | None = None) -> dict[str, Any]:
    """The Chat Completions ``tools`` entry of a Python function.

    Parameters become the JSON schema's properties (``str``, ``int``, ``float``, ``bool``,
    ``list`` and ``dict`` annotations map to their JSON types; others accept anything), those
    without a default are required; the docstring's first paragraph is the description.
    """
    tool_name = name or getattr(function, "__name__", "tool")
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # unresolvable annotations: accept anything
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        hint = hints.get(parameter.name)
        kind = _JSON_TYPES.get(typing.get_origin(hint) or hint)
        properties[parameter.name] = {"type": kind} if kind else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    spec: dict[str, Any] = {
        "name": tool_name,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }
    doc = inspect.getdoc(function)
    if doc:
        spec["description"] = doc.split("\n\n", 1)[0].replace("\n", " ")
    return {"type": "function", "function": spec}


def _arguments(call: ToolCall) -> dict[str, Any] | str:
    """The call's arguments as keyword arguments, or an error result."""
    text = call.arguments
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:  # cannot happen for a finished call, unless repaired oddly
        return f"error: the arguments are not valid JSON ({exc})"
    if not isinstance(value, dict):
        return f"error: the arguments must be a JSON object, not {type(value).__name__}"
    return value


def _run_tool(tools: Mapping[str, Tool], call: ToolCall) -> tuple[str, bool]:
    function = tools.get(call.name)
    if function is None:
        return _unknown(tools, call), True
    arguments = _arguments(call)
    if isinstance(arguments, str):
        return arguments, True
    try:
        value = function(**arguments)
    except Exception as exc:
        return _tool_error(exc), True
    return _as_content(value), False


async def _arun_tool(tools: Mapping[str, Tool], call: ToolCall) -> tuple[str, bool]:
    function = tools.get(call.name)
    if function is None:
        return _unknown(tools, call), True
    arguments = _arguments(call)
    if isinstance(arguments, str):
        return arguments, True
    try:
        value = function(**arguments)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        return _tool_error(exc), True
    return _as_content(value), False


async def _aexecute(
    tools: Mapping[str, Tool],
    step: int,
    position: int,
    call: ToolCall,
    emit: Callable[[AgentEvent], Awaitable[None]],
) -> str:
    content, error = await _arun_tool(tools, call)
    await emit(_executed(step, position, call, content, error))
    return content


def _unknown(tools: Mapping[str, Tool], call: ToolCall) -> str:
    return f"error: there is no tool {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})"


def _tool_error(exc: Exception) -> str:
    return f"error: {type(exc).__name__}: {exc}" if str(exc) else f"error: {type(exc).__name__}"


def _as_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _executed(step: int, position: int, call: ToolCall, content: str, error: bool) -> ToolExecuted:
    return ToolExecuted(step, position, call.id, call.name, call.arguments, content, error)


# -- store failures ------------------------------------------------------------------------------
_T = TypeVar("_T")

#: the longest error text recorded with an attempt (a driver's message is far shorter)
_ERROR_TEXT_LIMIT = 8000
#: the longest error text in a ``reason``
_REASON_LIMIT = 300


def _checked(operation: str, step: int, method: Callable[..., _T], *args: Any, **kw: Any) -> _T:
    """``method(*args, **kw)``, a store operation before any tool ran: fsm's typed errors as they
    are, anything else (a driver's error) as :class:`AgentStoreError`."""
    try:
        return method(*args, **kw)
    except (FsmError, LookupError):
        raise
    except Exception as exc:
        raise AgentStoreError(operation, step, exc) from exc


async def _achecked(
    operation: str, step: int, method: Callable[..., Awaitable[_T]], *args: Any, **kw: Any
) -> _T:
    """The async twin of :func:`_checked`."""
    try:
        return await method(*args, **kw)
    except (FsmError, LookupError):
        raise
    except Exception as exc:
        raise AgentStoreError(operation, step, exc) from exc


@dataclass(slots=True)
class _Lost:
    """A complete turn whose tools ran but whose commit raised ``exc``."""

    step: int
    result: ParseResult
    turn: Turn
    contents: list[str]
    expected_seq: int
    exc: BaseException
    ids: list[int] = field(default_factory=list)
    record_error: Exception | None = None

    @property
    def attempt(self) -> Turn | ParseResult:
        """What to record: the whole response when it is this one turn (it brings the stream's
        end and anomalies), else the turn."""
        return self.result if len(self.result.turns) == 1 else self.turn

    @property
    def error_text(self) -> str:
        return _error_text(self.exc)

    @property
    def reason(self) -> str:
        return f"commit_failed: {_one_line(self.exc)}"

    def error(self) -> TurnFailedError:
        if self.record_error is not None:
            return TurnNotRecordedError(
                self.step,
                self.reason,
                self.result,
                self.record_error,
                turn=self.turn,
                results=self.contents,
                expected_seq=self.expected_seq,
            )
        return TurnFailedError(
            self.step,
            self.reason,
            self.result,
            self.ids,
            turn=self.turn,
            results=self.contents,
            expected_seq=self.expected_seq,
        )

    def note_not_recorded(self) -> None:
        if self.record_error is not None:
            _note_not_recorded(self.exc, self.record_error, self.contents)


def _note_not_recorded(
    exc: BaseException, record_error: BaseException, results: Sequence[str] | None = None
) -> None:
    """Say on ``exc`` (re-raised as it is) that recording its turn failed."""
    note = f"fsm: recording the turn as an attempt failed too: {_one_line(record_error)}"
    if results is not None:
        note += f"; the tools had run, their results: {list(results)!r}"
    exc.add_note(note)


def _error_text(exc: BaseException) -> str:
    """The exception as text for an attempt's ``error``: its type and message, without the SQL
    statement, parameters and link that a SQLAlchemy error appends."""
    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED
    text = _describe(exc)
    for marker in ("\n[SQL: ", "\n(Background on this error at: "):
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text[:_ERROR_TEXT_LIMIT]


def _one_line(exc: BaseException) -> str:
    """The first line of :func:`_error_text`, at most :data:`_REASON_LIMIT` characters."""
    lines = _error_text(exc).strip().splitlines()
    line = lines[0].strip() if lines else type(exc).__name__
    return line if len(line) <= _REASON_LIMIT else line[: _REASON_LIMIT - 3] + "..."


# -- helpers -------------------------------------------------------------------------------------
def _ignore(_event: AgentEvent) -> None:
    pass


def _check_max_turns(max_turns: int) -> None:
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive integer, not {max_turns!r}")


def _base_request(
    model: str,
    tools: Mapping[str, Tool],
    tool_specs: Sequence[Mapping[str, Any]] | None,
    options: Mapping[str, Any] | None,
) -> dict[str, Any]:
    request: dict[str, Any] = dict(options or {})
    request.update(model=model, stream=True)
    specs = (
        [dict(s) for s in tool_specs]
        if tool_specs is not None
        else [function_tool(f, n) for n, f in tools.items()]
    )
    if specs:
        request["tools"] = specs
    return request


def _usable_turn(result: ParseResult, failure: Exception | None) -> Turn | None:
    """Choice 0 if it is a complete turn and the transport did not fail, else ``None``."""
    if failure is not None:
        return None
    turn = next((t for t in result.turns if t.index == 0), None)
    if turn is None or not turn.complete:
        return None
    return turn


def _why(result: ParseResult) -> str:
    """Why a response is not a usable turn, in a few words."""
    turn = next((t for t in result.turns if t.index == 0), None)
    if result.end_how not in ("done", "eof"):
        return result.end_reason or result.end_how or "the stream did not end"
    if turn is None:
        return "the response has no choice 0"
    reasons = []
    for call in turn.tool_calls:
        if call.state is not ToolCallState.FINISHED and call.reason and call.reason not in reasons:
            reasons.append(call.reason)
    if reasons:
        return ", ".join(reasons)
    if turn.finish_reason in ("length", "content_filter"):
        return turn.finish_reason
    if turn.finish_reason is None and result.end_how == "eof":
        return "eof"
    return result.end_reason or "incomplete"


def _abort(parser: StreamParser, exc: BaseException) -> None:
    if not parser.ended:
        parser.abort(CANCELLED if isinstance(exc, asyncio.CancelledError) else _describe(exc))


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
