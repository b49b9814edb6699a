"""openai-agents: ``agents.models.chatcmpl_stream_handler.ChatCmplStreamHandler.handle_stream``."""

from __future__ import annotations

import logging
from typing import Any

from . import Call, Outcome, describe
from ._util import args_object, run_async, sdk_chunks

LABEL = "openai-agents (ChatCmplStreamHandler)"
DISTS = ("openai-agents",)
#: what prepare() builds; adapters of the same kind can share prepared chunks
KIND = "openai"
HOW = (
    "`ChatCmplStreamHandler.handle_stream(response, stream, raise_on_length_truncation=True, "
    "require_finish_reason=False)` over an async iterator of `ChatCompletionChunk`s built as "
    "`openai.Stream` builds them (before timing), with the initial `Response` that "
    "`OpenAIChatCompletionsModel` makes; the calls are the `function_call` items of the "
    "`response.completed` event. These are the arguments `OpenAIChatCompletionsModel` passes "
    "for an OpenAI-compatible endpoint (it sets `require_finish_reason=True` only for "
    "api.openai.com); tool-call buffering is off, its default. Only choice 0 is read."
)
USABLE = (
    "the call is a `function_call` item of the completed response with a non-empty name and "
    "arguments the runner accepts before invoking a function tool (`json.loads(input) if input "
    "else {}` gives an object; otherwise `ModelBehaviorError`)."
)

_handle: Any = None
_Response: Any = None
_FAKE_ID: str = ""


def setup() -> None:
    global _handle, _Response, _FAKE_ID
    from agents.models.chatcmpl_stream_handler import ChatCmplStreamHandler
    from agents.models.fake_id import FAKE_RESPONSES_ID
    from openai.types.responses import Response

    logging.getLogger("openai.agents").setLevel(logging.CRITICAL)
    _handle = ChatCmplStreamHandler.handle_stream
    _Response, _FAKE_ID = Response, FAKE_RESPONSES_ID


async def _drive(chunks: list[Any]) -> Any:
    async def stream() -> Any:
        for chunk in chunks:
            yield chunk

    response = _Response(
        id=_FAKE_ID,
        created_at=0,
        model="gpt-4o",
        object="response",
        output=[],
        tool_choice="auto",
        top_p=None,
        temperature=None,
        tools=[],
        parallel_tool_calls=False,
        reasoning=None,
    )
    final = None
    async for event in _handle(
        response,
        stream(),
        model="gpt-4o",
        raise_on_length_truncation=True,
        require_finish_reason=False,
    ):
        if event.type == "response.completed":
            final = event.response
    return final


def prepare(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks)


def prepare_fast(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks, fast=True)


def consume(chunks: list[Any]) -> Outcome:
    try:
        final = run_async(_drive(chunks))
    except Exception as exc:
        return Outcome(raised=describe(exc))
    if final is None:
        return Outcome()
    calls = []
    for item in final.output:
        if getattr(item, "type", None) != "function_call":
            continue
        usable = bool(item.name) and args_object(item.arguments)
        calls.append(
            Call(
                id=item.call_id,
                name=item.name,
                arguments=item.arguments,
                usable=usable,
                note="" if usable else "runner would not invoke it (name/arguments invalid)",
            )
        )
    return Outcome(choices={0: calls})
