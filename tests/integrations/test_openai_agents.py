"""fsm.integrations.openai_agents.FsmSession with openai-agents' real Runner (streamed, over the
Responses API: OpenAIResponsesModel) against fsm's ReplayServer, on SQLite and PostgreSQL, with
the sync and the asyncio store.

The scripted model is fsm's own Responses recordings (fsm/examples/responses_add_multiply.sse:
a reasoning item with encrypted_content, a message and two calls, add and multiply; then
responses_final_answer.sse). The ReplayServer checks each request of a run: the second must
carry back the calls byte for byte with their outputs (the runner's own loop).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from fsm.integrations.errors import HistoryRewriteError, UnansweredCallsError
from fsm.replay import EXAMPLES_DIR, ReplayServer, ReplayTurn
from fsm.store import ConversationStore, InvalidMessageError, ResultsError
from fsm.store.audit import check, pending_turns
from tests.helpers import child_json, require_framework

T = TypeVar("T")

FIRST = EXAMPLES_DIR / "responses_add_multiply.sse"
FINAL = EXAMPLES_DIR / "responses_final_answer.sse"
QUESTION = "What are 1234 + 5678 and 12 * 34?"
ANSWER = "1234 + 5678 = 6912 and 12 \u00d7 34 = 408."
CALLS = {"call_add_7Qz2": "6912", "call_mul_9Xk4": "408"}


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


@pytest.fixture
def agents() -> Iterator[Any]:
    module = require_framework("agents", "openai-agents")
    module.set_tracing_disabled(True)  # nothing leaves the machine
    yield module


def make_agent(agents: Any, server: Any, *, approval: bool = False) -> Any:
    from openai import AsyncOpenAI

    @agents.function_tool(needs_approval=approval)
    def add(a: int, b: int) -> int:
        return a + b

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        return a * b

    client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
    model = agents.OpenAIResponsesModel(model="demo-model-1", openai_client=client)
    return agents.Agent(
        name="calc", instructions="Use the tools.", tools=[add, multiply], model=model
    )


async def run_streamed(agents: Any, agent: Any, given: Any, session: Any) -> Any:
    result = agents.Runner.run_streamed(agent, given, session=session)
    async for _event in result.stream_events():
        pass
    return result


def calls_in(request: dict[str, Any]) -> dict[str, Any]:
    """The function_call items of a request's input, by call id, and their outputs."""
    items = request["input"]
    made = {i["call_id"]: i for i in items if i.get("type") == "function_call"}
    outputs = {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}
    return {"calls": made, "outputs": outputs}


def assert_clean(url: sa.URL) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        assert list(check(engine)) == []
    finally:
        engine.dispose()


def two_runs(agents: Any, session: Any) -> tuple[ReplayServer, list[Any]]:
    """Run 1: a question answered with two tool calls; run 2: a follow-up in the same session."""
    script = [
        ReplayTurn(FIRST),
        ReplayTurn(FINAL, expect_tool_results=["6912", "408"]),
        ReplayTurn(FINAL),
    ]
    with ReplayServer(script) as server:
        agent = make_agent(agents, server)

        async def body() -> list[Any]:
            first = await run_streamed(agents, agent, QUESTION, session)
            second = await run_streamed(agents, agent, "And the sum of both?", session)
            return [first, second]

        results = run(body())
    return server, results


def check_two_runs(server: ReplayServer, results: list[Any], items: list[Any]) -> None:
    assert server.failures == []
    assert [r.final_output for r in results] == [ANSWER, ANSWER]
    assert len(server.requests) == 3
    # run 2's model request carries run 1's calls, byte for byte, with their outputs
    seen = calls_in(server.requests[2])
    assert {cid: c["arguments"] for cid, c in seen["calls"].items()} == {
        "call_add_7Qz2": '{"a": 1234, "b": 5678}',
        "call_mul_9Xk4": '{"a": 12, "b": 34}',
    }
    assert seen["outputs"] == CALLS
    sent = server.requests[2]["input"]
    reasoning = [i for i in sent if i.get("type") == "reasoning"]
    assert [r["encrypted_content"] for r in reasoning] == [
        "gAAAAABfsmdemo-encrypted-reasoning-sent-back-verbatim=="
    ]
    assert sent[0] == {"role": "user", "content": QUESTION}
    assert sent[-1] == {"role": "user", "content": "And the sum of both?"}
    # the session holds both runs: what run 2 sent, then its answer
    assert items[: len(sent)] == sent
    assert [i.get("type") for i in items[len(sent) :]] == ["message"]


def test_two_runs_sync_store(agents: Any, store: ConversationStore, db_url: sa.URL) -> None:
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "user-42")
    assert isinstance(session, agents.memory.Session)
    server, results = two_runs(agents, session)
    items = run(session.get_items())
    check_two_runs(server, results, items)
    # fsm's own view: two turns with tools linked to their results, then the answers
    chat = store.history("user-42")
    roles = ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    assert [m["role"] for m in chat] == roles
    assert [c["id"] for c in chat[1]["tool_calls"]] == list(CALLS)
    assert [(m["tool_call_id"], m["content"]) for m in chat[2:4]] == list(CALLS.items())
    assert store.pending("user-42") is None
    assert run(session.get_items(limit=2)) == items[-2:]
    assert_clean(db_url)


def test_two_runs_async_store(agents: Any, db_url: sa.URL) -> None:
    from fsm.integrations.openai_agents import FsmSession
    from fsm.store.aio import AsyncConversationStore

    url = db_url.render_as_string(hide_password=False)

    script = [
        ReplayTurn(FIRST),
        ReplayTurn(FINAL, expect_tool_results=["6912", "408"]),
        ReplayTurn(FINAL),
    ]
    with ReplayServer(script) as server:
        agent = make_agent(agents, server)

        async def body() -> tuple[list[Any], list[Any]]:
            async with AsyncConversationStore(url) as store:
                session = FsmSession(store, "user-async")
                first = await run_streamed(agents, agent, QUESTION, session)
                second = await run_streamed(agents, agent, "And the sum of both?", session)
                return [first, second], await session.get_items()

        results, items = run(body())
    check_two_runs(server, results, items)
    assert_clean(db_url)


class CompletedResponses:
    """A tiny scripted Responses server for ``Runner.run`` (not streamed): each request is
    answered with the next recording's final ``response`` object as JSON (what the API returns
    without ``stream``); the request bodies are kept."""

    def __init__(self, recordings: list[Path]) -> None:
        self.answers = [self.completed(path) for path in recordings]
        self.requests: list[Any] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if self.path != "/v1/responses" or body.get("stream") or not outer.answers:
                    self.send_response(400)
                    self.end_headers()
                    return
                data = json.dumps(outer.answers.pop(0)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @staticmethod
    def completed(path: Path) -> Any:
        for line in path.read_text().splitlines():
            if line.startswith("data: ") and '"response.completed"' in line:
                return json.loads(line[len("data: ") :])["response"]
        raise AssertionError(f"{path.name} has no response.completed event")

    def __enter__(self) -> CompletedResponses:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_two_runs_not_streamed(agents: Any, store: ConversationStore, db_url: sa.URL) -> None:
    """``Runner.run`` (the non-streamed call most code makes) with the same session."""
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "not-streamed")
    with CompletedResponses([FIRST, FINAL, FINAL]) as server:
        agent = make_agent(agents, server)

        async def body() -> list[Any]:
            first = await agents.Runner.run(agent, QUESTION, session=session)
            second = await agents.Runner.run(agent, "And the sum of both?", session=session)
            return [first.final_output, second.final_output]

        answers = run(body())
    assert answers == [ANSWER, ANSWER]
    assert len(server.requests) == 3
    for request in server.requests[1:]:  # the run's own follow-up, then run 2
        assert calls_in(request)["outputs"] == CALLS
    assert server.requests[2]["input"][-1] == {"role": "user", "content": "And the sum of both?"}
    items = run(session.get_items())
    assert items[:-1] == server.requests[2]["input"]
    assert store.pending("not-streamed") is None
    assert_clean(db_url)


def test_a_call_awaiting_approval_stays_pending(
    agents: Any, store: ConversationStore, db_url: sa.URL
) -> None:
    """add needs approval: the run stops with multiply answered and add not. The turn is the
    ledger's pending turn, never history; approving and resuming commits it."""
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "approve")
    script = [ReplayTurn(FIRST), ReplayTurn(FINAL, expect_tool_results=["6912", "408"])]
    with ReplayServer(script) as server:
        agent = make_agent(agents, server, approval=True)

        async def body() -> Any:
            stopped = await run_streamed(agents, agent, QUESTION, session)
            assert [i.raw_item.call_id for i in stopped.interruptions] == ["call_add_7Qz2"]
            assert await session.get_items() == [{"role": "user", "content": QUESTION}]
            pending = store.pending("approve")
            assert pending is not None
            assert [(e.call.id, e.state, e.result) for e in pending.executions] == [
                ("call_add_7Qz2", "not_started", None),
                ("call_mul_9Xk4", "succeeded", "408"),
            ]
            [row] = pending_turns(store.engine, conversation="approve")
            assert (row.state, row.not_started, row.succeeded) == ("pending", 1, 1)
            state = stopped.to_state()
            state.approve(stopped.interruptions[0])
            return await run_streamed(agents, agent, state, session)

        done = run(body())
    assert server.failures == []
    assert done.final_output == ANSWER
    assert store.pending("approve") is None
    items = run(session.get_items())
    outputs = {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}
    assert outputs == CALLS
    assert [row.state for row in pending_turns(store.engine, states=["committed"])] == ["committed"]
    assert_clean(db_url)


def test_a_call_never_answered_is_never_sent_back(
    agents: Any, store: ConversationStore, db_url: sa.URL
) -> None:
    """The approval never comes and the user asks something else: the model's next request has
    no call without its output; the turn is abandoned in the ledger (for audit), not history."""
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "moved-on")
    # the second request cannot carry the unanswered calls back: the server's own check (which
    # wants them) is off for it; this test checks the request itself
    script = [ReplayTurn(FIRST), ReplayTurn(FINAL, check=False)]
    with ReplayServer(script) as server:
        agent = make_agent(agents, server, approval=True)

        async def body() -> None:
            await run_streamed(agents, agent, QUESTION, session)
            await run_streamed(agents, agent, "Never mind, say hello.", session)

        run(body())
    assert server.failures == []
    assert calls_in(server.requests[1]) == {"calls": {}, "outputs": {}}
    assert server.requests[1]["input"] == [
        {"role": "user", "content": QUESTION},
        {"role": "user", "content": "Never mind, say hello."},
    ]
    assert store.pending("moved-on") is None
    [row] = pending_turns(store.engine, conversation="moved-on")
    assert row.state == "abandoned"
    assert row.reason is not None and "call_add_7Qz2" in row.reason
    assert [m["role"] for m in store.history("moved-on")] == ["user", "user", "assistant"]
    assert_clean(db_url)


def test_unanswered_raise_keeps_the_turn_pending(store: ConversationStore) -> None:
    require_framework("agents", "openai-agents")
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "strict", unanswered="raise")
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'}

    async def body() -> None:
        await session.add_items([{"role": "user", "content": "hi"}, call])
        with pytest.raises(UnansweredCallsError, match="'c1' \\(add\\)"):
            await session.add_items([{"role": "user", "content": "next"}])
        assert await session.get_items() == [{"role": "user", "content": "hi"}]
        await session.add_items([{"type": "function_call_output", "call_id": "c1", "output": "1"}])

    run(body())
    assert store.pending("strict") is None
    assert [m["role"] for m in store.history("strict")] == ["user", "assistant", "tool"]


def test_contract_breaks_are_typed_errors_and_write_nothing(store: ConversationStore) -> None:
    require_framework("agents", "openai-agents")
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "strictly")
    user = {"role": "user", "content": "hi"}
    bad_args = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1'}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "1"}

    async def body() -> None:
        with pytest.raises(ResultsError, match="c9"):
            await session.add_items([user, {**answer, "call_id": "c9"}])
        with pytest.raises(InvalidMessageError, match="message 1"):
            await session.add_items([user, bad_args, answer])
        with pytest.raises(InvalidMessageError, match="item 0"):
            await session.add_items([42])
        assert await session.get_items() == []

    run(body())
    assert store.history("strictly") == []


def test_pop_item_and_clear_session(store: ConversationStore) -> None:
    require_framework("agents", "openai-agents")
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "popped")
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "1"}

    async def body() -> None:
        assert await session.pop_item() is None  # an empty session
        await session.add_items([{"role": "user", "content": "hi"}, call, answer])
        with pytest.raises(HistoryRewriteError, match="append-only"):
            await session.pop_item()
        assert len(await session.get_items()) == 3
        await session.clear_session()
        assert await session.get_items() == []
        assert await session.pop_item() is None
        await session.add_items([{"role": "user", "content": "again"}])
        assert await session.get_items() == [{"role": "user", "content": "again"}]

    run(body())


def test_outputs_out_of_call_order_go_to_their_slots(store: ConversationStore) -> None:
    require_framework("agents", "openai-agents")
    from fsm.integrations.openai_agents import FsmSession

    session = FsmSession(store, "order")
    calls = [
        {"type": "function_call", "call_id": f"c{n}", "name": "add", "arguments": "{}"}
        for n in (1, 2)
    ]
    outputs = [
        {"type": "function_call_output", "call_id": f"c{n}", "output": str(n)} for n in (2, 1)
    ]

    async def body() -> list[Any]:
        await session.add_items([{"role": "user", "content": "hi"}, *calls, *outputs])
        return await session.get_items()

    items = run(body())
    assert [(i.get("type"), i.get("call_id")) for i in items[3:]] == [
        ("function_call_output", "c1"),
        ("function_call_output", "c2"),
    ]


def test_without_openai_agents() -> None:
    """The module imports without the framework; making a session names the extra."""
    code = """
import json, sys
sys.modules["agents"] = None  # as if openai-agents were not installed
import fsm.integrations.openai_agents as adapter
from fsm.integrations.errors import FrameworkMissingError
try:
    adapter.FsmSession(object(), "s")
except FrameworkMissingError as exc:
    print(json.dumps([str(exc), isinstance(exc, ImportError)]))
"""
    message, is_import_error = child_json(code, timeout=60)
    assert "pip install 'fsm-toolcalls[openai-agents]'" in message
    assert is_import_error
