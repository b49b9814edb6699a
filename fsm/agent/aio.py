"""The asyncio driver of the agent loop: :func:`arun_agent_loop` does the I/O (the store, the
``openai`` stream, the tools, concurrently) around :class:`~fsm.agent.step.AgentLoop`, which
decides, as :func:`~fsm.agent.run_agent_loop` does."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from fsm.agent.errors import UnknownOutcomeError, arelease_lease
from fsm.agent.events import AgentEvent, AgentResult, AttemptRecorded
from fsm.agent.step import (
    AgentLoop,
    Commit,
    Record,
    RecordingFailed,
    StreamFormat,
    abort,
    build_request,
    executed,
    forget_in_hand,
    heartbeat,
    in_hand,
    keep_in_hand,
    ledger_plan,
    no_stream,
    record_budget,
    store_operation,
    transient,
    uses_ledger,
)
from fsm.agent.tools import Tool, arun_tool, refusal
from fsm.clients import aiter_openai_events, instrumented_stream
from fsm.parser import StreamParser
from fsm.telemetry import agent_span, chat_span, instrumented, stream_ended, stream_opened
from fsm.toolcall import ToolCall

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from fsm.parser import Anomaly, ParseResult, Turn
    from fsm.store.store import CommittedTurn, Results

__all__ = ["AsyncStoreLike", "aopen_stream", "arun_agent_loop"]

T = TypeVar("T")

_Emit = Callable[[AgentEvent], Awaitable[None]]


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
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Any = ...,
    ) -> Sequence[Mapping[str, Any]]: ...


@agent_span
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
    ledger: bool = False,
    format: StreamFormat = "chat",
    max_tokens: int | None = None,
) -> AgentResult:
    """The asyncio twin of :func:`run_agent_loop`: an ``openai.AsyncOpenAI`` client (or an
    ``anthropic.AsyncAnthropic`` one for ``format="anthropic"``) and an
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
    if ledger and not uses_ledger(store):
        raise TypeError(
            f"ledger=True needs a store with the tool ledger (begin, pending, claim, started, "
            f"succeeded, failed, commit, abandon), which {type(store).__name__} does not have"
        )
    loop = AgentLoop(
        conversation,
        max_turns=max_turns,
        record_attempts=record_attempts,
        format=format,
        tools=tools,
    )
    request = build_request(model, tools, tool_specs, request_options, format, max_tokens)

    async def emit(event: AgentEvent) -> None:
        if on_event is not None:
            outcome = on_event(event)
            if inspect.isawaitable(outcome):
                await outcome

    try:
        with store_operation("next_seq", 0):
            await store.next_seq(conversation)
    except LookupError:  # ConversationNotFoundError
        with store_operation("create_conversation", 0):
            await store.create_conversation(conversation, exist_ok=True)
    book: Any = store if ledger else None
    if book is not None:
        with store_operation("pending", 0):
            found = await book.pending(conversation)
        pending = None
        if found is not None:  # an earlier run crashed while its tools ran: resume it
            with store_operation("claim", 0):  # TurnInProgressError while its owner lives
                pending = await _aclaimed(book, found, record_budget(book))
        if pending is not None:
            try:
                async with heartbeat(book, pending):
                    await _aledger_tools(book, pending, tools, emit, 0)
                resumed = await book.commit(pending)
            except UnknownOutcomeError:  # this run owns the turn: the error's holder decides
                raise
            except RecordingFailed as failed:
                await arelease_lease(book, pending)  # the next run resumes at once
                failed.cause.add_note(
                    "fsm: a resumed tool ran but its outcome could not be recorded; it is kept "
                    f"in hand and the next run on this store records it: {failed.contents!r}"
                )
                raise failed.cause from None
            except BaseException:
                await arelease_lease(book, pending)
                raise
            await emit(loop.resumed(resumed))
    if messages:
        with store_operation("append", 0):
            await store.append(conversation, list(messages))
    for step in loop.steps():
        with store_operation("history", step):
            history = (
                await store.history(conversation, format=format)
                if format != "chat"
                else await store.history(conversation)
            )
        parser, sent = loop.send(history)
        await emit(sent)
        try:
            failure = await _astream(client, loop.request(request, history), parser, emit, format)
        except BaseException as exc:  # cancelled, or on_event failed: record, re-raise
            await _arecord(store, loop.interrupted(parser, exc), emit)
        action = loop.decide(parser.result(), failure)
        if isinstance(action, Record):
            await _arecord(store, action, emit)
        if book is not None and action.calls:
            done = await _aledger_commit(book, action, tools, emit)
        else:
            runs = (_aexecute(tools, action, p, c, emit) for p, c in enumerate(action.calls))
            contents = list(await asyncio.gather(*runs))
            try:
                done = await store.commit_turn(
                    conversation, action.turn, contents, expected_seq=action.expected_seq
                )
            except BaseException as exc:  # the tools ran (cancelled too): record, then raise
                await _arecord(store, action.failed(contents, exc), emit)
        event, stop = loop.committed(action, done)
        await emit(event)
        if stop is not None:
            return stop
    return loop.out_of_turns()


@chat_span
async def _astream(
    client: Any,
    request: dict[str, Any],
    parser: StreamParser,
    emit: _Emit,
    format: StreamFormat = "chat",
) -> Exception | None:
    """The async twin of :func:`fsm.agent.loop._stream`."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            source = await stack.enter_async_context(aopen_stream(client, request, format))
        except Exception as exc:  # no stream at all: an HTTP error, a refused connection
            return no_stream(parser, exc)
        stream_opened(source)
        events = aiter_openai_events(source, parser=parser)
        failure: Exception | None = None
        try:
            while True:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    failure = exc
                    break
                try:
                    await emit(event)
                except BaseException as exc:  # the callback failed, or cancelled while in it
                    abort(parser, exc)
                    raise
        finally:
            await events.aclose()
            # before the response closes: an instrumentation's span ends with fsm's reading
            stream_ended(events, failure or sys.exc_info()[1])
        return failure


@contextlib.asynccontextmanager
async def aopen_stream(
    client: Any, request: dict[str, Any], format: StreamFormat = "chat"
) -> AsyncIterator[Any]:
    """The async twin of :func:`fsm.agent.loop.open_stream`: the raw ``AsyncAPIResponse`` of
    ``with_streaming_response``, or the parsed ``AsyncStream`` for a client without it
    (``client.responses`` / an ``anthropic`` client's ``messages`` for the other formats)."""
    if format != "chat":
        resource: Any = client.responses if format == "responses" else client.messages
        async with resource.with_streaming_response.create(**request) as response:
            yield response
        return
    completions: Any = client.chat.completions
    raw = getattr(completions, "with_streaming_response", None)
    if raw is not None and not instrumented(client, format):
        async with raw.create(**request) as response:
            yield response
        return
    # An instrumentation (opentelemetry-instrumentation-openai-v2) wraps create(): on the
    # async client it cannot wrap with_streaming_response (it parses the AsyncAPIResponse
    # without awaiting it), so fsm asks for the parsed stream, which the instrumentation
    # wraps, and reads the raw bytes of its HTTP response (fsm.clients.instrumented_stream).
    stream = await completions.create(**request)
    inner = instrumented_stream(stream)
    if inner is None:
        async with stream:
            yield stream
        return
    try:
        yield stream
    finally:
        await inner.response.aclose()
        stream.cleanup(sys.exc_info()[1])  # its span, if fsm did not end it (else a no-op)


async def _aexecute(
    tools: Mapping[str, Tool], commit: Commit, position: int, call: ToolCall, emit: _Emit
) -> str:
    content, error = await arun_tool(tools, call)
    await emit(commit.executed(position, call, content, error))
    return content


async def _aledger_commit(
    ledger: Any, action: Commit, tools: Mapping[str, Tool], emit: _Emit
) -> CommittedTurn:
    """The async twin of :func:`fsm.agent.loop._ledger_commit` (the tools run concurrently,
    each between its own ``started`` and ``succeeded``/``failed``)."""
    contents: list[str] = []
    try:
        pending = await ledger.begin(
            action.loop.conversation, action.turn, expected_seq=action.expected_seq
        )
    except BaseException as exc:  # nothing ran
        await _arecord(ledger, action.failed(contents, exc), emit)
    try:
        async with heartbeat(ledger, pending):
            contents = await _aledger_tools(ledger, pending, tools, emit, action.loop.step)
    except UnknownOutcomeError:  # (a same turn begun by an owner that is gone)
        raise
    except RecordingFailed as failed:  # a tool ran; its outcome is on the error, and kept
        await arelease_lease(ledger, pending)  # the next run resumes at once
        await _arecord(ledger, action.failed(failed.contents, failed.cause), emit)
    except BaseException:
        await arelease_lease(ledger, pending)
        raise
    try:
        done: CommittedTurn = await ledger.commit(pending)
    except BaseException as exc:  # the tools ran and their outcomes are in the ledger
        await arelease_lease(ledger, pending)
        await _arecord(ledger, action.failed(contents, exc), emit)
    return done


async def _aledger_tools(
    ledger: Any, pending: Any, tools: Mapping[str, Tool], emit: _Emit, step: int
) -> list[str]:
    """The async twin of :func:`fsm.agent.loop._ledger_tools`."""
    budget = record_budget(ledger)
    for position, (kept, failed) in in_hand(ledger, pending).items():
        pending = await _arecord_outcome(ledger, pending, position, kept, failed, budget)
        forget_in_hand(ledger, pending, position)

    async def one(position: int, call: Any, known: str | None) -> str:
        if known is not None:
            return known
        await _aretried(lambda: ledger.started(pending, position), budget)
        content, error = await arun_tool(tools, call)
        refused = refusal(tools, call) is not None
        event = executed(step, position, call, content, error, refused)
        try:
            await _arecord_outcome(ledger, pending, position, content, error, budget)
        except Exception as exc:
            keep_in_hand(ledger, pending, position, content, error)
            await emit(event)
            raise RecordingFailed([content], exc) from exc
        await emit(event)
        return content

    plan = ledger_plan(ledger, pending, tools)
    # every tool ends before anything is raised (the lease is released on the way out, and a
    # tool still running must not be taken over)
    done = await asyncio.gather(*(one(p, c, k) for p, c, k in plan), return_exceptions=True)
    failures = [d for d in done if isinstance(d, BaseException)]
    if failures:
        recorded = [d for d in done if isinstance(d, str)]
        first = failures[0]
        if isinstance(first, RecordingFailed):
            raise RecordingFailed(recorded + first.contents, first.cause) from first.cause
        raise first
    return [d for d in done if isinstance(d, str)]


async def _arecord_outcome(
    ledger: Any, pending: Any, position: int, content: str, error: bool, budget: float
) -> Any:
    """The async twin of :func:`fsm.agent.loop._record_outcome`."""
    record = ledger.failed if error else ledger.succeeded
    return await _aretried(lambda: record(pending, position, content), budget)


async def _aclaimed(book: Any, found: Any, budget: float) -> Any:
    """``found`` claimed to resume it, or ``None`` when it was resolved since it was read (as
    the sync loop's ``_claimed``)."""
    try:
        return await _aretried(lambda: book.claim(found), budget)
    except Exception:
        now = await book.pending(found.conversation_id)
        if now is None or now.id != found.id:
            return None
        raise


async def _aretried(step: Callable[[], Awaitable[T]], budget: float) -> T:
    """The async twin of :func:`fsm.agent.loop._retried`."""
    deadline = time.monotonic() + budget
    pause = 0.05
    while True:
        try:
            return await step()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(1.0, pause * 2)


async def _arecord(store: AsyncStoreLike, record: Record, emit: _Emit) -> NoReturn:
    """The async twin of :func:`fsm.agent.loop._record`."""
    event: AttemptRecorded | None
    if not record.wanted:
        event, error = record.skipped()
    else:
        try:
            ids = await store.record_attempt(
                record.loop.conversation, record.attempt, **record.options
            )
        except Exception as record_exc:
            event, error = None, record.not_recorded(record_exc)
        else:
            event, error = record.recorded(ids)
    if event is not None:
        await emit(event)
    raise error
