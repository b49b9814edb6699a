"""Test helpers for code built on :mod:`fsm`: a local OpenAI-compatible server replaying
recorded streams over real HTTP (:class:`ReplayServer`), re-exported from :mod:`fsm.replay`.

Not imported by ``import fsm``; stdlib only (plus fsm's own parser).
"""

from __future__ import annotations

from fsm.replay import (
    CHAT_COMPLETIONS_PATH,
    EXAMPLES_DIR,
    ReplayFailure,
    ReplayServer,
    ReplayTurn,
    demo_script,
    split_events,
)

__all__ = [
    "CHAT_COMPLETIONS_PATH",
    "EXAMPLES_DIR",
    "ReplayFailure",
    "ReplayServer",
    "ReplayTurn",
    "demo_script",
    "split_events",
]
