"""LangChain: ``AIMessageChunk`` summed with ``+``, fed the way ``ChatOpenAI`` converts chunks."""

from __future__ import annotations

import json
from typing import Any

from . import Call, Outcome, describe
from ._util import sdk_chunks

LABEL = "LangChain (ChatOpenAI chunks)"
DISTS = ("langchain-core", "langchain-openai")
#: what prepare() builds; adapters of the same kind can share prepared chunks
KIND = "openai"
HOW = (
    "each `ChatCompletionChunk` (built as `openai.Stream` builds it, before timing) is turned "
    "into a dict with `.model_dump()`, exactly as `ChatOpenAI._stream` does (so an absent "
    "`index` or `delta` arrives as `None`), and goes through "
    "`ChatOpenAI._convert_chunk_to_generation_chunk`, langchain-openai's own code: it reads "
    "`choices[0]` of each chunk only (with `n > 1` the choices end up in one message) and "
    "builds `tool_call_chunks` with `_convert_delta_to_message_chunk`. The message chunks are "
    "summed one by one, `full = full + chunk`, the streaming pattern of LangChain's docs: each "
    "`+` merges the `tool_call_chunks` by index and rebuilds `tool_calls` by re-parsing every "
    "call's arguments with `parse_partial_json` (`invoke()` instead merges all chunks once at "
    "the end). langchain-openai is installed, so nothing is reimplemented."
)
USABLE = (
    "the call is in the summed message's `.tool_calls` (not `.invalid_tool_calls`). Its "
    "arguments are compared as the raw concatenated `tool_call_chunks[i].args` string (which "
    "LangChain keeps) and must also equal the parsed `.tool_calls[i].args`; note that "
    "`ChatOpenAI` sends `json.dumps(args)` back to the API, not the raw string."
)

_convert: Any = None
_AIMessageChunk: Any = None


def setup() -> None:
    global _convert, _AIMessageChunk
    from langchain_core.messages import AIMessageChunk
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="gpt-4o", api_key="sk-bench-offline", base_url="http://127.0.0.1:9/v1")
    _convert = llm._convert_chunk_to_generation_chunk
    _AIMessageChunk = AIMessageChunk


def prepare(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks)


def prepare_fast(chunks: list[dict[str, Any]]) -> list[Any]:
    return sdk_chunks(chunks, fast=True)


def consume(chunks: list[Any]) -> Outcome:
    convert = _convert
    default_class: Any = _AIMessageChunk
    full: Any = None
    try:
        for chunk in chunks:
            gen = convert(chunk.model_dump(), default_class, {})
            if gen is None:
                continue
            default_class = gen.message.__class__
            full = gen.message if full is None else full + gen.message
    except Exception as exc:
        return Outcome(raised=describe(exc))
    out = Outcome()
    if full is None:
        return out
    out.choices[0] = _calls(full)
    return out


def _calls(message: Any) -> list[Call]:
    valid = list(getattr(message, "tool_calls", []) or [])
    invalid = list(getattr(message, "invalid_tool_calls", []) or [])
    calls: list[Call] = []
    # init_tool_calls walks tool_call_chunks in order, sending each to one of the two lists.
    vi = ii = 0
    for chunk in getattr(message, "tool_call_chunks", []) or []:
        if ii < len(invalid) and (
            invalid[ii].get("args") == chunk.get("args")
            and invalid[ii].get("id") == chunk.get("id")
            and invalid[ii].get("name") == chunk.get("name")
        ):
            bad = invalid[ii]
            ii += 1
            calls.append(
                Call(
                    id=bad.get("id"),
                    name=bad.get("name"),
                    arguments=bad.get("args"),
                    usable=False,
                    note="invalid_tool_calls",
                )
            )
            continue
        if vi >= len(valid):
            continue
        tc = valid[vi]
        vi += 1
        raw = chunk.get("args")
        note = ""
        try:
            expected_args = json.loads(raw) if raw else {}
        except ValueError:
            expected_args = None
        if expected_args != tc.get("args"):
            # leniently parsed (parse_partial_json closed it): the raw string is not what it ran
            note = f"args parsed leniently to {json.dumps(tc.get('args'))}"
        calls.append(
            Call(id=tc.get("id"), name=tc.get("name"), arguments=raw, usable=True, note=note)
        )
    return calls
