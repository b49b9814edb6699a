"""Listing conversations (issue 12, item 7): ``list_conversations`` on the sync and the async
store, and ``fsm conversations`` with the usual paging and output formats, on both engines."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.store.store import ConversationInfo
from tests.helpers import repo_env
from tests.helpers.store import make_turn

WHEN = {
    "a": datetime(2026, 11, 1, 9, 0, tzinfo=UTC),
    "b": datetime(2026, 11, 2, 9, 0, tzinfo=UTC),
    "c": datetime(2026, 11, 3, 9, 0, tzinfo=UTC),
}


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def url(db_url: sa.URL) -> str:
    """a: a user message and a turn of two calls (4 messages, 1 turn) and an attempt a day
    later; b: empty; c: two plain assistant messages. Dated by WHEN."""
    with ConversationStore(db_url) as store:
        store.create_conversation("a", metadata={"user": "ann"})
        store.append("a", [{"role": "user", "content": "add 2 and 3"}])
        turn = make_turn([("call_1", "add", "{}"), ("call_2", "mul", "{}")])
        store.commit_turn("a", turn, ["5", "6"])
        store.record_attempt("a", make_turn(finish_reason="length"))
        store.create_conversation("b")
        store.create_conversation("c")
        store.append("c", [{"role": "assistant", "content": "x"}] * 2)
        with store.engine.begin() as conn:
            for cid, when in WHEN.items():
                for table, at in (("fsm_conversations", "id"), ("fsm_messages", "conversation_id")):
                    conn.execute(
                        sa.text(f"UPDATE {table} SET created_at = :t WHERE {at} = :c"),
                        {"t": when, "c": cid},
                    )
            conn.execute(
                sa.text("UPDATE fsm_attempts SET created_at = :t WHERE conversation_id = 'a'"),
                {"t": datetime(2026, 11, 5, 12, 30, tzinfo=UTC)},
            )
    return db_url.render_as_string(hide_password=False)


EXPECTED = [
    ConversationInfo(
        id="a",
        created_at=WHEN["a"],
        messages=4,
        turns=1,
        attempts=1,
        last_activity=datetime(2026, 11, 5, 12, 30, tzinfo=UTC),
        metadata={"user": "ann"},
    ),
    ConversationInfo(
        id="b",
        created_at=WHEN["b"],
        messages=0,
        turns=0,
        attempts=0,
        last_activity=WHEN["b"],
        metadata=None,
    ),
    ConversationInfo(
        id="c",
        created_at=WHEN["c"],
        messages=2,
        turns=2,
        attempts=0,
        last_activity=WHEN["c"],
        metadata=None,
    ),
]


def test_the_command_columns_are_the_row_fields() -> None:
    from fsm.cli.conversations import COLUMNS
    from fsm.cli.output import columns_of

    assert columns_of(ConversationInfo) == COLUMNS == tuple(EXPECTED[0].as_dict())


def test_list_conversations(url: str) -> None:
    with ConversationStore(url) as store:
        assert store.list_conversations() == EXPECTED
        assert store.list_conversations(limit=2) == EXPECTED[:2]
        assert store.list_conversations(limit=2, after="a") == EXPECTED[1:]
        assert store.list_conversations(after=EXPECTED[-1].key) == []
        assert store.list_conversations(limit=None, after="") == EXPECTED
        assert store.list_conversations(limit=0) == []
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="limit must be"):
                store.list_conversations(limit=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="after must be"):
            store.list_conversations(after=3)  # type: ignore[arg-type]


def test_list_conversations_async(url: str) -> None:
    async def listed() -> list[list[ConversationInfo]]:
        async with AsyncConversationStore(url) as store:
            return [await store.list_conversations(), await store.list_conversations(after="b")]

    assert asyncio.run(listed()) == [EXPECTED, EXPECTED[2:]]


def test_an_empty_store_lists_nothing(db_url: sa.URL) -> None:
    with ConversationStore(db_url) as store:
        assert store.list_conversations() == []
    url = db_url.render_as_string(hide_password=False)
    table = run("conversations", "--db", url)
    assert table.exit_code == 0 and table.stdout.splitlines() == [
        "id  created_at  messages  turns  attempts  last_activity  metadata",
        "--  ----------  --------  -----  --------  -------------  --------",
    ]
    assert run("conversations", "--db", url, "--json").stdout == "[]\n"


def test_conversations_command_formats(url: str) -> None:
    table = run("conversations", "--db", url)
    assert table.exit_code == 0, table.stderr
    assert table.stdout.splitlines() == [  # times to the second in a table, exact in JSON
        "id  created_at            messages  turns  attempts  last_activity         metadata",
        "--  --------------------  --------  -----  --------  --------------------  --------------",
        'a   2026-11-01T09:00:00Z         4      1         1  2026-11-05T12:30:00Z  {"user":"ann"}',
        "b   2026-11-02T09:00:00Z         0      0         0  2026-11-02T09:00:00Z",
        "c   2026-11-03T09:00:00Z         2      2         0  2026-11-03T09:00:00Z",
    ]
    assert json.loads(run("conversations", "--db", url, "--json").stdout)[0] == {
        "id": "a",
        "created_at": "2026-11-01T09:00:00.000000+00:00",
        "messages": 4,
        "turns": 1,
        "attempts": 1,
        "last_activity": "2026-11-05T12:30:00.000000+00:00",
        "metadata": {"user": "ann"},
    }
    rows = list(csv.DictReader(io.StringIO(run("conversations", "--db", url, "--csv").stdout)))
    assert [(r["id"], r["messages"], r["metadata"]) for r in rows] == [
        ("a", "4", '{"user":"ann"}'),
        ("b", "0", ""),
        ("c", "2", ""),
    ]
    tsv = run("conversations", "--db", url, "--tsv", "--columns", "id,attempts", "--no-headers")
    assert tsv.stdout.splitlines() == ["a\t1", "b\t0", "c\t0"]
    nl = run("conversations", "--db", url, "--nl", "--columns", "turns,id")
    assert [json.loads(x) for x in nl.stdout.splitlines()] == [
        {"turns": 1, "id": "a"},
        {"turns": 0, "id": "b"},
        {"turns": 2, "id": "c"},
    ]


def test_conversations_command_pages(url: str) -> None:
    first = run("conversations", "--db", url, "--limit", "2", "--columns", "id")
    assert first.stdout.splitlines() == ["id", "--", "a", "b"]
    assert first.stderr.startswith("more rows may follow: add --after ")
    cursor = first.stderr.split("--after ")[1].split()[0]
    rest = run("conversations", "--db", url, "--after", cursor, "--nl", "--columns", "id")
    assert rest.stdout.splitlines() == ['{"id": "c"}'] and rest.stderr == ""
    json_page = run("conversations", "--db", url, "--json", "--limit", "1")
    assert len(json.loads(json_page.stdout)) == 1 and "--after" in json_page.stderr
    bad = run("conversations", "--db", url, "--after", "nonsense")
    assert bad.exit_code == 2 and "is not a cursor of this command" in bad.stderr
    offset = run("conversations", "--db", url, "--offset", "1", "--limit", "1", "--columns", "id")
    assert offset.stdout.splitlines() == ["id", "--", "b"] and "--after" in offset.stderr
    rest = run("conversations", "--db", url, "--offset", "1", "--csv", "--columns", "id")
    assert rest.stdout.splitlines() == ["id", "b", "c"] and rest.stderr == ""
    unknown = run("conversations", "--db", url, "--columns", "id,size")
    assert unknown.exit_code == 2
    assert "unknown column size for --columns: choose from id, created_at, messages" in (
        unknown.stderr
    )


def test_conversations_in_batches(db_url: sa.URL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row in a machine format, read a batch at a time (a batch of 2 here)."""
    from fsm.cli import conversations as command

    monkeypatch.setattr(command, "_BATCH", 2)
    with ConversationStore(db_url) as store:
        for i in range(7):
            store.create_conversation(f"k{i}")
    url = db_url.render_as_string(hide_password=False)
    shown = run("conversations", "--db", url, "--csv", "--columns", "id", "--no-headers")
    assert shown.stdout.splitlines() == [f"k{i}" for i in range(7)] and shown.stderr == ""
    limited = run("conversations", "--db", url, "--nl", "--columns", "id", "--limit", "5")
    assert len(limited.stdout.splitlines()) == 5 and "--after" in limited.stderr


def test_conversations_as_a_user_runs_it(url: str, tmp_path: Path) -> None:
    def fsm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fsm", *args],
            capture_output=True,
            text=True,
            env=repo_env(),
            cwd=tmp_path,
            timeout=120,
        )

    shown = fsm("conversations", "--db", url, "--tsv", "--columns", "id,messages,turns")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == ["id\tmessages\tturns", "a\t4\t1", "b\t0\t0", "c\t2\t2"]
    missing = tmp_path / "missing.db"
    absent = fsm("conversations", "--db", f"sqlite:///{missing}")
    assert absent.returncode != 0 and "Traceback" not in absent.stderr
    assert absent.stderr.startswith("error: no SQLite database at ") and not missing.exists()
