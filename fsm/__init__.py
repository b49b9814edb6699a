"""fsm: streamed LLM tool calls turned into trustworthy conversation history.

The core (this package's top level) is a sans-IO parser and imports neither SQLAlchemy, Alembic
nor the command-line library; the store lives in :mod:`fsm.store`.
"""

from __future__ import annotations

import logging

from fsm.__about__ import __version__
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

logging.getLogger(__name__).addHandler(logging.NullHandler())  # no output unless configured

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
