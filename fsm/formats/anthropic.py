"""The Anthropic Messages stream (``POST /v1/messages``, ``stream: true``).

Rules: ``shared/spec/formats.md`` ("Anthropic Messages", "What real recordings showed"). A call
opens at ``content_block_start`` of a ``tool_use`` block (its input may already be whole there,
or in ``message_start.message.content``); ``input_json_delta`` appends to the block at that
``index``; the stream ends at ``message_stop`` with the last ``stop_reason``; ``ping`` may come
anywhere; ``server_tool_use`` / ``mcp_tool_use`` and their results are the provider's, kept as
opaque blocks; a second ``message_start`` is an anomaly and the calls of the message it cut off
end ``aborted`` (reason ``second_message_start``): blocks of two messages are never merged.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import orjson

from fsm.formats.base import FormatHandler
from fsm.formats.core import StreamCore, utf8_len
from fsm.formats.turn import ANTHROPIC_STOPS, AnthropicTurn, Item, ItemToolCall, ItemTurn
from fsm.jsonutil import json_depth, loads_strict
from fsm.states import CallEnding, StreamState
from fsm.turn import CONTENT, REASONING

__all__ = ["SECOND_MESSAGE_START", "AnthropicHandler", "compact_json"]

_OPEN: Final = StreamState.OPEN

#: the reason of the calls of a message that a second ``message_start`` cut off
SECOND_MESSAGE_START: Final = "second_message_start"
_CUT_OFF: Final = CallEnding("abort", SECOND_MESSAGE_START)
#: the ending of a call whose block index a new block took while it was open
_INDEX_REUSED: Final = CallEnding("abort", "block_index_reused")

#: blocks whose input streams as ``input_json_delta`` but which the provider runs itself
_SERVER_TOOLS: Final = frozenset({"server_tool_use", "mcp_tool_use"})


def compact_json(value: Any) -> str:
    """``value`` as compact JSON text, keys in their order (the arguments of a call whose input
    came whole)."""
    try:
        return orjson.dumps(value).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):  # integers beyond 64 bits, deep nesting
        import json

        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class AnthropicHandler(FormatHandler):
    """Parses the events of one Anthropic Messages stream into an
    :class:`~fsm.formats.turn.AnthropicTurn`."""

    format: ClassVar[str] = "anthropic"
    turn_class: ClassVar[type[ItemTurn]] = AnthropicTurn
    article: ClassVar[str] = "an Anthropic Messages"
    dispatch_names: ClassVar[dict[str, str]] = {
        "content_block_delta": "block_delta",
        "content_block_start": "block_start",
        "content_block_stop": "block_stop",
        "message_start": "message_start",
        "message_delta": "message_delta",
        "message_stop": "message_stop",
        "ping": "ping",
        "error": "error",
    }

    def __init__(self, core: StreamCore) -> None:
        super().__init__(core)
        #: the open blocks of the current message, by index
        self.open: dict[int, Item] = {}
        #: every block of the current message, by index (to tell a reused index)
        self.blocks: dict[int, Item] = {}
        self.usage: dict[str, Any] = {}

    # -- the message ----------------------------------------------------------------------------
    def message_start(self, event: dict[str, Any]) -> None:
        """``message_start``: ids, model, usage; content already whole, a stop reason."""
        turn = self.the_turn()
        message = self.obj(event, "message", "")
        if message is None:
            message = {}
        turn.messages += 1
        if turn.messages > 1:
            cut = [item.call for item in turn.items if item.call is not None]
            self.anomaly(
                SECOND_MESSAGE_START,
                f"a second message_start (id {str(message.get('id'))[:80]!r}) in one stream; "
                f"the {len(cut)} call(s) of the message it cut off end aborted",
            )
            for call in cut:
                if call.forced is None:
                    call.forced = _CUT_OFF
            self.open = {}
            self.blocks = {}
        else:
            self.meta_id(message.get("id"), "the message id")
        self.meta_model(message.get("model"))
        usage = message.get("usage")
        if type(usage) is dict:
            self._usage(usage)
        content = message.get("content")
        if content is not None:
            if type(content) is not list:
                self.fail(f"must be a list, got {type(content).__name__}", "message.content")
            self.size = -1  # each block counted by its own size
            for i, block in enumerate(content):
                if self.core.status is not _OPEN:
                    return
                self.start(i, block, f"message.content[{i}]")
                self.stop(i)
        if self.core.status is not _OPEN:
            return  # a limit ended the stream (an id, an item): its turn has ended
        stop = self.string(message, "stop_reason", "message")
        if stop:
            self._stop_reason(stop)

    def _usage(self, usage: dict[str, Any]) -> None:
        merged = dict(self.usage)
        merged.update(usage)
        self.core.keep_usage(merged)
        if self.core.meta.usage is merged:
            self.usage = merged

    def message_delta(self, event: dict[str, Any]) -> None:
        """``message_delta``: the stop reason (the last one counts) and usage."""
        self.the_turn()
        delta = self.obj(event, "delta", "")
        if delta is not None:
            stop = self.string(delta, "stop_reason", "delta")
            if stop:
                self._stop_reason(stop)
        usage = self.obj(event, "usage", "")
        if usage is not None and self.core.status is _OPEN:
            self._usage(usage)

    def _stop_reason(self, stop: str) -> None:
        turn = self.the_turn()
        if stop not in ANTHROPIC_STOPS:
            if utf8_len(stop) > self.core.limits.max_id_bytes:
                self.core.limit(
                    "max_id_bytes",
                    f"a stop_reason is longer than {self.core.limits.max_id_bytes} bytes",
                )
                return
            self.anomaly(
                "unknown_finish_reason",
                f"stop_reason {stop[:80]!r} is not a known value; treated like 'end_turn'",
            )
        turn.finish(stop)
        from fsm.events import FinishReasonReceived

        self.core.events.append(FinishReasonReceived(choice=0, finish_reason=stop))

    def message_stop(self, event: dict[str, Any]) -> None:
        """``message_stop``: the stream ended normally (blocks never stopped are closed, with
        an anomaly)."""
        self.the_turn()
        for index in list(self.open):
            self.anomaly(
                "unclosed_block",
                f"content block {index} had no content_block_stop before message_stop",
            )
            self.stop(index)
            if self.core.status is not _OPEN:
                return
        self.core.end("done", None)

    def ping(self, event: dict[str, Any]) -> None:
        """``ping``: ignored, wherever it comes."""

    # -- blocks ---------------------------------------------------------------------------------
    def block_start(self, event: dict[str, Any]) -> None:
        """``content_block_start``."""
        self.the_turn()
        index = self.integer(event, "index", "")
        if index is None:
            self.fail("content_block_start must have an index", "index")
        self.start(index, event.get("content_block"), "content_block")

    def start(self, index: int, block: Any, path: str) -> None:
        """Open block ``index`` (``block`` as the provider sent it)."""
        turn = self.the_turn()
        if type(block) is not dict:
            self.fail(f"must be an object, got {type(block).__name__}", path)
        kind = block.get("type")
        if type(kind) is not str or not kind:
            self.fail("must be a non-empty string", f"{path}.type")
        if index in self.blocks:
            still_open = self.open.pop(index, None)
            self.anomaly(
                "block_index_reused",
                f"content_block_start at index {index}, which this message already had "
                f"({'still open' if still_open is not None else 'stopped'}); a new block"
                + ("; the call of the open one ends aborted" if still_open is not None
                   and still_open.call is not None else ""),
            )  # fmt: skip
            call = still_open.call if still_open is not None else None
            if call is not None and call.forced is None:
                # its deltas now go to the new block: it can never be whole
                call.forced = _INDEX_REUSED
        value: Any = None
        if kind == "tool_use" and block.get("input"):
            # the whole input of a programmatic call is its arguments (checked as arguments,
            # against max_json_depth), not part of the block kept verbatim
            value = block["input"]
            block = {key: inner for key, inner in block.items() if key != "input"}
        raw = self.keep(block, "a content block")
        if raw is None:
            return
        item = Item(kind, block, index, turn.messages, raw)
        if kind == "tool_use":
            cid = self.string(block, "id", path)
            name = self.string(block, "name", path) or ""
            if cid is None:
                self.anomaly(
                    "missing_call_id",
                    f"the tool_use block at index {index} has no id; it stays '' (never invented)",
                )
            call = self.open_call(turn, index, cid or "", name, "function", None)
            if call is None:
                return
            item.call = call
            if value is not None:  # programmatic tool calling: the input is already whole
                item.whole = True
                self.whole_input(call, value)
        elif kind == "text":
            text = self.string(block, "text", path)
            if text:
                self.text(item, "text", CONTENT, text)
        elif kind == "thinking":
            text = self.string(block, "thinking", path)
            if text:
                self.text(item, "thinking", REASONING, text)
            signature = self.string(block, "signature", path)
            if signature:
                self.text(item, "signature", None, signature)
        if self.core.status is not _OPEN:
            return
        turn.items.append(item)
        self.blocks[index] = item
        self.open[index] = item

    def whole_input(self, call: ItemToolCall, value: Any) -> None:
        """The input of a call that came whole: its compact JSON is the arguments; nested
        deeper than ``max_json_depth`` the call ends ``aborted`` (``limit:max_json_depth``)."""
        core = self.core
        limit = core.limits.max_json_depth
        if json_depth(value, limit) > limit:
            call.exceed("max_json_depth", drop=True)
            core.anomaly(
                "limit_exceeded",
                f"choice {call.choice} call {call.ordinal}: its input nests deeper than {limit} "
                "levels (Limits.max_json_depth); the call will end aborted",
                call.choice,
            )
            return
        self.arguments(call, compact_json(value))

    def block_delta(self, event: dict[str, Any]) -> None:
        """``content_block_delta``: ``input_json_delta``, ``text_delta``, ``thinking_delta``,
        ``signature_delta``, ``citations_delta``."""
        index = event.get("index")
        item = self.open.get(index) if type(index) is int else None
        delta = event.get("delta")
        if item is not None and type(delta) is dict:
            call = item.call
            if call is not None:
                fragment = delta.get("partial_json")
                if type(fragment) is str and delta.get("type") == "input_json_delta":
                    # the hot path: ToolCall.append within the limits
                    if fragment:
                        if item.whole:
                            self._input_and_deltas(item)
                        if (
                            fragment.isascii()
                            and call.over_limit is None
                            and self.core.fragment(call, fragment, len(fragment))
                        ):
                            return
                        self.arguments(call, fragment)
                    return
            elif item.kind == "text":
                text = delta.get("text")
                if type(text) is str and delta.get("type") == "text_delta":
                    if text:
                        self.text(item, "text", CONTENT, text)
                    return
        self._block_delta(event, index, item, delta)

    def _input_and_deltas(self, item: Item) -> None:
        call = item.call
        assert call is not None
        item.whole = False
        self.anomaly(
            "input_and_deltas",
            f"content block {item.index}: input_json_delta after a non-empty input in "
            "content_block_start; the deltas are the arguments",
        )
        call.replace_arguments("", 0)

    def _block_delta(
        self, event: dict[str, Any], index: Any, item: Item | None, delta: Any
    ) -> None:
        self.the_turn()
        if index is None or type(index) is not int or index < 0:
            self.integer(event, "index", "")  # a wrong type fails here
            self.fail("content_block_delta must have an index", "index")
        if type(delta) is not dict:
            self.fail(f"must be an object, got {type(delta).__name__}", "delta")
        kind = delta.get("type")
        if type(kind) is not str:
            self.fail("must be a string", "delta.type")
        if item is None:
            self.anomaly(
                "orphan_delta",
                f"a {kind[:40]} for content block {index}, which is not open, was dropped",
            )
            return
        if kind == "input_json_delta":
            fragment = self.string(delta, "partial_json", "delta")
            if item.call is not None:
                return  # a null or empty fragment
            if item.kind in _SERVER_TOOLS or item.raw_input is not None:
                if fragment:
                    self.text(item, "input", None, fragment)
                    item.raw_input = item.texts["input"]
                return
        elif kind == "text_delta" and item.kind == "text":
            text = self.string(delta, "text", "delta")
            if text:
                self.text(item, "text", CONTENT, text)
            return
        elif kind == "thinking_delta" and item.kind == "thinking":
            text = self.string(delta, "thinking", "delta")
            if text:
                self.text(item, "thinking", REASONING, text)
            return
        elif kind == "signature_delta" and item.kind == "thinking":
            text = self.string(delta, "signature", "delta")
            if text:
                self.text(item, "signature", None, text)
            return
        elif kind == "citations_delta":
            citation = delta.get("citation")
            if citation is not None:
                raw = self.keep(citation, "a citation")
                if raw is not None:
                    if item.citations is None:
                        item.citations = []
                    item.citations.append(raw)
            return
        elif kind not in _DELTA_TYPES:
            self.anomaly(
                "unknown_delta", f"a content_block_delta of unknown type {kind[:80]!r} was ignored"
            )
            return
        self.anomaly(
            "wrong_delta",
            f"a {kind[:40]} for content block {index}, a {item.kind[:40]} block, was dropped",
        )

    def block_stop(self, event: dict[str, Any]) -> None:
        """``content_block_stop``."""
        self.the_turn()
        index = self.integer(event, "index", "")
        if index is None:
            self.fail("content_block_stop must have an index", "index")
        if index not in self.open:
            self.anomaly(
                "orphan_stop", f"content_block_stop for content block {index}, which is not open"
            )
            return
        self.stop(index)

    def stop(self, index: int) -> None:
        """Close block ``index``: a call with no argument bytes gets its whole input (``{}``
        when empty); a server tool's streamed input is parsed into its block."""
        item = self.open.pop(index, None)
        if item is None:
            return
        item.done = True
        call = item.call
        if call is not None and call.argument_bytes == 0 and call.over_limit is None:
            data = item.data
            value = data.get("input")
            self.arguments(call, compact_json(value if value is not None else {}))
        elif item.raw_input is not None:
            limit = self.core.limits.max_json_depth
            try:
                value = loads_strict(item.raw_input.value())
                if json_depth(value, limit) >= limit:  # the block holds it one level deeper
                    raise ValueError("nested too deep")
            except (ValueError, RecursionError):
                self.anomaly(
                    "invalid_server_input",
                    f"content block {index}: the {item.kind[:40]} input is not valid JSON "
                    f"nested at most {limit - 1} deep; kept as text",
                )
            else:
                data = item.data
                data["input"] = value
                item.replace(data)

    def unknown(self, event: dict[str, Any], kind: str) -> None:
        """An unknown event type is an anomaly; a Responses event type is a change of format
        (a protocol error)."""
        if kind.startswith("response."):
            self.fail(
                f"the stream changed format: a Responses API event ({kind[:80]!r}) in an "
                "Anthropic Messages stream",
                "type",
            )
        self.the_turn()
        super().unknown(event, kind)


_DELTA_TYPES: Final = frozenset(
    {"input_json_delta", "text_delta", "thinking_delta", "signature_delta", "citations_delta"}
)
