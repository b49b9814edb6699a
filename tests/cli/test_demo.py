"""``fsm demo``: in-process (click's CliRunner) and as a real subprocess; its output and the rows it
stored."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import ConversationStore, audit
from tests.helpers import REPO

QUESTION = "What are 1234 + 5678 and 12 x 34?"
ANSWER = "1234 + 5678 = 6912, and 12 \u00d7 34 = 408."
EXPECTED_HISTORY = [
    {"role": "user", "content": QUESTION},
    {
        "role": "assistant",
        "content": "I'll work out both at once.",
        "tool_calls": [
            {
                "id": "call_add_7Qz2",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1234, "b": 5678}'},
            },
            {
                "id": "call_mul_9Xk4",
                "type": "function",
                "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_add_7Qz2", "content": "6912"},
    {"role": "tool", "tool_call_id": "call_mul_9Xk4", "content": "408"},
    {"role": "assistant", "content": ANSWER},
]

#: lines the demo prints, in this order
EXPECTED_LINES = [
    "user: " + QUESTION,
    "request 1: 1 message sent, streaming...",
    "  assistant: I'll work out both at once.",
    "  \u2192 add  call_add_7Qz2",
    "  \u2192 multiply  call_mul_9Xk4",
    "  turn complete (finish_reason tool_calls)",
    '  \u2713 add({"a": 1234, "b": 5678}) = 6912',
    '  \u2713 multiply({"a": 12, "b": 34}) = 408',
    "  committed at seq 1-3: the assistant message and 2 tool results, in one transaction",
    "request 2: 4 messages sent, streaming...",
    "  assistant: " + ANSWER,
    "  turn complete (finish_reason stop)",
    "  committed at seq 4: the assistant message",
    # the turn the model cuts off mid-call: truncated, never run, recorded as an attempt
    "user: And 99 x 99?",
    "  assistant: Let me multiply them.",
    "  \u2192 multiply  call_mul_cut8",
    "  turn NOT complete (finish_reason length)",
    '  multiply was never run: its call is truncated (length), arguments cut at {"a": 99, "b',
    "History (5 messages, as the next request would send it):",
    "    2  tool       call_add_7Qz2  \u2192 6912",
    "Audit (fsm.store.audit):",
    "  calls/tool    add 1, multiply 1",
    "  call states   finished 2",
    "  model         demo-model-1: 2 turns, 0 incomplete; tokens 276 in, 60 out",
    "  integrity     ok: the contract re-checked over the whole store, no violation",
    "  server check  3 requests, 0 rejected",
]


def assert_output(output: str) -> str:
    """The expected lines appear in order; returns the conversation id the demo printed."""
    lines = output.splitlines()
    at = 0
    for expected in EXPECTED_LINES:
        assert expected in lines[at:], f"missing or out of order: {expected!r}\n{output}"
        at = lines.index(expected, at) + 1
    done, viewer = lines[-2], lines[-1]
    assert done.startswith("done: fsm history --db "), output
    conversation = done.rsplit(" ", 1)[1]
    assert conversation.startswith("demo-")
    # the last line: the one command that opens the viewer on the demo's store
    url = done.split("--db ", 1)[1].rsplit(" ", 1)[0]
    assert viewer == f"see it all in the browser: fsm audit serve --db {url}", output
    assert f"conversation  {conversation}-cut: a turn the model cuts off mid-call" in lines
    return conversation


def assert_stored(url: str, conversation: str) -> None:
    with ConversationStore(url) as store:
        assert store.history(conversation) == EXPECTED_HISTORY
        assert store.attempts(conversation) == []
        # the cut-off turn: nothing in history but its user message, one attempt whose call is
        # truncated by length and was never run (no result)
        cut = f"{conversation}-cut"
        assert store.history(cut) == [{"role": "user", "content": "And 99 x 99?"}]
        (attempt,) = store.attempts(cut)
        assert (attempt["at_seq"], attempt["finish_reason"], attempt["complete"]) == (
            1,
            "length",
            False,
        )
        (call,) = attempt["tool_calls"]
        assert (call["name"], call["id"], call["state"], call["reason"]) == (
            "multiply",
            "call_mul_cut8",
            "truncated",
            "length",
        )
        assert call["raw_arguments"] == '{"a": 99, "b' and call["result"] is None
        assert list(audit.check(store.engine)) == []
        with store.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT seq, role, n_calls, tool_call_id, response_id, finish_reason "
                    "FROM fsm_messages WHERE conversation_id = :c ORDER BY seq"
                ),
                {"c": conversation},
            ).all()
            calls = conn.execute(
                sa.text(
                    "SELECT assistant_seq, position, call_id, name, arguments, state "
                    "FROM fsm_tool_calls WHERE conversation_id = :c ORDER BY assistant_seq, position"
                ),
                {"c": conversation},
            ).all()
    # the replay server gives each response its own id: <recorded id>-<8 hex digits>-<n>
    ids = [r[4] for r in rows if r[4] is not None]
    assert len(ids) == 2
    assert all(re.fullmatch(r"chatcmpl-fsmdemo000[12]-[0-9a-f]{8}-[12]", i) for i in ids), ids
    rows = [(*r[:4], r[4] and r[4].rsplit("-", 2)[0], r[5]) for r in rows]
    assert [tuple(r) for r in rows] == [
        (0, "user", 0, None, None, None),
        (1, "assistant", 2, None, "chatcmpl-fsmdemo0001", "tool_calls"),
        (2, "tool", 0, "call_add_7Qz2", None, None),
        (3, "tool", 0, "call_mul_9Xk4", None, None),
        (4, "assistant", 0, None, "chatcmpl-fsmdemo0002", "stop"),
    ]
    assert [tuple(c) for c in calls] == [
        (1, 0, "call_add_7Qz2", "add", '{"a": 1234, "b": 5678}', "finished"),
        (1, 1, "call_mul_9Xk4", "multiply", '{"a": 12, "b": 34}', "finished"),
    ]


def test_demo_in_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    runner = CliRunner()
    first = runner.invoke(cli, ["demo", "--db", url, "--delay", "0"])
    assert first.exit_code == 0, first.output
    conversation = assert_output(first.output)
    assert_stored(url, conversation)
    # every run is a new conversation in the same database
    second = runner.invoke(cli, ["demo", "--db", url, "--delay", "0"])
    assert second.exit_code == 0, second.output
    other = assert_output(second.output)
    assert other != conversation
    assert_stored(url, other)


def test_demo_on_each_engine(db_url: sa.URL) -> None:
    url = db_url.render_as_string(hide_password=False)
    result = CliRunner().invoke(cli, ["demo", "--db", url, "--delay", "0"])
    assert result.exit_code == 0, result.output
    assert_stored(url, assert_output(result.output))


def test_demo_on_an_empty_database(empty_url: sa.URL, engine_name: str) -> None:
    """SQLite is created as needed; PostgreSQL must be upgraded first, and the error says how."""
    url = empty_url.render_as_string(hide_password=False)
    result = CliRunner().invoke(cli, ["demo", "--db", url, "--delay", "0"])
    if engine_name == "sqlite":
        assert result.exit_code == 0, result.output
        assert_stored(url, assert_output(result.output))
        return
    assert result.exit_code == 3  # EXIT_STORE: the schema is not at head (issue 12)
    assert "fsm db upgrade --db" in result.output and "Traceback" not in result.output


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FSM_DB_URL", "FSM_DB")}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_demo_as_a_subprocess_with_no_set_up(tmp_path: Path) -> None:
    """No --db: the embedded default ./fsm.db is created (and migrated) in the working
    directory."""
    done = subprocess.run(
        [sys.executable, "-m", "fsm", "demo", "--delay", "0"],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    conversation = assert_output(done.stdout)
    assert (tmp_path / "fsm.db").is_file()
    assert_stored(f"sqlite:///{tmp_path / 'fsm.db'}", conversation)


def test_demo_shows_tool_names_while_streaming(tmp_path: Path) -> None:
    """Paced at 30 ms per event, the tool names are printed (and flushed) well before the turn
    ends: a live progress display, not output printed at the end."""
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    process = subprocess.Popen(
        [sys.executable, "-m", "fsm", "demo", "--db", url, "--delay", "0.03"],
        env=_environment(),
        stdout=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    seen: dict[str, float] = {}
    assert process.stdout is not None
    for line in process.stdout:
        seen.setdefault(line.rstrip("\n"), time.monotonic())
    assert process.wait(timeout=60) == 0
    opened = seen["  \u2192 add  call_add_7Qz2"]
    ended = seen["  turn complete (finish_reason tool_calls)"]
    assert ended - opened > 0.1  # ~10 events (0.3 s) separate them
