"""``fsm replay``: the offline replay server on its own (issue 25), in-process and as a real
process stopped by a real SIGINT, and ``ReplayServer(repeat=True)`` under it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fsm.cli.main import EXIT_INTERRUPTED, EXIT_UNUSABLE, cli
from fsm.replay import ReplayServer, carries_tool_results, demo_script
from tests.helpers import REPO

QUESTION = [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}]


def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


def _run_loop(environment: dict[str, str], fmt: str, db: Path) -> Any:
    """The agent loop with the official client built from the printed environment alone."""
    from fsm.agent import run_agent_loop
    from fsm.store import ConversationStore

    if fmt == "anthropic":
        anthropic = pytest.importorskip("anthropic")
        client: Any = anthropic.Anthropic(
            base_url=environment["ANTHROPIC_BASE_URL"],
            api_key=environment["ANTHROPIC_API_KEY"],
            max_retries=0,
        )
    else:
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(
            base_url=environment["OPENAI_BASE_URL"],
            api_key=environment["OPENAI_API_KEY"],
            max_retries=0,
        )
    with ConversationStore(f"sqlite:///{db}", auto_upgrade=True) as store:
        return run_agent_loop(
            client,
            store,
            store.create_conversation(),
            {"add": add, "multiply": multiply},
            model="demo-model-1",
            messages=QUESTION,
            format=fmt,  # type: ignore[arg-type]
        )


def _environment(stdout_lines: list[str]) -> dict[str, str]:
    environment = {}
    for line in stdout_lines:
        assert line.startswith("export "), line
        name, _, value = line.removeprefix("export ").partition("=")
        environment[name] = value
    return environment


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# -- ReplayServer(repeat=True) ----------------------------------------------------------------


def test_repeat_plays_the_script_for_every_new_conversation(tmp_path: Path) -> None:
    """Without repeat the third request is refused; with it, every conversation gets the whole
    script, and a conversation abandoned after its first turn does not spoil the next one."""
    with ReplayServer(demo_script()) as once:
        env = {"OPENAI_BASE_URL": once.base_url, "OPENAI_API_KEY": "k"}
        assert _run_loop(env, "chat", tmp_path / "a.db").status == "completed"
        status, body = _post(once.chat_url, {"stream": True, "messages": QUESTION})
        assert status == 400 and "no turn left" in body["error"]["message"]
    lines: list[str] = []
    with ReplayServer(demo_script(), repeat=True, log=lines.append) as server:
        env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "k"}
        for _ in range(2):
            assert _run_loop(env, "chat", tmp_path / "b.db").status == "completed"
        # a conversation that stops after its first turn, then a whole one
        assert _post(server.chat_url, {"stream": True, "messages": QUESTION})[0] == 200
        assert _run_loop(env, "chat", tmp_path / "b.db").status == "completed"
        assert server.failures == []
    assert len(lines) == 7
    assert lines[0] == "POST /v1/chat/completions: 200, turn 1 of 2 (parallel_add_multiply.sse)"


def test_repeat_still_checks_what_comes_back() -> None:
    """A follow-up whose tool result answers no call is refused with 400 and logged."""
    lines: list[str] = []
    with ReplayServer(demo_script(), repeat=True, log=lines.append) as server:
        assert _post(server.chat_url, {"stream": True, "messages": QUESTION})[0] == 200
        wrong = [*QUESTION, {"role": "tool", "tool_call_id": "nope", "content": "1"}]
        status, body = _post(server.chat_url, {"stream": True, "messages": wrong})
    assert status == 400 and body["error"]["message"] == server.failures[0].message
    assert lines[-1].startswith("POST /v1/chat/completions: 400 refused: ")


@pytest.mark.parametrize(
    ("body", "carries"),
    [
        ({"messages": QUESTION}, False),
        ({"messages": [*QUESTION, {"role": "tool", "content": "1"}]}, True),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, True),
        ({"input": "hi", "previous_response_id": "resp_1"}, True),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, True),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, False),
        (None, False),
    ],
)
def test_carries_tool_results(body: Any, carries: bool) -> None:
    assert carries_tool_results(body) is carries


def test_replay_server_listens_where_it_is_told() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with ReplayServer(demo_script(), port=free) as server:
        assert (server.port, server.url) == (free, f"http://127.0.0.1:{free}")
    with ReplayServer(demo_script(), host="0.0.0.0") as everywhere:
        assert everywhere.url == f"http://127.0.0.1:{everywhere.port}"
    with pytest.raises(ValueError, match="port must be from 0 to 65535"):
        ReplayServer(demo_script(), port=70000)


# -- the command, in-process ------------------------------------------------------------------


def test_command_in_process_prints_the_environment_and_stops_on_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While it serves (its wait replaced by a run of the agent loop built from what it
    printed), the official client works against it; Ctrl-C is exit 130."""
    import fsm.cli.replay as command

    printed: list[str] = []
    results: list[Any] = []
    real_echo = command.click.echo

    def echo(message: Any = None, *args: Any, err: bool = False, **kwargs: Any) -> None:
        if not err:
            printed.append(str(message))
        real_echo(message, *args, err=err, **kwargs)

    def wait() -> None:
        results.append(_run_loop(_environment(printed), "chat", tmp_path / "c.db"))
        raise KeyboardInterrupt

    monkeypatch.setattr(command.click, "echo", echo)
    monkeypatch.setattr(command, "_wait_for_ctrl_c", wait)
    done = CliRunner().invoke(cli, ["replay", "--port", "0"])
    assert done.exit_code == EXIT_INTERRUPTED, done.output
    assert [r.status for r in results] == ["completed"]
    environment = _environment(printed)
    assert sorted(environment) == [
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_BASE_URL",
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
    ]
    assert environment["OPENAI_BASE_URL"] == environment["ANTHROPIC_BASE_URL"] + "/v1"


def test_command_refuses_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = CliRunner().invoke(cli, ["replay", "--port", str(port)])
    assert done.exit_code == EXIT_UNUSABLE
    assert f"cannot listen on 127.0.0.1:{port}" in done.output


def test_command_help_says_what_it_prints() -> None:
    done = CliRunner().invoke(cli, ["replay", "--help"])
    assert done.exit_code == 0
    for word in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "--format", "Ctrl-C", "130"):
        assert word in done.output
    assert "replay" in CliRunner().invoke(cli, ["--help"]).output


# -- the command, as a real process -----------------------------------------------------------


def _start(*args: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env["PYTHONPATH"] = str(REPO)
    process = subprocess.Popen(
        [sys.executable, "-m", "fsm", "replay", "--port", "0", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    timer = threading.Timer(30, process.kill)  # never hang the suite
    timer.start()
    try:
        lines = [process.stdout.readline().strip() for _ in range(4)]
    finally:
        timer.cancel()
    return process, _environment(lines)


def _stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=20)
    return process.returncode, stderr


@pytest.mark.parametrize("fmt", ["chat", "responses", "anthropic"])
def test_command_as_a_process_serves_each_format_until_sigint(fmt: str, tmp_path: Path) -> None:
    process, environment = _start("--format", fmt)
    try:
        for run in range(2):  # the script plays again for the second conversation
            result = _run_loop(environment, fmt, tmp_path / f"{run}.db")
            assert result.status == "completed"
            assert "6912" in result.content and "408" in result.content
    finally:
        code, stderr = _stop(process)
    assert code == EXIT_INTERRUPTED
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == "stopped"
    assert stderr.count(": 200, turn ") == 4
