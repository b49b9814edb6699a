"""Typed messages (issue 13): what fsm returns passes to the openai SDK under ``mypy --strict``.

A user module that hands ``store.history()``, ``turn.to_message()``, ``CommittedTurn.messages``
and ``function_tool()`` to ``client.chat.completions.create`` is type-checked by mypy (with the
openai SDK installed) and must pass; a module that misuses them must fail, at the lines that
misuse them. The TypedDicts of :mod:`fsm.types` are also compared key by key with the SDK's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import fsm.types as T
from fsm import parse
from fsm.agent import function_tool
from fsm.store import ConversationStore
from tests.helpers import mypy_cache
from tests.helpers.agent import DEMO, FINAL, USER

ROOT = Path(__file__).resolve().parents[1]

GOOD = '''
from __future__ import annotations

from openai import AsyncOpenAI, OpenAI

from fsm import parse
from fsm.agent import function_tool
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.types import AssistantMessage, Message, ToolDefinition


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def step(client: OpenAI, store: ConversationStore, data: bytes) -> str | None:
    history = store.history("c1", last=20)
    tools = [function_tool(add)]
    client.chat.completions.create(model="m", messages=history, tools=tools)
    turn = parse(data).turn(0)
    message: AssistantMessage = turn.to_message()
    typed: list[Message] = [*history, message]
    client.chat.completions.create(model="m", messages=typed, tools=tools)
    done = store.commit_turn("c1", turn, ["5"])
    client.chat.completions.create(model="m", messages=done.messages)
    client.chat.completions.create(
        model="m", messages=[*history, turn.to_message(include_reasoning=True)]
    )
    ids = [call["id"] for call in message.get("tool_calls", [])]
    entry = turn.tool_calls[0].to_dict()
    spec: ToolDefinition = function_tool(add, "plus")
    return ids[0] if ids else entry["function"]["name"] + spec["function"]["name"]


async def astep(client: AsyncOpenAI, store: AsyncConversationStore) -> None:
    history = await store.history("c1")
    await client.chat.completions.create(
        model="m", messages=history, tools=[function_tool(add)], stream=True
    )
'''

BAD = """
from __future__ import annotations

from openai import OpenAI

from fsm import parse
from fsm.agent import function_tool
from fsm.store import ConversationStore


def add(a: int, b: int) -> int:
    return a + b


def misuse(client: OpenAI, store: ConversationStore, data: bytes) -> None:
    turn = parse(data).turn(0)
    client.chat.completions.create(model="m", messages=turn.to_message())  # BAD: not a list
    client.chat.completions.create(
        model="m", messages=store.history("c1"), tools=function_tool(add)  # BAD: not a list
    )
    message = turn.to_message()
    print(message["tool_call_id"])  # BAD: no such key on an assistant message
    store.history("c1")[0]["role"] = "robot"  # BAD: not a role
    print(turn.tool_calls[0].to_dict()["function"]["argumentz"])  # BAD: misspelt key
"""


@pytest.mark.slow  # a mypy run
def test_a_user_module_passing_fsm_messages_to_the_sdk_passes_mypy_strict(
    tmp_path: Path,
) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("mypy")
    (tmp_path / "good_user.py").write_text(textwrap.dedent(GOOD))
    (tmp_path / "bad_user.py").write_text(textwrap.dedent(BAD))
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            *mypy_cache(),
            "--hide-error-context",
            "--no-color-output",
            "--show-error-codes",
            "good_user.py",
            "bad_user.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if not e.startswith("bad_user.py:")], out.stdout
    bad_lines = {
        i for i, line in enumerate(textwrap.dedent(BAD).splitlines(), start=1) if "# BAD" in line
    }
    flagged = {int(m.group(1)) for e in errors if (m := re.match(r"bad_user\.py:(\d+):", e))}
    assert flagged == bad_lines, out.stdout
    assert out.returncode == 1


def _keys(typed_dict: Any) -> tuple[frozenset[str], frozenset[str]]:
    return frozenset(typed_dict.__required_keys__), frozenset(typed_dict.__optional_keys__)


@pytest.mark.parametrize(
    ("ours", "sdk"),
    [
        (T.SystemMessage, "chat_completion_system_message_param.ChatCompletionSystemMessageParam"),
        (
            T.DeveloperMessage,
            "chat_completion_developer_message_param.ChatCompletionDeveloperMessageParam",
        ),
        (T.UserMessage, "chat_completion_user_message_param.ChatCompletionUserMessageParam"),
        (T.ToolMessage, "chat_completion_tool_message_param.ChatCompletionToolMessageParam"),
        (T.ContentPartText, "chat_completion_content_part_text_param.ChatCompletionContentPartTextParam"),
        (T.ContentPartImage, "chat_completion_content_part_image_param.ChatCompletionContentPartImageParam"),
        (T.ImageURL, "chat_completion_content_part_image_param.ImageURL"),
        (T.FunctionToolCall, "chat_completion_message_function_tool_call_param.ChatCompletionMessageFunctionToolCallParam"),
        (T.ToolDefinition, "chat_completion_function_tool_param.ChatCompletionFunctionToolParam"),
    ],
)  # fmt: skip
def test_typed_dicts_have_the_sdks_keys(ours: Any, sdk: str) -> None:
    pytest.importorskip("openai")
    import importlib

    module, name = sdk.rsplit(".", 1)
    theirs = getattr(importlib.import_module(f"openai.types.chat.{module}"), name)
    assert _keys(ours) == _keys(theirs)


def test_the_assistant_message_has_the_sdks_keys_and_reasoning_content() -> None:
    pytest.importorskip("openai")
    from openai.types.chat import ChatCompletionAssistantMessageParam as Theirs

    required, optional = _keys(T.AssistantMessage)
    assert required == frozenset(Theirs.__required_keys__)
    assert optional == frozenset(Theirs.__optional_keys__) | {"reasoning_content"}


def test_returned_values_validate_against_fsms_and_the_sdks_types(tmp_path: Path) -> None:
    """At run time too: what fsm returns is what its types say (pydantic validates TypedDicts)."""
    pydantic = pytest.importorskip("pydantic")
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with ConversationStore(f"sqlite:///{tmp_path / 't.db'}", auto_upgrade=True) as store:
        cid = store.create_conversation()
        store.append(cid, [USER])
        store.commit_turn(cid, parse(DEMO.read_bytes()).turn(0), ["6912", "408"])
        store.commit_turn(cid, parse(FINAL.read_bytes()).turn(0))
        history = store.history(cid)
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
    for adapter in (
        pydantic.TypeAdapter(list[T.Message]),
        pydantic.TypeAdapter(list[ChatCompletionMessageParam]),
    ):
        # Iterable fields validate lazily: drain them (default=list) to see every value checked
        assert _drained(adapter.validate_python(history)) == history
    tool = function_tool(add)
    for tool_adapter in (
        pydantic.TypeAdapter(T.ToolDefinition),
        pydantic.TypeAdapter(ChatCompletionToolParam),
    ):
        assert _drained(tool_adapter.validate_python(tool)) == tool


def _drained(value: Any) -> Any:
    return json.loads(json.dumps(value, default=list))
