"""The store's commands, driven in-process through the ``fsm`` group."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli import store as store_cli
from fsm.cli.main import cli
from fsm.store import ConversationNotFoundError, ConversationStore
from tests.helpers import CORPUS, require_corpus

PARALLEL = "openai/openai-gpt-4o_parallel_two_calls.sse"
TRUNCATED = "openai-python/finish_length_max_tokens_1__gpt-4o-2024-08-06__4cc50a6135d2.sse"


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args))


def assert_one_line_error(result: click.testing.Result) -> None:
    assert result.exit_code not in (0, None)
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


@pytest.fixture
def url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


def test_db_upgrade_and_current(empty_url: sa.URL) -> None:
    url = empty_url.render_as_string(hide_password=False)
    before = run("db", "current", "--db", url)
    assert before.exit_code == 1 and "fsm db upgrade" in before.output
    upgraded = run("db", "upgrade", "--db", url)
    assert upgraded.exit_code == 0 and "upgraded from an empty database" in upgraded.output
    assert "already at revision" in run("db", "upgrade", "--db", url).output
    current = run("db", "current", "--db", url)
    assert current.exit_code == 0 and "(head)" in current.output


def test_ingest_commits_once_and_history_prints_it(url: str, tmp_path: Path) -> None:
    require_corpus()
    results = tmp_path / "results.json"
    results.write_text(json.dumps(["5", {"content": "6"}]))
    args = ["ingest", "--db", url, "--conversation", "c1", str(CORPUS / PARALLEL)]
    first = run(*args, "--results", str(results))
    assert first.exit_code == 0, first.output + first.stderr
    assert "at seq 0: 1 assistant message, 2 tool result(s)" in first.output
    again = run(*args, "--results", str(results))
    assert again.exit_code == 0 and "nothing written" in again.output

    printed = run("history", "--db", url, "c1", "--json")
    assert printed.exit_code == 0
    with ConversationStore(url) as store:
        assert json.loads(printed.output) == store.history("c1")
    table = run("history", "--db", url, "c1")
    assert "multiply" in table.output and "call_fBSgA47J5VeONggizTIvl7AH" in table.output

    def window(n: int) -> list[object]:
        shown = run("history", "--db", url, "c1", "--json", "--last", str(n))
        loaded: list[object] = json.loads(shown.output)
        return loaded

    assert len(window(3)) == 3
    assert window(2) == []  # would start inside the tool block


def test_ingest_json_lines(url: str, tmp_path: Path) -> None:
    require_corpus()
    chunks = [
        line[len("data: ") :]
        for line in (CORPUS / PARALLEL).read_text().splitlines()
        if line.startswith("data: {")
    ]
    stream = tmp_path / "stream.jsonl"
    stream.write_text("\n".join(chunks) + "\n")
    results = tmp_path / "r.json"
    results.write_text(
        json.dumps({"call_ehIWdjL1abZk1h8FWGLQ0Hie": "5", "call_fBSgA47J5VeONggizTIvl7AH": "6"})
    )
    done = run(
        "ingest", "--db", url, "--conversation", "c2", str(stream), "--results", str(results)
    )
    assert done.exit_code == 0, done.stderr


def test_incomplete_turn_becomes_an_attempt_and_exits_1(url: str) -> None:
    require_corpus()
    result = run("ingest", "--db", url, "--conversation", "c3", str(CORPUS / TRUNCATED))
    assert result.exit_code == 1
    assert "not complete" in result.stderr and "recorded as attempt" in result.stderr
    with ConversationStore(url) as store:
        assert store.history("c3") == []
        [attempt] = store.attempts("c3")
        assert attempt["finish_reason"] == "length"


@pytest.mark.parametrize(
    "args",
    [
        ["history", "--db", "{url}", "no-such-conversation"],
        ["ingest", "--db", "{url}", "--conversation", "c", "{parallel}"],  # results missing
    ],
)
def test_typed_errors_are_one_line(url: str, args: list[str]) -> None:
    require_corpus()
    filled = [a.format(url=url, parallel=CORPUS / PARALLEL) for a in args]
    assert_one_line_error(run(*filled))


def test_a_database_not_at_head_is_a_one_line_error(empty_url: sa.URL) -> None:
    result = run("history", "--db", empty_url.render_as_string(hide_password=False), "c")
    assert_one_line_error(result)
    assert "fsm db upgrade --db" in result.stderr


def test_every_store_command_has_help_with_examples() -> None:
    commands: list[tuple[list[str], click.Command]] = [
        (["db"], store_cli.db),
        (["ingest"], store_cli.ingest),
        (["history"], store_cli.history),
    ]
    commands += [(["db", name], command) for name, command in store_cli.db.commands.items()]
    for path, command in commands:
        assert command.help, path
        shown = run(*path, "--help")
        assert shown.exit_code == 0 and "Examples:" in shown.output, path


def test_shared_options_and_generated_help_come_from_the_definitions() -> None:
    from fsm.cli.audit import audit
    from fsm.cli.demo import demo
    from fsm.states import ToolCallState
    from fsm.store.audit import TOKEN_MAX, VIOLATION_KINDS

    stats_help = run("audit", "stats", "--help").output
    assert f"{TOKEN_MAX:,}" in stats_help and "{token_max}" not in stats_help
    check_help = audit.commands["check"].help or ""
    assert "{kinds}" not in check_help
    assert [w for w in check_help.split() if w in VIOLATION_KINDS] == list(VIOLATION_KINDS)
    calls_state = next(p for p in audit.commands["calls"].params if p.name == "state")
    assert list(getattr(calls_state.type, "choices", ())) == [s.value for s in ToolCallState]
    db_helps = [
        next(p for p in command.params if p.name == "url")
        for command in (store_cli.ingest, store_cli.history, demo, *audit.commands.values())
    ]
    assert all(
        isinstance(p, click.Option) and (p.help or "").startswith("Database URL") for p in db_helps
    )


def test_ingest_of_input_that_is_not_a_stream_writes_nothing(url: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nnot a stream\n")
    result = run("ingest", "--db", url, "--conversation", "c9", str(notes))
    assert result.exit_code == 2  # EXIT_UNUSABLE, not 1 ("recorded as an attempt")
    assert_one_line_error(result)
    assert "is not a stream" in result.stderr and "nothing written" in result.stderr
    with ConversationStore(url) as store, pytest.raises(ConversationNotFoundError):
        store.history("c9")


def test_ingest_into_a_new_sqlite_path_creates_it_and_history_never_does(tmp_path: Path) -> None:
    require_corpus()
    missing = tmp_path / "nowhere.db"
    shown = run("history", "--db", str(missing), "c1")
    assert shown.exit_code == 3  # EXIT_STORE: DatabaseNotFoundError
    assert_one_line_error(shown)
    assert not missing.exists()
    new = tmp_path / "sub" / "new.db"
    done = run("ingest", "--db", str(new), "--conversation", "c1", str(CORPUS / TRUNCATED))
    assert done.exit_code == 1, done.stderr  # recorded as an attempt, in a new file at head
    with ConversationStore(new) as store:
        assert len(store.attempts("c1")) == 1
