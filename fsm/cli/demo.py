"""``fsm demo``: a real agent loop end to end, with no set-up.

It starts :class:`fsm.testing.ReplayServer` on a free local port with the project's own streams
(:func:`fsm.testing.demo_script`: ``parallel_add_multiply.sse`` then ``final_answer.sse``), runs
:func:`fsm.agent.run_agent_loop` with the official ``openai.OpenAI`` client against it and two
real local tools (``add``, ``multiply``), stores everything in the store (the embedded SQLite
default unless ``--db`` says otherwise), and prints, as it happens, the streamed text and each
tool's name as soon as the stream names it; then the stored history and a short audit summary.

A third request (:data:`CUT_QUESTION`, in a conversation of its own, ``<id>-cut``) is answered by
``cut_off_call.sse``: the model is cut off by ``length`` in the middle of a call's arguments, so
the call is truncated, never run, and the turn is recorded as an attempt (nothing goes to
history). The demo ends with the command that opens the viewer (``fsm audit serve``) on its
store.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from fsm.cli.options import db_option
from fsm.cli.output import safe_text

if TYPE_CHECKING:
    from fsm.agent import AgentEvent
    from fsm.store import ConversationStore

__all__ = ["demo"]

QUESTION = "What are 1234 + 5678 and 12 x 34?"
#: the question of the turn the model cuts off mid-call
CUT_QUESTION = "And 99 x 99?"
MODEL = "demo-model-1"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@click.command(name="demo")
@db_option(
    "A SQLite database is created or upgraded as needed; PostgreSQL must be upgraded first "
    "(fsm db upgrade --db URL)."
)
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    default=0.04,
    show_default=True,
    help="Seconds between the replayed stream's events (0: as fast as possible).",
)
@click.option(
    "--format",
    "stream_format",
    type=click.Choice(["chat", "responses", "anthropic"]),
    default="chat",
    show_default=True,
    help="The API the loop speaks: Chat Completions, the Responses API (openai client), or "
    "Anthropic Messages (anthropic client, pip install 'fsm-toolcalls[anthropic]').",
)
def demo(url: str | None, delay: float, stream_format: str) -> None:
    """Run a real tool-calling agent loop end to end, with nothing to set up.

    A local OpenAI-compatible server replays fsm's example streams over HTTP; the official
    openai client streams them; fsm parses each turn as it arrives, runs the local tools add
    and multiply, commits every turn with its results in one transaction, and sends the stored
    history back, which the server checks (ids, arguments byte for byte, results in place).
    Each run is a new conversation (demo-<timestamp>). With --format responses or anthropic
    the same conversation runs over POST /v1/responses (openai's client.responses) or POST
    /v1/messages (the anthropic client), with a reasoning item or a thinking block that the
    follow-up must send back verbatim.

    \b
    Examples:
      fsm demo
      fsm demo --db sqlite:///demo.db --delay 0
      fsm demo --format anthropic
    """
    fmt: Any = stream_format
    package = "anthropic" if fmt == "anthropic" else "openai"  # the extra is named for it
    try:
        sdk = importlib.import_module(package)
    except ModuleNotFoundError:
        click.echo(
            f"error: fsm demo --format {fmt} needs the {package} package: "
            f"pip install 'fsm-toolcalls[{package}]'",
            err=True,
        )
        sys.exit(2)

    from fsm.agent import run_agent_loop
    from fsm.replay import EXAMPLES_DIR, ReplayServer, ReplayTurn, demo_script
    from fsm.store import ConversationStore
    from fsm.store.engine import normalize_url

    target = normalize_url(url)
    sqlite = target.get_backend_name() == "sqlite"
    out = _Output()
    conversation = _conversation_id()
    with (
        ReplayServer(
            [
                *demo_script(["6912", "408"], delay=delay, format=fmt),
                # the cut-off turn is a Chat Completions recording: run with --format chat only
                *(
                    [ReplayTurn(EXAMPLES_DIR / "cut_off_call.sse", delay=delay)]
                    if fmt == "chat"
                    else []
                ),
            ]
        ) as server,
        ConversationStore(url, auto_upgrade=True if sqlite else None) as store,
    ):
        api = {"chat": "", "responses": " (Responses API)", "anthropic": " (Messages API)"}[fmt]
        out.line(
            f"fsm demo: an agent loop with the {package} client{api} against {server.base_url}"
        )
        out.line(f"  store         {store.url}")
        out.line(f"  conversation  {conversation}")
        out.line("")
        out.line(f"user: {QUESTION}")
        client = (
            sdk.Anthropic(base_url=server.url, api_key="fsm-demo", max_retries=0)
            if fmt == "anthropic"
            else sdk.OpenAI(base_url=server.base_url, api_key="fsm-demo", max_retries=0)
        )
        try:
            result = run_agent_loop(
                client,
                store,
                conversation,
                {"add": add, "multiply": multiply},
                model=MODEL,
                messages=[{"role": "user", "content": QUESTION}],
                on_event=_Progress(out),
                format=fmt,
            )
            out.end_text()
            out.line("")
            cut_ok = fmt != "chat" or _cut_off_turn(out, client, store, f"{conversation}-cut")
        finally:
            client.close()
        out.end_text()
        out.line("")
        _print_history(out, store.history(conversation))
        out.line("")
        ok = _print_audit(out, store, conversation)
        requests, rejected = len(server.requests), len(server.failures)
        out.line(
            f"  server check  {requests} requests, {rejected} rejected"
            + "".join(f"\n    {f.message}" for f in server.failures)
        )
    out.line("")
    if result.status != "completed" or rejected or not ok or not cut_ok:
        out.line(f"demo FAILED ({result.status})")
        sys.exit(1)
    out.line(f"done: fsm history --db '{store.url}' {conversation}")
    out.line(f"see it all in the browser: fsm audit serve --db '{store.url}'")


def _cut_off_turn(out: _Output, client: Any, store: ConversationStore, conversation: str) -> bool:
    """The turn the model cuts off mid-call (``cut_off_call.sse``): the loop records it as an
    attempt and stops; the truncated call was never run. Whether it went so."""
    from fsm.agent import TurnFailedError, run_agent_loop

    out.line(f"conversation  {conversation}: a turn the model cuts off mid-call")
    out.line(f"user: {CUT_QUESTION}")

    def multiply_never(a: int, b: int) -> int:
        """Multiply two integers (never called: the call is cut)."""
        raise AssertionError("a truncated call must never run")

    try:
        run_agent_loop(
            client,
            store,
            conversation,
            {"multiply": multiply_never},
            model=MODEL,
            messages=[{"role": "user", "content": CUT_QUESTION}],
            on_event=_Progress(out),
        )
    except TurnFailedError as exc:
        out.end_text()
        calls = [c for a in store.attempts(conversation) for c in a["tool_calls"]]
        for call in calls:
            out.line(
                f"  {safe_text(call['name'])} was never run: its call is {call['state']} "
                f"({safe_text(str(call['reason']))}), arguments cut at "
                f"{safe_text(call['raw_arguments'])}"
            )
        return exc.reason == "length" and [c["state"] for c in calls] == ["truncated"]
    out.end_text()
    out.line("  the model was not cut off: expected a truncated call")
    return False


def _conversation_id() -> str:
    now = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"demo-{now}-{uuid.uuid4().hex[:6]}"


# -- output --------------------------------------------------------------------------------------
class _Output:
    """Lines and streamed text on stdout; symbols fall back to ASCII where they cannot print."""

    def __init__(self) -> None:
        encoding: str = getattr(sys.stdout, "encoding", None) or "ascii"
        self.encoding = encoding
        try:
            "\u2192\u2713\u00d7".encode(encoding)  # the arrow, the check mark, the times sign
            self.arrow, self.check = "\u2192", "\u2713"
        except (UnicodeEncodeError, LookupError):
            self.arrow, self.check = "->", "+"
        self._in_text = False

    def _safe(self, text: str) -> str:
        try:
            text.encode(self.encoding)
            return text
        except (UnicodeEncodeError, LookupError):
            return text.encode(self.encoding, "replace").decode(self.encoding, "replace")

    def text(self, chunk: str) -> None:
        """Streamed text, printed as it arrives (after an ``assistant:`` prefix)."""
        if not self._in_text:
            click.echo("  assistant: ", nl=False)
            self._in_text = True
        click.echo(self._safe(safe_text(chunk, newlines=True)), nl=False)

    def end_text(self) -> None:
        if self._in_text:
            click.echo("")
            self._in_text = False

    def line(self, text: str) -> None:
        """One line (or a few): any control character left in it is shown escaped."""
        self.end_text()
        click.echo(self._safe(safe_text(text, newlines=True)))


@dataclass
class _Progress:
    """The loop's ``on_event``: what is happening, as it happens."""

    out: _Output
    names: dict[int, str] = field(default_factory=dict)

    def __call__(self, event: AgentEvent) -> None:
        from fsm.agent import AttemptRecorded, RequestSent, ToolExecuted, TurnCommitted
        from fsm.events import ContentDelta, ToolCallOpened, ToolCallUpdated, TurnEnded

        out = self.out
        match event:
            case RequestSent(step=step, messages=n):
                self.names.clear()
                out.line(f"request {step}: {n} message{'s' if n != 1 else ''} sent, streaming...")
            case ContentDelta(text=text):
                out.text(text)
            case ToolCallOpened(ordinal=ordinal, name=name, id=call_id):
                self.names[ordinal] = name
                shown = safe_text(name) if name else "(name pending)"
                out.line(f"  {out.arrow} {shown}  {safe_text(call_id)}")
            case ToolCallUpdated(ordinal=ordinal, name=name) if name != self.names.get(ordinal):
                self.names[ordinal] = name
                out.line(f"  {out.arrow} {safe_text(name)}")
            case TurnEnded(choice=0, finish_reason=finish, complete=complete):
                state = "complete" if complete else "NOT complete"
                why = f"finish_reason {safe_text(finish)}" if finish else "no finish_reason"
                out.line(f"  turn {state} ({why})")
            case ToolExecuted(name=name, arguments=arguments, content=content, error=error):
                mark = "!" if error else out.check
                out.line(
                    f"  {mark} {safe_text(name)}({safe_text(arguments)}) = {_text_of(content)}"
                )
            case TurnCommitted(turn=turn):
                last = turn.seq + len(turn.messages) - 1
                where = f"seq {turn.seq}" if last == turn.seq else f"seq {turn.seq}-{last}"
                results = len(turn.messages) - 1
                out.line(
                    f"  committed at {where}: the assistant message"
                    + (f" and {results} tool results, in one transaction" if results else "")
                )
            case AttemptRecorded(attempt_ids=ids, reason=reason):
                shown = ", ".join(f"#{i}" for i in ids)
                label = (
                    f"attempt {shown} (store-wide id)"
                    if len(ids) == 1
                    else (f"attempts {shown} (store-wide ids)")
                )
                out.line(
                    f"  incomplete ({safe_text(str(reason))}): recorded as {label}, "
                    "nothing committed"
                )
            case _:
                pass


def _text_of(value: Any) -> str:
    """A content (text, or content parts as JSON) on one line, terminal-safe."""
    from fsm.cli.output import to_json

    if value is None:
        return ""
    return safe_text(value if isinstance(value, str) else to_json(value))


def _print_history(out: _Output, messages: Sequence[Mapping[str, Any]]) -> None:
    out.line(f"History ({len(messages)} messages, as the next request would send it):")
    for seq, message in enumerate(messages):
        role = message["role"]
        head = f"  {seq:>3}  {role:<9}  "
        if role == "tool":
            call_id = safe_text(str(message["tool_call_id"]))
            out.line(f"{head}{call_id}  {out.arrow} {_text_of(message['content'])}")
            continue
        out.line(f"{head}{_text_of(message.get('content'))}".rstrip())
        for call in message.get("tool_calls", []):
            function = call["function"]
            call_id, name = safe_text(str(call["id"])), safe_text(str(function["name"]))
            arguments = safe_text(str(function["arguments"]))
            out.line(f"{'':{len(head)}}{call_id}  {name}({arguments})")


# -- audit summary -------------------------------------------------------------------------------
def _print_audit(out: _Output, store: ConversationStore, conversation: str) -> bool:
    """Calls per tool, call states, tokens and the store's integrity (:mod:`fsm.store.audit`);
    whether this conversation is intact."""
    from fsm.store import audit

    stats = audit.stats(store.engine, conversation=conversation)
    violations = list(audit.check(store.engine))
    out.line("Audit (fsm.store.audit):")
    per_tool = ", ".join(f"{safe_text(t.name)} {t.calls}" for t in stats.tools if t.calls)
    per_tool = per_tool or "none"
    out.line(f"  calls/tool    {per_tool}")
    states: dict[str, int] = {}
    if stats.totals is not None and stats.totals.calls:
        states["finished"] = stats.totals.calls  # every call in history is finished
    for attempt in store.attempts(conversation):
        for call in attempt["tool_calls"]:
            key = f"{call['state']} (attempt)"
            states[key] = states.get(key, 0) + 1
    out.line("  call states   " + (", ".join(f"{k} {n}" for k, n in states.items()) or "none"))
    for model in stats.models:
        out.line(
            f"  model         {safe_text(model.model or '(none)')}: {model.turns} turns, "
            f"{model.incomplete} incomplete; tokens {model.prompt_tokens} in, "
            f"{model.completion_tokens} out"
        )
    mine = [v for v in violations if v.conversation_id == conversation]
    elsewhere = len(violations) - len(mine)
    if mine:
        out.line(f"  integrity     FAILED: {len(mine)} violations in this conversation")
        for violation in mine[:10]:
            seq = "-" if violation.seq is None else violation.seq
            out.line(f"    seq {seq}: {violation.kind}: {safe_text(violation.detail)}")
    else:
        out.line(
            "  integrity     ok: the contract re-checked over the whole store, no violation"
            if not elsewhere
            else f"  integrity     ok for this conversation ({elsewhere} violations elsewhere "
            "in the store)"
        )
    return not mine
