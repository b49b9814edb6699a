"""How every listing command prints rows (in the style of sqlite-utils).

One writer for every command that prints rows, in the format the shared output flags choose
(:func:`fsm.cli.options.output_options`):

* the default (or ``--table``): an aligned table for people, numbers right-aligned, long cells
  cut to ``--max-width`` characters (0: never), control characters shown escaped (``\\n``,
  ``\\x1b``) so that a value can neither break the layout nor drive the terminal;
* ``--json``: one JSON array (one object per line inside it), ``--nl``: one JSON object per line
  (JSON lines), ``--csv`` / ``--tsv``: a header row then one row per line (``--no-headers``
  leaves the header out). Values are exact: nothing is cut or escaped beyond the format's own
  rules; times are ISO 8601 in UTC (``2026-11-30T14:05:09Z``); lists and objects are JSON
  inside CSV cells; ``null`` is an empty CSV cell. A lone surrogate (an id or a text stored as a
  provider sent it, ``"\\ud83d"``), which no UTF-8 output can carry, is written as the JSON
  escape ``\\ud83d`` in JSON (the same string, exactly) and as that text in CSV and TSV cells.

The table is the default whether or not stdout is a terminal: what a person sees is what a
pipe gets, and a script asks for a machine format explicitly (``--json``, ``--nl``, ``--csv``),
so its output never changes with where it runs. Machine formats stream row by row; the table
reads all rows first to size its columns.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import date, datetime
from decimal import Decimal
from typing import IO, Any

__all__ = [
    "FORMATS",
    "OutputFormat",
    "columns_of",
    "emit",
    "escape_surrogates",
    "json_default",
    "mermaid_sequence",
    "mermaid_text",
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

    @property
    def is_table(self) -> bool:
        """Whether the rows are for people (a table) rather than for scripts."""
        return self.kind == "table"


def columns_of(row_type: type) -> tuple[str, ...]:
    """The columns of a row dataclass (its fields, in order): what a listing of such rows shows,
    and its CSV header even when there are no rows."""
    return tuple(field.name for field in fields(row_type))


# -- values ------------------------------------------------------------------------------------
def _time(value: datetime | date) -> str:
    if isinstance(value, datetime):
        text = value.isoformat()
        return text[:-6] + "Z" if text.endswith("+00:00") else text
    return value.isoformat()


def json_default(value: Any) -> Any:
    """``json.dumps`` ``default=``: times as ISO 8601 (UTC as ``Z``), decimals as numbers."""
    if isinstance(value, datetime | date):
        return _time(value)
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def to_json(value: Any) -> str:
    """``value`` as compact JSON text (times in ISO 8601, UTC as ``Z``)."""
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


def _visible(text: str) -> str:
    """Control and format characters escaped, so a cell stays on its line and inert."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
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


def _table_cell(value: Any, limit: int) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else _cell_text(value)
    return _cut(_visible(text), limit)


# -- writing -----------------------------------------------------------------------------------
def emit(
    rows: Iterable[Mapping[str, Any]],
    output: OutputFormat,
    *,
    columns: Sequence[str] | None = None,
    file: IO[str] | None = None,
) -> int:
    """Print ``rows`` (mappings; ``columns`` fixes which and in what order, else the first
    row's keys) in ``output``'s format; return how many rows were printed."""
    out = file if file is not None else sys.stdout
    kind = output.kind
    if kind == "table":
        return _table(rows, output, columns, out)
    count = 0
    if kind in ("json", "nl"):
        first = True
        for row in rows:
            record = {c: row.get(c) for c in columns} if columns else dict(row)
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
    writer = csv.writer(out, dialect="excel" if kind == "csv" else "excel-tab", lineterminator="\n")
    header: Sequence[str] | None = columns
    if header is not None and output.headers:
        writer.writerow(header)
    for row in rows:
        if header is None:
            header = list(row)
            if output.headers:
                writer.writerow(header)
        writer.writerow([_cell_text(row.get(c)) for c in header])
        count += 1
    return count


def _table(
    rows: Iterable[Mapping[str, Any]],
    output: OutputFormat,
    columns: Sequence[str] | None,
    out: IO[str],
) -> int:
    materialized = list(rows)
    if not materialized:  # nothing to show: no table at all (JSON says [] and CSV has a header)
        return 0
    header = list(columns) if columns is not None else list(materialized[0])
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
    widths = [_width(h) if output.headers else 0 for h in header]
    for line in cells:
        widths = [max(w, _width(cell)) for w, cell in zip(widths, line, strict=True)]

    def render(line: Sequence[str]) -> str:
        parts = []
        for cell, width, right in zip(line, widths, numeric, strict=True):
            pad = " " * (width - _width(cell))
            parts.append(pad + cell if right else cell + pad)
        return "  ".join(parts).rstrip()

    if output.headers:
        out.write(render(header) + "\n")
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
