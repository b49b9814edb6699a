"""What the Responses and Anthropic handlers share: an event loop over the SSE events of a
format whose events are typed JSON objects, dispatched by ``type`` to a method of the format,
and the helpers those methods share. A handler is one :class:`~fsm.formats.core.Format` over
the one :class:`~fsm.formats.core.StreamCore`: limits, anomalies, protocol errors (with event
number and byte offset), endings (through :meth:`fsm.formats.turn.ItemTurn.end`) and events
are the core's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Final, NoReturn

import orjson

from fsm.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    cd_choice,
    cd_text,
    rd_choice,
    rd_text,
    refusal_delta,
)
from fsm.formats.core import Frames, StreamCore, error_message, json_type, utf8_len
from fsm.formats.turn import Item, ItemToolCall, ItemTurn, Text
from fsm.jsonutil import dumps_kept, json_depth, loads_strict
from fsm.states import StreamState
from fsm.toolcall import FLUSH_EVERY

__all__ = ["FormatHandler", "utf8_len"]

_OPEN: Final = StreamState.OPEN
#: the deepest value orjson serializes (deeper raises)
_ORJSON_DEPTH: Final = 254

_new_event: Final = object.__new__


def _content_delta(text: str) -> Event:
    event: Event = _new_event(ContentDelta)  # built through its slots, as the chat format does
    cd_choice(event, 0)
    cd_text(event, text)
    return event


def _reasoning_delta(text: str) -> Event:
    event: Event = _new_event(ReasoningDelta)
    rd_choice(event, 0)
    rd_text(event, text)
    return event


def _refusal(text: str) -> Event:
    return refusal_delta(0, text)


#: the event of a text fragment, by field (CONTENT, REASONING, REFUSAL)
_TEXT_EVENTS: Final = (_content_delta, _reasoning_delta, _refusal)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class FormatHandler:
    """The part of a Responses or Anthropic handler that does not depend on the format."""

    format: ClassVar[str]
    turn_class: ClassVar[type[ItemTurn]]
    #: event type -> method name
    dispatch_names: ClassVar[dict[str, str]]

    def __init__(self, core: StreamCore) -> None:
        self.core = core
        self.turn: ItemTurn | None = None
        #: bytes of the SSE event being processed (-1: a chunk fed as an object)
        self.size = -1
        self.dispatch: dict[str, Callable[[dict[str, Any]], None]] = {
            kind: getattr(self, name) for kind, name in self.dispatch_names.items()
        }

    # -- the event loop ---------------------------------------------------------------------------
    def frames(self, frames: Frames) -> None:
        """SSE events (``name``, data, byte offset) from the parser's framer."""
        core = self.core
        loads = orjson.loads
        process = self.process
        for name, payload, offset in frames:
            core.event_number += 1
            core.offset = offset
            self.size = len(payload)
            if core.status is not _OPEN:
                self.after_end(name, payload)
            elif payload[:1] == b"{" and name != "error":
                try:
                    event = loads(payload)
                except orjson.JSONDecodeError:
                    event = core.decode_slow(payload)
                process(event)
            else:
                self.rare_frame(name, payload)

    def rare_frame(self, name: str, payload: bytes) -> None:
        """An event named ``error``, ``[DONE]``, empty data, or JSON after whitespace."""
        core = self.core
        stripped = payload.strip()
        if name == "error":
            try:
                event = loads_strict(payload) if stripped[:1] == b"{" else None
            except (ValueError, RecursionError):
                event = None
            if type(event) is dict:
                self.error(event)
            else:
                core.error_event(payload)
        elif stripped == b"[DONE]":
            self.done_sentinel()
        elif not stripped:
            core.anomaly("empty_event", "an SSE event with empty data was ignored")
        else:
            self.process(core.decode_slow(payload))

    def chunk(self, event: Any) -> None:
        """One event fed with ``receive_chunk`` (no SSE event size known)."""
        self.size = -1
        self.process(event)

    def process(self, event: Any) -> None:
        """One event of the format (a decoded dict)."""
        if type(event) is not dict:
            self.fail(f"an event must be a JSON object, got {json_type(event)}", None)
        kind = event.get("type")
        method = self.dispatch.get(kind) if type(kind) is str else None
        if method is not None:
            method(event)
        else:
            self.other(event)

    def other(self, event: dict[str, Any]) -> None:
        """An event whose ``type`` is not one the handler dispatches."""
        kind = event.get("type")
        if "choices" in event:
            self.fail(
                f"the stream changed format: a Chat Completions chunk in {self.article} stream",
                "choices",
            )
        if kind is None:
            self.fail(f"{self.article} event must have a type", "type")
        if type(kind) is not str:
            self.fail(f"must be a string, got {json_type(kind)}", "type")
        self.unknown(event, kind)

    article: ClassVar[str] = "a"

    def unknown(self, event: dict[str, Any], kind: str) -> None:
        """An event type the handler does not know."""
        self.anomaly("unknown_event", f"an event of unknown type {kind[:80]!r} was ignored")

    def after_end(self, name: str, payload: bytes) -> None:
        """An SSE event after the terminal event: ``[DONE]`` is harmless; anything else is an
        anomaly (``data_after_end``)."""
        if payload.strip() == b"[DONE]" and name != "error":
            return
        self.core.anomaly(
            "data_after_end", "an event after the terminal event of the stream was ignored"
        )

    def done_sentinel(self) -> None:
        """``data: [DONE]``: not an end in this format. After the terminal event it is
        harmless; before it, an anomaly (``done_before_end``), and the stream goes on."""
        if self.core.status is _OPEN:
            self.anomaly(
                "done_before_end",
                f"[DONE] before the terminal event of {self.article} stream was ignored (it is "
                "not how this format ends)",
            )

    # -- helpers ----------------------------------------------------------------------------------
    def fail(self, reason: str, path: str | None) -> NoReturn:
        """A protocol error at the current event."""
        self.core.fail(reason, path)

    def anomaly(self, kind: str, detail: str) -> None:
        """Report an anomaly of the turn."""
        self.core.anomaly(kind, detail, 0)

    def the_turn(self) -> ItemTurn:
        """The stream's one turn, created at its first event."""
        turn = self.turn
        if turn is None:
            core = self.core
            turn = self.turn = self.turn_class(0, core.meta)
            core.turns[0] = turn
        return turn

    def error(self, event: dict[str, Any]) -> None:
        """An ``error`` event (its ``message`` / ``code`` at the top or in an ``error``
        object): the stream ends ``error``."""
        error = event.get("error")
        source = error if type(error) is dict else event
        message = source.get("message")
        code = source.get("code")
        if type(code) is not str or not code:
            code = source.get("type") if source is error else None
        if type(message) is not str or not message:
            message = error_message(error if error is not None else event)
        self.end_error(message, code if type(code) is str and code else None)

    def end_error(self, message: str, code: str | None) -> None:
        """End the stream with an error."""
        self.the_turn()
        core = self.core
        if code is not None and utf8_len(code) <= core.limits.max_id_bytes:
            core.error_code = code
        core.end("error", message)

    def keep(self, value: Any, what: str) -> bytes | None:
        """Check a verbatim item (an output item, a content block, a citation) and return it as
        compact JSON bytes, the form the parser keeps it in; ``None`` when a limit ended the
        stream.

        It must nest at most ``max_json_depth`` deep (else the stream ends,
        ``limit:max_json_depth``: the store could not keep it); its size counts against
        ``max_stream_bytes`` (the size of the SSE event that carried it, at most; its JSON size
        for a chunk fed as an object), and each item counts against ``max_items``."""
        core = self.core
        limit = core.limits.max_json_depth
        try:
            raw: bytes | None = orjson.dumps(value)  # fails past 254 levels
        except (TypeError, orjson.JSONEncodeError):
            raw = None
        if raw is None or (limit < _ORJSON_DEPTH and raw.count(b"[") + raw.count(b"{") > limit):
            if json_depth(value, limit) > limit:
                core.limit(
                    "max_json_depth",
                    f"{what} nests deeper than {limit} levels (Limits.max_json_depth): it "
                    "could not be kept",
                )
                return None
            if raw is None:
                try:
                    raw = dumps_kept(value)
                except ValueError:
                    self.fail(
                        f"{what} holds a number beyond a double (such as 1e400), which JSON "
                        "text cannot keep",
                        None,
                    )
        # orjson's bytes keep the capacity it grew (up to 8x the text): keep an exact copy
        raw = memoryview(raw).tobytes()
        size = self.size if self.size >= 0 else len(raw)
        if not core.count_header_bytes(size):
            return None
        turn = self.turn or self.the_turn()
        turn.kept += 1
        if turn.kept > core.limits.max_items:
            core.limit(
                "max_items",
                f"the stream carried more than {core.limits.max_items} items (output items, "
                "content blocks, citations)",
            )
            return None
        return raw

    def text(self, item: Item, key: Any, field: int | None, value: str) -> bool:
        """Append a text fragment (a non-empty ``str``) to ``item``'s text ``key``, within the
        limits, with its event; ``False`` when a limit ended the stream."""
        core = self.core
        turn = self.turn or self.the_turn()
        nbytes = len(value) if value.isascii() else utf8_len(value)
        if not core.text_room(turn, nbytes, field is not None):
            return False
        if field is not None:
            turn.text_bytes += nbytes
        text = item.texts.get(key)
        if text is None:
            text = item.texts[key] = Text(field)
        parts = text.parts
        parts.append(value)
        text.nbytes += nbytes
        if len(parts) >= FLUSH_EVERY:
            text.blocks.append("".join(parts))
            parts.clear()
        if field is not None:
            core.events.append(_TEXT_EVENTS[field](value))
        return True

    def done_text(self, item: Item, key: Any, field: int | None, value: str, what: str) -> None:
        """A ``.done`` text for ``item``'s text ``key``: it wins over the deltas; a difference
        from what they built is an anomaly (``done_mismatch``)."""
        text = item.texts.get(key)
        if text is None:
            if value:
                self.text(item, key, field, value)
            return
        held = text.value()
        if held == value:
            return
        self.anomaly(
            "done_mismatch",
            f"{what}: the done text ({len(value)} characters) differs from the deltas "
            f"({len(held)} characters); the done text is kept",
        )
        if value.startswith(held):
            self.text(item, key, field, value[len(held) :])
            return
        nbytes = utf8_len(value)
        core = self.core
        turn = self.the_turn()
        grow = nbytes - text.nbytes
        if field is not None and turn.text_bytes + grow > core.max_text_bytes:
            core.limit("max_text_bytes", f"choice {turn.index} text exceeds the limit")
            return
        if core.stream_bytes + max(grow, 0) > core.max_stream_bytes:
            core.stream_limit()
            return
        core.stream_bytes += max(grow, 0)
        if field is not None:
            turn.text_bytes += grow
        text.replace(value, nbytes)

    def open_call(
        self, turn: ItemTurn, index: int, cid: str, name: str, typ: str, item_id: str | None
    ) -> ItemToolCall | None:
        """Open a client call within the limits (:meth:`StreamCore.admit_call`; ``typ`` is the
        format's own word, not counted); ``None`` when a limit ended the stream."""
        core = self.core
        header = core.admit_call(turn, cid, name, typ, item_id, typ_sent=False)
        if header is None:
            return None
        call = ItemToolCall(
            choice=turn.index, ordinal=turn.call_count, index=index, id=header.cid,
            name=header.name, type=header.typ, item_id=header.item_id,
        )  # fmt: skip
        core.register_call(turn, call, header.over)
        return call

    def arguments(self, call: ItemToolCall, fragment: str) -> None:
        """Append an argument fragment (non-empty) within the limits."""
        if call.over_limit is None:
            self.core.arguments(call, fragment, utf8_len(fragment))

    def done_arguments(self, call: ItemToolCall, value: str, what: str) -> None:
        """The whole arguments from a ``.done`` event: they win; with no delta before, they
        simply are the arguments; a difference from the deltas is an anomaly."""
        if call.over_limit is not None:
            return
        held = call.raw_arguments
        if held == value:
            return
        if not held:
            self.arguments(call, value)
            return
        self.anomaly(
            "done_mismatch",
            f"{what}: the done arguments ({len(value)} characters) differ from the deltas "
            f"({len(held)} characters); the done text is kept",
        )
        if value.startswith(held):
            self.arguments(call, value[len(held) :])
            return
        core = self.core
        nbytes = utf8_len(value)
        if nbytes > core.max_argument_bytes:
            core.over_limit(call)
            return
        grow = max(nbytes - call.argument_bytes, 0)
        if core.stream_bytes + grow > core.max_stream_bytes:
            core.stream_limit()
            return
        core.stream_bytes += grow
        call.replace_arguments(value, nbytes)

    def string(self, obj: dict[str, Any], key: str, path: str) -> str | None:
        """``obj[key]`` when it is a string or absent/null (``None``); any other type is a
        protocol error."""
        value = obj.get(key)
        if value is None or type(value) is str:
            return value
        self.fail(f"must be a string or null, got {json_type(value)}", _at(path, key))

    def obj(self, obj: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
        """``obj[key]`` when it is an object or absent/null; else a protocol error."""
        value = obj.get(key)
        if value is None or type(value) is dict:
            return value
        self.fail(f"must be an object or null, got {json_type(value)}", _at(path, key))

    def integer(self, obj: dict[str, Any], key: str, path: str) -> int | None:
        """``obj[key]`` when it is a non-negative integer (at most 2**31-1) or absent/null;
        else a protocol error."""
        value = obj.get(key)
        if value is None:
            return None
        if type(value) is not int or not 0 <= value <= 2**31 - 1:
            self.fail(
                f"must be a non-negative integer (at most {2**31 - 1}) or null, got "
                f"{json_type(value)}",
                _at(path, key),
            )
        return value

    def meta_id(self, value: Any, what: str) -> None:
        """The response / message id: the first is kept, a change is an anomaly."""
        meta = self.core.meta
        if type(value) is not str or not value:
            return
        if meta.response_id is None:
            if self.core.identifier(value, what):
                meta.response_id = value
        elif value != meta.response_id:
            self.anomaly(
                "id_changed",
                f"{what} changed from {meta.response_id[:80]!r} to {value[:80]!r}; the first "
                "is kept",
            )

    def meta_model(self, value: Any) -> None:
        """The model name (the first is kept)."""
        meta = self.core.meta
        if (
            meta.model is None
            and type(value) is str
            and value
            and self.core.identifier(value, "the model")
        ):
            meta.model = value
