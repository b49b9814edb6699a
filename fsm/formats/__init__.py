"""The OpenAI Responses API and Anthropic Messages stream formats, through the same
:class:`~fsm.parser.StreamParser` as Chat Completions (``shared/spec/formats.md``).

``StreamParser(format=...)`` takes ``"auto"`` (the default), ``"chat"``, ``"responses"`` or
``"anthropic"``. A named format installs its handler (:mod:`fsm.formats.responses`,
:mod:`fsm.formats.anthropic`) on the parser; ``"auto"`` installs a detector that looks at the
first event carrying JSON: a ``type`` that starts with ``response.`` means Responses, an
Anthropic event type (``message_start``, ...) Anthropic, anything else a Chat Completions chunk
(the detector then removes itself: a Chat Completions stream runs exactly the code it ran
before). Once the format is known, an event of another format is a protocol error.

The same SSE framer, limits, anomalies, errors, events, :class:`~fsm.turn.Turn` and
:class:`~fsm.toolcall.ToolCall` serve every format; the format turns are
:class:`~fsm.formats.turn.ResponsesTurn` and :class:`~fsm.formats.turn.AnthropicTurn`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from fsm.parser import StreamParser

__all__ = ["ANTHROPIC_EVENTS", "FORMATS", "PROVIDER_BOUND", "detect", "foreign_format", "install"]

#: the stream formats
FORMATS: Final = ("chat", "responses", "anthropic")

#: the event types of an Anthropic Messages stream (``error`` is shared with Responses)
ANTHROPIC_EVENTS: Final = frozenset(
    {
        "message_start",
        "message_delta",
        "message_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "ping",
    }
)

#: item / block types only one provider understands: dropped when a turn is rendered for the
#: other (:meth:`fsm.turn.Turn.to_items`, :meth:`fsm.turn.Turn.to_anthropic`). Every type not
#: listed as neutral here is provider-bound: only messages / text and client calls cross over.
PROVIDER_BOUND: Final = {
    "responses": "every item but message, function_call and custom_tool_call",
    "anthropic": "every block but text and tool_use",
}


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


def install(parser: StreamParser, format: str) -> None:
    """Give ``parser`` the handler of ``format`` (``"auto"``: the detector)."""
    if format == "auto":
        from fsm.formats.base import Detector

        Detector(parser).install()
    elif format == "responses":
        from fsm.formats.responses import ResponsesHandler

        ResponsesHandler(parser).install()
    elif format == "anthropic":
        from fsm.formats.anthropic import AnthropicHandler

        AnthropicHandler(parser).install()
