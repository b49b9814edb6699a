"""pydantic-ai's conversation store over fsm's store.

:class:`FsmConversationStore` implements pydantic-ai's
``pydantic_ai.conversation_store.ConversationStore`` (the ABC that ``store.load()`` /
``store.save(result)`` go through around each ``agent.run``) on a
:class:`~fsm.store.ConversationStore` or :class:`~fsm.store.aio.AsyncConversationStore`, so the
history a pydantic-ai agent carries from run to run lives in fsm's tables, with fsm's contract
enforced by the database: each ``ToolCallPart`` is a stored tool call and each ``ToolReturnPart``
its result, in its slot; a response whose calls have no returns yet is a *pending* turn of fsm's
ledger (never in :meth:`~fsm.store.ConversationStore.history`, so never sent back to a model
unanswered) until the run that answers it is saved. A conversation's ``revision`` is fsm's next
seq: a save with a stale one raises :class:`RevisionConflictError` (pydantic-ai's
``ConversationConflict``) and writes nothing.

This module imports pydantic-ai only when one of its classes is used: ``import
fsm.integrations.pydantic_ai`` works without it, and using it without it raises
:class:`PydanticAIMissingError` naming the extra to install. The guide:
``docs/guides/pydantic-ai.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from fsm.integrations.errors import FrameworkMissingError

if TYPE_CHECKING:
    from fsm.integrations.pydantic_ai_store import (
        FsmConversationStore,
        HistoryRewriteError,
        RevisionConflictError,
        ScopeNotSupportedError,
        UnstorableMessageError,
    )

__all__ = [
    "INSTALL",
    "FsmConversationStore",
    "HistoryRewriteError",
    "PydanticAIMissingError",
    "RevisionConflictError",
    "ScopeNotSupportedError",
    "UnstorableMessageError",
]

#: the command that installs what this module needs
INSTALL: Final = "pip install 'fsm-toolcalls[pydantic-ai]'"

#: the names this module takes from :mod:`fsm.integrations.pydantic_ai_store` when first used
_LAZY: Final = frozenset(
    {
        "FsmConversationStore",
        "HistoryRewriteError",
        "RevisionConflictError",
        "ScopeNotSupportedError",
        "UnstorableMessageError",
    }
)


class PydanticAIMissingError(FrameworkMissingError):
    """pydantic-ai (``pydantic-ai-slim``) is not installed; the message names the extra."""

    def __init__(self, cause: BaseException | None = None) -> None:
        super().__init__("pydantic-ai", "pydantic-ai", "" if cause is None else str(cause))


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        importlib.import_module("pydantic_ai.conversation_store")
    except ImportError as exc:
        raise PydanticAIMissingError(exc) from None
    implementation = importlib.import_module("fsm.integrations.pydantic_ai_store")
    return getattr(implementation, name)
