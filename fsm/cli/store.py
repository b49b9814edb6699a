"""Store commands: ``fsm db upgrade|current``, ``fsm ingest`` and ``fsm history``.

Thin wrappers over :mod:`fsm.store`; typed errors propagate to the ``fsm`` group, which prints
them as one line on stderr with a non-zero exit status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from fsm.cli import options
from fsm.exitstatus import EXIT_INTERRUPTED, EXIT_UNUSABLE

__all__ = ["db", "history", "ingest"]

db_option = options.db_option()

#: ``--schema NAME`` of the ``db`` commands (``$FSM_SCHEMA`` by default, as for the library).
schema_option = click.option(
    "--schema",
    metavar="NAME",
    envvar="FSM_SCHEMA",
    default=None,
    help="PostgreSQL schema of fsm's tables (created if missing) [env: FSM_SCHEMA].",
)


@click.group(name="db")
def db() -> None:
    """Create, upgrade and inspect the store's schema.

    \b
    Examples:
      fsm db upgrade                                  # the default ./fsm.db
      fsm db upgrade --db postgresql+psycopg://app@db.internal/app
      fsm db current --db sqlite:///chat.db
    """


@db.command(name="upgrade")
@db_option
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@schema_option
@click.option(
    "--partitions",
    type=click.IntRange(2, 1024),
    metavar="N",
    default=None,
    help="PostgreSQL: create the database with every table hash-partitioned by conversation "
    "into N partitions (2-1024; a new database only).",
)
@click.option(
    "--sql",
    "show_sql",
    is_flag=True,
    help="Print the SQL the upgrade would run on this database (from its revision), for a DBA "
    "to review, and change nothing (it runs in a transaction that is rolled back).",
)
def db_upgrade(
    url: str | None, revision: str, schema: str | None, partitions: int | None, show_sql: bool
) -> None:
    """Upgrade the database schema (creating it if needed) to REVISION.

    The same as `alembic -x db=URL upgrade head` from a checkout. fsm keeps its revision in
    its own table (fsm_alembic_version), so it can share a database with an application's
    own Alembic history.

    \b
    Examples:
      fsm db upgrade --db sqlite:///chat.db
      FSM_DB_URL=postgresql+psycopg://app@localhost/app fsm db upgrade
      fsm db upgrade --db postgresql+psycopg://app@localhost/app --schema fsm
      fsm db upgrade --db postgresql+psycopg://app@localhost/new --partitions 16
      fsm db upgrade --db postgresql+psycopg://app@localhost/app --sql > review.sql

    A database whose tables already use fsm's names (a host's own messages table) is refused
    (exit 2), nothing changed.
    """
    from fsm.store.engine import display_url, new_sqlite_file, normalize_url, removed_if_failed
    from fsm.store.migrate import (
        check_partitions,
        check_revision,
        current_revision,
        upgrade_statements,
    )

    target = normalize_url(url)
    check_revision(revision)
    check_partitions(partitions, target)
    if show_sql:
        if partitions is not None:
            raise click.UsageError("--sql shows an upgrade; it does not go with --partitions")
        new = new_sqlite_file(target) is not None
        statements = upgrade_statements(target, revision, schema=schema)
        before = None if new else current_revision(target, schema=schema)
        click.echo(
            f"-- fsm db upgrade --sql: {display_url(target)} from "
            f"{before or 'an empty database'} to {revision}; rolled back, nothing changed"
        )
        for statement in statements:
            click.echo(statement)
        return
    with removed_if_failed(target):
        _upgrade(target, revision, schema, partitions)


def _upgrade(target: Any, revision: str, schema: str | None, partitions: int | None) -> None:
    from fsm.store.engine import display_url
    from fsm.store.migrate import current_revision, upgrade

    before = current_revision(target, schema=schema)
    upgrade(target, revision, schema=schema, partitions=partitions)
    after = current_revision(target, schema=schema)
    where = display_url(target)
    if before == after:
        click.echo(f"{where}: already at revision {after}")
    else:
        click.echo(f"{where}: upgraded from {before or 'an empty database'} to revision {after}")


@db.command(name="current")
@db_option
@schema_option
def db_current(url: str | None, schema: str | None) -> None:
    """Show the database's schema revision; exit status 1 if it is not the one fsm needs.

    \b
    Examples:
      fsm db current --db sqlite:///chat.db
      fsm db current --db postgresql+psycopg://app@localhost/app || fsm db upgrade --db ...
    """
    from fsm.store.engine import display_url, normalize_url
    from fsm.store.migrate import current_revision, head_revision

    target = normalize_url(url)
    current = current_revision(target, schema=schema)
    head = head_revision()
    where = display_url(target)
    if current == head:
        click.echo(f"{where}: {current} (head)")
        return
    click.echo(
        f"{where}: {current or 'no fsm schema'} (fsm needs {head}; "
        f"run: fsm db upgrade --db '{where}')"
    )
    sys.exit(1)


def _load_results(path: str | None) -> Any:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise click.BadParameter(
            f"{path} is not valid JSON: {exc}", param_hint="--results"
        ) from exc


@click.command(name="ingest")
@db_option
@click.option(
    "--conversation",
    "conversation_id",
    required=True,
    metavar="ID",
    help="Conversation to add the turn to (created if it does not exist).",
)
@click.argument("file", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option(
    "--results",
    "results_path",
    type=click.Path(exists=True, dir_okay=False),
    metavar="RESULTS.json",
    help='The tool results: a JSON list in call order (strings or {"content": ...} objects), '
    "or an object keyed by call id.",
)
@click.option(
    "--choice",
    type=options.whole_number(),
    default=None,
    help="Choice to commit when the stream has several.",
)
@click.option("--idempotency-key", default=None, help="Commit at most once under this key.")
@click.option(
    "--expected-seq",
    type=options.whole_number(),
    default=None,
    help="Fail if the turn would not land at this seq.",
)
@click.option("--repair-json", is_flag=True, help="Parse with opt-in append-only JSON repair.")
def ingest(
    url: str | None,
    conversation_id: str,
    file: str,
    results_path: str | None,
    choice: int | None,
    idempotency_key: str | None,
    expected_seq: int | None,
    repair_json: bool,
) -> None:
    """Parse a recorded stream FILE (SSE text or JSON lines of chunks; '-' for stdin), or one
    whole non-streamed response (a chat.completion, a Responses 'response', an Anthropic
    'message'), and commit its turn, with the tool results, to a conversation.

    A turn that is not complete (a call truncated or aborted, a stream cut short) goes to the
    conversation's attempts instead, never to history, and the exit status is 1. Committing the
    same response again writes nothing (idempotent). A new or empty SQLite file gets the schema
    first. Input that is not a stream exits 2 with nothing written; Ctrl-C while reading stdin
    records what arrived as an attempt and exits 130; store errors have their own statuses
    (fsm --help).

    \b
    Examples:
      fsm ingest --db sqlite:///chat.db --conversation c1 response.sse --results results.json
      echo '["18 C, sunny"]' > r.json && fsm ingest --conversation c1 weather.sse --results r.json
    """
    from fsm.cli.parse import not_a_stream, parse_input, read_input
    from fsm.parser import Turn
    from fsm.store import ConversationStore
    from fsm.store.engine import normalize_url

    normalize_url(url)  # a --db that is no URL or path is told before anything is read
    results = _load_results(results_path)
    data, interrupted = read_input(file)
    parsed, completion = parse_input(data, interrupted=interrupted, repair_json=repair_json)
    if interrupted:
        _record_interrupted(url, conversation_id, parsed, choice, len(data))
    if completion is not None:
        click.echo(
            f"a non-streamed {completion} (not a stream): parsed by the same rules", err=True
        )
    why = None if completion else not_a_stream(parsed)
    if why is not None:
        name = "stdin" if file == "-" else file
        click.echo(f"error: {name} is not a stream: {why}; nothing written", err=True)
        sys.exit(EXIT_UNUSABLE)
    if choice is None and len(parsed.turns) > 1:
        raise click.UsageError(
            f"the stream has {len(parsed.turns)} choices "
            f"({', '.join(str(t.index) for t in parsed.turns)}): pick one with --choice"
        )
    turn: Turn | None
    if choice is not None:
        try:
            turn = parsed.turn(choice)
        except KeyError as exc:
            raise click.BadParameter(exc.args[0], param_hint="--choice") from None
    else:
        turn = parsed.turns[0] if parsed.turns else None
    with ConversationStore(url) as store:
        store.create_conversation(conversation_id, exist_ok=True)
        if turn is None or not turn.complete:
            # the whole response when it is this one choice (it keeps how the stream ended)
            ids = (
                store.record_attempt(conversation_id, parsed)
                if turn is None or len(parsed.turns) == 1
                else store.record_attempt(conversation_id, turn, anomalies=parsed.anomalies)
            )
            click.echo(
                f"the turn is not complete ({_why(parsed, turn)}): nothing added to history; "
                f"recorded as {_attempt_ids(ids)} of conversation {conversation_id!r}",
                err=True,
            )
            sys.exit(1)
        committed = store.commit_turn(
            conversation_id,
            turn,
            results,
            expected_seq=expected_seq,
            idempotency_key=idempotency_key,
        )
    n = len(committed.messages) - 1
    if committed.created:
        click.echo(
            f"committed choice {turn.index} to conversation {conversation_id!r} at seq "
            f"{committed.seq}: 1 assistant message, {n} tool result(s)"
        )
    else:
        click.echo(
            f"already stored at seq {committed.seq} of conversation {conversation_id!r}: "
            "nothing written"
        )


def _record_interrupted(
    url: str | None, conversation_id: str, parsed: Any, choice: int | None, size: int
) -> None:
    """Ctrl-C while reading stdin: record what arrived as an attempt (all its choices, or the
    one of ``--choice``), say so, and exit 130."""
    from fsm.cli.parse import INTERRUPTED
    from fsm.store import ConversationStore

    if parsed.event_count == 0:
        click.echo(f"error: {INTERRUPTED} before any event arrived: nothing recorded", err=True)
        sys.exit(EXIT_INTERRUPTED)
    chosen = [t for t in parsed.turns if t.index == choice]
    with ConversationStore(url) as store:
        store.create_conversation(conversation_id, exist_ok=True)
        ids = (
            store.record_attempt(conversation_id, chosen[0], anomalies=parsed.anomalies)
            if chosen
            else store.record_attempt(conversation_id, parsed)
        )
    click.echo(
        f"error: {INTERRUPTED} while reading stdin ({size} bytes arrived): nothing added to "
        f"history; recorded as {_attempt_ids(ids)} of conversation {conversation_id!r}",
        err=True,
    )
    sys.exit(EXIT_INTERRUPTED)


def _attempt_ids(ids: list[int]) -> str:
    """Attempt ids as people should read them: numbered across the whole store, not per
    conversation (``attempt #12 (store-wide id)``)."""
    shown = ", ".join(f"#{i}" for i in ids)
    if len(ids) == 1:
        return f"attempt {shown} (store-wide id)"
    return f"attempts {shown} (store-wide ids)"


def _why(parsed: Any, turn: Any) -> str:
    """Why a turn is not complete, in words (provider text shown terminal-safe)."""
    from fsm.cli.output import safe_text

    if turn is None:
        how = parsed.end_how or "early"
        reason = f" ({parsed.end_reason})" if parsed.end_reason else ""
        return safe_text(f"no choice in the stream; it ended {how}{reason}")
    bad = [
        f"{call.name or 'a call without name'} {call.state.value}"
        + (f" ({call.reason})" if call.reason else "")
        for call in turn.unfinished_calls
    ]
    if bad:
        return safe_text(", ".join(bad))
    finish = f"finish_reason {turn.finish_reason}" if turn.finish_reason else "no finish_reason"
    ended = f"stream ended {turn.end_reason}" if turn.end_reason else "stream not ended"
    reason = turn.incomplete_reason
    why = f"; {reason}" if reason and reason != turn.finish_reason else ""
    return safe_text(f"{finish}, {ended}{why}")


def _preview(value: Any, limit: int = 120) -> str:
    """A message text (or content parts, as JSON) on one line, terminal-safe, cut to ``limit``."""
    from fsm.cli.output import safe_text

    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = safe_text(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _not_found(error: Any, url: str | None) -> Any:
    """The store's not-found error (the same object: its type and exit status), worded for the
    command line: where it looked, and the command that lists what is there."""
    from fsm.store.engine import display_url, normalize_url

    where = display_url(normalize_url(url))
    error.args = (
        f"no conversation {error.conversation_id!r} in {where}; list them with: "
        f"fsm conversations --db '{where}'",
    )
    return error


@click.command(name="history")
@db_option
@click.argument("conversation_id", metavar="ID")
@options.json_document_option("Print the OpenAI messages list as JSON.")
@click.option(
    "--last",
    type=options.whole_number(),
    default=None,
    help="Only the last N messages, or more to keep a tool block whole (a window that would "
    "start inside one starts at its assistant message).",
)
@click.option(
    "--include-reasoning", is_flag=True, help="Add reasoning_content to assistant messages."
)
@click.option(
    "--mermaid",
    is_flag=True,
    help="Print a mermaid sequenceDiagram (user, assistant and each tool as participants).",
)
def history(
    url: str | None,
    conversation_id: str,
    as_json: bool,
    last: int | None,
    include_reasoning: bool,
    mermaid: bool,
) -> None:
    """Print a conversation's history, ready to send back to the model.

    \b
    Examples:
      fsm history --db sqlite:///chat.db c1
      fsm history --db sqlite:///chat.db c1 --json --last 20 > messages.json
      fsm history --db sqlite:///chat.db c1 --mermaid > c1.mmd
    """
    from fsm.store import ConversationStore
    from fsm.store.engine import normalize_url, require_existing
    from fsm.store.errors import ConversationNotFoundError

    if as_json and mermaid:
        raise click.UsageError("choose --json or --mermaid, not both")
    require_existing(normalize_url(url), "fsm history")
    with ConversationStore(url) as store:
        try:
            messages: list[Any] = store.history(
                conversation_id, last=last, include_reasoning=include_reasoning
            )
            first = store.next_seq(conversation_id) - len(messages)
        except ConversationNotFoundError as exc:
            raise _not_found(exc, url) from None
    if mermaid:
        from fsm.cli.output import mermaid_sequence

        click.echo(mermaid_sequence(messages), nl=False)
        return
    if as_json:
        click.echo(json.dumps(messages, ensure_ascii=False, indent=2))
        return
    _print_messages(messages, first)


#: where a message's text starts in ``fsm history``: after the seq (5) and the role (9).
_TEXT_COLUMN = 5 + 2 + 9 + 2


def _print_messages(messages: list[dict[str, Any]], first: int) -> None:
    """The messages as text for people: one line per message (seq, role, its text), a line
    per tool call under its assistant message (indented to the text's column), each result
    with the id of the call it answers. Provider text is shown terminal-safe."""
    from fsm.cli.output import safe_text

    for offset, message in enumerate(messages):
        role = safe_text(str(message["role"]))
        head = f"{first + offset:>5}  {role:<9}  "
        if message["role"] == "tool":
            call_id = safe_text(str(message.get("tool_call_id", "")))
            click.echo(f"{head}{_preview(message['content'])}  (result of {call_id})")
            continue
        if message["role"] == "function":  # the result of a legacy function_call
            name = safe_text(str(message.get("name", "")))
            click.echo(f"{head}{_preview(message['content'])}  (result of function {name})")
            continue
        legacy = message.get("function_call")
        if message.get("content") is not None:
            click.echo(f"{head}{_preview(message['content'])}".rstrip())
        elif message.get("refusal") is not None:
            click.echo(f"{head}(refusal) {_preview(message['refusal'])}")
        elif message.get("tool_calls") or legacy:
            click.echo(f"{head}(no text)")
        else:
            click.echo(f"{head}(empty)")
        for call in message.get("tool_calls", []):
            function = call["function"]
            name = safe_text(str(function["name"]))
            arguments = _preview(function["arguments"], 80)
            call_id = safe_text(str(call["id"]))
            click.echo(f"{'':{_TEXT_COLUMN}}-> {name}({arguments})  id {call_id}")
        if legacy:
            name = safe_text(str(legacy["name"]))
            arguments = _preview(legacy["arguments"], 80)
            click.echo(f"{'':{_TEXT_COLUMN}}-> {name}({arguments})  (legacy function_call)")
