"""The client side of the store's per-operation deadline (``timeout=``), and how a failed
transaction tells a known outcome from an unknown one.

The server enforces the deadline by itself (``statement_timeout``, ``lock_timeout`` and
``idle_in_transaction_session_timeout``, set per transaction by :mod:`fsm.store.engine`), and
the kernel through TCP keepalives and ``tcp_user_timeout``; but a network that silently drops
packets after a stateful middlebox (a black hole: every packet acknowledged by something, none
answered) leaves a client blocked in ``recv`` forever, with the server never told. So each
operation of a PostgreSQL store also arms a :class:`Deadline` on its connection: one watchdog
thread per process, which, when the deadline passes, shuts the connection's socket down. The
blocked call then fails at once, the store raises
:class:`~fsm.store.errors.StoreUnavailableError` (or
:class:`~fsm.store.errors.CommitOutcomeUnknownError` if COMMIT was in flight), and the server,
no longer hearing from the session, ends it after ``idle_in_transaction_session_timeout``,
which frees the conversation's lock for the next writer.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from fsm.store.errors import StoreError

__all__ = [
    "DEFAULT_TIMEOUT",
    "Deadline",
    "InvalidTimeoutError",
    "check_timeout",
    "server_refused",
    "socket_fd",
]

#: the default per-operation deadline of a store, in seconds (``timeout=`` of
#: :class:`~fsm.store.ConversationStore` and :class:`~fsm.store.aio.AsyncConversationStore`)
DEFAULT_TIMEOUT: Final = 30.0


class InvalidTimeoutError(StoreError, ValueError):
    """A store's ``timeout`` must be a positive number of seconds, or ``None`` (no deadline)."""


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as a float, or ``None``; :class:`InvalidTimeoutError` for anything else."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidTimeoutError(
            f"timeout must be a number of seconds or None, not {type(timeout).__name__}"
        )
    value = float(timeout)
    if not math.isfinite(value) or value <= 0:
        raise InvalidTimeoutError(
            f"timeout must be a positive number of seconds (or None for no deadline), not "
            f"{timeout!r}"
        )
    return value


class _Watchdog:
    """One thread per process that runs the actions of deadlines that pass."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def arm(self, seconds: float, action: Callable[[], None]) -> int:
        with self._cond:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._heap, self._live, self._thread = [], set(), None
                self._pid = os.getpid()
            ident = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + seconds, ident, action))
            self._live.add(ident)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fsm-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()
            return ident

    def disarm(self, ident: int) -> None:
        """After this returns the action of ``ident`` will not run (it may have run)."""
        with self._cond:
            self._live.discard(ident)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait(60.0)
                    if not self._heap:
                        self._thread = None
                        return
                    continue
                when, ident, action = self._heap[0]
                delay = when - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(ident)
                with contextlib.suppress(Exception):
                    action()


_WATCHDOG: Final = _Watchdog()


class Deadline:
    """The client-side deadline of one operation on one PostgreSQL connection.

    ``Deadline(seconds, driver_connection)`` arms it (no-op for ``seconds=None`` or a connection
    without a socket, as SQLite's); :meth:`cancel` disarms it; ``fired`` says whether it passed
    (the connection's socket was then shut down, and the connection must be invalidated).
    ``committing`` is set by the store right before COMMIT is sent.
    """

    def __init__(self, seconds: float | None, driver_connection: Any) -> None:
        self.seconds = seconds
        self.fired = False
        self.committing = False
        self._ident: int | None = None
        fd = socket_fd(driver_connection)
        if seconds is not None and fd is not None:
            self._ident = _WATCHDOG.arm(seconds, lambda: self._fire(fd))

    def _fire(self, fd: int) -> None:
        self.fired = True
        # shutdown() acts on the socket itself, which the dup shares: the driver's blocked
        # recv/poll returns at once with an end of file
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        if self._ident is not None:
            _WATCHDOG.disarm(self._ident)
            self._ident = None


def socket_fd(driver_connection: Any) -> int | None:
    """The socket of a psycopg connection (sync or async), or ``None``."""
    pgconn = getattr(driver_connection, "pgconn", None)
    if pgconn is None:
        return None
    try:
        fd = int(pgconn.socket)
    except Exception:  # closed, or not a socket
        return None
    return fd if fd >= 0 else None


def server_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is an error the server answered with for a statement
    (SQLSTATE outside the classes of a lost or ended session: 08, 57P0x), not a connection
    lost without an answer."""
    seen: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in seen:
        seen.append(error)
        state = getattr(error, "sqlstate", None)
        if isinstance(state, str) and state:
            return not state.startswith(("08", "57P"))
        error = error.__cause__ or error.__context__
    return False
