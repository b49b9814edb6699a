"""``fsm replay``: the offline replay server on its own, for the examples and your own code.

It starts :class:`fsm.replay.ReplayServer` on the demo conversation (:func:`fsm.replay.demo_script`:
two tool calls, ``add`` and ``multiply``, then the final answer) in the chosen API's streams, plays
it again for every new conversation, prints the environment variables that point the official
``openai`` and ``anthropic`` clients at it, and serves until Ctrl-C (exit status 130).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import click

__all__ = ["replay", "replay_environment"]


def replay_environment(openai_base_url: str, anthropic_base_url: str) -> dict[str, str]:
    """The environment variables that point the official clients at a replay server: the
    ``openai`` client reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, the ``anthropic`` client
    ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` (the server accepts any key)."""
    return {
        "OPENAI_BASE_URL": openai_base_url,
        "OPENAI_API_KEY": "fsm-replay",
        "ANTHROPIC_BASE_URL": anthropic_base_url,
        "ANTHROPIC_API_KEY": "fsm-replay",
    }


def _wait_for_ctrl_c() -> None:
    """Block until Ctrl-C (KeyboardInterrupt); the server answers from its own thread."""
    threading.Event().wait()


@click.command(name="replay")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The address to listen on (the default, loopback, lets only this machine in).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8766,
    show_default=True,
    help="The port to listen on (0: any free port).",
)
@click.option(
    "--format",
    "stream_format",
    type=click.Choice(["chat", "responses", "anthropic"]),
    default="chat",
    show_default=True,
    help="The API whose streams are replayed: Chat Completions (POST /v1/chat/completions), "
    "the Responses API (POST /v1/responses) or Anthropic Messages (POST /v1/messages).",
)
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds between the replayed stream's events (0: as fast as possible).",
)
@click.option("--quiet", is_flag=True, help="Do not log each request on stderr.")
def replay(host: str, port: int, stream_format: str, delay: float, quiet: bool) -> None:
    """Serve fsm's demo conversation offline, as an OpenAI- and Anthropic-compatible API.

    The model's side of the conversation is recorded: to "What is 1234 + 5678 and 12 * 34?" it
    calls add and multiply, then answers with their results. Every new conversation (a request
    with no tool result) plays it from the start. From the second request of a conversation
    the server checks what the client sends back (the calls byte for byte, one result per
    call, in order) and refuses a wrong request with HTTP 400 saying why.

    Standard output is the environment, one export line per variable, that points the official
    openai (OPENAI_BASE_URL, OPENAI_API_KEY) and anthropic (ANTHROPIC_BASE_URL,
    ANTHROPIC_API_KEY) clients at the server; paste it in the shell that runs your code. Each
    request is logged on stderr (--quiet: not). It serves until Ctrl-C (exit status 130).

    \b
    Examples:
      fsm replay
      fsm replay --format anthropic --port 9000
      fsm replay --port 0 --quiet > replay.env   # then: . ./replay.env
    """
    from fsm.exitstatus import EXIT_INTERRUPTED
    from fsm.replay import ReplayServer, demo_script

    fmt: Any = stream_format

    def log(line: str) -> None:
        click.echo(line, err=True)

    server = ReplayServer(
        demo_script(delay=delay, format=fmt),
        host=host,
        port=port,
        repeat=True,
        log=None if quiet else log,
    )
    try:
        server.start()
    except OSError as exc:
        raise click.UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        for name, value in replay_environment(server.base_url, server.url).items():
            click.echo(f"export {name}={value}")
        sys.stdout.flush()
        api = {"chat": "Chat Completions", "responses": "Responses API", "anthropic": "Messages"}
        click.echo(
            f"replaying fsm's demo conversation ({api[fmt]} streams) at {server.url}; Ctrl-C stops",
            err=True,
        )
        try:
            _wait_for_ctrl_c()
        except KeyboardInterrupt:
            click.echo("stopped", err=True)
            sys.exit(EXIT_INTERRUPTED)
    finally:
        server.stop()
