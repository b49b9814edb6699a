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
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, ParamSpec, TypeVar

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

_tracer: Any = None
_log = logging.getLogger("fsm.telemetry")


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


# -- what a call talks to ----------------------------------------------------------------------
#: the GenAI operation of every model call fsm makes (Chat Completions, Responses, Messages)
OPERATION: Final = "chat"

#: ``gen_ai.provider.name`` of the OpenAI-compatible servers fsm can name by their host
_HOSTS: Final = {
    "api.openai.com": "openai",
    "api.anthropic.com": "anthropic",
    "api.groq.com": "groq",
    "api.deepseek.com": "deepseek",
    "api.mistral.ai": "mistral_ai",
    "api.x.ai": "x_ai",
    "api.perplexity.ai": "perplexity",
    "generativelanguage.googleapis.com": "gcp.gemini",
}
#: ``gen_ai.provider.name`` by the SDK client's class
_CLIENTS: Final = {
    "AzureOpenAI": "azure.ai.openai",
    "AsyncAzureOpenAI": "azure.ai.openai",
    "AnthropicBedrock": "aws.bedrock",
    "AsyncAnthropicBedrock": "aws.bedrock",
    "AnthropicVertex": "gcp.vertex_ai",
    "AsyncAnthropicVertex": "gcp.vertex_ai",
}


def provider_name(client: Any, format: str = "chat") -> str:
    """The ``gen_ai.provider.name`` of the calls made with ``client`` in ``format``: by the
    client's class (Azure OpenAI ``azure.ai.openai``, Anthropic on Bedrock ``aws.bedrock``, on
    Vertex ``gcp.vertex_ai``), else by its base URL's host (``api.groq.com`` is ``groq``,
    ...), else the API spoken: ``anthropic`` for the Messages API, ``openai`` for Chat
    Completions and Responses (an OpenAI-compatible server fsm cannot name)."""
    by_class = _CLIENTS.get(type(client).__name__)
    if by_class is not None:
        return by_class
    host = getattr(getattr(client, "base_url", None), "host", None)
    if isinstance(host, str) and host in _HOSTS:
        return _HOSTS[host]
    return "anthropic" if format == "anthropic" else "openai"


def _server(client: Any) -> dict[str, Any]:
    base_url = getattr(client, "base_url", None)
    host, port = getattr(base_url, "host", None), getattr(base_url, "port", None)
    out: dict[str, Any] = {}
    if isinstance(host, str) and host:
        out["server.address"] = host
        if isinstance(port, int):
            out["server.port"] = port
    return out


def instrumented(client: Any, format: str = "chat") -> bool:
    """Whether the SDK method fsm calls for ``format`` is wrapped by an instrumentation (a
    ``wrapt`` wrapper, as ``opentelemetry-instrumentation-openai-v2`` installs on
    ``chat.completions.create``): its model span is then the call's span, and fsm adds none."""
    try:
        resource: Any = (
            client.chat.completions
            if format == "chat"
            else client.responses
            if format == "responses"
            else client.messages
        )
        raw = getattr(resource, "with_streaming_response", None)
        target = getattr(raw.create, "__wrapped__", None) if raw is not None else resource.create
    except Exception:  # not an SDK client fsm knows
        return False
    return hasattr(target, "_self_wrapper")


# -- metrics -----------------------------------------------------------------------------------
#: the GenAI conventions' advised buckets (seconds, tokens)
_SECONDS: Final = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                   40.96, 81.92]  # fmt: skip
_TOKENS: Final = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                  16777216, 67108864]  # fmt: skip

_instruments: _Instruments | None = None


class _Instruments:
    """fsm's metric instruments, made once through the global meter provider."""

    def __init__(self) -> None:
        from opentelemetry import metrics

        from fsm import __version__

        meter = metrics.get_meter("fsm", __version__)
        self.duration = _histogram(
            meter, "gen_ai.client.operation.duration", "s", "GenAI operation duration.", _SECONDS
        )
        self.tokens = _histogram(
            meter,
            "gen_ai.client.token.usage",
            "{token}",
            "Number of input and output tokens used.",
            _TOKENS,
        )
        self.first_chunk = _histogram(
            meter,
            "gen_ai.client.operation.time_to_first_chunk",
            "s",
            "Time to receive the first chunk of the response stream.",
            _SECONDS,
        )
        self.tool_calls = meter.create_counter(
            "fsm.tool_calls",
            unit="{call}",
            description="Tool calls streamed by the model, by the state they ended in.",
        )


def _histogram(meter: Any, name: str, unit: str, description: str, buckets: list[Any]) -> Any:
    try:
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
        )
    except TypeError:  # opentelemetry-api before 1.23: no advice
        return meter.create_histogram(name, unit=unit, description=description)


def _get_instruments() -> _Instruments:
    global _instruments
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments


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
@dataclass(slots=True)
class _Chat:
    """One model call being traced: what the decorator and the stream's hooks share."""

    format: str
    attributes: dict[str, Any]
    #: ``time.perf_counter()`` / ``time.time_ns()`` when the request went out
    start: float
    start_ns: int
    #: an instrumentation wraps the SDK method: its span is the call's (fsm adds none)
    deferred: bool
    span: Any = None
    #: the instrumentation's stream wrapper, when fsm recognised one
    wrapper: Any = None
    opened: bool = False
    #: ``time.perf_counter()`` when the first bytes (or chunk) of the stream arrived
    first_at: float | None = None


_CHAT: ContextVar[_Chat | None] = ContextVar("fsm_chat", default=None)


def chat_span(function: Callable[P, R]) -> Callable[P, R]:
    """Decorate the function that sends one request and feeds its streamed answer to a parser
    (``(client, request, parser, emit, format)``, returning the transport's exception or
    ``None``; sync or async; it calls :func:`stream_opened` and :func:`stream_ended`): a
    ``chat {model}`` span around it, or, when an instrumentation wraps the SDK method, that
    instrumentation's span annotated; and the call's metrics."""
    if not OTEL:
        return function
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def achat(*args: Any, **kwargs: Any) -> Any:
            chat, parser = _begin_chat(args, kwargs)
            token = _CHAT.set(chat)
            try:
                with _current(chat):
                    try:
                        outcome = await function(*args, **kwargs)
                    except BaseException as exc:
                        _end_chat(chat, parser, exc)
                        raise
                    _end_chat(chat, parser, outcome)
                    return outcome
            finally:
                _CHAT.reset(token)

        return achat  # type: ignore[return-value]

    @functools.wraps(function)
    def chat(*args: P.args, **kwargs: P.kwargs) -> R:
        record, parser = _begin_chat(args, kwargs)
        token = _CHAT.set(record)
        try:
            with _current(record):
                try:
                    outcome = function(*args, **kwargs)
                except BaseException as exc:
                    _end_chat(record, parser, exc)
                    raise
                _end_chat(record, parser, outcome)
                return outcome
        finally:
            _CHAT.reset(token)

    return chat


def _begin_chat(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[_Chat, Any]:
    client = args[0] if args else None
    request = next((a for a in args if isinstance(a, Mapping)), {})
    parser = next((a for a in args if hasattr(a, "receive_data") and hasattr(a, "result")), None)
    fmt = args[4] if len(args) > 4 else kwargs.get("format", "chat")
    fmt = fmt if isinstance(fmt, str) else "chat"
    model = request.get("model")
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": provider_name(client, fmt),
    }
    if isinstance(model, str):
        attributes["gen_ai.request.model"] = model
    for key, name in (
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("top_k", "gen_ai.request.top_k"),
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("max_completion_tokens", "gen_ai.request.max_tokens"),
        ("max_output_tokens", "gen_ai.request.max_tokens"),
    ):
        value = request.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[name] = value
    attributes.update(_server(client))
    deferred = instrumented(client, fmt)  # (first: it may import the SDK's resources)
    chat = _Chat(fmt, attributes, time.perf_counter(), time.time_ns(), deferred)
    return chat, parser


def _span_name(chat: _Chat) -> str:
    model = chat.attributes.get("gen_ai.request.model")
    return f"{OPERATION} {model}" if model else OPERATION


@contextlib.contextmanager
def _current(chat: _Chat) -> Iterator[None]:
    """fsm's ``chat`` span as the current span while the call runs (an HTTP instrumentation
    nests under it), unless an instrumentation makes the call's span itself."""
    if chat.deferred:
        yield
        return
    from opentelemetry.trace import SpanKind

    with _get_tracer().start_as_current_span(
        _span_name(chat), kind=SpanKind.CLIENT, attributes=chat.attributes
    ) as span:
        chat.span = span
        chat.start = time.perf_counter()  # the span's start, as its duration counts
        yield


def stream_opened(source: Any) -> None:
    """The call being traced has its stream ``source`` (what the SDK returned): an
    instrumentation's stream wrapper in it is noted, to annotate and end its span with what
    fsm read. Does nothing outside a traced call."""
    chat = _CHAT.get() if OTEL else None
    if chat is None:
        return
    chat.opened = True
    if chat.deferred:
        chat.wrapper = _instrumentation_wrapper(source)


def stream_ended(events: Any, failure: BaseException | None) -> None:
    """The stream of the call being traced was read (``events``: the
    :class:`~fsm.clients.EventIterator` that fed its parser; ``failure``: what stopped it, if
    anything), before the SDK's response is closed: an instrumentation's span gets fsm's
    reading (response id and model, finish reasons, usage, fsm's attributes) and is ended.
    Does nothing outside a traced call."""
    chat = _CHAT.get() if OTEL else None
    if chat is None:
        return
    first = getattr(events, "first_data_at", None)
    if isinstance(first, float):
        chat.first_at = first
    wrapper = chat.wrapper
    parser = getattr(events, "parser", None)
    if wrapper is None or parser is None:
        return
    result = parser.result()
    usage = _usage(result.usage, chat.format)
    wrapper.response_id = result.response_id
    wrapper.response_model = result.model
    wrapper.prompt_tokens = usage.get("gen_ai.usage.input_tokens")
    wrapper.completion_tokens = usage.get("gen_ai.usage.output_tokens")
    wrapper.finish_reasons = [t.finish_reason for t in result.turns if t.finish_reason]
    span = _wrapper_span(wrapper)
    if span is not None and span.is_recording():
        span.set_attribute("gen_ai.provider.name", chat.attributes["gen_ai.provider.name"])
        span.set_attributes(_response_attributes(chat, result, failure))
        problem = _failure(result, failure)
        if problem is not None and failure is None:
            _error(span, *problem)
    try:
        wrapper.cleanup(failure)  # the instrumentation ends its span (and records its metrics)
    except Exception as exc:  # an instrumentation's own fault must not fail the call
        _log.debug("the instrumentation's stream wrapper failed to end: %r", exc)


def _instrumentation_wrapper(source: Any) -> Any:
    """The stream wrapper of an instrumentation that fsm can hand its reading to
    (``opentelemetry-instrumentation-openai-v2``'s: a ``cleanup`` method and a ``span`` or an
    ``invocation`` with one), else ``None``."""
    if not callable(getattr(source, "cleanup", None)):
        return None
    return source if _wrapper_span(source) is not None else None


def _wrapper_span(wrapper: Any) -> Any:
    span = getattr(wrapper, "span", None)
    if span is None:
        span = getattr(getattr(wrapper, "invocation", None), "span", None)
    return span if callable(getattr(span, "set_attribute", None)) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage(usage: Any, fmt: str) -> dict[str, int]:
    """The GenAI usage attributes of a response's ``usage`` in ``fmt``. Input tokens include
    the cached ones, as the conventions ask (Anthropic reports them apart: summed here)."""
    if not isinstance(usage, Mapping):
        return {}
    out: dict[str, int] = {}
    if fmt == "chat":
        inp, outp = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
        details, odetails = (
            usage.get("prompt_tokens_details"),
            usage.get("completion_tokens_details"),
        )
    else:
        inp, outp = _int(usage.get("input_tokens")), _int(usage.get("output_tokens"))
        details, odetails = usage.get("input_tokens_details"), usage.get("output_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    reasoning = _int(odetails.get("reasoning_tokens")) if isinstance(odetails, Mapping) else None
    created = None
    if fmt == "anthropic":
        cached = _int(usage.get("cache_read_input_tokens"))
        created = _int(usage.get("cache_creation_input_tokens"))
        if inp is not None:
            inp += (cached or 0) + (created or 0)
    for name, value in (
        ("gen_ai.usage.input_tokens", inp),
        ("gen_ai.usage.output_tokens", outp),
        ("gen_ai.usage.cache_read.input_tokens", cached),
        ("gen_ai.usage.cache_creation.input_tokens", created),
        ("gen_ai.usage.reasoning.output_tokens", reasoning),
    ):
        if value is not None:
            out[name] = value
    return out


def _choice0(result: Any) -> Any:
    return next((t for t in result.turns if t.index == 0), None)


def _response_attributes(chat: _Chat, result: Any, outcome: object) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    if result.response_id:
        attributes["gen_ai.response.id"] = result.response_id
    if result.model:
        attributes["gen_ai.response.model"] = result.model
    reasons = [t.finish_reason for t in result.turns if t.finish_reason]
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = reasons
    attributes.update(_usage(result.usage, chat.format))
    if chat.first_at is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = max(0.0, chat.first_at - chat.start)
    turn = _choice0(result)
    attributes["fsm.stream.end"] = result.end_how or "none"
    attributes["fsm.turn.complete"] = bool(
        turn is not None and turn.complete and not isinstance(outcome, BaseException)
    )
    if turn is not None:
        attributes["fsm.tool_calls"] = len(turn.tool_calls)
    return attributes


def _failure(result: Any, outcome: object) -> tuple[str, str | None] | None:
    """``(error.type, description)`` of a call that did not give a complete turn, else
    ``None``."""
    if isinstance(outcome, BaseException):
        return type(outcome).__qualname__, (str(outcome).splitlines() or [""])[0][:200] or None
    turn = _choice0(result)
    if turn is not None and turn.complete:
        return None
    why = result.end_reason or (turn.incomplete_reason if turn is not None else None)
    return "incomplete_turn", why


def _end_chat(chat: _Chat, parser: Any, outcome: object) -> None:
    if parser is None:
        return
    result = parser.result()
    attributes = _response_attributes(chat, result, outcome)
    problem = _failure(result, outcome)
    span = chat.span
    late = None
    if chat.deferred and chat.opened and chat.wrapper is None:
        # an instrumentation fsm could not hand its reading to: fsm's own span after all
        from opentelemetry.trace import SpanKind

        late = _get_tracer().start_span(
            _span_name(chat), kind=SpanKind.CLIENT, attributes=chat.attributes,
            start_time=chat.start_ns,
        )  # fmt: skip
        span = late
    if span is not None:
        span.set_attributes(attributes)
        if problem is not None:
            _error(span, *problem)
        if late is not None:
            late.end()
    _record_metrics(chat, result, attributes, problem)


def _record_metrics(
    chat: _Chat, result: Any, attributes: Mapping[str, Any], problem: tuple[str, Any] | None
) -> None:
    """The call's metrics. With an instrumentation's span (:func:`instrumented`), the
    operation's duration is the instrumentation's to record, and so are the tokens when it
    takes them from fsm (an ``invocation``); fsm records the rest."""
    instruments = _get_instruments()
    common = {
        k: v
        for k, v in chat.attributes.items()
        if k
        in (
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.request.model",
            "server.address",
            "server.port",
        )
    }
    if "gen_ai.response.model" in attributes:
        common["gen_ai.response.model"] = attributes["gen_ai.response.model"]
    with_error = dict(common)
    if problem is not None:
        with_error["error.type"] = problem[0]
    theirs = chat.deferred and (chat.wrapper is not None or not chat.opened)
    if not theirs:
        instruments.duration.record(max(0.0, time.perf_counter() - chat.start), with_error)
    if not (theirs and getattr(chat.wrapper, "invocation", None) is not None):
        for kind, key in (("input", "gen_ai.usage.input_tokens"),
                          ("output", "gen_ai.usage.output_tokens")):  # fmt: skip
            if key in attributes:
                instruments.tokens.record(attributes[key], {**common, "gen_ai.token.type": kind})
    if chat.first_at is not None:
        instruments.first_chunk.record(max(0.0, chat.first_at - chat.start), common)
    states: dict[str, int] = {}
    for turn in result.turns:
        for call in turn.tool_calls:
            states[call.state.value] = states.get(call.state.value, 0) + 1
    for state, count in states.items():
        instruments.tool_calls.add(
            count,
            {
                "gen_ai.provider.name": common["gen_ai.provider.name"],
                **(
                    {"gen_ai.request.model": common["gen_ai.request.model"]}
                    if "gen_ai.request.model" in common
                    else {}
                ),
                "fsm.tool_call.state": state,
            },
        )


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
