"""Test helpers for code built on :mod:`fsm`: a local OpenAI-compatible server replaying
recorded streams over real HTTP (:class:`ReplayServer`, :class:`ReplayTurn`,
:func:`demo_script`, ...), re-exported from :mod:`fsm.replay` (every name of its ``__all__``).

Not imported by ``import fsm``; stdlib only (plus fsm's own parser).
"""

from __future__ import annotations

from fsm.replay import *  # noqa: F403
from fsm.replay import __all__ as __all__
