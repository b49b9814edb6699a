"""openai-python: ``openai.lib.streaming.chat.ChatCompletionStreamState``."""

from __future__ import annotations

from typing import Any

from . import Call, Outcome, describe
from ._util import sdk_chunks

LABEL = "openai-python"
DISTS = ("openai",)
#: what prepare() builds; adapters of the same kind can share prepared chunks
KIND = "openai"
HOW = (
    "`ChatCompletionStreamState()` (no `input_tools`, as in its docstring) is handed the "
    "`ChatCompletionChunk`s `openai.Stream` builds (`construct_type(type_=ChatCompletionChunk, "
    "value=chunk)`, no validation; built before timing), one `handle_chunk(chunk)` each, then "
    "`get_final_completion()`."
)
USABLE = (
    "`get_final_completion()` returns without raising and the call is in "
    "`choices[i].message.tool_calls`. `get_final_completion()` raises "
    "`LengthFinishReasonError` / `ContentFilterFinishReasonError` when a choice ended with "
    "`length` / `content_filter` (`handle_chunk` raises them too, earlier, when given strict "
    "`input_tools` or a `response_format` class); nothing else is checked: no JSON validation, "
    "and a stream that just stops is returned as it is."
)

_State: Any = None


def setup() -> None:
    global _State
    from openai.lib.streaming.chat import ChatCompletionStreamState

    _State = ChatCompletionStreamState


def prepare(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks)


def prepare_fast(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks, fast=True)


def consume(chunks: list[Any]) -> Outcome:
    state = _State()
    try:
        for chunk in chunks:
            state.handle_chunk(chunk)
        completion = state.get_final_completion()
    except Exception as exc:
        return Outcome(raised=describe(exc))
    out = Outcome()
    for choice in completion.choices:
        calls = []
        for tc in choice.message.tool_calls or []:
            fn = getattr(tc, "function", None)
            calls.append(
                Call(
                    id=getattr(tc, "id", None),
                    name=getattr(fn, "name", None),
                    arguments=getattr(fn, "arguments", None),
                    usable=True,
                )
            )
        out.choices[choice.index] = calls
    return out


def available() -> bool:
    """Whether setup() ran (the SDK is importable)."""
    return _State is not None
