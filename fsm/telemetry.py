"""Logs and traces: what fsm tells a host service about its work.

**Logging.** fsm logs through the standard :mod:`logging` module, under the ``fsm`` logger (which
has a :class:`logging.NullHandler`, so nothing is printed unless the application configures
logging):

* ``fsm.store``: a turn committed (or written in a caller's transaction), an attempt recorded,
  messages appended (``INFO``); a write that failed (``INFO``), a conflict with another writer
  or a busy database (``WARNING``). These records also carry their fields as ``record.fsm`` (a
  dict: ``conversation_id``, ``seq``, ``messages``, ``created``, ``response_id``,
  ``attempt_ids``, ``expected_seq``, ``actual_seq``, ...), for structured handlers;
* ``fsm.store.migrate``: a migration run (``INFO``);
* ``fsm.agent``: a request sent and a tool run (``DEBUG``), a response's anomaly counts
  (``INFO``), a turn that failed (``WARNING``, with its reason), one that could not even be
  recorded (``ERROR``);
* ``fsm.parser``: each anomaly with its detail (``DEBUG``).

Records at ``INFO`` and above carry ids, counts, seqs and reasons, never message content, tool
arguments or results.

**Tracing and metrics (OpenTelemetry).** With ``opentelemetry-api`` installed
(``pip install 'fsm-toolcalls[otel]'``), the agent loop and the store emit spans through the
global tracer provider and metrics through the global meter provider, following the
OpenTelemetry semantic conventions for generative AI (the manual's "OpenTelemetry" page lists
every span, attribute and metric):

* ``invoke_agent`` (kind ``INTERNAL``): a whole run of the agent loop, the parent of the spans
  below: ``gen_ai.operation.name`` ``invoke_agent``, ``gen_ai.provider.name``
  (:func:`provider_name`: ``openai``, ``anthropic``, ``azure.ai.openai``, ``groq``, ...),
  ``gen_ai.conversation.id``, ``gen_ai.request.model``, ``fsm.status`` / ``fsm.turns``;
* ``chat {model}`` (kind ``CLIENT``): one model call in any of the three formats, from the
  request to the end of its stream: ``gen_ai.operation.name`` ``chat``,
  ``gen_ai.provider.name``, the request's model and parameters, ``gen_ai.response.id`` /
  ``.model`` / ``.finish_reasons``, ``gen_ai.response.time_to_first_chunk``, the usage
  (``gen_ai.usage.input_tokens`` including cached tokens, ``output_tokens``,
  ``cache_read.input_tokens``, ``cache_creation.input_tokens``,
  ``reasoning.output_tokens``, from each format's own usage fields), ``server.address`` /
  ``server.port``, and ``fsm.stream.end``, ``fsm.turn.complete``, ``fsm.tool_calls``; an
  incomplete turn or a failed request sets the status to error (``error.type``). When an
  instrumentation wraps the SDK method (:func:`instrumented`, e.g.
  ``opentelemetry-instrumentation-openai-v2``), its span is the call's ``chat`` span: fsm
  adds none, hands the instrumentation what it read (:func:`stream_ended`) and still reads
  the raw bytes (:func:`fsm.clients.instrumented_stream`);
* ``execute_tool {name}`` (kind ``INTERNAL``): each tool run: ``gen_ai.operation.name``
  ``execute_tool``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.tool.type``
  ``function``; an error result sets the status to error (``error.type`` ``tool_error``);
* ``commit_turn`` / ``record_attempt`` / ``append`` (kind ``INTERNAL``): each write of the
  store: ``db.system.name`` (``sqlite`` or ``postgresql``), ``db.operation.name``,
  ``gen_ai.conversation.id``, ``gen_ai.response.id``, ``fsm.seq``, ``fsm.messages``,
  ``fsm.created``, ``fsm.attempt_ids``, ``fsm.caller_transaction`` (written inside a caller's
  transaction: not yet committed).

Metrics (meter ``fsm``): ``gen_ai.client.operation.duration`` (s),
``gen_ai.client.token.usage`` ({token}, by ``gen_ai.token.type``),
``gen_ai.client.operation.time_to_first_chunk`` (s), and ``fsm.tool_calls`` ({call}, a
counter by ``fsm.tool_call.state``: ``finished``, ``truncated``, ``aborted``).

Spans are children of whatever span is current (a host's request span), and are the current span
while they run (an HTTP client instrumentation nests under ``chat``). Without opentelemetry
installed, nothing of it is imported and the decorated functions are the plain functions: zero
cost. (No span carries message content either.)

The functions here are decorators applied once, where the work happens (``fsm.agent`` and
``fsm.store``); they are not needed by users.

This module holds the ``invoke_agent`` and ``execute_tool`` spans and the store's write records;
the ``chat {model}`` span is :mod:`fsm.telemetry_chat` and the plumbing (the tracer, the
provider, the metric instruments) :mod:`fsm.telemetry_otel`; every name above is importable
from here.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fsm.telemetry_chat import chat_span, stream_ended, stream_opened
from fsm.telemetry_otel import (
    OPERATION,
    OTEL,
    P,
    R,
    get_tracer,
    instrumented,
    log,
    mark_error,
    provider_name,
)

__all__ = [
    "OPERATION",
    "OTEL",
    "agent_span",
    "chat_span",
    "instrumented",
    "log",
    "provider_name",
    "store_write",
    "stream_ended",
    "stream_opened",
    "tool_span",
]


# -- invoke_agent ------------------------------------------------------------------------------
def agent_span(function: Callable[P, R]) -> Callable[P, R]:
    """Decorate an agent loop (``(client, store, conversation, tools, *, model, ...)``, sync or
    async): an ``invoke_agent`` span around the whole run, the parent of its ``chat``,
    ``execute_tool`` and store spans."""
    if not OTEL:
        return function
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def arun(*args: Any, **kwargs: Any) -> Any:
            with _start_agent(args, kwargs) as span:
                result = await function(*args, **kwargs)
                _end_agent(span, result)
                return result

        return arun  # type: ignore[return-value]

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with _start_agent(args, kwargs) as span:
            result = function(*args, **kwargs)
            _end_agent(span, result)
            return result

    return run


def _start_agent(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    from opentelemetry.trace import SpanKind

    client = args[0] if args else kwargs.get("client")
    fmt = kwargs.get("format", "chat")
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": provider_name(client, fmt if isinstance(fmt, str) else "chat"),
    }
    conversation = kwargs.get("conversation", args[2] if len(args) > 2 else None)
    if isinstance(conversation, str):
        attributes["gen_ai.conversation.id"] = conversation
    model = kwargs.get("model")
    if isinstance(model, str):
        attributes["gen_ai.request.model"] = model
    return get_tracer().start_as_current_span(
        "invoke_agent", kind=SpanKind.INTERNAL, attributes=attributes
    )


def _end_agent(span: Any, result: object) -> None:
    status, turns = getattr(result, "status", None), getattr(result, "turns", None)
    if isinstance(status, str):
        span.set_attribute("fsm.status", status)
    if isinstance(turns, list):
        span.set_attribute("fsm.turns", len(turns))


# -- execute_tool {name} -----------------------------------------------------------------------
def tool_span(function: Callable[P, R]) -> Callable[P, R]:
    """Decorate the function that runs one tool call (a :class:`~fsm.toolcall.ToolCall`
    argument, returning ``(content, error)``; sync or async): an ``execute_tool {name}`` span
    around it."""
    if not OTEL:
        return function
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def arun(*args: Any, **kwargs: Any) -> Any:
            with _start_tool(args, kwargs) as span:
                outcome = await function(*args, **kwargs)
                _end_tool(span, outcome)
                return outcome

        return arun  # type: ignore[return-value]

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with _start_tool(args, kwargs) as span:
            outcome = function(*args, **kwargs)
            _end_tool(span, outcome)
            return outcome

    return run


def _start_tool(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    from opentelemetry.trace import SpanKind

    call = kwargs.get("call") or next(
        (a for a in args if hasattr(a, "arguments") and hasattr(a, "name") and hasattr(a, "id")),
        None,
    )
    name = getattr(call, "name", None) or "tool"
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.type": "function",
    }
    call_id = getattr(call, "id", None)
    if isinstance(call_id, str):
        attributes["gen_ai.tool.call.id"] = call_id
    return get_tracer().start_as_current_span(
        f"execute_tool {name}", kind=SpanKind.INTERNAL, attributes=attributes
    )


def _end_tool(span: Any, outcome: object) -> None:
    if isinstance(outcome, tuple) and len(outcome) == 2 and outcome[1] is True:
        mark_error(span, "tool_error")


# -- the store's writes ------------------------------------------------------------------------
_store_log = logging.getLogger("fsm.store")


def store_write(operation: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a write method of a store (``commit_turn``, ``record_attempt``, ``append``;
    sync or async; ``(self, conversation_id, ...)``): its log record and, with opentelemetry, a
    span named ``operation`` around it."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def awrite(*args: Any, **kwargs: Any) -> Any:
                with _StoreWrite(operation, args) as write:
                    return write.done(await function(*args, **kwargs))

            return awrite  # type: ignore[return-value]

        @functools.wraps(function)
        def write(*args: P.args, **kwargs: P.kwargs) -> R:
            with _StoreWrite(operation, args) as write:
                return write.done(function(*args, **kwargs))

        return write

    return decorate


class _StoreWrite:
    """One write of a store: the span (if tracing) and the log records of its outcome."""

    __slots__ = ("_cm", "bound", "conversation_id", "operation", "response_id", "span", "store")

    def __init__(self, operation: str, args: tuple[Any, ...]) -> None:
        self.operation = operation
        self.store = args[0] if args else None
        conversation_id = args[1] if len(args) > 1 else None
        self.conversation_id = conversation_id if isinstance(conversation_id, str) else None
        turn = args[2] if operation == "commit_turn" and len(args) > 2 else None
        # a Turn or a one-choice ParseResult: both have response_id
        response_id = getattr(turn, "response_id", None)
        self.response_id = response_id if isinstance(response_id, str) else None
        self.bound = bool(getattr(self.store, "caller_transaction", False))
        self.span: Any = None
        self._cm: Any = None

    def __enter__(self) -> _StoreWrite:
        if OTEL:
            from opentelemetry.trace import SpanKind

            attributes: dict[str, Any] = {
                "db.operation.name": self.operation,
                "fsm.caller_transaction": self.bound,
            }
            dialect = getattr(self.store, "dialect", None)
            if isinstance(dialect, str):
                attributes["db.system.name"] = dialect
            if self.conversation_id is not None:
                attributes["gen_ai.conversation.id"] = self.conversation_id
            if self.response_id:
                attributes["gen_ai.response.id"] = self.response_id
            self._cm = get_tracer().start_as_current_span(
                self.operation, kind=SpanKind.INTERNAL, attributes=attributes
            )
            self.span = self._cm.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            kind = type(exc).__name__
            level = logging.WARNING if kind in ("ConflictError", "StoreBusyError") else logging.INFO
            log(
                _store_log,
                level,
                "{operation} failed on conversation {conversation_id!r}: {error}",
                operation=self.operation,
                conversation_id=self.conversation_id,
                error=kind,
                expected_seq=getattr(exc, "expected_seq", None),
                actual_seq=getattr(exc, "actual_seq", None),
                caller_transaction=self.bound,
            )
            if self.span is not None:
                mark_error(self.span, kind)
        if self._cm is not None:
            self._cm.__exit__(exc_type, exc, tb)

    def done(self, value: R) -> R:
        """Log (and describe on the span) what the write returned."""
        fields: dict[str, Any] = {
            "conversation_id": self.conversation_id,
            "caller_transaction": self.bound,
        }
        what = "committed" if not self.bound else "written in the caller's transaction"
        if self.operation == "commit_turn":
            seq, messages = getattr(value, "seq", None), getattr(value, "messages", ())
            created = bool(getattr(value, "created", True))
            fields.update(seq=seq, messages=len(messages), created=created)
            text = (
                "turn {what} to conversation {conversation_id!r} at seq {seq} ({messages} messages)"
                if created
                else "turn already in conversation {conversation_id!r} at seq {seq} (not written again)"
            )
            fields["response_id"] = self.response_id
        elif self.operation == "record_attempt":
            ids = list(value) if isinstance(value, list) else []
            fields.update(attempt_ids=ids, attempts=len(ids))
            text = "attempt {attempt_ids} recorded for conversation {conversation_id!r}"
            what = ""
        else:
            fields.update(next_seq=value)
            text = "messages {what} to conversation {conversation_id!r} (next seq {next_seq})"
        log(_store_log, logging.INFO, text, what=what, **fields)
        span = self.span
        if span is not None:
            for key in ("seq", "messages", "created", "next_seq"):
                if isinstance(fields.get(key), int | bool):
                    span.set_attribute(f"fsm.{key}", fields[key])
            if fields.get("attempt_ids"):
                span.set_attribute("fsm.attempt_ids", [int(i) for i in fields["attempt_ids"]])
        return value
