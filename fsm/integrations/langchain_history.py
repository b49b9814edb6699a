"""The body of :mod:`fsm.integrations.langchain` (documented there), which imports it when
:class:`FsmChatMessageHistory` is first used: this module imports ``langchain-core``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fsm.integrations.errors import FrameworkMissingError, HistoryOperationError

try:
    from langchain_core.chat_history import BaseChatMessageHistory
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        FunctionMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
        convert_to_openai_messages,
    )
except ImportError as exc:
    raise FrameworkMissingError("langchain-core", "langchain", str(exc)) from exc

from fsm.completion import parse_completion
from fsm.parser import ParseResult
from fsm.store import ConversationNotFoundError, ConversationStore, ResultsError

__all__ = ["FsmChatMessageHistory", "HistoryOperationError"]

#: the reason a pending turn is given up with when a batch does not bring its results
ABANDONED = "LangChain added a message before the results of this turn's tool calls"


class FsmChatMessageHistory(BaseChatMessageHistory):
    """A LangChain chat message history kept in an fsm conversation (see the module).

    Args:
        store: a :class:`~fsm.store.ConversationStore` (sync; LangChain's async methods run
            these in its executor).
        conversation_id: the conversation (LangChain's session id); created on the first
            write.
    """

    def __init__(self, store: ConversationStore, conversation_id: str) -> None:
        super().__init__()
        self.store = store
        self.conversation_id = conversation_id

    # -- reading ------------------------------------------------------------------------------
    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The conversation's history as LangChain messages (``[]`` before the first write).
        A pending turn (calls without results) is not part of it."""
        try:
            stored = self.store.history(self.conversation_id)
        except ConversationNotFoundError:
            return []
        return [_to_langchain(dict(m)) for m in stored]

    @property
    def pending_message(self) -> AIMessage | None:
        """The ``AIMessage`` whose tool calls wait for their results, or ``None``: held in
        fsm's ledger, never in :attr:`messages` until its results come."""
        pending = self.store.pending(self.conversation_id)
        return None if pending is None else _ai_message(pending.to_message())

    # -- writing ------------------------------------------------------------------------------
    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Append ``messages`` (see the module: one fsm turn per ``AIMessage`` with tool calls
        and its ``ToolMessage`` results, the batch all or nothing; a trailing ``AIMessage``
        whose calls have no results yet is held pending, out of :attr:`messages`).

        Raises the store's typed errors for a batch that breaks the tool-call contract
        (:class:`~fsm.store.ResultsError`, :class:`~fsm.store.InvalidMessageError`),
        :class:`~fsm.errors.IncompleteTurnError` for a pending call whose arguments are not
        JSON, and :class:`HistoryOperationError` for a message type fsm does not store."""
        batch = list(messages)
        if not batch:
            return
        self.store.create_conversation(self.conversation_id, exist_ok=True)
        batch = self._answer_pending(batch)
        if not batch:
            return
        held: ParseResult | None = None
        last = batch[-1]
        if isinstance(last, AIMessage) and _calls_of(last):
            held, batch = _as_turn(last), batch[:-1]
            if not held.complete:
                # kept for the audit as an attempt, never history; the typed error says why
                self.store.record_attempt(self.conversation_id, held, error="LangChain message")
                held.turns[0].to_message()  # raises IncompleteTurnError naming each call
        if batch:
            self.store.import_history(
                self.conversation_id, [_to_openai(m) for m in batch], format="chat"
            )
        if held is not None:
            pending = self.store.begin(self.conversation_id, held)
            # nobody runs its tools here: the next batch's results claim it at once
            self.store.release(pending)

    def clear(self) -> None:
        """Delete the conversation with its messages, calls, attempts and pending turn."""
        delete = getattr(self.store, "delete_conversation", None)
        if delete is None:
            raise HistoryOperationError(
                f"{type(self.store).__name__} cannot delete a conversation, so clear() cannot "
                f"empty {self.conversation_id!r}: use a ConversationStore"
            )
        delete(self.conversation_id)

    def _answer_pending(self, batch: list[BaseMessage]) -> list[BaseMessage]:
        """Give the pending turn the ``ToolMessage`` results that open ``batch`` (committing it
        once every call has one); give it up when the batch opens with anything else. Returns
        the rest of the batch."""
        pending = self.store.pending(self.conversation_id)
        if pending is None:
            return batch
        results = 0
        while results < len(batch) and isinstance(batch[results], ToolMessage):
            results += 1
        if results == 0:
            self.store.abandon(self.store.claim(pending), ABANDONED)
            return batch
        pending = self.store.claim(pending)
        positions = {call.id: n for n, call in enumerate(pending.calls)}
        for message in batch[:results]:
            assert isinstance(message, ToolMessage)
            position = positions.get(message.tool_call_id)
            if position is None:
                self.store.release(pending)
                raise ResultsError(
                    f"a ToolMessage answers tool_call_id {message.tool_call_id!r}, which is not "
                    f"a call of the pending turn (its calls: {sorted(positions)})"
                )
            pending = self.store.started(pending, position)
            content = _content(message.content)
            if message.status == "error":
                text = content if isinstance(content, str) else json.dumps(content)
                pending = self.store.failed(pending, position, text)
            else:
                pending = self.store.succeeded(pending, position, content)
        if all(e.finished for e in pending.executions):
            self.store.commit(pending)
        elif results < len(batch):
            self.store.release(pending)
            raise ResultsError(
                f"pending turn {pending.id} still has calls without a result, and the batch "
                f"goes on with a {type(batch[results]).__name__}: send every call's ToolMessage "
                "first"
            )
        else:
            self.store.release(pending)
        return batch[results:]


# -- LangChain messages -> Chat Completions messages ------------------------------------------


def _calls_of(message: AIMessage) -> list[dict[str, Any]]:
    """The message's calls as Chat Completions ``tool_calls`` (see the module on arguments):
    the provider's own string when ``additional_kwargs`` still has it and it decodes to the
    same ``args``, else ``json.dumps(args, ensure_ascii=False)``; invalid calls keep their
    string (then the store refuses them, never silently fixing them)."""
    raw: dict[str, str] = {}
    for call in message.additional_kwargs.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            raw[str(call.get("id"))] = function["arguments"]
    calls = []
    for call in message.tool_calls:
        arguments = raw.get(str(call["id"]))
        if arguments is None or _decoded(arguments) != call["args"]:
            arguments = json.dumps(call["args"], ensure_ascii=False)
        calls.append(_call(call["id"] or "", call["name"], arguments))
    for invalid in message.invalid_tool_calls:
        calls.append(_call(invalid["id"] or "", invalid["name"] or "", invalid["args"] or ""))
    return calls


def _call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def _decoded(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _content(content: Any) -> Any:
    """A message's content as fsm stores it: a string, or a list of content parts."""
    if isinstance(content, str):
        return content
    return list(content)


def _to_openai(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as a Chat Completions message for ``import_history``."""
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": _text_or_none(message.content)}
        calls = _calls_of(message)
        if calls:
            out["tool_calls"] = calls
        elif "function_call" in message.additional_kwargs:
            out["function_call"] = dict(message.additional_kwargs["function_call"])
        return out
    if isinstance(message, ToolMessage):
        return {
            "role": "tool",
            "tool_call_id": message.tool_call_id,
            "content": _content(message.content),
        }
    if isinstance(message, HumanMessage | SystemMessage | FunctionMessage):
        converted = convert_to_openai_messages(message)
        assert isinstance(converted, dict)
        return converted
    raise HistoryOperationError(
        f"fsm stores system, human, AI, tool and function messages; got a "
        f"{type(message).__name__} ({message.type!r})"
    )


def _text_or_none(content: Any) -> Any:
    if isinstance(content, str):
        return content or None
    return list(content) or None


def _as_turn(message: AIMessage) -> ParseResult:
    """An ``AIMessage`` with calls as the parsed turn fsm's ledger holds (the same rules as a
    stream: arguments must be JSON, a name is needed)."""
    meta = message.response_metadata
    usage = message.usage_metadata
    completion: dict[str, Any] = {
        "id": message.id,
        "object": "chat.completion",
        "created": None,
        "model": meta.get("model_name") or meta.get("model"),
        "choices": [
            {
                "index": 0,
                "message": _to_openai(message),
                "finish_reason": meta.get("finish_reason") or "tool_calls",
            }
        ],
    }
    if usage:
        completion["usage"] = {
            "prompt_tokens": usage["input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
        }
    return parse_completion(completion)


# -- stored messages -> LangChain messages ------------------------------------------------------


def _to_langchain(message: dict[str, Any]) -> BaseMessage:
    role = message.get("role")
    content = message.get("content")
    if role in ("system", "developer"):
        return SystemMessage(content=content or "")
    if role == "user":
        return HumanMessage(content=content or "", **_name(message))
    if role == "assistant":
        return _ai_message(message)
    if role == "tool":
        return ToolMessage(content=content or "", tool_call_id=message["tool_call_id"])
    if role == "function":
        return FunctionMessage(content=content or "", name=message["name"])
    raise HistoryOperationError(f"the store returned a message with role {role!r}")


def _name(message: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": message["name"]} if message.get("name") else {}


def _ai_message(message: Mapping[str, Any]) -> AIMessage:
    """An assistant message as an ``AIMessage``: ``tool_calls`` with ``args`` decoded, and the
    stored calls (arguments byte-exact) in ``additional_kwargs["tool_calls"]``."""
    extra: dict[str, Any] = {}
    tool_calls = []
    invalid = []
    for call in message.get("tool_calls") or []:
        function = call["function"]
        args = _decoded(function["arguments"]) if function["arguments"].strip() else {}
        if isinstance(args, dict):
            tool_calls.append(
                {"name": function["name"], "args": args, "id": call["id"], "type": "tool_call"}
            )
        else:  # JSON, but not an object: LangChain's args are a dict
            invalid.append(
                {
                    "name": function["name"],
                    "args": function["arguments"],
                    "id": call["id"],
                    "error": "the arguments are JSON but not an object",
                    "type": "invalid_tool_call",
                }
            )
    if message.get("tool_calls"):
        extra["tool_calls"] = [dict(c) for c in message["tool_calls"]]
    if message.get("function_call"):
        extra["function_call"] = dict(message["function_call"])
    return AIMessage(
        content=message.get("content") or "",
        tool_calls=tool_calls,
        invalid_tool_calls=invalid,
        additional_kwargs=extra,
    )
