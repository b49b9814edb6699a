"""The SSE front end every peer sits behind in real use: the ``openai`` SDK's ``Stream``.

openai-python, LangChain's ``ChatOpenAI``, pydantic-ai's ``OpenAIChatModel`` and openai-agents'
``OpenAIChatCompletionsModel`` all read a streamed Chat Completions response through
``openai.Stream`` (LiteLLM's OpenAI-compatible providers do too). It decodes the SSE events,
stops at ``data: [DONE]`` (so nothing after it is ever seen), and raises ``openai.APIError`` when
a ``data:`` payload carries an ``"error"`` key. Here it runs over an in-memory ``httpx2``
response with ``cast_to=object``, which hands over each payload as the plain dict the SDK would
otherwise turn into a ``ChatCompletionChunk``.
"""

from __future__ import annotations

import json
from typing import Any

from . import describe

__all__ = ["data_payloads", "sdk_decode"]

_client: Any = None


def _get_client() -> Any:
    global _client
    if _client is None:
        import openai

        _client = openai.OpenAI(api_key="sk-bench-offline", base_url="http://127.0.0.1:9/v1")
    return _client


def sdk_decode(sse: bytes) -> tuple[list[dict[str, Any]], str | None]:
    """The payloads ``openai.Stream`` yields for ``sse``, and the error it raised (if any)."""
    import httpx2
    import openai

    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    response = httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, content=sse, request=request
    )
    stream = openai.Stream(cast_to=object, response=response, client=_get_client())
    chunks: list[dict[str, Any]] = []
    try:
        for item in stream:
            chunks.append(item)
    except Exception as exc:
        return chunks, describe(exc)
    return chunks, None


def data_payloads(sse: bytes) -> list[dict[str, Any]]:
    """Every JSON ``data:`` payload before ``[DONE]`` without an ``"error"`` key: the chunks a
    successful read yields. Used to build the timing workloads (no SDK in the loop)."""
    out: list[dict[str, Any]] = []
    text = sse.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    for block in text.split("\n\n"):
        data = [
            line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")
        ]
        if not data:
            continue
        payload = "\n".join(data)
        if payload.startswith("[DONE]"):
            break
        obj = json.loads(payload)
        if isinstance(obj, dict) and not obj.get("error"):
            out.append(obj)
    return out
