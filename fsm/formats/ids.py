"""Tool call ids and inputs as the Anthropic Messages API takes them, by a reversible rule:
built once in :mod:`fsm.shapes` (see there), re-exported here for existing imports."""

from __future__ import annotations

from fsm.shapes import (
    ANTHROPIC_ID_PATTERN,
    PREFIX,
    VALUE_KEY,
    anthropic_id,
    anthropic_input,
    anthropic_safe,
    original_id,
)

__all__ = [
    "ANTHROPIC_ID_PATTERN",
    "PREFIX",
    "VALUE_KEY",
    "anthropic_id",
    "anthropic_input",
    "anthropic_safe",
    "original_id",
]
