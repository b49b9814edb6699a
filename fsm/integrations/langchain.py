"""LangChain chat history over fsm's store: ``FsmChatMessageHistory`` (issue 30, item 3).

A ``langchain_core.chat_history.BaseChatMessageHistory`` whose messages live in a
:class:`~fsm.store.ConversationStore` conversation, so LangChain's ``RunnableWithMessageHistory``
(or any code that takes a chat history) gets fsm's tool-call contract::

    from fsm.integrations.langchain import FsmChatMessageHistory
    from fsm.store import ConversationStore

    store = ConversationStore("sqlite:///chat.db")
    history = FsmChatMessageHistory(store, "user-42")
    chain = RunnableWithMessageHistory(agent, lambda session_id: history)

- ``FsmChatMessageHistory.messages`` reads the conversation's history as
  ``SystemMessage`` / ``HumanMessage`` / ``AIMessage`` (with ``tool_calls``, and the stored
  ``tool_calls`` byte-exact in ``additional_kwargs``) / ``ToolMessage``.
- ``FsmChatMessageHistory.add_messages`` writes a batch: each ``AIMessage`` with tool calls
  and the ``ToolMessage`` results that follow it become ONE fsm turn, the whole batch all or
  nothing through :meth:`~fsm.store.ConversationStore.import_history` (a result for no call, a
  call whose arguments are not JSON, a result out of its slot: the store's typed errors, nothing
  written). An ``AIMessage`` whose calls have no result yet (the batch ends with it) is held as
  the conversation's *pending* turn in fsm's tool ledger: it is not part of ``messages``,
  so an unanswered call is never sent back to a model; the ``ToolMessage`` results of a later
  batch complete it and it goes into history then. A batch that starts with anything but its
  results gives it up (:meth:`~fsm.store.ConversationStore.abandon`: kept for the audit, never
  sent back).
- ``FsmChatMessageHistory.clear`` deletes the conversation
  (:meth:`~fsm.store.ConversationStore.delete_conversation`); a store without that method is a
  ``HistoryOperationError`` saying so.

**Where the provider's bytes are lost.** LangChain keeps a tool call's arguments as a parsed
``dict`` (``AIMessage.tool_calls[i]["args"]``): the chat model integration has already decoded
the provider's argument string, and LangChain serializes the dict again whenever it needs a
string (``langchain_core.messages.convert_to_openai_messages`` and the OpenAI integration write
``json.dumps(args, ensure_ascii=False)``: spacing, key order of duplicates, escapes and number
spellings are then LangChain's, not the model's). So fsm stores the provider's own argument
string only when the ``AIMessage`` still carries it in ``additional_kwargs["tool_calls"]`` (the
OpenAI-compatible integrations put it there) and it decodes to the same ``args``; otherwise it
stores ``json.dumps(args, ensure_ascii=False)``, as LangChain would send it. Tool call ids are
kept as given either way. To keep the bytes a provider sent, parse its stream with fsm
(``fsm.parse``) and commit the turn with ``store.commit_turn``.

LangChain (``langchain-core``) is imported on first use of a name of this module:
``import fsm.integrations.langchain`` works without it, and using
``FsmChatMessageHistory`` then raises ``ImportError`` naming the extra to install
(``pip install 'fsm-toolcalls[langchain]'``). ``import fsm`` never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsm.integrations.langchain_history import FsmChatMessageHistory, HistoryOperationError

__all__ = ["FsmChatMessageHistory", "HistoryOperationError"]


def __getattr__(name: str) -> Any:
    """``FsmChatMessageHistory`` and ``HistoryOperationError``, imported with LangChain on
    first use (``import fsm.integrations.langchain`` works without it)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # without langchain-core: ImportError naming the extra to install
    from fsm.integrations import langchain_history as body

    return getattr(body, name)
