"""What the replay server (:mod:`fsm.replay`) plays: a script of :class:`ReplayTurn`, the recorded streams it sends (split into events, cut, failed or held), what a turn sent, and the demo script."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Final

from fsm.errors import RemoteProtocolError
from fsm.parser import ParseResult, StreamParser
from fsm.replay_formats import (
    StreamFormat,
    detect_format,
)

#: The Chat Completions path (under ``base_url``'s ``/v1``); the server also answers
#: :data:`RESPONSES_PATH` (``/v1/responses``) and :data:`ANTHROPIC_PATH` (``/v1/messages``).
CHAT_COMPLETIONS_PATH: Final = "/v1/chat/completions"

#: The project's own example streams (``fsm/examples/*.sse``).
EXAMPLES_DIR: Final = Path(__file__).resolve().parent / "examples"

_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
_BLANK_LINES: Final = frozenset({b"\n", b"\r", b"\r\n"})


def split_events(data: bytes) -> list[bytes]:
    """Split a recorded SSE stream into pieces that each end after a blank line (an event's end).

    The pieces concatenate back to ``data`` exactly: line endings (``\\n``, ``\\r\\n``, ``\\r``),
    comments and any trailing bytes without a final blank line are kept as they are.
    """
    pieces: list[bytes] = []
    start = 0
    for match in _LINE.finditer(data):
        if match.group() in _BLANK_LINES:
            pieces.append(data[start : match.end()])
            start = match.end()
    if start < len(data):
        pieces.append(data[start:])
    return pieces


@dataclass(frozen=True)
class ReplayTurn:
    """One scripted answer of :class:`ReplayServer`.

    Args:
        stream: the recorded stream: its bytes, or the path of a file (``str`` or path-like).
        delay: seconds to wait before sending each piece after the first (pacing; ``0`` sends
            everything at once).
        cut_at: close the connection abruptly after this many bytes of the recording: the HTTP
            body ends without its last chunk, so the client sees an incomplete chunked read.
        reset_at: at this byte offset, drop the socket with a TCP reset.
        error_at: at the first event boundary at or after this byte offset, send
            ``event: error`` with ``{"error": {"message": error_message, ...}}`` and end the body
            (without ``[DONE]``).
        hold_at: at this byte offset, stop sending until :meth:`ReplayServer.release` is called
            (or the server's ``hold_timeout`` passes), then go on. A stalled stream, without
            sleeps.
        status: a non-2xx status answers that status with an OpenAI-style error body carrying
            ``error_message`` instead of streaming. The request after it (a retry) is checked
            against the turn before, as if this one had not happened.
        error_message: the message of ``error_at``'s error event or of a ``status`` error.
        expect_tool_results: the ``content`` of each tool message the request answered by this
            turn must carry, in call order (only checked when the previous turn ended with tool
            calls).
        check: whether to check the request answered by this turn (see
            :meth:`ReplayServer.check_request`).
        format: the recording's format, ``"chat"`` (served at ``/v1/chat/completions``),
            ``"responses"`` (``/v1/responses``) or ``"anthropic"`` (``/v1/messages``); ``None``
            (the default) detects it from the recording's first typed event. A request to
            another path than the turn's is refused (``400``) and does not use up the turn.

    At most one of ``cut_at``, ``reset_at`` and ``error_at`` may be given.
    """

    stream: bytes | str | os.PathLike[str]
    _: KW_ONLY
    delay: float = 0.0
    cut_at: int | None = None
    reset_at: int | None = None
    error_at: int | None = None
    hold_at: int | None = None
    status: int = 200
    error_message: str = "the replay server failed this stream on purpose"
    expect_tool_results: Sequence[str] | None = None
    check: bool = True
    format: StreamFormat | None = None

    def __post_init__(self) -> None:
        ends = [n for n in ("cut_at", "reset_at", "error_at") if getattr(self, n) is not None]
        if len(ends) > 1:
            raise ValueError(f"ReplayTurn takes at most one of {', '.join(ends)}")
        for name in ("cut_at", "reset_at", "error_at", "hold_at"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"ReplayTurn.{name} must be >= 0, got {value}")
        if self.delay < 0:
            raise ValueError(f"ReplayTurn.delay must be >= 0, got {self.delay}")
        if not 200 <= self.status <= 599:
            raise ValueError(f"ReplayTurn.status must be an HTTP status, got {self.status}")
        if self.format not in (None, "chat", "responses", "anthropic"):
            raise ValueError(
                "ReplayTurn.format must be 'chat', 'responses', 'anthropic' or None, got "
                f"{self.format!r}"
            )

    def stream_format(self) -> StreamFormat:
        """The recording's format: :attr:`format`, else detected from its bytes."""
        return self.format if self.format is not None else detect_format(self.data())

    def data(self) -> bytes:
        """The recording's bytes."""
        if isinstance(self.stream, bytes):
            return self.stream
        return Path(self.stream).read_bytes()


@dataclass(frozen=True, slots=True)
class ReplayFailure:
    """A request the server rejected: ``request`` is its index in
    :attr:`ReplayServer.requests`, ``message`` the reason (also sent in the 400 body)."""

    request: int
    message: str


@dataclass(slots=True)
class Sent:
    """What the server streamed for a turn, as fsm's parser reads it."""

    result: ParseResult
    complete: bool
    calls: list[tuple[str, str, str, str]] = field(default_factory=list)  # id, type, name, args
    format: StreamFormat = "chat"
    #: the response id the client saw (renamed when ``response_ids="unique"``)
    response_id: str | None = None
    #: the bytes sent
    data: bytes = b""
    #: the turn (choice 0), if the stream had one
    turn: Any = None


def read_sent(data: bytes, fmt: StreamFormat = "chat") -> Sent:
    if fmt != "chat":
        return _read_sent_typed(data, fmt)
    parser = StreamParser()
    try:
        parser.receive_data(data)
        parser.receive_eof()
    except RemoteProtocolError:
        pass
    result = parser.result()
    turn = next((t for t in result.turns if t.index == 0), None)
    calls: list[tuple[str, str, str, str]] = []
    if turn is not None:
        calls = [(c.id, c.type, c.name, c.arguments) for c in turn.tool_calls]
    return Sent(result, turn is not None and turn.complete, calls, "chat", result.response_id)


def _read_sent_typed(data: bytes, fmt: StreamFormat) -> Sent:
    """:func:`read_sent` for a Responses or Messages stream (one turn)."""
    parser = StreamParser(format=fmt)
    try:
        parser.receive_data(data)
        parser.receive_eof()
    except RemoteProtocolError:
        pass
    result = parser.result()
    turn = result.turns[0] if result.turns else None
    calls: list[tuple[str, str, str, str]] = []
    if turn is not None:
        calls = [(c.id, c.type, c.name, c.arguments) for c in turn.tool_calls]
    complete = turn is not None and turn.complete
    return Sent(result, complete, calls, fmt, result.response_id, data, turn)


def _sse_data(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of a recording's ``data:`` fields, in order."""
    for line in data.splitlines():
        stripped = line.strip()
        if stripped.startswith(b"data:"):
            try:
                value = json.loads(stripped[5:])
            except ValueError:
                continue
            if isinstance(value, dict):
                yield value


def responses_output(sent: Sent) -> list[dict[str, Any]]:
    """The output items of a Responses stream, as ``previous_response_id`` refers to them: the
    terminal event's ``response.output``, else each ``response.output_item.done`` item."""
    done: list[dict[str, Any]] = []
    for event in _sse_data(sent.data):
        kind = event.get("type")
        if kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            done.append(event["item"])
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            response = event.get("response")
            output = response.get("output") if isinstance(response, dict) else None
            if isinstance(output, list) and output:
                return [item for item in output if isinstance(item, dict)]
    return done


def demo_script(
    tool_results: Sequence[str] | None = None,
    *,
    delay: float = 0.0,
    format: StreamFormat = "chat",
) -> list[ReplayTurn]:
    """The project's demo conversation: ``parallel_add_multiply.sse`` (two tool calls, ``add``
    and ``multiply``) then ``final_answer.sse``. ``tool_results``, when given, are the tool
    message contents the second request must carry (add's, then multiply's); ``delay`` paces
    both streams (seconds between events) so that a demo visibly streams. ``format``
    ``"responses"`` or ``"anthropic"`` gives the same conversation in that API's streams
    (``responses_*.sse``, ``anthropic_*.sse``: with a reasoning item or a thinking block that
    the follow-up must send back verbatim)."""
    first, final = {
        "chat": ("parallel_add_multiply.sse", "final_answer.sse"),
        "responses": ("responses_add_multiply.sse", "responses_final_answer.sse"),
        "anthropic": ("anthropic_add_multiply.sse", "anthropic_final_answer.sse"),
    }[format]
    return [
        ReplayTurn(EXAMPLES_DIR / first, delay=delay),
        ReplayTurn(EXAMPLES_DIR / final, delay=delay, expect_tool_results=tool_results),
    ]


def carries_tool_results(body: Any) -> bool:
    """Whether a request body (Chat Completions, Responses or Messages) sends tool results
    back: a ``tool`` or ``function`` message, a ``function_call_output`` or
    ``custom_tool_call_output`` item, a ``previous_response_id``, or a ``tool_result`` block. A
    request without one starts a conversation (``ReplayServer(repeat=True)`` starts its script
    over)."""
    if not isinstance(body, dict):
        return False
    if body.get("previous_response_id") is not None:
        return True
    entries = body.get("messages")
    if not isinstance(entries, list):
        entries = body.get("input")
    if not isinstance(entries, list):
        return False
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        if entry.get("role") in ("tool", "function"):
            return True
        if entry.get("type") in ("function_call_output", "custom_tool_call_output"):
            return True
        content = entry.get("content")
        if isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") == "tool_result" for block in content
        ):
            return True
    return False


def id_renamer(
    data: bytes, suffix: str, fmt: StreamFormat = "chat"
) -> Callable[[bytes], bytes] | None:
    """A function that gives the response id of the recording ``data`` the suffix ``suffix``
    in a piece of it (each ``"id": "<response id>"``, as JSON-encoded in the recording), or
    ``None`` when the recording has no response id."""
    rid = read_sent(data, fmt).response_id
    if rid is None:
        return None
    recorded = json.dumps(rid).encode()
    pattern = re.compile(rb'("id"\s*:\s*)' + re.escape(recorded))
    renamed = json.dumps(f"{rid}-{suffix}").encode()

    def rename(piece: bytes) -> bytes:
        return pattern.sub(lambda m: m.group(1) + renamed, piece)

    return rename


def stream_pieces(data: bytes, stop: int, hold_at: int | None) -> Iterator[bytes]:
    """The recording's events up to ``stop``, also split at ``hold_at``."""
    offset = 0
    for piece in split_events(data):
        if offset >= stop:
            return
        piece = piece[: stop - offset]
        if hold_at is not None and offset < hold_at < offset + len(piece):
            yield piece[: hold_at - offset]
            yield piece[hold_at - offset :]
        else:
            yield piece
        offset += len(piece)


def error_boundary(data: bytes, offset: int) -> int:
    """The first event boundary at or after ``offset`` (``len(data)`` at the latest)."""
    end = 0
    if offset <= 0:
        return 0
    for piece in split_events(data):
        end += len(piece)
        if end >= offset:
            return end
    return len(data)


def error_event(message: str, fmt: StreamFormat = "chat") -> bytes:
    error: dict[str, Any]
    if fmt == "responses":
        error = {"type": "error", "code": "server_error", "message": message, "param": None}
    elif fmt == "anthropic":
        error = {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


def what_is_sent(data: bytes, turn: ReplayTurn) -> bytes:
    if turn.cut_at is not None:
        return data[: turn.cut_at]
    if turn.reset_at is not None:
        return data[: turn.reset_at]
    if turn.error_at is not None:
        fmt = turn.stream_format()
        error = error_event(turn.error_message, fmt)
        return data[: error_boundary(data, turn.error_at)] + error
    return data
