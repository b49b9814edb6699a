"""The tools of the agent loop: the request's ``tools`` entry of a Python function, and running
one call (the same rules sync and async; only the await differs).

Tools are described and checked with pydantic, from the function's signature:

* **The schema** (:func:`function_tool`): each parameter becomes a property with the JSON schema
  pydantic gives its annotation (``str``, ``int``, ``float``, ``bool``, ``list[int]``,
  ``dict[str, float]``, ``Optional[X]`` / ``X | None``, ``Literal[...]``, an ``Enum``, a
  ``BaseModel`` or dataclass (under ``$defs``), ``Annotated[X, Field(...)]`` with its
  constraints); a parameter without a default is required, a default is stated as ``default``.
  The docstring's first paragraph is the tool's description; a parameter's description comes
  from ``Annotated[X, Field(description=...)]`` or else from the docstring (Google style
  ``Args:`` entries, or Sphinx ``:param name:``). Schemas carry no ``title``.
* **The arguments** are validated against the same model before the tool runs, in pydantic's
  **lax** mode, from the JSON text (:meth:`pydantic.BaseModel.model_validate_json`): the
  coercions a model's JSON can need (``"5"`` for an ``int``, ``5.0`` for an ``int``, ``"true"``
  for a ``bool``, a JSON object for a ``BaseModel``, a string for an ``Enum`` member's value)
  are applied, nothing lossy is (``5.5`` is not an ``int``, ``"abc"`` is not a number). A
  parameter can be strict on its own (``Annotated[int, Strict()]``, ``StrictInt``). The tool
  is called with the validated values (a ``BaseModel`` instance, an ``Enum`` member, defaults
  filled in). Unknown arguments are refused unless the function takes ``**kwargs`` (they are
  then passed on as they are).
* **A validation failure never runs the tool**: the call's result is an error result naming
  each bad argument (``error: invalid arguments for add: b: Input should be a valid integer
  ...``), sent back to the model and committed with the turn like any result.

An annotation pydantic cannot describe or validate (an arbitrary class), or an unresolvable
one, accepts anything (``{}`` in the schema, the value passed on unchecked). A callable without
an inspectable signature gets an empty object schema and its arguments unchecked.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import typing
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsm.agent.errors import ToolError
from fsm.telemetry import tool_span
from fsm.toolcall import ToolCall
from fsm.types import FunctionDefinition, ToolDefinition

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["Tool", "arun_tool", "function_tool", "is_idempotent", "run_tool", "tool"]

#: A tool: called with the call's JSON arguments (validated against its signature) as keyword
#: arguments; a ``str`` result is sent as it is, anything else as JSON. In
#: :func:`~fsm.agent.arun_agent_loop` it may also be a coroutine function.
Tool = Callable[..., Any]

#: the attribute :func:`tool` sets on a tool to declare its policy.
_IDEMPOTENT = "__fsm_idempotent__"
#: the attribute :func:`tool` sets on a tool to declare its request definition.
_DEFINITION = "__fsm_definition__"


def tool(
    function: Tool, *, idempotent: bool = False, definition: ToolDefinition | None = None
) -> Tool:
    """Declare ``function``'s policy for the tool ledger: ``idempotent=True`` says running it
    twice for the same call does no harm (a read, an upsert keyed by the call id), so after a
    crash while it ran the agent loop may run it again; the default (``False``, as for a plain
    callable) means it is never run twice: its unknown outcome is raised as
    :class:`~fsm.agent.UnknownOutcomeError` for the caller to resolve.

    Returns the function itself, marked (a callable that takes no attribute, such as a bound
    method, is wrapped in a :func:`functools.partial`), so the registry stays a plain mapping:
    ``tools = {"pay": tool(pay), "lookup": tool(lookup, idempotent=True)}``.

    ``definition`` declares the tool's request definition (a Chat Completions ``tools`` entry,
    ``{"type": "function", "function": {"name", "description", "parameters"}}``) instead of
    the one derived from its signature: for a tool described elsewhere (an MCP server's input
    schema, :mod:`fsm.integrations.mcp`), typically a ``**arguments`` function whose
    arguments the other side validates. The loop sends it in each API's shape under the
    tool's registry name.
    """
    if not callable(function):
        raise TypeError(f"tool() takes a callable, not {type(function).__name__}")
    if not isinstance(idempotent, bool):
        raise TypeError(f"idempotent must be True or False, not {idempotent!r}")
    if definition is not None and not (
        isinstance(definition, Mapping)
        and definition.get("type") == "function"
        and isinstance(definition.get("function"), Mapping)
        and isinstance(definition["function"].get("name"), str)
    ):
        raise TypeError(
            "definition must be a Chat Completions tools entry "
            "({'type': 'function', 'function': {'name': ..., 'parameters': ...}}), "
            f"not {definition!r}"
        )
    try:
        setattr(function, _IDEMPOTENT, idempotent)
    except (AttributeError, TypeError):
        import functools

        function = functools.partial(function)
        setattr(function, _IDEMPOTENT, idempotent)
    if definition is not None:
        setattr(function, _DEFINITION, definition)
    return function


def is_idempotent(function: Tool | None) -> bool:
    """Whether ``function`` was declared idempotent with :func:`tool` (``False`` for a plain
    callable and for no tool at all)."""
    return getattr(function, _IDEMPOTENT, False) is True


def function_tool(function: Tool, name: str | None = None) -> ToolDefinition:
    """The Chat Completions ``tools`` entry of a Python function.

    The parameters' JSON schema comes from pydantic (see the module's documentation: Optional,
    Enum, Literal, nested models, lists, defaults, descriptions from ``Field`` or the
    docstring); those without a default are required; the docstring's first paragraph is the
    description. The arguments of a call are validated against the same schema before the tool
    runs (:func:`run_tool`). A definition declared with :func:`tool` is returned instead
    (named ``name`` when given).
    """
    declared = getattr(function, _DEFINITION, None)
    if isinstance(declared, Mapping):
        spec_: FunctionDefinition = dict(declared["function"])  # type: ignore[assignment]
        if name:
            spec_["name"] = str(name)
        return {"type": "function", "function": spec_}
    tool_name = str(name or getattr(function, "__name__", "tool"))
    signature = _signature(function)
    spec: FunctionDefinition = {
        "name": tool_name,
        "parameters": (
            signature.schema
            if signature is not None
            else {"type": "object", "properties": {}, "required": []}
        ),
    }
    doc = inspect.getdoc(function)
    if doc:
        spec["description"] = doc.split("\n\n", 1)[0].replace("\n", " ")
    return {"type": "function", "function": spec}


@dataclass(frozen=True, slots=True)
class _Signature:
    """A function's parameters as a pydantic model: the JSON schema, and how to call it."""

    model: type[BaseModel]
    #: (field name, parameter name, positional only) in signature order
    fields: tuple[tuple[str, str, bool], ...]
    #: the function takes ``**kwargs``: extra arguments are allowed and passed on
    var_keyword: bool
    schema: dict[str, Any]


_SIGNATURES: weakref.WeakKeyDictionary[Any, _Signature | None] = weakref.WeakKeyDictionary()


def _signature(function: Tool) -> _Signature | None:
    """The model of ``function``'s parameters (built once per function), or ``None`` when it
    has no inspectable signature."""
    try:
        return _SIGNATURES[function]
    except (KeyError, TypeError):  # not cached yet, or not weak-referenceable
        pass
    built = _build_signature(function)
    with contextlib.suppress(TypeError):
        _SIGNATURES[function] = built
    return built


def _build_signature(function: Tool) -> _Signature | None:
    import pydantic  # lazily: ``import fsm.agent`` stays light

    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    hints = _hints(function)
    described = _docstring_params(inspect.getdoc(function) or "")
    definitions: dict[str, Any] = {}
    fields: list[tuple[str, str, bool]] = []
    var_keyword = False
    for i, parameter in enumerate(parameters):
        if parameter.kind is parameter.VAR_KEYWORD:
            var_keyword = True
            continue
        if parameter.kind is parameter.VAR_POSITIONAL:
            continue
        annotation = _usable(hints.get(parameter.name, Any))
        info: dict[str, Any] = {"alias": parameter.name}
        if parameter.name in described and not _has_description(annotation):
            info["description"] = described[parameter.name]
        if parameter.default is not parameter.empty:
            info["default"] = parameter.default
        field = f"p{i}"
        definitions[field] = (annotation, pydantic.Field(**info))
        fields.append((field, parameter.name, parameter.kind is parameter.POSITIONAL_ONLY))
    config = pydantic.ConfigDict(
        extra="allow" if var_keyword else "forbid",
        populate_by_name=False,
        arbitrary_types_allowed=False,
    )
    model_name = re.sub(r"\W", "_", getattr(function, "__name__", "tool")) or "tool"
    model = pydantic.create_model(model_name, __config__=config, **definitions)
    schema = _untitled(model.model_json_schema())
    schema.setdefault("properties", {})
    schema["required"] = schema.get("required", [])
    if not var_keyword:
        schema["additionalProperties"] = False
    ordered = {"type": "object", "properties": schema.pop("properties"),
               "required": schema.pop("required")}  # fmt: skip
    schema.pop("type", None)
    ordered.update(schema)  # $defs, additionalProperties, a model description
    return _Signature(model, tuple(fields), var_keyword, ordered)


def _hints(function: Tool) -> dict[str, Any]:
    """The parameters' annotations, resolved; when some cannot be (a name that is not a global
    of the function's module, under ``from __future__ import annotations``), each one that can,
    the others ``Any``."""
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:
        pass
    resolved: dict[str, Any] = {}
    namespace = getattr(function, "__globals__", {})
    for name, annotation in getattr(function, "__annotations__", {}).items():
        if not isinstance(annotation, str):
            resolved[name] = annotation
            continue
        try:
            resolved[name] = eval(annotation, dict(namespace))  # what get_type_hints does
        except Exception:
            resolved[name] = Any
    return resolved


def _has_description(annotation: Any) -> bool:
    """Whether ``Annotated[X, Field(description=...)]`` describes the parameter already."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return False
    return any(getattr(m, "description", None) for m in annotation.__metadata__)


def _usable(annotation: Any) -> Any:
    """``annotation`` if pydantic can both validate it and describe it in JSON schema, else
    ``Any`` (an arbitrary class, a callable type)."""
    import pydantic

    if annotation is Any:
        return Any
    try:
        pydantic.TypeAdapter(annotation).json_schema()
    except Exception:
        return Any
    return annotation


_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "patternProperties")
_SCHEMA_ONE = ("items", "additionalProperties", "not")


def _untitled(schema: Any) -> Any:
    """``schema`` without its ``title`` entries (pydantic derives them from the Python names;
    they only cost tokens), walking only schema positions (so a property or a default
    named ``title`` stays)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _untitled(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_untitled(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _untitled(out[key])
    return out


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def _docstring_params(doc: str) -> dict[str, str]:
    """Parameter descriptions of a docstring: Google style (``Args:`` then ``name (type):
    text`` entries, continuation lines indented deeper) or Sphinx (``:param name: text``)."""
    found: dict[str, str] = {}
    lines = doc.splitlines()
    current: str | None = None
    indent: int | None = None
    in_section = False
    for line in lines:
        stripped = line.strip()
        sphinx = _SPHINX.match(stripped)
        if sphinx:
            current, in_section = sphinx.group(1), False
            found[current] = sphinx.group(2).strip()
            continue
        if _SECTION.match(stripped):
            in_section, current, indent = True, None, None
            continue
        if not in_section:
            if current is not None and stripped and not stripped.startswith(":"):
                found[current] = f"{found[current]} {stripped}".strip()  # a Sphinx continuation
            elif not stripped or stripped.startswith(":"):
                current = None
            continue
        if not stripped:
            current = None
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:  # the section ended (a new one, or prose)
            in_section, current = False, None
            continue
        entry = _ENTRY.match(stripped)
        if width == indent and entry:
            current = entry.group(1).lstrip("*")
            found[current] = entry.group(2).strip()
        elif current is not None:
            found[current] = f"{found[current]} {stripped}".strip()
    return {k: v for k, v in found.items() if v}


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
    if inspect.isawaitable(value):  # a coroutine function: the sync loop cannot await it
        close = getattr(value, "close", None)
        if callable(close):
            close()  # no "never awaited" warning
        return (
            f"error: the tool {call.name!r} is a coroutine function; run it with "
            "arun_agent_loop (the sync loop does not await tools)"
        ), True
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


def refusal(tools: Mapping[str, Tool], call: ToolCall) -> str | None:
    """The error result of a call that no tool of ``tools`` may run, or ``None``: a name that
    is not registered (some servers report tools they ran themselves as calls), or a Responses
    ``custom_tool_call`` (free-text input, never given to a function). Such a call is
    reported (:attr:`~fsm.agent.ToolExecuted.refused`), never executed."""
    if getattr(call, "custom", False):
        return (
            f"error: {call.name!r} is a custom tool call (free-text input); the agent loop runs "
            "only the function tools it was given, so it was not run"
        )
    if call.name not in tools:
        return _unknown(tools, call)
    return None


def tool_spec(spec: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """A Chat Completions ``tools`` entry (``{"type": "function", "function": {...}}``) as
    the API ``fmt`` takes it: unchanged for ``chat``; ``{"type": "function", "name",
    "description", "parameters"}`` for ``responses``; ``{"name", "description",
    "input_schema"}`` for ``anthropic``. An entry that is not a Chat function tool is kept as
    it is (already in the target's shape)."""
    function = spec.get("function") if spec.get("type") == "function" else None
    if fmt == "chat" or not isinstance(function, Mapping):
        return dict(spec)
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    out: dict[str, Any] = {"name": function["name"]}
    if function.get("description"):
        out["description"] = function["description"]
    if fmt == "responses":
        return {"type": "function", **out, "parameters": parameters, "strict": False}
    return {**out, "input_schema": parameters}


def _bind(tools: Mapping[str, Tool], call: ToolCall) -> Callable[[], Any] | str:
    """The call's tool with its validated arguments bound, or the error result when it cannot
    run (an unknown tool, a custom call, arguments that are not a JSON object or fail
    validation)."""
    refused = refusal(tools, call)
    if refused is not None:
        return refused
    function = tools[call.name]
    signature = _signature(function)
    if signature is None:  # nothing to validate against: the JSON object as it is
        arguments = _arguments(call)
        if isinstance(arguments, str):
            return arguments
        return lambda: function(**arguments)
    import pydantic

    text = call.arguments if call.arguments.strip() else "{}"
    try:
        values = signature.model.model_validate_json(text)
    except pydantic.ValidationError as exc:
        return _invalid(call.name, exc)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for field, parameter, positional in signature.fields:
        value = getattr(values, field)
        if positional:
            args.append(value)
        else:
            kwargs[parameter] = value
    if signature.var_keyword and values.model_extra:
        kwargs.update(values.model_extra)
    return lambda: function(*args, **kwargs)


def _invalid(name: str, exc: Any) -> str:
    """The error result of arguments that failed validation: each error's location and
    message, the way the model can fix its next call."""
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "arguments"
        problem = f"{where}: {error['msg']}"
        if error["type"] not in ("missing", "extra_forbidden") and error["loc"]:
            problem += f" (got {json.dumps(error['input'], ensure_ascii=False, default=str)})"
        problems.append(problem)
    return f"error: invalid arguments for {name}: " + "; ".join(problems)


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
    if isinstance(exc, ToolError):
        return str(exc)
    return f"error: {type(exc).__name__}: {exc}" if str(exc) else f"error: {type(exc).__name__}"


def _as_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)
