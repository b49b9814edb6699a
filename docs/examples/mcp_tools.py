"""An MCP server's tools in the agent loop: this file is also the MCP server, which the
program starts as a subprocess and talks to over stdio.

Needs ``pip install 'fsm-toolcalls[openai,async,mcp]'``. Offline: run ``fsm replay`` in another
terminal and paste the ``export`` lines it prints into this one; then ``python mcp_tools.py``.
"""

import asyncio
import sys

from mcp import Client, StdioServerParameters
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from openai import AsyncOpenAI

from fsm.agent import arun_agent_loop
from fsm.integrations.mcp import mcp_tools
from fsm.store.aio import AsyncConversationStore

server = MCPServer("calculator", log_level="WARNING")  # (its default INFO logs the client too)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))  # may run again after a crash
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


async def main() -> None:
    this_file_as_server = StdioServerParameters(command=sys.executable, args=[__file__, "serve"])
    async with (
        Client(this_file_as_server) as session,
        AsyncConversationStore("sqlite:///chat.db", auto_upgrade=True) as store,
    ):
        tools = await mcp_tools(session)  # the server's tools, their input schemas as definitions
        result = await arun_agent_loop(
            AsyncOpenAI(),
            store,
            await store.create_conversation(),
            tools,
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}],
            ledger=True,  # each MCP call recorded as it finishes (the tool ledger)
        )
        for message in await store.history(result.conversation_id):
            if message["role"] == "tool":  # what the MCP server answered, as the model saw it
                print("tool", message["tool_call_id"], message["content"])
    print(result.status, result.content)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        server.run()  # the MCP server, over stdio
    else:
        asyncio.run(main())
