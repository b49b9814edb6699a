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

This module is the server; what it plays (the script's turns, the recorded streams and how a
turn cuts or fails them) is :mod:`fsm.replay_script`, its checks of each request
:mod:`fsm.replay_checks`, and the three formats' wire details :mod:`fsm.replay_formats`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from fsm.replay_checks import (
    API_NAMES,
    PATH_OF_FORMAT,
    check_anthropic_round,
    check_no_salvage,
    check_responses_round,
    check_tool_round,
)
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
    openai_error_body,
    responses_items,
)
from fsm.replay_script import (
    CHAT_COMPLETIONS_PATH,
    EXAMPLES_DIR,
    ReplayFailure,
    ReplayTurn,
    Sent,
    carries_tool_results,
    demo_script,
    error_boundary,
    error_event,
    id_renamer,
    read_sent,
    responses_output,
    split_events,
    stream_pieces,
    what_is_sent,
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
        self._previous: Sent | None = None
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
            return check_no_salvage(messages, previous)
        if not previous.calls:
            return None
        results = turn.expect_tool_results if turn is not None else None
        return check_tool_round(messages, previous, results)

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
            return check_responses_round(items, previous_id, previous, results)
        messages = anthropic_messages(body)
        if isinstance(messages, str):
            return messages
        problem = check_anthropic_blocks(messages) or check_anthropic_tools(messages)
        if problem is not None or previous is None or previous.format != "anthropic":
            return problem
        return check_anthropic_round(messages, previous, results)

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
                        f"turn {self.served} of the script is a {API_NAMES[recorded]} stream, "
                        f"served at POST {PATH_OF_FORMAT[recorded]}, not {path}"
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
                sent = read_sent(what_is_sent(turn.data(), turn), turn.stream_format())
                if sent.response_id is not None and self.response_ids == "unique":
                    sent.response_id = f"{sent.response_id}-{self._id_token}-{self.served}"
                self._previous = sent
                if sent.format == "responses" and sent.response_id is not None:
                    self._outputs[sent.response_id] = responses_output(sent)
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
            rename = id_renamer(data, f"{self._id_token}-{number}", fmt)
        handler.start_stream()
        error_at = error_boundary(data, turn.error_at) if turn.error_at is not None else None
        stop = next((x for x in (turn.cut_at, turn.reset_at, error_at) if x is not None), len(data))
        stop = min(stop, len(data))
        sent = 0
        held = False
        for index, piece in enumerate(stream_pieces(data, stop, turn.hold_at)):
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
            handler.send_chunk(error_event(turn.error_message, fmt))
        handler.end_stream()
