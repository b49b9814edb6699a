"""``fsm parse``: parse a recorded stream and show what it amounts to."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import orjson

from fsm.api import parse_text
from fsm.cli.output import safe_text
from fsm.parser import ParseResult, Turn

__all__ = ["parse_command", "render_result"]

_PREVIEW = 200
#: exit status for unusable input (``fsm.cli.main.EXIT_UNUSABLE``; not imported: main imports us)
_EXIT_UNUSABLE = 2


def _short(text: str, limit: int = _PREVIEW) -> str:
    """Provider text on one line, terminal-safe (:func:`~fsm.cli.output.safe_text`), cut."""
    text = safe_text(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _render_turn(turn: Turn) -> list[str]:
    status = "complete" if turn.complete else "INCOMPLETE"
    why = f"; {_short(turn.incomplete_reason)}" if turn.incomplete_reason else ""
    finish = _short(turn.finish_reason) if turn.finish_reason else "-"
    lines = [f"choice {turn.index}: {status} (finish_reason {finish}{why})"]
    for label, text in (
        ("reasoning", turn.reasoning),
        ("content", turn.content),
        ("refusal", turn.refusal),
    ):
        if text is not None:
            lines.append(f"  {label}: {_short(text)}")
    calls = turn.tool_calls
    if not calls:
        lines.append("  no tool calls")
    for call in calls:
        state = call.state.value + (f" ({call.reason})" if call.reason else "")
        if call.repaired:
            state += " (repaired)"
        index = "-" if call.index is None else str(call.index)
        lines.append(
            f"  #{call.position} [index {index}] {_short(call.name) or '(no name)'}  "
            f"id {_short(call.id) or '(none)'}  {_short(state)}"
        )
        lines.append(f"      arguments: {_short(call.arguments) or '(empty)'}")
    return lines


def render_result(result: ParseResult) -> str:
    """A readable summary of a parse result, for people."""
    head = [
        f"response {_short(result.response_id or '-')} · model {_short(result.model or '-')} · "
        f"ended: {result.end_how or 'not yet'}"
        + (f" ({_short(result.end_reason)})" if result.end_reason else "")
    ]
    for turn in result.turns:
        head.extend(_render_turn(turn))
    if not result.turns:
        head.append("no choices in the stream")
    if result.anomalies:
        head.append(f"anomalies ({len(result.anomalies)}):")
        head.extend(f"  {a.kind}: {safe_text(a.detail)}" for a in result.anomalies)
    if result.usage:
        usage = ", ".join(
            f"{safe_text(str(k))} {v}" for k, v in result.usage.items() if isinstance(v, int)
        )
        head.append(f"usage: {usage}")
    verdict = "COMPLETE: safe to commit" if result.complete else "INCOMPLETE: do not execute"
    head.append(verdict)
    # lone surrogates (kept as sent in ids and names) cannot be written as UTF-8: show escapes
    return "\n".join(head).encode("utf-8", "backslashreplace").decode("utf-8")


def render_json(result: ParseResult) -> str:
    """The ``--json`` document. Lone surrogates, which UTF-8 cannot carry, are written as JSON
    ``\\uXXXX`` escapes (the whole document is then ASCII)."""
    payload: Any = result.to_json()
    try:
        return orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode()
    except TypeError:  # orjson.JSONEncodeError: a str with a lone surrogate
        return json.dumps(payload, indent=2, ensure_ascii=True)


def _read(source: str) -> bytes:
    if source == "-":
        return sys.stdin.buffer.read()
    with open(source, "rb") as handle:
        return handle.read()


@click.command(name="parse")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object.")
@click.option(
    "--repair-json",
    is_flag=True,
    help="Opt-in append-only repair of invalid argument JSON (never for finish_reason length).",
)
def parse_command(file: str, as_json: bool, repair_json: bool) -> None:
    """Parse a recorded stream FILE (SSE text, or JSON lines of chunks; '-' for stdin).

    Exit status: 0 when every choice is a complete turn, 1 when any is not, 2 when the input is
    not a stream at all (invalid chunks, or no SSE event and no chunk in it: the reason is
    printed on stderr).

    \b
    Examples:
      fsm parse response.sse
      fsm parse --json response.sse | jq '.choices[0].tool_calls'
      curl -sN ... | fsm parse --json -
    """
    result = parse_text(_read(file), repair_json=repair_json)
    if result.event_count == 0:
        name = "stdin" if file == "-" else file
        click.echo(
            f"error: {name} is not a stream: it holds no SSE event and no JSON chunk", err=True
        )
        sys.exit(_EXIT_UNUSABLE)
    if as_json:
        click.echo(render_json(result))
    else:
        click.echo(render_result(result))
    if not result.complete:
        sys.exit(1)
