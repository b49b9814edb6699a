"""Logs and OpenTelemetry spans (issue 13, deliverable 4).

The agent loop runs against the replay server with the official openai clients; the spans go to
the OpenTelemetry SDK's ``InMemorySpanExporter`` and are checked name by name, attribute by
attribute (GenAI semantic conventions), with their parent (the host's own span). Log records
are checked through ``caplog``: ids, counts and seqs, never message content at INFO.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import sqlalchemy as sa

from fsm.agent import TurnFailedError, arun_agent_loop, run_agent_loop
from fsm.api import parse_file
from fsm.store import ConflictError, ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.store.migrate import upgrade
from fsm.testing import ReplayServer, ReplayTurn, demo_script
from tests.helpers.agent import CLIENTS, DEMO, DEMO_BYTES, MODEL, USER, bounded
from tests.helpers.store import make_turn

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import metrics  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

EXPORTER = InMemorySpanExporter()
READER = InMemoryMetricReader()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _provider() -> None:
    """The process's tracer provider (OpenTelemetry allows one), exporting to memory."""
    current = trace.get_tracer_provider()
    if not isinstance(current, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    elif EXPORTER not in getattr(current, "_fsm_exporters", ()):
        current.add_span_processor(SimpleSpanProcessor(EXPORTER))
        current._fsm_exporters = (EXPORTER,)  # type: ignore[attr-defined]
    meters = metrics.get_meter_provider()
    if getattr(meters, "_fsm_reader", None) is not READER:
        if isinstance(meters, MeterProvider):  # set by someone else: its readers are fixed
            pytest.skip("another MeterProvider is the process's: fsm's metrics cannot be read")
        provider = MeterProvider(metric_readers=[READER])
        provider._fsm_reader = READER  # type: ignore[attr-defined]
        metrics.set_meter_provider(provider)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


@pytest.fixture
def url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = {"add": add, "multiply": multiply}


def _run(kind: str, url: str, server: ReplayServer, **kwargs: Any) -> Any:
    """Run the loop under a host span ``host request``; the result or the exception."""
    tracer = trace.get_tracer("host-app")
    if kind == "openai":
        with ConversationStore(url) as store, tracer.start_as_current_span("host request"):
            client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            try:
                return run_agent_loop(client, store, "conv", TOOLS, model=MODEL, **kwargs)
            except TurnFailedError as exc:
                return exc
            finally:
                client.close()

    async def body() -> Any:
        async with AsyncConversationStore(url) as store:
            with tracer.start_as_current_span("host request"):
                client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
                try:
                    return await arun_agent_loop(
                        client, store, "conv", TOOLS, model=MODEL, **kwargs
                    )
                except TurnFailedError as exc:
                    return exc
                finally:
                    await client.close()

    return asyncio.run(bounded(body()))


def _by_name(exported: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(s.name, dict(s.attributes or {})) for s in exported]


@pytest.mark.parametrize("kind", CLIENTS)
def test_demo_run_spans_follow_the_genai_conventions(
    kind: str, url: str, spans: InMemorySpanExporter
) -> None:
    with ReplayServer(demo_script(["6912", "408"]), response_ids="recorded") as server:
        result = _run(kind, url, server, messages=[USER])
        port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
    assert result.status == "completed"
    exported = spans.get_finished_spans()
    names = [s.name for s in exported]
    names[2:4] = sorted(names[2:4])  # the async loop runs the two tools concurrently
    assert names == [
        "append",
        f"chat {MODEL}",
        "execute_tool add",
        "execute_tool multiply",
        "commit_turn",
        f"chat {MODEL}",
        "commit_turn",
        "invoke_agent",
        "host request",
    ]
    host = next(s for s in exported if s.name == "host request")
    agent = next(s for s in exported if s.name == "invoke_agent")
    # the run is a child of the host's span, every other fsm span a child of the run: the
    # context propagates (threads, tasks)
    assert agent.parent is not None and agent.parent.span_id == host.context.span_id
    assert all(s.parent is not None and s.parent.span_id == agent.context.span_id
               for s in exported if s not in (host, agent))  # fmt: skip
    assert len({s.context.trace_id for s in exported}) == 1
    assert dict(agent.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "openai",
        "gen_ai.conversation.id": "conv",
        "gen_ai.request.model": MODEL,
        "fsm.status": "completed",
        "fsm.turns": 2,
    }

    chats = [s for s in exported if s.name.startswith("chat ")]
    first = parse_file(DEMO)
    assert chats[0].kind == trace.SpanKind.CLIENT
    attrs = dict(chats[0].attributes or {})
    # the loop reads the response's raw bytes, so it sees the recording's [DONE]
    assert attrs.pop("fsm.stream.end") == first.end_how == "done"
    span_seconds = (chats[0].end_time - chats[0].start_time) / 1e9
    assert 0 < attrs.pop("gen_ai.response.time_to_first_chunk") < span_seconds
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.id": first.response_id,
        "gen_ai.response.model": first.model,
        "gen_ai.response.finish_reasons": ("tool_calls",),
        "gen_ai.usage.input_tokens": 96,
        "gen_ai.usage.output_tokens": 41,
        "server.address": "127.0.0.1",
        "server.port": port,
        "fsm.turn.complete": True,
        "fsm.tool_calls": 2,
    }
    last = dict(chats[1].attributes or {})
    assert last["gen_ai.response.finish_reasons"] == ("stop",)
    assert last["gen_ai.usage.input_tokens"] == 180 and last["fsm.tool_calls"] == 0
    assert all(s.status.status_code != trace.StatusCode.ERROR for s in exported)

    tools = {s.name: dict(s.attributes or {}) for s in exported if s.name.startswith("execute")}
    assert tools["execute_tool add"] == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "call_add_7Qz2",
    }
    assert tools["execute_tool multiply"]["gen_ai.tool.call.id"] == "call_mul_9Xk4"

    commits = [dict(s.attributes or {}) for s in exported if s.name == "commit_turn"]
    dialect = sa.make_url(url).get_backend_name()
    assert commits[0] == {
        "db.operation.name": "commit_turn",
        "db.system.name": dialect,
        "fsm.caller_transaction": False,
        "gen_ai.conversation.id": "conv",
        "gen_ai.response.id": first.response_id,
        "fsm.seq": 1,
        "fsm.messages": 3,
        "fsm.created": True,
    }
    assert commits[1]["fsm.seq"] == 4 and commits[1]["fsm.messages"] == 1
    # no span carries message content, arguments or results (the text values, whole or within;
    # numbers such as the server's random port or a duration may hold "408" by chance)
    texts = [v for _, attrs in _by_name(exported) for v in attrs.values() if isinstance(v, str)]
    texts = [v for v in texts if not v.startswith("http://127.0.0.1:")]
    for secret in ("1234", "6912", "408", USER["content"]):
        assert not [v for v in texts if secret in v], secret


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_cut_turn_is_an_error_chat_span_and_a_recorded_attempt(
    kind: str, url: str, spans: InMemorySpanExporter
) -> None:
    with ReplayServer([ReplayTurn(DEMO, cut_at=len(DEMO_BYTES) // 2)]) as server:
        error = _run(kind, url, server, messages=[USER])
    assert isinstance(error, TurnFailedError)
    exported = spans.get_finished_spans()
    assert [s.name for s in exported] == [
        "append",
        f"chat {MODEL}",
        "record_attempt",
        "invoke_agent",
        "host request",
    ]
    assert exported[3].status.status_code == trace.StatusCode.ERROR  # TurnFailedError escaped
    chat = exported[1]
    assert chat.status.status_code == trace.StatusCode.ERROR
    attrs = dict(chat.attributes or {})
    assert attrs["fsm.turn.complete"] is False
    # the transport's exception (the connection was cut), else the turn is incomplete
    cause = error.__cause__
    assert attrs["error.type"] == (
        type(cause).__qualname__ if cause is not None else "incomplete_turn"
    )
    attempt = dict(exported[2].attributes or {})
    assert attempt["fsm.attempt_ids"] == tuple(error.attempt_ids)


def test_a_failing_tool_is_an_error_span(url: str, spans: InMemorySpanExporter) -> None:
    def broken(a: int, b: int) -> int:
        raise RuntimeError("no")

    with ReplayServer(demo_script()) as server, ConversationStore(url) as store:
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        try:
            run_agent_loop(
                client, store, "c", {"add": broken, "multiply": multiply}, model=MODEL,
                messages=[USER],
            )  # fmt: skip
        finally:
            client.close()
    tools = [s for s in spans.get_finished_spans() if s.name.startswith("execute_tool")]
    assert [(s.name, s.status.status_code) for s in tools] == [
        ("execute_tool add", trace.StatusCode.ERROR),
        ("execute_tool multiply", trace.StatusCode.UNSET),
    ]
    assert dict(tools[0].attributes or {})["error.type"] == "tool_error"


def test_a_conflict_is_an_error_commit_span_and_a_warning(
    store: ConversationStore, spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    cid = store.create_conversation("c1")
    store.append(cid, [USER])
    with caplog.at_level(logging.INFO, logger="fsm"), pytest.raises(ConflictError):
        store.commit_turn(cid, make_turn(), ["r"], expected_seq=0)
    span = spans.get_finished_spans()[-1]
    assert span.name == "commit_turn" and span.status.status_code == trace.StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "ConflictError"
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.name == "fsm.store"
    assert warning.fsm["expected_seq"] == 0 and warning.fsm["actual_seq"] == 1  # type: ignore[attr-defined]


# -- logging --------------------------------------------------------------------------------------
def test_log_records_of_a_demo_run(url: str, caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.DEBUG, logger="fsm"),
        ReplayServer(demo_script(["6912", "408"]), response_ids="recorded") as server,
    ):
        result = _run("openai", url, server, messages=[USER])
    assert result.status == "completed"
    fsm_records = [r for r in caplog.records if r.name.startswith("fsm")]
    info = [r for r in fsm_records if r.levelno >= logging.INFO]
    messages = [r.getMessage() for r in info]
    assert messages == [
        "messages committed to conversation 'conv' (next seq 1)",
        "turn committed to conversation 'conv' at seq 1 (3 messages)",
        "turn committed to conversation 'conv' at seq 4 (1 messages)",
    ], messages
    assert all(r.name == "fsm.store" for r in info)
    committed = info[1].fsm  # type: ignore[attr-defined]
    assert committed["seq"] == 1 and committed["messages"] == 3 and committed["created"]
    assert committed["response_id"] == parse_file(DEMO).response_id
    debug = [r.getMessage() for r in fsm_records if r.levelno == logging.DEBUG]
    assert "request 1 of conv: 1 messages" in debug
    assert "tool add ran for call 'call_add_7Qz2' (error result: False)" in debug
    # ids, counts and seqs only: no content, arguments or results at INFO
    for secret in ("1234", "6912", "408", USER["content"]):
        assert not any(secret in m for m in messages)


def test_a_failed_turn_and_its_attempt_are_logged(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="fsm"),
        ReplayServer([ReplayTurn(DEMO, cut_at=len(DEMO_BYTES) // 2)]) as server,
    ):
        error = _run("openai", url, server, messages=[USER])
    assert isinstance(error, TurnFailedError)
    by_name = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    ids = error.attempt_ids
    assert ("fsm.store", "INFO", f"attempt {ids} recorded for conversation 'conv'") in by_name
    assert any(n == "fsm.agent" and lvl == "WARNING" and "turn 1 of conv failed" in m
               for n, lvl, m in by_name)  # fmt: skip


def test_a_migration_run_is_logged(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fsm.store.migrate"):
        upgrade(f"sqlite:///{tmp_path / 'm.db'}")
    assert [r.getMessage() for r in caplog.records if r.name == "fsm.store.migrate"] == [
        f"migrating sqlite:///{tmp_path / 'm.db'} to head"
    ]


def test_an_anomaly_is_logged_by_the_parser(caplog: pytest.LogCaptureFixture) -> None:
    from fsm import StreamParser

    parser = StreamParser()
    with caplog.at_level(logging.DEBUG, logger="fsm.parser"):
        parser.receive_data(b"data: [DONE]\n\ndata: {}\n\n")
        parser.receive_eof()
    assert [r.getMessage() for r in caplog.records if r.name == "fsm.parser"] == [
        "anomaly data_after_end (choice None, event 2): an SSE event after the end of the stream"
    ]


def test_nothing_is_printed_by_default(tmp_path: Any) -> None:
    """A NullHandler on ``fsm``: even a WARNING (a conflict) prints nothing unless the
    application configures logging."""
    code = f"""
import fsm
from fsm.store import ConflictError, ConversationStore
from tests.helpers.store import make_turn
with ConversationStore("sqlite:///{tmp_path / "q.db"}", auto_upgrade=True) as store:
    store.create_conversation("c")
    store.append("c", [{{"role": "user", "content": "hi"}}])
    try:
        store.commit_turn("c", make_turn(), ["r"], expected_seq=0)
    except ConflictError:
        pass
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stderr == "" and out.stdout == ""


def test_without_opentelemetry_nothing_is_imported_and_nothing_is_wrapped() -> None:
    code = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, Hide())
import fsm.telemetry, fsm.agent, fsm.agent.loop, fsm.agent.tools, fsm.store
assert fsm.telemetry.OTEL is False
assert not hasattr(fsm.agent.tools.run_tool, "__wrapped__")
assert not hasattr(fsm.agent.loop._stream, "__wrapped__")
assert not [m for m in sys.modules if m.startswith("opentelemetry")]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr


# -- the GenAI conventions in every format, and metrics -------------------------------------------
def _points(name: str, model: str, scope: str = "fsm") -> list[tuple[dict[str, Any], Any]]:
    """The data points of metric ``name`` (instrumentation scope ``scope``) of calls to
    ``model`` (each test uses a model name of its own: the reader is cumulative)."""
    found = []
    data = READER.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scoped in resource.scope_metrics:
            if scoped.scope.name != scope:
                continue
            for metric in scoped.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if attributes.get("gen_ai.request.model") == model:
                        found.append((attributes, point))
    return found


def _client(fmt: str, base_url: str) -> Any:
    if fmt == "anthropic":
        anthropic = pytest.importorskip("anthropic")
        return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="t",
                                   max_retries=0)  # fmt: skip
    return openai.OpenAI(base_url=base_url, api_key="t", max_retries=0)


#: (provider, the two turns' usage attributes) of the demo conversation in each format
FORMATS = {
    "chat": ("openai", [{"gen_ai.usage.input_tokens": 96, "gen_ai.usage.output_tokens": 41},
                        {"gen_ai.usage.input_tokens": 180, "gen_ai.usage.output_tokens": 19}]),
    "responses": ("openai", [{"gen_ai.usage.input_tokens": 81, "gen_ai.usage.output_tokens": 64,
                              "gen_ai.usage.cache_read.input_tokens": 0,
                              "gen_ai.usage.reasoning.output_tokens": 12}] * 2),
    "anthropic": ("anthropic", [{"gen_ai.usage.input_tokens": 81,
                                 "gen_ai.usage.output_tokens": 64}] * 2),
}  # fmt: skip


def _loop(fmt: str, url: str, script: Any, model: str, **kwargs: Any) -> Any:
    with ReplayServer(script) as server, ConversationStore(url) as store:
        client = _client(fmt, server.base_url)
        try:
            return run_agent_loop(client, store, "conv", TOOLS, model=model, messages=[USER],
                                  format=fmt, **kwargs)  # fmt: skip
        except TurnFailedError as exc:
            return exc
        finally:
            client.close()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_has_its_provider_usage_and_metrics(
    fmt: str, url: str, spans: InMemorySpanExporter
) -> None:
    """Before: every run was labelled provider ``openai`` (and the deprecated
    ``gen_ai.system``), and Responses and Anthropic spans carried no usage; there were no
    metrics."""
    model = f"telemetry-{fmt}-{uuid.uuid4().hex[:8]}"
    result = _loop(fmt, url, demo_script(format=fmt), model)  # type: ignore[arg-type]
    assert result.status == "completed"
    provider, usage = FORMATS[fmt]
    exported = spans.get_finished_spans()
    agent = next(s for s in exported if s.name == "invoke_agent")
    assert dict(agent.attributes or {})["gen_ai.provider.name"] == provider
    chats = [s for s in exported if s.name.startswith("chat")]
    assert [s.name for s in chats] == [f"chat {model}"] * 2
    for span, expected in zip(chats, usage, strict=True):
        attrs = dict(span.attributes or {})
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == provider
        assert "gen_ai.system" not in attrs  # deprecated: gen_ai.provider.name replaces it
        assert {k: v for k, v in attrs.items() if k.startswith("gen_ai.usage.")} == expected
        assert attrs["fsm.stream.end"] == "done" and attrs["fsm.turn.complete"] is True
        assert attrs["gen_ai.response.time_to_first_chunk"] > 0
        assert span.parent is not None and span.parent.span_id == agent.context.span_id
    # metrics: one duration and one time to first chunk per call, tokens by type, calls by state
    (duration,) = _points("gen_ai.client.operation.duration", model)
    attributes, point = duration
    assert point.count == 2 and attributes["gen_ai.provider.name"] == provider
    assert attributes["gen_ai.operation.name"] == "chat" and "error.type" not in attributes
    tokens = {a["gen_ai.token.type"]: p.sum for a, p in _points("gen_ai.client.token.usage", model)}
    assert tokens == {
        "input": sum(u["gen_ai.usage.input_tokens"] for u in usage),
        "output": sum(u["gen_ai.usage.output_tokens"] for u in usage),
    }
    ((_, first),) = _points("gen_ai.client.operation.time_to_first_chunk", model)
    assert first.count == 2 and 0 < first.sum < point.sum
    calls = {a["fsm.tool_call.state"]: p.value for a, p in _points("fsm.tool_calls", model)}
    assert calls == {"finished": 2}


def test_anthropic_input_tokens_include_the_cached_ones(
    url: str, spans: InMemorySpanExporter
) -> None:
    """Anthropic counts cache reads and writes apart from ``input_tokens``; the conventions'
    ``gen_ai.usage.input_tokens`` includes them, and names each."""
    from fsm.replay import EXAMPLES_DIR

    first = (EXAMPLES_DIR / "anthropic_add_multiply.sse").read_bytes()
    cached = first.replace(
        b'"usage":{"input_tokens":81,"output_tokens":1}',
        b'"usage":{"input_tokens":81,"output_tokens":1,"cache_read_input_tokens":1000,'
        b'"cache_creation_input_tokens":200}',
    )
    assert cached != first
    script = [ReplayTurn(cached), demo_script(format="anthropic")[1]]
    model = f"telemetry-anthropic-cache-{uuid.uuid4().hex[:8]}"
    assert _loop("anthropic", url, script, model).status == "completed"
    chat = next(s for s in spans.get_finished_spans() if s.name.startswith("chat"))
    usage = {k: v for k, v in (chat.attributes or {}).items() if k.startswith("gen_ai.usage")}
    assert usage == {
        "gen_ai.usage.input_tokens": 1281,
        "gen_ai.usage.output_tokens": 64,
        "gen_ai.usage.cache_read.input_tokens": 1000,
        "gen_ai.usage.cache_creation.input_tokens": 200,
    }


def test_calls_by_final_state_and_a_failed_call_metric(
    url: str, spans: InMemorySpanExporter
) -> None:
    """A cut stream: its calls end ``aborted`` (``fsm.tool_calls`` by state), the duration
    carries ``error.type``."""
    model = f"telemetry-cut-{uuid.uuid4().hex[:8]}"
    error = _loop("chat", url, [ReplayTurn(DEMO, cut_at=len(DEMO_BYTES) * 3 // 4)], model)
    assert isinstance(error, TurnFailedError)
    states = {a["fsm.tool_call.state"]: p.value for a, p in _points("fsm.tool_calls", model)}
    turn = error.result.turns[0]
    expected: dict[str, int] = {}
    for call in turn.tool_calls:
        expected[call.state.value] = expected.get(call.state.value, 0) + 1
    assert states == expected and set(states) <= {"aborted", "truncated", "finished"}
    assert "aborted" in states
    ((attributes, point),) = _points("gen_ai.client.operation.duration", model)
    cause = error.__cause__
    assert attributes["error.type"] == (
        type(cause).__qualname__ if cause is not None else "incomplete_turn"
    )
    assert point.count == 1


def test_provider_names_by_client_and_host() -> None:
    from fsm.telemetry import provider_name

    anthropic = pytest.importorskip("anthropic")
    assert provider_name(openai.OpenAI(api_key="t"), "chat") == "openai"
    assert provider_name(openai.OpenAI(api_key="t"), "responses") == "openai"
    assert provider_name(anthropic.Anthropic(api_key="t"), "anthropic") == "anthropic"
    groq = openai.OpenAI(api_key="t", base_url="https://api.groq.com/openai/v1")
    assert provider_name(groq, "chat") == "groq"
    azure = openai.AzureOpenAI(api_key="t", api_version="2024-10-21",
                               azure_endpoint="https://x.openai.azure.com")  # fmt: skip
    assert provider_name(azure, "chat") == "azure.ai.openai"
    # an OpenAI-compatible server fsm cannot name: the API it speaks
    assert provider_name(openai.OpenAI(api_key="t", base_url="http://127.0.0.1:1/v1")) == "openai"


# -- next to the official OpenAI instrumentation ---------------------------------------------------
@pytest.fixture
def openai_v2() -> Iterator[Any]:
    """``opentelemetry-instrumentation-openai-v2`` instrumenting the openai SDK (undone after)."""
    from tests.helpers import require_framework

    module = require_framework("opentelemetry.instrumentation.openai_v2", "frameworks")
    instrumentor = module.OpenAIInstrumentor()
    instrumentor.instrument(
        tracer_provider=trace.get_tracer_provider(), meter_provider=metrics.get_meter_provider()
    )
    try:
        yield instrumentor
    finally:
        instrumentor.uninstrument()


@pytest.mark.parametrize("kind", CLIENTS)
def test_with_the_official_instrumentation_one_chat_span_and_raw_bytes(
    kind: str, url: str, spans: InMemorySpanExporter, openai_v2: Any
) -> None:
    """Before: every model call had two ``chat`` spans (the instrumentation's inside fsm's)
    and fsm silently read the instrumentation's re-parsed SDK chunks instead of the raw bytes
    (``fsm.stream.end`` ``eof``: the SDK swallows ``[DONE]``); the async loop failed on
    leaving the stream (the wrapper's ``close()`` is not awaitable). Now the instrumentation's
    span is the call's only ``chat`` span, a child of ``invoke_agent``, carrying fsm's reading
    (usage, finish reasons, ``fsm.*``), and fsm reads the raw bytes."""
    model = f"telemetry-openai-v2-{kind}-{uuid.uuid4().hex[:8]}"
    with ReplayServer(demo_script(["6912", "408"])) as server:
        if kind == "openai":
            with ConversationStore(url) as store:
                client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
                result = run_agent_loop(client, store, "conv", TOOLS, model=model,
                                        messages=[USER])  # fmt: skip
                client.close()
        else:

            async def body() -> Any:
                async with AsyncConversationStore(url) as store:
                    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t",
                                                max_retries=0)  # fmt: skip
                    try:
                        return await arun_agent_loop(client, store, "conv", TOOLS, model=model,
                                                     messages=[USER])  # fmt: skip
                    finally:
                        await client.close()

            result = asyncio.run(bounded(body()))
    assert result.status == "completed" and server.failures == []
    exported = spans.get_finished_spans()
    chats = [s for s in exported if s.name.startswith("chat")]
    assert len(chats) == 2  # one per model call
    assert {s.instrumentation_scope.name for s in chats} == {
        "opentelemetry.instrumentation.openai_v2"
    }
    agent = next(s for s in exported if s.name == "invoke_agent")
    first = parse_file(DEMO)
    for span in chats:
        assert span.parent is not None and span.parent.span_id == agent.context.span_id
        assert span.kind == trace.SpanKind.CLIENT
    attrs = dict(chats[0].attributes or {})
    assert attrs["fsm.stream.end"] == "done"  # fsm read the raw bytes ([DONE] seen)
    assert attrs["fsm.turn.complete"] is True and attrs["fsm.tool_calls"] == 2
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.response.id"].startswith(first.response_id)
    assert attrs["gen_ai.usage.input_tokens"] == 96 and attrs["gen_ai.usage.output_tokens"] == 41
    assert attrs["gen_ai.response.finish_reasons"] == ("tool_calls",)
    # the operation's duration is the instrumentation's; fsm adds what it does not record
    assert _points("gen_ai.client.operation.duration", model) == []
    assert len(_points("gen_ai.client.operation.duration", model,
                       scope="opentelemetry.instrumentation.openai_v2")) == 1  # fmt: skip
    tokens = {a["gen_ai.token.type"]: p.sum for a, p in _points("gen_ai.client.token.usage", model)}
    assert tokens == {"input": 96 + 180, "output": 41 + 19}
    calls = {a["fsm.tool_call.state"]: p.value for a, p in _points("fsm.tool_calls", model)}
    assert calls == {"finished": 2}


def test_fsm_reads_the_raw_bytes_under_the_instrumentation_wrapper(openai_v2: Any) -> None:
    """``iter_openai_events`` on what ``with_streaming_response`` returns with the
    instrumentation on (its stream wrapper, not the ``APIResponse``): the raw bytes."""
    from fsm.clients import instrumented_stream, iter_openai_events

    with ReplayServer(demo_script()) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        with client.chat.completions.with_streaming_response.create(
            model="m",
            messages=[USER],
            stream=True,  # type: ignore[list-item]
        ) as response:
            assert type(response).__name__.endswith("StreamWrapper")
            assert instrumented_stream(response) is not None
            events = iter_openai_events(response)
            list(events)
        client.close()
    assert events.result().end_how == "done"


_EXPERIMENTAL = """
import json, sys
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
spans = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(provider)
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
OpenAIInstrumentor().instrument()
import openai
from fsm.agent import run_agent_loop
from fsm.store import ConversationStore
from fsm.testing import ReplayServer, demo_script
from tests.agent.test_telemetry import TOOLS, USER
with ReplayServer(demo_script(["6912", "408"])) as server, ConversationStore(
    "sqlite:///" + sys.argv[1], auto_upgrade=True
) as store:
    client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
    status = run_agent_loop(client, store, "c", TOOLS, model="m", messages=[USER]).status
chats = [dict(s.attributes) for s in spans.get_finished_spans() if s.name.startswith("chat")]
points = {}
for resource in reader.get_metrics_data().resource_metrics:
    for scoped in resource.scope_metrics:
        for metric in scoped.metrics:
            for point in metric.data.data_points:
                key = scoped.scope.name + " " + metric.name
                kind = dict(point.attributes).get("gen_ai.token.type")
                key += (" " + kind) if kind else ""
                points[key] = getattr(point, "sum", getattr(point, "value", None))
print(json.dumps({"status": status, "chats": chats, "points": points}))
"""


def test_beside_the_instrumentations_experimental_mode(tmp_path: Any, monkeypatch: Any) -> None:
    """With ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` the instrumentation
    ends its span through ``opentelemetry-util-genai`` (an ``invocation``) and records the
    duration and the tokens itself, from what fsm handed it: fsm records neither again.
    (In a child process: the mode is read once per process.)"""
    from tests.helpers import child_json, require_framework

    require_framework("opentelemetry.instrumentation.openai_v2", "frameworks")
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
    out = child_json(_EXPERIMENTAL, str(tmp_path / "x.db"), timeout=120)
    assert out["status"] == "completed"
    assert len(out["chats"]) == 2  # one span per call
    first = out["chats"][0]
    assert first["fsm.stream.end"] == "done"  # the raw bytes
    assert first["gen_ai.usage.input_tokens"] == 96 and first["gen_ai.usage.output_tokens"] == 41
    points = out["points"]
    assert not any(k.startswith("fsm gen_ai.client.operation.duration") for k in points)
    assert not any(k.startswith("fsm gen_ai.client.token.usage") for k in points)
    theirs = {k.split(" ", 1)[1]: v for k, v in points.items() if not k.startswith("fsm ")}
    assert theirs["gen_ai.client.token.usage input"] == 96 + 180
    assert theirs["gen_ai.client.token.usage output"] == 41 + 19
    assert points["fsm fsm.tool_calls"] == 2
    assert "fsm gen_ai.client.operation.time_to_first_chunk" in points


def test_a_wrapper_fsm_cannot_hand_over_to_still_gets_fsm_chat_span(
    url: str, spans: InMemorySpanExporter
) -> None:
    """Another wrapt wrapper on ``create`` (one that makes no span, or a span fsm cannot reach)
    that returns the response as it is: fsm's ``chat`` span is made after all, from the
    request's start, so the call is never without one."""
    from tests.helpers import require_framework

    wrapt = require_framework("wrapt", "frameworks")
    calls: list[str] = []

    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(kwargs.get("model", ""))
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(
        "openai.resources.chat.completions", "Completions.create", passthrough
    )
    model = f"telemetry-wrapped-{uuid.uuid4().hex[:8]}"
    try:
        result = _loop("chat", url, demo_script(), model)
    finally:
        from openai.resources.chat.completions import Completions
        from opentelemetry.instrumentation.utils import unwrap

        unwrap(Completions, "create")
        assert not hasattr(Completions.__dict__["create"], "_self_wrapper")
    assert result.status == "completed" and calls == [model, model]
    exported = spans.get_finished_spans()
    chats = [s for s in exported if s.name.startswith("chat")]
    agent = next(s for s in exported if s.name == "invoke_agent")
    assert [s.instrumentation_scope.name for s in chats] == ["fsm", "fsm"]
    for span in chats:
        assert span.parent is not None and span.parent.span_id == agent.context.span_id
        assert dict(span.attributes or {})["fsm.stream.end"] == "done"
        assert agent.start_time < span.start_time < span.end_time
    ((_, point),) = _points("gen_ai.client.operation.duration", model)
    assert point.count == 2
