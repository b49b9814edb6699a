"""A tool-calling agent loop over the official ``openai`` client and fsm's store.

One step of the loop: read the conversation from the store, send it (``stream=True``), parse the
streamed answer with fsm as it arrives (:mod:`fsm.clients`), and then

* a **complete turn with tool calls**: run the tools (arguments JSON-decoded and passed as
  keyword arguments; an exception or an unknown tool becomes an error *result string*, so the
  model hears about it), commit the turn together with its results in one transaction, and go on;
* a **complete turn without tool calls** (the answer): commit it and stop;
* an **incomplete turn** (truncated, aborted, cut, a failed request): record it as an attempt
  (``record_attempts=True``, the default), write nothing to history, and raise
  :class:`TurnFailedError`, whose ``reason`` says why.

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
:class:`asyncio.CancelledError`. A cancellation while tools run commits nothing either.

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
from typing import TYPE_CHECKING, Any, Literal, Protocol

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
    "AsyncStoreLike",
    "AttemptRecorded",
    "RequestSent",
    "StoreLike",
    "ToolExecuted",
    "TurnCommitted",
    "TurnFailedError",
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
    """A request did not give a complete turn, so the loop stopped.

    Attributes: ``step`` (1-based request number), ``reason`` (why: ``length``, ``eof``,
    ``invalid_json``, the provider's error message, the transport's error, ...), ``result`` (the
    :class:`~fsm.parser.ParseResult`: every call with its final state and reason),
    ``attempt_ids`` (the recorded attempts; empty when ``record_attempts`` is false). The
    transport's exception, if any, is ``__cause__``. Nothing of the turn is in history.
    """

    def __init__(
        self, step: int, reason: str, result: ParseResult, attempt_ids: Sequence[int]
    ) -> None:
        self.step = step
        self.reason = reason
        self.result = result
        self.attempt_ids = list(attempt_ids)
        recorded = (
            f"recorded as attempt {', '.join(map(str, self.attempt_ids))}"
            if self.attempt_ids
            else "not recorded"
        )
        super().__init__(
            f"request {step} did not give a complete turn ({reason}); nothing was written to "
            f"history ({recorded})"
        )


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
    failed request (nothing of it in history), and the store's errors as they are (a
    :class:`~fsm.store.errors.ConflictError` if another writer appended to the conversation
    while a turn streamed: every commit names the seq it expects). ``KeyboardInterrupt`` during
    a stream records the attempt (reason ``KeyboardInterrupt``) and is re-raised.
    """
    _check_max_turns(max_turns)
    emit = on_event or _ignore
    request = _base_request(model, tools, tool_specs, request_options)
    try:
        store.next_seq(conversation)
    except LookupError:  # ConversationNotFoundError
        store.create_conversation(conversation, exist_ok=True)
    if messages:
        store.append(conversation, list(messages))
    committed: list[CommittedTurn] = []
    for step in range(1, max_turns + 1):
        history = store.history(conversation)
        emit(RequestSent(step, len(history)))
        parser = StreamParser()
        try:
            failure = _stream(client, {**request, "messages": history}, parser, emit)
        except BaseException as exc:  # KeyboardInterrupt, a failing on_event: record, re-raise
            _abort(parser, exc)
            if record_attempts:
                ids = store.record_attempt(conversation, parser.result())
                emit(AttemptRecorded(step, ids, _why(parser.result())))
            raise
        result = parser.result()
        turn = _usable_turn(result, failure)
        if turn is None:
            reason = _why(result)
            ids = store.record_attempt(conversation, result) if record_attempts else []
            emit(AttemptRecorded(step, ids, reason))
            raise TurnFailedError(step, reason, result, ids) from failure
        contents: list[str] = []
        for position, call in enumerate(turn.tool_calls):
            content, error = _run_tool(tools, call)
            contents.append(content)
            emit(_executed(step, position, call, content, error))
        done = store.commit_turn(conversation, turn, contents, expected_seq=len(history))
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
    committed (the turn and its results only go in together).
    """
    _check_max_turns(max_turns)
    request = _base_request(model, tools, tool_specs, request_options)

    async def emit(event: AgentEvent) -> None:
        if on_event is not None:
            outcome = on_event(event)
            if inspect.isawaitable(outcome):
                await outcome

    try:
        await store.next_seq(conversation)
    except LookupError:
        await store.create_conversation(conversation, exist_ok=True)
    if messages:
        await store.append(conversation, list(messages))
    committed: list[CommittedTurn] = []
    for step in range(1, max_turns + 1):
        history = await store.history(conversation)
        await emit(RequestSent(step, len(history)))
        parser = StreamParser()
        try:
            failure = await _astream(client, {**request, "messages": history}, parser, emit)
        except BaseException as exc:  # cancelled, or on_event failed: record, re-raise
            _abort(parser, exc)
            if record_attempts:
                ids = await store.record_attempt(conversation, parser.result())
                await emit(AttemptRecorded(step, ids, _why(parser.result())))
            raise
        result = parser.result()
        turn = _usable_turn(result, failure)
        if turn is None:
            reason = _why(result)
            ids = await store.record_attempt(conversation, result) if record_attempts else []
            await emit(AttemptRecorded(step, ids, reason))
            raise TurnFailedError(step, reason, result, ids) from failure
        calls = turn.tool_calls
        contents = list(
            await asyncio.gather(*(_aexecute(tools, step, p, c, emit) for p, c in enumerate(calls)))
        )
        done = await store.commit_turn(conversation, turn, contents, expected_seq=len(history))
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
