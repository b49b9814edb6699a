"""The typed errors of :mod:`fsm.integrations`' adapters.

Each derives from :class:`IntegrationError`, itself an :class:`fsm.errors.FsmError`, so one
``except FsmError`` catches what fsm raises on purpose, adapters included.
"""

from __future__ import annotations

from fsm.errors import FsmError

__all__ = [
    "FrameworkMissingError",
    "HistoryOperationError",
    "HistoryRewriteError",
    "IntegrationError",
    "UnansweredCallsError",
]


class IntegrationError(FsmError):
    """Base class of the errors of fsm's adapters to other frameworks."""


class FrameworkMissingError(IntegrationError, ImportError):
    """An adapter was used without its framework installed; the message names the extra that
    brings it (``pip install 'fsm-toolcalls[openai-agents]'``)."""

    def __init__(self, framework: str, extra: str, detail: str = "") -> None:
        self.framework = framework
        self.extra = extra
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"this fsm adapter needs {framework}, which is not installed{why}: "
            f"pip install 'fsm-toolcalls[{extra}]'"
        )


class HistoryOperationError(IntegrationError):
    """A framework's chat history was asked for something fsm's store cannot do (a store
    without ``delete_conversation`` asked to ``clear``, a message type fsm does not store)."""


class HistoryRewriteError(IntegrationError):
    """A framework asked to change history that fsm has committed (remove or replace an item):
    fsm's history is append-only, so the request is refused and nothing changes."""


class UnansweredCallsError(IntegrationError):
    """A framework wrote past tool calls whose outputs never came, and the adapter was told to
    refuse that (instead of abandoning the calls): the calls stay pending in fsm's ledger."""
