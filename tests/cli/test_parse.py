"""``fsm parse``, driven in-process and as a real subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from fsm.cli.main import cli
from tests.helpers import chunk, sse, tc

EXAMPLES = Path(__file__).resolve().parents[2] / "fsm" / "examples"


def run(args: list[str], stdin: bytes | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, args, input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_json_output_has_exactly_the_documented_shape() -> None:
    code, out, _ = run(["parse", "--json", str(EXAMPLES / "parallel_add_multiply.sse")])
    assert code == 0
    data = json.loads(out)
    assert list(data) == [
        "response_id", "model", "usage", "end", "anomalies", "choices", "format", "error_code"
    ]  # fmt: skip
    assert data["format"] == "chat"
    assert data["end"] == {"how": "done", "reason": None}
    (choice,) = data["choices"]
    assert list(choice) == [
        "index", "finish_reason", "complete", "incomplete_reason", "content", "reasoning",
        "refusal", "tool_calls",
    ]  # fmt: skip
    assert [list(c) for c in choice["tool_calls"]] == [
        ["position", "index", "id", "type", "name", "arguments", "state", "reason", "repaired"]
    ] * 2
    assert [(c["id"], c["name"], c["arguments"]) for c in choice["tool_calls"]] == [
        ("call_add_7Qz2", "add", '{"a": 1234, "b": 5678}'),
        ("call_mul_9Xk4", "multiply", '{"a": 12, "b": 34}'),
    ]


def test_exit_status_one_for_an_incomplete_turn_and_summary_says_so() -> None:
    data = sse(chunk(tc(0, "a", "f", '{"x": ')), chunk(finish="length"))
    code, out, _ = run(["parse", "-"], stdin=data)
    assert code == 1
    assert "truncated (length)" in out
    assert "INCOMPLETE" in out


def test_repair_flag() -> None:
    data = sse(chunk(tc(0, "a", "f", '{"x": "y')), chunk(finish="tool_calls"))
    assert run(["parse", "-"], stdin=data)[0] == 1
    code, out, _ = run(["parse", "--json", "--repair-json", "-"], stdin=data)
    assert code == 0
    call = json.loads(out)["choices"][0]["tool_calls"][0]
    assert (call["arguments"], call["repaired"], call["state"]) == ('{"x": "y"}', True, "finished")


def test_json_lines_input() -> None:
    lines = "\n".join(json.dumps(c) for c in [chunk(tc(0, "a", "f", "{}")), chunk(finish="stop")])
    code, out, _ = run(["parse", "--json", "-"], stdin=(lines + "\n").encode())
    assert code == 0
    assert json.loads(out)["choices"][0]["complete"] is True


def test_protocol_error_exits_two_without_traceback() -> None:
    data = b'data: {"choices": [{"delta": {"tool_calls": [{"index": "x"}]}}]}\n\n'
    code, out, err = run(["parse", "--json", "-"], stdin=data)
    assert code == 2
    assert out == ""
    assert "invalid stream at event 1, byte 0, choices[0].delta.tool_calls[0].index" in err
    assert "Traceback" not in err


def test_missing_file_is_a_clear_error() -> None:
    code, _, err = run(["parse", "/nonexistent/stream.sse"])
    assert code == 2
    assert "No such file" in err and "Traceback" not in err


def test_real_subprocess_protocol_error_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "parse", "-"],
        input=b"data: [1, 2]\n\n",
        capture_output=True,
    )
    assert proc.returncode == 2
    assert b"Traceback" not in proc.stderr
    assert b"a chunk must be a JSON object" in proc.stderr


def test_every_command_has_help_with_examples() -> None:
    def walk(command: click.Command, path: list[str]) -> None:
        code, out, _ = run([*path, "--help"])
        assert code == 0, path
        assert command.help, f"{' '.join(path) or 'fsm'} has no help text"
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            assert "Example" in out, f"fsm {' '.join(path)} --help shows no example"

    walk(cli, [])


def test_input_with_no_chat_completions_chunk_is_not_a_stream() -> None:
    """Issue 12: a JSON document, or SSE events of JSON objects that are not chunks, exit 2
    ("not a stream"), not 1 ("incomplete")."""
    for data in (b'{"name": "x", "version": "1.0.0"}\n', b'data: {"foo": 1}\n\ndata: {}\n\n'):
        code, out, err = run(["parse", "-"], stdin=data)
        events = data.count(b"\n\n") or 1
        assert (code, out) == (2, "")
        assert err == (
            f"error: stdin is not a stream: none of its {events} event(s) is a Chat Completions "
            "chunk, a Responses API event or an Anthropic Messages event\n"
        )
    # a stream with no choice but a real chunk (an id, [DONE]) is a stream: incomplete, 1
    code, _, err = run(
        ["parse", "-"], stdin=b'data: {"id": "r", "choices": []}\n\ndata: [DONE]\n\n'
    )
    assert (code, err) == (1, "")


def test_a_usage_error_is_one_line() -> None:
    code, out, err = run(["parse", "--jsn", "x.sse"])
    assert (code, out) == (2, "")
    # in process the program is not called fsm; the subprocess catalog pins the whole line
    # click's own words (8.2.0 writes "No such option: --jsn Did you mean --json?")
    assert re.match(r"error: No such option:? '?--jsn'?\.? Did you mean '?--json'?\? \(see: ", err)
    assert err.endswith(" parse --help)\n") and err.count("\n") == 1
