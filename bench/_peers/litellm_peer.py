"""LiteLLM: ``litellm.stream_chunk_builder`` over ``ModelResponseStream`` chunks."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

from . import Call, Outcome, describe

LABEL = "LiteLLM"
DISTS = ("litellm",)
#: what prepare() builds; adapters of the same kind can share prepared chunks
KIND = "litellm"
HOW = (
    "each chunk dict becomes `litellm.ModelResponseStream(**chunk)` (the chunk type "
    "`litellm.completion(stream=True)` yields; built before timing), and the list goes to "
    "`litellm.stream_chunk_builder(chunks)` at the end, as LiteLLM's docs show for rebuilding "
    "a streamed response. (`CustomStreamWrapper`, which produces those chunks from the "
    "provider's stream, is not exercised.) `LITELLM_LOCAL_MODEL_COST_MAP=True` keeps it offline."
)
USABLE = (
    "`stream_chunk_builder` returns without raising and the call is in "
    "`choices[i].message.tool_calls`; it validates nothing (it keeps `finish_reason`, and "
    "leaves out a call that never got an id or a name)."
)

_build: Any = None
_Stream: Any = None


def setup() -> None:
    global _build, _Stream
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    from litellm import ModelResponseStream, stream_chunk_builder

    litellm.suppress_debug_info = True
    litellm.telemetry = False
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    _build, _Stream = stream_chunk_builder, ModelResponseStream


def prepare(chunks: list[dict[str, Any]]) -> list[Any]:
    # ModelResponseStream(**chunk) mutates the dicts it is given: hand it copies.
    return [_Stream(**copy.deepcopy(data)) for data in chunks]


prepare_fast = prepare


def consume(chunks: list[Any]) -> Outcome:
    try:
        response = _build(list(chunks))
    except Exception as exc:
        return Outcome(raised=describe(exc))
    out = Outcome()
    if response is None:
        return out
    for choice in response.choices:
        message = getattr(choice, "message", None)
        calls = []
        for tc in getattr(message, "tool_calls", None) or []:
            fn = getattr(tc, "function", None)
            calls.append(
                Call(
                    id=getattr(tc, "id", None),
                    name=getattr(fn, "name", None),
                    arguments=getattr(fn, "arguments", None),
                    usable=True,
                )
            )
        out.choices[getattr(choice, "index", 0)] = calls
    return out
