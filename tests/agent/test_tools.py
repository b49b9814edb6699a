"""Tools described and validated by pydantic (fsm.agent.tools): the schema of each kind of
annotation, argument validation (lax, from the JSON text) before the tool runs, the error result
of a validation failure, and the same end to end through the agent loop (the official openai
clients against fsm.testing.ReplayServer, the store on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import openai
import pytest
from pydantic import BaseModel, Field, Strict

from fsm import StreamParser
from fsm.agent import ToolExecuted, arun_agent_loop, function_tool, run_agent_loop
from fsm.agent.tools import arun_tool, run_tool
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.testing import ReplayServer, demo_script
from fsm.toolcall import ToolCall
from tests.helpers.agent import CLIENTS, MODEL, USER, bounded


class Color(enum.Enum):
    """A primary colour."""

    RED = "red"
    BLUE = "blue"


class Point(BaseModel):
    """A point on the plane."""

    x: int
    y: int = 0


class Box(BaseModel):
    corner: Point
    label: str | None = None


@dataclass
class Size:
    width: float
    height: float


def parameters(function: Callable[..., Any]) -> dict[str, Any]:
    spec: dict[str, Any] = function_tool(function)["function"]["parameters"]
    return spec


def call(name: str, arguments: str) -> ToolCall:
    """A finished call of ``name`` with ``arguments``, as the parser hands it to the loop."""
    parser = StreamParser()
    function = {"name": name, "arguments": arguments}
    delta = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": function}]}
    parser.receive_chunk({"id": "r", "choices": [{"index": 0, "delta": delta}]})
    parser.receive_chunk(
        {"id": "r", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    )
    parser.receive_eof()
    (c,) = parser.turns[0].tool_calls
    assert c.state.value == "finished", (c.state, c.reason)
    return c


# -- the schema of each kind --------------------------------------------------------------------
def test_scalars_required_and_defaults() -> None:
    def f(s: str, i: int, x: float, b: bool, n: int = 10, label: str = "a") -> None:
        pass

    assert parameters(f) == {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "n": {"type": "integer", "default": 10},
            "label": {"type": "string", "default": "a"},
        },
        "required": ["s", "i", "x", "b"],
        "additionalProperties": False,
    }


def test_optional_both_spellings() -> None:
    def f(a: Optional[int], b: str | None = None) -> None:  # noqa: UP045
        pass

    props = parameters(f)["properties"]
    assert props["a"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert props["b"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert parameters(f)["required"] == ["a"]


def test_enum_and_literal() -> None:
    def f(color: Color, mode: Literal["fast", "slow"] = "fast", level: Literal[1, 2] = 1) -> None:
        pass

    spec = parameters(f)
    assert spec["properties"]["color"] == {"$ref": "#/$defs/Color"}
    assert spec["$defs"]["Color"] == {
        "description": "A primary colour.",
        "enum": ["red", "blue"],
        "type": "string",
    }
    assert spec["properties"]["mode"] == {
        "enum": ["fast", "slow"],
        "type": "string",
        "default": "fast",
    }
    assert spec["properties"]["level"] == {"enum": [1, 2], "type": "integer", "default": 1}


def test_lists_and_dicts() -> None:
    def f(ids: list[int], scores: dict[str, float], pairs: list[tuple[int, str]]) -> None:
        pass

    props = parameters(f)["properties"]
    assert props["ids"] == {"type": "array", "items": {"type": "integer"}}
    assert props["scores"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["pairs"]["items"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]


def test_nested_models_and_dataclasses() -> None:
    def f(box: Box, points: list[Point], size: Size | None = None) -> None:
        pass

    spec = parameters(f)
    assert spec["properties"]["box"] == {"$ref": "#/$defs/Box"}
    assert spec["properties"]["points"] == {"type": "array", "items": {"$ref": "#/$defs/Point"}}
    assert spec["$defs"]["Point"] == {
        "description": "A point on the plane.",
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}},
        "required": ["x"],
    }
    assert spec["$defs"]["Box"]["properties"]["corner"] == {"$ref": "#/$defs/Point"}
    assert spec["$defs"]["Size"]["required"] == ["width", "height"]
    assert "title" not in json.dumps(spec)  # pydantic's titles are dropped everywhere


def test_descriptions_from_field_and_docstring() -> None:
    def google(query: str, limit: Annotated[int, Field(ge=1, description="at most")] = 5) -> str:
        """Search the web.

        Longer text that is not part of the description.

        Args:
            query (str): what to look for,
                over two lines.
            limit: overridden by the Field's description.
        """
        return query

    def sphinx(city: str, days: int) -> str:
        """Forecast.

        :param city: the city's name
        :param int days: how many days
        """
        return city

    tool = function_tool(google)["function"]
    assert tool["description"] == "Search the web."
    assert tool["parameters"]["properties"] == {
        "query": {"type": "string", "description": "what to look for, over two lines."},
        "limit": {"type": "integer", "minimum": 1, "description": "at most", "default": 5},
    }
    assert parameters(sphinx)["properties"] == {
        "city": {"type": "string", "description": "the city's name"},
        "days": {"type": "integer", "description": "how many days"},
    }


def test_kwargs_positional_only_and_unusable_annotations() -> None:
    class Opaque:
        pass

    def f(
        a: int, /, b: Opaque, *args: int, c: Callable[[int], int] | None = None, **kw: Any
    ) -> None:
        pass

    spec = parameters(f)
    assert spec["properties"] == {"a": {"type": "integer"}, "b": {}, "c": {"default": None}}
    assert spec["required"] == ["a", "b"]
    assert spec["additionalProperties"] is True  # **kw: extra arguments are allowed
    assert function_tool(f, "renamed")["function"]["name"] == "renamed"


def test_no_signature_gets_an_empty_object() -> None:
    spec = function_tool(max)["function"]  # a builtin without an inspectable signature
    assert spec["parameters"] == {"type": "object", "properties": {}, "required": []}


# -- validation before the tool runs --------------------------------------------------------------
ran: list[Any] = []


def record(**values: Any) -> str:
    ran.append(values)
    return "ok"


def typed(
    a: int,
    color: Color,
    box: Box,
    ids: list[int],
    mode: Literal["fast", "slow"] = "fast",
    note: str | None = None,
) -> str:
    ran.append((a, color, box, ids, mode, note))
    return "ok"


def strict(a: Annotated[int, Strict()]) -> str:
    ran.append(a)
    return "ok"


@pytest.fixture(autouse=True)
def _clear() -> None:
    ran.clear()


def test_valid_arguments_are_coerced_and_passed_as_python_values() -> None:
    arguments = '{"a": "5", "color": "blue", "box": {"corner": {"x": 1}}, "ids": [1, "2", 3.0]}'
    assert run_tool({"typed": typed}, call("typed", arguments)) == ("ok", False)
    ((a, color, box, ids, mode, note),) = ran
    assert a == 5 and color is Color.BLUE and ids == [1, 2, 3]
    assert isinstance(box, Box) and box.corner == Point(x=1, y=0) and box.label is None
    assert (mode, note) == ("fast", None)  # defaults filled in


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ('{"color": "red", "box": {"corner": {"x": 1}}, "ids": []}', "a: Field required"),
        ('{"a": 5.5, "color": "red", "box": {"corner": {"x": 1}}, "ids": []}', "a: Input should"),
        ('{"a": 1, "color": "green", "box": {"corner": {"x": 1}}, "ids": []}', "color: Input"),
        ('{"a": 1, "color": "red", "box": {"corner": {}}, "ids": []}', "box.corner.x: Field"),
        ('{"a": 1, "color": "red", "box": {"corner": {"x": 1}}, "ids": ["x"]}', "ids.0: Input"),
        (
            '{"a": 1, "color": "red", "box": {"corner": {"x": 1}}, "ids": [], "mode": "medium"}',
            "mode: Input should be 'fast' or 'slow' (got \"medium\")",
        ),
        (
            '{"a": 1, "color": "red", "box": {"corner": {"x": 1}}, "ids": [], "extra": 1}',
            "extra: Extra inputs are not permitted",
        ),
        ("[1, 2]", "arguments: Input should be an object"),
    ],
)
def test_invalid_arguments_are_an_error_result_and_the_tool_never_runs(
    arguments: str, problem: str
) -> None:
    content, error = run_tool({"typed": typed}, call("typed", arguments))
    assert error is True and ran == []
    assert content.startswith("error: invalid arguments for typed: ")
    assert problem in content, content


def test_every_problem_is_named() -> None:
    content, error = run_tool({"typed": typed}, call("typed", '{"a": "x", "color": 1}'))
    assert error and ran == []
    assert content.count(";") == 3  # a, color, box, ids
    for name in ("a:", "color:", "box:", "ids:"):
        assert name in content


def test_strict_parameters_refuse_what_lax_ones_coerce() -> None:
    assert run_tool({"strict": strict}, call("strict", '{"a": 5}')) == ("ok", False)
    content, error = run_tool({"strict": strict}, call("strict", '{"a": "5"}'))
    assert error and "a: Input should be a valid integer" in content and ran == [5]


def test_kwargs_pass_extra_arguments_on_and_positional_only_ones_positionally() -> None:
    def mixed(a: int, /, b: int = 2, **rest: Any) -> str:
        ran.append((a, b, rest))
        return "ok"

    assert run_tool({"m": mixed}, call("m", '{"a": "1", "z": [1]}')) == ("ok", False)
    assert ran == [(1, 2, {"z": [1]})]
    assert run_tool({"r": record}, call("r", "")) == ("ok", False)  # blank arguments: {}
    assert ran[-1] == {}


def test_async_tools_are_validated_too() -> None:
    async def aadd(a: int, b: int) -> int:
        return a + b

    async def both() -> tuple[tuple[str, bool], tuple[str, bool]]:
        good = await arun_tool({"add": aadd}, call("add", '{"a": "1", "b": 2}'))
        bad = await arun_tool({"add": aadd}, call("add", '{"a": "one", "b": 2}'))
        return good, bad

    good, bad = asyncio.run(both())
    assert good == ("3", False)
    assert bad[1] is True and bad[0].startswith("error: invalid arguments for add: a: ")


def test_builtins_without_a_signature_run_unchecked() -> None:
    content, error = run_tool({"max": max}, call("max", "{}"))
    assert error and content.startswith("error: TypeError")  # ran, and failed itself


# -- end to end through the agent loop -------------------------------------------------------------
def add(a: float, b: float) -> float:
    """Add two numbers (floats: the stream's integers arrive validated as floats)."""
    return a + b


def multiply(a: int, b: Literal[1, 2]) -> int:
    """Multiply by one or two (the stream asks for 34: invalid, never run)."""
    raise AssertionError("a tool whose arguments failed validation must not run")


@pytest.mark.parametrize("kind", CLIENTS)
def test_validation_through_the_loop_is_committed_as_the_tool_result(
    kind: str, fsm_db_url: str, fsm_replay: Callable[..., ReplayServer]
) -> None:
    url = fsm_db_url
    tools = {"add": add, "multiply": multiply}
    expected = [
        "6912.0",
        "error: invalid arguments for multiply: b: Input should be 1 or 2 (got 34)",
    ]
    events: list[Any] = []
    server = fsm_replay(demo_script(expected))  # it checks what the loop sends back
    if kind == "openai":
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        with ConversationStore(url) as store:
            result = run_agent_loop(client, store, "c", tools, model=MODEL,
                                    messages=[USER], on_event=events.append)  # fmt: skip
            history = store.history("c")
        client.close()
    else:

        async def body() -> tuple[Any, list[dict[str, Any]]]:
            aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            async with AsyncConversationStore(url) as astore:
                done = await arun_agent_loop(aclient, astore, "c", tools, model=MODEL,
                                             messages=[USER], on_event=events.append)  # fmt: skip
                got = await astore.history("c")
            await aclient.close()
            return done, got

        result, history = asyncio.run(bounded(body()))
    assert server.failures == [] and result.status == "completed"
    assert [m["content"] for m in history[2:4]] == expected
    executed = [(e.name, e.error) for e in events if isinstance(e, ToolExecuted)]
    assert executed == [("add", False), ("multiply", True)]
    # what the model was told about its tools is the pydantic schema
    (request, _) = server.requests
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in request["tools"]}
    assert spec["multiply"]["properties"]["b"] == {"enum": [1, 2], "type": "integer"}
    assert spec["add"]["properties"]["a"] == {"type": "number"}
