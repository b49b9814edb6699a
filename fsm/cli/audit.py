"""``fsm audit calls|failures|stats|check``: read-only queries over the store.

Thin wrappers over :mod:`fsm.store.audit`: each command opens the store read-only (a SQLite
file through a ``mode=ro`` URI, never created; PostgreSQL transactions ``READ ONLY``), runs one
function and prints its rows with the shared output options of :mod:`fsm.cli.output` (a table by
default; ``--json``, ``--nl``, ``--csv``, ``--tsv`` for scripts). Errors are typed and print as one line (the ``fsm`` group handles them).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import click

from fsm.cli.options import (
    FAILED_STATES,
    STATES,
    GeneratedHelpCommand,
    Page,
    count_option,
    filter_options,
    output_options,
    paging_options,
    read_db_options,
)
from fsm.cli.output import OutputFormat, columns_of, emit, escape_surrogates, json_default
from fsm.cli.readonly import read_only_store

__all__ = ["audit"]


read_only_db = read_db_options("Opened read-only.")


def _show_page(rows: Iterable[Any], row_type: type, output: OutputFormat, page: Page) -> None:
    """Emit rows that carry a keyset ``key``; on a full page shown as a table, say how to get
    the next one."""
    last: list[Any] = [None]

    def dicts() -> Iterator[dict[str, Any]]:
        for row in rows:
            last[0] = row.key
            yield row.as_dict()

    shown = emit(dicts(), output, columns=columns_of(row_type))
    page.more(output, shown, last[0])


def _arg_filter(text: str) -> tuple[str, Any]:
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise click.BadParameter(f"{text!r} is not PATH=VALUE", param_hint="--arg")
    try:
        value = json.loads(raw, parse_constant=_not_json)
    except ValueError:
        value = raw  # not a JSON scalar (NaN and Infinity are not JSON either): text
    if isinstance(value, dict | list):
        value = raw  # an object or array literal is matched as the text it is
    return path.strip(), value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _kinds() -> str:
    """The violation kinds of :func:`fsm.store.audit.check`, for ``fsm audit check --help``."""
    import textwrap

    from fsm.store.audit import VIOLATION_KINDS

    return textwrap.fill(" ".join(VIOLATION_KINDS), width=80)


def _token_max() -> str:
    """The largest token count ``fsm audit stats`` adds up, for its ``--help``."""
    from fsm.store.audit import TOKEN_MAX

    return f"{TOKEN_MAX:,}"


# -- the group --------------------------------------------------------------------------------
@click.group(name="audit")
def audit() -> None:
    """Read-only queries over the store, and an integrity check.

    Every command opens the database read-only (a SQLite file is never created) and prints
    an aligned table, whether or not stdout is a terminal, so what you see is what a pipe gets;
    scripts ask for --json (one array), --nl (JSON lines), --csv or --tsv, which print the
    same rows exactly (nothing cut or escaped) and stream them.

    \b
    Examples:
      fsm audit calls --db sqlite:///chat.db --tool get_weather --arg city=Paris
      fsm audit failures --counts
      fsm audit stats --by model --json
      fsm audit check --db postgresql+psycopg://app@db/app || echo "history is broken"
    """


@audit.command(name="calls")
@read_only_db
@filter_options(
    tool=True,
    states=STATES,
    state_help="Only calls in this state (history holds finished calls; the others are in "
    "attempts).",
)
@click.option(
    "--arg",
    "args",
    multiple=True,
    metavar="PATH=VALUE",
    help="The arguments hold VALUE at the JSON path PATH (city, user.id, items[0].sku, "
    '$."odd.key"). VALUE is read as JSON when it is a JSON scalar (3, true, null, "3"), else as '
    "text. Repeat for several; only finished calls match.",
)
@click.option(
    "--args-contains", metavar="TEXT", help="The raw arguments contain TEXT (case-sensitive)."
)
@click.option(
    "--format",
    "stream_format",
    type=click.Choice(["chat", "responses", "anthropic"]),
    help="Only calls of streams of this API (Chat Completions, Responses, Anthropic Messages).",
)
@click.option(
    "--source",
    type=click.Choice(["all", "history", "attempts"]),
    default="all",
    show_default=True,
    help="Calls of history, of recorded attempts, or both.",
)
@paging_options
@output_options
def calls(
    url: str | None,
    filters: dict[str, Any],
    args: tuple[str, ...],
    args_contains: str | None,
    stream_format: str | None,
    source: str,
    page: Page,
    output: OutputFormat,
) -> None:
    """List tool calls, with their arguments and results.

    Rows come in key order: by conversation, then seq (a call of an attempt comes before the
    turn committed at the same seq), then position. A call of history shows its result (the
    tool message); a call of an attempt shows its attempt and why it failed. A call run through
    the tool ledger shows its execution: its state (execution: not_started, started,
    succeeded, failed; empty for a call that never went through the ledger), duration_ms
    (finished minus started) and starts (how many times it was started). Every call shows the
    format of the stream it came from (chat, responses, anthropic).

    \b
    Examples:
      fsm audit calls --db sqlite:///chat.db --tool get_weather --since 2026-11-01
      fsm audit calls --arg city=Paris --arg units=metric --model gpt-4o
      fsm audit calls --state truncated --nl | jq .reason
      fsm audit calls --format anthropic --tool get_weather
      fsm audit calls --conversation c1 --limit 0 --csv > c1-calls.csv
    """
    from fsm.store import audit as audit_api

    arg_filters = [_arg_filter(a) for a in args]
    page = page.for_output(output)
    # a CallKey: conversation, seq, rank, attempt, position
    paging = page.query(key_size=5, check=audit_api.call_key)
    with read_only_store(url) as engine:
        rows = audit_api.tool_calls(
            engine,
            **filters,
            args=arg_filters,
            args_contains=args_contains,
            format=stream_format,
            source=source,  # type: ignore[arg-type]
            **paging,
        )
        _show_page(rows, audit_api.CallRow, output, page)


@audit.command(name="failures")
@read_only_db
@filter_options(tool=True, states=FAILED_STATES, reason=True)
@click.option(
    "--counts",
    is_flag=True,
    help="Count failed calls and attempts by model, state and reason instead of listing them "
    "(attempts without a failed call have state empty and calls 0).",
)
@paging_options
@output_options
def failures(
    url: str | None, filters: dict[str, Any], counts: bool, page: Page, output: OutputFormat
) -> None:
    """List the failed turns of recorded attempts: each truncated or aborted call, with its
    reason and the attempt's anomalies, and each attempt without such a call as one row whose
    call columns are empty (a provider's error event, a text turn cut by length, a stream cut
    before any call; its reason is the attempt's).

    An attempt is a turn that could not go to history (cut by max_tokens, a dropped stream, a
    content filter, a server error, invalid JSON). Rows come oldest attempt first. --tool,
    --state and --reason select calls: with any of them, only failed calls are listed.

    \b
    Examples:
      fsm audit failures --db sqlite:///chat.db --since 2026-11-29
      fsm audit failures --counts                      # by model, state and reason
      fsm audit failures --model gpt-4o --reason length --json
    """
    from fsm.store import audit as audit_api

    if counts and (page.limit_given or page.offset or page.after is not None):
        raise click.UsageError(
            "--counts prints every group: --limit, --offset and --after page the listing only"
        )
    with read_only_store(url) as engine:
        if counts:
            emit(
                (c.as_dict() for c in audit_api.failure_counts(engine, **filters)),
                output,
                columns=columns_of(audit_api.FailureCount),
            )
            return
        page = page.for_output(output)
        # a failure's key: attempt, position
        paging = page.query(key_size=2, check=audit_api.failure_key)
        rows = audit_api.failures(engine, **filters, **paging)
        _show_page(rows, audit_api.FailureRow, output, page)


@audit.command(name="pending")
@read_only_db
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(["pending", "committed", "abandoned"]),
    help="Ledger states to list (repeatable; default: pending and abandoned).",
)
@click.option("--conversation", default=None, help="Only this conversation's turns.")
@output_options
def pending(
    url: str | None, states: tuple[str, ...], conversation: str | None, output: OutputFormat
) -> None:
    """List the tool ledger's turns: pending ones (their tools ran or are running, or a
    process crashed while they ran) and abandoned ones, oldest first, with their age in
    seconds and their calls' executions (how many not started, started with no outcome,
    succeeded, failed; the total of starts: more than the calls when a call ran again), the
    end of the owner's lease (lease_expires_at, the database's clock) and, for a pending turn,
    whether its owner is alive (the lease holds: its tools may be running) or gone (the next
    run resumes it).

    A pending turn blocks other writes to its conversation until the agent loop (ledger=True)
    resumes it, or it is abandoned. A started call with no outcome may have run: the loop runs
    it again only if its tool is declared idempotent.

    \b
    Examples:
      fsm audit pending --db sqlite:///chat.db
      fsm audit pending --state abandoned --json
    """
    from fsm.store import audit as audit_api

    with read_only_store(url) as engine:
        rows = audit_api.pending_turns(
            engine, states=states or ("pending", "abandoned"), conversation=conversation
        )
        emit((r.as_dict() for r in rows), output, columns=columns_of(audit_api.PendingRow))


@audit.command(name="stats", cls=GeneratedHelpCommand, parts={"token_max": _token_max})
@read_only_db
@filter_options()
@click.option(
    "--by",
    type=click.Choice(["tool", "model", "day"]),
    help="One breakdown only (needed for --nl, --csv and --tsv). Default: all three, and totals.",
)
@output_options
def stats(url: str | None, filters: dict[str, Any], by: str | None, output: OutputFormat) -> None:
    """Usage statistics: calls per tool, turns, calls, tokens and incomplete share per model,
    and per day.

    The incomplete share of a model is incomplete attempts / (committed turns + incomplete
    attempts): how often a turn it streamed could not go to history. Tokens come from the
    usage of the assistant messages (a count that is not an integer from 0 to {token_max} is left
    out; a note on stderr says how many messages have a usage that is not a JSON object at
    all); days are UTC.

    \b
    Examples:
      fsm audit stats --db sqlite:///chat.db
      fsm audit stats --by model --since 2026-11-01 --csv > models.csv
      fsm audit stats --json | jq '.models[] | {model, incomplete_share}'
    """
    from fsm.store import audit as audit_api

    if by is None and output.kind in ("nl", "csv", "tsv"):
        raise click.UsageError(f"--{output.kind} prints one table: choose it with --by")
    if by is None and output.columns is not None:
        raise click.UsageError("--columns picks the columns of one table: choose it with --by")
    with read_only_store(url) as engine:
        result = audit_api.stats(engine, **filters)
    sections: dict[str, tuple[str, list[dict[str, Any]], tuple[str, ...]]] = {
        key: (title, [row.as_dict() for row in rows], columns_of(row_type))
        for key, title, rows, row_type in (
            ("tool", "tools", result.tools, audit_api.ToolStat),
            ("model", "models", result.models, audit_api.ModelStat),
            ("day", "days", result.days, audit_api.DayStat),
        )
    }
    if result.unreadable_usage:
        click.echo(
            f"note: {result.unreadable_usage} assistant message(s) have a usage that is not a "
            "JSON object (malformed, Infinity, an array): their tokens are not counted",
            err=True,
        )
    if by is not None:
        _, rows, columns = sections[by]
        emit(rows, output, columns=columns)
        return
    totals = result.totals.as_dict() if result.totals is not None else {}
    totals.pop("model", None)
    if output.kind == "json":
        totals["unreadable_usage"] = result.unreadable_usage
        document: dict[str, Any] = {title: rows for title, rows, _ in sections.values()}
        document["totals"] = totals
        text = json.dumps(document, ensure_ascii=False, indent=2, default=json_default)
        click.echo(escape_surrogates(text))
        return
    for title, rows, columns in sections.values():
        click.echo(f"{title}:")
        emit(rows, output, columns=columns)
        click.echo()
    click.echo("totals:")
    emit([totals], output, columns=[c for c in columns_of(audit_api.ModelStat) if c != "model"])


@audit.command(name="check", cls=GeneratedHelpCommand, parts={"kinds": _kinds})
@read_only_db
@click.option(
    "--progress/--no-progress",
    default=None,
    help="A progress bar on stderr (default: on a terminal, for stores of several batches).",
)
@count_option("--batch-size", default=10_000, minimum=1, help="Conversations checked per batch.")
@click.option(
    "--deep",
    is_flag=True,
    help="The engine's full check: SQLite integrity_check instead of quick_check (also every "
    "index against its table), PostgreSQL amcheck with heapallindexed.",
)
@output_options
def check(
    url: str | None, progress: bool | None, batch_size: int, deep: bool, output: OutputFormat
) -> None:
    """Check that the whole store satisfies the history contract; exit 1 on any violation.

    First the database engine's own integrity: SQLite PRAGMA quick_check (--deep:
    integrity_check), PostgreSQL amcheck's bt_index_check over fsm's indexes when the amcheck
    extension is installed (a note on stderr says when it is not). Damage found there is one
    violation per problem, exit 7, and the contract is then not checked.

    Like fsck: re-verifies every conversation (dense seq from 0; each assistant message with N
    calls followed by exactly its N results in call order, nothing in between; each result's
    tool_call_id equal to its call's id; only finished calls, with a name and blank or valid
    JSON arguments; content where the format needs it; the columns the database enforces the
    contract with) and every key, foreign key, check and column type of the schema, so that
    rows written with the database's enforcement off (SQLite PRAGMA foreign_keys=OFF or
    ignore_check_constraints=ON, PostgreSQL session_replication_role = replica, constraints
    dropped or NOT VALID) are found, and so is a schema that lost part of its enforcement
    (unenforced). Prints one row (one line) per violation: conversation, seq,
    kind, detail. A summary goes to stderr. Exit status: 0 clean, 1 violations found (whatever
    the database holds), 7 the engine finds the database damaged, else the status of why the
    store cannot be read (2 a bad --db, 3 no such database or no fsm schema, 4 the server
    cannot be reached; see fsm --help).

    \b
    Kinds:
      {kinds}

    \b
    Examples:
      fsm audit check --db sqlite:///chat.db
      fsm audit check --db postgresql+psycopg://app@db/app --nl > violations.jsonl
      fsm audit check --no-progress && echo clean
    """
    import time

    from fsm.errors import FsmError
    from fsm.exitstatus import EXIT_CORRUPT, EXIT_INCOMPLETE
    from fsm.store import audit as audit_api

    bar: list[Any] = []
    stderr = sys.stderr

    def on_progress(done: int, total: int) -> None:
        if not bar:
            show = progress if progress is not None else stderr.isatty() and total > batch_size
            if not show:
                bar.append(None)
                return
            bar.append(click.progressbar(length=total, label="checking conversations", file=stderr))
            bar[0].__enter__()
        if bar[0] is not None:
            bar[0].update(done - bar[0].pos)

    counts: dict[str, int] = {}
    started = time.perf_counter()
    try:
        with read_only_store(url) as engine:

            def dicts() -> Iterator[dict[str, Any]]:
                for violation in audit_api.check(
                    engine,
                    progress=on_progress,
                    batch_size=batch_size,
                    deep=deep,
                    note=lambda text: click.echo(f"note: {text}", err=True),
                ):
                    counts[violation.kind] = counts.get(violation.kind, 0) + 1
                    yield violation.as_dict()

            try:
                emit(dicts(), output, columns=columns_of(audit_api.Violation), empty_table=False)
            finally:
                if bar and bar[0] is not None:
                    bar[0].__exit__(None, None, None)
            if "corrupt" not in counts:
                _note_pending(engine)
    except FsmError as exc:
        # the store could not be checked: not "violations found" (1), so scripts can tell
        click.echo(f"error: {' '.join(str(exc).split())}", err=True)
        sys.exit(exc.exit_code)
    seconds = time.perf_counter() - started
    found = sum(counts.values())
    if found:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        click.echo(f"{found} violation(s) in {seconds:.1f} s: {kinds}", err=True)
        sys.exit(EXIT_CORRUPT if "corrupt" in counts else EXIT_INCOMPLETE)
    click.echo(f"no violations ({seconds:.1f} s)", err=True)


def _note_pending(engine: Any) -> None:
    """A note on stderr about the tool ledger's pending turns (not violations): how many have
    a live owner, how many an owner that is gone (they block their conversation until resumed
    or abandoned)."""
    from fsm.store import audit as audit_api

    try:
        rows = audit_api.pending_turns(engine, states=("pending",))
    except Exception:  # a store older than the ledger (0005): nothing to say
        return
    gone = sum(1 for r in rows if r.owner == "gone")
    if rows:
        click.echo(
            f"note: {len(rows)} pending turn(s) in the tool ledger: {len(rows) - gone} with a "
            f"live owner (lease held), {gone} whose owner is gone (the next run resumes it, or "
            "abandon it; see fsm audit pending)",
            err=True,
        )


@audit.command(name="serve")
@read_only_db
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The address to listen on. Any address but loopback needs a token (one is generated "
    "when --token is not given).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8765,
    show_default=True,
    help="The port to listen on (0: any free port).",
)
@click.option(
    "--token",
    default=None,
    envvar="FSM_AUDIT_TOKEN",
    help="Require this token on every request (the printed URL carries it; 401 without it). "
    "Also read from FSM_AUDIT_TOKEN.",
)
@click.option("--quiet", is_flag=True, help="Do not log each request on stderr.")
def serve(url: str | None, host: str, port: int, token: str | None, quiet: bool) -> None:
    """Browse the store's history in a web browser: conversations, each one's timeline (tool
    calls with their results and states, failed attempts in place), calls, failures, stats with
    charts, and the integrity check. Every page has a JSON twin (?format=json).

    The store is opened read-only and no page writes; only GET and HEAD are answered. Pages hold
    no script; every stored value is shown escaped. The first line of stdout is the URL; it
    serves until Ctrl-C (exit status 130). Needs nothing beyond fsm itself: no extra, the viewer
    runs on the standard library.

    \b
    Examples:
      fsm audit serve --db sqlite:///chat.db
      fsm audit serve --db postgresql+psycopg://app@db/app --port 9000
      fsm audit serve --host 0.0.0.0 --token "$(openssl rand -hex 16)"
    """
    from fsm.exitstatus import EXIT_INTERRUPTED
    from fsm.store import audit as audit_api
    from fsm.store.engine import display_url, normalize_url
    from fsm.web import serve as start

    if token is not None and not token.strip():
        raise click.BadParameter("the token must not be empty", param_hint="--token")
    engine = audit_api.open_readonly(url)
    try:
        try:
            serving = start(
                engine,
                label=display_url(normalize_url(url)),
                host=host,
                port=port,
                token=token,
                log=None if quiet else lambda line: click.echo(line, err=True),
            )
        except OSError as exc:
            raise click.UsageError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        click.echo(serving.url)
        click.echo("serving the store read-only; Ctrl-C stops", err=True)
        try:
            serving.serve_forever()
        except KeyboardInterrupt:
            click.echo("stopped", err=True)
            sys.exit(EXIT_INTERRUPTED)
        finally:
            serving.server.server_close()
    finally:
        engine.dispose()
