"""pydantic-ai messages as the Chat Completions messages fsm stores, and back (the mapping of
:mod:`fsm.integrations.pydantic_ai`; this module imports pydantic-ai, so import it only through
that module's classes).

A ``ModelRequest`` becomes its parts' messages (``SystemPromptPart``: ``system``;
``UserPromptPart``: ``user``, text and image URLs; ``ToolReturnPart``: a ``tool`` result with its
call's id and the text the model is sent; ``RetryFeedbackPart``: the ``user`` text the model is
sent); a ``ModelResponse`` one ``assistant`` message (its ``TextPart`` text, its ``ToolCallPart``
calls as ``tool_calls``; ``ThinkingPart`` text is dropped, as Chat Completions requests carry
none). Anything else is an :class:`UnstorableMessageError`. Read back, consecutive non-assistant
messages form one ``ModelRequest``, each assistant message one ``ModelResponse``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_ai import messages as pm
from pydantic_ai.exceptions import UserError

from fsm.integrations.errors import IntegrationError
from fsm.store import PendingTurn

__all__ = [
    "UnstorableMessageError",
    "as_completion",
    "from_chat",
    "normal",
    "pending_response",
    "to_chat",
]


class UnstorableMessageError(IntegrationError, UserError):
    """A message part that Chat Completions history cannot hold (a file, a built-in tool's
    call, ...): nothing was written."""

    def __init__(self, message: str) -> None:
        UserError.__init__(self, message)


def _user_content(content: str | Sequence[Any]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for item in content:
        if isinstance(item, str):
            parts.append({"type": "text", "text": item})
        elif isinstance(item, pm.ImageUrl):
            parts.append({"type": "image_url", "image_url": {"url": item.url}})
        else:
            raise UnstorableMessageError(
                f"a user prompt's {type(item).__name__} cannot be stored in Chat Completions "
                "history (text and image URLs can): pass it by URL, or keep it out of the "
                "stored conversation"
            )
    return parts


def _request_messages(message: pm.ModelRequest, at: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in message.parts:
        if isinstance(part, pm.SystemPromptPart):
            out.append({"role": "system", "content": part.content})
        elif isinstance(part, pm.UserPromptPart):
            out.append({"role": "user", "content": _user_content(part.content)})
        elif isinstance(part, pm.ToolReturnPart):
            if part.files:
                raise UnstorableMessageError(
                    f"message {at}: the return of call {part.tool_call_id!r} ({part.tool_name}) "
                    "holds files, which a Chat Completions tool result cannot: return their URLs "
                    "as text instead"
                )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": part.tool_call_id,
                    "content": part.model_response_str(),
                }
            )
        elif isinstance(part, pm.RetryFeedbackPart):
            out.append({"role": "user", "content": part.model_response()})
        else:
            raise UnstorableMessageError(
                f"message {at}: a request's {part.part_kind!r} part cannot be stored in Chat "
                "Completions history"
            )
    return out


def _response_message(message: pm.ModelResponse, at: int) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in message.parts:
        if isinstance(part, pm.TextPart):
            texts.append(part.content)
        elif isinstance(part, pm.ToolCallPart):
            calls.append(
                {
                    "id": part.tool_call_id,
                    "type": "function",
                    "function": {"name": part.tool_name, "arguments": part.args_as_json_str()},
                }
            )
        elif isinstance(part, pm.ThinkingPart):
            continue  # Chat Completions requests carry no reasoning: not kept (see the guide)
        else:
            raise UnstorableMessageError(
                f"message {at}: a response's {part.part_kind!r} part cannot be stored in Chat "
                "Completions history"
            )
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    return out


def to_chat(messages: Sequence[pm.ModelMessage], first: int = 0) -> list[list[dict[str, Any]]]:
    """Each pydantic-ai message as the Chat Completions messages fsm stores for it, with each
    response's results put in call order (fsm's slots); ``first``: the number of the first
    message, for errors."""
    out: list[list[dict[str, Any]]] = []
    for at, message in enumerate(messages, start=first):
        if isinstance(message, pm.ModelResponse):
            out.append([_response_message(message, at)])
        else:
            out.append(_request_messages(message, at))
    order: dict[str, int] = {}
    for group in out:
        if group and group[0]["role"] == "assistant":
            calls = group[0].get("tool_calls") or []
            order = {c["id"]: i for i, c in enumerate(calls)}
            continue
        lead = 0
        while lead < len(group) and group[lead]["role"] == "tool":
            lead += 1
        if lead and all(m["tool_call_id"] in order for m in group[:lead]):
            group[:lead] = sorted(group[:lead], key=lambda m: order[m["tool_call_id"]])
        order = {}
    return out


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))


def _user_part_content(content: Any) -> str | list[pm.UserContent]:
    if content is None or isinstance(content, str):
        return content or ""
    items: list[pm.UserContent] = []
    for p in content:
        if p.get("type") == "image_url":
            items.append(pm.ImageUrl(url=p["image_url"]["url"]))
        else:
            items.append(str(p.get("text", "")))
    return items


def from_chat(history: Sequence[Mapping[str, Any]]) -> list[tuple[pm.ModelMessage, int]]:
    """fsm's Chat Completions history as pydantic-ai messages, each with the seq right after
    its last fsm message (what its entry id names)."""
    out: list[tuple[pm.ModelMessage, int]] = []
    request: list[pm.ModelRequestPart] = []
    names: dict[str, str] = {}
    for seq, m in enumerate(history):
        role = m.get("role")
        if role == "assistant":
            if request:
                out.append((pm.ModelRequest(parts=request), seq))
                request = []
            parts: list[pm.ModelResponsePart] = []
            text = _text(m.get("content"))
            if text:
                parts.append(pm.TextPart(content=text))
            for call in m.get("tool_calls") or []:
                body = call.get("function") or call.get("custom") or {}
                name = str(body.get("name", ""))
                names[call["id"]] = name
                arguments = body.get("arguments", body.get("input"))
                parts.append(
                    pm.ToolCallPart(tool_name=name, args=arguments, tool_call_id=call["id"])
                )
            out.append((pm.ModelResponse(parts=parts), seq + 1))
        elif role in ("system", "developer"):
            request.append(pm.SystemPromptPart(content=_text(m.get("content"))))
        elif role == "tool":
            call_id = str(m.get("tool_call_id"))
            request.append(
                pm.ToolReturnPart(
                    tool_name=names.get(call_id, ""),
                    content=m.get("content"),
                    tool_call_id=call_id,
                )
            )
        else:
            request.append(pm.UserPromptPart(content=_user_part_content(m.get("content"))))
    if request:
        out.append((pm.ModelRequest(parts=request), len(history)))
    return out


def normal(message: Mapping[str, Any]) -> dict[str, Any]:
    """A Chat Completions message without the keys whose value is ``None`` (to compare)."""
    return {k: v for k, v in message.items() if v is not None}


def pending_response(pending: PendingTurn) -> pm.ModelResponse:
    """A pending turn of fsm's ledger as the ``ModelResponse`` it was saved from (its text and
    calls, its model name and response id)."""
    parts: list[pm.ModelResponsePart] = []
    if pending.content:
        parts.append(pm.TextPart(content=pending.content))
    for call in pending.calls:
        parts.append(
            pm.ToolCallPart(tool_name=call.name, args=call.arguments, tool_call_id=call.id)
        )
    return pm.ModelResponse(
        parts=parts, model_name=pending.model, provider_response_id=pending.response_id
    )


def as_completion(message: Mapping[str, Any], response: pm.ModelResponse) -> dict[str, Any]:
    """An assistant message with tool calls as the ``chat.completion`` that carried it."""
    body = {k: v for k, v in message.items() if k != "role"}
    completion: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": body, "finish_reason": "tool_calls"}],
    }
    if response.provider_response_id:
        completion["id"] = response.provider_response_id
    if response.model_name:
        completion["model"] = response.model_name
    usage = response.usage
    if usage.input_tokens or usage.output_tokens:
        completion["usage"] = {
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
        }
    return completion
