"""The viewer's plumbing (:mod:`fsm.web.pages`): keyset cursors, a page's :class:`View`, the scan workers and the caches of slow pages."""

from __future__ import annotations

import base64
import binascii
import json
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from fsm.states import ToolCallState
from fsm.store.errors import InvalidFilterError
from fsm.web.html import when

#: rows per page of each listing (``limit=`` may ask for fewer or more, up to MAX_LIMIT).
LIMITS: Final = {
    "conversations": 50,
    "calls": 100,
    "failures": 100,
    "timeline": 200,
    "attempts": 50,
}
MAX_LIMIT: Final = 500
#: violations the check page keeps (the counts per kind cover every one).
MAX_VIOLATIONS: Final = 1000
#: groups a whole-store page lists (tools and failure counts the largest first, models); the
#: JSON says how many there are in all (``tools_total``, ``models_total``, ``counts_groups``)
MAX_GROUPS: Final = 500
STATES: Final = tuple(s.value for s in ToolCallState)
#: the APIs a conversation may use (``api=``), as the pages name them
APIS: Final = {"chat": "Chat Completions", "responses": "Responses", "anthropic": "Anthropic"}
#: a listing's total is counted exactly up to this many rows (then shown "10,000+")
TOTAL_CAP: Final = 10_000
#: the seconds a count may take (on a scan worker); beyond, the total is not shown
TOTAL_SECONDS: Final = 30.0
#: the seconds one page with a text search (``q=``) may take before it is refused
SEARCH_SECONDS: Final = 5.0
#: the rows one export (``?format=csv``) holds at most; the cursor of the rest is in the
#: ``X-Fsm-Next-Cursor`` header
EXPORT_ROWS: Final = 10_000
#: the listings that export (their rows as CSV)
EXPORTS: Final = ("/", "/calls", "/failures")


class Query:
    """A request's query string, parsed: one value per name (the last), or all of them."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs = list(pairs)

    def get(self, name: str) -> str | None:
        """The last non-empty value of ``name``, stripped, or ``None``."""
        for key, value in reversed(self.pairs):
            if key == name and value.strip():
                return value.strip()
        return None

    def all(self, name: str) -> list[str]:
        """Every non-empty value of ``name``, in order."""
        return [v for k, v in self.pairs if k == name and v.strip()]

    def limit(self, default: int, name: str = "limit") -> int:
        """``limit=`` (or ``name=``): a whole number from 1 to :data:`MAX_LIMIT` (the page's
        default if absent)."""
        given = self.get(name)
        if given is None:
            return default
        if not (given.isascii() and given.isdigit()) or not 1 <= int(given) <= MAX_LIMIT:
            raise InvalidFilterError(f"{name} must be a whole number from 1 to {MAX_LIMIT}")
        return int(given)


def cursor(key: Sequence[Any]) -> str:
    """An opaque cursor for a row key (the same encoding as the CLI's ``--after``)."""
    raw = json.dumps(list(key), separators=(",", ":"), ensure_ascii=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def uncursor(text_: str | None, size: int) -> tuple[Any, ...] | None:
    """The key of a cursor (``None`` for none); :class:`InvalidFilterError` if it is not one."""
    if text_ is None:
        return None
    try:
        key = json.loads(base64.urlsafe_b64decode(text_ + "=" * (-len(text_) % 4)))
    except (ValueError, binascii.Error):
        key = None
    if (
        not isinstance(key, list)
        or len(key) != size
        or not all(isinstance(p, str) or type(p) is int for p in key)
    ):
        raise InvalidFilterError(f"{text_!r} is not a cursor of this page")
    return tuple(key)


@dataclass(frozen=True, slots=True)
class View:
    """What a route returns: the page's title, its HTML body, its data (the JSON twin) and the
    status (200, or 404 for a conversation that does not exist)."""

    title: str
    body: str
    data: dict[str, Any]
    status: int = 200
    #: reload the page after this many seconds (a computation still running)
    refresh: int | None = None


class Pending(Exception):
    """A whole-store computation still running (or waiting for a worker) after the wait budget
    (since ``started``)."""

    def __init__(self, started: datetime) -> None:
        super().__init__(f"computing since {started.isoformat()}")
        self.started = started


class Busy(Exception):
    """Every worker of the whole-store computations is busy and their queue is full: a new
    computation is refused (the page answers 503 with ``Retry-After``)."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(
            "the viewer is busy with other whole-store computations (statistics, counts, the "
            f"integrity check): retry in {retry_after} seconds"
        )
        self.retry_after = retry_after


class _Job:
    """One computation, run by a worker of :class:`Scans`."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self.started = datetime.now(UTC)
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._compute = compute

    def run(self) -> None:
        """Compute (on a worker's thread); the result or the error is kept for the requests."""
        self.started = datetime.now(UTC)
        clock = time.perf_counter()
        try:
            self.value = self._compute()
        except BaseException as exc:  # handed to the request that collects the job
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - clock
            self.done.set()


class Scans:
    """The whole-store computations of one viewer (``/stats``, the counts of ``/failures``,
    ``/check``): at most ``workers`` run at once, on threads of their own, and at most
    ``queued`` wait for one; beyond that a new computation is refused with :class:`Busy`, so
    that no number of distinct requests can start more scans than the store can serve."""

    def __init__(self, workers: int = 2, queued: int = 8, retry_after: int = 5) -> None:
        self.workers = workers
        self.retry_after = retry_after
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=queued)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def submit(self, compute: Callable[[], Any]) -> _Job:
        """Queue ``compute``; :class:`Busy` when the queue is full."""
        job = _Job(compute)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Busy(self.retry_after) from None
        with self._lock:
            if len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name="fsm-web-scan", daemon=True)
                self._threads.append(thread)
                thread.start()
        return job

    def _work(self) -> None:
        while True:
            self._queue.get().run()


class Cache:
    """The last few results of a slow whole-store computation (stats, the check), by their
    filters, so that a reload renders at once; ``refresh=1`` recomputes. A computation runs on
    a worker of ``scans`` (shared by every page): a request waits for it at most ``budget``
    seconds, then gets :class:`Pending` (the page says so and reloads itself) while it goes on;
    one computation per key at a time, however many requests ask, and :class:`Busy` when the
    workers and their queue are full."""

    def __init__(self, scans: Scans, size: int = 8, budget: float = 2.0) -> None:
        self._items: OrderedDict[Any, tuple[Any, datetime, float]] = OrderedDict()
        self._running: dict[Any, _Job] = {}
        self._lock = threading.Lock()
        self._size = size
        self._scans = scans
        self.budget = budget

    def get(
        self, key: Any, compute: Callable[[], Any], refresh: bool
    ) -> tuple[Any, datetime, float]:
        """The result for ``key``: kept, or computed now (within the budget), else
        :class:`Pending` (or :class:`Busy`)."""
        with self._lock:
            job = self._running.get(key)
            if job is None:
                if not refresh and key in self._items:
                    self._items.move_to_end(key)
                    return self._items[key]
                job = self._running[key] = self._scans.submit(compute)
        if not job.done.wait(self.budget):
            raise Pending(job.started)
        with self._lock:
            if self._running.get(key) is job:
                del self._running[key]
                if job.error is None:
                    self._items[key] = (job.value, datetime.now(UTC), job.seconds)
                    while len(self._items) > self._size:
                        self._items.popitem(last=False)
        if job.error is not None:
            raise job.error
        return job.value, datetime.now(UTC), job.seconds


def pending_view(title: str, pending: Pending, what: str) -> View:
    body = (
        f'<p class="computing">Computing {what} over the whole store (started '
        f"{when(pending.started)}): this page reloads itself every 2 seconds until it is "
        "ready.</p>"
    )
    return View(title, body, {"computing": True, "started_at": pending.started}, 202, refresh=2)
