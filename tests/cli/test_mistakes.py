"""The mistake catalog (issue 12): what a new user gets wrong, and the one line each one gets.

Every entry of :data:`CATALOG` is run as a real ``fsm`` process (``python -m fsm ...``, the
checkout on ``PYTHONPATH``), on each engine where a store is involved: the exit status, the exact
first line of stderr (of stdout for a mistake the command now simply accepts) and the absence of
a traceback or an "internal error" are asserted. Ctrl-C is sent as a real SIGINT, to processes
whose stdin pipe is still open. The Python API's own mistakes (the store constructors given a
path, a bad URL, a missing driver) follow.

``FSM_MISTAKES_TABLE=PATH pytest tests/cli/test_mistakes.py`` also writes the catalog as a Markdown
table (mistake | message (first line) | exit status) to ``PATH``, from the runs themselves.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import importlib
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore, DatabaseUrlError, SchemaNotAtHeadError
from fsm.store.aio import AsyncConversationStore
from fsm.store.engine import display_url
from fsm.store.migrate import current_revision, head_revision, upgrade
from tests.helpers import CORPUS, REPO, repo_env, require_corpus
from tests.helpers.store import empty_database, postgres_server

PARALLEL = "openai/openai-gpt-4o_parallel_two_calls.sse"
TRUNCATED = "openai-python/finish_length_max_tokens_1__gpt-4o-2024-08-06__4cc50a6135d2.sse"
HEAD = head_revision()
BIG = str(10**20)
TIMEOUT = 60.0
#: runs ``fsm`` with the psycopg module hidden, as after ``pip install 'fsm-toolcalls[openai]'`` alone
NO_PSYCOPG = (
    "import sys; sys.modules['psycopg'] = None; from fsm.cli.main import main; main(sys.argv[1:])"
)


# -- what a run sees -----------------------------------------------------------------------------
@dataclass
class Ctx:
    """The files and URLs one mistake is run with (``{name}`` in its arguments and message)."""

    tmp: Path
    engine: str
    db: str  # a store at head, with no data
    empty: str  # a database with no tables at all
    values: dict[str, str] = field(default_factory=dict)

    def format(self, text: str) -> str:
        return text.format(**self.values)


def make_ctx(tmp: Path, engine: str, db: sa.URL, empty: sa.URL) -> Ctx:
    ctx = Ctx(
        tmp,
        engine,
        db.render_as_string(hide_password=False),
        empty.render_as_string(hide_password=False),
    )
    server = sa.make_url(os.environ.get("FSM_TEST_POSTGRES_URL") or "postgresql://u@127.0.0.1/x")
    missing_pg = server.set(drivername="postgresql+psycopg", database="fsm_no_such_db_12")
    down_pg = server.set(drivername="postgresql+psycopg", host="127.0.0.1", port=1)
    if engine == "sqlite":
        Path(empty.database or "").touch()  # an empty file, as `touch chat.db` makes
    (tmp / "notes.md").write_text("# Notes\n\nSome *Markdown*, not a stream.\n")
    (tmp / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    (tmp / "package.json").write_text('{"name": "x", "version": "1.0.0"}\n')
    (tmp / "bad.json").write_text("[1, 2,")
    (tmp / "one.json").write_text('["5"]')
    (tmp / "two.json").write_text('["5", "6"]')
    (tmp / "folder").mkdir()

    def b64(key: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")

    cursor = b64([10**20, 1])
    ctx.values = {
        "tmp": str(tmp),
        "db": ctx.db,
        "db_shown": display_url(ctx.db),
        "empty": ctx.empty,
        "empty_shown": display_url(ctx.empty),
        "missing_pg": missing_pg.render_as_string(hide_password=False),
        "missing_pg_shown": display_url(missing_pg),
        "down_pg": down_pg.render_as_string(hide_password=False),
        "down_pg_shown": display_url(down_pg),
        "parallel": str(CORPUS / PARALLEL),
        "truncated": str(CORPUS / TRUNCATED),
        "big": BIG,
        "cursor": cursor,
        # forged cursors that decode and have the right length, but no row has such a key
        "text_cursor": b64(["a", "b"]),
        "calls_cursor": b64([1, "x", 0, 0, 0]),
        "rank_cursor": b64(["c1", 0, 7, 0, 0]),
        "head": HEAD,
    }
    return ctx


# -- the catalog ---------------------------------------------------------------------------------
Check = Callable[[Ctx], None]


@dataclass(frozen=True)
class Mistake:
    """One user mistake: the command line, what it must answer, and on which engines."""

    mistake: str
    args: tuple[str, ...]
    status: int
    #: the exact first line of stderr (``stdout=True``: of stdout), by engine or for all
    first_line: str | dict[str, str]
    engines: tuple[str, ...] = ("sqlite",)
    stdout: bool = False
    check: Check | None = None
    code: str | None = None  # run ``python -c code ARGS`` instead of ``python -m fsm ARGS``
    needs_corpus: bool = False

    def line_for(self, engine: str) -> str:
        return self.first_line if isinstance(self.first_line, str) else self.first_line[engine]


BOTH = ("sqlite", "postgresql")
PG = ("postgresql",)


def nothing_at(name: str) -> Check:
    def check(ctx: Ctx) -> None:
        assert not (ctx.tmp / name).exists(), f"{name} was created"
        assert not list(ctx.tmp.glob(f"{name}-*")), f"{name}'s journal files were left"

    return check


def revision_is(expected: str | None) -> Check:
    def check(ctx: Ctx) -> None:
        assert current_revision(ctx.db) == expected

    return check


NOT_STREAM = "error: {tmp}/notes.md is not a stream: it holds no SSE event and no JSON chunk"
UNAVAILABLE = (
    "error: the database {down_pg_shown} could not be reached (connection failed: connection to "
    'server at "127.0.0.1", port 1 failed: Connection refused Is the server running on that host '
    "and accepting TCP/IP connections?): nothing was written; check that the server is running "
    "and the URL is right, then retry"
)
MISSING_PG = (
    "error: the database {missing_pg_shown} does not exist (connection failed: connection to "
    'server at "127.0.0.1", port 5432 failed: FATAL: database "fsm_no_such_db_12" does not '
    "exist): create it (createdb NAME), or fix the database name in the URL"
)
NOT_AT_HEAD = (
    "error: the database {empty_shown} has no fsm schema, but this fsm needs revision {head}; "
    "run: fsm db upgrade --db '{empty_shown}' (from Python: fsm.store.upgrade('{empty_shown}'); "
    "or: alembic -x db='{empty_shown}' upgrade head)"
)
URL_FORMS = (
    "give a SQLite file path (chat.db), a sqlite:///path.db URL or a "
    "postgresql+psycopg://user@host/db URL (several hosts: "
    "postgresql://user@host1:5432,host2:5432/db?target_session_attrs=read-write)"
)
NO_SQLITE_FILE = (
    "error: no SQLite database at {tmp}/missing.db: fsm history reads a store and never creates "
    "one; check --db, or create it with: fsm db upgrade --db '{tmp}/missing.db'"
)
NO_AUDIT_FILE = (
    "error: no SQLite database at {tmp}/missing.db: audits open the store read-only and never "
    "create it (create one with: fsm db upgrade --db 'sqlite:///{tmp}/missing.db')"
)


def too_big(option: str, command: str, minimum: int = 0) -> str:
    return (
        f"error: Invalid value for '{option}': {BIG} is not in the range "
        f"{minimum}<=x<=9223372036854775807. (see: fsm {command} --help)"
    )


CATALOG: list[Mistake] = [
    # -- fsm parse
    Mistake("`fsm parse` of a Markdown file", ("parse", "{tmp}/notes.md"), 2, NOT_STREAM),
    Mistake(
        "`fsm parse` of a binary file (a PNG)",
        ("parse", "{tmp}/logo.png"),
        2,
        "error: {tmp}/logo.png is not a stream: it holds no SSE event and no JSON chunk",
    ),
    Mistake(
        "`fsm parse` of a JSON document that is not chunks",
        ("parse", "{tmp}/package.json"),
        2,
        "error: {tmp}/package.json is not a stream: none of its 1 event(s) is a Chat Completions "
        "chunk, a Responses API event or an Anthropic Messages event",
    ),
    Mistake(
        "`fsm parse` of a file that does not exist",
        ("parse", "{tmp}/nope.sse"),
        2,
        "error: [Errno 2] No such file or directory: '{tmp}/nope.sse'",
    ),
    Mistake(
        "`fsm parse` of a directory",
        ("parse", "{tmp}/folder"),
        2,
        "error: Invalid value for 'FILE': File '{tmp}/folder' is a directory. "
        "(see: fsm parse --help)",
    ),
    Mistake(
        "a misspelt option (`fsm parse --jsn`)",
        ("parse", "--jsn", "{parallel}"),
        2,
        "error: No such option '--jsn'. Did you mean '--json'? (see: fsm parse --help)",
    ),
    Mistake(
        "a command that does not exist (`fsm show`)",
        ("show",),
        2,
        "error: No such command 'show'. (see: fsm --help)",
    ),
    # -- fsm ingest
    Mistake(
        "`--db sqlite://x.db`: two slashes, a host where a file goes (fsm ingest)",
        ("ingest", "--db", "sqlite://x.db", "--conversation", "c1", "{tmp}/notes.md"),
        2,
        "error: 'sqlite://x.db' names a host, which SQLite has not (two slashes after 'sqlite:'): "
        "a file is sqlite:///x.db (three slashes, relative to here), sqlite:////abs/path/x.db "
        "(four, absolute), or just the path",
    ),
    Mistake(
        "`--db sqlite://x.db`: two slashes, a host where a file goes (fsm history)",
        ("history", "--db", "sqlite://x.db", "c1"),
        2,
        "error: 'sqlite://x.db' names a host, which SQLite has not (two slashes after 'sqlite:'): "
        "a file is sqlite:///x.db (three slashes, relative to here), sqlite:////abs/path/x.db "
        "(four, absolute), or just the path",
    ),
    Mistake(
        "`--db sqlite://x.db`: two slashes, a host where a file goes (fsm audit check)",
        ("audit", "check", "--db", "sqlite://x.db"),
        2,
        "error: 'sqlite://x.db' names a host, which SQLite has not (two slashes after 'sqlite:'): "
        "a file is sqlite:///x.db (three slashes, relative to here), sqlite:////abs/path/x.db "
        "(four, absolute), or just the path",
    ),
    Mistake(
        "`--db chat.db`: a path, not a URL (accepted as a SQLite file)",
        (
            "ingest",
            "--db",
            "chat.db",
            "--conversation",
            "c1",
            "{parallel}",
            "--results",
            "{tmp}/two.json",
        ),
        0,
        "committed choice 0 to conversation 'c1' at seq 0: 1 assistant message, 2 tool result(s)",
        stdout=True,
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest --db sqlite:///new.db`: a new file (gets the schema)",
        ("ingest", "--db", "sqlite:///{tmp}/new.db", "--conversation", "c1", "{truncated}"),
        1,
        "the turn is not complete (finish_reason length, stream ended done): nothing added to "
        "history; recorded as attempt #1 (store-wide id) of conversation 'c1'",
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest` of a Markdown file",
        ("ingest", "--db", "{db}", "--conversation", "c1", "{tmp}/notes.md"),
        2,
        NOT_STREAM + "; nothing written",
        engines=BOTH,
    ),
    Mistake(
        "`fsm ingest` with results that are not JSON",
        (
            "ingest",
            "--db",
            "{db}",
            "--conversation",
            "c1",
            "{parallel}",
            "--results",
            "{tmp}/bad.json",
        ),
        2,
        "error: Invalid value for --results: {tmp}/bad.json is not valid JSON: Expecting value: "
        "line 1 column 7 (char 6) (see: fsm ingest --help)",
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest` with one result for two calls",
        (
            "ingest",
            "--db",
            "{db}",
            "--conversation",
            "c1",
            "{parallel}",
            "--results",
            "{tmp}/one.json",
        ),
        3,
        "error: the turn has 2 tool call(s) but 1 result(s) were given; give exactly one result "
        "per call",
        engines=BOTH,
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest --choice 10^20`",
        ("ingest", "--db", "{db}", "--conversation", "c1", "{parallel}", "--choice", "{big}"),
        2,
        too_big("--choice", "ingest"),
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest --expected-seq 10^20`",
        (
            "ingest",
            "--db",
            "{db}",
            "--conversation",
            "c1",
            "{parallel}",
            "--expected-seq",
            "{big}",
        ),
        2,
        too_big("--expected-seq", "ingest"),
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest` without `--conversation`",
        ("ingest", "--db", "{db}", "{parallel}"),
        2,
        "error: Missing option '--conversation'. (see: fsm ingest --help)",
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest` into a PostgreSQL database that does not exist",
        ("ingest", "--db", "{missing_pg}", "--conversation", "c1", "{truncated}"),
        3,
        MISSING_PG,
        engines=PG,
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest` with the PostgreSQL server down",
        ("ingest", "--db", "{down_pg}", "--conversation", "c1", "{truncated}"),
        4,
        UNAVAILABLE,
        engines=PG,
        needs_corpus=True,
    ),
    Mistake(
        "`fsm ingest` into an empty PostgreSQL schema (not upgraded)",
        ("ingest", "--db", "{empty}", "--conversation", "c1", "{truncated}"),
        3,
        NOT_AT_HEAD,
        engines=PG,
        needs_corpus=True,
    ),
    Mistake(
        "psycopg not installed (`fsm ingest --db postgresql://...`)",
        (
            "ingest",
            "--db",
            "postgresql://app@localhost/app",
            "--conversation",
            "c1",
            "{truncated}",
        ),
        2,
        "error: the database driver psycopg is not installed, and "
        "postgresql+psycopg://app@localhost/app needs it: pip install 'fsm-toolcalls[postgres]'",
        code=NO_PSYCOPG,
        needs_corpus=True,
    ),
    Mistake(
        "`--db app@localhost/app`: a URL without its scheme",
        ("ingest", "--db", "app@localhost/app", "--conversation", "c1", "{tmp}/notes.md"),
        2,
        f"error: 'app@localhost/app' is not a database URL or file path: {URL_FORMS}",
    ),
    Mistake(
        "`--db mysql://...`: an engine fsm does not store to",
        ("history", "--db", "mysql://app@localhost/app", "c1"),
        2,
        "error: fsm stores to SQLite and PostgreSQL, not mysql (mysql://app@localhost/app): "
        + URL_FORMS,
    ),
    Mistake(
        "`--db sqlite:/chat.db`: a URL with one slash",
        ("history", "--db", "sqlite:/chat.db", "c1"),
        2,
        f"error: 'sqlite:/chat.db' is not a database URL or file path: {URL_FORMS}",
    ),
    Mistake(
        "`--db README.md`: a file that is not a database",
        ("ingest", "--db", "{tmp}/notes.md", "--conversation", "c1", "{truncated}"),
        3,
        "error: {tmp}/notes.md is not a SQLite database (file is not a database): give the path "
        "of an fsm database, or a new file name to create one",
        needs_corpus=True,
    ),
    Mistake(
        "`--db` naming a directory",
        ("ingest", "--db", "{tmp}/folder", "--conversation", "c1", "{truncated}"),
        3,
        "error: cannot open the SQLite database {tmp}/folder: it is a directory (unable to open "
        "database file); give a file path you can write",
        needs_corpus=True,
    ),
    # -- fsm history
    Mistake(
        "`fsm history` of a SQLite file that does not exist (none is created)",
        ("history", "--db", "{tmp}/missing.db", "c1"),
        3,
        NO_SQLITE_FILE,
        check=nothing_at("missing.db"),
    ),
    Mistake(
        "`fsm history` of a PostgreSQL database that does not exist",
        ("history", "--db", "{missing_pg}", "c1"),
        3,
        MISSING_PG,
        engines=PG,
    ),
    Mistake(
        "`fsm history` with the PostgreSQL server down",
        ("history", "--db", "{down_pg}", "c1"),
        4,
        UNAVAILABLE,
        engines=PG,
    ),
    Mistake(
        "`fsm history --last 10^20`",
        ("history", "--db", "{db}", "c1", "--last", "{big}"),
        2,
        too_big("--last", "history"),
    ),
    Mistake(
        "`fsm history --json --mermaid`",
        ("history", "--db", "{db}", "c1", "--json", "--mermaid"),
        2,
        "error: choose --json or --mermaid, not both (see: fsm history --help)",
    ),
    # -- fsm db
    Mistake(
        "`fsm db upgrade --revision 9999`",
        ("db", "upgrade", "--db", "{tmp}/up.db", "--revision", "9999"),
        2,
        "error: no revision '9999' in fsm's migrations: give head (the default) or one of 0001, "
        "0002, 0003, 0004_attempts_by_conversation, 0005_tool_ledger, 0006_token_columns, 0007_stream_formats, "
        "0008_ledger_leases, 0009_fsm_prefix",
        check=nothing_at("up.db"),
    ),
    Mistake(
        "`fsm db upgrade` with the PostgreSQL server down",
        ("db", "upgrade", "--db", "{down_pg}"),
        4,
        UNAVAILABLE,
        engines=PG,
    ),
    Mistake(
        "`fsm db upgrade` of a PostgreSQL database that does not exist",
        ("db", "upgrade", "--db", "{missing_pg}"),
        3,
        MISSING_PG,
        engines=PG,
    ),
    Mistake(
        "`fsm db upgrade --db notes.md`: a file that is not a database",
        ("db", "upgrade", "--db", "{tmp}/notes.md"),
        3,
        "error: {tmp}/notes.md is not a SQLite database (file is not a database): give the path "
        "of an fsm database, or a new file name to create one",
    ),
    Mistake(
        "`fsm db current` of a database with no schema",
        ("db", "current", "--db", "{empty}"),
        1,
        "{empty_shown}: no fsm schema (fsm needs {head}; run: fsm db upgrade --db '{empty_shown}')",
        engines=BOTH,
        stdout=True,
    ),
    Mistake(
        "`fsm db migrate`: a subcommand that does not exist",
        ("db", "migrate"),
        2,
        "error: No such command 'migrate'. (see: fsm db --help)",
    ),
    # -- fsm audit
    Mistake(
        "`fsm audit calls --since 0001-01-01T00:00:00+01:00` (before year 1 in UTC)",
        ("audit", "calls", "--db", "{db}", "--since", "0001-01-01T00:00:00+01:00", "--json"),
        0,
        "[]",
        engines=BOTH,
        stdout=True,
    ),
    Mistake(
        "`fsm audit calls --until 9999-12-31T23:59:59-01:00` (after year 9999 in UTC)",
        ("audit", "calls", "--db", "{db}", "--until", "9999-12-31T23:59:59-01:00", "--json"),
        0,
        "[]",
        engines=BOTH,
        stdout=True,
    ),
    Mistake(
        "`fsm audit calls --since yesterday`",
        ("audit", "calls", "--db", "{db}", "--since", "yesterday"),
        2,
        "error: since must be an ISO 8601 date or time (2026-11-30, 2026-11-30T14:00:00Z), not "
        "'yesterday'",
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit calls --limit 10^20`",
        ("audit", "calls", "--db", "{db}", "--limit", "{big}"),
        2,
        too_big("--limit", "audit calls"),
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit failures --offset 10^20`",
        ("audit", "failures", "--db", "{db}", "--offset", "{big}"),
        2,
        too_big("--offset", "audit failures"),
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit failures --after` a cursor holding 10^20",
        ("audit", "failures", "--db", "{db}", "--after", "{cursor}"),
        2,
        "error: Invalid value for --after: '{cursor}' is not a cursor of this command: not "
        "one fsm printed (copy the --after that a full page printed on stderr) "
        "(see: fsm audit failures --help)",
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit failures --after` a forged cursor of two strings",
        ("audit", "failures", "--db", "{db}", "--after", "{text_cursor}"),
        2,
        "error: Invalid value for --after: '{text_cursor}' is not a cursor of this command: not "
        "one fsm printed (copy the --after that a full page printed on stderr) "
        "(see: fsm audit failures --help)",
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit calls --after` a forged cursor (a number where the id goes)",
        ("audit", "calls", "--db", "{db}", "--after", "{calls_cursor}"),
        2,
        "error: Invalid value for --after: '{calls_cursor}' is not a cursor of this command: not "
        "one fsm printed (copy the --after that a full page printed on stderr) "
        "(see: fsm audit calls --help)",
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit calls --after` a forged cursor (a rank that is not 0 or 1)",
        ("audit", "calls", "--db", "{db}", "--after", "{rank_cursor}"),
        2,
        "error: Invalid value for --after: '{rank_cursor}' is not a cursor of this command: not "
        "one fsm printed (copy the --after that a full page printed on stderr) "
        "(see: fsm audit calls --help)",
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit check --batch-size 10^20`",
        ("audit", "check", "--db", "{db}", "--batch-size", "{big}"),
        2,
        too_big("--batch-size", "audit check", minimum=1),
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit calls --arg a=NaN` (read as the text NaN)",
        ("audit", "calls", "--db", "{db}", "--arg", "a=NaN", "--json"),
        0,
        "[]",
        engines=BOTH,
        stdout=True,
    ),
    Mistake(
        "`fsm audit calls --arg city` (no value)",
        ("audit", "calls", "--db", "{db}", "--arg", "city"),
        2,
        "error: Invalid value for --arg: 'city' is not PATH=VALUE (see: fsm audit calls --help)",
    ),
    Mistake(
        "`fsm audit failures --state finished` (not a failed state)",
        ("audit", "failures", "--db", "{db}", "--state", "finished"),
        2,
        "error: Invalid value for '--state': 'finished' is not one of 'truncated', 'aborted'. "
        "(see: fsm audit failures --help)",
    ),
    Mistake(
        "`fsm audit stats --nl` without `--by`",
        ("audit", "stats", "--db", "{db}", "--nl"),
        2,
        "error: --nl prints one table: choose it with --by (see: fsm audit stats --help)",
    ),
    Mistake(
        "`fsm audit calls --json --csv`",
        ("audit", "calls", "--db", "{db}", "--json", "--csv"),
        2,
        "error: choose one output format, not --json, --csv (see: fsm audit calls --help)",
    ),
    Mistake(
        "`fsm audit check` of a SQLite file that does not exist (none is created)",
        ("audit", "check", "--db", "sqlite:///{tmp}/missing.db"),
        3,
        NO_AUDIT_FILE,
        check=nothing_at("missing.db"),
    ),
    Mistake(
        "`fsm audit stats` of a database with no schema",
        ("audit", "stats", "--db", "{empty}"),
        3,
        NOT_AT_HEAD,
        engines=BOTH,
    ),
    Mistake(
        "`fsm audit calls` with the PostgreSQL server down",
        ("audit", "calls", "--db", "{down_pg}"),
        4,
        UNAVAILABLE,
        engines=PG,
    ),
    Mistake(
        "`fsm audit check` of a PostgreSQL database that does not exist",
        ("audit", "check", "--db", "{missing_pg}"),
        3,
        MISSING_PG,
        engines=PG,
    ),
    # -- fsm demo
    Mistake(
        "`fsm demo` on an empty PostgreSQL schema (not upgraded)",
        ("demo", "--db", "{empty}", "--delay", "0"),
        3,
        NOT_AT_HEAD,
        engines=PG,
    ),
    Mistake(
        "`fsm demo --delay -1`",
        ("demo", "--delay", "-1"),
        2,
        "error: Invalid value for '--delay': -1.0 is not in the range x>=0. (see: fsm demo --help)",
    ),
    Mistake(
        "`fsm demo --db postgres@localhost/app`",
        ("demo", "--db", "postgres@localhost/app", "--delay", "0"),
        2,
        f"error: 'postgres@localhost/app' is not a database URL or file path: {URL_FORMS}",
    ),
]


def _params() -> Iterator[Any]:
    for mistake in CATALOG:
        for engine in mistake.engines:
            marks = [pytest.mark.postgres] if engine == "postgresql" else []
            yield pytest.param(engine, mistake, id=f"{engine}-{mistake.mistake}", marks=marks)


#: rows of the table, filled as the catalog runs: mistake -> (first line, exit status, engines)
TABLE: dict[str, tuple[str, int, set[str]]] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_table() -> Iterator[None]:
    yield
    target = os.environ.get("FSM_MISTAKES_TABLE")
    if not target or not TABLE:
        return
    lines = ["| mistake | message (first line) | exit status |", "|---|---|---|"]
    for mistake, (line, status, engines) in TABLE.items():
        alone = engines == {"postgresql"} and "PostgreSQL" not in mistake
        where = " (PostgreSQL)" if alone else ""
        shown = line.replace("|", "\\|")
        lines.append(f"| {mistake}{where} | `{shown}` | {status} |")
    Path(target).write_text("\n".join(lines) + "\n", encoding="utf-8")


def fsm(
    ctx: Ctx, args: tuple[str, ...], code: str | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [ctx.format(a) for a in args]
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "fsm"]
    env = repo_env()
    env.pop("FSM_DB_URL", None)
    env["FSM_DB"] = str(ctx.tmp / "default.db")
    return subprocess.run(
        [*head, *argv], capture_output=True, text=True, cwd=ctx.tmp, env=env, timeout=TIMEOUT
    )


@pytest.fixture
def ctx(engine_name: str, db_url: sa.URL, tmp_path: Path) -> Iterator[Ctx]:
    for empty in empty_database(engine_name, tmp_path / "empty.db"):
        yield make_ctx(tmp_path, engine_name, db_url, empty)


@pytest.mark.slow  # the catalog: a command-line process per mistake and engine
@pytest.mark.parametrize(("engine_name", "mistake"), list(_params()), indirect=["engine_name"])
def test_a_mistake_gets_one_line(engine_name: str, mistake: Mistake, ctx: Ctx) -> None:
    if mistake.needs_corpus:
        require_corpus()
    proc = fsm(ctx, mistake.args, mistake.code)
    out = proc.stdout if mistake.stdout else proc.stderr
    first = out.splitlines()[0] if out else ""
    expected = ctx.format(mistake.line_for(engine_name))
    assert (proc.returncode, first) == (mistake.status, expected), proc.stderr
    for text in (proc.stdout, proc.stderr):
        assert "Traceback" not in text and "internal error" not in text, text
    if not mistake.stdout:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert first.startswith("error: ") or mistake.status == 1
    if mistake.check is not None:
        mistake.check(ctx)
    row = TABLE.setdefault(mistake.mistake, (_generic(expected, ctx), mistake.status, set()))
    row[2].add(engine_name)


def _generic(line: str, ctx: Ctx) -> str:
    """A first line as the table shows it: this run's paths and URLs replaced by names."""
    for key, name in (
        ("empty_shown", "URL"),
        ("db_shown", "URL"),
        ("missing_pg_shown", "postgresql+psycopg://postgres@127.0.0.1:5432/fsm_no_such_db_12"),
        ("down_pg_shown", "postgresql+psycopg://postgres@127.0.0.1:1/test"),
        ("cursor", "CURSOR"),
        ("text_cursor", "CURSOR"),
        ("calls_cursor", "CURSOR"),
        ("rank_cursor", "CURSOR"),
        ("tmp", "."),
    ):
        line = line.replace(ctx.values[key], name)
    return line


# -- Ctrl-C, as a real SIGINT ----------------------------------------------------------------------
def _interrupt_while_reading(
    args: list[str], data: bytes, cwd: Path
) -> subprocess.CompletedProcess[bytes]:
    """Start ``fsm ARGS`` with a pipe as stdin, write ``data`` and keep the pipe open; once the
    child has read it all and waits for more, send SIGINT."""
    env = repo_env()
    child = subprocess.Popen(
        [sys.executable, "-m", "fsm", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
    )
    assert child.stdin is not None
    try:
        child.stdin.write(data)
        child.stdin.flush()
        deadline = time.monotonic() + TIMEOUT
        while _unread(child.stdin.fileno()) and time.monotonic() < deadline:
            time.sleep(0.02)
        while not _reading_stdin(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.poll() is None, "the child ended before the signal"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=TIMEOUT)  # closes stdin only now
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def _unread(fd: int) -> int:
    """Bytes written to the pipe and not read yet (FIONREAD works on either end on Linux)."""
    raw = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", raw)[0])


def _reading_stdin(pid: int) -> bool:
    """Whether the process is blocked in read(0, ...) (``/proc/PID/syscall``: 0 is read)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        time.sleep(0.5)
        return True
    return fields[:2] == ["0", "0x0"]


def _half_a_stream() -> bytes:
    require_corpus()
    data = (CORPUS / PARALLEL).read_bytes()
    return data[: len(data) // 2]


def test_ctrl_c_on_parse_stdin_prints_the_partial_result_and_exits_130(tmp_path: Path) -> None:
    proc = _interrupt_while_reading(["parse", "--json", "-"], _half_a_stream(), tmp_path)
    assert proc.returncode == 130, proc.stderr
    result = json.loads(proc.stdout)
    assert result["end"] == {"how": "aborted", "reason": "interrupted (Ctrl-C)"}
    calls = result["choices"][0]["tool_calls"]
    assert calls and (calls[-1]["state"], calls[-1]["reason"]) == (
        "aborted",
        "interrupted (Ctrl-C)",
    )
    size = len(_half_a_stream())
    first = proc.stderr.decode().splitlines()[0]
    assert first == (
        "error: interrupted (Ctrl-C) while reading stdin: the result above is what arrived "
        f"before ({size} bytes)"
    )
    assert b"Traceback" not in proc.stderr
    TABLE["Ctrl-C during `fsm parse -` (the partial result is printed)"] = (
        first.replace(str(size), "N"),
        130,
        {"sqlite"},
    )


def test_ctrl_c_on_ingest_stdin_records_the_partial_turn_and_exits_130(
    db_url: sa.URL, tmp_path: Path
) -> None:
    url = db_url.render_as_string(hide_password=False)
    data = _half_a_stream()
    proc = _interrupt_while_reading(
        ["ingest", "--db", url, "--conversation", "c1", "-"], data, tmp_path
    )
    assert proc.returncode == 130, proc.stderr
    with ConversationStore(url) as store:
        assert store.history("c1") == []
        [attempt] = store.attempts("c1")
    assert proc.stderr.decode().splitlines() == [
        f"error: interrupted (Ctrl-C) while reading stdin ({len(data)} bytes arrived): nothing "
        f"added to history; recorded as attempt #{attempt['id']} (store-wide id) of conversation "
        "'c1'"
    ]
    assert (attempt["end_how"], attempt["end_reason"]) == ("aborted", "interrupted (Ctrl-C)")
    assert attempt["tool_calls"][-1]["state"] == "aborted"
    line = proc.stderr.decode().splitlines()[0].replace(str(len(data)), "N")
    TABLE["Ctrl-C during `fsm ingest -` (the partial turn is recorded)"] = (
        line.replace(f"attempt {attempt['id']} ", "attempt 1 "),
        130,
        {"sqlite"},
    )


def test_ctrl_c_says_one_line_even_when_it_left_an_object_half_built(tmp_path: Path) -> None:
    """Ctrl-C in a command as an SDK client was being built (its ``__del__`` then fails as the
    interpreter exits, "Exception ignored in ..."): still the one line and exit status 130."""
    script = tmp_path / "half_built.py"
    script.write_text(
        "from fsm.cli.main import cli\n"
        "class HalfBuilt:\n"
        "    def __del__(self):\n"
        "        raise AttributeError('no attribute _state')\n"
        "@cli.command('half-built')\n"
        "def half_built():\n"
        "    global kept\n"
        "    kept = HalfBuilt()\n"
        "    raise KeyboardInterrupt\n"
        "cli.main(['half-built'])\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, env=repo_env(), timeout=TIMEOUT
    )
    assert done.returncode == 130, done.stderr
    lines = [line for line in done.stderr.decode().splitlines() if line.strip()]
    assert lines == ["error: interrupted (Ctrl-C): nothing more was done"], done.stderr


def test_ctrl_c_in_any_command_exits_130(tmp_path: Path) -> None:
    """``fsm demo`` with a slow replay: SIGINT once it started streaming."""
    env = repo_env()
    env["FSM_DB"] = str(tmp_path / "demo.db")
    env.pop("FSM_DB_URL", None)
    child = subprocess.Popen(
        [sys.executable, "-m", "fsm", "demo", "--delay", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().startswith(b"fsm demo: an agent loop")
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert lines == ["error: interrupted (Ctrl-C): nothing more was done"], err
    TABLE["Ctrl-C in any other command (`fsm demo`)"] = (lines[0], 130, {"sqlite"})


# -- the Python API ------------------------------------------------------------------------------
def test_the_store_takes_a_path_as_a_sqlite_file(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    for given, where in (
        ("chat.db", tmp_path / "chat.db"),
        ("./sub/x.db", tmp_path / "sub" / "x.db"),
        (str(tmp_path / "abs.sqlite"), tmp_path / "abs.sqlite"),
        ("~/h.db", tmp_path / "home" / "h.db"),
        (tmp_path / "pathlib.db", tmp_path / "pathlib.db"),
    ):
        with ConversationStore(given) as store:  # type: ignore[arg-type]
            store.create_conversation("c")
            assert store.url == f"sqlite:///{where}"
        assert current_revision(f"sqlite:///{where}") == HEAD


def test_a_new_sqlite_file_just_works_sync_and_async(tmp_path: Path) -> None:
    with ConversationStore(f"sqlite:///{tmp_path / 'new.db'}") as store:
        store.create_conversation("c")
    (tmp_path / "zero.db").write_bytes(b"")  # an empty file, as `touch` makes

    async def body() -> None:
        for name in ("anew.db", "zero.db"):
            async with AsyncConversationStore(f"sqlite:///{tmp_path / name}") as store:
                await store.create_conversation("c")

    asyncio.run(body())
    for name in ("new.db", "anew.db", "zero.db"):
        assert current_revision(f"sqlite:///{tmp_path / name}") == HEAD


def test_a_failed_open_leaves_no_file_behind(tmp_path: Path) -> None:
    target = tmp_path / "made" / "for" / "it.db"
    with pytest.raises(SchemaNotAtHeadError, match=r"from Python: fsm\.store\.upgrade\("):
        ConversationStore(f"sqlite:///{target}", auto_upgrade=False)
    assert not (tmp_path / "made").exists()

    async def body() -> None:
        store = AsyncConversationStore(f"sqlite:///{target}", auto_upgrade=False)
        try:
            with pytest.raises(SchemaNotAtHeadError):
                await store.open()
        finally:
            await store.close()

    asyncio.run(body())
    assert not (tmp_path / "made").exists()


def test_an_older_sqlite_database_names_both_fixes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0001")
    with pytest.raises(SchemaNotAtHeadError) as caught:
        ConversationStore(url)
    assert str(caught.value) == (
        f"the database {url} is at revision 0001, but this fsm needs revision {HEAD}; run: fsm db "
        f"upgrade --db '{url}' (from Python: fsm.store.upgrade('{url}'); or: alembic -x "
        f"db='{url}' upgrade head)"
    )


def test_two_slashes_after_sqlite_is_a_database_url_error() -> None:
    """``sqlite://x.db`` (a host where a file goes): the same one line in Python as on the
    command line, never SQLAlchemy's raw ArgumentError, never an in-memory database."""
    for url in ("sqlite://x.db", "sqlite://localhost/x.db", "sqlite+pysqlite://x.db"):
        with pytest.raises(DatabaseUrlError, match="names a host, which SQLite has not"):
            ConversationStore(url)
        with pytest.raises(DatabaseUrlError, match="names a host"):
            AsyncConversationStore(url)
    ConversationStore("sqlite://", auto_upgrade=True).close()  # nothing after: in memory


@pytest.mark.parametrize(
    "url",
    [
        "",
        "   ",
        "postgres@localhost/app",
        "sqlite:x.db",
        "nonsense://",
        "mysql://a@b/c",
    ],
)
def test_a_bad_url_is_a_database_url_error(url: str) -> None:
    with pytest.raises(DatabaseUrlError) as caught:
        ConversationStore(url)
    assert "give a SQLite file path (chat.db)" in str(caught.value) or "not a valid" in str(
        caught.value
    )
    with pytest.raises(DatabaseUrlError):
        AsyncConversationStore(url)


def test_a_missing_driver_names_the_package(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "from fsm.store import ConversationStore, DriverMissingError\n"
        "from fsm.store.aio import AsyncConversationStore\n"
        "for make in (ConversationStore, AsyncConversationStore):\n"
        "    try:\n"
        "        make('postgresql://app@localhost/app')\n"
        "    except DriverMissingError as exc:\n"
        "        assert isinstance(exc, ImportError) and exc.__cause__ is not None\n"
        "        print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=repo_env()
    )
    assert proc.returncode == 0, proc.stderr
    message = (
        "the database driver psycopg is not installed, and postgresql+psycopg://app@localhost/app "
        "needs it: pip install 'fsm-toolcalls[postgres]'"
    )
    assert proc.stdout.splitlines() == [message, message]


#: the exit status of each typed error as the command line mapped it by class name until the
#: classes carried their own ``exit_code`` (issue 28): the oracle that the move changed nothing
_EXIT_BY_CLASS_NAME = {
    "fsm.errors.RemoteProtocolError": 2,
    "fsm.errors.LocalProtocolError": 2,
    "fsm.errors.IncompleteTurnError": 1,
    "fsm.store.errors.DatabaseUrlError": 2,
    "fsm.store.errors.DriverMissingError": 2,
    "fsm.store.errors.InvalidFilterError": 2,
    "fsm.store.errors.UnknownRevisionError": 2,
    "fsm.store.errors.StoreLayoutError": 2,
    "fsm.store.errors.CommitOutcomeUnknownError": 5,
    "fsm.store.errors.StoreUnavailableError": 4,
    "fsm.store.errors.StoreBusyError": 4,
    "fsm.store.errors.StorageFullError": 6,
    "fsm.store.errors.DatabaseCorruptError": 7,
    "fsm.store.errors.CorruptStoreError": 7,
    "fsm.store.errors.StoreError": 3,
    "fsm.errors.FsmError": 1,
}


def test_every_typed_error_carries_the_exit_status_it_always_had() -> None:
    """Each class's ``exit_code`` (inherited through its MRO) is the status the old table of
    class names gave it, for every typed error of fsm, the web viewer's and the agent's too."""
    from fsm.cli.main import exit_code_for
    from fsm.errors import FsmError
    from fsm.exitstatus import EXIT_INTERNAL

    for module in (
        "fsm.store",
        "fsm.store.deadline",
        "fsm.store.audit",
        "fsm.agent",
        "fsm.clients",
        "fsm.web.pages",
    ):
        importlib.import_module(module)
    classes: list[type[FsmError]] = []
    todo: list[type[FsmError]] = [FsmError]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    assert len(classes) > 40
    for cls in classes:
        old = next(
            _EXIT_BY_CLASS_NAME[name]
            for name in (f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__)
            if name in _EXIT_BY_CLASS_NAME
        )
        assert cls.exit_code == old, cls
        error = cls.__new__(cls)
        assert exit_code_for(error) == old, cls
    setting = {c for c in classes if "exit_code" in c.__dict__}
    assert {f"{c.__module__}.{c.__qualname__}" for c in setting} == set(_EXIT_BY_CLASS_NAME)
    assert exit_code_for(ValueError("not fsm's")) == EXIT_INTERNAL


@pytest.mark.postgres
def test_the_postgres_probe_does_not_mistake_a_down_server(tmp_path: Path) -> None:
    """The server down: unavailable (4), never "does not exist" (3), even for a database name
    that does not exist either."""
    server = postgres_server()
    down = server.set(port=1, database=f"fsm_nowhere_{uuid.uuid4().hex[:6]}")
    ctx = make_ctx(tmp_path, "postgresql", server, server)
    proc = fsm(ctx, ("history", "--db", down.render_as_string(hide_password=False), "c1"))
    assert proc.returncode == 4, proc.stderr


@pytest.mark.postgres
def test_an_unknown_role_is_a_url_to_fix_not_a_retry(tmp_path: Path) -> None:
    """A role the server does not know (or a wrong password) is exit 2, "check the user and
    password in the URL": retrying cannot help, so never exit 4 "retry"."""
    server = postgres_server()
    role = f"fsm_nobody_{uuid.uuid4().hex[:6]}"
    nobody = server.set(username=role)
    ctx = make_ctx(tmp_path, "postgresql", server, server)
    proc = fsm(ctx, ("history", "--db", nobody.render_as_string(hide_password=False), "c1"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: the server refused the login of "), proc.stderr
    assert f'role "{role}" does not exist' in proc.stderr
    with pytest.raises(DatabaseUrlError, match="check the user and password"):
        ConversationStore(nobody)


def test_the_help_lists_every_exit_status() -> None:
    from fsm.cli import main

    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "--help"], capture_output=True, text=True, env=repo_env()
    )
    listed = {
        int(line.split()[0]) for line in proc.stdout.splitlines() if line[:6].strip().isdigit()
    }
    names = [name for name in main.__all__ if name.startswith("EXIT_") and name != "EXIT_BY_CLASS"]
    assert listed == {0} | {getattr(main, name) for name in names}


def test_the_async_engines_raise_the_same_typed_errors(tmp_path: Path) -> None:
    """The ``handle_error`` hook is on the async engines too (aiosqlite, psycopg async)."""
    import sqlite3

    from fsm.store import DatabaseFileError, StoreUnavailableError
    from fsm.store.engine import create_async_engine

    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n")

    async def body() -> None:
        engine = create_async_engine(f"sqlite:///{notes}")
        try:
            with pytest.raises(DatabaseFileError) as caught:
                async with engine.connect() as conn:
                    await conn.execute(sa.text("SELECT * FROM sqlite_master"))
        finally:
            await engine.dispose()
        assert caught.value.path == str(notes)
        assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)
        if not os.environ.get("FSM_TEST_POSTGRES_URL"):
            return
        down = create_async_engine("postgresql+psycopg://postgres@127.0.0.1:1/test")
        try:
            with pytest.raises(StoreUnavailableError, match="could not be reached"):
                async with down.connect():
                    pass
        finally:
            await down.dispose()

    asyncio.run(body())


@pytest.mark.parametrize("args", [[], ["db"], ["audit"]])
def test_a_group_without_its_command_shows_its_help(args: list[str]) -> None:
    """Not a one-line error: the help, as click shows it (exit 2)."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", *args], capture_output=True, text=True, env=repo_env()
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.splitlines()[0]
        == f"Usage: {' '.join(['fsm', *args])} [OPTIONS] COMMAND [ARGS]..."
    )
    assert "Commands:" in proc.stderr and "Traceback" not in proc.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """``fsm history c1 | head -1``: no "Broken pipe" message, no traceback, exit 0 (the reader
    took what it wanted), however much was left to print; as the audit commands do."""
    url = f"sqlite:///{tmp_path / 'chat.db'}"
    with ConversationStore(url, auto_upgrade=True) as store:
        cid = store.create_conversation("c1")
        store.append(cid, [{"role": "user", "content": f"{i} " + "x" * 200} for i in range(2000)])
        for i in range(1200):
            store.create_conversation(f"conversation-{i:05d}-" + "y" * 100)
    for args in (
        ["history", "--db", url, "c1"],
        ["history", "--db", url, "--json", "c1"],
        ["conversations", "--db", url, "--limit", "0"],
    ):
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsm", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env=repo_env(),
        )
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()  # the first line, as `head -1` reads it
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0, stderr
        assert stderr == ""
