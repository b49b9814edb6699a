"""What the Responses and Anthropic handlers share, and the format detector.

A handler is installed on one :class:`~fsm.parser.StreamParser`: it replaces, on that instance
only, the parser's event loop (``_frames``: SSE events from the one framer), its chunk entry
(``_process``), and what ``[DONE]`` and an event after the end mean. Everything else is the
parser's own: limits, anomalies, protocol errors (with event number and byte offset), ending
(``_end``, through :meth:`fsm.formats.turn.ItemTurn.end`), events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Final, NoReturn

import orjson

from fsm.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallOpened,
    _cd_choice,
    _cd_text,
    _rd_choice,
    _rd_text,
    _refusal_delta,
)
from fsm.formats import detect
from fsm.formats.turn import Item, ItemToolCall, ItemTurn, Text
from fsm.jsonutil import dumps_kept, json_depth, loads_strict
from fsm.states import StreamState
from fsm.toolcall import FLUSH_EVERY

if TYPE_CHECKING:
    from fsm.parser import StreamParser

__all__ = ["Detector", "FormatHandler"]

_OPEN: Final = StreamState.OPEN
#: the deepest value orjson serializes (deeper raises)
_ORJSON_DEPTH: Final = 254
_HOOKS: Final = ("_frames", "_process", "_after_end", "_done_sentinel")

Frames = list[tuple[str, bytes, int]]


def _json_type(value: Any) -> str:
    from fsm.parser import _json_type as json_type

    return json_type(value)


def utf8_len(text: str) -> int:
    """UTF-8 size of ``text`` (lone surrogates counted as 3 bytes)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


_new_event: Final = object.__new__


def _content_delta(text: str) -> Event:
    event: Event = _new_event(ContentDelta)  # built through its slots, as the parser does
    _cd_choice(event, 0)
    _cd_text(event, text)
    return event


def _reasoning_delta(text: str) -> Event:
    event: Event = _new_event(ReasoningDelta)
    _rd_choice(event, 0)
    _rd_text(event, text)
    return event


def _refusal(text: str) -> Event:
    return _refusal_delta(0, text)


#: the event of a text fragment, by field (CONTENT, REASONING, REFUSAL)
_TEXT_EVENTS: Final = (_content_delta, _reasoning_delta, _refusal)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Detector:
    """Installed by ``format="auto"``: the first event that carries JSON decides the format;
    the detector then installs that format's handler (or, for Chat Completions, removes
    itself) and hands it the rest of the input."""

    def __init__(self, parser: StreamParser) -> None:
        self.parser = parser

    def install(self) -> None:
        """Hook the detector into the parser."""
        self.parser._frames = self.frames  # type: ignore[method-assign]
        self.parser._process = self.process  # type: ignore[method-assign]

    def _choose(self, event: Any) -> None:
        parser = self.parser
        for hook in _HOOKS:
            parser.__dict__.pop(hook, None)
        fmt = detect(event)
        parser._format = fmt
        if fmt != "chat":
            from fsm.formats import install

            install(parser, fmt)

    def frames(self, frames: Frames) -> None:
        """Frames before the format is known: chat rules for events without JSON, the first
        JSON event decides."""
        from fsm.parser import StreamParser

        parser = self.parser
        for i, frame in enumerate(frames):
            payload = frame[1]
            if payload.lstrip()[:1] == b"{" and parser._status is _OPEN:
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    event = None
                self._choose(event)
                parser._frames(frames[i:])
                return
            StreamParser._frames(parser, [frame])

    def process(self, chunk: Any) -> None:
        """A chunk (``receive_chunk``) before the format is known: it decides."""
        self._choose(chunk)
        self.parser._process(chunk)


class FormatHandler:
    """The part of a Responses or Anthropic handler that does not depend on the format."""

    format: ClassVar[str]
    turn_class: ClassVar[type[ItemTurn]]
    #: event type -> method name
    dispatch_names: ClassVar[dict[str, str]]

    def __init__(self, parser: StreamParser) -> None:
        self.parser = parser
        self.turn: ItemTurn | None = None
        #: bytes of the SSE event being processed (-1: a chunk fed as an object)
        self.size = -1
        self.dispatch: dict[str, Callable[[dict[str, Any]], None]] = {
            kind: getattr(self, name) for kind, name in self.dispatch_names.items()
        }

    def install(self) -> None:
        """Hook the handler into the parser."""
        parser = self.parser
        parser._format = self.format
        parser._frames = self.frames  # type: ignore[method-assign]
        parser._process = self.chunk  # type: ignore[method-assign,assignment]
        parser._after_end = self.after_end  # type: ignore[method-assign]
        parser._done_sentinel = self.done_sentinel  # type: ignore[method-assign]

    # -- the event loop ---------------------------------------------------------------------------
    def frames(self, frames: Frames) -> None:
        """SSE events (``name``, data, byte offset) from the parser's framer."""
        parser = self.parser
        loads = orjson.loads
        process = self.process
        for name, payload, offset in frames:
            parser._event_number += 1
            parser._offset = offset
            self.size = len(payload)
            if parser._status is not _OPEN:
                self.after_end(name, payload)
            elif payload[:1] == b"{" and name != "error":
                try:
                    event = loads(payload)
                except orjson.JSONDecodeError:
                    event = parser._decode_slow(payload)
                process(event)
            else:
                self.rare_frame(name, payload)

    def rare_frame(self, name: str, payload: bytes) -> None:
        """An event named ``error``, ``[DONE]``, empty data, or JSON after whitespace."""
        parser = self.parser
        stripped = payload.strip()
        if name == "error":
            try:
                event = loads_strict(payload) if stripped[:1] == b"{" else None
            except (ValueError, RecursionError):
                event = None
            if type(event) is dict:
                self.error(event)
            else:
                parser._error_event(payload)
        elif stripped == b"[DONE]":
            self.done_sentinel()
        elif not stripped:
            parser._anomaly("empty_event", "an SSE event with empty data was ignored")
        else:
            self.process(parser._decode_slow(payload))

    def chunk(self, event: Any) -> None:
        """One event fed with ``receive_chunk`` (no SSE event size known)."""
        self.size = -1
        self.process(event)

    def process(self, event: Any) -> None:
        """One event of the format (a decoded dict)."""
        if type(event) is not dict:
            self.fail(f"an event must be a JSON object, got {_json_type(event)}", None)
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
            self.fail(f"must be a string, got {_json_type(kind)}", "type")
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
        self.parser._anomaly(
            "data_after_end", "an event after the terminal event of the stream was ignored"
        )

    def done_sentinel(self) -> None:
        """``data: [DONE]``: not an end in this format. After the terminal event it is
        harmless; before it, an anomaly (``done_before_end``), and the stream goes on."""
        if self.parser._status is _OPEN:
            self.anomaly(
                "done_before_end",
                f"[DONE] before the terminal event of {self.article} stream was ignored (it is "
                "not how this format ends)",
            )

    # -- helpers ----------------------------------------------------------------------------------
    def fail(self, reason: str, path: str | None) -> NoReturn:
        """A protocol error at the current event."""
        self.parser._fail(reason, path)

    def anomaly(self, kind: str, detail: str) -> None:
        """Report an anomaly of the turn."""
        self.parser._anomaly(kind, detail, 0)

    def the_turn(self) -> ItemTurn:
        """The stream's one turn, created at its first event."""
        turn = self.turn
        if turn is None:
            parser = self.parser
            turn = self.turn = self.turn_class(0, parser._meta)
            parser._turns[0] = turn
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
            from fsm.parser import _error_message

            message = _error_message(error if error is not None else event)
        self.end_error(message, code if type(code) is str and code else None)

    def end_error(self, message: str, code: str | None) -> None:
        """End the stream with an error."""
        self.the_turn()
        parser = self.parser
        if code is not None and utf8_len(code) <= parser.limits.max_id_bytes:
            parser._error_code = code
        parser._end("error", message)

    def keep(self, value: Any, what: str) -> bytes | None:
        """Check a verbatim item (an output item, a content block, a citation) and return it as
        compact JSON bytes, the form the parser keeps it in; ``None`` when a limit ended the
        stream.

        It must nest at most ``max_json_depth`` deep (else the stream ends,
        ``limit:max_json_depth``: the store could not keep it); its size counts against
        ``max_stream_bytes`` (the size of the SSE event that carried it, at most; its JSON size
        for a chunk fed as an object), and each item counts against ``max_items``."""
        parser = self.parser
        limit = parser.limits.max_json_depth
        try:
            raw: bytes | None = orjson.dumps(value)  # fails past 254 levels
        except (TypeError, orjson.JSONEncodeError):
            raw = None
        if raw is None or (limit < _ORJSON_DEPTH and raw.count(b"[") + raw.count(b"{") > limit):
            if json_depth(value, limit) > limit:
                parser._limit(
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
        if not parser.count_header_bytes(size):
            return None
        turn = self.turn or self.the_turn()
        turn.kept += 1
        if turn.kept > parser.limits.max_items:
            parser._limit(
                "max_items",
                f"the stream carried more than {parser.limits.max_items} items (output items, "
                "content blocks, citations)",
            )
            return None
        return raw

    def text(self, item: Item, key: Any, field: int | None, value: str) -> bool:
        """Append a text fragment (a non-empty ``str``) to ``item``'s text ``key``, within the
        limits, with its event; ``False`` when a limit ended the stream."""
        parser = self.parser
        turn = self.turn or self.the_turn()
        nbytes = len(value) if value.isascii() else utf8_len(value)
        if field is not None:
            if turn.text_bytes + nbytes > parser._max_text_bytes:
                parser._limit("max_text_bytes", f"choice {turn.index} text exceeds the limit")
                return False
            turn.text_bytes += nbytes
        stream = parser._stream_bytes + nbytes
        if stream > parser._max_stream_bytes:
            parser._stream_limit()
            return False
        parser._stream_bytes = stream
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
            parser._events.append(_TEXT_EVENTS[field](value))
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
        parser = self.parser
        turn = self.the_turn()
        grow = nbytes - text.nbytes
        if field is not None and turn.text_bytes + grow > parser._max_text_bytes:
            parser._limit("max_text_bytes", f"choice {turn.index} text exceeds the limit")
            return
        if parser._stream_bytes + max(grow, 0) > parser._max_stream_bytes:
            parser._stream_limit()
            return
        parser._stream_bytes += max(grow, 0)
        if field is not None:
            turn.text_bytes += grow
        text.replace(value, nbytes)

    def open_call(
        self, turn: ItemTurn, index: int, cid: str, name: str, typ: str, item_id: str | None
    ) -> ItemToolCall | None:
        """Open a client call (the checks of the parser's own ``_open``); ``None`` when a limit
        ended the stream."""
        parser = self.parser
        limits = parser.limits
        if turn.call_count >= limits.max_tool_calls:
            parser._limit(
                "max_tool_calls",
                f"choice {turn.index} has more than {limits.max_tool_calls} tool calls",
            )
            return None
        over: tuple[str, str, int] | None = None
        id_size, name_size = utf8_len(cid), utf8_len(name)
        item_size = utf8_len(item_id) if item_id else 0
        if id_size > limits.max_id_bytes:
            over, cid, id_size = ("max_id_bytes", "id", limits.max_id_bytes), "", 0
        if item_size > limits.max_id_bytes:
            over, item_id, item_size = ("max_id_bytes", "item id", limits.max_id_bytes), "", 0
        if name_size > limits.max_name_bytes:
            over, name, name_size = (
                over or ("max_name_bytes", "name", limits.max_name_bytes),
                "",
                0,
            )
        if not parser.count_header_bytes(id_size + name_size + item_size):
            return None
        call = ItemToolCall(
            choice=turn.index, ordinal=turn.call_count, index=index, id=cid, name=name, type=typ,
            item_id=item_id,
        )  # fmt: skip
        turn.add_call(call)
        parser._events.append(
            ToolCallOpened(
                choice=turn.index, ordinal=call.ordinal, index=index, id=cid, name=name,
                type=call.type,
            )
        )  # fmt: skip
        if cid.isspace():
            parser._blank_id(call)
        if over is not None:
            parser.header_over_limit(call, *over)
        return call

    def arguments(self, call: ItemToolCall, fragment: str) -> None:
        """Append an argument fragment (non-empty) within the limits."""
        if call.over_limit is None:
            self.parser._arguments(call, fragment, utf8_len(fragment))

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
        parser = self.parser
        nbytes = utf8_len(value)
        if nbytes > parser._max_argument_bytes:
            parser._over_limit(call)
            return
        grow = max(nbytes - call.argument_bytes, 0)
        if parser._stream_bytes + grow > parser._max_stream_bytes:
            parser._stream_limit()
            return
        parser._stream_bytes += grow
        call.replace_arguments(value, nbytes)

    def string(self, obj: dict[str, Any], key: str, path: str) -> str | None:
        """``obj[key]`` when it is a string or absent/null (``None``); any other type is a
        protocol error."""
        value = obj.get(key)
        if value is None or type(value) is str:
            return value
        self.fail(f"must be a string or null, got {_json_type(value)}", _at(path, key))

    def obj(self, obj: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
        """``obj[key]`` when it is an object or absent/null; else a protocol error."""
        value = obj.get(key)
        if value is None or type(value) is dict:
            return value
        self.fail(f"must be an object or null, got {_json_type(value)}", _at(path, key))

    def integer(self, obj: dict[str, Any], key: str, path: str) -> int | None:
        """``obj[key]`` when it is a non-negative integer (at most 2**31-1) or absent/null;
        else a protocol error."""
        value = obj.get(key)
        if value is None:
            return None
        if type(value) is not int or not 0 <= value <= 2**31 - 1:
            self.fail(
                f"must be a non-negative integer (at most {2**31 - 1}) or null, got "
                f"{_json_type(value)}",
                _at(path, key),
            )
        return value

    def meta_id(self, value: Any, what: str) -> None:
        """The response / message id: the first is kept, a change is an anomaly."""
        meta = self.parser._meta
        if type(value) is not str or not value:
            return
        if meta.response_id is None:
            if self.parser._identifier(value, what):
                meta.response_id = value
        elif value != meta.response_id:
            self.anomaly(
                "id_changed",
                f"{what} changed from {meta.response_id[:80]!r} to {value[:80]!r}; the first "
                "is kept",
            )

    def meta_model(self, value: Any) -> None:
        """The model name (the first is kept)."""
        meta = self.parser._meta
        if (
            meta.model is None
            and type(value) is str
            and value
            and self.parser._identifier(value, "the model")
        ):
            meta.model = value
