"""The ``chat {model}`` span of one model call (:mod:`fsm.telemetry`): from the request to the end of its stream, with its usage, finish reasons and metrics, in each of the three formats."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fsm.telemetry_otel import (
    OPERATION,
    OTEL,
    P,
    R,
    get_instruments,
    get_tracer,
    instrumented,
    mark_error,
    provider_name,
    server_attributes,
    telemetry_log,
)


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
    attributes.update(server_attributes(client))
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

    with get_tracer().start_as_current_span(
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
            mark_error(span, *problem)
    try:
        wrapper.cleanup(failure)  # the instrumentation ends its span (and records its metrics)
    except Exception as exc:  # an instrumentation's own fault must not fail the call
        telemetry_log.debug("the instrumentation's stream wrapper failed to end: %r", exc)


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

        late = get_tracer().start_span(
            _span_name(chat), kind=SpanKind.CLIENT, attributes=chat.attributes,
            start_time=chat.start_ns,
        )  # fmt: skip
        span = late
    if span is not None:
        span.set_attributes(attributes)
        if problem is not None:
            mark_error(span, *problem)
        if late is not None:
            late.end()
    _record_metrics(chat, result, attributes, problem)


def _record_metrics(
    chat: _Chat, result: Any, attributes: Mapping[str, Any], problem: tuple[str, Any] | None
) -> None:
    """The call's metrics. With an instrumentation's span (:func:`instrumented`), the
    operation's duration is the instrumentation's to record, and so are the tokens when it
    takes them from fsm (an ``invocation``); fsm records the rest."""
    instruments = get_instruments()
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
