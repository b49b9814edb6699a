"""The sync driver of the agent loop: :func:`run_agent_loop` does the I/O (the store, the
``openai`` stream, the tools) around :class:`~fsm.agent.step.AgentLoop`, which decides."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from fsm.agent.errors import UnknownOutcomeError, release_lease
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
    started_here,
    store_operation,
    transient,
    uses_ledger,
)
from fsm.agent.tools import Tool, refusal, run_tool
from fsm.clients import iter_openai_events
from fsm.parser import StreamParser
from fsm.telemetry import agent_span, chat_span, stream_ended, stream_opened

if TYPE_CHECKING:
    from openai import OpenAI

    from fsm.parser import Anomaly, ParseResult, Turn
    from fsm.store.store import CommittedTurn, Results

__all__ = ["StoreLike", "open_stream", "run_agent_loop"]

T = TypeVar("T")


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
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Any = ...,
    ) -> Sequence[Mapping[str, Any]]: ...


@agent_span
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
    ledger: bool = False,
    format: StreamFormat = "chat",
    max_tokens: int | None = None,
) -> AgentResult:
    """Run the tool-calling loop on ``conversation`` until the model answers without tools.

    Args:
        client: an ``openai.OpenAI`` client (any OpenAI-compatible server, via ``base_url``),
            or an ``anthropic.Anthropic`` client for ``format="anthropic"``.
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
        ledger: run tools through the store's tool ledger (:mod:`fsm.store.ledger`): each turn
            with calls is stored pending before its tools run, each outcome recorded as it
            finishes, then committed; a run that finds a pending turn (an earlier run crashed)
            resumes it first: recorded outcomes are reused, calls never started run, a call
            started with no outcome runs again only if its tool is declared idempotent
            (:func:`~fsm.agent.tool`), else :class:`~fsm.agent.UnknownOutcomeError` is raised.
            A non-idempotent tool never runs twice. The pending turn is resumed only once its
            owner is gone (its lease, renewed by a heartbeat while its tools run, ran out):
            while the owner lives, the run raises
            :class:`~fsm.store.errors.TurnInProgressError` (retryable: ``retry_after``) before
            appending or sending anything. A brief store fault while recording a step is
            retried (each step is idempotent); a tool's outcome that still could not be
            recorded is kept in hand, and the next run on the same store records it.
        format: the API to speak: ``"chat"`` (``chat.completions``), ``"responses"``
            (``client.responses``: the history goes as ``input`` items) or ``"anthropic"``
            (``client.messages`` of the ``anthropic`` SDK). Each request carries the store's
            ``history(conversation, format=format)`` (a turn goes back as its parser's
            ``to_items()`` / ``to_anthropic()`` rendered it: encrypted reasoning and thinking
            signatures verbatim), and the answer is parsed as that format. For Anthropic, give
            the system prompt as ``request_options={"system": ...}``.
        max_tokens: the answer's token limit (``max_tokens`` for Anthropic, where it is
            required and defaults to 1024; ``max_output_tokens`` / ``max_completion_tokens``
            otherwise).

    Only the tools in ``tools`` run: a call that names no registered tool, or a Responses
    ``custom_tool_call`` (free-text input), gets an error result that says so and is reported
    as a :class:`~fsm.agent.ToolExecuted` with ``refused=True``; it never runs.

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
    emit = on_event or _ignore
    request = build_request(model, tools, tool_specs, request_options, format, max_tokens)
    try:
        with store_operation("next_seq", 0):
            store.next_seq(conversation)
    except LookupError:  # ConversationNotFoundError
        with store_operation("create_conversation", 0):
            store.create_conversation(conversation, exist_ok=True)
    book: Any = store if ledger else None
    if book is not None:
        with store_operation("pending", 0):
            found = book.pending(conversation)
        pending = None
        if found is not None:  # an earlier run crashed while its tools ran: resume it
            with store_operation("claim", 0):  # TurnInProgressError while its owner lives
                pending = _claimed(book, found, record_budget(book))
        if pending is not None:
            try:
                with heartbeat(book, pending):
                    resumed = _ledger_run(book, pending, tools, emit, 0)[1]
            except UnknownOutcomeError:  # this run owns the turn: the error's holder decides
                raise
            except RecordingFailed as failed:
                release_lease(book, pending)  # the next run resumes at once
                failed.cause.add_note(
                    "fsm: the resumed turn could not be recorded or committed; a tool's outcome "
                    "that was not recorded is kept in hand and the next run on this store "
                    f"records it; its results: {failed.contents!r}"
                )
                raise failed.cause from None
            except BaseException:
                release_lease(book, pending)
                raise
            emit(loop.resumed(resumed))
    if messages:
        with store_operation("append", 0):
            store.append(conversation, list(messages))
    for step in loop.steps():
        with store_operation("history", step):
            history = (
                store.history(conversation, format=format)
                if format != "chat"
                else store.history(conversation)
            )
        parser, sent = loop.send(history)
        emit(sent)
        try:
            failure = _stream(client, loop.request(request, history), parser, emit, format)
        except BaseException as exc:  # KeyboardInterrupt, a failing on_event: record, re-raise
            _record(store, loop.interrupted(parser, exc), emit)
        action = loop.decide(parser.result(), failure)
        if isinstance(action, Record):
            _record(store, action, emit)
        if book is not None and action.calls:
            done = _ledger_commit(book, action, tools, emit)
        else:
            contents = []
            for position, call in enumerate(action.calls):
                content, error = run_tool(tools, call)
                contents.append(content)
                emit(action.executed(position, call, content, error))
            try:
                done = store.commit_turn(
                    conversation, action.turn, contents, expected_seq=action.expected_seq
                )
            except BaseException as exc:  # the tools ran: record the turn with their results
                _record(store, action.failed(contents, exc), emit)
        event, stop = loop.committed(action, done)
        emit(event)
        if stop is not None:
            return stop
    return loop.out_of_turns()


def _ledger_commit(
    ledger: Any, action: Commit, tools: Mapping[str, Tool], emit: Callable[[AgentEvent], object]
) -> CommittedTurn:
    """Run ``action``'s tools through the ledger: begin (the turn stored pending, its first
    call started), each tool between its start and its outcome, then commit (with the last
    outcome). A failed begin or commit is recorded as the commit of the plain path is (the
    pending turn, if begun, stays for the next run to resume)."""
    contents: list[str] = []
    first = {"start": 0} if action.calls and _merges(ledger) else {}
    try:
        pending = ledger.begin(
            action.loop.conversation, action.turn, expected_seq=action.expected_seq, **first
        )
    except BaseException as exc:  # nothing ran
        _record(ledger, action.failed(contents, exc), emit)
    try:
        with heartbeat(ledger, pending):
            contents, done = _ledger_run(ledger, pending, tools, emit, action.loop.step)
    except UnknownOutcomeError:  # (a same turn begun by an owner that is gone)
        raise
    except RecordingFailed as failed:  # the tools ran; their results are on the error
        release_lease(ledger, pending)  # the next run resumes at once
        _record(ledger, action.failed(failed.contents, failed.cause), emit)
    except BaseException:
        release_lease(ledger, pending)
        raise
    return done


def _merges(ledger: Any) -> bool:
    """Whether ``ledger`` records an outcome with the next step (fsm's stores: ``begin(...,
    start=)``, ``started(..., recording=)``, ``commit(..., recording=)``)."""
    return callable(getattr(ledger, "ledger_outcome", None))


def _ledger_run(
    ledger: Any,
    pending: Any,
    tools: Mapping[str, Tool],
    emit: Callable[[AgentEvent], object],
    step: int,
) -> tuple[list[str], CommittedTurn]:
    """Each call's content (its recorded outcome, or its tool run now), then the commit.

    Outcomes kept in hand by an earlier run on this store are recorded first. A call is
    started before its tool runs; its outcome is recorded with the next call's start, and the
    last one with the commit (one transaction per call, plus the commit). Raises
    :class:`~fsm.agent.UnknownOutcomeError` before running anything if a started call of a
    tool that is not idempotent has no outcome. Each step is retried through brief store
    faults; an outcome that still cannot be recorded is kept in hand, and that failure, or the
    commit's, raises :class:`~fsm.agent.step.RecordingFailed` with the contents so far."""
    budget = record_budget(ledger)
    merge = _merges(ledger)
    for position, (content, error) in in_hand(ledger, pending).items():
        pending = _record_outcome(ledger, pending, position, content, error, budget)
        forget_in_hand(ledger, pending, position)
    contents: list[str] = []
    owed: tuple[int, str, bool] | None = None  # the last tool's outcome, not recorded yet
    for position, call, known in ledger_plan(ledger, pending, tools):
        if known is not None:
            contents.append(known)
            continue
        if not started_here(pending, position):  # (begin(start=...) started the first)
            try:
                if owed is not None and merge:
                    started = functools.partial(
                        ledger.started, pending, position, recording=_outcome(ledger, owed)
                    )
                else:
                    if owed is not None:
                        pending = _record_outcome(ledger, pending, *owed, budget)
                    started = functools.partial(ledger.started, pending, position)
                pending = _retried(started, budget)
            except Exception as exc:
                if owed is None:
                    raise
                keep_in_hand(ledger, pending, *owed)
                raise RecordingFailed(contents, exc) from exc
            owed = None
        content, error = run_tool(tools, call)
        contents.append(content)
        emit(executed(step, position, call, content, error, refusal(tools, call) is not None))
        owed = (position, content, error)
    try:
        if owed is not None and merge:
            commit = functools.partial(ledger.commit, pending, recording=_outcome(ledger, owed))
        else:
            if owed is not None:
                pending = _record_outcome(ledger, pending, *owed, budget)
            commit = functools.partial(ledger.commit, pending)
        done: CommittedTurn = _retried(commit, budget)
    except Exception as exc:
        if owed is not None:
            keep_in_hand(ledger, pending, *owed)
        raise RecordingFailed(contents, exc) from exc
    return contents, done


def _outcome(ledger: Any, owed: tuple[int, str, bool]) -> Any:
    """The store's ``ledger_outcome`` of call ``owed[0]``: its content as the result, or as the
    error text of a tool that failed."""
    position, content, error = owed
    if error:
        return ledger.ledger_outcome(position, error=content)
    return ledger.ledger_outcome(position, result=content)


def _record_outcome(
    ledger: Any, pending: Any, position: int, content: str, error: bool, budget: float
) -> Any:
    """Record call ``position``'s outcome, retrying brief faults (the step is idempotent)."""
    record = ledger.failed if error else ledger.succeeded
    return _retried(lambda: record(pending, position, content), budget)


def _claimed(book: Any, found: Any, budget: float) -> Any:
    """``found`` (read by ``pending()``) claimed to resume it, or ``None`` when it was resolved
    since it was read: its owner committed or abandoned it meanwhile, so there is nothing to
    resume (the claim's own error is raised while the turn is still pending)."""
    try:
        return _retried(lambda: book.claim(found), budget)
    except Exception:
        now = book.pending(found.conversation_id)
        if now is None or now.id != found.id:
            return None
        raise


def _retried(step: Callable[[], T], budget: float) -> T:
    """``step()``, tried again after a brief store fault (:func:`~fsm.agent.step.transient`)
    for up to ``budget`` seconds, with a growing pause (50 ms to 1 s)."""
    deadline = time.monotonic() + budget
    pause = 0.05
    while True:
        try:
            return step()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(1.0, pause * 2)


@chat_span
def _stream(
    client: OpenAI,
    request: dict[str, Any],
    parser: StreamParser,
    emit: Callable[[AgentEvent], object],
    format: StreamFormat = "chat",
) -> Exception | None:
    """Send the request and feed the streamed answer to ``parser``; the transport's exception
    (the parser then has ended with its reason), or ``None``."""
    with contextlib.ExitStack() as stack:
        try:
            source = stack.enter_context(open_stream(client, request, format))
        except Exception as exc:  # no stream at all: an HTTP error, a refused connection
            return no_stream(parser, exc)
        stream_opened(source)
        events = iter_openai_events(source, parser=parser)
        failure: Exception | None = None
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration:
                    break
                except Exception as exc:
                    failure = exc
                    break
                try:
                    emit(event)
                except BaseException as exc:  # the callback failed: the turn ends with it
                    abort(parser, exc)
                    raise
        finally:
            events.close()
            # before the response closes: an instrumentation's span ends with fsm's reading
            stream_ended(events, failure or sys.exc_info()[1])
        return failure


def open_stream(
    client: Any, request: dict[str, Any], format: StreamFormat = "chat"
) -> contextlib.AbstractContextManager[Any]:
    """The streamed response to ``request``, to enter: the raw ``APIResponse`` of
    ``chat.completions.with_streaming_response.create`` (fsm parses its bytes), or, for a
    client without ``with_streaming_response`` (an OpenAI-compatible look-alike), the parsed
    ``Stream`` of ``chat.completions.create``. ``format="responses"`` uses
    ``client.responses``, ``"anthropic"`` ``client.messages`` (of an ``anthropic`` client),
    both through ``with_streaming_response`` (their raw bytes)."""
    if format != "chat":
        resource: Any = client.responses if format == "responses" else client.messages
        manager_: contextlib.AbstractContextManager[Any] = resource.with_streaming_response.create(
            **request
        )
        return manager_
    completions: Any = client.chat.completions
    raw = getattr(completions, "with_streaming_response", None)
    if raw is not None:
        manager: contextlib.AbstractContextManager[Any] = raw.create(**request)
        return manager
    stream: contextlib.AbstractContextManager[Any] = completions.create(**request)
    return stream


def _record(store: StoreLike, record: Record, emit: Callable[[AgentEvent], object]) -> NoReturn:
    """Record the attempt as ``record`` says, emit its event, and raise its exception."""
    event: AttemptRecorded | None
    if not record.wanted:
        event, error = record.skipped()
    else:
        try:
            ids = store.record_attempt(record.loop.conversation, record.attempt, **record.options)
        except Exception as record_exc:
            event, error = None, record.not_recorded(record_exc)
        else:
            event, error = record.recorded(ids)
    if event is not None:
        emit(event)
    raise error


def _ignore(_event: AgentEvent) -> None:
    pass
