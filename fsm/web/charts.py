"""Charts drawn on the server as inline SVG: no script, no style attribute (the colours are
classes of the package's stylesheet, so the Content-Security-Policy needs no ``unsafe-inline``),
every label escaped by :func:`fsm.web.html.text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsm.web.html import text

__all__ = ["hbars", "stacked_columns"]


def _nice_max(value: float) -> float:
    """A round axis maximum at or above ``value``."""
    if value <= 0:
        return 1.0
    magnitude = 10 ** (len(str(int(value))) - 1)
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def stacked_columns(
    title: str,
    labels: Sequence[str],
    series: Sequence[tuple[str, str, Sequence[float]]],
    *,
    width: int = 760,
    height: int = 220,
) -> str:
    """Columns per label (a day), each stacked from ``series``: ``(name, css class, values)``.
    A legend names the series; each column has a tooltip with its numbers."""
    if not labels:
        return f'<p class="none">{text(title)}: no data.</p>'
    left, bottom, top = 56, 34, 10
    plot_w, plot_h = width - left - 8, height - bottom - top
    totals = [sum(s[2][i] for s in series) for i in range(len(labels))]
    peak = _nice_max(max(totals))
    step = plot_w / len(labels)
    bar = max(1.0, step * 0.8)
    parts = [
        f'<figure class="chart"><figcaption>{text(title)}</figcaption>'
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{text(title)}">'
    ]
    for tick in range(5):
        value = peak * tick / 4
        y = top + plot_h - plot_h * tick / 4
        parts.append(
            f'<line class="grid" x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="axis" x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
            f"{value:,.0f}</text>"
        )
    every = max(1, len(labels) // 10)
    for i, label in enumerate(labels):
        x = left + i * step + (step - bar) / 2
        y = top + plot_h
        tip = ", ".join(f"{name} {values[i]:,.0f}" for name, _, values in series)
        parts.append(f"<g><title>{text(label)}: {text(tip)}</title>")
        for _name, css, values in series:
            h = plot_h * values[i] / peak
            if h <= 0:
                continue
            y -= h
            parts.append(
                f'<rect class="{css}" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}"/>'
            )
        parts.append("</g>")
        if i % every == 0:
            parts.append(
                f'<text class="axis" x="{x + bar / 2:.1f}" y="{height - bottom + 14}" '
                f'text-anchor="middle">{text(label[5:] if len(label) == 10 else label)}</text>'
            )
    legend_x = left
    for name, css, _ in series:
        parts.append(
            f'<rect class="{css}" x="{legend_x}" y="{height - 12}" width="10" height="10"/>'
            f'<text class="axis" x="{legend_x + 14}" y="{height - 3}">{text(name)}</text>'
        )
        legend_x += 14 + 8 * len(name) + 16
    parts.append("</svg></figure>")
    return "".join(parts)


def hbars(
    title: str,
    rows: Sequence[tuple[str, float, str]],
    *,
    css: str = "bar",
    width: int = 760,
    percent: bool = False,
) -> str:
    """Horizontal bars: ``(label, value, shown value)`` per row, the longest label first as the
    caller orders them; ``percent`` scales against 100 % instead of the largest value."""
    if not rows:
        return f'<p class="none">{text(title)}: no data.</p>'
    label_w, row_h = 220, 20
    height = row_h * len(rows) + 8
    peak = 1.0 if percent else _nice_max(max(v for _, v, _ in rows))
    plot_w = width - label_w - 90
    parts = [
        f'<figure class="chart"><figcaption>{text(title)}</figcaption>'
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{text(title)}">'
    ]
    for i, (label, value, shown) in enumerate(rows):
        y = 4 + i * row_h
        w = max(0.0, plot_w * min(value / peak, 1.0)) if peak else 0.0
        short = label if len(label) <= 30 else label[:29] + "\u2026"
        parts.append(
            f"<g><title>{text(label)}: {text(shown)}</title>"
            f'<text class="axis" x="{label_w - 6}" y="{y + 14}" text-anchor="end">'
            f"{text(short)}</text>"
            f'<rect class="{css}" x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}"/>'
            f'<text class="axis" x="{label_w + w + 6:.1f}" y="{y + 14}">{text(shown)}</text></g>'
        )
    parts.append("</svg></figure>")
    return "".join(parts)
