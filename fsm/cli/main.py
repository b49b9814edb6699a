"""The ``fsm`` command group and its error handling.

Every command raises typed :class:`~fsm.errors.FsmError` subclasses; this module turns them into
one line on stderr and a non-zero exit status, never a traceback. Set ``FSM_DEBUG=1`` to see the
traceback of an unexpected error.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from fsm import __version__
from fsm.errors import FsmError, RemoteProtocolError

__all__ = [
    "EXIT_CORRUPT",
    "EXIT_FULL",
    "EXIT_INCOMPLETE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OUTCOME_UNKNOWN",
    "EXIT_STORE",
    "EXIT_UNAVAILABLE",
    "EXIT_UNUSABLE",
    "cli",
    "main",
]

# One exit status per outcome, the same for every command (the README's "Exit status" table):
#: the work was done and the result is incomplete or not clean (a stream that did not complete,
#: a turn recorded as a failed attempt, an audit check that found violations)
EXIT_INCOMPLETE = 1
#: a usage error or unusable input (a bad option or URL, input that is not a stream)
EXIT_UNUSABLE = 2
#: the store refused the request (not found, conflict, schema not at head, value rejected)
EXIT_STORE = 3
#: the database could not be reached or stayed busy: nothing was written, retry later
EXIT_UNAVAILABLE = 4
#: the connection was lost while COMMIT was in flight: retry with the same idempotency key
EXIT_OUTCOME_UNKNOWN = 5
#: the disk or the database is full: nothing was written
EXIT_FULL = 6
#: the database file itself is corrupt (the engine's own integrity check failed)
EXIT_CORRUPT = 7
#: an unexpected internal error (a bug: please report it)
EXIT_INTERNAL = 70
#: interrupted (Ctrl-C), as shells report SIGINT
EXIT_INTERRUPTED = 130


def exit_code_for(error: BaseException) -> int:
    """The exit status a typed error maps to."""
    if isinstance(error, RemoteProtocolError):
        return EXIT_UNUSABLE
    code = getattr(error, "exit_code", None)
    return code if isinstance(code, int) else 1


class FsmGroup(click.Group):
    """A click group that prints typed errors without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except FsmError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exit_code_for(exc))
        except OSError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_UNUSABLE)
        except Exception as exc:
            if os.environ.get("FSM_DEBUG"):
                raise
            click.echo(
                f"internal error: {type(exc).__name__}: {exc} (set FSM_DEBUG=1 for the traceback; "
                "please report it)",
                err=True,
            )
            ctx.exit(EXIT_INTERNAL)


@click.group(cls=FsmGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fsm")
def cli() -> None:
    """fsm: streamed LLM tool calls turned into trustworthy conversation history.

    \b
    Examples:
      fsm parse stream.sse
      fsm parse --json - < stream.sse
    """


def _register() -> None:
    from fsm.cli.audit import audit
    from fsm.cli.conversations import conversations
    from fsm.cli.demo import demo
    from fsm.cli.parse import parse_command
    from fsm.cli.store import db, history, ingest

    for command in (parse_command, db, ingest, history, conversations, audit, demo):
        cli.add_command(command)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="fsm")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
