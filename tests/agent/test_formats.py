"""Issue 17: the agent loop speaks the Responses API and Anthropic Messages end to end.

The official ``openai`` client (``client.responses``) and ``anthropic`` client (``messages``),
sync and async, over real HTTP against :class:`fsm.testing.ReplayServer`, which checks every
follow-up as the real APIs would (each call answered once, by call_id / tool_use id, in one
user message for Anthropic) and that what was streamed comes back byte-exact (arguments, ids,
encrypted reasoning, thinking signatures): ``server.failures`` must stay empty. The store is
on SQLite and PostgreSQL. Only registered function tools run: a custom (free-text) call and a
call of an unregistered name are refused and reported.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from fsm.agent import (
    AgentEvent,
    ToolExecuted,
    TurnCommitted,
    arun_agent_loop,
    function_tool,
    run_agent_loop,
)
from fsm.agent.tools import tool_spec
from fsm.parser import StreamParser
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.testing import EXAMPLES_DIR, ReplayServer, ReplayTurn
from tests.helpers import REPO, require_recording
from tests.helpers.agent import bounded

SHARED = Path(os.environ.get("FSM_SHARED_DIR", REPO.parent / "shared"))
USER = {"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}
FIRST = {f: EXAMPLES_DIR / f"{f}_add_multiply.sse" for f in ("responses", "anthropic")}
FINAL = {f: EXAMPLES_DIR / f"{f}_final_answer.sse" for f in ("responses", "anthropic")}
ran: list[str] = []


def add(a: int, b: int) -> int:
    """Add two integers."""
    ran.append("add")
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    ran.append("multiply")
    return a * b


TOOLS: dict[str, Callable[..., Any]] = {"add": add, "multiply": multiply}


def client_for(fmt: str, server: ReplayServer, *, asynchronous: bool = False) -> Any:
    if fmt == "anthropic":
        kind = anthropic.AsyncAnthropic if asynchronous else anthropic.Anthropic
        return kind(base_url=server.url, api_key="test", max_retries=0)
    sdk = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return sdk(base_url=server.base_url, api_key="test", max_retries=0)


def script(fmt: str) -> list[ReplayTurn]:
    return [ReplayTurn(FIRST[fmt]), ReplayTurn(FINAL[fmt], expect_tool_results=["6912", "408"])]


def first_turn(fmt: str) -> Any:
    parser = StreamParser(format=fmt)  # type: ignore[arg-type]
    parser.receive_data(FIRST[fmt].read_bytes())
    parser.receive_eof()
    return parser.result().turns[0]


@pytest.mark.parametrize("fmt", ["responses", "anthropic"])
def test_the_loop_runs_a_turn_of_each_format(fmt: str, store: ConversationStore) -> None:
    ran.clear()
    events: list[AgentEvent] = []
    with ReplayServer(script(fmt)) as server:
        result = run_agent_loop(
            client_for(fmt, server),
            store,
            "c",
            TOOLS,
            model="demo-model-1",
            messages=[USER],
            format=fmt,  # type: ignore[arg-type]
            on_event=events.append,
        )
    assert server.failures == [] and server.served == 2
    assert result.status == "completed" and len(result.turns) == 2
    assert ran == ["add", "multiply"]
    executed = [e for e in events if isinstance(e, ToolExecuted)]
    assert [(e.name, e.content, e.error, e.refused) for e in executed] == [
        ("add", "6912", False, False),
        ("multiply", "408", False, False),
    ]
    # what went out: the first request, in the API's shape (tools converted, max_tokens)
    sent = server.requests[0]
    if fmt == "responses":
        assert sent["input"] == [USER]
        assert sent["tools"][0] == {
            "type": "function",
            **{k: v for k, v in function_tool(add)["function"].items()},
            "strict": False,
        }
    else:
        assert sent["messages"] == [USER] and sent["max_tokens"] == 1024
        assert sent["tools"][0]["input_schema"] == function_tool(add)["function"]["parameters"]
    # the follow-up carried the turn back as its parser renders it (server-checked too)
    turn = first_turn(fmt)
    follow = server.requests[1]
    if fmt == "responses":
        assert follow["input"] == [USER, *turn.to_items(["6912", "408"])]
    else:
        assert follow["messages"] == [USER, *turn.to_anthropic(["6912", "408"])]
    history = store.history("c", format=fmt)  # type: ignore[arg-type]
    assert history[: len(follow.get("input", follow.get("messages")))] == follow.get(
        "input", follow.get("messages")
    )
    committed = [e for e in events if isinstance(e, TurnCommitted)]
    assert [e.turn.seq for e in committed] == [1, 4]


@pytest.mark.parametrize("fmt", ["responses", "anthropic"])
def test_the_async_loop_runs_a_turn_of_each_format(fmt: str, db_url: Any) -> None:
    ran.clear()

    async def body() -> Any:
        with ReplayServer(script(fmt)) as server:
            async with AsyncConversationStore(db_url.render_as_string(hide_password=False)) as st:
                result = await bounded(
                    arun_agent_loop(
                        client_for(fmt, server, asynchronous=True),
                        st,
                        "c",
                        TOOLS,
                        model="demo-model-1",
                        messages=[USER],
                        format=fmt,  # type: ignore[arg-type]
                    )
                )
                history = await st.history("c", format=fmt)  # type: ignore[arg-type]
        assert server.failures == [] and server.served == 2
        return result, history

    result, history = asyncio.run(body())
    assert result.status == "completed"
    assert sorted(ran) == ["add", "multiply"]
    assert history[-1]["role"] == "assistant"


def test_a_custom_tool_call_is_reported_never_executed(store: ConversationStore) -> None:
    """xAI-style: the server reports a free-text call. Even with a tool of that name
    registered, nothing runs; the call gets an error result that says why, and the loop goes
    on with a follow-up the server accepts (custom_tool_call_output by call_id)."""
    recording = require_recording(
        SHARED / "corpus-responses" / "vercel-ai__hw_custom_tool_call_free_text.sse",
        "responses recording",
    )
    calls: list[str] = []

    def write_sql(query: str) -> str:
        """Would run SQL."""
        calls.append(query)
        return "ran"

    events: list[AgentEvent] = []
    turns = [ReplayTurn(recording), ReplayTurn(FINAL["responses"])]
    with ReplayServer(turns) as server:
        result = run_agent_loop(
            client_for("responses", server),
            store,
            "c",
            {"write_sql": write_sql},
            model="m",
            messages=[USER],
            format="responses",
            on_event=events.append,
        )
    assert server.failures == [] and result.status == "completed"
    assert calls == []
    (refused,) = [e for e in events if isinstance(e, ToolExecuted)]
    assert refused.refused and refused.error and refused.name == "write_sql"
    assert "custom tool call" in refused.content and "not run" in refused.content
    output = server.requests[1]["input"][-1]
    assert output["type"] == "custom_tool_call_output" and output["output"] == refused.content


@pytest.mark.parametrize("fmt", ["responses", "anthropic"])
def test_an_unregistered_tool_is_reported_never_executed(
    fmt: str, store: ConversationStore
) -> None:
    ran.clear()
    events: list[AgentEvent] = []
    with ReplayServer([ReplayTurn(FIRST[fmt]), ReplayTurn(FINAL[fmt])]) as server:
        result = run_agent_loop(
            client_for(fmt, server),
            store,
            "c",
            {"add": add},
            model="m",
            messages=[USER],
            format=fmt,  # type: ignore[arg-type]
            on_event=events.append,
        )
    assert server.failures == [] and result.status == "completed"
    assert ran == ["add"]
    executed = [(e.name, e.refused) for e in events if isinstance(e, ToolExecuted)]
    assert executed == [("add", False), ("multiply", True)]


def test_tool_specs_in_each_api_shape() -> None:
    chat = function_tool(add)
    assert tool_spec(chat, "chat") == chat
    responses = tool_spec(chat, "responses")
    assert responses["type"] == "function" and responses["name"] == "add"
    assert responses["parameters"] == chat["function"]["parameters"]
    claude = tool_spec(chat, "anthropic")
    assert set(claude) == {"name", "description", "input_schema"}
    native = {"type": "web_search_preview"}
    assert tool_spec(native, "responses") == native  # not a Chat function tool: as it is
    with pytest.raises(ValueError, match="format must be"):
        run_agent_loop(None, None, "c", {}, model="m", format="gemini")  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["responses", "anthropic"])
def test_fsm_demo_runs_offline_in_each_format(fmt: str, tmp_path: Path) -> None:
    """On SQLite only: the demo's store code is the same as chat's, which tests/cli/test_demo.py runs on
    both engines."""
    from click.testing import CliRunner

    from fsm.cli.main import cli

    url = f"sqlite:///{tmp_path / 'demo.db'}"
    result = CliRunner().invoke(cli, ["demo", "--db", url, "--delay", "0", "--format", fmt])
    assert result.exit_code == 0, result.output
    client = "anthropic client (Messages API)" if fmt == "anthropic" else "openai client (Resp"
    assert client in result.output
    assert "server check  2 requests, 0 rejected" in result.output
    assert "integrity     ok" in result.output
    with ConversationStore(url) as store:
        (conversation,) = [c.id for c in store.list_conversations()]
        native = store.history(conversation, format=fmt)  # type: ignore[arg-type]
    turn = first_turn(fmt)
    rendered = (
        turn.to_items(["6912", "408"]) if fmt == "responses" else turn.to_anthropic(["6912", "408"])
    )
    assert native[1 : 1 + len(rendered)] == rendered  # reasoning / signature kept verbatim


@pytest.mark.parametrize("fmt", ["responses", "anthropic"])
def test_the_ledger_keeps_the_provider_items_until_the_commit(
    fmt: str, store: ConversationStore
) -> None:
    """ledger=True: the turn waits pending (outside history) while its tools run; its
    reasoning item / thinking block is kept with it, so the follow-up still carries it back
    verbatim (the server checks) and history reads back as the parser rendered it."""
    ran.clear()
    with ReplayServer(script(fmt)) as server:
        result = run_agent_loop(
            client_for(fmt, server),
            store,
            "c",
            TOOLS,
            model="demo-model-1",
            messages=[USER],
            format=fmt,  # type: ignore[arg-type]
            ledger=True,
        )
    assert server.failures == [] and result.status == "completed"
    assert ran == ["add", "multiply"]
    turn = first_turn(fmt)
    rendered = (
        turn.to_items(["6912", "408"]) if fmt == "responses" else turn.to_anthropic(["6912", "408"])
    )
    history = store.history("c", format=fmt)  # type: ignore[arg-type]
    assert history[1 : 1 + len(rendered)] == rendered
