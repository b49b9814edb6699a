"""fsm: streamed LLM tool calls turned into trustworthy conversation history.

The core (this package's top level) is a sans-IO parser and imports neither SQLAlchemy, Alembic
nor the command-line library; the store lives in :mod:`fsm.store`. Each name is imported on first
use (``fsm.lazy``): ``import fsm`` alone loads nothing of the parser.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fsm.__about__ import __version__
from fsm.lazy import lazy_exports as _lazy_exports

logging.getLogger(__name__).addHandler(logging.NullHandler())  # no output unless configured


if TYPE_CHECKING:
    from fsm.api import aparse, parse
    from fsm.completion import parse_completion
    from fsm.errors import (
        FsmError,
        IncompleteTurnError,
        LocalProtocolError,
        RemoteProtocolError,
    )
    from fsm.events import (
        AnomalyDetected,
        ContentDelta,
        Event,
        FinishReasonReceived,
        ReasoningDelta,
        RefusalDelta,
        StreamEnded,
        ToolCallAborted,
        ToolCallArgumentsDelta,
        ToolCallFinished,
        ToolCallOpened,
        ToolCallTruncated,
        ToolCallUpdated,
        TurnEnded,
        UsageReceived,
    )
    from fsm.parser import Anomaly, Limits, ParseResult, StreamParser, Turn
    from fsm.states import ToolCallState
    from fsm.toolcall import ToolCall

__all__ = [
    "Anomaly",
    "AnomalyDetected",
    "ContentDelta",
    "Event",
    "FinishReasonReceived",
    "FsmError",
    "IncompleteTurnError",
    "Limits",
    "LocalProtocolError",
    "ParseResult",
    "ReasoningDelta",
    "RefusalDelta",
    "RemoteProtocolError",
    "StreamEnded",
    "StreamParser",
    "ToolCall",
    "ToolCallAborted",
    "ToolCallArgumentsDelta",
    "ToolCallFinished",
    "ToolCallOpened",
    "ToolCallState",
    "ToolCallTruncated",
    "ToolCallUpdated",
    "Turn",
    "TurnEnded",
    "UsageReceived",
    "__version__",
    "aparse",
    "parse",
    "parse_completion",
]

#: where each exported name lives: imported on first use (PEP 562), not by ``import fsm``
_EXPORTS: dict[str, tuple[str, ...]] = {
    "fsm.api": (
        "aparse",
        "parse",
    ),
    "fsm.completion": ("parse_completion",),
    "fsm.errors": (
        "FsmError",
        "IncompleteTurnError",
        "LocalProtocolError",
        "RemoteProtocolError",
    ),
    "fsm.events": (
        "AnomalyDetected",
        "ContentDelta",
        "Event",
        "FinishReasonReceived",
        "ReasoningDelta",
        "RefusalDelta",
        "StreamEnded",
        "ToolCallAborted",
        "ToolCallArgumentsDelta",
        "ToolCallFinished",
        "ToolCallOpened",
        "ToolCallTruncated",
        "ToolCallUpdated",
        "TurnEnded",
        "UsageReceived",
    ),
    "fsm.parser": (
        "Anomaly",
        "Limits",
        "ParseResult",
        "StreamParser",
        "Turn",
    ),
    "fsm.states": ("ToolCallState",),
    "fsm.toolcall": ("ToolCall",),
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
