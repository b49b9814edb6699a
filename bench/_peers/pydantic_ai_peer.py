"""pydantic-ai: ``OpenAIChatModel``'s stream handling, which feeds ``ModelResponsePartsManager``."""

from __future__ import annotations

from typing import Any

from . import Call, Outcome, describe
from ._util import args_object, run_async, sdk_chunks

LABEL = "pydantic-ai (OpenAIChatModel)"
DISTS = ("pydantic-ai-slim",)
#: what prepare() builds; adapters of the same kind can share prepared chunks
KIND = "openai"
HOW = (
    "the `ChatCompletionChunk`s (built as `openai.Stream` builds them, before timing) go "
    "through "
    "`OpenAIChatModel._process_streamed_response` and the resulting `OpenAIStreamedResponse` "
    "is iterated to the end, then `.get()`: this is the code path of a real run, and it calls "
    "`ModelResponsePartsManager.handle_tool_call_delta(vendor_part_id=delta.index, "
    "tool_name=..., args=..., tool_call_id=delta.id)` for every tool-call delta of "
    "`choices[0]` (other choices are ignored). Offline: an `OpenAIProvider` that is never "
    "called."
)
USABLE = (
    "the call is a `ToolCallPart` of the final `ModelResponse` with a non-empty `tool_name` and "
    "arguments an agent run would execute: `args_as_dict(raise_if_invalid=True)` succeeds (a "
    "JSON object, or empty). Invalid JSON makes the agent ask the model to retry instead. "
    "A missing id is replaced by a generated `pyd_ai_...` id."
)

_model: Any = None
_params: Any = None
_ToolCallPart: Any = None


def setup() -> None:
    global _model, _params, _ToolCallPart
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(api_key="sk-bench-offline", base_url="http://127.0.0.1:9/v1")
    _model = OpenAIChatModel("gpt-4o", provider=provider)
    _params = ModelRequestParameters()
    _ToolCallPart = ToolCallPart


class _Source:
    """The minimum of ``openai.AsyncStream`` that pydantic-ai touches: async iteration, close()."""

    def __init__(self, chunks: list[Any]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> Any:
        for chunk in self._chunks:
            yield chunk

    async def close(self) -> None:
        return None


async def _drive(chunks: list[Any]) -> Any:
    streamed = await _model._process_streamed_response(_Source(chunks), _params)
    async for _event in streamed:
        pass
    return streamed.get()


def prepare(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks)


def prepare_fast(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks, fast=True)


def consume(chunks: list[Any]) -> Outcome:
    try:
        response = run_async(_drive(chunks))
    except Exception as exc:
        return Outcome(raised=describe(exc))
    calls = []
    for part in response.parts:
        if not isinstance(part, _ToolCallPart):
            continue
        args = part.args
        usable = bool(part.tool_name) and args_object(args)
        calls.append(
            Call(
                id=part.tool_call_id,
                name=part.tool_name,
                arguments=args if isinstance(args, str) or args is None else repr(args),
                usable=usable,
                note="" if usable else "agent would not run it (name/arguments invalid)",
            )
        )
    return Outcome(choices={0: calls})
