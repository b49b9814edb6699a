"""A local OpenAI-compatible server that replays recorded streams over real HTTP.

:class:`ReplayServer` listens on ``127.0.0.1`` on a free port and answers
``POST /v1/chat/completions`` (``"stream": true``) from a *script*: a list of
:class:`ReplayTurn`, one per request, in order. Each turn names a recorded stream (a ``.sse``
file or its bytes), which is sent as it is, with chunked transfer encoding, one HTTP chunk per
SSE event of the recording (the recording's own framing and line endings are kept). A turn can
also cut the stream at a byte offset, fail it mid-stream (an ``event: error`` or a dropped
socket), hold it open until :meth:`ReplayServer.release`, or answer an HTTP error instead.

From the second request on, the server checks that the request is exactly what a correct agent
loop sends after the previous turn (see :meth:`ReplayServer.check_request`). A request that fails
the check is answered ``400`` with an OpenAI-style error body, is listed in
:attr:`ReplayServer.failures`, and does not use up a turn of the script.

::

    from openai import OpenAI
    from fsm.replay import ReplayServer, ReplayTurn

    script = [ReplayTurn("first.sse"), ReplayTurn("final.sse", expect_tool_results=["6912"])]
    with ReplayServer(script) as server:
        client = OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        ...
    assert server.failures == []

Stdlib only (``http.server`` in a background thread) plus :mod:`fsm`'s own parser, which the
check uses to know what a turn streamed.

A product module, not only a test helper: ``fsm demo`` runs the agent loop against it. Tests of
code built on fsm may import it as :mod:`fsm.testing` (which re-exports it, as does
``fsm.testing.server``, its former home). ``import fsm`` does not import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

from fsm.errors import RemoteProtocolError
from fsm.formats.ids import anthropic_input, original_id
from fsm.parser import ParseResult, StreamParser
from fsm.replay_formats import (
    ANTHROPIC_PATH,
    FORMAT_OF_PATH,
    RESPONSES_PATH,
    StreamFormat,
    anthropic_error_body,
    anthropic_messages,
    check_anthropic_blocks,
    check_anthropic_tools,
    check_responses_tools,
    detect_format,
    openai_error_body,
    responses_items,
)

__all__ = [
    "ANTHROPIC_PATH",
    "CHAT_COMPLETIONS_PATH",
    "EXAMPLES_DIR",
    "RESPONSES_PATH",
    "ReplayFailure",
    "ReplayServer",
    "ReplayTurn",
    "carries_tool_results",
    "demo_script",
    "split_events",
]

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
class _Sent:
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


def _read_sent(data: bytes, fmt: StreamFormat = "chat") -> _Sent:
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
    return _Sent(result, turn is not None and turn.complete, calls, "chat", result.response_id)


def _read_sent_typed(data: bytes, fmt: StreamFormat) -> _Sent:
    """:func:`_read_sent` for a Responses or Messages stream (one turn)."""
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
    return _Sent(result, complete, calls, fmt, result.response_id, data, turn)


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


def _responses_output(sent: _Sent) -> list[dict[str, Any]]:
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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    replay: ReplayServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that went away (closed early, was cancelled, reset): not an error
        super().handle_error(request, client_address)


class _Abort(Exception):
    """Stop answering on this connection (the turn dropped it on purpose)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    timeout = 30

    def setup(self) -> None:
        super().setup()
        # Each piece goes out at once (no Nagle delay waiting for the client's delayed ACK).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.replay._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.replay._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read server.requests and server.failures instead

    def do_POST(self) -> None:
        try:
            self.server.replay._handle(self)
        except _Abort:
            self.close_connection = True
        except OSError:
            # The client went away (closed the stream early, was cancelled): nothing to answer.
            self.close_connection = True

    # -- writing helpers used by ReplayServer._handle ------------------------------------------
    def read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return b""

    def send_error_json(
        self, status: int, message: str, error_type: str, fmt: StreamFormat = "chat"
    ) -> None:
        if fmt == "anthropic":
            anthropic_type = {
                "server_error": "api_error",
                "not_found_error": "not_found_error",
            }.get(error_type, error_type)
            body = anthropic_error_body(message, anthropic_type)
        else:
            body = openai_error_body(message, error_type)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def start_stream(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def send_chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def cut(self) -> None:
        """Close without the last chunk: the client sees an incomplete body."""
        self.connection.shutdown(socket.SHUT_RDWR)
        raise _Abort

    def reset(self) -> None:
        """Drop the socket with a TCP RST."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        raise _Abort


class ReplayServer:
    """A local OpenAI-compatible ``/v1/chat/completions`` server replaying a script of streams.

    Use it as a context manager; it listens on ``127.0.0.1`` on a free port from ``__enter__``
    until ``__exit__``::

        with ReplayServer([ReplayTurn(path)]) as server:
            client = OpenAI(base_url=server.base_url, api_key="test", max_retries=0)

    Args:
        script: the turns, answered in order, one per accepted request.
        hold_timeout: the longest a ``hold_at`` turn waits for :meth:`release`, in seconds.
        response_ids: ``"unique"`` (the default) gives every response its own id, as a real
            provider does: each chunk's ``"id"`` equal to the recording's response id becomes
            ``<recorded id>-<token>-<n>`` (``token``: 8 random hex digits drawn when the server
            is made and at each :meth:`reset`; ``n``: the request's 1-based number among the accepted ones), so running the
            same script twice against one store never meets the store's idempotency by accident.
            ``"recorded"`` sends the recording byte for byte. Only the id is rewritten (the
            framing, line endings and every other byte stay as recorded); ``cut_at``,
            ``reset_at``, ``error_at`` and ``hold_at`` count bytes of the recording.

        host: the address to listen on (``127.0.0.1``, the default, is the loopback: only this
            machine can reach the server).
        port: the port to listen on; ``0`` (the default) picks a free one (:attr:`port`).
        repeat: play the script again and again, as ``fsm replay`` does: when every turn has
            been answered, or when a request carries no tool result (a new conversation
            starts), the script starts over with new response ids. Without it (the default)
            a request past the end of the script is refused.
        log: called with one line per request answered or refused (``fsm replay`` prints them
            on stderr).

    Attributes:
        requests: every JSON body received, in order (``None`` for a body that is not JSON).
        failures: every rejected request, as :class:`ReplayFailure`.
        served: how many turns of the script have been answered (since it last started over).
    """

    def __init__(
        self,
        script: Sequence[ReplayTurn],
        *,
        hold_timeout: float = 10.0,
        response_ids: Literal["unique", "recorded"] = "unique",
        host: str = "127.0.0.1",
        port: int = 0,
        repeat: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if response_ids not in ("unique", "recorded"):
            raise ValueError(f"response_ids must be 'unique' or 'recorded', got {response_ids!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be from 0 to 65535, got {port!r}")
        self.script: list[ReplayTurn] = list(script)
        self.host = host
        self._port = port
        self.repeat = repeat
        self._log = log
        self.hold_timeout = hold_timeout
        self.response_ids = response_ids
        #: the random part of this server's response ids (see ``response_ids``)
        self._id_token = os.urandom(4).hex()
        self.requests: list[Any] = []
        self.failures: list[ReplayFailure] = []
        self.served = 0
        self._lock = threading.Lock()
        self._previous: _Sent | None = None
        #: the output items of each Responses turn served, by the response id the client saw
        self._outputs: dict[str, list[dict[str, Any]]] = {}
        self._released = threading.Event()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ReplayServer:
        """Start listening (``__enter__`` does this)."""
        if self._httpd is not None:
            raise RuntimeError("the server is already running")
        httpd = _HTTPServer((self.host, self._port), _Handler)
        httpd.replay = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.01},
            name=f"ReplayServer:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening, release held streams and close open connections (``__exit__``)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._released.set()
        httpd.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The port the server listens on."""
        if self._httpd is None:
            raise RuntimeError("the server is not running: use it as a context manager")
        port: int = self._httpd.server_address[1]
        return port

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (``http://127.0.0.1:PORT`` by default): the ``base_url`` for an
        ``anthropic`` client. A server listening on every address (``0.0.0.0``) names the
        loopback."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``: the ``base_url`` for an ``openai`` client."""
        return f"{self.url}/v1"

    @property
    def chat_url(self) -> str:
        """The full URL of ``POST /v1/chat/completions`` (for plain HTTP clients)."""
        return self.url + CHAT_COMPLETIONS_PATH

    def release(self) -> None:
        """Let every stream stopped at its ``hold_at`` go on (and later ones pass straight)."""
        self._released.set()

    def reset(self, script: Sequence[ReplayTurn]) -> None:
        """Start a new script on the running server: forget the previous turn, the requests and
        the failures, and draw a new random part of the response ids."""
        with self._lock:
            self.script = list(script)
            self.served = 0
            self.requests = []
            self.failures = []
            self._previous = None
            self._outputs = {}
            self._released.clear()
            self._id_token = os.urandom(4).hex()

    # -- the request check ----------------------------------------------------------------------
    def check_request(
        self, body: Any, turn: ReplayTurn | None = None, fmt: StreamFormat = "chat"
    ) -> str | None:
        """Why ``body`` is not the request a correct agent loop sends next, or ``None`` if it is.

        ``fmt`` is the API of the request: ``"chat"`` (below), ``"responses"`` or
        ``"anthropic"`` (:meth:`_check_typed`: first the tool results must match the tool calls
        of the request itself, as the real APIs require, then the request must carry back what
        the previous turn streamed).

        A Chat Completions body must be a JSON object with ``"stream": true`` and a ``messages`` list. After a
        turn that streamed complete tool calls (choice 0, as fsm's parser reads the bytes sent):

        * the last ``assistant`` message carries exactly those ``tool_calls``, in order, with
          ids, types, names and arguments equal to what was streamed, byte for byte;
        * it is immediately followed by one ``tool`` message per call, in call order, each with
          the call's ``tool_call_id``;
        * when ``turn.expect_tool_results`` is given, each tool message's ``content`` equals it.

        After a turn that did not end complete (cut, failed, truncated), no message may carry
        any of its call ids: an incomplete call must never be salvaged into history.
        """
        if not isinstance(body, dict):
            return "the request body must be a JSON object"
        if body.get("stream") is not True:
            return 'this server only streams: the request must have "stream": true'
        if fmt != "chat":
            return self._check_typed(body, turn, fmt)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return "'messages' must be a list of objects"
        previous = self._previous
        if previous is None:
            return None
        if not previous.complete:
            return _check_no_salvage(messages, previous)
        if not previous.calls:
            return None
        results = turn.expect_tool_results if turn is not None else None
        return _check_tool_round(messages, previous, results)

    def _check_typed(
        self, body: dict[str, Any], turn: ReplayTurn | None, fmt: StreamFormat
    ) -> str | None:
        """:meth:`check_request` for a Responses or Messages request.

        First what the real API refuses: tool results that do not match the request's own
        tool calls (:func:`~fsm.replay_formats.check_responses_tools`,
        :func:`~fsm.replay_formats.check_anthropic_tools`), a ``previous_response_id`` the
        server never sent. Then, after a turn that streamed complete tool calls, the request
        must carry them back byte for byte (Responses: as ``function_call`` /
        ``custom_tool_call`` items with their ``call_id``, name and arguments or input, and
        each reasoning item with ``encrypted_content`` verbatim, or by ``previous_response_id``;
        Anthropic: the last assistant message's ``tool_use`` blocks with their ids, names and
        inputs, and its thinking blocks with their signatures) with one result per call (in
        call order, equal to ``turn.expect_tool_results`` when given). After a turn that did not
        end complete, none of its calls may appear.
        """
        results = turn.expect_tool_results if turn is not None else None
        previous = self._previous
        if fmt == "responses":
            items = responses_items(body)
            if isinstance(items, str):
                return items
            prior: list[dict[str, Any]] = []
            previous_id = body.get("previous_response_id")
            if previous_id is not None:
                if previous_id not in self._outputs:
                    return f"Previous response with id '{previous_id}' not found."
                prior = self._outputs[previous_id]
            problem = check_responses_tools(items, prior)
            if problem is not None or previous is None or previous.format != "responses":
                return problem
            return _check_responses_round(items, previous_id, previous, results)
        messages = anthropic_messages(body)
        if isinstance(messages, str):
            return messages
        problem = check_anthropic_blocks(messages) or check_anthropic_tools(messages)
        if problem is not None or previous is None or previous.format != "anthropic":
            return problem
        return _check_anthropic_round(messages, previous, results)

    # -- internals ------------------------------------------------------------------------------
    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _decide(self, path: str, body: Any) -> tuple[ReplayTurn | None, str | None, int, int]:
        """Under the lock: record the request and choose the answer: ``(turn, rejection,
        status)``, a turn to answer or a rejection message, with the status to send."""
        with self._lock:
            number = len(self.requests)
            self.requests.append(body)
            problem: str | None = None
            status = 400
            turn: ReplayTurn | None = None
            fmt = FORMAT_OF_PATH.get(path)
            if (
                self.repeat
                and fmt is not None
                and self.served > 0
                and (self.served >= len(self.script) or not carries_tool_results(body))
            ):
                # a new conversation (or the script's end): play the script again
                self.served = 0
                self._previous = None
                self._id_token = os.urandom(4).hex()
            if fmt is None:
                problem, status = f"unknown path {path!r}", 404
            elif body is None:
                problem = "the request body is not valid JSON"
            elif self.served >= len(self.script):
                problem = (
                    f"the script has no turn left for request #{number} "
                    f"({len(self.script)} turns, all answered)"
                )
            else:
                turn = self.script[self.served]
                recorded = turn.stream_format()
                if recorded != fmt:
                    problem = (
                        f"turn {self.served} of the script is a {_API_NAMES[recorded]} stream, "
                        f"served at POST {_PATH_OF_FORMAT[recorded]}, not {path}"
                    )
                else:
                    problem = self.check_request(body, turn, fmt) if turn.check else None
            if problem is not None:
                self.failures.append(ReplayFailure(number, problem))
                return None, problem, status, self.served
            assert turn is not None
            self.served += 1
            if 200 <= turn.status < 300:
                # What the next request is checked against: the bytes this turn sends.
                sent = _read_sent(_what_is_sent(turn.data(), turn), turn.stream_format())
                if sent.response_id is not None and self.response_ids == "unique":
                    sent.response_id = f"{sent.response_id}-{self._id_token}-{self.served}"
                self._previous = sent
                if sent.format == "responses" and sent.response_id is not None:
                    self._outputs[sent.response_id] = _responses_output(sent)
            return turn, None, turn.status, self.served

    def _handle(self, handler: _Handler) -> None:
        raw = handler.read_body()
        path = handler.path.split("?", 1)[0]
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        turn, problem, status, served = self._decide(path, body)
        fmt = FORMAT_OF_PATH.get(path, "chat")
        if self._log is not None:
            if turn is None:
                self._log(f"POST {path}: {status} refused: {problem}")
            else:
                name = "bytes" if isinstance(turn.stream, bytes) else Path(turn.stream).name
                self._log(f"POST {path}: {status}, turn {served} of {len(self.script)} ({name})")
        if turn is None:
            assert problem is not None
            error_type = "not_found_error" if status == 404 else "invalid_request_error"
            handler.send_error_json(status, problem, error_type, fmt)
        elif not 200 <= status < 300:
            error_type = "invalid_request_error" if status < 500 else "server_error"
            handler.send_error_json(status, turn.error_message, error_type, fmt)
        else:
            self._stream(handler, turn, turn.data(), served, fmt)

    def _stream(
        self, handler: _Handler, turn: ReplayTurn, data: bytes, number: int, fmt: StreamFormat
    ) -> None:
        rename = None
        if self.response_ids == "unique":
            rename = _id_renamer(data, f"{self._id_token}-{number}", fmt)
        handler.start_stream()
        error_at = _error_boundary(data, turn.error_at) if turn.error_at is not None else None
        stop = next((x for x in (turn.cut_at, turn.reset_at, error_at) if x is not None), len(data))
        stop = min(stop, len(data))
        sent = 0
        held = False
        for index, piece in enumerate(_pieces(data, stop, turn.hold_at)):
            if index and turn.delay:
                time.sleep(turn.delay)
            if not held and turn.hold_at is not None and sent >= turn.hold_at:
                held = True
                self._released.wait(self.hold_timeout)
            handler.send_chunk(piece if rename is None else rename(piece))
            sent += len(piece)
        if not held and turn.hold_at is not None and sent >= turn.hold_at:
            self._released.wait(self.hold_timeout)
        if turn.cut_at is not None:
            handler.cut()
        if turn.reset_at is not None:
            handler.reset()
        if error_at is not None:
            handler.send_chunk(_error_event(turn.error_message, fmt))
        handler.end_stream()


def _id_renamer(
    data: bytes, suffix: str, fmt: StreamFormat = "chat"
) -> Callable[[bytes], bytes] | None:
    """A function that gives the response id of the recording ``data`` the suffix ``suffix``
    in a piece of it (each ``"id": "<response id>"``, as JSON-encoded in the recording), or
    ``None`` when the recording has no response id."""
    rid = _read_sent(data, fmt).response_id
    if rid is None:
        return None
    recorded = json.dumps(rid).encode()
    pattern = re.compile(rb'("id"\s*:\s*)' + re.escape(recorded))
    renamed = json.dumps(f"{rid}-{suffix}").encode()

    def rename(piece: bytes) -> bytes:
        return pattern.sub(lambda m: m.group(1) + renamed, piece)

    return rename


def _pieces(data: bytes, stop: int, hold_at: int | None) -> Iterator[bytes]:
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


def _error_boundary(data: bytes, offset: int) -> int:
    """The first event boundary at or after ``offset`` (``len(data)`` at the latest)."""
    end = 0
    if offset <= 0:
        return 0
    for piece in split_events(data):
        end += len(piece)
        if end >= offset:
            return end
    return len(data)


def _error_event(message: str, fmt: StreamFormat = "chat") -> bytes:
    error: dict[str, Any]
    if fmt == "responses":
        error = {"type": "error", "code": "server_error", "message": message, "param": None}
    elif fmt == "anthropic":
        error = {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


def _what_is_sent(data: bytes, turn: ReplayTurn) -> bytes:
    if turn.cut_at is not None:
        return data[: turn.cut_at]
    if turn.reset_at is not None:
        return data[: turn.reset_at]
    if turn.error_at is not None:
        fmt = turn.stream_format()
        error = _error_event(turn.error_message, fmt)
        return data[: _error_boundary(data, turn.error_at)] + error
    return data


def _check_tool_round(
    messages: list[dict[str, Any]], previous: _Sent, results: Sequence[str] | None
) -> str | None:
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    last = assistants[-1] if assistants else None
    expected_ids = [c[0] for c in previous.calls]
    if last is None:
        return (
            f"no assistant message: the previous turn streamed tool calls {expected_ids} and "
            "the request must carry them back"
        )
    got = messages[last].get("tool_calls")
    if not isinstance(got, list) or not got:
        return (
            f"the last assistant message (messages[{last}]) has no tool_calls; the previous turn "
            f"streamed {expected_ids}"
        )
    if len(got) != len(previous.calls):
        return (
            f"the last assistant message (messages[{last}]) has {len(got)} tool_calls; the "
            f"previous turn streamed {len(previous.calls)}: {expected_ids}"
        )
    for position, (entry, (cid, ctype, name, arguments)) in enumerate(
        zip(got, previous.calls, strict=True)
    ):
        where = f"messages[{last}].tool_calls[{position}]"
        if not isinstance(entry, dict):
            return f"{where} must be an object"
        function = entry.get("function")
        if not isinstance(function, dict):
            return f"{where}.function must be an object"
        for label, value, want in (
            ("id", entry.get("id"), cid),
            ("type", entry.get("type"), ctype),
            ("function.name", function.get("name"), name),
            ("function.arguments", function.get("arguments"), arguments),
        ):
            if value != want:
                return f"{where}.{label} is {value!r}; the stream sent {want!r}"
    for position, (cid, _type, name, _args) in enumerate(previous.calls):
        at = last + 1 + position
        if at >= len(messages):
            return (
                f"the tool result for call {cid!r} ({name}) is missing: messages[{at}] should be "
                f"a tool message with tool_call_id {cid!r}"
            )
        message = messages[at]
        if message.get("role") != "tool":
            return (
                f"messages[{at}] is a {message.get('role')!r} message where the tool result for "
                f"call {cid!r} ({name}) must come (tool messages must immediately follow the "
                "assistant message, one per call, in call order)"
            )
        if message.get("tool_call_id") != cid:
            return (
                f"messages[{at}].tool_call_id is {message.get('tool_call_id')!r}; call "
                f"{position} of the assistant message has id {cid!r}"
            )
        if results is not None:
            if position >= len(results):
                return f"the script expects {len(results)} tool results, the stream had more calls"
            if message.get("content") != results[position]:
                return (
                    f"messages[{at}].content is {message.get('content')!r}; expected "
                    f"{results[position]!r} for call {cid!r} ({name})"
                )
    return None


_API_NAMES: Final[dict[StreamFormat, str]] = {
    "chat": "Chat Completions",
    "responses": "Responses API",
    "anthropic": "Anthropic Messages",
}
_PATH_OF_FORMAT: Final[dict[StreamFormat, str]] = {
    "chat": CHAT_COMPLETIONS_PATH,
    "responses": RESPONSES_PATH,
    "anthropic": ANTHROPIC_PATH,
}
_RESPONSES_CALLS: Final = {"function": "function_call", "custom": "custom_tool_call"}


def _incomplete(previous: _Sent) -> str:
    return (
        f"the previous turn did not end complete ({previous.result.end_how}: "
        f"{previous.result.end_reason}); an incomplete call must not reach history"
    )


def _check_responses_round(
    items: list[dict[str, Any]],
    previous_id: Any,
    previous: _Sent,
    results: Sequence[str] | None,
) -> str | None:
    ids = {c[0] for c in previous.calls if c[0]}
    if not previous.complete:
        if previous_id is not None and previous_id == previous.response_id:
            return f"previous_response_id {previous_id!r} names a turn that " + _incomplete(
                previous
            )
        for at, item in enumerate(items):
            if item.get("type") in ("function_call", "custom_tool_call") and (
                item.get("call_id") in ids
            ):
                return f"input[{at}] carries call {item.get('call_id')!r}: " + _incomplete(previous)
        return None
    if not previous.calls:
        return None
    chained = previous_id is not None and previous_id == previous.response_id
    outputs: dict[str, list[Any]] = {}
    for item in items:
        if item.get("type") in ("function_call_output", "custom_tool_call_output"):
            outputs.setdefault(str(item.get("call_id")), []).append(item.get("output"))
    if not chained:
        made = [i for i in items if i.get("type") in ("function_call", "custom_tool_call")]
        for cid, kind, name, arguments in previous.calls:
            want = _RESPONSES_CALLS.get(kind, "function_call")
            field_name = "input" if want == "custom_tool_call" else "arguments"
            match = next((i for i in made if i.get("call_id") == cid), None)
            if match is None:
                return (
                    f"the previous turn streamed call {cid!r} ({name}); the input must carry it "
                    f"back as a {want} item (or chain with previous_response_id)"
                )
            for label, value, expected in (
                ("type", match.get("type"), want),
                ("name", match.get("name"), name),
                (field_name, match.get(field_name), arguments),
            ):
                if value != expected:
                    return f"call {cid!r}: {label} is {value!r}; the stream sent {expected!r}"
        turn = previous.turn
        if turn is not None:
            for item in turn.to_items():
                if item.get("type") != "reasoning" or item.get("encrypted_content") is None:
                    continue
                if not any(
                    i.get("type") == "reasoning"
                    and i.get("encrypted_content") == item["encrypted_content"]
                    for i in items
                ):
                    return (
                        f"reasoning item {item.get('id')!r} of the previous turn is missing or "
                        "its encrypted_content was changed: it must be sent back verbatim"
                    )
    if results is not None:
        for position, (cid, _kind, name, _args) in enumerate(previous.calls):
            got = outputs.get(cid, [])
            if position >= len(results):
                return f"the script expects {len(results)} tool results, the stream had more calls"
            if results[position] not in got:
                return (
                    f"the output for call {cid!r} ({name}) is {got!r}; expected "
                    f"{results[position]!r}"
                )
    return None


def _result_text(block: Mapping[str, Any]) -> Any:
    content = block.get("content")
    if isinstance(content, list):
        texts = [b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        return "".join(t for t in texts if isinstance(t, str))
    return content


def _sent_id(value: Any) -> Any:
    """The call id an id sent to Anthropic stands for (fsm.formats.ids), else the value."""
    if not isinstance(value, str):
        return value
    try:
        return original_id(value)
    except ValueError:
        return value


def _check_anthropic_round(
    messages: list[dict[str, Any]], previous: _Sent, results: Sequence[str] | None
) -> str | None:
    ids = {c[0] for c in previous.calls if c[0]}
    if not previous.complete:
        for at, message in enumerate(messages):
            content = message.get("content")
            for block in content if isinstance(content, list) else []:
                if block.get("type") == "tool_use" and _sent_id(block.get("id")) in ids:
                    return f"messages[{at}] carries tool_use {block.get('id')!r}: " + _incomplete(
                        previous
                    )
        return None
    if not previous.calls:
        return None
    expected_ids = [c[0] for c in previous.calls]
    found = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].get("role") == "assistant"
            and isinstance(messages[i].get("content"), list)
            and any(b.get("type") == "tool_use" for b in messages[i]["content"])
        ),
        None,
    )
    if found is None:
        return (
            f"no assistant message with tool_use blocks: the previous turn streamed tool calls "
            f"{expected_ids} and the request must carry them back"
        )
    at = found
    uses = [b for b in messages[at]["content"] if b.get("type") == "tool_use"]
    # ids and inputs as fsm renders them for Anthropic (fsm.formats.ids): compared by what
    # they stand for
    if [_sent_id(b.get("id")) for b in uses] != expected_ids:
        return (
            f"messages[{at}] has tool_use ids {[b.get('id') for b in uses]}; the previous turn "
            f"streamed {expected_ids}"
        )
    for block, (cid, _kind, name, arguments) in zip(uses, previous.calls, strict=True):
        if block.get("name") != name:
            return f"tool_use {cid!r}: name is {block.get('name')!r}; the stream sent {name!r}"
        wanted: Any
        try:
            wanted = anthropic_input(json.loads(arguments) if arguments.strip() else {})
        except ValueError:
            wanted = arguments
        if block.get("input") != wanted:
            return (
                f"tool_use {cid!r}: input is {block.get('input')!r}; the stream sent {arguments!r}"
            )
    turn = previous.turn
    if turn is not None:
        sent_blocks = turn.to_anthropic()[0]["content"]
        for block in sent_blocks:
            kind = block.get("type")
            if kind not in ("thinking", "redacted_thinking"):
                continue
            if block not in messages[at]["content"]:
                what = "signature" if kind == "thinking" else "data"
                return (
                    f"messages[{at}]: a {kind} block of the previous turn is missing or its "
                    f"{what} was changed: thinking blocks must be sent back verbatim"
                )
    if results is not None and at + 1 < len(messages):
        answers = [
            b for b in messages[at + 1].get("content") or [] if b.get("type") == "tool_result"
        ]
        for position, (cid, _kind, name, _args) in enumerate(previous.calls):
            if position >= len(results):
                return f"the script expects {len(results)} tool results, the stream had more calls"
            if position >= len(answers) or _sent_id(answers[position].get("tool_use_id")) != cid:
                return (
                    f"messages[{at + 1}]: the tool_result blocks must answer the calls in call "
                    f"order; result {position} is not for {cid!r}"
                )
            if _result_text(answers[position]) != results[position]:
                return (
                    f"the tool_result for {cid!r} ({name}) is "
                    f"{_result_text(answers[position])!r}; expected {results[position]!r}"
                )
    return None


def _check_no_salvage(messages: list[dict[str, Any]], previous: _Sent) -> str | None:
    ids = {c[0] for c in previous.calls if c[0]}
    if not ids:
        return None
    for at, message in enumerate(messages):
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for entry in calls:
                if isinstance(entry, dict) and entry.get("id") in ids:
                    return (
                        f"messages[{at}] carries tool call {entry.get('id')!r} from the previous "
                        f"turn, which did not end complete ({previous.result.end_how}: "
                        f"{previous.result.end_reason}); an incomplete call must not reach history"
                    )
        if message.get("role") == "tool" and message.get("tool_call_id") in ids:
            return (
                f"messages[{at}] is a tool result for {message.get('tool_call_id')!r} from the "
                "previous turn, which did not end complete"
            )
    return None
