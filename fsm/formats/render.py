"""Rendering a turn back for the next request: the verbatim items of a turn
(:func:`output_items`, :func:`iter_output_items`), and what :mod:`fsm.shapes` builds once:
Responses input items (:func:`responses_input`, :meth:`fsm.turn.Turn.to_items`), Anthropic
messages (:func:`anthropic_messages`, :meth:`fsm.turn.Turn.to_anthropic`), the pairing of calls
with results (:func:`call_results`).

A turn renders for its own format verbatim (encrypted reasoning, thinking signatures, built-in
tool items, ids as first sent). For the other format only what both understand crosses over:
the assistant's text and the client calls; every other item is provider-bound and dropped
(``fsm.formats.PROVIDER_BOUND``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fsm.shapes import (
    anthropic_messages,
    call_results,
    responses_input,
    to_anthropic,
    to_items,
)

if TYPE_CHECKING:
    from fsm.turn import Turn

__all__ = [
    "anthropic_messages", "call_results", "iter_output_items", "output_items", "responses_input",
    "to_anthropic", "to_items",
]  # fmt: skip


def output_items(turn: Turn) -> list[dict[str, Any]]:
    """The turn's items verbatim, in output order (see :meth:`fsm.turn.Turn.output_items`)."""
    return turn.output_items()


def iter_output_items(turn: Turn) -> Iterator[dict[str, Any]]:
    """The items of :func:`output_items`, decoded one at a time (a writer that serializes each
    before the next holds one decoded item at a time, not the whole turn's)."""
    return turn.iter_output_items()
