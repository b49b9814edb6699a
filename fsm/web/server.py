"""The viewer's HTTP side: :class:`App` turns one request (method, target, headers) into a
:class:`Response`, with every rule of safety in one place; :func:`serve` runs it on the standard
library's threading HTTP server until Ctrl-C.

Safety, by construction:

* the store is opened by :func:`fsm.store.audit.open_readonly` (SQLite ``mode=ro``, PostgreSQL
  read-only transactions): the database refuses any write, and no route writes;
* only ``GET`` and ``HEAD``: any other method gets 405 (with ``Allow: GET, HEAD``);
* with a token, every request must carry it (``?token=``, which sets an HttpOnly cookie and
  redirects to the same page without it, the cookie, or ``Authorization: Bearer``), else 401;
  without one (loopback only), the ``Host`` header must name the loopback address the server
  is bound to, so that a web page cannot reach it through DNS rebinding (403 otherwise);
* every response carries a strict Content-Security-Policy (no script at all, styles and images
  from the package's own ``/static/`` only, no inline style, no form posting elsewhere, no
  framing), ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and
  ``Cache-Control: no-store``; pages hold no script and no event handler, and every stored value
  is escaped (:mod:`fsm.web.html`).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Final
from urllib.parse import parse_qsl, unquote_to_bytes, urlencode, urlsplit

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fsm.errors import FsmError
from fsm.store.errors import InvalidFilterError
from fsm.web import pages
from fsm.web.html import href, page, text
from fsm.web.pages import (
    EXPORTS,
    Busy,
    Query,
    View,
    Viewer,
    as_csv,
    as_json,
    json_twin,
)

__all__ = ["CSP", "App", "Response", "Serving", "is_loopback", "serve"]

#: the Content-Security-Policy of every response: nothing runs, nothing loads from elsewhere.
CSP: Final = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_COOKIE: Final = "fsm_audit_token"
#: what ``surrogateescape`` makes of bytes that are not UTF-8 (no UTF-8 text decodes to these)
_NOT_UTF8: Final = re.compile("[\udc80-\udcff]")
_STATIC: Final = {
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}


@dataclass(frozen=True, slots=True)
class Response:
    """One HTTP response: status, headers (the security headers are added to every one) and
    body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def all_headers(self) -> dict[str, str]:
        """The response's headers with the security headers and the body's length."""
        return {**_SECURITY_HEADERS, **self.headers, "Content-Length": str(len(self.body))}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class App:
    """The viewer as a function of requests: :meth:`respond`.

    ``token``: required on every request when set. ``hosts``: the ``Host`` values accepted when
    there is no token (the loopback names of the bound port); ``None`` accepts any (tests).
    ``label``: the store as the pages' header shows it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        label: str,
        token: str | None = None,
        hosts: frozenset[str] | None = None,
    ) -> None:
        self.viewer = Viewer(engine)
        self.label = label
        self.token = token
        self.hosts = hosts

    def respond(self, method: str, target: str, headers: Mapping[str, str]) -> Response:
        """The response to ``method target`` with ``headers`` (names case-insensitive)."""
        lowered = {k.lower(): v for k, v in headers.items()}
        parts = urlsplit(target)
        pairs = parse_qsl(parts.query, keep_blank_values=True, errors="surrogateescape")
        denied = self._denied(parts.path, pairs, lowered)
        if denied is not None:
            return denied
        if method not in ("GET", "HEAD"):
            return _plain(
                HTTPStatus.METHOD_NOT_ALLOWED,
                "This viewer is read-only: only GET and HEAD.",
                {"Allow": "GET, HEAD"},
            )
        query = Query([(k, v) for k, v in pairs if k != "token"])
        if any(_NOT_UTF8.search(k) or _NOT_UTF8.search(v) for k, v in query.pairs):
            response = self._error(
                HTTPStatus.BAD_REQUEST,
                "The query string must be UTF-8 (percent-encoded): a value is not.",
                parts.path,
                Query([(k, v) for k, v in query.pairs if k == "format"]),
            )
        else:
            response = self._get(parts.path, query)
        if method == "HEAD":
            return Response(
                response.status, b"", {**response.headers, "X-Body-Length": str(len(response.body))}
            )
        return response

    # -- access --------------------------------------------------------------------------------
    def _denied(
        self, path: str, pairs: list[tuple[str, str]], headers: Mapping[str, str]
    ) -> Response | None:
        if self.token is None:
            if self.hosts is not None and headers.get("host", "").lower() not in self.hosts:
                return _plain(
                    HTTPStatus.FORBIDDEN,
                    "Unexpected Host header: open the viewer at the address it printed.",
                )
            return None
        given = [v for k, v in pairs if k == "token"]
        if given and self._matches(given[-1]):
            # the token in the URL: keep it in a cookie and take it out of the address bar
            rest = urlencode([(k, v) for k, v in pairs if k != "token"], errors="surrogateescape")
            location = (path or "/") + (f"?{rest}" if rest else "")
            return Response(
                HTTPStatus.SEE_OTHER,
                b"",
                {
                    "Location": location,
                    "Set-Cookie": f"{_COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/",
                },
            )
        bearer = headers.get("authorization", "")
        if bearer.lower().startswith("bearer ") and self._matches(bearer[7:].strip()):
            return None
        for item in headers.get("cookie", "").split(";"):
            name, _, value = item.strip().partition("=")
            if name == _COOKIE and self._matches(value):
                return None
        return _plain(
            HTTPStatus.UNAUTHORIZED,
            "This viewer needs its token: open the URL with ?token= that fsm audit serve printed.",
            {"WWW-Authenticate": 'Bearer realm="fsm audit"'},
        )

    def _matches(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.token.encode())

    # -- pages ---------------------------------------------------------------------------------
    def _get(self, path: str, query: Query) -> Response:
        if path in _STATIC:
            name, content_type = _STATIC[path]
            body = resources.files("fsm.web").joinpath("static", name).read_bytes()
            return Response(HTTPStatus.OK, body, {"Content-Type": content_type})
        try:
            if query.get("format") == "csv" and path not in EXPORTS:
                return self._error(
                    HTTPStatus.BAD_REQUEST,
                    "format=csv exports a listing: /, /calls or /failures.",
                    path,
                    query,
                )
            if path.startswith("/c/") and len(path) > 3:
                raw = unquote_to_bytes(path[3:])
                try:
                    conversation_id = raw.decode("utf-8")
                except UnicodeDecodeError:
                    return self._error(
                        HTTPStatus.BAD_REQUEST, "A conversation id must be UTF-8.", path, query
                    )
                view = self.viewer.timeline(conversation_id, query)
                current = "/"
            else:
                current, function = self.viewer.route(path)
                if function is None:
                    return self._error(HTTPStatus.NOT_FOUND, f"No page {path}.", path, query)
                if query.get("format") == "csv":
                    return self._export(path, function, query)
                view = function(query)
        except InvalidFilterError as exc:
            return self._error(HTTPStatus.BAD_REQUEST, " ".join(str(exc).split()), path, query)
        except Busy as exc:
            return self._error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                str(exc),
                path,
                query,
                {"Retry-After": str(exc.retry_after)},
            )
        except sa.exc.DBAPIError as exc:
            reason = " ".join(str(exc.orig).split())
            return self._error(
                HTTPStatus.SERVICE_UNAVAILABLE, f"cannot read the store: {reason}", path, query
            )
        except FsmError as exc:
            return self._error(
                HTTPStatus.SERVICE_UNAVAILABLE, " ".join(str(exc).split()), path, query
            )
        except sa.exc.TimeoutError:
            return self._error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "every connection to the store is in use: retry shortly",
                path,
                query,
                {"Retry-After": "2"},
            )
        return self._render(view, path, query, current)

    def _export(self, path: str, function: Callable[[Query], View], query: Query) -> Response:
        """The rows of a listing with its filters as CSV: pages of ``pages.MAX_LIMIT`` from the
        query's ``after=``, at most ``pages.EXPORT_ROWS`` rows; the cursor of the rest in the
        ``X-Fsm-Next-Cursor`` header (and a ``Link: rel="next"``)."""
        kept = [(k, v) for k, v in query.pairs if k not in ("after", "limit", "format")]
        after = query.get("after")
        rows: list[dict[str, Any]] = []
        while True:
            size = min(pages.MAX_LIMIT, pages.EXPORT_ROWS - len(rows))
            pairs = [*kept, ("limit", str(size))]
            pairs += [("format", "csv"), *([("after", after)] if after else [])]
            data = function(Query(pairs)).data
            rows += data["rows"]
            after = data.get("next")
            if after is None or len(rows) >= pages.EXPORT_ROWS:
                break
        name = "conversations" if path == "/" else path.strip("/")
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        headers = {
            "Content-Type": "text/csv; charset=utf-8",
            "Content-Disposition": f'attachment; filename="fsm-{name}-{stamp}.csv"',
            "X-Fsm-Rows": str(len(rows)),
        }
        if after is not None:
            headers["X-Fsm-Next-Cursor"] = after
            headers["Link"] = (
                f'<{href(path, [*kept, ("after", after), ("format", "csv")])}>; rel="next"'
            )
        return Response(HTTPStatus.OK, as_csv(rows), headers)

    def _render(self, view: View, path: str, query: Query, current: str) -> Response:
        if query.get("format") == "json":
            return Response(
                view.status, as_json(view.data), {"Content-Type": "application/json; charset=utf-8"}
            )
        twin = json_twin(path, query)  # the path as it was sent (still percent-encoded)
        reload = None
        if view.refresh is not None:
            # the same page without refresh=1, which would start the computation again
            again = href(path, [(k, v) for k, v in query.pairs if k != "refresh"])
            reload = (view.refresh, again)
        document = page(
            view.title, view.body, current=current, json_link=twin, store=self.label, refresh=reload
        )
        return Response(
            view.status,
            document.encode("utf-8", "surrogateescape"),
            {"Content-Type": "text/html; charset=utf-8"},
        )

    def _error(
        self,
        status: HTTPStatus,
        message: str,
        path: str,
        query: Query,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        if query.get("format") == "json":
            return Response(
                status,
                as_json({"error": message, "status": int(status)}),
                {"Content-Type": "application/json; charset=utf-8", **(headers or {})},
            )
        body = f'<p class="error">{text(message)}</p><p><a href="/">Conversations</a></p>'
        document = page(status.phrase, body, current="", json_link=None, store=self.label)
        return Response(
            status,
            document.encode("utf-8", "surrogateescape"),
            {"Content-Type": "text/html; charset=utf-8", **(headers or {})},
        )


def _plain(status: HTTPStatus, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        status,
        (message + "\n").encode(),
        {"Content-Type": "text/plain; charset=utf-8", **(headers or {})},
    )


# -- serving -----------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "fsm-audit"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # a read that waits longer fails with a timeout (an OSError): the connection is closed
        self.connection.settimeout(self.server.read_timeout)

    def _answer(self) -> None:
        headers = {k: v for k, v in self.headers.items()}
        try:
            response = self.server.app.respond(self.command, self.path, headers)
        except Exception as exc:  # a bug: one line to the client, the traceback to the log
            self.server.handle_error(self.request, self.client_address)
            response = _plain(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"internal error: {type(exc).__name__} (a bug in fsm's viewer: please report it)",
            )
        self.send_response(response.status)
        for name, value in response.all_headers().items():
            if name == "X-Body-Length":
                continue
            if name == "Content-Length" and self.command == "HEAD":
                value = response.headers.get("X-Body-Length", value)
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def __getattr__(self, name: str) -> Callable[[], None]:
        # http.server looks up do_<METHOD>: every method is answered (405 but GET and HEAD)
        if name.startswith("do_"):
            return self._answer
        raise AttributeError(name)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log(f"{self.address_string()} {format % args}")


#: seconds a connection may take to send a request (or stay idle between two): then it is closed
READ_TIMEOUT: Final = 10.0
#: connections served at once (a thread each); one more is answered 503 and closed
MAX_CONNECTIONS: Final = 32
_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: 2\r\nConnection: close\r\nContent-Length: 68\r\n\r\n"
    b"The viewer is serving as many connections as it can: retry shortly.\n"
)


class _Server(ThreadingHTTPServer):
    """The threading server with bounds: each connection's socket has a read timeout (a
    half-open or idle connection is closed after it), and at most ``max_connections`` are
    served at once (one thread each); one more is answered 503 at once and closed."""

    daemon_threads = True
    app: App
    log: Callable[[str], None] | None
    read_timeout: float = READ_TIMEOUT
    slots: threading.BoundedSemaphore
    #: the requests (by id) that hold a slot, so that each gives it back once
    held: set[int]
    held_lock: threading.Lock

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self.held_lock:
            self.held.add(id(request))
        try:
            super().process_request(request, client_address)
        except BaseException:  # the thread did not start, or Ctrl-C landed right after it did
            self._free(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._free(request)

    def _free(self, request: Any) -> None:
        """Give back the slot of ``request``, once (its thread and a failed start may both
        try: releasing twice would raise in the thread and lose a slot's count)."""
        with self.held_lock:
            if id(request) not in self.held:
                return
            self.held.discard(id(request))
        self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that went away (or let its connection time out)
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _family(host: str) -> socket.AddressFamily:
    try:
        return (
            socket.AF_INET6
            if ipaddress.ip_address(host.strip("[]")).version == 6
            else socket.AF_INET
        )
    except ValueError:
        return socket.AF_INET


@dataclass
class Serving:
    """A viewer being served: its URL (with the token when there is one), and how to stop it."""

    url: str
    server: _Server

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (another thread) or Ctrl-C (``KeyboardInterrupt``)."""
        self.server.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()


def serve(
    engine: Engine,
    *,
    label: str,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    log: Callable[[str], None] | None = None,
    read_timeout: float = READ_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
) -> Serving:
    """Bind the viewer of ``engine`` to ``host:port`` (``port`` 0: any free port) and return it
    ready to :meth:`~Serving.serve_forever`. A host that is not loopback needs a token: one is
    generated when none is given (the URL carries it).

    ``read_timeout``: seconds a connection may take to send its request or stay idle between
    two (then it is closed); ``max_connections``: connections served at once (one more gets a
    503 with ``Retry-After`` and is closed)."""
    if not read_timeout > 0 or max_connections < 1:
        raise ValueError("read_timeout must be positive and max_connections at least 1")
    if not is_loopback(host) and token is None:
        token = secrets.token_urlsafe(24)
    family = _family(host)
    server_class = _Server if family == socket.AF_INET else _Server6
    server = server_class((host.strip("[]"), port), _Handler)
    bound_port = server.server_address[1]
    shown_host = f"[{host.strip('[]')}]" if _family(host) == socket.AF_INET6 else host
    hosts = None
    if token is None:
        names = {shown_host, "localhost", "127.0.0.1", "[::1]"}
        hosts = frozenset({*(f"{n}:{bound_port}" for n in names), *names})
    server.app = App(engine, label=label, token=token, hosts=hosts)
    server.log = log
    server.read_timeout = read_timeout
    server.slots = threading.BoundedSemaphore(max_connections)
    server.held = set()
    server.held_lock = threading.Lock()
    url = f"http://{shown_host}:{bound_port}/" + (f"?token={token}" if token else "")
    return Serving(url, server)
