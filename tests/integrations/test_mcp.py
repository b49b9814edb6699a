"""MCP tools in fsm's agent loop (issue 30, item 7): a real MCP server (mcp's ``MCPServer``,
over stdio as a subprocess and in-process), fsm's asyncio agent loop against the replay server
(two turns: the first calls the MCP tools, the second must carry their results), then
``fsm audit check``."""

from __future__ import annotations

import asyncio
import base64
import sys
import warnings
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner

from fsm.agent import ToolExecuted, arun_agent_loop, run_agent_loop
from fsm.cli.main import cli
from fsm.replay import ReplayServer, ReplayTurn, demo_script
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from tests.helpers import REPO, chunk, entry, require_framework, sse
from tests.helpers.agent import USER, bounded
from tests.integrations import mcp_server

mcp = require_framework("mcp", "mcp")
pytest.importorskip("aiosqlite")
anthropic = pytest.importorskip("anthropic")

from fsm.integrations.mcp import McpToolsError, mcp_tools, result_text  # noqa: E402

SERVER = Path(mcp_server.__file__)
MODEL = "demo-model-1"


def _stdio() -> Any:
    params = mcp.StdioServerParameters(command=sys.executable, args=[str(SERVER)], cwd=str(REPO))
    return mcp.Client(params)


def _client(fmt: str, base_url: str) -> Any:
    if fmt == "anthropic":
        return anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key="t",
                                         max_retries=0)  # fmt: skip
    return openai.AsyncOpenAI(base_url=base_url, api_key="t", max_retries=0)


def _audit(url: str) -> None:
    done = CliRunner().invoke(cli, ["audit", "check", "--db", url])
    assert done.exit_code == 0, done.output
    assert "no violations" in done.output


@pytest.mark.parametrize(
    ("fmt", "transport"), [("chat", "stdio"), ("responses", "memory"), ("anthropic", "memory")]
)
def test_mcp_tools_run_in_the_agent_loop(fmt: str, transport: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mcp.db'}"
    script = demo_script(["6912", "408"], format=fmt)  # type: ignore[arg-type]
    events: list[Any] = []

    async def main() -> Any:
        session = _stdio() if transport == "stdio" else mcp.Client(mcp_server.build())
        async with (
            session,
            AsyncConversationStore(url, auto_upgrade=True) as store,
        ):
            tools = await mcp_tools(session)
            client = _client(fmt, server.base_url)
            try:
                return tools, await arun_agent_loop(
                    client, store, "mcp-1", tools, model=MODEL, messages=[USER],
                    format=fmt, on_event=events.append,  # type: ignore[arg-type]
                )  # fmt: skip
            finally:
                await client.close()

    with ReplayServer(script) as server:
        tools, result = asyncio.run(bounded(main()))
    assert server.failures == [], server.failures  # the second request carried both results
    assert result.status == "completed" and len(result.turns) == 2
    assert sorted(tools) == ["add", "divide", "logo", "multiply"]
    # the first request's tools: the MCP input schemas, in the API's shape
    sent = {(t.get("function") or t)["name"]: t for t in server.requests[0]["tools"]}
    schema = sent["add"].get("input_schema") or sent["add"].get("parameters") or sent["add"][
        "function"]["parameters"]  # fmt: skip
    assert schema["properties"] == {"a": {"title": "A", "type": "integer"},
                                    "b": {"title": "B", "type": "integer"}}  # fmt: skip
    assert schema["required"] == ["a", "b"]
    if fmt == "chat":
        assert sent["add"]["function"]["description"] == "Add two integers."
    elif fmt == "responses":
        assert sent["add"]["type"] == "function" and "parameters" in sent["add"]
    else:
        assert set(sent["add"]) == {"name", "description", "input_schema"}
    ran = [(e.name, e.content, e.error) for e in events if isinstance(e, ToolExecuted)]
    assert sorted(ran) == [("add", "6912", False), ("multiply", "408", False)]
    # the second request saw the first turn: history holds the calls and the MCP results
    with ConversationStore(url) as store:
        history = store.history("mcp-1")
    results = [m["content"] for m in history if m["role"] == "tool"]
    assert results == ["6912", "408"]
    _audit(url)


def test_the_ledger_reruns_only_what_the_hints_allow() -> None:
    async def main() -> Any:
        async with mcp.Client(mcp_server.build()) as session:
            trusted = await mcp_tools(session)
            untrusted = await mcp_tools(session, trust_hints=False)
            return trusted, untrusted

    trusted, untrusted = asyncio.run(bounded(main()))
    from fsm.agent import is_idempotent

    # readOnlyHint or idempotentHint: may run again after a crash; destructive / no hints: never
    assert {n: is_idempotent(t) for n, t in trusted.items()} == {
        "add": True, "multiply": True, "divide": False, "logo": False,
    }  # fmt: skip
    assert not any(is_idempotent(t) for t in untrusted.values())


def _one_call(name: str, args: str, call_id: str = "call_1") -> bytes:
    return sse(chunk(entry(0, call_id, name, args)), chunk(finish="tool_calls"))


def _answer(text: str = "done") -> bytes:
    return sse(chunk(content=text), chunk(finish="stop"))


def test_an_mcp_error_is_an_error_result_and_the_loop_goes_on(tmp_path: Path) -> None:
    """``isError`` (the tool raised; the server refused the arguments) is an error result with
    the server's text, sent to the model and committed (with the tool ledger on); audit
    stays clean."""
    url = f"sqlite:///{tmp_path / 'e.db'}"
    script = [
        ReplayTurn(
            sse(
                chunk(entry(0, "c1", "divide", '{"a": 1, "b": 0}')),
                chunk(entry(1, "c2", "divide", '{"a": "x", "b": 2}')),
                chunk(finish="tool_calls"),
            )
        ),
        ReplayTurn(_answer()),
    ]
    events: list[Any] = []

    async def main() -> Any:
        async with (
            mcp.Client(mcp_server.build()) as session,
            AsyncConversationStore(url, auto_upgrade=True) as store,
        ):
            tools = await mcp_tools(session)
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            try:
                return await arun_agent_loop(
                    client, store, "e", tools, model=MODEL, messages=[USER], ledger=True,
                    on_event=events.append,
                )  # fmt: skip
            finally:
                await client.close()

    with ReplayServer(script) as server:
        result = asyncio.run(bounded(main()))
    assert result.status == "completed" and server.failures == []
    ran = sorted((e.call_id, e.error, e.content) for e in events if isinstance(e, ToolExecuted))
    assert ran[0][:2] == ("c1", True) and ran[0][2].startswith("error: ")
    assert "divide" in ran[0][2]
    assert ran[1][:2] == ("c2", True) and "valid integer" in ran[1][2]
    sent = [m for m in server.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in sent] == [ran[0][2], ran[1][2]]
    with ConversationStore(url) as store:
        committed = store.history("e")
    assert [m["content"] for m in committed if m["role"] == "tool"] == [ran[0][2], ran[1][2]]
    _audit(url)


def test_what_a_result_keeps_and_loses() -> None:
    """Text is kept; an image is a placeholder (its bytes are not); structured content alone
    is JSON; an embedded text resource is its text."""
    types = mcp.types
    png = base64.b64encode(b"\x89PNG" + bytes(96)).decode()

    def call(*content: Any, structured: Any = None, error: bool = False) -> Any:
        return types.CallToolResult(content=list(content), structured_content=structured,
                                    is_error=error)  # fmt: skip

    text = types.TextContent(type="text", text="hello")
    image = types.ImageContent(type="image", data=png, mime_type="image/png")
    assert result_text(call(text)) == "hello"
    assert result_text(call(text, image)) == "hello\n[image: image/png, 100 bytes not kept]"
    assert result_text(call(structured={"result": 3})) == '{"result":3}'
    # text wins over structured content (servers send both: the text is its serialization)
    assert result_text(call(types.TextContent(type="text", text="3"), structured={"r": 3})) == "3"
    resource = types.EmbeddedResource(
        type="resource",
        resource=types.TextResourceContents(uri="file:///a.txt", text="A", mime_type="text/plain"),
    )
    assert result_text(call(resource)) == "A"
    blob = types.EmbeddedResource(
        type="resource",
        resource=types.BlobResourceContents(
            uri="file:///b.bin", blob=png, mime_type="application/pdf"
        ),
    )
    assert (
        result_text(call(blob)) == "[resource file:///b.bin: application/pdf, 100 bytes not kept]"
    )

    async def main() -> str:
        async with mcp.Client(mcp_server.build()) as session:
            tools = await mcp_tools(session)
            value: str = await tools["logo"]()
            return value

    assert asyncio.run(bounded(main())) == "[image: image/png, 100 bytes not kept]"


def test_names_prefix_filter_and_refusals() -> None:
    async def main() -> Any:
        async with mcp.Client(mcp_server.build()) as session:
            prefixed = await mcp_tools(session, prefix="calc_", only=lambda t: t.name != "logo")
            with pytest.raises(McpToolsError, match="APIs refuse"):
                await mcp_tools(session, prefix="calc.")
            return prefixed, prefixed.definitions(), await prefixed["calc_add"](a=2, b=3)

    prefixed, definitions, five = asyncio.run(bounded(main()))
    assert sorted(prefixed) == ["calc_add", "calc_divide", "calc_multiply"]
    assert [d["function"]["name"] for d in definitions] == sorted(
        prefixed, key=list(prefixed).index
    )
    assert five == "5"  # the MCP call uses the server's name


def test_the_sync_loop_says_mcp_tools_need_the_async_loop(tmp_path: Path) -> None:
    """A coroutine tool in the sync loop is an error result saying to use arun_agent_loop (no
    'never awaited' warning, the tool never runs)."""
    script = [ReplayTurn(_one_call("add", '{"a": 1, "b": 2}')), ReplayTurn(_answer())]
    mcp_server.CALLS.clear()

    async def listing() -> Any:
        async with mcp.Client(mcp_server.build()) as session:
            return await mcp_tools(session)

    tools = asyncio.run(bounded(listing()))
    events: list[Any] = []
    with (
        ReplayServer(script) as server,
        ConversationStore(f"sqlite:///{tmp_path / 's.db'}", auto_upgrade=True) as store,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error", RuntimeWarning)  # no "coroutine never awaited"
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        run_agent_loop(client, store, "s", tools, model=MODEL, messages=[USER],
                       on_event=events.append)  # fmt: skip
        client.close()
    (done,) = [e for e in events if isinstance(e, ToolExecuted)]
    assert done.error and "arun_agent_loop" in done.content
    assert mcp_server.CALLS["add"] == 0


def test_the_adapter_imports_mcp_lazily() -> None:
    from tests.helpers import child_json

    code = "import sys, json, fsm.integrations.mcp; print(json.dumps('mcp' in sys.modules))"
    assert child_json(code, timeout=60) is False
