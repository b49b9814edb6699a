"""Small helpers shared by the adapters."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

__all__ = ["args_object", "run_async", "sdk_chunks"]

_loop: asyncio.AbstractEventLoop | None = None


def run_async(coro: Any) -> Any:
    """Run ``coro`` to completion on one event loop kept for the whole benchmark (cheaper and
    steadier to time than a new loop per stream). A loop interrupted by the benchmark's cap is
    dropped and a fresh one made next time."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    try:
        return _loop.run_until_complete(coro)
    except Exception:
        raise
    except BaseException:
        loop, _loop = _loop, None
        with contextlib.suppress(Exception):  # a loop stopped mid-task may refuse to close
            loop.close()
        raise


def args_object(arguments: Any) -> bool:
    """Whether ``arguments`` is what an agent runner accepts before running a tool: empty, or
    JSON text of an object (pydantic-ai: ``args_as_dict(raise_if_invalid=True)``; openai-agents:
    ``json.loads(input) if input else {}`` then "expected a JSON object")."""
    if not arguments:
        return True
    if isinstance(arguments, dict):
        return True
    try:
        return isinstance(json.loads(arguments), dict)
    except (TypeError, ValueError):
        return False


def sdk_chunks(chunks: list[dict[str, Any]], *, fast: bool = False) -> list[Any]:
    """The ``ChatCompletionChunk`` objects ``openai.Stream`` would hand over for ``chunks``.

    The SDK builds them with ``construct_type`` (no validation), which is what the correctness
    matrix uses. ``fast=True`` (the timing workloads only, built before timing) validates instead,
    about 20 times cheaper in this SDK version and giving equal objects (same ``model_dump()`` and
    ``to_dict()``) for every chunk that validates; a chunk that does not is constructed.
    """
    from openai._models import construct_type
    from openai.types.chat import ChatCompletionChunk
    from pydantic import ValidationError

    out: list[Any] = []
    for data in chunks:
        if fast:
            try:
                out.append(ChatCompletionChunk.model_validate(data))
                continue
            except ValidationError:
                pass
        out.append(construct_type(type_=ChatCompletionChunk, value=data))
    return out
