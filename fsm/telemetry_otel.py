"""The plumbing of fsm's telemetry (:mod:`fsm.telemetry`): whether OpenTelemetry is installed, structured log records, the tracer, what a client talks to (provider and server), and the metric instruments."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Final, ParamSpec, TypeVar

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
telemetry_log = logging.getLogger("fsm.telemetry")


def log(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log ``message`` (``%(name)s``-style fields in the text) with ``fields`` also as
    ``record.fsm`` (a dict), when ``logger`` is enabled for ``level``."""
    if logger.isEnabledFor(level):
        text = message.format(**fields) if fields else message
        logger.log(level, text, extra={"fsm": fields}, stacklevel=2)


def get_tracer() -> Any:
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        from fsm import __version__

        _tracer = trace.get_tracer("fsm", __version__)
    return _tracer


def mark_error(span: Any, error_type: str, description: str | None = None) -> None:
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


def server_attributes(client: Any) -> dict[str, Any]:
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


def get_instruments() -> _Instruments:
    global _instruments
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments
