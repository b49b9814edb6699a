"""The turn and call of a Responses API or Anthropic Messages stream.

:class:`ItemTurn` is a :class:`~fsm.turn.Turn` that also keeps, in output order, every item
(Responses output item, Anthropic content block) the stream carried, verbatim: what the next
request must send back (encrypted reasoning, thinking signatures, built-in tool items). Its text
fields are read from those items, so a ``.done`` text that wins over the deltas is the text of
the turn. :class:`ItemToolCall` is a :class:`~fsm.toolcall.ToolCall` with the Responses item id
and a way for a ``.done`` text to replace what the deltas built.

Both end by the same ending table (:mod:`fsm.states`) and the same machine as Chat Completions
calls: only the mapping from the format's stop signal to the table's row is the format's own.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, ClassVar, Final

from fsm.jsonutil import dumps_kept, loads_strict
from fsm.shapes import tool_call_entry
from fsm.states import (
    ANTHROPIC_LENGTH_STOPS,
    ANTHROPIC_NORMAL_STOPS,
    CALL_STOPS,
    PAUSE_TURN,
    STOP_SIGNALS,
    CallEnding,
    Ending,
    ToolCallState,
    fire,
    stop_ending,
)
from fsm.toolcall import FLUSH_EVERY, ToolCall, pair_surrogates
from fsm.turn import CONTENT, REASONING, REFUSAL, Meta, Turn
from fsm.types import FunctionToolCall

__all__ = [
    "ANTHROPIC_LENGTH_STOPS", "ANTHROPIC_NORMAL_STOPS", "ANTHROPIC_STOPS", "PAUSE_TURN",
    "AnthropicTurn", "Item", "ItemToolCall", "ItemTurn", "ResponsesTurn", "Text",
]  # fmt: skip

_OPENED: Final = ToolCallState.OPENED


class Text:
    """One text of an item (a message part, a summary part, a block's text or thinking), kept
    in two levels like a call's arguments so memory tracks its size. ``field`` says which text
    of the turn it belongs to (:data:`~fsm.turn.CONTENT`, ``REASONING``, ``REFUSAL``), or
    ``None`` (a signature)."""

    __slots__ = ("blocks", "field", "nbytes", "parts")

    def __init__(self, field: int | None) -> None:
        self.field = field
        self.parts: list[str] = []
        self.blocks: list[str] = []
        self.nbytes = 0

    def add(self, text: str, nbytes: int) -> None:
        """Append a fragment of ``nbytes`` UTF-8 bytes."""
        parts = self.parts
        parts.append(text)
        self.nbytes += nbytes
        if len(parts) >= FLUSH_EVERY:
            self.blocks.append("".join(parts))
            parts.clear()

    def value(self) -> str:
        """The whole text (surrogate halves that pair up joined)."""
        if not self.parts and len(self.blocks) == 1:
            return self.blocks[0]
        text = pair_surrogates("".join(self.blocks) + "".join(self.parts))
        self.blocks[:] = [text]
        self.parts.clear()
        return text

    def replace(self, text: str, nbytes: int) -> None:
        """Make the text ``text`` (a ``.done`` text that won)."""
        self.blocks[:] = [text]
        self.parts.clear()
        self.nbytes = nbytes


class Item:
    """One output item / content block, in output order.

    The item as the provider sent it (``output_item.added`` or ``content_block_start``,
    replaced by ``output_item.done`` when that arrives) is kept as compact JSON bytes
    (:attr:`raw`, a fraction of the memory of the decoded tree); :attr:`data` decodes a fresh
    copy. ``texts`` holds the texts streamed into it, by a key of the format (content index,
    summary index, ``"text"``); ``call`` the client call it is, if any; ``citations`` the
    citations streamed into an Anthropic block (compact JSON bytes each)."""

    __slots__ = (
        "call", "citations", "done", "first_ids", "index", "kind", "message", "raw", "raw_input",
        "texts", "whole",
    )  # fmt: skip

    def __init__(
        self, kind: str, data: dict[str, Any], index: int, message: int = 0, raw: bytes = b""
    ) -> None:
        self.kind = kind
        #: the item as compact JSON (:func:`fsm.jsonutil.dumps_kept` of ``data``)
        self.raw = raw or memoryview(dumps_kept(data)).tobytes()
        self.index = index
        #: which message of the stream it belongs to (an Anthropic stream with a second
        #: ``message_start`` has two)
        self.message = message
        self.texts: dict[Any, Text] = {}
        self.call: ItemToolCall | None = None
        #: whether the item is whole (``output_item.done`` / ``content_block_stop``)
        self.done = False
        #: the streamed JSON of a provider-executed tool's input (server_tool_use, mcp_tool_use)
        self.raw_input: Text | None = None
        #: whether a call's input came whole at its start (no delta expected)
        self.whole = False
        #: citations streamed into the block (``citations_delta``), as compact JSON
        self.citations: list[bytes] | None = None
        #: the ids first seen (``id``, ``call_id``): kept when a later event changes them
        self.first_ids: dict[str, Any] = {
            key: data[key] for key in ("id", "call_id") if type(data.get(key)) is str
        }

    @property
    def data(self) -> dict[str, Any]:
        """A fresh decoded copy of the item as the provider sent it (citations streamed into
        it included)."""
        data: dict[str, Any] = loads_strict(self.raw)
        if self.citations is not None:
            citations = data.get("citations")
            if type(citations) is not list:
                citations = data["citations"] = []
            citations.extend(loads_strict(c) for c in self.citations)
        return data

    def replace(self, data: dict[str, Any], raw: bytes = b"") -> None:
        """Make ``data`` the item as the provider sent it (``raw``: its compact JSON, if known)."""
        self.raw = raw or memoryview(dumps_kept(data)).tobytes()

    def text(self, key: Any, field: int | None) -> Text:
        """The text of ``key``, created empty if new."""
        text = self.texts.get(key)
        if text is None:
            text = self.texts[key] = Text(field)
        return text


class ItemToolCall(ToolCall):
    """A call of a Responses or Anthropic turn (see :class:`~fsm.toolcall.ToolCall`).

    ``item_id`` is the Responses output item's id (``fc_...``, ``ctc_...``; ``None`` for an
    Anthropic call, whose block id is :attr:`id`)."""

    __slots__ = ("forced", "item_id")

    def __init__(
        self,
        *,
        choice: int,
        ordinal: int,
        index: int | None,
        id: str,
        name: str,
        type: str,
        item_id: str | None = None,
    ) -> None:
        super().__init__(choice=choice, ordinal=ordinal, index=index, id=id, name=name, type=type)
        self.item_id = item_id
        #: an ending decided before the stream ended (the calls of an Anthropic message that a
        #: second ``message_start`` cut off), else ``None``
        self.forced: CallEnding | None = None

    def replace_arguments(self, text: str, nbytes: int) -> None:
        """Make the arguments ``text`` (a ``.done`` text that differs from the deltas: the
        ``done`` text wins). The caller checked the limits."""
        self._parts = [text] if text else []
        self._blocks = []
        self.argument_bytes = nbytes
        if text and self.state is _OPENED:
            fire(self, "accumulate")

    def to_dict(self) -> FunctionToolCall:
        """The call as a Chat Completions ``tool_calls[]`` entry; a custom call in the custom
        shape (``{"id", "type": "custom", "custom": {"name", "input"}}``)."""
        return tool_call_entry(self.id, self.type, self.name, self.arguments, custom=self.custom)


class ItemTurn(Turn):
    """The one turn of a Responses or Anthropic stream (choice index 0): a
    :class:`~fsm.turn.Turn` whose text comes from its items, which it keeps verbatim in output
    order (:meth:`output_items`)."""

    __slots__ = ("items", "kept", "messages")

    format: ClassVar[str] = "?"

    def __init__(self, index: int, meta: Meta) -> None:
        super().__init__(index, meta)
        #: every item / block, in arrival order
        self.items: list[Item] = []
        #: how many messages the stream started (Anthropic ``message_start``)
        self.messages = 0
        #: how many verbatim items the stream carried (``Limits.max_items``)
        self.kept = 0

    # -- text, read from the items --------------------------------------------------------------
    def _field(self, field: int) -> str | None:
        out = [t.value() for item in self.ordered_items() for t in item.texts.values()
               if t.field == field and t.nbytes]  # fmt: skip
        return "".join(out) if out else None

    @property
    def content(self) -> str | None:
        """The text of the turn's messages (Responses ``output_text``, Anthropic ``text``
        blocks), concatenated in output order; ``None`` if there is none."""
        return self._field(CONTENT)

    @property
    def reasoning(self) -> str | None:
        """Reasoning summaries and reasoning text (Responses), thinking (Anthropic)."""
        return self._field(REASONING)

    @property
    def refusal(self) -> str | None:
        """Refusal text (Responses ``refusal`` parts)."""
        return self._field(REFUSAL)

    def ordered_items(self) -> list[Item]:
        """The items in output order."""
        return self.items

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The client calls in output order."""
        if self._final_calls is not None:
            return list(self._final_calls)
        return [item.call for item in self.ordered_items() if item.call is not None]

    # -- ending -----------------------------------------------------------------------------------
    def ending_row(self, how: str) -> Ending:
        """The row of the ending table for a stream that ended ``how`` (the format's own
        mapping of its stop signal)."""
        raise NotImplementedError

    def final_call_order(self) -> list[ToolCall]:
        """The calls in output order."""
        return list(self.tool_calls)

    def forced_ending(self, call: ToolCall) -> CallEnding | None:
        """The ending an item's own terminal status gave ``call`` (:attr:`ItemToolCall.forced`)."""
        return call.forced if isinstance(call, ItemToolCall) else None

    def promises_calls(self) -> bool:
        """Whether the stop signal says calls were made (then a turn with none is
        ``no_tool_calls``)."""
        return False

    # -- what goes back ---------------------------------------------------------------------------
    def iter_output_items(self) -> Iterator[dict[str, Any]]:
        """The items of :meth:`output_items`, decoded one at a time (a writer that serializes
        each before the next holds one decoded item at a time, not the whole turn's)."""
        make = _responses_item if self.format == "responses" else _anthropic_block
        for item in self.ordered_items():
            yield make(item)

    def to_json(self) -> dict[str, Any]:
        """The turn as ``fsm parse --json`` prints it: the Chat Completions shape, plus
        ``format`` and the types of its items in output order."""
        out = super().to_json()
        out["format"] = self.format
        out["items"] = [item.kind for item in self.ordered_items()]
        for entry, call in zip(out["tool_calls"], self.tool_calls, strict=True):
            if call.item_id is not None:
                entry["item_id"] = call.item_id
        return out


class ResponsesTurn(ItemTurn):
    """The turn of an OpenAI Responses API stream. ``finish_reason`` is ``"completed"``, the
    ``incomplete_details.reason`` of ``response.incomplete`` (``"max_output_tokens"``,
    ``"content_filter"``, ...), ``"failed"`` for ``response.failed``, else ``None``."""

    __slots__ = ("incomplete_event",)

    format: ClassVar[str] = "responses"

    def __init__(self, index: int, meta: Meta) -> None:
        super().__init__(index, meta)
        #: whether ``response.incomplete`` ended the stream (whatever its reason says: a reason
        #: of ``"completed"`` there is still an incomplete response)
        self.incomplete_event = False

    def ordered_items(self) -> list[Item]:
        """The items by ``output_index`` (then arrival)."""
        items = self.items
        for a, b in itertools.pairwise(items):
            if b.index < a.index:
                return sorted(items, key=_by_index)
        return items

    def ending_row(self, how: str) -> Ending:
        return stop_ending("responses", how, self.finish_reason, incomplete=self.incomplete_event)


#: every Anthropic stop reason with a meaning of its own (:data:`fsm.states.STOP_SIGNALS`)
ANTHROPIC_STOPS: Final = frozenset(STOP_SIGNALS["anthropic"])


class AnthropicTurn(ItemTurn):
    """The turn of an Anthropic Messages stream. ``finish_reason`` is the last ``stop_reason``
    (``message_delta``, or ``message_start`` when the message came whole)."""

    __slots__ = ()

    format: ClassVar[str] = "anthropic"

    def ending_row(self, how: str) -> Ending:
        return stop_ending("anthropic", how, self.finish_reason)

    def promises_calls(self) -> bool:
        return self.finish_reason in CALL_STOPS["anthropic"]


def _texts(item: Item, prefix: str) -> list[tuple[int, str]]:
    return sorted(
        (key[1], text.value())
        for key, text in item.texts.items()
        if type(key) is tuple and key[0] == prefix
    )


def _responses_item(item: Item) -> dict[str, Any]:
    data: dict[str, Any] = item.data  # a fresh copy
    data.update(item.first_ids)
    call = item.call
    if call is not None:
        data["arguments" if item.kind == "function_call" else "input"] = call.arguments
        if call.id:
            data["call_id"] = call.id
        if call.name:
            data["name"] = call.name
    elif not item.done and item.kind == "message":
        content: list[dict[str, Any]] = []
        for key, text in item.texts.items():
            if text.field == 2:  # REFUSAL
                content.append({"type": "refusal", "refusal": text.value()})
            else:
                content.append({"type": "output_text", "text": text.value(), "annotations": []})
            del key
        data["content"] = content
    elif not item.done and item.kind == "reasoning":
        data["summary"] = [{"type": "summary_text", "text": t} for _, t in _texts(item, "s")]
        reasoning = _texts(item, "r")
        if reasoning:
            data["content"] = [{"type": "reasoning_text", "text": t} for _, t in reasoning]
    return data


def _anthropic_block(item: Item) -> dict[str, Any]:
    data: dict[str, Any] = item.data  # a fresh copy
    call = item.call
    if call is not None:
        with contextlib.suppress(ValueError):  # not JSON (incomplete): the block's input stays
            data["input"] = call.input
        if call.id:
            data["id"] = call.id
        if call.name:
            data["name"] = call.name
    elif item.kind == "text":
        text = item.texts.get("text")
        data["text"] = text.value() if text is not None else data.get("text") or ""
    elif item.kind == "thinking":
        thinking = item.texts.get("thinking")
        signature = item.texts.get("signature")
        data["thinking"] = thinking.value() if thinking is not None else data.get("thinking", "")
        data["signature"] = (
            signature.value() if signature is not None else data.get("signature", "")
        )
    return data


def _by_index(item: Item) -> int:
    return item.index
