"""The viewer's pages: each is a function of the read-only engine and the request's query that
returns a :class:`View`: the data (the page's JSON twin, ``?format=json``) and the HTML body
built from it. Every listing pages by keyset, as the CLI does (``after=`` the last row's key,
as an opaque cursor).

Routes: ``/`` conversations, ``/c/{id}`` one conversation's timeline, ``/calls``,
``/failures``, ``/stats``, ``/check``.

This module holds the :class:`Viewer` and its listing pages (``/``, ``/calls``, ``/failures``,
``/stats``) with the limits they read from here (tests tune them on this module); the other
pages are mixins of their own (:mod:`fsm.web.timeline`, :mod:`fsm.web.check`), the plumbing is
:mod:`fsm.web.views` (limits, :class:`Query`, cursors, :class:`View`, scan workers, caches) and
the bits the pages share :mod:`fsm.web.bits` (``as_csv``, ``as_json``, ``csv_cell``,
``bounded``, ``SearchTooSlow`` are importable from here as before).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy.engine import Connection, Engine

from fsm.store import audit
from fsm.store.audit import browse
from fsm.store.audit.calls import Source
from fsm.store.errors import InvalidFilterError
from fsm.web import charts
from fsm.web.bits import (
    SearchTooSlow,
    api_badge,
    api_of,
    api_select,
    arg_filter,
    as_dicts,
    bounded,
    conversation_link,
    cut_row,
    failure_rates,
    filter_form,
    json_twin,
    next_link,
    select_html,
    shorten,
    state_badge,
    total_note,
)

# importable from here as before (the server and tests use them; tests tune the limits here)
from fsm.web.bits import as_csv as as_csv
from fsm.web.bits import as_json as as_json
from fsm.web.bits import csv_cell as csv_cell
from fsm.web.check import CheckPage
from fsm.web.html import attr, href, text, when
from fsm.web.timeline import TimelinePage
from fsm.web.views import EXPORT_ROWS as EXPORT_ROWS
from fsm.web.views import EXPORTS as EXPORTS
from fsm.web.views import (
    LIMITS,
    MAX_GROUPS,
    SEARCH_SECONDS,
    STATES,
    TOTAL_CAP,
    TOTAL_SECONDS,
    Cache,
    Pending,
    Query,
    Scans,
    View,
    cursor,
    pending_view,
    uncursor,
)
from fsm.web.views import MAX_LIMIT as MAX_LIMIT
from fsm.web.views import Busy as Busy

__all__ = ["Query", "View", "Viewer", "json_twin"]


def _more_groups(total: int) -> str:
    """The note under a table of groups cut at :data:`MAX_GROUPS` (nothing when it is not)."""
    if total <= MAX_GROUPS:
        return ""
    return (
        f'<p class="cut">{MAX_GROUPS:,} of {total:,} shown (all of them: '
        "<code>fsm audit stats</code>, <code>fsm audit failures --counts</code>)</p>"
    )


def _export_links(path: str, query: Query) -> str:
    kept = [(k, v) for k, v in query.pairs if k not in ("after", "format", "limit", "refresh")]
    csv_link = href(path, [*kept, ("format", "csv")])
    json_link = href(path, [*kept, ("limit", str(MAX_LIMIT)), ("format", "json")])
    return (
        f'<p class="export">Export <a href="{csv_link}">CSV</a> (up to {EXPORT_ROWS:,} rows) / '
        f'<a href="{json_link}">JSON</a> (a page of up to {MAX_LIMIT} rows)</p>'
    )


#: characters that make a spreadsheet read a cell as a formula (OWASP: CSV injection)
# -- the viewer --------------------------------------------------------------------------------
class Viewer(TimelinePage, CheckPage):
    """The pages over one read-only engine (see :func:`fsm.store.audit.open_readonly`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scans = Scans()
        self._stats = Cache(self.scans)
        self._check = Cache(self.scans, size=2)
        # the listings' totals: a short wait (the page shows "counting" and reloads)
        self._totals = Cache(self.scans, size=64, budget=1.0)

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
            "api": api_of(query),
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
        data = {"filters": filters, "rows": as_dicts(rows), "next": next_cursor, **total}
        form = filter_form(
            "/",
            [
                ("q", "id contains", filters["search"], "search"),
                ("prefix", "id starts with", filters["prefix"], "demo-"),
                ("model", "model", filters["model"], "gpt-4o"),
                ("since", "since", filters["since"], "2026-11-01"),
                ("until", "until", filters["until"], "2026-12-01"),
            ],
        ).replace('<button type="submit">', f'{api_select(filters["api"])}<button type="submit">')
        body = [
            form,
            _export_links("/", query),
            '<table class="rows"><thead><tr><th>conversation</th><th>API</th><th>created</th>'
            "<th>last activity</th><th>messages</th><th>calls</th><th>failed attempts</th>"
            "</tr></thead><tbody>",
        ]
        for row in rows:
            failed = (
                f'<a class="bad" href="{conversation_link(row.id, anchor="attempts")}">'
                f"{row.attempts:,}{'+' if row.attempts_capped else ''}</a>"
                if row.attempts
                else "0"
            )
            body.append(
                f'<tr><td><a class="id" href="{conversation_link(row.id)}">{text(row.id)}</a></td>'
                f"<td>{api_badge(row.format)}</td><td>{when(row.created_at)}</td><td>{when(row.last_activity)}</td>"
                f'<td class="n">{row.messages}</td>'
                f'<td class="n">{row.calls:,}{"+" if row.calls_capped else ""}</td>'
                f'<td class="n">{failed}</td></tr>'
            )
        body.append("</tbody></table>")
        body.append(next_link("/", query, next_cursor, len(rows), total_note(data)))
        refresh = 2 if data.get("total_computing") else None
        return View("Conversations", "".join(body), data, refresh=refresh)

    # -- /calls --------------------------------------------------------------------------------
    def calls(self, query: Query) -> View:
        """``fsm audit calls`` as a page: the same filters, each row linked to its place in the
        timeline."""
        limit = query.limit(LIMITS["calls"])
        after = uncursor(query.get("after"), 5)
        args = [arg_filter(a) for a in query.all("arg")]
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
            "format": api_of(query),
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
            "rows": [cut_row(row) for row in as_dicts(rows)],
            "next": next_cursor,
            **total,
        }
        form = (
            '<form class="filters" method="get" action="/calls">'
            f'<label>search <input name="q" value="{attr(filters["search"])}" '
            'placeholder="tool, call id, conversation, arguments"></label>'
            f"{api_select(filters['format'])}"
            f'<label>tool <input name="tool" value="{attr(filters["name"])}" placeholder="get_weather"></label>'
            f"{select_html('state', 'state', filters['state'], STATES)}"
            f"{select_html('source', 'source', source if source != 'all' else None, ('history', 'attempts'))}"
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
                outcome = shorten(row.result)
            else:
                anchor = f"attempt-{row.attempt_id}-{row.position}"
                outcome = f'<span class="reason">{shorten(row.reason)}</span>'
            state = row.state if row.state in STATES else "unknown"
            link = conversation_link(
                row.conversation_id, row.seq, anchor=anchor, attempt=row.attempt_id
            )
            body.append(
                f'<tr><td><a class="id" href="{conversation_link(row.conversation_id)}">'
                f"{text(row.conversation_id)}</a></td>"
                f'<td class="n"><a class="place" href="{link}">{row.seq}</a></td>'
                f'<td class="n">{row.position}</td><td>{text(row.name)}</td>'
                f'<td class="mono">{text(row.call_id)}</td>'
                f'<td><span class="state state-{state}">{text(row.state)}</span></td>'
                f'<td class="mono">{shorten(row.arguments)}</td><td>{outcome}</td>'
                f"<td>{text(row.model)}</td><td>{api_badge(row.format)}</td>"
                f"<td>{when(row.created_at)}</td></tr>"
            )
        body.append("</tbody></table>")
        body.append(next_link("/calls", query, next_cursor, len(rows), total_note(data)))
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
            "counts": as_dicts(shown_counts),
            "counts_groups": len(counts),
            "counts_computed_at": None if pending or refused else computed,
            "counts_computing": pending is not None,
            "counts_refused": None if refused is None else str(refused),
            "rows": [cut_row(row) for row in as_dicts(rows)],
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
            f"{select_html('state', 'state', filters['state'], ('truncated', 'aborted'))}"
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
                f'<td>{shorten(c.reason)}</td><td class="n">{c.calls:,}</td>'
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
            link = conversation_link(
                row.conversation_id, row.seq, anchor=anchor, attempt=row.attempt_id
            )
            body.append(
                f'<tr><td class="n"><a class="place" href="{link}">#{row.attempt_id}</a></td>'
                f'<td><a class="id" href="{conversation_link(row.conversation_id)}">'
                f"{text(row.conversation_id)}</a></td>"
                f'<td class="n">{row.seq}</td><td>{text(row.name)}</td>'
                f"<td>{state_badge(row.state) if row.state else '-'}</td>"
                f'<td class="reason">{shorten(row.reason)}</td>'
                f"<td>{text(', '.join(row.anomalies))}</td>"
                f'<td class="mono">{shorten(row.arguments)}</td>'
                f"<td>{text(row.model)}</td><td>{when(row.created_at)}</td></tr>"
            )
        body.append("</tbody></table>")
        body.append(next_link("/failures", query, next_cursor, len(rows), total_note(data)))
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
            return pending_view("Stats", pending, "the statistics")
        result: audit.Stats = value["stats"]
        failed_days: dict[str, dict[str, int]] = value["failed_days"]
        counts: list[audit.FailureCount] = value["counts"]
        rates = failure_rates(result, counts)
        data = {
            "filters": filters,
            "computed_at": computed,
            "seconds": round(seconds, 3),
            "tools": as_dicts(result.tools[:MAX_GROUPS]),
            "tools_total": len(result.tools),
            "models": as_dicts(result.models[:MAX_GROUPS]),
            "models_total": len(result.models),
            "days": as_dicts(result.days),
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
            filter_form(
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
