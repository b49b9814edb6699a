"""History for each API: the stored, format-neutral rows rendered for Chat Completions, the
Responses API or Anthropic Messages.

What is stored (issue 17). History rows stay format-neutral: an assistant message's text
(``content``), its calls (``tool_calls``: id, type, name, arguments byte-exact) and their results
(tool messages linked to their call's row). What only the provider that wrote the turn
understands is kept verbatim beside them, in ``messages.provider_items``, with the message's
``format``: the turn's output items (Responses) or content blocks (Anthropic) in output order,
as :meth:`Turn.output_items() <fsm.parser.Turn.output_items>` gives them, except that each tool
call item is stored as a *reference* to its row (``{"fsm:call": position, ...}`` with the item's
own provider-only fields, such as its Responses item ``id`` and ``status``): a call's id, name and
arguments exist once, in ``tool_calls``, where the database checks them.

**The rendering rule.** :func:`render` turns the chat-shaped history that the store reads into
the target API's shape:

* An assistant message rendered for the API that wrote it is its stored items, in order, each
  reference replaced by the call rebuilt from its row: reasoning items with
  ``encrypted_content``, thinking blocks with their signatures, ``redacted_thinking``, built-in
  tool items and annotations come back verbatim, so the turn round-trips byte-exact.
* Rendered for another API, it is only what every API understands: its text and its calls.
  Everything provider-bound is dropped: Responses reasoning items, ``encrypted_content`` and
  built-in tool items (``web_search_call``, ``mcp_call``, ...), Anthropic ``thinking`` /
  ``redacted_thinking`` blocks and server tool blocks (``server_tool_use``,
  ``*_tool_result``), annotations and citations. (Reasoning *text* stays in the neutral
  ``reasoning`` column: ``include_reasoning=True`` gives it to Chat Completions as
  ``reasoning_content``.) A Responses ``custom_tool_call`` (free-text input) is OpenAI's: for
  Chat Completions it is a ``{"type": "custom", "custom": {"name", "input"}}`` tool call; for
  Anthropic, which has no free-text tools, a ``tool_use`` whose ``input`` is
  ``{"input": <the text>}``.
* The tool blocks stay valid for the target API: Responses gets one ``function_call_output``
  (``custom_tool_call_output``) per ``call_id`` right after the calls; Anthropic gets ONE user
  message holding a ``tool_result`` block per call, in call order, right after the assistant
  message; Chat Completions one ``tool`` message per call.
* Anthropic takes system prompts as the request's ``system`` parameter, not as messages:
  ``system`` and ``developer`` messages are left out of ``format="anthropic"`` (read them with
  ``format="chat"``).

Pure functions, no I/O: the sync and the async store share them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Literal

from fsm.formats.ids import anthropic_safe
from fsm.formats.render import anthropic_messages, iter_output_items, responses_input
from fsm.store.errors import InvalidTurnError

__all__ = [
    "CALL_REF",
    "HistoryFormat",
    "RenderedHistory",
    "check_format",
    "iter_stored_items",
    "render",
    "stored_items",
]

#: A history format: the API the history is rendered for.
HistoryFormat = Literal["chat", "responses", "anthropic"]
#: The key of a call reference in stored provider items (its value: the call's position).
CALL_REF: Final = "fsm:call"
_FORMATS: Final = ("chat", "responses", "anthropic")
_TYPED: Final = ("responses", "anthropic")
_RESPONSES_CALLS: Final = ("function_call", "custom_tool_call")
#: The fields of a call item that its row holds (left out of the stored reference).
_RESPONSES_CALL_FIELDS: Final = ("call_id", "name", "arguments", "input")
_ANTHROPIC_CALL_FIELDS: Final = ("id", "name", "input")


def check_format(value: object) -> HistoryFormat:
    """``value`` as a history format, or :class:`ValueError` naming the three."""
    if value == "chat" or value == "responses" or value == "anthropic":
        return value
    raise ValueError(f"format must be 'chat', 'responses' or 'anthropic', not {value!r}")


def stored_items(turn: Any) -> tuple[str, list[dict[str, Any]] | None]:
    """The ``format`` and ``provider_items`` columns an assistant message of ``turn`` is stored
    with: ``("chat", None)`` for a Chat Completions turn; else the turn's output items with each
    call item replaced by a reference to its call (``{"fsm:call": position}`` plus the item's
    other provider-only fields)."""
    fmt, items = iter_stored_items(turn)
    return fmt, None if items is None else list(items)


def iter_stored_items(turn: Any) -> tuple[str, Iterator[dict[str, Any]] | None]:
    """:func:`stored_items`, the items decoded one at a time (for a writer that serializes each
    before the next: a turn of large items is never held decoded whole). Iterating raises
    :class:`~fsm.store.errors.InvalidTurnError` where the items and the calls disagree."""
    fmt = getattr(turn, "format", "chat")
    if fmt not in ("responses", "anthropic"):
        return "chat", None
    return fmt, _stored(turn, fmt)


def _stored(turn: Any, fmt: str) -> Iterator[dict[str, Any]]:
    calls = list(turn.tool_calls)
    position = 0
    for item in iter_output_items(turn):
        kind = item.get("type")
        is_call = kind in _RESPONSES_CALLS if fmt == "responses" else kind == "tool_use"
        if not is_call:
            yield item
            continue
        key = "call_id" if fmt == "responses" else "id"
        if position >= len(calls) or calls[position].id != item.get(key):
            raise InvalidTurnError(
                f"the turn's {kind} item {item.get(key)!r} is not its call {position} "
                f"({calls[position].id if position < len(calls) else 'none'!r}): the output "
                "items and the calls of the turn disagree"
            )
        fields = _RESPONSES_CALL_FIELDS if fmt == "responses" else _ANTHROPIC_CALL_FIELDS
        ref = {k: v for k, v in item.items() if k not in fields}
        ref[CALL_REF] = position
        yield ref
        position += 1
    if position != len(calls):
        raise InvalidTurnError(
            f"the turn has {len(calls)} calls but {position} call items in its output"
        )


# -- rendering ---------------------------------------------------------------------------------
class RenderedHistory(list[dict[str, Any]]):
    """A history rendered for the Responses API or Anthropic: a plain list of its items or
    messages, which also says how many stored messages it renders (:attr:`message_count`:
    an assistant message becomes several Responses items, a tool block one Anthropic message),
    so that a writer can name the seq it expects to append at."""

    message_count: int

    def __init__(self, items: list[dict[str, Any]], message_count: int) -> None:
        super().__init__(items)
        self.message_count = message_count


def render(
    messages: Sequence[Mapping[str, Any]],
    provider: Mapping[int, tuple[Any, Any]],
    fmt: HistoryFormat,
    seqs: Sequence[int],
) -> list[dict[str, Any]]:
    """``messages`` (the chat-shaped history the store read, message ``i`` at seq
    ``seqs[i]``) rendered for ``fmt``; ``provider``: seq -> (format, provider items) of the
    assistant messages that have them. See the module docstring for the rule."""
    if fmt == "chat":
        return [dict(m) for m in messages]
    out = RenderedHistory([], len(messages))
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.get("role")
        if role == "assistant":
            calls = _calls_of(message)
            n = len(calls)
            results = messages[i + 1 : i + 1 + n]
            written, items = provider.get(seqs[i], (None, None))
            source = written if written in _TYPED and isinstance(items, list) else "chat"
            rebuilt = _rebuild(source, items, calls) if source != "chat" else []
            neutral = [
                {"id": c[0], "name": c[2], "arguments": c[3], "custom": c[1] == "custom"}
                for c in calls
            ]
            text = _text(message.get("content")) or None
            if fmt == "responses":
                outputs = [_responses_output(r.get("content")) for r in results]
                out.extend(responses_input(source, rebuilt, text, neutral, outputs))
            else:
                answers = [_anthropic_output(r.get("content")) for r in results]
                out.extend(anthropic_messages(source, rebuilt, text, neutral, answers))
            i += 1 + n
            continue
        if fmt == "responses":
            out.append({"role": role, "content": _responses_content(message.get("content"))})
        elif role == "user":
            out.append({"role": "user", "content": _anthropic_content(message.get("content"))})
        # anthropic: system / developer messages go in the request's ``system`` parameter
        i += 1
    if fmt == "anthropic":
        # ids and inputs as the API takes them (fsm.formats.ids: reversible, pairs kept)
        return RenderedHistory(anthropic_safe(out), out.message_count)
    return out


def _rebuild(source: str, items: Any, calls: list[tuple[str, str, str, str]]) -> list[Any]:
    """The turn's output items as :meth:`Turn.output_items` gave them: each stored reference
    replaced by the call rebuilt from its row."""
    rebuilt: list[Any] = []
    for item in items:
        if not (isinstance(item, dict) and CALL_REF in item):
            rebuilt.append(item)
            continue
        ref = {k: v for k, v in item.items() if k != CALL_REF}
        cid, kind, name, arguments = calls[item[CALL_REF]]
        if source == "responses":
            key = "input" if kind == "custom" else "arguments"
            rebuilt.append({**ref, "call_id": cid, "name": name, key: arguments})
        else:
            rebuilt.append({**ref, **_tool_use(calls[item[CALL_REF]])})
    return rebuilt


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(id, type, name, arguments or input) of a chat-shaped assistant message's calls."""
    found: list[tuple[str, str, str, str]] = []
    for call in message.get("tool_calls") or []:
        if call.get("type") == "custom":
            custom = call["custom"]
            found.append((call["id"], "custom", custom["name"], custom["input"]))
        else:
            function = call["function"]
            found.append(
                (call["id"], call.get("type", "function"), function["name"], function["arguments"])
            )
    legacy = message.get("function_call")
    if legacy is not None:
        found.append(("", "function", legacy["name"], legacy["arguments"]))
    return found


def _text(content: Any) -> str:
    """The text of a chat content (a string, or parts whose text parts are joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _parse_input(arguments: str) -> Any:
    if not arguments.strip(" \t\r\n"):
        return {}
    return json.loads(arguments)


# -- Responses ---------------------------------------------------------------------------------
def _responses_content(content: Any) -> Any:
    """A chat content as Responses input content: text as it is, parts as input parts."""
    if not isinstance(content, list):
        return content if content is not None else ""
    parts: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "input_text", "text": part.get("text", "")})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append({"type": "input_image", "image_url": url, "detail": "auto"})
        else:
            parts.append(part)
    return parts


def _responses_output(content: Any) -> Any:
    """A tool message's content as a Responses ``output`` (text, or input parts)."""
    return _responses_content(content) if isinstance(content, list) else (content or "")


# -- Anthropic ---------------------------------------------------------------------------------
def _anthropic_content(content: Any) -> Any:
    """A chat content as Anthropic content: text as it is, text parts as text blocks."""
    if not isinstance(content, list):
        return content if content is not None else ""
    blocks: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            blocks.append({"type": "image", "source": {"type": "url", "url": url}})
        else:
            blocks.append(part)
    return blocks


def _tool_use(call: tuple[str, str, str, str]) -> dict[str, Any]:
    cid, kind, name, arguments = call
    value = {"input": arguments} if kind == "custom" else _parse_input(arguments)
    return {"type": "tool_use", "id": cid, "name": name, "input": value}


def _anthropic_output(content: Any) -> Any:
    """A tool message's content as an Anthropic ``tool_result`` content."""
    return _anthropic_content(content) if isinstance(content, list) else (content or "")
