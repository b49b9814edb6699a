"""The viewer's pages: each is a function of the read-only engine and the request's query that
returns a :class:`View`: the data (the page's JSON twin, ``?format=json``) and the HTML body
built from it. Every listing pages by keyset, as the CLI does (``after=`` the last row's key,
as an opaque cursor).

Routes: ``/`` conversations, ``/c/{id}`` one conversation's timeline, ``/calls``,
``/failures``, ``/stats``, ``/check``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import csv
import io
import json
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fsm.states import ToolCallState
from fsm.store import audit
from fsm.store.audit import browse
from fsm.store.audit.calls import Source
from fsm.store.errors import InvalidFilterError, StoreError
from fsm.web import charts
from fsm.web.html import attr, href, json_block, path_of, text, when

__all__ = ["Query", "View", "Viewer", "json_twin"]

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
_STATES: Final = tuple(s.value for s in ToolCallState)
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


class _Cache:
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


def _pending(title: str, pending: Pending, what: str) -> View:
    body = (
        f'<p class="computing">Computing {what} over the whole store (started '
        f"{when(pending.started)}): this page reloads itself every 2 seconds until it is "
        "ready.</p>"
    )
    return View(title, body, {"computing": True, "started_at": pending.started}, 202, refresh=2)


# -- shared bits -------------------------------------------------------------------------------
def _conversation_link(
    conversation_id: str, seq: int | None = None, *, anchor: str = "", attempt: int | None = None
) -> str:
    """The link to a conversation's timeline, at the page holding ``seq`` (and, for the
    attempt ``attempt`` at ``seq``, at the page of attempts that starts with it)."""
    query: dict[str, Any] = {}
    if seq is not None and seq >= LIMITS["timeline"]:
        query["after"] = (seq // LIMITS["timeline"]) * LIMITS["timeline"] - 1
    if seq is not None and attempt is not None:
        query["attempts_after"] = cursor((seq, attempt - 1))
    return href(path_of("c", conversation_id), query, anchor=anchor)


def _form(path: str, fields: Sequence[tuple[str, str, str | None, str]]) -> str:
    """A GET form of text inputs: (name, label, value, placeholder)."""
    inputs = "".join(
        f'<label>{label} <input name="{name}" value="{attr(value)}" '
        f'placeholder="{attr(placeholder)}"></label>'
        for name, label, value, placeholder in fields
    )
    return (
        f'<form class="filters" method="get" action="{path}">{inputs}'
        f'<button type="submit">Filter</button> <a href="{path}">clear</a></form>'
    )


def _select(name: str, label: str, value: str | None, options: Sequence[str]) -> str:
    choices = "".join(
        f'<option value="{attr(o)}"{" selected" if o == value else ""}>{text(o) or "any"}</option>'
        for o in ("", *options)
    )
    return f'<label>{label} <select name="{name}">{choices}</select></label>'


def _next_link(
    path: str, query: Query, next_cursor: str | None, shown: int, total: str = ""
) -> str:
    kept = [(k, v) for k, v in query.pairs if k not in ("after", "format", "refresh")]
    first = href(path, kept)
    parts = [f'<span class="count">{shown} row{"s" if shown != 1 else ""} {total}</span>']
    if any(k == "after" for k, _ in query.pairs):
        parts.append(f'<a href="{first}">first page</a>')
    if next_cursor is not None:
        parts.append(
            f'<a rel="next" class="next" href="{href(path, [*kept, ("after", next_cursor)])}">next page</a>'
        )
    return f'<nav class="pager">{" ".join(parts)}</nav>'


def json_twin(path: str, query: Query) -> str:
    return href(path, [*((k, v) for k, v in query.pairs if k != "format"), ("format", "json")])


def _arguments(arguments: str, state: str) -> str:
    """A call's arguments: pretty-printed JSON, or the raw text marked as not JSON (a cut or
    invalid text), or a note for none."""
    if not arguments.strip():
        return '<p class="none">(no arguments)</p>'
    try:
        value = json.loads(arguments)
    except ValueError:
        why = "cut: not JSON" if state != ToolCallState.FINISHED.value else "not JSON"
        return (
            f'<p class="raw-mark">raw text ({why})</p>'
            f'<pre class="raw">{text(arguments, newlines=True)}</pre>'
        )
    return json_block(value)


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return f'<pre class="content">{text(value, newlines=True)}</pre>'
    return json_block(value)


def _path_of_states(call: browse.TimelineCall) -> str:
    """The call's states as the machine's path: opened -> accumulating (when arguments came)
    -> its final state, named as :class:`fsm.states.ToolCallState` names them."""
    steps = [ToolCallState.OPENED.value]
    if call.arguments or call.raw_arguments:
        steps.append(ToolCallState.ACCUMULATING.value)
    if call.state not in steps:
        steps.append(call.state)
    shown = ' <span class="arrow">\u2192</span> '.join(
        f'<span class="state state-{attr(s) if s in _STATES else "unknown"}">{text(s)}</span>'
        for s in steps
    )
    return f'<p class="path" title="the call\'s path through the state machine">{shown}</p>'


def _cut_note(fields: Sequence[str]) -> str:
    """The note of a row whose values were cut at :data:`browse.VALUE_CHARS` characters."""
    if not fields:
        return ""
    return (
        f'<p class="cut">{text(", ".join(fields))}: cut at {browse.VALUE_CHARS:,} characters '
        "here (the whole value: <code>fsm history</code>, or the store's Python API)</p>"
    )


def _more_groups(total: int) -> str:
    """The note under a table of groups cut at :data:`MAX_GROUPS` (nothing when it is not)."""
    if total <= MAX_GROUPS:
        return ""
    return (
        f'<p class="cut">{MAX_GROUPS:,} of {total:,} shown (all of them: '
        "<code>fsm audit stats</code>, <code>fsm audit failures --counts</code>)</p>"
    )


def _more_calls_note() -> str:
    return (
        f'<p class="cut">more than {browse.CALLS_PER_TURN} calls: the first '
        f"{browse.CALLS_PER_TURN} are shown (all of them: <code>fsm audit calls "
        "--conversation</code>)</p>"
    )


def _state_badge(state: str) -> str:
    css = state if state in _STATES else "unknown"
    return f'<span class="state state-{css}">{text(state)}</span>'


def _short(value: Any, limit: int = 160) -> str:
    if value is None:
        return ""
    shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(shown) > limit:
        shown = shown[: limit - 1] + "\u2026"
    return text(shown)


def _dicts(rows: Sequence[Any]) -> list[dict[str, Any]]:
    return [row.as_dict() for row in rows]


def _cut_row(row: dict[str, Any]) -> dict[str, Any]:
    """A listing's row with each text value (or JSON value, as its text) longer than
    :data:`browse.VALUE_CHARS` characters cut there, the fields named in ``cut``: a JSON twin's
    size is bounded by its rows."""
    cut: list[str] = []
    for name, value in row.items():
        if isinstance(value, str):
            shown = value
        elif isinstance(value, dict | list):
            shown = json.dumps(value, ensure_ascii=False, default=str)
        else:
            continue
        if len(shown) > browse.VALUE_CHARS:
            row[name] = shown[: browse.VALUE_CHARS]
            cut.append(name)
    row["cut"] = cut
    return row


def _api(query: Query) -> str | None:
    """``api=``: ``chat``, ``responses`` or ``anthropic`` (``format=`` is the JSON twin's)."""
    given = query.get("api")
    if given is not None and given not in APIS:
        raise InvalidFilterError(f"api must be chat, responses or anthropic, not {given!r}")
    return given


def _api_badge(fmt: str | None) -> str:
    """An API as a page shows it (``-`` for unknown)."""
    if fmt is None:
        return '<span class="none">-</span>'
    name = APIS.get(fmt, fmt)
    return f'<span class="api api-{attr(fmt) if fmt in APIS else "other"}">{text(name)}</span>'


def _api_select(value: str | None) -> str:
    choices = "".join(
        f'<option value="{key}"{" selected" if key == value else ""}>{name}</option>'
        for key, name in (("", "any"), *APIS.items())
    )
    return f'<label>API <select name="api">{choices}</select></label>'


class SearchTooSlow(InvalidFilterError):
    """A text search (``q=``) that took longer than its time cap."""


@contextlib.contextmanager
def bounded(engine: Engine, seconds: float, what: str) -> Iterator[Connection]:
    """A read-only snapshot connection whose statements may run ``seconds`` in all: PostgreSQL's
    ``statement_timeout`` (per statement), SQLite's progress handler (interrupts past the
    deadline). A statement cut there raises :class:`SearchTooSlow` naming ``what``."""
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if not sqlite:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        raw: Any = conn.connection.dbapi_connection
        deadline = time.monotonic() + seconds
        try:
            with conn.begin():
                if sqlite:
                    raw.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
                else:
                    conn.exec_driver_sql(
                        f"SET LOCAL statement_timeout = {max(1, int(seconds * 1000))}"
                    )
                yield conn
        except (sa.exc.OperationalError, StoreError) as exc:
            if _interrupted(exc):
                raise SearchTooSlow(
                    f"{what} took more than {seconds:g} s: narrow it with other filters "
                    "(since=, until=, model=, tool=, conversation=)"
                ) from None
            raise
        finally:
            if sqlite:
                raw.set_progress_handler(None, 0)


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a statement cut by its time cap:
    PostgreSQL's query_canceled (57014), SQLite's "interrupted"."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if getattr(current, "sqlstate", None) == "57014" or str(current) == "interrupted":
            return True
        todo += [current.__cause__, current.__context__, getattr(current, "orig", None)]
    return False


def _total_note(data: Mapping[str, Any]) -> str:
    """The total of a listing's rows as its pager shows it."""
    if data.get("total_computing"):
        return '<span class="total computing">of \u2026 (counting\u2026; this page reloads)</span>'
    total = data.get("total")
    if total is None:
        why = data.get("total_refused") or "not counted"
        return f'<span class="total none" title="{attr(why)}">(total not counted)</span>'
    return f'<span class="total">of {total:,}{"+" if data.get("total_capped") else ""}</span>'


def _export_links(path: str, query: Query) -> str:
    kept = [(k, v) for k, v in query.pairs if k not in ("after", "format", "limit", "refresh")]
    csv_link = href(path, [*kept, ("format", "csv")])
    json_link = href(path, [*kept, ("limit", str(MAX_LIMIT)), ("format", "json")])
    return (
        f'<p class="export">Export <a href="{csv_link}">CSV</a> (up to {EXPORT_ROWS:,} rows) / '
        f'<a href="{json_link}">JSON</a> (a page of up to {MAX_LIMIT} rows)</p>'
    )


#: characters that make a spreadsheet read a cell as a formula (OWASP: CSV injection)
_FORMULA_STARTS: Final = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> str:
    """A value as a CSV cell: text that starts like a formula gets a leading ``'`` (so that
    spreadsheets show it as text); JSON values as JSON; times ISO 8601; ``None`` empty."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if shown.startswith(_FORMULA_STARTS):
        return "'" + shown
    return shown


def as_csv(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """Rows (dicts with the same keys) as CSV with a header row (UTF-8, CRLF line ends, lone
    surrogates as ``\\uXXXX``)."""
    from fsm.cli.output import escape_surrogates

    out = io.StringIO()
    writer = csv.writer(out)
    if rows:
        names = list(rows[0])
        writer.writerow(names)
        for row in rows:
            writer.writerow([csv_cell(row.get(name)) for name in names])
    return escape_surrogates(out.getvalue()).encode("utf-8")


# -- the viewer --------------------------------------------------------------------------------
class Viewer:
    """The pages over one read-only engine (see :func:`fsm.store.audit.open_readonly`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scans = Scans()
        self._stats = _Cache(self.scans)
        self._check = _Cache(self.scans, size=2)
        # the listings' totals: a short wait (the page shows "counting" and reloads)
        self._totals = _Cache(self.scans, size=64, budget=1.0)

    @contextlib.contextmanager
    def _bind(self, search: str | None) -> Iterator[Engine | Connection]:
        """The engine, or with a text search a connection whose statements are cut at
        :data:`SEARCH_SECONDS`."""
        if search is None:
            yield self.engine
            return
        with bounded(self.engine, SEARCH_SECONDS, f"the search q={search!r}") as conn:
            yield conn

    def _total(
        self,
        path: str,
        filters: Mapping[str, Any],
        count: Callable[[Connection], tuple[int, bool]],
        query: Query,
    ) -> dict[str, Any]:
        """The total of a listing's rows (``total``, ``total_capped``), counted on a scan
        worker up to :data:`TOTAL_CAP` within :data:`TOTAL_SECONDS`; ``total_computing`` while
        it runs (past the page's short wait), ``total_refused`` why it was not counted."""
        if query.get("format") == "csv":
            return {}
        key = ("total", path, json.dumps(sorted(filters.items()), default=str))

        def compute() -> tuple[int, bool]:
            with bounded(self.engine, TOTAL_SECONDS, "counting the rows") as conn:
                return count(conn)

        out: dict[str, Any] = {"total": None, "total_capped": False, "total_computing": False}
        try:
            (total, capped), _, _ = self._totals.get(key, compute, query.get("refresh") == "1")
        except Pending:
            out["total_computing"] = True
        except (Busy, SearchTooSlow) as exc:
            out["total_refused"] = str(exc)
        else:
            out.update(total=total, total_capped=capped)
        return out

    # routes: path -> (current nav entry, function)
    def route(self, path: str) -> tuple[str, Callable[[Query], View]] | tuple[str, None]:
        """The page of ``path`` (already split from its query), or ``None``."""
        fixed: dict[str, Callable[[Query], View]] = {
            "/": self.conversations,
            "/calls": self.calls,
            "/failures": self.failures,
            "/stats": self.stats,
            "/check": self.check,
        }
        if path in fixed:
            return path, fixed[path]
        return path, None

    # -- / -------------------------------------------------------------------------------------
    def conversations(self, query: Query) -> View:
        """Conversations newest first, filtered by id prefix, model, API, time range and a
        text in their id (``q=``)."""
        limit = query.limit(LIMITS["conversations"])
        after = uncursor(query.get("after"), 2)
        filters: dict[str, Any] = {
            "prefix": query.get("prefix"),
            "model": query.get("model"),
            "since": query.get("since"),
            "until": query.get("until"),
            "api": _api(query),
            "search": query.get("q"),
        }
        with self._bind(filters["search"]) as bind:
            rows = browse.conversations(bind, **filters, limit=limit, after=after)
        next_cursor = cursor(rows[-1].key) if len(rows) == limit else None
        total = self._total(
            "/",
            filters,
            lambda conn: browse.count_conversations(conn, **filters, cap=TOTAL_CAP),
            query,
        )
        data = {"filters": filters, "rows": _dicts(rows), "next": next_cursor, **total}
        form = _form(
            "/",
            [
                ("q", "id contains", filters["search"], "search"),
                ("prefix", "id starts with", filters["prefix"], "demo-"),
                ("model", "model", filters["model"], "gpt-4o"),
                ("since", "since", filters["since"], "2026-11-01"),
                ("until", "until", filters["until"], "2026-12-01"),
            ],
        ).replace('<button type="submit">', f'{_api_select(filters["api"])}<button type="submit">')
        body = [
            form,
            _export_links("/", query),
            '<table class="rows"><thead><tr><th>conversation</th><th>API</th><th>created</th>'
            "<th>last activity</th><th>messages</th><th>calls</th><th>failed attempts</th>"
            "</tr></thead><tbody>",
        ]
        for row in rows:
            failed = (
                f'<a class="bad" href="{_conversation_link(row.id, anchor="attempts")}">'
                f"{row.attempts:,}{'+' if row.attempts_capped else ''}</a>"
                if row.attempts
                else "0"
            )
            body.append(
                f'<tr><td><a class="id" href="{_conversation_link(row.id)}">{text(row.id)}</a></td>'
                f"<td>{_api_badge(row.format)}</td><td>{when(row.created_at)}</td><td>{when(row.last_activity)}</td>"
                f'<td class="n">{row.messages}</td>'
                f'<td class="n">{row.calls:,}{"+" if row.calls_capped else ""}</td>'
                f'<td class="n">{failed}</td></tr>'
            )
        body.append("</tbody></table>")
        body.append(_next_link("/", query, next_cursor, len(rows), _total_note(data)))
        refresh = 2 if data.get("total_computing") else None
        return View("Conversations", "".join(body), data, refresh=refresh)

    # -- /c/{id} -------------------------------------------------------------------------------
    def timeline(self, conversation_id: str, query: Query) -> View:
        """One conversation in seq order, with its attempts at their place in time."""
        limit = query.limit(LIMITS["timeline"])
        attempts_limit = query.limit(LIMITS["attempts"], "attempts_limit")
        after_text = query.get("after")
        if after_text is not None and not (
            after_text.isascii() and after_text.lstrip("-").isdigit() and len(after_text) <= 20
        ):
            raise InvalidFilterError("after must be a seq (a whole number)")
        after = None if after_text is None else int(after_text)
        attempts_after = uncursor(query.get("attempts_after"), 2)
        found = browse.timeline(
            self.engine,
            conversation_id,
            after=after,
            limit=limit,
            attempts_after=None
            if attempts_after is None
            else (attempts_after[0], attempts_after[1]),
            attempts_limit=attempts_limit,
        )
        title = f"Conversation {conversation_id}"
        if found is None:
            missing = (
                f'<p class="error">No conversation {text(conversation_id)} in this store.</p>'
                '<p><a href="/">All conversations</a></p>'
            )
            return View(
                title, missing, {"error": "not found", "conversation_id": conversation_id}, 404
            )
        data = found.as_dict()
        more_attempts = None if found.attempts_next is None else cursor(found.attempts_next)
        data["attempts_next_cursor"] = more_attempts
        base = path_of("c", conversation_id)
        body = [
            '<dl class="meta">'
            f"<dt>id</dt><dd>{text(conversation_id)}</dd>"
            f"<dt>created</dt><dd>{when(found.created_at)}</dd>"
            f"<dt>messages</dt><dd>{found.messages_total}</dd>"
            f"<dt>attempts here</dt><dd>{len(found.attempts)}</dd></dl>"
        ]
        if found.metadata is not None:
            body.append(
                f"<details><summary>metadata</summary>{json_block(found.metadata)}"
                f"{_cut_note(['metadata'] if found.metadata_cut else [])}</details>"
            )
        links = [
            f'<a href="{href("/calls", {"conversation": conversation_id})}">its calls</a>',
            f'<a href="{href("/failures", {"conversation": conversation_id})}">its failures</a>',
        ]
        body.append(f'<p class="links">{" ".join(links)}</p>')
        body.append('<ol class="timeline" id="attempts">')
        pending = list(found.attempts)
        for message in found.messages:
            while pending and pending[0].at_seq <= message.seq:
                body.append(self._attempt(pending.pop(0)))
            body.append(self._message(conversation_id, message))
        for attempt in pending:
            body.append(self._attempt(attempt))
        body.append("</ol>")
        pager = []
        if after is not None:
            pager.append(f'<a href="{base}">first page</a>')
        if found.next_after is not None:
            pager.append(
                f'<a rel="next" class="next" href="{href(base, {"after": found.next_after})}">'
                "next page</a>"
            )
        if more_attempts is not None:
            kept = [(k, v) for k, v in query.pairs if k not in ("attempts_after", "format")]
            pager.append(
                f'<a class="next-attempts" href="{href(base, [*kept, ("attempts_after", more_attempts)])}">'
                "more attempts of these messages</a>"
            )
        shown = len(found.messages)
        body.append(
            f'<nav class="pager"><span class="count">{shown} message{"s" if shown != 1 else ""}'
            f", {len(found.attempts)} attempt{'s' if len(found.attempts) != 1 else ''}"
            f"</span> {' '.join(pager)}</nav>"
        )
        return View(title, "".join(body), data)

    def _message(self, conversation_id: str, m: browse.TimelineMessage) -> str:
        role = m.role if m.role in ("user", "assistant", "system", "developer", "tool") else "other"
        head = [
            f'<span class="role">{text(m.role)}</span>',
            f'<a class="seq" href="#m-{m.seq}">seq {m.seq}</a>',
        ]
        if m.model:
            head.append(f'<span class="model">{text(m.model)}</span>')
        if m.format is not None:
            head.append(_api_badge(m.format))
        if m.finish_reason:
            head.append(f'<span class="finish">finish_reason {text(m.finish_reason)}</span>')
        head.append(when(m.created_at))
        parts = [f'<li class="msg msg-{role}" id="m-{m.seq}"><header>{" ".join(head)}</header>']
        if m.role == "tool":
            target = (
                f"#call-{m.assistant_seq}-{m.call_position}"
                if m.assistant_seq is not None and m.call_position is not None
                else ""
            )
            answered = (
                f'<a href="{target}">{text(m.tool_call_id)}</a>' if target else text(m.tool_call_id)
            )
            parts.append(f'<p class="answers">result for tool_call_id {answered}</p>')
        if m.reasoning:
            parts.append(
                f'<details class="reasoning"><summary>reasoning ({len(m.reasoning):,} characters)'
                f"</summary>{_content(m.reasoning)}</details>"
            )
        if m.refusal:
            parts.append(f'<p class="refusal">refusal:</p>{_content(m.refusal)}')
        parts.append(_content(m.content))
        if m.calls:
            parts.append('<div class="calls">')
            for call in m.calls:
                parts.append(self._call(f"call-{m.seq}-{call.position}", call, history=True))
            parts.append("</div>")
        if m.more_calls:
            parts.append(_more_calls_note())
        if m.usage is not None:
            parts.append(f"<details><summary>usage</summary>{json_block(m.usage)}</details>")
        parts.append(_cut_note(m.cut))
        parts.append("</li>")
        return "".join(parts)

    def _call(self, anchor: str, call: browse.TimelineCall, *, history: bool) -> str:
        state = call.state if call.state in _STATES else "unknown"
        parts = [
            f'<article class="call call-{state}" id="{anchor}">'
            f'<header><span class="name">{text(call.name) or "<em>(no name)</em>"}</span> '
            f'<span class="callid" title="tool_call_id">{text(call.call_id)}</span> '
            f'<a class="here" href="#{anchor}">#{call.position}</a></header>',
            _path_of_states(call),
        ]
        if call.reason:
            parts.append(f'<p class="reason">reason: <strong>{text(call.reason)}</strong></p>')
        parts.append('<div class="pair"><div class="args"><h3>arguments</h3>')
        parts.append(_arguments(call.arguments, call.state))
        if call.raw_arguments is not None and call.raw_arguments != call.arguments:
            parts.append(
                "<details><summary>raw arguments as streamed"
                f"{' (repaired)' if call.repaired else ''}</summary>"
                f'<pre class="raw">{text(call.raw_arguments, newlines=True)}</pre></details>'
            )
        parts.append('</div><div class="result"><h3>result</h3>')
        if history:
            if call.result_seq is None:
                parts.append('<p class="bad">no result found for this call</p>')
            else:
                same = call.result_tool_call_id == call.call_id
                mark = (
                    "tool_call_id matches"
                    if same
                    else f'<span class="bad">tool_call_id {text(call.result_tool_call_id)} differs</span>'
                )
                parts.append(
                    f'<p class="link"><a href="#m-{call.result_seq}">seq {call.result_seq}</a> '
                    f"({mark})</p>{_content(call.result)}"
                )
        elif call.result is not None:
            parts.append(_content(call.result))
        else:
            parts.append('<p class="none">never executed</p>')
        parts.append("</div></div>")
        parts.append(_cut_note(call.cut))
        parts.append("</article>")
        return "".join(parts)

    def _attempt(self, a: browse.TimelineAttempt) -> str:
        why = audit.attempt_reason(a.finish_reason, a.end_how, a.end_reason, a.error)
        head = [
            f'<span class="role bad">failed attempt #{a.id}</span>',
            f"<span>at seq {a.at_seq}</span>",
        ]
        if a.model:
            head.append(f'<span class="model">{text(a.model)}</span>')
        if a.format is not None:
            head.append(_api_badge(a.format))
        head.append(when(a.created_at))
        parts = [
            f'<li class="msg attempt" id="attempt-{a.id}"><header>{" ".join(head)}</header>',
            '<dl class="meta">',
            f"<dt>why</dt><dd><strong>{text(why) or 'unknown'}</strong></dd>",
            f"<dt>finish_reason</dt><dd>{text(a.finish_reason) or '-'}</dd>",
            f"<dt>stream ended</dt><dd>{text(a.end_how) or '-'}"
            f"{(': ' + text(a.end_reason)) if a.end_reason else ''}</dd>",
        ]
        if a.error:
            parts.append(f"<dt>error</dt><dd>{text(a.error)}</dd>")
        parts.append("</dl>")
        if a.reasoning:
            parts.append(
                f'<details class="reasoning"><summary>reasoning</summary>{_content(a.reasoning)}</details>'
            )
        parts.append(_content(a.content))
        anomalies = (
            a.anomalies
            if isinstance(a.anomalies, list)
            else ([] if a.anomalies is None else [a.anomalies])
        )
        if anomalies:
            parts.append('<div class="anomalies"><h3>anomalies the parser reported</h3><ul>')
            for anomaly in anomalies:
                if isinstance(anomaly, dict):
                    kind = anomaly.get("kind")
                    rest = {k: v for k, v in anomaly.items() if k != "kind"}
                    detail = json.dumps(rest, ensure_ascii=False, default=str) if rest else ""
                    parts.append(f"<li><strong>{text(kind)}</strong> {text(detail)}</li>")
                else:
                    parts.append(f"<li>{_short(anomaly, 400)}</li>")
            parts.append("</ul></div>")
        if a.calls:
            parts.append('<div class="calls">')
            for call in a.calls:
                parts.append(self._call(f"attempt-{a.id}-{call.position}", call, history=False))
            parts.append("</div>")
        if a.more_calls:
            parts.append(_more_calls_note())
        parts.append(_cut_note(a.cut))
        parts.append("</li>")
        return "".join(parts)

    # -- /calls --------------------------------------------------------------------------------
    def calls(self, query: Query) -> View:
        """``fsm audit calls`` as a page: the same filters, each row linked to its place in the
        timeline."""
        limit = query.limit(LIMITS["calls"])
        after = uncursor(query.get("after"), 5)
        args = [_arg_filter(a) for a in query.all("arg")]
        source = query.get("source") or "all"
        if source not in ("all", "history", "attempts"):
            raise InvalidFilterError(f"source must be all, history or attempts, not {source!r}")
        filters: dict[str, Any] = {
            "name": query.get("tool"),
            "state": query.get("state"),
            "conversation": query.get("conversation"),
            "model": query.get("model"),
            "since": query.get("since"),
            "until": query.get("until"),
            "args_contains": query.get("args_contains"),
            "format": _api(query),
            "search": query.get("q"),
        }
        with self._bind(filters["search"]) as bind:
            rows = list(
                audit.tool_calls(
                    bind,
                    **filters,
                    args=args,
                    source=cast(Source, source),
                    limit=limit,
                    after=after,
                )
            )
        next_cursor = cursor(rows[-1].key) if len(rows) == limit else None

        def count(conn: Connection) -> tuple[int, bool]:
            found = sum(
                1
                for _ in audit.tool_calls(
                    conn, **filters, args=args, source=cast(Source, source), limit=TOTAL_CAP + 1
                )
            )
            return min(found, TOTAL_CAP), found > TOTAL_CAP

        shown_filters = {**filters, "args": [list(a) for a in args], "source": source}
        total = self._total("/calls", shown_filters, count, query)
        data = {
            "filters": shown_filters,
            "rows": [_cut_row(row) for row in _dicts(rows)],
            "next": next_cursor,
            **total,
        }
        form = (
            '<form class="filters" method="get" action="/calls">'
            f'<label>search <input name="q" value="{attr(filters["search"])}" '
            'placeholder="tool, call id, conversation, arguments"></label>'
            f"{_api_select(filters['format'])}"
            f'<label>tool <input name="tool" value="{attr(filters["name"])}" placeholder="get_weather"></label>'
            f"{_select('state', 'state', filters['state'], _STATES)}"
            f"{_select('source', 'source', source if source != 'all' else None, ('history', 'attempts'))}"
            f'<label>model <input name="model" value="{attr(filters["model"])}"></label>'
            f'<label>conversation <input name="conversation" value="{attr(filters["conversation"])}"></label>'
            f'<label>since <input name="since" value="{attr(filters["since"])}" placeholder="2026-11-01"></label>'
            f'<label>until <input name="until" value="{attr(filters["until"])}"></label>'
            + "".join(
                f'<label>arg <input name="arg" value="{attr(a)}"></label>' for a in query.all("arg")
            )
            + '<label>arg <input name="arg" value="" placeholder="city=Paris"></label>'
            f'<label>arguments contain <input name="args_contains" value="{attr(filters["args_contains"])}"></label>'
            '<button type="submit">Filter</button> <a href="/calls">clear</a></form>'
        )
        body = [
            form,
            _export_links("/calls", query),
            '<table class="rows"><thead><tr><th>conversation</th><th>seq</th><th>#</th>'
            "<th>tool</th><th>call id</th><th>state</th><th>arguments</th><th>result / reason</th>"
            "<th>model</th><th>API</th><th>created</th></tr></thead><tbody>",
        ]
        for row in rows:
            if row.attempt_id is None:
                anchor = f"call-{row.seq}-{row.position}"
                outcome = _short(row.result)
            else:
                anchor = f"attempt-{row.attempt_id}-{row.position}"
                outcome = f'<span class="reason">{_short(row.reason)}</span>'
            state = row.state if row.state in _STATES else "unknown"
            link = _conversation_link(
                row.conversation_id, row.seq, anchor=anchor, attempt=row.attempt_id
            )
            body.append(
                f'<tr><td><a class="id" href="{_conversation_link(row.conversation_id)}">'
                f"{text(row.conversation_id)}</a></td>"
                f'<td class="n"><a class="place" href="{link}">{row.seq}</a></td>'
                f'<td class="n">{row.position}</td><td>{text(row.name)}</td>'
                f'<td class="mono">{text(row.call_id)}</td>'
                f'<td><span class="state state-{state}">{text(row.state)}</span></td>'
                f'<td class="mono">{_short(row.arguments)}</td><td>{outcome}</td>'
                f"<td>{text(row.model)}</td><td>{_api_badge(row.format)}</td>"
                f"<td>{when(row.created_at)}</td></tr>"
            )
        body.append("</tbody></table>")
        body.append(_next_link("/calls", query, next_cursor, len(rows), _total_note(data)))
        refresh = 2 if data.get("total_computing") else None
        return View("Calls", "".join(body), data, refresh=refresh)

    # -- /failures -----------------------------------------------------------------------------
    def failures(self, query: Query) -> View:
        """``fsm audit failures`` as a page, with the counts by model, state and reason."""
        limit = query.limit(LIMITS["failures"])
        after = uncursor(query.get("after"), 2)
        filters: dict[str, Any] = {
            "conversation": query.get("conversation"),
            "model": query.get("model"),
            "name": query.get("tool"),
            "state": query.get("state"),
            "reason": query.get("reason"),
            "since": query.get("since"),
            "until": query.get("until"),
        }
        rows = list(audit.failures(self.engine, **filters, limit=limit, after=after))
        # the counts group every failed call (a scan): kept for reloads, as /stats is
        pending: Pending | None = None
        refused: Busy | None = None
        counts: list[audit.FailureCount] = []
        computed, seconds = datetime.now(UTC), 0.0

        def count(conn: Connection) -> tuple[int, bool]:
            found = sum(1 for _ in audit.failures(conn, **filters, limit=TOTAL_CAP + 1))
            return min(found, TOTAL_CAP), found > TOTAL_CAP

        total = self._total("/failures", filters, count, query)
        try:
            if query.get("format") != "csv":  # an export holds the rows only
                counts, computed, seconds = self._stats.get(
                    ("failure_counts", *sorted(filters.items())),
                    lambda: audit.failure_counts(self.engine, **filters),
                    query.get("refresh") == "1",
                )
        except Pending as still:
            pending = still
        except Busy as busy:  # the rows still show; the counts on a later visit
            refused = busy
        next_cursor = cursor(rows[-1].key) if len(rows) == limit else None
        shown_counts = sorted(counts, key=lambda c: -(c.calls or c.attempts))[:MAX_GROUPS]
        data = {
            "filters": filters,
            "counts": _dicts(shown_counts),
            "counts_groups": len(counts),
            "counts_computed_at": None if pending or refused else computed,
            "counts_computing": pending is not None,
            "counts_refused": None if refused is None else str(refused),
            "rows": [_cut_row(row) for row in _dicts(rows)],
            "next": next_cursor,
            **total,
        }
        by_reason: dict[str, int] = {}
        for c in counts:
            label = f"{c.state or 'attempt'}: {c.reason or '-'}"
            by_reason[label] = by_reason.get(label, 0) + (c.calls or c.attempts)
        top = sorted(by_reason.items(), key=lambda kv: -kv[1])[:12]
        body = [
            '<form class="filters" method="get" action="/failures">'
            f'<label>model <input name="model" value="{attr(filters["model"])}"></label>'
            f'<label>tool <input name="tool" value="{attr(filters["name"])}"></label>'
            f"{_select('state', 'state', filters['state'], ('truncated', 'aborted'))}"
            f'<label>reason <input name="reason" value="{attr(filters["reason"])}" placeholder="length"></label>'
            f'<label>conversation <input name="conversation" value="{attr(filters["conversation"])}"></label>'
            f'<label>since <input name="since" value="{attr(filters["since"])}"></label>'
            f'<label>until <input name="until" value="{attr(filters["until"])}"></label>'
            '<button type="submit">Filter</button> <a href="/failures">clear</a></form>',
            _export_links("/failures", query),
            (
                f'<p class="computing">The counts are being computed (started '
                f"{when(pending.started)}); this page reloads itself.</p>"
                if pending
                else f'<p class="computing">Counts not computed: {text(str(refused))}.</p>'
                if refused
                else f'<p class="computed">counts computed {when(computed)} in {seconds:.2f} s '
                f'<a href="{href("/failures", [*((k, v) for k, v in filters.items() if v), ("refresh", "1")])}">'
                "recompute</a></p>"
            ),
            charts.hbars(
                "Failed calls (and attempts without one) by state and reason",
                [(label, float(n), f"{n:,}") for label, n in top],
                css="bar-bad",
            ),
            "<details><summary>counts by model, state and reason</summary>"
            '<table class="rows"><thead><tr><th>model</th><th>state</th><th>reason</th>'
            "<th>calls</th><th>attempts</th></tr></thead><tbody>",
        ]
        for c in shown_counts:
            body.append(
                f"<tr><td>{text(c.model)}</td><td>{text(c.state) or '-'}</td>"
                f'<td>{_short(c.reason)}</td><td class="n">{c.calls:,}</td>'
                f'<td class="n">{c.attempts:,}</td></tr>'
            )
        body.append("</tbody></table>")
        body.append(_more_groups(len(counts)))
        body.append("</details>")
        body.append(
            '<table class="rows"><thead><tr><th>attempt</th><th>conversation</th><th>seq</th>'
            "<th>tool</th><th>state</th><th>reason</th><th>anomalies</th><th>arguments (cut)</th>"
            "<th>model</th><th>created</th></tr></thead><tbody>"
        )
        for row in rows:
            anchor = (
                f"attempt-{row.attempt_id}-{row.position}"
                if row.position is not None
                else f"attempt-{row.attempt_id}"
            )
            link = _conversation_link(
                row.conversation_id, row.seq, anchor=anchor, attempt=row.attempt_id
            )
            body.append(
                f'<tr><td class="n"><a class="place" href="{link}">#{row.attempt_id}</a></td>'
                f'<td><a class="id" href="{_conversation_link(row.conversation_id)}">'
                f"{text(row.conversation_id)}</a></td>"
                f'<td class="n">{row.seq}</td><td>{text(row.name)}</td>'
                f"<td>{_state_badge(row.state) if row.state else '-'}</td>"
                f'<td class="reason">{_short(row.reason)}</td>'
                f"<td>{text(', '.join(row.anomalies))}</td>"
                f'<td class="mono">{_short(row.arguments)}</td>'
                f"<td>{text(row.model)}</td><td>{when(row.created_at)}</td></tr>"
            )
        body.append("</tbody></table>")
        body.append(_next_link("/failures", query, next_cursor, len(rows), _total_note(data)))
        reload = pending is not None or bool(data.get("total_computing"))
        return View("Failures", "".join(body), data, refresh=2 if reload else None)

    # -- /stats --------------------------------------------------------------------------------
    def stats(self, query: Query) -> View:
        """``fsm audit stats`` with charts: calls per day by final state, top tools, truncation
        and abort rates by model. Whole-store scans: the result is kept for reloads (``refresh=1``
        recomputes)."""
        filters: dict[str, Any] = {
            "conversation": query.get("conversation"),
            "model": query.get("model"),
            "since": query.get("since"),
            "until": query.get("until"),
        }

        def compute() -> dict[str, Any]:
            result = audit.stats(self.engine, **filters)
            failed_days = browse.failed_calls_per_day(self.engine, **filters)
            counts = audit.failure_counts(self.engine, **filters)
            return {"stats": result, "failed_days": failed_days, "counts": counts}

        key = tuple(sorted(filters.items()))
        try:
            value, computed, seconds = self._stats.get(key, compute, query.get("refresh") == "1")
        except Pending as pending:
            return _pending("Stats", pending, "the statistics")
        result: audit.Stats = value["stats"]
        failed_days: dict[str, dict[str, int]] = value["failed_days"]
        counts: list[audit.FailureCount] = value["counts"]
        rates = _rates(result, counts)
        data = {
            "filters": filters,
            "computed_at": computed,
            "seconds": round(seconds, 3),
            "tools": _dicts(result.tools[:MAX_GROUPS]),
            "tools_total": len(result.tools),
            "models": _dicts(result.models[:MAX_GROUPS]),
            "models_total": len(result.models),
            "days": _dicts(result.days),
            "failed_calls_per_day": failed_days,
            "rates": rates[:MAX_GROUPS],
            "totals": None if result.totals is None else result.totals.as_dict(),
            "unreadable_usage": result.unreadable_usage,
        }
        days = sorted({d.day for d in result.days} | set(failed_days))
        finished = {d.day: d.calls for d in result.days}
        series = [
            ("finished", "s-finished", [float(finished.get(d, 0)) for d in days]),
            (
                "truncated",
                "s-truncated",
                [float(failed_days.get(d, {}).get("truncated", 0)) for d in days],
            ),
            (
                "aborted",
                "s-aborted",
                [float(failed_days.get(d, {}).get("aborted", 0)) for d in days],
            ),
        ]
        refresh = href("/stats", [*((k, v) for k, v in filters.items() if v), ("refresh", "1")])
        body = [
            _form(
                "/stats",
                [
                    ("model", "model", filters["model"], ""),
                    ("conversation", "conversation", filters["conversation"], ""),
                    ("since", "since", filters["since"], "2026-11-01"),
                    ("until", "until", filters["until"], ""),
                ],
            ),
            f'<p class="computed">computed {when(computed)} in {seconds:.2f} s '
            f'<a href="{refresh}">recompute</a></p>',
            charts.stacked_columns("Calls per day (UTC) by final state", days, series),
            charts.hbars(
                "Top tools (calls in history)",
                [
                    (t.name, float(t.calls), f"{t.calls:,} ({t.failed:,} failed)")
                    for t in result.tools[:15]
                ],
            ),
            charts.hbars(
                "Truncation rate by model (truncated calls / all calls)",
                [
                    (r["model"] or "(none)", r["truncated_rate"], f"{r['truncated_rate']:.2%}")
                    for r in rates
                ],
                css="s-truncated",
                percent=True,
            ),
            charts.hbars(
                "Abort rate by model (aborted calls / all calls)",
                [
                    (r["model"] or "(none)", r["aborted_rate"], f"{r['aborted_rate']:.2%}")
                    for r in rates
                ],
                css="s-aborted",
                percent=True,
            ),
            '<h2>Models</h2><table class="rows"><thead><tr><th>model</th><th>turns</th>'
            "<th>calls</th><th>attempts</th><th>incomplete share</th><th>prompt tokens</th>"
            "<th>completion tokens</th></tr></thead><tbody>",
        ]
        for s in result.models[:MAX_GROUPS]:
            body.append(
                f'<tr><td>{text(s.model)}</td><td class="n">{s.turns:,}</td>'
                f'<td class="n">{s.calls:,}</td><td class="n">{s.attempts:,}</td>'
                f'<td class="n">{s.incomplete_share:.2%}</td><td class="n">{s.prompt_tokens:,}</td>'
                f'<td class="n">{s.completion_tokens:,}</td></tr>'
            )
        body.append("</tbody></table>")
        body.append(_more_groups(len(result.models)))
        body.append(
            '<h2>Tools</h2><table class="rows"><thead><tr><th>tool</th><th>calls</th>'
            "<th>failed in attempts</th></tr></thead><tbody>"
        )
        for t in result.tools[:MAX_GROUPS]:
            link = href("/calls", {"tool": t.name})
            body.append(
                f'<tr><td><a href="{link}">{text(t.name)}</a></td><td class="n">{t.calls:,}</td>'
                f'<td class="n">{t.failed:,}</td></tr>'
            )
        body.append("</tbody></table>")
        body.append(_more_groups(len(result.tools)))
        return View("Stats", "".join(body), data)

    # -- /check --------------------------------------------------------------------------------
    def check(self, query: Query) -> View:
        """``fsm audit check`` as a page: each rule, pass or fail, the offending rows linked.
        The whole store is checked (seconds on a large one): the result is kept for reloads
        (``refresh=1`` checks again)."""

        def compute() -> tuple[dict[str, int], list[audit.Violation]]:
            counts: dict[str, int] = {}
            kept: list[audit.Violation] = []
            for violation in audit.check(self.engine):
                counts[violation.kind] = counts.get(violation.kind, 0) + 1
                if len(kept) < MAX_VIOLATIONS:
                    kept.append(violation)
            return counts, kept

        try:
            (counts, kept), computed, seconds = self._check.get(
                "all", compute, query.get("refresh") == "1"
            )
        except Pending as pending:
            return _pending("Integrity check", pending, "the integrity check")
        kinds = list(audit.VIOLATION_KINDS)
        kinds += [k for k in counts if k not in audit.VIOLATION_KINDS]
        rules = [
            {
                "kind": kind,
                "rule": audit.VIOLATION_KINDS.get(kind, ""),
                "passed": counts.get(kind, 0) == 0,
                "violations": counts.get(kind, 0),
            }
            for kind in kinds
        ]
        found = sum(counts.values())
        data = {
            "computed_at": computed,
            "seconds": round(seconds, 3),
            "clean": found == 0,
            "violations_total": found,
            "rules": rules,
            "violations": _dicts(kept),
            "violations_shown": len(kept),
        }
        verdict = (
            '<p class="verdict ok">No violations: the history contract holds over the whole store.</p>'
            if not found
            else f'<p class="verdict bad">{found:,} violation{"s" if found != 1 else ""} found.</p>'
        )
        body = [
            verdict,
            f'<p class="computed">checked {when(computed)} in {seconds:.2f} s '
            f'<a href="/check?refresh=1">check again</a></p>',
            '<table class="rows rules"><thead><tr><th>rule</th><th>result</th><th>violations</th>'
            "<th>what it checks</th></tr></thead><tbody>",
        ]
        for rule in rules:
            ok = rule["passed"]
            result = (
                '<span class="pass">pass</span>'
                if ok
                else f'<a class="fail" href="#kind-{attr(rule["kind"])}">fail</a>'
            )
            body.append(
                f'<tr class="{"pass" if ok else "fail"}"><td class="mono">{text(rule["kind"])}</td>'
                f'<td>{result}</td><td class="n">{rule["violations"]:,}</td>'
                f"<td>{text(rule['rule'])}</td></tr>"
            )
        body.append("</tbody></table>")
        if kept:
            body.append(
                f"<h2>Violations{f' (the first {len(kept):,})' if len(kept) < found else ''}</h2>"
                '<table class="rows"><thead><tr><th>kind</th><th>conversation</th><th>seq</th>'
                "<th>detail</th></tr></thead><tbody>"
            )
            first_of_kind: set[str] = set()
            for v in kept:
                row_id = ""
                if v.kind not in first_of_kind:
                    first_of_kind.add(v.kind)
                    row_id = f' id="kind-{attr(v.kind)}"'
                if v.conversation_id is not None:
                    anchor = f"m-{v.seq}" if v.seq is not None else ""
                    where = (
                        f'<a class="id" href="{_conversation_link(v.conversation_id, v.seq, anchor=anchor)}">'
                        f"{text(v.conversation_id)}</a>"
                    )
                else:
                    where = '<span class="none">-</span>'
                body.append(
                    f'<tr{row_id}><td class="mono">{text(v.kind)}</td><td>{where}</td>'
                    f'<td class="n">{"" if v.seq is None else v.seq}</td><td>{text(v.detail)}</td></tr>'
                )
            body.append("</tbody></table>")
        return View("Integrity check", "".join(body), data)


def _rates(result: audit.Stats, counts: Sequence[audit.FailureCount]) -> list[dict[str, Any]]:
    # (each row: model, calls, truncated, aborted, truncated_rate, aborted_rate)
    """Per model: truncated and aborted calls of attempts over all its calls (history's and the
    attempts' failed ones)."""
    failed: dict[str | None, dict[str, int]] = {}
    for c in counts:
        if c.state in ("truncated", "aborted"):
            bucket = failed.setdefault(c.model, {"truncated": 0, "aborted": 0})
            bucket[c.state] += c.calls
    out: list[dict[str, Any]] = []
    models = {s.model: s.calls for s in result.models}
    for model in dict.fromkeys([*models, *failed]):
        bad = failed.get(model, {"truncated": 0, "aborted": 0})
        total = models.get(model, 0) + bad["truncated"] + bad["aborted"]
        out.append(
            {
                "model": model,
                "calls": total,
                "truncated": bad["truncated"],
                "aborted": bad["aborted"],
                "truncated_rate": bad["truncated"] / total if total else 0.0,
                "aborted_rate": bad["aborted"] / total if total else 0.0,
            }
        )
    out.sort(
        key=lambda r: (
            -(float(r["truncated_rate"]) + float(r["aborted_rate"])),
            str(r["model"] or ""),
        )
    )
    return out


def _arg_filter(given: str) -> tuple[str, Any]:
    """``PATH=VALUE`` as ``fsm audit calls --arg`` reads it: VALUE is JSON when it is a JSON
    scalar, else text."""
    path, sep, raw = given.partition("=")
    if not sep or not path.strip():
        raise InvalidFilterError(f"arg {given!r} is not PATH=VALUE (city=Paris)")
    try:
        value = json.loads(raw, parse_constant=_not_json)
    except ValueError:
        value = raw
    if isinstance(value, dict | list):
        value = raw
    return path.strip(), value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def as_json(data: Mapping[str, Any]) -> bytes:
    """A page's data as JSON (times ISO 8601 in UTC, lone surrogates as ``\\uXXXX``)."""
    from fsm.cli.output import escape_surrogates, json_default

    text_ = json.dumps(data, ensure_ascii=False, indent=1, default=json_default)
    return escape_surrogates(text_).encode("utf-8")


def store_label(engine: Engine) -> str:
    """The store as the header shows it (no password)."""
    from fsm.store.engine import display_url

    return display_url(sa.make_url(str(engine.url)))
