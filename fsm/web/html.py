"""HTML for the viewer: every stored value goes through :func:`text` (escaped, with invisible
and control characters shown visibly), every URL is built by :func:`href` / :func:`path_of`
from fixed paths and percent-encoded values, and every page is one :func:`page` (a fixed layout,
one stylesheet served by the package, no script).

Nothing here ever puts a stored value into an attribute other than through :func:`attr` (quoted,
escaped) and never into a URL scheme position: a ``javascript:`` value is shown as text, and a
link to a conversation is ``/c/`` followed by its id percent-encoded.
"""

from __future__ import annotations

import html
import json
import unicodedata
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import quote, urlencode

__all__ = ["attr", "href", "json_block", "page", "path_of", "text", "when"]

_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_HARMLESS: Final = frozenset("\u200c\u200d")
_UNSAFE: Final = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})


def _escape_of(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def text(value: Any, *, newlines: bool = False) -> str:
    """``value`` (any stored value) as HTML text: ``<``, ``>``, ``&`` and quotes escaped; every
    control character (C0, C1, DEL), invisible format character (bidirectional overrides and
    isolates, zero-width spaces, the BOM), lone surrogate, unassigned code point and line
    separator shown as its escape (``\\u202e``) in a marked span, so that no value can reorder,
    hide or inject what the page shows. ``newlines`` keeps ``\\n`` as a line break (inside a
    ``<pre>``); else it is shown as ``\\n`` too."""
    if value is None:
        return ""
    if not isinstance(value, str):
        value = str(value)
    if value.isascii() and value.isprintable():
        return html.escape(value)
    out: list[str] = []
    plain: list[str] = []
    for ch in value:
        if ch == "\n" and newlines:
            plain.append(ch)
        elif ch in _ESCAPES or (
            not ch.isprintable() and unicodedata.category(ch) in _UNSAFE and ch not in _HARMLESS
        ):
            if plain:
                out.append(html.escape("".join(plain)))
                plain.clear()
            out.append(f'<span class="ctl" title="an invisible character">{_escape_of(ch)}</span>')
        else:
            plain.append(ch)
    if plain:
        out.append(html.escape("".join(plain)))
    return "".join(out)


def attr(value: Any) -> str:
    """``value`` for a double-quoted attribute (escaped; invisible characters as escapes)."""
    shown = "" if value is None else str(value)
    if not (shown.isascii() and shown.isprintable()):
        shown = "".join(
            _escape_of(ch)
            if ch in _ESCAPES or (unicodedata.category(ch) in _UNSAFE and ch not in _HARMLESS)
            else ch
            for ch in shown
        )
    return html.escape(shown, quote=True)


def path_of(*segments: str) -> str:
    """A path of fixed and stored segments, each percent-encoded (``/``, ``%``, spaces, any
    non-ASCII and lone surrogates included), e.g. ``path_of("c", "a/b")`` -> ``/c/a%2Fb``."""
    return "/" + "/".join(
        quote(segment.encode("utf-8", "surrogatepass"), safe="") for segment in segments
    )


def href(
    path: str, query: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), *, anchor: str = ""
) -> str:
    """A link for an ``href`` attribute: ``path`` (from :func:`path_of` or a fixed route), its
    query (values percent-encoded; ``None`` and ``""`` left out) and an anchor, escaped."""
    items = query.items() if isinstance(query, Mapping) else query
    pairs = [(k, str(v)) for k, v in items if v is not None and v != ""]
    url = path + ("?" + urlencode(pairs, encoding="utf-8", errors="surrogatepass") if pairs else "")
    if anchor:
        url += "#" + quote(anchor, safe="-_.")
    return html.escape(url, quote=True)


def when(value: datetime | None) -> str:
    """A time as the viewer shows it (UTC, to the second), with the exact value as a tooltip."""
    if value is None:
        return '<span class="none">-</span>'
    utc = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return (
        f'<time datetime="{utc.isoformat()}" title="{utc.isoformat()}">'
        f"{utc.strftime('%Y-%m-%d %H:%M:%S')}</time>"
    )


def json_block(value: Any) -> str:
    """A JSON value pretty-printed in a ``<pre>`` (escaped as :func:`text` does)."""
    shown = json.dumps(value, ensure_ascii=False, indent=2, default=str)
    return f'<pre class="json">{text(shown, newlines=True)}</pre>'


#: the pages of the navigation bar: (path, label).
NAV: Final = (
    ("/", "Conversations"),
    ("/calls", "Calls"),
    ("/failures", "Failures"),
    ("/stats", "Stats"),
    ("/check", "Check"),
)


def page(
    title: str,
    body: str,
    *,
    current: str,
    json_link: str | None,
    store: str,
    refresh: tuple[int, str] | None = None,
) -> str:
    """A whole page: the navigation (each page links the others), the title, the body, a link
    to the page's JSON twin, and the store it reads. ``title`` and ``store`` are escaped here;
    ``body`` is HTML built by the callers from escaped parts. ``refresh``: (seconds, the link
    from :func:`href`) to reload, while a computation runs (no script: a meta refresh)."""
    mark = ' aria-current="page"'
    nav = "".join(
        f'<a href="{path}"{mark if path == current else ""}>{label}</a>' for path, label in NAV
    )
    twin = f' <a class="twin" href="{json_link}">JSON</a>' if json_link else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        + (
            f'<meta http-equiv="refresh" content="{refresh[0]}; url={refresh[1]}">'
            if refresh
            else ""
        )
        + f"<title>{text(title)} - fsm audit</title>"
        '<link rel="stylesheet" href="/static/style.css">'
        '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">'
        "</head><body>"
        f'<header><span class="brand">fsm audit</span><nav>{nav}</nav>'
        f'<span class="store" title="the store, opened read-only">{text(store)} '
        '<span class="ro">read-only</span></span></header>'
        f"<main><h1>{text(title)}{twin}</h1>{body}</main>"
        "</body></html>\n"
    )
