"""The OpenAI Responses API stream (``POST /v1/responses``, ``stream: true``).

Rules: ``shared/spec/formats.md`` ("Responses API", "What real recordings showed"). A call
opens at ``response.output_item.added`` (``function_call``, or ``custom_tool_call`` whose input is
free text); deltas are routed by ``item_id``, else by ``output_index``; a ``.done`` text wins over
the deltas (a difference is an anomaly); the first terminal event (``response.completed``,
``response.incomplete``, ``response.failed``, ``error``) decides, EOF without one aborts.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from fsm.formats.base import FormatHandler
from fsm.formats.core import StreamCore
from fsm.formats.turn import Item, ItemTurn, ResponsesTurn
from fsm.states import CallEnding, StreamState
from fsm.turn import CONTENT, REASONING, REFUSAL
from fsm.vocab import ANTHROPIC_EVENTS

__all__ = ["HOSTED_FAMILIES", "ResponsesHandler"]

_OPEN: Final = StreamState.OPEN

#: event families of items the provider runs itself (their ``output_item.done`` carries the
#: whole item): their progress events are ignored without an anomaly
HOSTED_FAMILIES: Final = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "code_interpreter_call_code",
        "image_generation_call",
        "mcp_call",
        "mcp_call_arguments",
        "mcp_list_tools",
        "tool_search_call",
        "computer_call",
        "local_shell_call",
        "shell_call",
        "apply_patch_call",
        "audio",
        "audio_transcript",
    }
)
#: other informational events, ignored (what they say arrives again in ``output_item.done``)
_IGNORED: Final = frozenset(
    {
        "response.output_text.annotation.added",
        "response.content_part.added",
        "response.reasoning_summary_part.added",
    }
)

#: the ending of a call whose output_index a new item took while it was open
_INDEX_REUSED: Final = CallEnding("abort", "duplicate_output_index")
#: the kinds of item that are client calls, and their call type
_CALL_TYPES: Final = {"function_call": "function", "custom_tool_call": "custom"}
#: the text field of each call kind
_CALL_TEXT: Final = {"function_call": "arguments", "custom_tool_call": "input"}


class ResponsesHandler(FormatHandler):
    """Parses the events of one Responses API stream into a
    :class:`~fsm.formats.turn.ResponsesTurn`."""

    format: ClassVar[str] = "responses"
    turn_class: ClassVar[type[ItemTurn]] = ResponsesTurn
    article: ClassVar[str] = "a Responses API"
    dispatch_names: ClassVar[dict[str, str]] = {
        "response.function_call_arguments.delta": "call_delta",
        "response.custom_tool_call_input.delta": "call_delta",
        "response.output_text.delta": "output_text_delta",
        "response.refusal.delta": "refusal_delta",
        "response.reasoning_summary_text.delta": "summary_delta",
        "response.reasoning_text.delta": "reasoning_text_delta",
        "response.function_call_arguments.done": "call_done",
        "response.custom_tool_call_input.done": "call_done",
        "response.output_text.done": "output_text_done",
        "response.refusal.done": "refusal_done",
        "response.reasoning_summary_text.done": "summary_done",
        "response.reasoning_text.done": "reasoning_text_done",
        "response.content_part.done": "content_part_done",
        "response.reasoning_summary_part.done": "summary_part_done",
        "response.output_item.added": "item_added",
        "response.output_item.done": "item_done",
        "response.created": "response_event",
        "response.in_progress": "response_event",
        "response.queued": "response_event",
        "response.completed": "completed",
        "response.incomplete": "incomplete",
        "response.failed": "failed",
        "error": "error",
    }

    def __init__(self, core: StreamCore) -> None:
        super().__init__(core)
        #: open items by their (first) id, and by output_index
        self.by_id: dict[str, Item] = {}
        self.by_output: dict[int, Item] = {}

    # -- routing ----------------------------------------------------------------------------------
    def route(self, event: dict[str, Any], what: str) -> Item | None:
        """The open item an event is for: by ``item_id``, else by ``output_index``; ``None``
        (an anomaly: the event is dropped) if neither names one."""
        item_id = event.get("item_id")
        item = self.by_id.get(item_id) if type(item_id) is str else None
        if item is not None:
            return item
        if item_id is not None and type(item_id) is not str:
            self.fail(f"must be a string or null, got {type(item_id).__name__}", "item_id")
        index = self.integer(event, "output_index", "")
        item = self.by_output.get(index) if index is not None else None
        if item is None:
            self.the_turn()
            self.anomaly(
                "orphan_delta",
                f"{what} for no open item (item_id {str(item_id)[:80]!r}, output_index "
                f"{index}) was dropped",
            )
        return item

    # -- calls ------------------------------------------------------------------------------------
    def call_delta(self, event: dict[str, Any]) -> None:
        """``response.function_call_arguments.delta`` / ``custom_tool_call_input.delta``."""
        item_id = event.get("item_id")
        item = self.by_id.get(item_id) if type(item_id) is str else None
        if item is None:
            item = self.route(event, event["type"])
            if item is None:
                return
        delta = event.get("delta")
        if type(delta) is not str:
            if delta is None:
                return
            self.fail(f"must be a string, got {type(delta).__name__}", "delta")
        call = item.call
        if call is None:
            self.anomaly(
                "orphan_delta",
                f"{event['type']} for output item {item.index}, which is a {item.kind[:40]} and "
                "not a call, was dropped",
            )
            return
        if delta:
            # the hot path: ToolCall.append within the call's and the stream's limits
            if (
                delta.isascii()
                and call.over_limit is None
                and self.core.fragment(call, delta, len(delta))
            ):
                return
            self.arguments(call, delta)

    def call_done(self, event: dict[str, Any]) -> None:
        """``response.function_call_arguments.done`` (``arguments``) /
        ``custom_tool_call_input.done`` (``input``): the whole text wins."""
        item = self.route(event, event["type"])
        if item is None or item.call is None:
            return
        key = "arguments" if event["type"].startswith("response.function") else "input"
        value = self.string(event, key, "")
        if value is not None:
            self.done_arguments(item.call, value, event["type"])
        name = self.string(event, "name", "")
        if name and not item.call.name:
            item.call.merge(None, name, None, self.core)

    # -- text -------------------------------------------------------------------------------------
    def _text_delta(self, event: dict[str, Any], prefix: str, index_key: str, field: int) -> None:
        item_id = event.get("item_id")
        item = self.by_id.get(item_id) if type(item_id) is str else None
        if item is None:
            item = self.route(event, event["type"])
            if item is None:
                return
        delta = event.get("delta")
        if type(delta) is not str:
            delta = self.string(event, "delta", "")
        if delta:
            index = event.get(index_key)
            if type(index) is not int:
                index = self.integer(event, index_key, "") or 0
            self.text(item, (prefix, index), field, delta)

    def output_text_delta(self, event: dict[str, Any]) -> None:
        """``response.output_text.delta``."""
        self._text_delta(event, "c", "content_index", CONTENT)

    def refusal_delta(self, event: dict[str, Any]) -> None:
        """``response.refusal.delta``."""
        self._text_delta(event, "c", "content_index", REFUSAL)

    def summary_delta(self, event: dict[str, Any]) -> None:
        """``response.reasoning_summary_text.delta``."""
        self._text_delta(event, "s", "summary_index", REASONING)

    def reasoning_text_delta(self, event: dict[str, Any]) -> None:
        """``response.reasoning_text.delta`` (reasoning content, e.g. gpt-oss)."""
        self._text_delta(event, "r", "content_index", REASONING)

    def _text_done(
        self, event: dict[str, Any], prefix: str, index_key: str, field: int, key: str
    ) -> None:
        item = self.route(event, event["type"])
        if item is None:
            return
        value = self.string(event, key, "")
        if value is not None:
            index = self.integer(event, index_key, "") or 0
            self.done_text(item, (prefix, index), field, value, event["type"])

    def output_text_done(self, event: dict[str, Any]) -> None:
        """``response.output_text.done``: its ``text`` wins."""
        self._text_done(event, "c", "content_index", CONTENT, "text")

    def refusal_done(self, event: dict[str, Any]) -> None:
        """``response.refusal.done``."""
        self._text_done(event, "c", "content_index", REFUSAL, "refusal")

    def summary_done(self, event: dict[str, Any]) -> None:
        """``response.reasoning_summary_text.done``."""
        self._text_done(event, "s", "summary_index", REASONING, "text")

    def reasoning_text_done(self, event: dict[str, Any]) -> None:
        """``response.reasoning_text.done``."""
        self._text_done(event, "r", "content_index", REASONING, "text")

    def content_part_done(self, event: dict[str, Any]) -> None:
        """``response.content_part.done``: the part's whole text wins."""
        item = self.route(event, event["type"])
        part = self.obj(event, "part", "")
        if item is None or part is None:
            return
        self._part(item, part, self.integer(event, "content_index", "") or 0, event["type"])

    def _part(self, item: Item, part: dict[str, Any], index: int, what: str) -> None:
        kind = part.get("type")
        if kind == "output_text":
            value = self.string(part, "text", "part")
            field = CONTENT
        elif kind == "refusal":
            value = self.string(part, "refusal", "part")
            field = REFUSAL
        elif kind == "reasoning_text":
            value = self.string(part, "text", "part")
            self.done_text(item, ("r", index), REASONING, value or "", what)
            return
        else:
            return
        if value is not None:
            self.done_text(item, ("c", index), field, value, what)

    def summary_part_done(self, event: dict[str, Any]) -> None:
        """``response.reasoning_summary_part.done``."""
        item = self.route(event, event["type"])
        part = self.obj(event, "part", "")
        if item is None or part is None:
            return
        value = self.string(part, "text", "part")
        if value is not None:
            index = self.integer(event, "summary_index", "") or 0
            self.done_text(item, ("s", index), REASONING, value, event["type"])

    # -- items ------------------------------------------------------------------------------------
    def _item(self, event: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
        item = event.get("item")
        if type(item) is not dict:
            self.fail(f"must be an object, got {type(item).__name__}", "item")
        kind = item.get("type")
        if type(kind) is not str or not kind:
            self.fail("must be a non-empty string", "item.type")
        index = self.integer(event, "output_index", "")
        if index is None:
            index = len(self.the_turn().items)
        return item, kind, index

    def item_added(self, event: dict[str, Any]) -> None:
        """``response.output_item.added``: a new output item (a call opens here)."""
        data, kind, index = self._item(event)
        turn = self.the_turn()
        raw = self.keep(data, "an output item")
        if raw is None:
            return
        old = self.by_output.get(index)
        if old is not None:
            self.anomaly(
                "duplicate_output_index",
                f"output_index {index} was added again while its item is open; the new item "
                "gets its events"
                + ("; the call of the open one ends aborted" if old.call is not None else ""),
            )
            if old.call is not None and old.call.forced is None:
                # events routed by output_index now reach the new item: it can never be whole
                old.call.forced = _INDEX_REUSED
        item = Item(kind, data, index, raw=raw)
        item_id = self.string(data, "id", "item")
        call_type = _CALL_TYPES.get(kind)
        if call_type is not None:
            cid = self.string(data, "call_id", "item")
            name = self.string(data, "name", "item") or ""
            text = self.string(data, _CALL_TEXT[kind], "item")
            if cid is None:
                self.anomaly(
                    "missing_call_id",
                    f"the {kind} at output_index {index} has no call_id; its id stays '' (never "
                    "invented)",
                )
            call = self.open_call(turn, index, cid or "", name, call_type, item_id)
            if call is None:
                return
            item.call = call
            if text:
                self.arguments(call, text)
        turn.items.append(item)
        if item_id:
            self.by_id[item_id] = item
        self.by_output[index] = item

    def item_done(self, event: dict[str, Any]) -> None:
        """``response.output_item.done``: the whole item (matched by ``output_index``, then by
        id); its texts win; an id that changed is an anomaly (the first is kept)."""
        data, kind, index = self._item(event)
        item_id = self.string(data, "id", "item")
        item = self.by_output.get(index)
        if item is None and item_id:
            item = self.by_id.get(item_id)
        if item is None:
            self.anomaly(
                "item_without_added",
                f"output_item.done for output_index {index} that was never added; the whole "
                "item is kept",
            )
            self.item_added(event)
            if self.core.status is not _OPEN:
                return
            item = self.by_output.get(index)
            if item is None:
                return
        raw = self.keep(data, "an output item")
        if raw is None:
            return
        first = item.first_ids.get("id")
        if item_id is not None and first is not None and item_id != first:
            self.anomaly(
                "id_changed",
                f"output item {index}: id {str(first)[:80]!r} at output_item.added is "
                f"{item_id[:80]!r} at output_item.done; the first is kept",
            )
            data["id"] = first
            raw = b""
        changed = True  # whether the done item replaces the one kept
        if kind != item.kind:
            self.anomaly(
                "item_type_changed",
                f"output item {index}: type {item.kind[:40]!r} at output_item.added is "
                f"{kind[:40]!r} at output_item.done; the first is kept",
            )
            changed = False
        call = item.call
        if call is not None and changed:
            cid = self.string(data, "call_id", "item")
            if cid is not None and call.id and cid != call.id:
                self.anomaly(
                    "id_changed",
                    f"output item {index}: call_id {call.id[:80]!r} at output_item.added is "
                    f"{cid[:80]!r} at output_item.done; the first is kept",
                )
                data["call_id"] = call.id
                raw = b""
            elif cid and not call.id:
                call.merge(cid, None, None, self.core)
            name = self.string(data, "name", "item")
            if name and not call.name:
                call.merge(None, name, None, self.core)
            text = self.string(data, _CALL_TEXT[item.kind], "item")
            if text is not None:
                self.done_arguments(call, text, "output_item.done")
        elif kind == "message" and changed:
            content = data.get("content")
            if type(content) is list:
                for ci, part in enumerate(content):
                    if type(part) is dict:
                        self._part(item, part, ci, "output_item.done")
        elif kind == "reasoning" and changed:
            summary = data.get("summary")
            if type(summary) is list:
                for si, part in enumerate(summary):
                    if type(part) is dict:
                        text = self.string(part, "text", "item.summary")
                        if text is not None:
                            self.done_text(item, ("s", si), REASONING, text, "output_item.done")
            content = data.get("content")
            if type(content) is list:
                for ci, part in enumerate(content):
                    if type(part) is dict and part.get("type") == "reasoning_text":
                        text = self.string(part, "text", "item.content")
                        if text is not None:
                            self.done_text(item, ("r", ci), REASONING, text, "output_item.done")
        if self.core.status is not _OPEN:
            return
        if changed:
            item.replace(data, raw)
        item.done = True
        if self.by_output.get(index) is item:
            del self.by_output[index]
        for key in (first, item_id):
            if type(key) is str and self.by_id.get(key) is item:
                del self.by_id[key]

    # -- the response -----------------------------------------------------------------------------
    def _response(self, event: dict[str, Any]) -> dict[str, Any]:
        response = self.obj(event, "response", "")
        self.the_turn()
        if response is None:
            return {}
        self.meta_id(response.get("id"), "the response id")
        self.meta_model(response.get("model"))
        created = response.get("created_at")
        meta = self.core.meta
        if meta.created is None and type(created) is int and 0 <= created < 2**63:
            meta.created = created
        usage = response.get("usage")
        if usage is not None and self.core.status is _OPEN:
            self.core.keep_usage(usage)
        return response

    def response_event(self, event: dict[str, Any]) -> None:
        """``response.created`` / ``in_progress`` / ``queued``: ids and model."""
        self._response(event)

    def completed(self, event: dict[str, Any]) -> None:
        """``response.completed``: the stream ended normally."""
        self._response(event)
        if self.core.status is not _OPEN:
            return
        turn = self.the_turn()
        turn.finish("completed")
        self.core.end("done", None)

    def incomplete(self, event: dict[str, Any]) -> None:
        """``response.incomplete``: ``max_output_tokens`` -> calls ``truncated`` / ``length``,
        ``content_filter`` -> ``aborted``, any other reason -> ``aborted`` /
        ``incomplete:<reason>``."""
        response = self._response(event)
        if self.core.status is not _OPEN:
            return
        details = response.get("incomplete_details")
        reason = details.get("reason") if type(details) is dict else None
        if type(reason) is not str or not reason:
            reason = "unknown"
        elif len(reason) > 128:
            reason = reason[:128]
        turn = self.the_turn()
        turn.finish(reason)
        if isinstance(turn, ResponsesTurn):
            turn.incomplete_event = True
        self.core.end("done", None)

    def failed(self, event: dict[str, Any]) -> None:
        """``response.failed``: the stream ends ``error`` with the response's error."""
        response = self._response(event)
        if self.core.status is not _OPEN:
            return
        self.the_turn().finish("failed")
        error = response.get("error")
        if type(error) is dict:
            self.error({"error": error})
        else:
            self.end_error("response failed", None)

    def unknown(self, event: dict[str, Any], kind: str) -> None:
        """Progress events of hosted tools are ignored; any other unknown type is an anomaly
        (an Anthropic event type is a change of format: a protocol error)."""
        if kind in ANTHROPIC_EVENTS:
            self.fail(
                f"the stream changed format: an Anthropic Messages event ({kind!r}) in a "
                "Responses API stream",
                "type",
            )
        if kind in _IGNORED:
            return
        parts = kind.split(".")
        if len(parts) >= 3 and parts[0] == "response" and parts[1] in HOSTED_FAMILIES:
            return
        self.the_turn()
        super().unknown(event, kind)
