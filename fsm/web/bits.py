"""The HTML and data bits the viewer's pages share (:mod:`fsm.web.pages`): links, forms, badges, cut notes, bounded statements, CSV and JSON output."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fsm.states import ToolCallState
from fsm.store import audit
from fsm.store.audit import browse
from fsm.store.errors import InvalidFilterError, StoreError
from fsm.web.html import attr, href, json_block, path_of, text
from fsm.web.views import APIS, LIMITS, STATES, Query, cursor


# -- shared bits -------------------------------------------------------------------------------
def conversation_link(
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


def filter_form(path: str, fields: Sequence[tuple[str, str, str | None, str]]) -> str:
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


def select_html(name: str, label: str, value: str | None, options: Sequence[str]) -> str:
    choices = "".join(
        f'<option value="{attr(o)}"{" selected" if o == value else ""}>{text(o) or "any"}</option>'
        for o in ("", *options)
    )
    return f'<label>{label} <select name="{name}">{choices}</select></label>'


def next_link(path: str, query: Query, next_cursor: str | None, shown: int, total: str = "") -> str:
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


def arguments_html(arguments: str, state: str) -> str:
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


def content_html(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return f'<pre class="content">{text(value, newlines=True)}</pre>'
    return json_block(value)


def path_of_states(call: browse.TimelineCall) -> str:
    """The call's states as the machine's path: opened -> accumulating (when arguments came)
    -> its final state, named as :class:`fsm.states.ToolCallState` names them."""
    steps = [ToolCallState.OPENED.value]
    if call.arguments or call.raw_arguments:
        steps.append(ToolCallState.ACCUMULATING.value)
    if call.state not in steps:
        steps.append(call.state)
    shown = ' <span class="arrow">\u2192</span> '.join(
        f'<span class="state state-{attr(s) if s in STATES else "unknown"}">{text(s)}</span>'
        for s in steps
    )
    return f'<p class="path" title="the call\'s path through the state machine">{shown}</p>'


def cut_note(fields: Sequence[str]) -> str:
    """The note of a row whose values were cut at :data:`browse.VALUE_CHARS` characters."""
    if not fields:
        return ""
    return (
        f'<p class="cut">{text(", ".join(fields))}: cut at {browse.VALUE_CHARS:,} characters '
        "here (the whole value: <code>fsm history</code>, or the store's Python API)</p>"
    )


def more_calls_note() -> str:
    return (
        f'<p class="cut">more than {browse.CALLS_PER_TURN} calls: the first '
        f"{browse.CALLS_PER_TURN} are shown (all of them: <code>fsm audit calls "
        "--conversation</code>)</p>"
    )


def state_badge(state: str) -> str:
    css = state if state in STATES else "unknown"
    return f'<span class="state state-{css}">{text(state)}</span>'


def shorten(value: Any, limit: int = 160) -> str:
    if value is None:
        return ""
    shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(shown) > limit:
        shown = shown[: limit - 1] + "\u2026"
    return text(shown)


def as_dicts(rows: Sequence[Any]) -> list[dict[str, Any]]:
    return [row.as_dict() for row in rows]


def cut_row(row: dict[str, Any]) -> dict[str, Any]:
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


def api_of(query: Query) -> str | None:
    """``api=``: ``chat``, ``responses`` or ``anthropic`` (``format=`` is the JSON twin's)."""
    given = query.get("api")
    if given is not None and given not in APIS:
        raise InvalidFilterError(f"api must be chat, responses or anthropic, not {given!r}")
    return given


def api_badge(fmt: str | None) -> str:
    """An API as a page shows it (``-`` for unknown)."""
    if fmt is None:
        return '<span class="none">-</span>'
    name = APIS.get(fmt, fmt)
    return f'<span class="api api-{attr(fmt) if fmt in APIS else "other"}">{text(name)}</span>'


def api_select(value: str | None) -> str:
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


def total_note(data: Mapping[str, Any]) -> str:
    """The total of a listing's rows as its pager shows it."""
    if data.get("total_computing"):
        return '<span class="total computing">of \u2026 (counting\u2026; this page reloads)</span>'
    total = data.get("total")
    if total is None:
        why = data.get("total_refused") or "not counted"
        return f'<span class="total none" title="{attr(why)}">(total not counted)</span>'
    return f'<span class="total">of {total:,}{"+" if data.get("total_capped") else ""}</span>'


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


def failure_rates(
    result: audit.Stats, counts: Sequence[audit.FailureCount]
) -> list[dict[str, Any]]:
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


def arg_filter(given: str) -> tuple[str, Any]:
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
