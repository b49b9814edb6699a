"""An MCP server's tools as tools of fsm's agent loop (issue 30, item 7).

::

    from mcp import Client, StdioServerParameters
    from fsm.agent import arun_agent_loop
    from fsm.integrations.mcp import mcp_tools

    async with Client(StdioServerParameters(command="python", args=["server.py"])) as session:
        tools = await mcp_tools(session)              # a Client or a ClientSession
        await arun_agent_loop(client, store, "chat-1", tools, model=..., messages=[...])

:func:`mcp_tools` lists the session's tools (every page of ``tools/list``) and returns them as
the loop's tool registry (:class:`McpTools`, a mapping of name to tool):

* **the definition**: each tool's MCP ``inputSchema`` is its ``parameters``, its description
  the tool's description; the loop sends it in the shape of the API it speaks (Chat
  ``{"type": "function", "function": ...}``, Responses ``{"type": "function", "name", ...}``,
  Anthropic ``{"name", "input_schema"}``). The arguments are not validated by fsm: the MCP
  server validates them against its schema and answers an error result when they fail.
* **a call** is the MCP ``tools/call`` with the call's JSON object as its arguments; the
  result's content becomes the result string (:func:`result_text`);
* **MCP's error flag** (``isError``: the tool failed, or refused the arguments) makes it an
  error result, ``error: <the server's text>``, as fsm's own tools' exceptions are: sent to
  the model, committed with the turn, ``ToolExecuted.error``, the ledger's ``failed``. A
  protocol error (an unknown tool, a closed session) is an error result too
  (``error: McpError: ...``);
* **the ledger's re-run policy** (:func:`fsm.agent.tool`): a tool whose annotations say
  ``readOnlyHint`` or ``idempotentHint`` is idempotent (after a crash while it ran, the loop
  with ``ledger=True`` may run it again); any other tool is never run twice. MCP calls these
  *hints* that a client should not trust from an untrusted server: ``trust_hints=False``
  treats every tool as not idempotent.

What a result loses: fsm's results are text. Text blocks are kept (joined by a newline); with
no text block, ``structuredContent`` is the result as JSON; an embedded text resource is its
text. An image, an audio clip or an embedded binary resource becomes a placeholder naming its
MIME type and size (``[image: image/png, 5120 bytes not kept]``), a resource link its URI:
the model never sees the bytes. Pass ``render=`` to make another string of the result.

MCP sessions are asyncio objects, so these tools are coroutine functions: run them with
:func:`~fsm.agent.arun_agent_loop` (the sync loop gives each call an error result saying so).
``mcp`` is imported when :func:`mcp_tools` is called (``pip install 'fsm-toolcalls[mcp]'``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fsm.agent.errors import ToolError
from fsm.agent.tools import tool
from fsm.integrations.errors import IntegrationError
from fsm.types import FunctionDefinition, ToolDefinition

__all__ = ["McpTool", "McpTools", "McpToolsError", "mcp_tools", "result_text"]

#: a tool name every API takes (OpenAI's rule, the strictest of the three)
_API_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the most tools/list pages read (a server whose cursor never ends cannot hang the caller)
_MAX_PAGES = 1000


class McpToolsError(IntegrationError):
    """The MCP session's tools cannot be used as the agent loop's tools (the message says
    why: ``mcp`` is not installed, a tool's name is not one the APIs take, two tools share a
    name)."""


def _field(obj: Any, snake: str, camel: str) -> Any:
    """``obj.snake`` (mcp 2) or ``obj.camel`` (mcp 1), else ``None``."""
    value = getattr(obj, snake, None)
    return getattr(obj, camel, None) if value is None else value


def _b64_size(data: Any) -> int:
    """The decoded size of a base64 string, without decoding it."""
    if not isinstance(data, str):
        return 0
    text = data.strip()
    return max(0, len(text) * 3 // 4 - text[-2:].count("="))


def result_text(result: Any) -> str:
    """The text the model gets for an MCP ``CallToolResult`` (what :func:`mcp_tools` sends by
    default): its text blocks joined by a newline; with none, ``structuredContent`` as JSON;
    an embedded text resource as its text; images, audio and binary resources as a
    placeholder naming the MIME type and size; a resource link as its URI."""
    parts: list[str] = []
    texts = 0
    for block in _field(result, "content", "content") or ():
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(str(getattr(block, "text", "")))
            texts += 1
        elif kind in ("image", "audio"):
            mime = _field(block, "mime_type", "mimeType") or "application/octet-stream"
            size = _b64_size(getattr(block, "data", None))
            parts.append(f"[{kind}: {mime}, {size} bytes not kept]")
        elif kind == "resource":
            resource = getattr(block, "resource", None)
            uri = str(getattr(resource, "uri", ""))
            text = getattr(resource, "text", None)
            if isinstance(text, str):
                parts.append(text)
                texts += 1
            else:
                mime = _field(resource, "mime_type", "mimeType") or "application/octet-stream"
                size = _b64_size(getattr(resource, "blob", None))
                parts.append(f"[resource {uri}: {mime}, {size} bytes not kept]")
        elif kind == "resource_link":
            name = getattr(block, "name", "")
            parts.append(f"[resource link: {getattr(block, 'uri', '')} ({name})]")
        else:  # a block type of a later protocol version
            parts.append(f"[{kind} content not kept]")
    structured = _field(result, "structured_content", "structuredContent")
    if not texts and structured is not None:
        parts.insert(0, json.dumps(structured, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(parts)


class McpTool:
    """One MCP tool as a tool of the agent loop: ``await tool(**arguments)`` calls it on the
    session (``tools/call``) and returns its result text, or raises
    :class:`~fsm.agent.ToolError` with ``error: <text>`` when the server flags the result as
    an error (``isError``).

    Attributes: ``name`` (the MCP tool's name), ``definition`` (the MCP ``Tool``),
    ``idempotent`` (the ledger's re-run policy, from its annotations).
    """

    def __init__(
        self,
        session: Any,
        definition: Any,
        *,
        idempotent: bool,
        render: Callable[[Any], str],
    ) -> None:
        self.name: str = definition.name
        self.definition = definition
        self.idempotent = idempotent
        self._session = session
        self._render = render
        self.__name__ = self.name
        self.__doc__ = definition.description or None

    async def __call__(self, **arguments: Any) -> str:
        """Call the tool on the MCP server with ``arguments``."""
        result = await self._session.call_tool(self.name, arguments)
        text = self._render(result)
        if _field(result, "is_error", "isError"):
            raise ToolError(f"error: {text}" if text else f"error: the MCP tool {self.name} failed")
        return text

    def __repr__(self) -> str:
        return f"McpTool({self.name!r}, idempotent={self.idempotent})"


class McpTools(Mapping[str, Any]):
    """The tools of an MCP session, by the name the model calls them: a registry to give the
    agent loop as ``tools`` (each tool carries its request definition and re-run policy)."""

    def __init__(self, tools: Mapping[str, Any]) -> None:
        self._tools = dict(tools)

    def __getitem__(self, name: str) -> Any:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def definitions(self) -> list[ToolDefinition]:
        """The Chat Completions ``tools`` entries the loop sends (it converts them for the
        Responses and Anthropic APIs)."""
        from fsm.agent.tools import function_tool

        return [function_tool(t, name) for name, t in self._tools.items()]

    def __repr__(self) -> str:
        return f"McpTools({list(self._tools)!r})"


async def _list(session: Any) -> list[Any]:
    """Every tool of ``session`` (each page of ``tools/list``): an ``mcp.Client`` takes
    ``cursor=``, an ``mcp.ClientSession`` ``params=``."""
    import mcp

    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        if isinstance(session, mcp.Client):
            page = await session.list_tools(cursor=cursor)
        elif cursor is None:
            page = await session.list_tools()
        else:
            page = await session.list_tools(params=mcp.types.PaginatedRequestParams(cursor=cursor))
        tools.extend(page.tools)
        cursor = _field(page, "next_cursor", "nextCursor")
        if not cursor:
            return tools
    raise McpToolsError(f"tools/list gave more than {_MAX_PAGES} pages: a cursor that never ends")


async def mcp_tools(
    session: Any,
    *,
    prefix: str = "",
    only: Callable[[Any], bool] | None = None,
    trust_hints: bool = True,
    render: Callable[[Any], str] = result_text,
) -> McpTools:
    """The tools of an MCP session as the agent loop's tools.

    Args:
        session: an entered ``mcp.Client`` or ``mcp.ClientSession`` (initialized); it must
            stay open while the loop runs.
        prefix: put before each tool's name (``"files_"``): the name the model calls it by,
            to tell several servers' tools apart. The MCP call uses the server's name.
        only: keep a tool only when ``only(mcp_tool)`` is true (its ``name``,
            ``annotations``, ...).
        trust_hints: take the tools' ``readOnlyHint`` / ``idempotentHint`` annotations as the
            ledger's re-run policy (``False``: no tool is ever run twice).
        render: the result string of a ``CallToolResult`` (default :func:`result_text`).

    Raises :class:`McpToolsError` without ``mcp`` installed, for a name the APIs refuse
    (``^[A-Za-z0-9_-]{1,64}$``: give a ``prefix`` or filter it out with ``only``), or two
    tools of one name.
    """
    try:
        import mcp  # noqa: F401  (the session's package; checked here for its message)
    except ImportError as exc:
        raise McpToolsError(
            f"fsm.integrations.mcp needs the mcp package ({exc}): pip install 'fsm-toolcalls[mcp]'"
        ) from None
    tools: dict[str, Any] = {}
    for definition in await _list(session):
        if only is not None and not only(definition):
            continue
        name = prefix + definition.name
        if not _API_NAME.match(name):
            raise McpToolsError(
                f"the MCP tool {definition.name!r} would be called {name!r}, which the model "
                "APIs refuse (letters, digits, '_' and '-', at most 64): leave it out with "
                "only= or change prefix="
            )
        if name in tools:
            raise McpToolsError(f"two MCP tools are named {name!r}: leave one out with only=")
        annotations = getattr(definition, "annotations", None)
        hinted = bool(
            _field(annotations, "read_only_hint", "readOnlyHint")
            or _field(annotations, "idempotent_hint", "idempotentHint")
        )
        call = McpTool(session, definition, idempotent=trust_hints and hinted, render=render)
        function: FunctionDefinition = {
            "name": name,
            "parameters": _parameters(_field(definition, "input_schema", "inputSchema")),
        }
        if definition.description:
            function["description"] = definition.description
        tools[name] = tool(
            call,
            idempotent=call.idempotent,
            definition={"type": "function", "function": function},
        )
    return McpTools(tools)


def _parameters(schema: Any) -> dict[str, Any]:
    """The MCP input schema as the tool's ``parameters`` (an object schema; a missing one is
    the empty object)."""
    if not isinstance(schema, Mapping):
        return {"type": "object", "properties": {}}
    out = dict(schema)
    out.setdefault("type", "object")
    if out.get("type") == "object":
        out.setdefault("properties", {})
    return out
