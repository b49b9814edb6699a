"""Pydantic v2 models of the Chat Completions chunk format, as providers really send it.

Unknown fields are ignored and ``null`` is accepted wherever some provider sends it. The parser's
hot path does not validate through these models (it checks the few fields it reads by hand, for
speed); they are the documented shape, a way to build valid chunks (tests, the demo server), and
an input :meth:`fsm.StreamParser.receive_chunk` accepts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionChunk",
    "ChoiceDelta",
    "ChunkChoice",
    "FunctionDelta",
    "ToolCallDelta",
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class FunctionDelta(_Wire):
    """``function`` of a tool-call delta: a name (maybe in parts) and an arguments fragment."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Wire):
    """One ``delta.tool_calls[]`` entry. Every field may be missing or null."""

    index: int | None = Field(default=None, ge=0)
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChoiceDelta(_Wire):
    """``choices[].delta``."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Wire):
    """One ``choices[]`` entry; ``delta`` may be absent (Azure)."""

    index: int = Field(default=0, ge=0)
    delta: ChoiceDelta | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Wire):
    """One ``chat.completion.chunk`` object."""

    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    choices: list[ChunkChoice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None
