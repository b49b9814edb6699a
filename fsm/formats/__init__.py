"""The OpenAI Responses API and Anthropic Messages stream formats, through the same
:class:`~fsm.parser.StreamParser` as Chat Completions (``shared/spec/formats.md``).

``StreamParser(format=...)`` takes ``"auto"`` (the default), ``"chat"``, ``"responses"`` or
``"anthropic"``. Each format is one implementation of one protocol,
:class:`fsm.formats.core.Format` (:mod:`fsm.formats.chat`, :mod:`fsm.formats.responses`,
:mod:`fsm.formats.anthropic`), over one stream core (:class:`fsm.formats.core.StreamCore`:
limits, anomalies, errors, events, endings). ``"auto"`` starts with a detector
(:mod:`fsm.formats.auto`) that looks at the first event carrying JSON: a ``type`` that starts
with ``response.`` means Responses, an Anthropic event type (``message_start``, ...) Anthropic,
anything else a Chat Completions chunk; it then hands that event and every later one to the
chosen format. Once the format is known, an event of another format is a protocol error.

The same SSE framer, limits, anomalies, errors, events, :class:`~fsm.turn.Turn` and
:class:`~fsm.toolcall.ToolCall` serve every format; the format turns are
:class:`~fsm.formats.turn.ResponsesTurn` and :class:`~fsm.formats.turn.AnthropicTurn`.
"""

from __future__ import annotations

from typing import Final

from fsm.formats.detect import detect, foreign_format
from fsm.vocab import ANTHROPIC_EVENTS, FORMATS

__all__ = ["ANTHROPIC_EVENTS", "FORMATS", "PROVIDER_BOUND", "detect", "foreign_format"]

#: item / block types only one provider understands: dropped when a turn is rendered for the
#: other (:meth:`fsm.turn.Turn.to_items`, :meth:`fsm.turn.Turn.to_anthropic`). Every type not
#: listed as neutral here is provider-bound: only messages / text and client calls cross over.
PROVIDER_BOUND: Final = {
    "responses": "every item but message, function_call and custom_tool_call",
    "anthropic": "every block but text and tool_use",
}
