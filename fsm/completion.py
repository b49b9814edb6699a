"""Non-streamed responses: a ``chat.completion``, a Responses ``response`` or an Anthropic
``message`` parsed into the same :class:`~fsm.parser.ParseResult` a stream gives.

A whole response is replayed through :class:`~fsm.parser.StreamParser` as the one stream that
carries it (one chunk holding every choice; ``output_item.added`` / ``.done`` per item and the
terminal event; ``message_start`` with the content whole and ``message_stop``), so every rule of
the parser holds unchanged: arguments must be JSON, a blank name is refused, a turn cut by
``length`` / ``max_tokens`` / ``incomplete`` is never executable, the provider's ids are kept as
sent, limits bound what is kept. Anything that is not such a response (a stream chunk, an event,
a list, text that is not JSON) is a :class:`~fsm.errors.LocalProtocolError` saying what it is.
"""

from __future__ import annotations

import copy
from typing import Any, Final

import orjson

from fsm.errors import LocalProtocolError, RemoteProtocolError
from fsm.parser import Limits, ParseResult, StreamParser

__all__ = ["COMPLETION_KINDS", "completion_kind", "parse_completion"]

#: what :func:`completion_kind` answers, by the stream format it belongs to
COMPLETION_KINDS: Final[dict[str, str]] = {
    "chat": "chat.completion",
    "responses": "response",
    "anthropic": "message",
}

#: a Responses status and the terminal event that carries it in a stream
_TERMINAL: Final[dict[str, str]] = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",
}

#: the ``object`` / ``type`` of things that are parts of a stream, not whole responses
_STREAM_PARTS: Final = ("chat.completion.chunk",)


def _as_object(obj: Any) -> Any:
    """A dict of ``obj``: JSON text decoded, an SDK (pydantic) object dumped as JSON."""
    if isinstance(obj, bytes | bytearray | memoryview | str):
        try:
            return orjson.loads(obj)
        except orjson.JSONDecodeError as exc:
            raise LocalProtocolError(
                f"a non-streamed response must be one JSON object; this text is not JSON ({exc})"
            ) from None
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_unset=True)
    return obj


def completion_kind(obj: Any) -> str | None:
    """The stream format (``"chat"``, ``"responses"`` or ``"anthropic"``) of a decoded
    non-streamed response, or ``None`` when ``obj`` is not one."""
    if type(obj) is not dict:
        return None
    kind = obj.get("object")
    if kind == "chat.completion":
        return "chat"
    if kind == "response":
        return "responses"
    if obj.get("type") == "message" and obj.get("role") == "assistant":
        return "anthropic"
    return None


def _what(obj: Any) -> str:
    if type(obj) is not dict:
        return f"a JSON {type(obj).__name__}" if obj is not None else "null"
    kind = obj.get("object")
    if kind in _STREAM_PARTS:
        return "a stream chunk (chat.completion.chunk): parse a whole stream with fsm.parse()"
    event = obj.get("type")
    if isinstance(event, str) and event:
        return f"an event of type {event[:60]!r} (a stream's part: parse streams with fsm.parse())"
    if isinstance(kind, str) and kind:
        return f"an object of kind {kind[:60]!r}"
    return "an object with neither 'object' nor 'type'"


def _chat_chunk(completion: dict[str, Any]) -> dict[str, Any]:
    """The one chunk that carries a whole ``chat.completion`` (shapes are the parser's to judge:
    a ``choices`` that is not a list is its :class:`~fsm.errors.RemoteProtocolError`)."""
    chunk = dict(completion, object="chat.completion.chunk")
    choices = completion.get("choices")
    if type(choices) is list:
        chunk["choices"] = [_chat_choice(choice) for choice in choices]
    return chunk


def _chat_choice(choice: Any) -> Any:
    """A choice with its ``message`` as the ``delta``; a message's calls carry no index, so
    their position is theirs (an index already there is kept)."""
    if type(choice) is not dict or "message" not in choice:
        return choice
    delta = {k: v for k, v in choice.items() if k != "message"}
    message = choice["message"]
    calls = message.get("tool_calls") if type(message) is dict else None
    if type(calls) is list:
        message = dict(message)
        message["tool_calls"] = [
            {"index": position, **call} if type(call) is dict and "index" not in call else call
            for position, call in enumerate(calls)
        ]
    delta["delta"] = {} if message is None else message
    return delta


def _responses_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a stream that carries a whole Responses ``response``."""
    output = response.get("output")
    if output is None:
        output = []
    if type(output) is not list:
        raise RemoteProtocolError(
            f"must be a list, got {type(output).__name__}", event_number=1, path="output"
        )
    status = response.get("status")
    created = {k: v for k, v in response.items() if k != "output"}
    created.update(output=[], status="in_progress")
    events: list[dict[str, Any]] = [{"type": "response.created", "response": created}]
    for index, item in enumerate(output):
        # added and done each get their own copy: done's texts are compared with added's
        for kind in ("response.output_item.added", "response.output_item.done"):
            events.append({"type": kind, "output_index": index, "item": copy.deepcopy(item)})
    terminal = _TERMINAL.get(status) if isinstance(status, str) else None
    if terminal is not None:
        events.append({"type": terminal, "response": response})
    return events


def _anthropic_events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """``message_start`` with the content whole, then ``message_stop``."""
    return [{"type": "message_start", "message": message}, {"type": "message_stop"}]


def parse_completion(
    obj: Any, *, limits: Limits | None = None, repair_json: bool = False
) -> ParseResult:
    """Parse a non-streamed response into the :class:`~fsm.parser.ParseResult` its stream gives.

    ``obj`` is a Chat Completions ``chat.completion``, a Responses API ``response`` or an
    Anthropic Messages ``message``: a dict, its JSON text (``str`` or ``bytes``), or the SDK's
    own object (``openai``'s ``ChatCompletion`` / ``Response``, ``anthropic``'s ``Message``, any
    pydantic model of one). The result commits with
    :meth:`~fsm.store.ConversationStore.commit_turn` like a parsed stream's turn.

    The same rules as a stream: each call's arguments must be JSON to be ``finished``; a call with
    no name is ``aborted``; ``finish_reason`` ``length``, ``stop_reason`` ``max_tokens`` or a
    ``response`` whose status is ``incomplete`` leave the turn incomplete and its calls never
    executable; ``failed`` aborts them; a Responses ``response`` still ``queued`` or
    ``in_progress`` (background mode) has not ended, so its turn is incomplete (aborted).

    Raises :class:`~fsm.errors.LocalProtocolError` for anything that is not such a response (a
    stream chunk or event, a list, text that is not JSON), naming what it got, and
    :class:`~fsm.errors.RemoteProtocolError` for a response that breaks the format's rules (a
    ``choices`` or ``output`` that is not a list, a call that is not an object), as a stream
    with the same fault would.
    """
    data = _as_object(obj)
    kind = completion_kind(data)
    if kind is None:
        raise LocalProtocolError(
            "parse_completion() takes a non-streamed chat.completion, Responses 'response' or "
            f"Anthropic 'message'; got {_what(data)}"
        )
    parser = StreamParser(format=kind, limits=limits, repair_json=repair_json)
    if kind == "chat":
        parser.receive_chunk(_chat_chunk(data))
    else:
        events = _responses_events(data) if kind == "responses" else _anthropic_events(data)
        for event in events:
            parser.receive_chunk(event)
        if kind == "responses" and data.get("status") not in _TERMINAL:
            status = data.get("status")
            parser.abort(
                f"the response's status is {str(status)[:40]!r}: it has not ended (background "
                "mode: retrieve it again once it has)"
            )
            return parser.result()
    parser.receive_eof()
    return parser.result()
