"""How every listing command prints rows (in the style of sqlite-utils), and how any human
output shows text it did not write.

One writer for every command that prints rows, in the format the shared output flags choose
(:func:`fsm.cli.options.output_options`):

* the default (or ``--table``): an aligned table for people, numbers right-aligned, long cells
  cut to ``--max-width`` characters with an ellipsis, times to the second in UTC, and the whole
  table fitted to the width of the terminal (``$COLUMNS``, else the terminal's; not when stdout
  is no terminal and ``COLUMNS`` is unset): columns empty in every row are left out, long text
  columns (arguments, results, reasons) are cut first, then left out from the right (numbers
  first; a line on stderr names them), while ids, names, states, models and times stay whole as
  long as they fit; ``--columns`` keeps what it names, ``--max-width 0`` cuts nothing.
  Control characters are shown escaped (:func:`safe_text`) so that a value can neither break
  the layout nor drive the terminal. An empty result still prints the header;
* ``--json``: one JSON array (one object per line inside it), ``--nl``: one JSON object per line
  (JSON lines), ``--csv``: a header row then one row per line (``--no-headers`` leaves the header
  out), CSV quoting; ``--tsv``: the same rows tab-separated, never quoted: a tab, a line break, a
  carriage return and a backslash inside a value are written ``\\t``, ``\\n``, ``\\r``,
  ``\\\\`` (the convention of PostgreSQL's ``COPY`` and of ``cut``-friendly tools), so every row is
  one line. Values are exact: nothing is cut or escaped beyond the format's own rules; times are
  ISO 8601 in UTC with microseconds, the same on every engine
  (``2026-11-30T14:05:09.000000+00:00``); lists and objects are JSON inside CSV cells; ``null``
  is an empty CSV cell. A lone surrogate (an id or a text stored as a provider sent it,
  ``"\\ud83d"``), which no UTF-8 output can carry, is written as the JSON escape ``\\ud83d`` in
  JSON (the same string, exactly) and as that text in CSV and TSV cells.

``--columns a,b,c`` picks and orders the columns of any format (names from the row type's
fields; an unknown name is a usage error that lists the valid ones).

The table is the default whether or not stdout is a terminal, and a script asks for a machine
format explicitly (``--json``, ``--nl``, ``--csv``, ``--tsv``). Machine formats stream row by
row (bounded memory); the table reads all rows first to size its columns.

:func:`safe_text` is the one function every human output (tables, ``fsm history``, ``fsm
parse``, ``fsm ingest``, ``fsm demo``) passes provider-controlled text through: C0 and C1
controls, ESC, DEL, bidirectional overrides and other invisible format characters are shown as
escapes; machine formats (JSON, CSV, TSV) are never escaped this way.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import IO, Any

import click

__all__ = [
    "FORMATS",
    "OutputFormat",
    "columns_of",
    "emit",
    "escape_surrogates",
    "json_default",
    "mermaid_sequence",
    "mermaid_text",
    "safe_text",
    "terminal_width",
    "to_json",
]

#: the formats, as their flags spell them.
FORMATS = ("table", "json", "nl", "csv", "tsv")


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """How rows are printed: ``kind`` is one of :data:`FORMATS`."""

    kind: str = "table"
    headers: bool = True
    max_width: int = 60
    #: the columns asked for (``--columns``), in order; ``None``: every column.
    columns: tuple[str, ...] | None = None
    #: the width a table must fit in (``None``: :func:`terminal_width`; 0: no limit).
    width: int | None = None

    @property
    def is_table(self) -> bool:
        """Whether the rows are for people (a table) rather than for scripts."""
        return self.kind == "table"

    def pick(self, available: Sequence[str]) -> list[str]:
        """The columns to print out of ``available``: those asked for, in their order, or all
        of them; an unknown name is a :class:`click.UsageError` that lists the valid ones."""
        if self.columns is None:
            return list(available)
        unknown = [c for c in self.columns if c not in available]
        if unknown:
            raise click.UsageError(
                f"unknown column{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                f"--columns: choose from {', '.join(available)}"
            )
        return list(dict.fromkeys(self.columns))


def terminal_width() -> int:
    """The width a table must fit: ``$COLUMNS`` when set (a positive integer), else the
    terminal's when stdout is one, else 0 (no limit: a table written to a file or a pipe is cut
    only by ``--max-width``)."""
    text = os.environ.get("COLUMNS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):
        pass
    return 0


def columns_of(row_type: type) -> tuple[str, ...]:
    """The columns of a row dataclass (its fields, in order): what a listing of such rows shows,
    and its CSV header even when there are no rows."""
    return tuple(field.name for field in fields(row_type))


# -- values ------------------------------------------------------------------------------------
def _time(value: datetime | date) -> str:
    """A time as ISO 8601 in UTC with microseconds (naive means UTC): the same text for the
    same instant on every engine (SQLite stores whole seconds, PostgreSQL microseconds)."""
    if isinstance(value, datetime):
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return utc.isoformat(timespec="microseconds")
    return value.isoformat()


def json_default(value: Any) -> Any:
    """``json.dumps`` ``default=``: times as ISO 8601 in UTC with microseconds, decimals as
    numbers."""
    if isinstance(value, datetime | date):
        return _time(value)
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def to_json(value: Any) -> str:
    """``value`` as compact JSON text (times in ISO 8601 in UTC)."""
    text = json.dumps(value, ensure_ascii=False, default=json_default, separators=(",", ":"))
    return escape_surrogates(text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written ``\\uXXXX`` (inside JSON strings, the only place
    ``json.dumps`` can leave one, that is the same string; elsewhere it is readable text)."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _cell_text(value: Any) -> str:
    """A value as exact text (CSV/TSV cells)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime | date):
        return _time(value)
    if isinstance(value, str):
        return escape_surrogates(value)
    if isinstance(value, int | float | Decimal):
        return str(value)
    return to_json(value)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: invisible characters that are harmless and needed (emoji sequences, some scripts' joining)
_HARMLESS = frozenset("\u200c\u200d")
#: the Unicode categories shown escaped: controls (C0, C1, DEL), format characters (the
#: bidirectional overrides and isolates, zero-width and invisible ones), surrogates,
#: unassigned code points, and the line and paragraph separators
_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})


def _unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE and ch not in _HARMLESS


def safe_text(text: str, *, newlines: bool = False) -> str:
    """``text`` as a terminal may show it: every control character (C0 and C1, ESC, DEL), every
    invisible format character (bidirectional overrides and isolates, zero-width spaces, the
    BOM), lone surrogates, unassigned code points and the line separators U+2028/U+2029 are
    written as escapes (``\\n``, ``\\t``, ``\\r``, ``\\x1b``, ``\\u202e``), so a value can
    neither drive the terminal, nor reorder or hide what is shown, nor break the layout.
    ``newlines`` keeps line breaks (``\\n``) as they are, for text shown as it streams.

    For human output only: JSON, CSV and TSV print values exactly."""
    if text.isascii() and text.isprintable():
        return text
    out = []
    for ch in text:
        if ch == "\n" and newlines:
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif _unsafe(ch):
            code = ord(ch)
            if code < 0x100:
                out.append(f"\\x{code:02x}")
            else:
                out.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def _width(text: str) -> int:
    """Terminal columns of ``text`` (wide East Asian characters take two)."""
    if text.isascii():
        return len(text)
    return sum(
        0
        if unicodedata.combining(ch)
        else 2
        if unicodedata.east_asian_width(ch) in ("W", "F")
        else 1
        for ch in text
    )


def _cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` terminal columns, the last one an ellipsis (0: never cut)."""
    if not limit or _width(text) <= limit:
        return text
    out, used = [], 0
    for ch in text:
        w = _width(ch)
        if used + w > limit - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + "…"


def _tsv_cell(value: Any) -> str:
    """A TSV cell: the exact text with tab, line breaks and backslash escaped."""
    text = _cell_text(value)
    if not any(ch in text for ch in "\t\n\r\\"):
        return text
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _table_cell(value: Any, limit: int) -> str:
    """A value as a table shows it: a float to 6 digits, a time to the second in UTC, a list of
    texts as ``a, b`` (empty: nothing), anything else as its exact text; terminal-safe and cut
    to ``limit``."""
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, datetime):  # to the second, in UTC: 2026-11-30T14:05:09Z
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        text = utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        text = ", ".join(value)
    else:
        text = _cell_text(value)
    return _cut(safe_text(text), limit)


# -- writing -----------------------------------------------------------------------------------
def emit(
    rows: Iterable[Mapping[str, Any]],
    output: OutputFormat,
    *,
    columns: Sequence[str] | None = None,
    file: IO[str] | None = None,
    empty_table: bool = True,
) -> int:
    """Print ``rows`` (mappings; ``columns`` names every column a row has, in order, else the
    first row's keys) in ``output``'s format, with the columns ``output`` picks (``--columns``);
    return how many rows were printed. A table of no rows is its header, unless
    ``empty_table`` is false (then nothing: a report that is silent when all is well)."""
    out = file if file is not None else sys.stdout
    kind = output.kind
    header: list[str] | None = output.pick(columns) if columns is not None else None
    if kind == "table":
        return _table(rows, output, header if empty_table else None, out, header)
    count = 0
    if kind in ("json", "nl"):
        first = True
        for row in rows:
            if header is None:
                header = output.pick(list(row))
            record = {c: row.get(c) for c in header}
            text = escape_surrogates(json.dumps(record, ensure_ascii=False, default=json_default))
            if kind == "nl":
                out.write(text + "\n")
            else:
                out.write(("[" if first else ",\n ") + text)
            first = False
            count += 1
        if kind == "json":
            out.write("[]\n" if first else "]\n")
        return count
    if kind == "tsv":
        if header is not None and output.headers:
            out.write("\t".join(header) + "\n")
        for row in rows:
            if header is None:
                header = output.pick(list(row))
                if output.headers:
                    out.write("\t".join(header) + "\n")
            out.write("\t".join(_tsv_cell(row.get(c)) for c in header) + "\n")
            count += 1
        return count
    writer = csv.writer(out, dialect="excel", lineterminator="\n")
    if header is not None and output.headers:
        writer.writerow(header)
    for row in rows:
        if header is None:
            header = output.pick(list(row))
            if output.headers:
                writer.writerow(header)
        writer.writerow([_cell_text(row.get(c)) for c in header])
        count += 1
    return count


#: the narrowest a text column is cut to when a table is fitted to the terminal.
_MIN_COLUMN = 8
#: the columns a fitted table keeps whole as long as they fit (what an auditor reads a row by):
#: ids, names, states and why, models and times; the others (arguments, results...) are cut
#: first, then left out
_WHOLE_NAMES = frozenset(
    {"id", "conversation", "name", "tool", "state", "reason", "model", "time", "day"}
)


def _keep_whole(column: str) -> bool:
    return column in _WHOLE_NAMES or column.endswith(("_id", "_at"))


def _fit(widths: list[int], floors: list[int], total: int) -> list[int]:
    """Column widths that fit ``total`` columns (two spaces between columns) by narrowing the
    widest columns first, none below its floor; as close as the floors allow."""
    fitted = list(widths)
    excess = sum(fitted) + 2 * (len(fitted) - 1) - total
    while excess > 0:
        shrinkable = [i for i, w in enumerate(fitted) if w > floors[i]]
        if not shrinkable:
            break
        widest = max(fitted[i] for i in shrinkable)
        at_widest = [i for i in shrinkable if fitted[i] == widest]
        others = [fitted[i] for i in shrinkable if fitted[i] < widest]
        target = max([*others, *(floors[i] for i in at_widest)])
        # take each widest column down towards the next width, one column at a time
        step = min(widest - target, -(-excess // len(at_widest))) or 1
        for i in at_widest:
            cut = min(step, fitted[i] - floors[i], excess)
            fitted[i] -= cut
            excess -= cut
            if excess <= 0:
                break
    return fitted


def _total(widths: Sequence[int]) -> int:
    """A table's width: its columns and two spaces between each."""
    return sum(widths) + 2 * (len(widths) - 1)


def _fitting_columns(
    header: Sequence[str],
    cells: Sequence[Sequence[str]],
    widths: Sequence[int],
    numeric: Sequence[bool],
    room: int,
    may_leave_out: bool,
) -> list[int]:
    """The columns (their indexes) a table too wide for ``room`` keeps: without columns that
    are empty in every row; then, while it cannot fit with its text columns cut to
    :data:`_MIN_COLUMN`, without the rightmost number column, then the rightmost text column,
    that is not kept whole (:func:`_keep_whole`). Nothing is left out of columns the user named
    (``may_leave_out`` false)."""
    keep = list(range(len(header)))
    if not may_leave_out:
        return keep
    if cells:
        keep = [i for i in keep if any(line[i] for line in cells)]

    def narrowest() -> int:
        return _total(
            [
                widths[i] if numeric[i] or _keep_whole(header[i]) else min(widths[i], _MIN_COLUMN)
                for i in keep
            ]
        )

    for kind in (True, False):  # numbers first (positions, counts), then texts
        for i in reversed(list(keep)):
            if narrowest() <= room:
                return keep
            if numeric[i] == kind and not _keep_whole(header[i]):
                keep.remove(i)
    return keep


def _table(
    rows: Iterable[Mapping[str, Any]],
    output: OutputFormat,
    columns: Sequence[str] | None,
    out: IO[str],
    picked: Sequence[str] | None = None,
) -> int:
    materialized = list(rows)
    if columns is None:
        if not materialized:  # no row, and no header wanted or known: nothing to show
            return 0
        columns = picked if picked is not None else output.pick(list(materialized[0]))
    header = list(columns)
    limit = output.max_width
    cells = [[_table_cell(row.get(c), limit) for c in header] for row in materialized]
    numeric = [
        bool(materialized)
        and all(
            isinstance(row.get(c), int | float | Decimal) and not isinstance(row.get(c), bool)
            for row in materialized
            if row.get(c) is not None
        )
        for c in header
    ]
    titles = [safe_text(h) for h in header]
    widths = [_width(h) if output.headers else 0 for h in titles]
    for line in cells:
        widths = [max(w, _width(cell)) for w, cell in zip(widths, line, strict=True)]
    room = output.width if output.width is not None else terminal_width()
    if limit and room and _total(widths) > room:
        keep = _fitting_columns(header, cells, widths, numeric, room, output.columns is None)
        if len(keep) < len(header):
            left_out = [header[i] for i in range(len(header)) if i not in keep]
            print(
                f"({len(left_out)} column(s) left out to fit {room} columns: "
                f"{', '.join(left_out)}; --columns or --max-width 0 shows them)",
                file=sys.stderr,
            )
            header = [header[i] for i in keep]
            titles = [titles[i] for i in keep]
            widths = [widths[i] for i in keep]
            numeric = [numeric[i] for i in keep]
            cells = [[line[i] for i in keep] for line in cells]
        whole = [right or _keep_whole(c) for c, right in zip(header, numeric, strict=True)]
        fitted = _fit(
            widths,
            [w if k else min(w, _MIN_COLUMN) for w, k in zip(widths, whole, strict=True)],
            room,
        )
        if _total(fitted) > room:  # the whole columns alone are too wide: cut them too
            fitted = _fit(
                fitted,
                [w if r else min(w, _MIN_COLUMN) for w, r in zip(fitted, numeric, strict=True)],
                room,
            )
        if fitted != widths:
            widths = fitted
            titles = [_cut(t, w) for t, w in zip(titles, widths, strict=True)]
            cells = [[_cut(c, w) for c, w in zip(line, widths, strict=True)] for line in cells]

    def render(line: Sequence[str]) -> str:
        parts = []
        for cell, width, right in zip(line, widths, numeric, strict=True):
            pad = " " * (width - _width(cell))
            parts.append(pad + cell if right else cell + pad)
        return "  ".join(parts).rstrip()

    if output.headers:
        out.write(render(titles) + "\n")
        out.write("  ".join("-" * w for w in widths) + "\n")
    for line in cells:
        out.write(render(line) + "\n")
    return len(materialized)


# -- mermaid -------------------------------------------------------------------------------------
#: characters written as they are in mermaid text; everything else becomes an entity code
#: (``#59;``), which mermaid decodes when it renders: no ``;``, ``#``, ``:``, ``%%``, quotes,
#: brackets or markup can end a statement, start a comment or inject HTML.
_MERMAID_PLAIN = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,_-/()?!'+*=@$^~|"
)
_MERMAID_KEYWORDS = frozenset(
    {"end", "participant", "actor", "as", "loop", "alt", "else", "opt", "par", "and", "rect",
     "note", "critical", "break", "box", "activate", "deactivate", "autonumber", "link", "links",
     "create", "destroy"}
)  # fmt: skip


def mermaid_text(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters and made safe inside a mermaid statement.

    Letters, digits and a few harmless punctuation marks stay; a line break becomes ``<br/>``;
    every other character is written as an entity code (``#123;``); control characters become
    spaces. Empty text becomes ``(empty)`` (mermaid wants some text after the colon), and a text
    that is exactly a mermaid keyword is fully encoded.
    """
    cut = _cut(text, limit) if limit else text
    if not cut.strip():
        return "(empty)"
    if cut.strip().lower() in _MERMAID_KEYWORDS:
        return "".join(f"#{ord(ch)};" for ch in cut)
    out = []
    for ch in cut:
        if ch in _MERMAID_PLAIN or (ch.isalnum() and not ch.isascii()):
            out.append(ch)
        elif ch == "\n":
            out.append("<br/>")
        elif not ch.isprintable():
            out.append(" ")
        else:
            out.append(f"#{ord(ch)};")
    return "".join(out)


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if texts and all(isinstance(t, str) for t in texts):
            return " ".join(t for t in texts if isinstance(t, str))
    return to_json(content)


def mermaid_sequence(messages: Sequence[Mapping[str, Any]], *, width: int = 60) -> str:
    """A conversation (an OpenAI ``messages`` list, as ``history()`` returns it) as a mermaid
    ``sequenceDiagram``.

    Participants: the user, the assistant, and each tool by name, in order of appearance.
    Arrows: each user message (user to assistant), each assistant text (assistant to user),
    each tool call with its short arguments and id (assistant to tool), each result (tool back
    to the assistant; results are matched to calls by position, as history stores them).
    System and developer messages are notes. Texts are cut to ``width`` characters and escaped
    with :func:`mermaid_text`.
    """
    tools: dict[str, str] = {}
    lines: list[str] = []
    pending: list[str] = []

    def tool(name: str) -> str:
        if name not in tools:
            tools[name] = f"T{len(tools) + 1}"
        return tools[name]

    for message in messages:
        role = message.get("role")
        text = _message_text(message.get("content"))
        if role == "user":
            lines.append(f"    U->>A: {mermaid_text(text, width)}")
        elif role in ("system", "developer"):
            lines.append(f"    Note over U,A: {role}: {mermaid_text(text, width)}")
        elif role == "assistant":
            if text:
                lines.append(f"    A->>U: {mermaid_text(text, width)}")
            if message.get("refusal"):
                refusal = mermaid_text(str(message["refusal"]), width)
                lines.append(f"    A->>U: refusal: {refusal}")
            pending = []
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                name = str(function.get("name", ""))
                target = tool(name)
                pending.append(target)
                arguments = mermaid_text(str(function.get("arguments", "")), width // 2)
                call_id = mermaid_text(str(call.get("id", "")), 32)
                lines.append(
                    f"    A->>{target}: {mermaid_text(name, 40)}({arguments}) id {call_id}"
                )
            if not text and not message.get("refusal") and not pending:
                lines.append("    A->>U: (empty)")
        elif role == "tool":
            source = pending.pop(0) if pending else tool("")
            lines.append(f"    {source}-->>A: {mermaid_text(text, width)}")
    head = ["sequenceDiagram", "    participant U as user", "    participant A as assistant"]
    head += [f"    participant {pid} as {mermaid_text(name, 40)}" for name, pid in tools.items()]
    return "\n".join(head + lines) + "\n"
