"""A user's own file, typed against fsm's public API: ``mypy --strict`` must accept it where fsm
is installed. ``.ci/run`` checks it against the wheel installed in a new venv outside the
checkout, and ``tests/test_packaging.py`` against the editable install (the README's)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsm
from fsm import Limits, ParseResult, StreamParser, ToolCall, ToolCallState, Turn, parse
from fsm.agent import AgentResult, TurnFailedError, run_agent_loop, tool
from fsm.store import ConversationStore

VERSION: str = fsm.__version__


def finished_calls(stream: bytes) -> list[tuple[str, str]]:
    """The name and the arguments of each finished tool call of a recorded stream."""
    result: ParseResult = parse(stream, limits=Limits())
    turn: Turn = result.turn()
    calls: list[ToolCall] = turn.tool_calls
    return [(c.name, c.arguments) for c in calls if c.state is ToolCallState.FINISHED]


def live_parser() -> StreamParser:
    return StreamParser()


def add(a: int, b: int) -> int:
    return a + b


def answer(client: Any, database: Path, question: str) -> str | None:
    """One conversation with the agent loop, committed to a SQLite store."""
    tools: Mapping[str, Any] = {"add": tool(add)}
    with ConversationStore(f"sqlite:///{database}", auto_upgrade=True) as store:
        conversation: str = store.create_conversation()
        try:
            result: AgentResult = run_agent_loop(
                client,
                store,
                conversation,
                tools,
                model="demo-model-1",
                messages=[{"role": "user", "content": question}],
            )
        except TurnFailedError:
            return None
        history: list[Any] = list(store.history(conversation))
        return f"{result.status}: {len(history)} messages"
