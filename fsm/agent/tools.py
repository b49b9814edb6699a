"""The tools of the agent loop: the request's ``tools`` entry of a Python function, and running
one call (the same rules sync and async; only the await differs)."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Mapping
from typing import Any

from fsm.telemetry import tool_span
from fsm.toolcall import ToolCall
from fsm.types import FunctionDefinition, ToolDefinition

__all__ = ["Tool", "arun_tool", "function_tool", "run_tool"]

#: A tool: called with the call's JSON arguments as keyword arguments; a ``str`` result is sent
#: as it is, anything else as JSON. In :func:`~fsm.agent.arun_agent_loop` it may also be a
#: coroutine function.
Tool = Callable[..., Any]

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def function_tool(function: Tool, name: str | None = None) -> ToolDefinition:
    """The Chat Completions ``tools`` entry of a Python function.

    Parameters become the JSON schema's properties (``str``, ``int``, ``float``, ``bool``,
    ``list`` and ``dict`` annotations map to their JSON types; others accept anything), those
    without a default are required; the docstring's first paragraph is the description.
    """
    tool_name = str(name or getattr(function, "__name__", "tool"))
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # unresolvable annotations: accept anything
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        hint = hints.get(parameter.name)
        kind = _JSON_TYPES.get(typing.get_origin(hint) or hint)
        properties[parameter.name] = {"type": kind} if kind else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    spec: FunctionDefinition = {
        "name": tool_name,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }
    doc = inspect.getdoc(function)
    if doc:
        spec["description"] = doc.split("\n\n", 1)[0].replace("\n", " ")
    return {"type": "function", "function": spec}


@tool_span
def run_tool(tools: Mapping[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """Run ``call`` with its tool: the result to send back, and whether it is an error result
    (an unknown tool, arguments that are not a JSON object, an exception)."""
    run = _bind(tools, call)
    if isinstance(run, str):
        return run, True
    try:
        value = run()
    except Exception as exc:
        return _tool_error(exc), True
    return _as_content(value), False


@tool_span
async def arun_tool(tools: Mapping[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """:func:`run_tool`, awaiting what the tool returns when it is awaitable."""
    run = _bind(tools, call)
    if isinstance(run, str):
        return run, True
    try:
        value = run()
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        return _tool_error(exc), True
    return _as_content(value), False


def _bind(tools: Mapping[str, Tool], call: ToolCall) -> Callable[[], Any] | str:
    """The call's tool with its arguments bound, or the error result when it cannot run."""
    function = tools.get(call.name)
    if function is None:
        return _unknown(tools, call)
    arguments = _arguments(call)
    if isinstance(arguments, str):
        return arguments
    return lambda: function(**arguments)


def _arguments(call: ToolCall) -> dict[str, Any] | str:
    """The call's arguments as keyword arguments, or an error result."""
    text = call.arguments
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:  # cannot happen for a finished call, unless repaired oddly
        return f"error: the arguments are not valid JSON ({exc})"
    if not isinstance(value, dict):
        return f"error: the arguments must be a JSON object, not {type(value).__name__}"
    return value


def _unknown(tools: Mapping[str, Tool], call: ToolCall) -> str:
    return f"error: there is no tool {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})"


def _tool_error(exc: Exception) -> str:
    return f"error: {type(exc).__name__}: {exc}" if str(exc) else f"error: {type(exc).__name__}"


def _as_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)
