"""The replay server's former home: it is :mod:`fsm.replay` now (``fsm demo`` uses it too), and
this module re-exports it so that ``from fsm.testing.server import ReplayServer`` keeps working."""

from __future__ import annotations

from fsm.replay import *  # noqa: F403
from fsm.replay import __all__ as __all__
