"""The agent loop end to end: the official openai clients (sync and async) over real HTTP against
fsm.testing.ReplayServer, the store on SQLite and PostgreSQL (the ``fsm_db_url``,
``fsm_replay`` and ``fsm_replay_server`` fixtures of fsm's pytest plugin, fsm/pytest_plugin.py).

The server checks every request after the first (ids linked, arguments byte-exact, each tool
message right after its assistant message, no salvaged incomplete call): ``server.failures`` must
stay empty. What the store holds must be exactly what was streamed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from fsm import Event, StreamEnded, ToolCallOpened
from fsm.agent import (
    AgentEvent,
    AgentResult,
    AttemptRecorded,
    RequestSent,
    ToolExecuted,
    TurnCommitted,
    TurnFailedError,
    arun_agent_loop,
    function_tool,
    run_agent_loop,
)
from fsm.api import parse_file
from fsm.store import ConflictError, ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.testing import ReplayServer, ReplayTurn, demo_script
from tests.helpers import CORPUS, require_corpus
from tests.helpers.agent import CLIENTS, DEMO, DEMO_BYTES, FINAL, MODEL, USER, bounded, streamed

#: the end of the first tool-call event of the demo stream: a place to stall it
FIRST_CALL_EVENT_END = DEMO_BYTES.index(b"\n\n", DEMO_BYTES.index(b"tool_calls")) + 2


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS: dict[str, Callable[..., Any]] = {"add": add, "multiply": multiply}


@dataclass
class Run:
    """What one run of the loop did: its result or error, its events, and the store after it."""

    result: AgentResult | None = None
    error: BaseException | None = None
    events: list[AgentEvent] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)


def drive(
    kind: str,
    url: str,
    server: ReplayServer,
    conversation: str = "conv",
    tools: Mapping[str, Callable[..., Any]] = TOOLS,
    wrap: Callable[[Any], Any] = lambda client: client,
    **kwargs: Any,
) -> Run:
    """Run the loop with the ``kind`` of client (and the matching store) against ``server``
    (``wrap`` wraps the client)."""
    run = Run()
    user_callback = kwargs.pop("on_event", None)

    def on_event(event: AgentEvent) -> None:
        run.events.append(event)
        if user_callback is not None:
            user_callback(event)

    if kind == "openai":
        with ConversationStore(url) as store:
            client = wrap(openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0))
            try:
                run.result = run_agent_loop(
                    client, store, conversation, tools, model=MODEL, on_event=on_event,
                    **kwargs,
                )  # fmt: skip
            except Exception as exc:
                run.error = exc
            finally:
                client.close()
            run.history = store.history(conversation)
            run.attempts = store.attempts(conversation)
        return run

    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            client = wrap(
                openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            )
            try:
                run.result = await arun_agent_loop(
                    client, store, conversation, tools, model=MODEL, on_event=on_event,
                    **kwargs,
                )  # fmt: skip
            except Exception as exc:
                run.error = exc
            finally:
                await client.close()
            run.history = await store.history(conversation)
            run.attempts = await store.attempts(conversation)

    asyncio.run(bounded(body()))
    return run


# -- the demo conversation -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", CLIENTS)
def test_demo_conversation_end_to_end(
    kind: str, fsm_db_url: str, fsm_replay: Callable[..., ReplayServer]
) -> None:
    server = fsm_replay(demo_script(["6912", "408"]))  # fsm's pytest plugin
    run = drive(kind, fsm_db_url, server, messages=[USER])
    assert run.error is None, run.error
    assert run.result is not None and run.result.status == "completed"
    assert server.failures == []
    assert server.served == 2
    assert run.history == [
        USER,
        streamed(DEMO),
        {"role": "tool", "tool_call_id": "call_add_7Qz2", "content": "6912"},
        {"role": "tool", "tool_call_id": "call_mul_9Xk4", "content": "408"},
        streamed(FINAL),
    ]
    assert run.result.content == "1234 + 5678 = 6912, and 12 \u00d7 34 = 408."
    assert [t.seq for t in run.result.turns] == [1, 4]
    # what the server received second is exactly what the store holds
    assert server.requests[1]["messages"] == run.history[:4]
    assert [t["function"]["name"] for t in server.requests[0]["tools"]] == ["add", "multiply"]
    assert server.requests[0]["model"] == MODEL and server.requests[0]["stream"] is True
    assert run.attempts == []


@pytest.mark.parametrize("kind", CLIENTS)
def test_progress_events_name_tools_as_soon_as_they_arrive(
    kind: str, fsm_db_url: str, fsm_replay_server: ReplayServer
) -> None:
    run = drive(kind, fsm_db_url, fsm_replay_server, messages=[USER])  # the demo script
    assert run.error is None
    kinds = [type(e).__name__ for e in run.events]
    opened = [e.name for e in run.events if isinstance(e, ToolCallOpened)]
    assert opened == ["add", "multiply"]
    # both names are known before the stream ends, long before any tool runs
    first_end = kinds.index("StreamEnded")
    assert max(i for i, k in enumerate(kinds) if k == "ToolCallOpened") < first_end
    assert kinds[0] == "RequestSent" and kinds.count("RequestSent") == 2
    executed = [e for e in run.events if isinstance(e, ToolExecuted)]
    assert [(e.name, e.arguments, e.content, e.error) for e in executed] == [
        ("add", '{"a": 1234, "b": 5678}', "6912", False),
        ("multiply", '{"a": 12, "b": 34}', "408", False),
    ]
    committed = [e for e in run.events if isinstance(e, TurnCommitted)]
    assert [(e.step, e.turn.seq) for e in committed] == [(1, 1), (2, 4)]
    assert isinstance(run.events[-1], TurnCommitted)
    requests = [e for e in run.events if isinstance(e, RequestSent)]
    assert [(e.step, e.messages) for e in requests] == [(1, 1), (2, 4)]


# -- corpus streams with parallel calls ----------------------------------------------------------
PARALLEL = [
    "groq/groq-kimi-k2_content_then_parallel_calls.sse",
    "openrouter/openrouter-deepinfra-kimi-k2_numeric_string_ids_finish_per_call.sse",
    "openai/openai-gpt-4o_parallel_empty_object_args.sse",
    "writer/writer-palmyra-x4_seven_parallel_calls_message_and_delta.sse",
]


def _echo(**arguments: Any) -> str:
    return "echo " + json.dumps(arguments, sort_keys=True)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("name", PARALLEL)
def test_corpus_parallel_calls_through_the_loop(kind: str, name: str, fsm_db_url: str) -> None:
    require_corpus()
    path = CORPUS / name
    turn = parse_file(path).turn(0)
    assert turn.complete and len(turn.tool_calls) >= 2
    tools: dict[str, Callable[..., Any]] = {c.name: _echo for c in turn.tool_calls}
    tools.update({k: v for k, v in TOOLS.items() if k in tools})
    with ReplayServer([ReplayTurn(path), ReplayTurn(FINAL)]) as server:
        run = drive(kind, fsm_db_url, server, tools=tools, messages=[USER])
    assert run.error is None, run.error
    assert server.failures == []
    assert run.history[1] == turn.to_message()  # ids and arguments byte-exact
    n = len(turn.tool_calls)
    results = run.history[2 : 2 + n]
    assert [m["tool_call_id"] for m in results] == [c.id for c in turn.tool_calls]
    assert all(m["role"] == "tool" and not m["content"].startswith("error") for m in results)
    assert run.history[2 + n :] == [streamed(FINAL)]
    assert server.requests[1]["messages"] == run.history[: 2 + n]


# -- incomplete turns ----------------------------------------------------------------------------
FAILURES = {
    # the loop reads the raw bytes: the transport's own error, not the SDK's wrapper
    "cut": (ReplayTurn(DEMO, cut_at=len(DEMO_BYTES) // 2), "incomplete chunked read"),
    "provider-error": (
        ReplayTurn(DEMO, error_at=len(DEMO_BYTES) // 2, error_message="upstream overloaded"),
        "upstream overloaded",
    ),
    "http-500": (ReplayTurn(DEMO, status=500, error_message="boom"), "500"),
    # inside the second call's arguments
    "cut-mid-call": (
        ReplayTurn(DEMO, cut_at=DEMO_BYTES.index(b'"arguments":"12, "') + 10),
        "incomplete chunked read",
    ),
    # every chunk arrived (finish_reason included), then an ``event: error`` whose data has no
    # "error" key, and no [DONE]: the parsed Stream of openai < 1.97.2 called this complete
    "error-event-after-finish": (
        ReplayTurn(
            DEMO_BYTES[: DEMO_BYTES.index(b"data: [DONE]")]
            + b'event: error\ndata: {"message": "backend died", "code": 500}\n\n'
        ),
        "backend died",
    ),
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_an_incomplete_turn_records_an_attempt_and_commits_nothing(
    kind: str, failure: str, fsm_db_url: str
) -> None:
    turn, reason = FAILURES[failure]
    script = [turn, *demo_script()]
    with ReplayServer(script) as server:
        run = drive(kind, fsm_db_url, server, messages=[USER])
        assert isinstance(run.error, TurnFailedError), run.error
        assert reason in run.error.reason and run.error.step == 1
        assert run.history == [USER]  # nothing of the turn went to history
        (attempt,) = run.attempts
        assert run.error.attempt_ids == [attempt["id"]] and not attempt["complete"]
        if failure != "http-500":
            assert [(c["id"], c["state"]) for c in attempt["tool_calls"]] == [
                ("call_add_7Qz2", "aborted"),
                ("call_mul_9Xk4", "aborted"),
            ]
        recorded = [e for e in run.events if isinstance(e, AttemptRecorded)]
        assert [e.attempt_ids for e in recorded] == [run.error.attempt_ids]
        # the same conversation goes on: the retry carries nothing of the failed turn (the
        # server rejects a request that salvages an incomplete call)
        again = drive(kind, fsm_db_url, server)
    assert again.error is None, again.error
    assert server.failures == []
    assert again.history == [
        USER,
        streamed(DEMO),
        {"role": "tool", "tool_call_id": "call_add_7Qz2", "content": "6912"},
        {"role": "tool", "tool_call_id": "call_mul_9Xk4", "content": "408"},
        streamed(FINAL),
    ]
    assert len(again.attempts) == 1


class ParsedOnly:
    """A client without ``with_streaming_response`` (an OpenAI look-alike): only
    ``chat.completions.create``, so the loop falls back to the SDK's parsed ``Stream``."""

    def __init__(self, client: Any) -> None:
        self.chat = SimpleNamespace(
            completions=SimpleNamespace(create=client.chat.completions.create)
        )
        self.close = client.close


@pytest.mark.parametrize("kind", CLIENTS)
def test_the_loop_reads_raw_bytes_and_falls_back_to_the_parsed_stream(
    kind: str, fsm_db_url: str
) -> None:
    """The same conversation through ``with_streaming_response`` (the raw bytes: the stream
    ends ``done``, at ``[DONE]``) and through a client that only has ``create`` (the SDK's
    chunks: it ends ``eof``)."""
    ends: list[str | None] = []

    def on_event(event: AgentEvent) -> None:
        if isinstance(event, StreamEnded):
            ends.append(event.how)

    with ReplayServer(demo_script(["6912", "408"]) * 2) as server:
        raw = drive(kind, fsm_db_url, server, "raw", messages=[USER], on_event=on_event)
        parsed = drive(
            kind, fsm_db_url, server, "parsed", messages=[USER], on_event=on_event, wrap=ParsedOnly
        )
    assert raw.error is None and parsed.error is None, (raw.error, parsed.error)
    assert server.failures == []
    assert raw.history == parsed.history and len(raw.history) == 5
    assert ends == ["done", "done", "eof", "eof"]


@pytest.mark.parametrize("kind", CLIENTS)
def test_truncated_arguments_are_never_executed(kind: str, fsm_db_url: str) -> None:
    truncated = DEMO_BYTES.replace(b'"finish_reason":"tool_calls"', b'"finish_reason":"length"')
    with ReplayServer([ReplayTurn(truncated)]) as server:
        run = drive(kind, fsm_db_url, server, messages=[USER], record_attempts=False)
    assert isinstance(run.error, TurnFailedError)
    assert run.error.reason == "length" and run.error.attempt_ids == []
    assert not any(isinstance(e, ToolExecuted) for e in run.events)
    assert run.history == [USER] and run.attempts == []


# -- tools, limits, conflicts ---------------------------------------------------------------------
def test_tool_errors_become_error_results(fsm_db_url: str) -> None:
    def broken(a: int, b: int) -> int:
        raise ValueError("no multiplying today")

    with ReplayServer(demo_script()) as server:
        run = drive(
            "openai", fsm_db_url, server, tools={"add": add, "multiply": broken}, messages=[USER]
        )
    assert run.error is None and server.failures == []
    assert [m["content"] for m in run.history[2:4]] == [
        "6912",
        "error: ValueError: no multiplying today",
    ]
    errors = [e.error for e in run.events if isinstance(e, ToolExecuted)]
    assert errors == [False, True]


def test_unknown_tools_are_errors(fsm_db_url: str) -> None:
    with ReplayServer(demo_script()) as server:
        run = drive("openai", fsm_db_url, server, tools={"add": add}, messages=[USER])
    assert run.error is None and server.failures == []
    assert [m["content"] for m in run.history[2:4]] == [
        "6912",
        "error: there is no tool 'multiply' (tools: add)",
    ]


def test_async_tools_run_concurrently(fsm_db_url: str) -> None:
    started: list[str] = []

    def waiting(name: str, combine: Callable[[int, int], int]) -> Callable[..., Any]:
        async def tool(a: int, b: int) -> dict[str, int]:
            started.append(name)
            while len(started) < 2:  # returns only once the other call has started too
                await asyncio.sleep(0.001)
            return {name: combine(a, b)}

        return tool

    tools = {"add": waiting("sum", add), "multiply": waiting("product", multiply)}
    with ReplayServer(demo_script()) as server:
        run = drive("async-openai", fsm_db_url, server, tools=tools, messages=[USER])
    assert run.error is None and server.failures == []
    assert [m["content"] for m in run.history[2:4]] == ['{"sum": 6912}', '{"product": 408}']


@pytest.mark.parametrize("kind", CLIENTS)
def test_max_turns(kind: str, fsm_db_url: str) -> None:
    with ReplayServer(demo_script()) as server:
        run = drive(kind, fsm_db_url, server, messages=[USER], max_turns=1)
    assert run.result is not None and run.result.status == "max_turns"
    assert len(run.history) == 4 and server.served == 1


def test_another_writer_mid_stream_is_a_conflict(fsm_db_url: str) -> None:
    """Every commit names the seq its request was built from: a write in between is caught.
    The tools had run: the turn is recorded as an attempt with their results, and the
    TurnFailedError says so (tests/agent/test_commit_failures.py tries every other failure)."""
    with ConversationStore(fsm_db_url) as other, ReplayServer(demo_script()) as server:
        other.create_conversation("conv")

        def meddle(event: AgentEvent) -> None:
            if isinstance(event, StreamEnded):
                other.append("conv", [{"role": "user", "content": "me too"}])

        with ConversationStore(fsm_db_url) as store:
            client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            with pytest.raises(TurnFailedError) as failed:
                run_agent_loop(client, store, "conv", TOOLS, model=MODEL, messages=[USER],
                               on_event=meddle)  # fmt: skip
            client.close()
            assert [m["content"] for m in store.history("conv")] == [USER["content"], "me too"]
            (attempt,) = store.attempts("conv")
    error = failed.value
    assert isinstance(error.__cause__, ConflictError) and error.retryable
    assert error.reason.startswith("commit_failed: ") and error.results == ["6912", "408"]
    assert error.attempt_ids == [attempt["id"]]


def test_function_tool_schema() -> None:
    def search(query: str, limit: int = 10, tags: list[str] | None = None) -> str:
        """Search the web.

        Longer text that is not part of the description.
        """
        return query

    assert function_tool(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer", "default": 10},
                    "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                                       {"type": "null"}], "default": None},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    }  # fmt: skip
    with pytest.raises(ValueError):
        run_agent_loop(None, None, "c", {}, model="m", max_turns=0)  # type: ignore[arg-type]


# -- cancellation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "not-recorded"])
def test_cancelling_the_task_mid_stream_commits_nothing(record: bool, fsm_db_url: str) -> None:
    """The server stalls the stream right after the first tool call's header (``hold_at``, no
    sleeps); the task running the loop is cancelled once the loop reported that call."""
    seen: list[Event | Any] = []

    async def scenario(server: ReplayServer) -> tuple[list[dict[str, Any]], list[Any]]:
        async with AsyncConversationStore(fsm_db_url) as store:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            opened = asyncio.Event()

            def on_event(event: AgentEvent) -> None:
                seen.append(event)
                if isinstance(event, ToolCallOpened):
                    opened.set()

            task = asyncio.create_task(
                arun_agent_loop(client, store, "conv", TOOLS, model=MODEL, messages=[USER],
                                on_event=on_event, record_attempts=record)
            )  # fmt: skip
            await opened.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            server.release()
            await client.close()
            return await store.history("conv"), await store.attempts("conv")

    with ReplayServer([ReplayTurn(DEMO, hold_at=FIRST_CALL_EVENT_END)]) as server:
        history, attempts = asyncio.run(bounded(scenario(server)))
    assert history == [USER]
    assert not any(isinstance(e, ToolExecuted | TurnCommitted) for e in seen)
    if not record:
        assert attempts == []
        return
    (attempt,) = attempts
    assert (attempt["end_how"], attempt["complete"]) == ("aborted", False)
    assert [(c["id"], c["name"], c["state"], c["reason"]) for c in attempt["tool_calls"]] == [
        ("call_add_7Qz2", "add", "aborted", "cancelled")
    ]
    assert attempt["content"] == "I'll work out both at once."
    (recorded,) = [e for e in seen if isinstance(e, AttemptRecorded)]
    assert recorded.reason == "cancelled" and recorded.attempt_ids == [attempt["id"]]


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_failing_callback_aborts_the_turn_with_its_error(kind: str, fsm_db_url: str) -> None:
    def on_event(event: AgentEvent) -> None:
        if isinstance(event, ToolCallOpened):
            raise RuntimeError("display crashed")

    with ReplayServer(demo_script()) as server:
        run = drive(kind, fsm_db_url, server, messages=[USER], on_event=on_event)
    assert isinstance(run.error, RuntimeError)
    assert run.history == [USER]
    (attempt,) = run.attempts
    assert attempt["end_reason"] == "RuntimeError: display crashed"
    assert [c["state"] for c in attempt["tool_calls"]] == ["aborted"]


def test_importing_the_agent_loads_neither_openai_nor_sqlalchemy() -> None:
    code = (
        "import sys, json, fsm.agent\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'openai', 'httpx', 'sqlalchemy', 'alembic', 'click'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
