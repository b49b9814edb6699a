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
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

EXPORTER = InMemorySpanExporter()
ROOT = Path(__file__).resolve().parents[1]


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
        "gen_ai.system": "openai",
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
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
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
    # no span carries message content, arguments or results
    text = repr(_by_name(exported))
    for secret in ("1234", "6912", "408", USER["content"]):
        assert secret not in text


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
