"""Which format a stream is: decided from its first event that carries JSON
(:func:`detect`), and which format an event type belongs to (:func:`foreign_format`)."""

from __future__ import annotations

from typing import Any

from fsm.vocab import ANTHROPIC_EVENTS

__all__ = ["detect", "foreign_format"]


def detect(event: Any) -> str:
    """The format of a stream whose first JSON event is ``event``: ``"responses"`` for a
    ``type`` starting with ``response.``, ``"anthropic"`` for an Anthropic event type, else
    ``"chat"``. A first ``error`` event is Anthropic's when its ``error`` is an object with a
    ``type``, else the Responses one."""
    if type(event) is dict:
        kind = event.get("type")
        if type(kind) is str and "choices" not in event:
            if kind.startswith("response."):
                return "responses"
            if kind in ANTHROPIC_EVENTS:
                return "anthropic"
            if kind == "error":
                error = event.get("error")
                if type(error) is dict and "type" in error and "code" not in error:
                    return "anthropic"
                return "responses"
    return "chat"


def foreign_format(kind: Any) -> str | None:
    """The format an event ``type`` belongs to when it is not Chat Completions', else ``None``
    (a shared or unknown type)."""
    if type(kind) is not str:
        return None
    if kind.startswith("response."):
        return "a Responses API"
    if kind in ANTHROPIC_EVENTS:
        return "an Anthropic Messages"
    return None
