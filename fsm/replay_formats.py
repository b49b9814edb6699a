"""The replay server's request checks for the Responses API and Anthropic Messages.

:class:`~fsm.replay.ReplayServer` answers ``POST /v1/responses`` and ``POST /v1/messages`` as
well as ``POST /v1/chat/completions``. Like the real APIs, it refuses (``400``, in the API's own
error shape) a follow-up request whose tool results do not match its tool calls:

* **Responses** (:func:`check_responses_tools`): every ``function_call_output`` (and
  ``custom_tool_call_output``) answers a ``function_call`` (``custom_tool_call``) with its
  ``call_id`` in the ``input`` or in the output of ``previous_response_id``; every call has an
  output; a call gets at most one output per time it was made.
* **Anthropic** (:func:`check_anthropic_tools`): an assistant message with ``tool_use`` blocks is
  followed by ONE user message whose ``tool_result`` blocks answer every ``tool_use`` id, and
  only those; a ``tool_result`` anywhere else answers nothing and is refused. Before that
  (:func:`check_anthropic_blocks`), what the API's schema refuses: a ``tool_use.id`` or
  ``tool_result.tool_use_id`` that does not match ``^[a-zA-Z0-9_-]+$``, a ``tool_use`` id used
  twice in one request, a ``tool_use.input`` that is not an object.

The messages follow the wording of the real APIs' errors, so a test that passes here meets the
same refusal there. Stdlib only.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

__all__ = [
    "ANTHROPIC_PATH",
    "CHAT_PATH",
    "FORMAT_OF_PATH",
    "RESPONSES_PATH",
    "StreamFormat",
    "anthropic_error_body",
    "check_anthropic_blocks",
    "check_anthropic_tools",
    "check_responses_tools",
    "detect_format",
    "openai_error_body",
]

#: The three formats a replayed stream may have.
StreamFormat = Literal["chat", "responses", "anthropic"]

CHAT_PATH: Final = "/v1/chat/completions"
RESPONSES_PATH: Final = "/v1/responses"
ANTHROPIC_PATH: Final = "/v1/messages"
#: The path each format is served at.
FORMAT_OF_PATH: Final[Mapping[str, StreamFormat]] = {
    CHAT_PATH: "chat",
    RESPONSES_PATH: "responses",
    ANTHROPIC_PATH: "anthropic",
}

_CALL_OF_OUTPUT: Final = {
    "function_call_output": "function_call",
    "custom_tool_call_output": "custom_tool_call",
}
_ANTHROPIC_ROLES: Final = ("user", "assistant")
#: what the Anthropic API requires of ``tool_use.id`` and ``tool_result.tool_use_id``
_ANTHROPIC_ID: Final = re.compile(r"[a-zA-Z0-9_-]+")
_ID_PATTERN_TEXT: Final = "^[a-zA-Z0-9_-]+$"


def openai_error_body(message: str, error_type: str, param: str | None = None) -> bytes:
    """An OpenAI error body (Chat Completions and Responses share it)."""
    error = {"message": message, "type": error_type, "param": param, "code": None}
    return json.dumps({"error": error}).encode()


def anthropic_error_body(message: str, error_type: str) -> bytes:
    """An Anthropic error body (``{"type": "error", "error": {"type", "message"}}``)."""
    return json.dumps({"type": "error", "error": {"type": error_type, "message": message}}).encode()


def detect_format(data: bytes) -> StreamFormat:
    """The format of a recorded stream, from its first event that carries a JSON object with a
    ``type`` (``response.*`` -> Responses, a Messages event -> Anthropic) or a chunk (Chat
    Completions); a stream of no such event is taken for Chat Completions."""
    for line in data.splitlines():
        stripped = line.strip()
        if not stripped.startswith(b"data:"):
            continue
        try:
            value = json.loads(stripped[5:])
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        kind = value.get("type")
        if isinstance(kind, str):
            if kind.startswith("response."):
                return "responses"
            if kind in ("message_start", "ping") or kind.startswith(("content_block", "message_")):
                return "anthropic"
            if kind == "error":
                continue  # both typed formats have it: the next event decides
        return "chat"
    return "chat"


# -- Responses ---------------------------------------------------------------------------------
def responses_items(body: Mapping[str, Any]) -> list[dict[str, Any]] | str:
    """The ``input`` items of a Responses request (``[]`` for a text input), or why the
    request is not one."""
    value = body.get("input")
    if value is None or isinstance(value, str):
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        return "'input' must be a string or a list of objects"
    return value


def check_responses_tools(
    items: Sequence[Mapping[str, Any]], previous: Sequence[Mapping[str, Any]] = ()
) -> str | None:
    """Why the tool outputs of a Responses ``input`` do not match its calls (``previous``: the
    output items of ``previous_response_id``), or ``None``.

    An output whose ``call_id`` names no call of its kind is refused, and so is a call with no
    output (the same call_id may be made, and answered, more than once)."""
    calls: Counter[tuple[str, Any]] = Counter()
    for item in [*previous, *items]:
        kind = item.get("type")
        if kind in ("function_call", "custom_tool_call"):
            calls[(kind, item.get("call_id"))] += 1
    answered: Counter[tuple[str, Any]] = Counter()
    for at, item in enumerate(items):
        kind = item.get("type")
        if kind not in _CALL_OF_OUTPUT:
            continue
        call_id = item.get("call_id")
        key = (_CALL_OF_OUTPUT[kind], call_id)
        answered[key] += 1
        if answered[key] > calls[key]:
            what = "function call" if kind == "function_call_output" else "custom tool call"
            return (
                f"No tool call found for {what} output with call_id {call_id}. "
                f"(input[{at}]: every {kind} must answer a {key[0]} with its call_id, "
                "in the input or in the output of previous_response_id)"
            )
    for (kind, call_id), made in calls.items():
        if answered[(kind, call_id)] < made:
            what = "function call" if kind == "function_call" else "custom tool call"
            return f"No tool output found for {what} {call_id}."
    return None


# -- Anthropic ---------------------------------------------------------------------------------
def anthropic_messages(body: Mapping[str, Any]) -> list[dict[str, Any]] | str:
    """The ``messages`` of a Messages request, or why the request is not one."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return "messages: Input should be a valid list of objects"
    if not messages:
        return "messages: at least one message is required"
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return "max_tokens: Field required (a positive integer)"
    for at, message in enumerate(messages):
        if message.get("role") not in _ANTHROPIC_ROLES:
            return (
                f"messages.{at}.role: Input should be 'user' or 'assistant' (system prompts go "
                "in the top-level 'system' parameter)"
            )
        content = message.get("content")
        if not isinstance(content, str) and not (
            isinstance(content, list) and all(isinstance(b, dict) for b in content)
        ):
            return f"messages.{at}.content: Input should be a string or a list of content blocks"
    return messages


def check_anthropic_blocks(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the ``tool_use`` / ``tool_result`` blocks of a Messages request break the API's
    schema, or ``None`` (the wording of the API's own errors): ids must match
    ``^[a-zA-Z0-9_-]+$``, ``tool_use`` ids be unique in the request, ``tool_use.input`` be an
    object."""
    seen: set[Any] = set()
    for at, message in enumerate(messages):
        content = message.get("content")
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type")
            if kind == "tool_use":
                where = f"messages.{at}.content.{j}.tool_use"
                cid = block.get("id")
                if not isinstance(cid, str):
                    return f"{where}.id: Input should be a valid string"
                if _ANTHROPIC_ID.fullmatch(cid) is None:
                    return f"{where}.id: String should match pattern '{_ID_PATTERN_TEXT}'"
                if cid in seen:
                    return f"messages.{at}.content.{j}: `tool_use` ids must be unique"
                seen.add(cid)
                if not isinstance(block.get("input"), dict):
                    return f"{where}.input: Input should be a valid dictionary"
            elif kind == "tool_result":
                where = f"messages.{at}.content.{j}.tool_result"
                cid = block.get("tool_use_id")
                if not isinstance(cid, str):
                    return f"{where}.tool_use_id: Input should be a valid string"
                if _ANTHROPIC_ID.fullmatch(cid) is None:
                    return f"{where}.tool_use_id: String should match pattern '{_ID_PATTERN_TEXT}'"
    return None


def _blocks(message: Mapping[str, Any], kind: str) -> list[tuple[int, dict[str, Any]]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [(j, b) for j, b in enumerate(content) if b.get("type") == kind]


def check_anthropic_tools(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the ``tool_result`` blocks of a Messages request do not match its ``tool_use``
    blocks, or ``None``: each assistant message with ``tool_use`` blocks must be followed by a
    user message whose ``tool_result`` blocks answer every one of their ids, once, and answer
    nothing else."""
    for at, message in enumerate(messages):
        results = _blocks(message, "tool_result")
        if message.get("role") == "assistant":
            if results:
                return f"messages.{at}: tool_result blocks are only allowed in user messages"
            continue
        before = messages[at - 1] if at else None
        uses = (
            [b.get("id") for _, b in _blocks(before, "tool_use")]
            if before is not None and before.get("role") == "assistant"
            else []
        )
        wanted = Counter(uses)
        seen: Counter[Any] = Counter()
        for j, block in results:
            use_id = block.get("tool_use_id")
            seen[use_id] += 1
            if seen[use_id] > wanted[use_id]:
                return (
                    f"messages.{at}.content.{j}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {use_id}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )
    for at, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        uses = [b.get("id") for _, b in _blocks(message, "tool_use")]
        if not uses:
            continue
        after = messages[at + 1] if at + 1 < len(messages) else None
        answered = Counter(
            b.get("tool_use_id")
            for _, b in (_blocks(after, "tool_result") if after is not None else [])
        )
        missing = [u for u, n in Counter(uses).items() if answered[u] < n]
        if missing:
            return (
                f"messages.{at + 1}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(str(m) for m in missing)}. Each `tool_use` block "
                "must have a corresponding `tool_result` block in the next message."
            )
    return None
