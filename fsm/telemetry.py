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

**Tracing (OpenTelemetry).** With ``opentelemetry-api`` installed
(``pip install 'fsm-toolcalls[otel]'``), the agent loop and the store emit spans through the
global tracer provider, following the OpenTelemetry semantic conventions for generative AI:

* ``invoke_agent`` (kind ``INTERNAL``): a whole run of the agent loop, the parent of the spans
  below: ``gen_ai.operation.name`` ``invoke_agent``, ``gen_ai.provider.name``,
  ``gen_ai.conversation.id``, ``gen_ai.request.model``, and ``fsm.status`` / ``fsm.turns`` (how
  it ended, the turns committed);
* ``chat {model}`` (kind ``CLIENT``): one model turn, from the request to the end of its stream:
  ``gen_ai.operation.name`` ``chat``, ``gen_ai.provider.name`` and ``gen_ai.system`` ``openai``
  (the API spoken), ``gen_ai.request.model``, ``gen_ai.response.id``, ``gen_ai.response.model``,
  ``gen_ai.response.finish_reasons``, ``gen_ai.usage.input_tokens`` /
  ``gen_ai.usage.output_tokens``, ``server.address`` / ``server.port``, and fsm's own
  ``fsm.stream.end`` (how the stream ended), ``fsm.turn.complete``, ``fsm.tool_calls``; an
  incomplete turn or a failed request sets the span's status to error (``error.type``);
* ``execute_tool {name}`` (kind ``INTERNAL``): each tool run: ``gen_ai.operation.name``
  ``execute_tool``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.tool.type``
  ``function``; an error result sets the status to error (``error.type`` ``tool_error``);
* ``commit_turn`` / ``record_attempt`` / ``append`` (kind ``INTERNAL``): each write of the
  store: ``db.system.name`` (``sqlite`` or ``postgresql``), ``db.operation.name``,
  ``gen_ai.conversation.id``, ``gen_ai.response.id``, ``fsm.seq``, ``fsm.messages``,
  ``fsm.created``, ``fsm.attempt_ids``, ``fsm.caller_transaction`` (written inside a caller's
  transaction: not yet committed).

Spans are children of whatever span is current (a host's request span), and are the current span
while they run (an HTTP client instrumentation nests under ``chat``). Without opentelemetry
installed, nothing of it is imported and the decorated functions are the plain functions: zero
cost. (No span carries message content either.)

The functions here are decorators applied once, where the work happens (``fsm.agent`` and
``fsm.store``); they are not needed by users.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, ParamSpec, TypeVar

__all__ = ["OTEL", "agent_span", "chat_span", "log", "store_write", "tool_span"]

P = ParamSpec("P")
R = TypeVar("R")


def _installed(name: str) -> bool:
    """Whether the module ``name`` can be imported (looked up; a top-level name is not
    imported to find out)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken install, a finder that refuses
        return False


#: Whether ``opentelemetry-api`` is installed.
OTEL: Final = _installed("opentelemetry") and _installed("opentelemetry.trace")

#: The API fsm's spans describe (every client fsm drives speaks OpenAI Chat Completions).
PROVIDER: Final = "openai"

_tracer: Any = None


def log(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log ``message`` (``%(name)s``-style fields in the text) with ``fields`` also as
    ``record.fsm`` (a dict), when ``logger`` is enabled for ``level``."""
    if logger.isEnabledFor(level):
        text = message.format(**fields) if fields else message
        logger.log(level, text, extra={"fsm": fields}, stacklevel=2)


def _get_tracer() -> Any:
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        from fsm import __version__

        _tracer = trace.get_tracer("fsm", __version__)
    return _tracer


def _error(span: Any, error_type: str, description: str | None = None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, description))


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

    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.system": PROVIDER,
    }
    conversation = kwargs.get("conversation", args[2] if len(args) > 2 else None)
    if isinstance(conversation, str):
        attributes["gen_ai.conversation.id"] = conversation
    model = kwargs.get("model")
    if isinstance(model, str):
        attributes["gen_ai.request.model"] = model
    return _get_tracer().start_as_current_span(
        "invoke_agent", kind=SpanKind.INTERNAL, attributes=attributes
    )


def _end_agent(span: Any, result: object) -> None:
    status, turns = getattr(result, "status", None), getattr(result, "turns", None)
    if isinstance(status, str):
        span.set_attribute("fsm.status", status)
    if isinstance(turns, list):
        span.set_attribute("fsm.turns", len(turns))


# -- chat {model} ------------------------------------------------------------------------------
def chat_span(function: Callable[P, R]) -> Callable[P, R]:
    """Decorate the function that sends one request and feeds its streamed answer to a parser
    (``(client, request, parser, ...)``, returning the transport's exception or ``None``;
    sync or async): a ``chat {model}`` span around it."""
    if not OTEL:
        return function
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def achat(*args: Any, **kwargs: Any) -> Any:
            client, request, parser = _chat_args(args)
            with _start_chat(client, request) as span:
                outcome = await function(*args, **kwargs)
                _end_chat(span, parser, outcome)
                return outcome

        return achat  # type: ignore[return-value]

    @functools.wraps(function)
    def chat(*args: P.args, **kwargs: P.kwargs) -> R:
        client, request, parser = _chat_args(args)
        with _start_chat(client, request) as span:
            outcome = function(*args, **kwargs)
            _end_chat(span, parser, outcome)
            return outcome

    return chat


def _chat_args(args: tuple[Any, ...]) -> tuple[Any, Mapping[str, Any], Any]:
    client = args[0] if args else None
    request = next((a for a in args if isinstance(a, Mapping)), {})
    parser = next((a for a in args if hasattr(a, "receive_data") and hasattr(a, "result")), None)
    return client, request, parser


def _start_chat(client: Any, request: Mapping[str, Any]) -> Any:
    from opentelemetry.trace import SpanKind

    model = request.get("model")
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.system": PROVIDER,
    }
    if isinstance(model, str):
        attributes["gen_ai.request.model"] = model
    for key, name in (
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ):
        value = request.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[name] = value
    base_url = getattr(client, "base_url", None)
    host, port = getattr(base_url, "host", None), getattr(base_url, "port", None)
    if isinstance(host, str) and host:
        attributes["server.address"] = host
        if isinstance(port, int):
            attributes["server.port"] = port
    name = f"chat {model}" if isinstance(model, str) else "chat"
    return _get_tracer().start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes)


def _end_chat(span: Any, parser: Any, outcome: object) -> None:
    if parser is None:
        return
    result = parser.result()
    if result.response_id:
        span.set_attribute("gen_ai.response.id", result.response_id)
    if result.model:
        span.set_attribute("gen_ai.response.model", result.model)
    reasons = [t.finish_reason for t in result.turns if t.finish_reason]
    if reasons:
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
    usage = result.usage if isinstance(result.usage, Mapping) else {}
    for key, name in (
        ("prompt_tokens", "gen_ai.usage.input_tokens"),
        ("completion_tokens", "gen_ai.usage.output_tokens"),
    ):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            span.set_attribute(name, value)
    turn = next((t for t in result.turns if t.index == 0), None)
    complete = turn is not None and turn.complete and outcome is None
    span.set_attribute("fsm.stream.end", result.end_how or "none")
    span.set_attribute("fsm.turn.complete", complete)
    if turn is not None:
        span.set_attribute("fsm.tool_calls", len(turn.tool_calls))
    if isinstance(outcome, BaseException):
        _error(span, type(outcome).__qualname__, str(outcome).splitlines()[0][:200] or None)
    elif not complete:
        why = result.end_reason or (turn.incomplete_reason if turn is not None else None)
        _error(span, "incomplete_turn", why)


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
    return _get_tracer().start_as_current_span(
        f"execute_tool {name}", kind=SpanKind.INTERNAL, attributes=attributes
    )


def _end_tool(span: Any, outcome: object) -> None:
    if isinstance(outcome, tuple) and len(outcome) == 2 and outcome[1] is True:
        _error(span, "tool_error")


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
            self._cm = _get_tracer().start_as_current_span(
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
                _error(self.span, kind)
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
