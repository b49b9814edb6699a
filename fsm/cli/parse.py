"""``fsm parse``: parse a recorded stream and show what it amounts to."""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

import click
import orjson

from fsm.api import parse_text
from fsm.cli.output import safe_text
from fsm.completion import COMPLETION_KINDS, completion_kind, parse_completion
from fsm.exitstatus import EXIT_INTERRUPTED, EXIT_UNUSABLE
from fsm.parser import ParseResult, StreamParser, Turn

__all__ = [
    "INTERRUPTED",
    "Parsed",
    "not_a_stream",
    "parse_command",
    "parse_input",
    "read_input",
    "render_result",
]

_PREVIEW = 200


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
    if turn.format != "chat":
        kinds = [item.get("type", "?") for item in turn.output_items()]
        lines.append(f"  items: {_short(', '.join(kinds)) or '(none)'}")
    calls = turn.tool_calls
    if not calls:
        lines.append("  no tool calls")
    for call in calls:
        state = call.state.value + (f" ({call.reason})" if call.reason else "")
        if call.repaired:
            state += " (repaired)"
        if call.custom:
            state += " (custom: free-text input)"
        index = "-" if call.index is None else str(call.index)
        lines.append(
            f"  #{call.position} [index {index}] {_short(call.name) or '(no name)'}  "
            f"id {_short(call.id) or '(none)'}  {_short(state)}"
        )
        lines.append(f"      arguments: {_short(call.arguments) or '(empty)'}")
    return lines


def render_result(result: ParseResult) -> str:
    """A readable summary of a parse result, for people."""
    kind = "" if result.format in (None, "chat") else f"{result.format} "
    head = [
        f"{kind}response {_short(result.response_id or '-')} · model "
        f"{_short(result.model or '-')} · "
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


def render_json(result: ParseResult, completion: str | None = None) -> str:
    """The ``--json`` document (with ``"input"``: the kind of a non-streamed response, e.g.
    ``"chat.completion"``, when it was one). Lone surrogates, which UTF-8 cannot carry, are
    written as JSON ``\\uXXXX`` escapes (the whole document is then ASCII)."""
    payload: Any = result.to_json()
    if completion is not None:
        payload = {"input": completion, **payload}
    try:
        return orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode()
    except TypeError:  # orjson.JSONEncodeError: a str with a lone surrogate
        return json.dumps(payload, indent=2, ensure_ascii=True)


#: the abort reason of a stream cut by Ctrl-C while it was read from stdin.
INTERRUPTED = "interrupted (Ctrl-C)"


def read_input(source: str) -> tuple[bytes, bool]:
    """The bytes of ``source`` (a path, or ``-`` for stdin) and whether Ctrl-C ended reading.

    Stdin is read as it comes, so that Ctrl-C (while a producer still writes, or on a
    terminal) keeps every byte received so far; a file is read whole (Ctrl-C then interrupts
    the command as usual).
    """
    if source != "-":
        with open(source, "rb") as handle:
            return handle.read(), False
    stdin = sys.stdin.buffer
    read = getattr(stdin, "read1", stdin.read)
    received = bytearray()
    try:
        while piece := read(1 << 16):
            received += piece
    except KeyboardInterrupt:
        return bytes(received), True
    return bytes(received), False


class Parsed(NamedTuple):
    """What :func:`parse_input` made of its bytes."""

    #: the parse result
    result: ParseResult
    #: what the input was, for people: ``"chat.completion"``, ``"response"`` or ``"message"``
    #: for a non-streamed response (:func:`fsm.completion.parse_completion`), ``None`` for a stream
    completion: str | None


def _completion(body: bytes) -> Any:
    """The decoded object when ``body`` (without its BOM) is one whole non-streamed response,
    else ``None`` (a stream, JSON lines of chunks, anything else: the stream path judges
    those)."""
    if body.lstrip()[:1] != b"{":
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:  # JSON lines of chunks, or not JSON at all
        return None
    return obj if completion_kind(obj) is not None else None


def parse_input(
    data: bytes, *, interrupted: bool, repair_json: bool, format: str = "auto"
) -> Parsed:
    """:func:`fsm.api.parse_text` of ``data``, or :func:`fsm.completion.parse_completion` when it
    is one whole non-streamed response (a ``chat.completion``, a Responses ``response``, an
    Anthropic ``message``, pretty-printed or not); a ``format`` that names another format than
    that response's is a :class:`click.UsageError`. For input cut by Ctrl-C (``interrupted``),
    the stream is aborted with reason :data:`INTERRUPTED` instead of ended by EOF (its open calls
    become ``aborted``), and a last JSON line cut in the middle is left out."""
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    if not interrupted:
        whole = _completion(body)
        if whole is not None:
            kind = completion_kind(whole)
            assert kind is not None
            if format not in ("auto", kind):
                raise click.UsageError(
                    f"the input is a non-streamed {COMPLETION_KINDS[kind]} ({kind} format), "
                    f"not {format}: drop --format or name {kind}"
                )
            return Parsed(parse_completion(whole, repair_json=repair_json), COMPLETION_KINDS[kind])
        return Parsed(parse_text(data, repair_json=repair_json, format=format), None)
    parser = StreamParser(repair_json=repair_json, format=format)
    if body.lstrip()[:1] == b"{":  # JSON lines, as parse_text tells them
        lines = body.splitlines()
        if lines and not body.endswith((b"\n", b"\r")):
            lines.pop()
        for line in lines:
            if line.strip():
                parser.receive_chunk(line)
    else:
        parser.receive_data(data)
    parser.abort(INTERRUPTED)
    return Parsed(parser.result(), None)


def not_a_stream(result: ParseResult) -> str | None:
    """Why the parsed input is not a stream at all (``None``: it is one): it held no SSE event
    and no JSON chunk, or none of its events was a Chat Completions chunk (no choice, id,
    model, usage, error or ``[DONE]``: Markdown, a JSON document, a binary file). A Responses
    or Anthropic stream is recognised by its turn (created at its first event)."""
    if result.event_count == 0:
        return "it holds no SSE event and no JSON chunk"
    recognised = (
        result.turns
        or result.response_id is not None
        or result.model is not None
        or result.usage is not None
        or result.error is not None
        or result.end_how in ("done", "error")
    )
    if recognised:
        return None
    return (
        f"none of its {result.event_count} event(s) is a Chat Completions chunk, a Responses "
        "API event or an Anthropic Messages event"
    )


@click.command(name="parse")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object.")
@click.option(
    "--repair-json",
    is_flag=True,
    help="Opt-in append-only repair of invalid argument JSON (never for finish_reason length).",
)
@click.option(
    "--format",
    "stream_format",
    type=click.Choice(["auto", "chat", "responses", "anthropic"]),
    default="auto",
    show_default=True,
    help="The stream format: detected from the first JSON event, or named (Chat Completions, "
    "the OpenAI Responses API, Anthropic Messages).",
)
def parse_command(file: str, as_json: bool, repair_json: bool, stream_format: str) -> None:
    """Parse a recorded stream FILE (SSE text, or JSON lines of chunks or events; '-' for
    stdin): Chat Completions, OpenAI Responses API or Anthropic Messages (auto-detected, or
    --format). A FILE holding one whole non-streamed response (a chat.completion, a Responses
    'response' or an Anthropic 'message', as create() without stream=True returns it) is parsed
    by the same rules, and the output says so.

    Exit status: 0 when every choice is a complete turn, 1 when any is not, 2 when the input is
    not a stream at all (invalid chunks, no SSE event or chunk in it, or none that is a Chat
    Completions chunk: the reason is printed on stderr), 130 on Ctrl-C (reading stdin, the
    partial result is still printed, its open calls aborted as interrupted).

    \b
    Examples:
      fsm parse response.sse
      fsm parse --json response.sse | jq '.choices[0].tool_calls'
      curl -sN ... | fsm parse --json -
    """
    data, interrupted = read_input(file)
    result, completion = parse_input(
        data, interrupted=interrupted, repair_json=repair_json, format=stream_format
    )
    why = None if interrupted or completion else not_a_stream(result)
    if why is not None:
        name = "stdin" if file == "-" else file
        click.echo(f"error: {name} is not a stream: {why}", err=True)
        sys.exit(EXIT_UNUSABLE)
    if as_json:
        click.echo(render_json(result, completion))
    else:
        if completion is not None:
            click.echo(f"a non-streamed {completion} (not a stream): parsed by the same rules")
        click.echo(render_result(result))
    if interrupted:
        click.echo(
            f"error: {INTERRUPTED} while reading stdin: the result above is what arrived "
            f"before ({len(data)} bytes)",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    if not result.complete:
        sys.exit(1)
