"""The ``fsm`` command group and its error handling.

Every command raises typed :class:`~fsm.errors.FsmError` subclasses; this module turns them into
one line on stderr and a non-zero exit status, never a traceback. Set ``FSM_DEBUG=1`` to see the
traceback of an unexpected error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from fsm import __version__
from fsm.errors import FsmError
from fsm.exitstatus import (
    EXIT_CORRUPT,
    EXIT_FULL,
    EXIT_INCOMPLETE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OUTCOME_UNKNOWN,
    EXIT_STORE,
    EXIT_UNAVAILABLE,
    EXIT_UNUSABLE,
)

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
    "exit_code_for",
    "main",
]

# One exit status per outcome, the same for every command: the EXIT_* constants of
# fsm.exitstatus (re-exported here), each typed error carrying its own as ``exit_code``; the
# manual's exit status page, docs/reference/exit-status.md, is generated from both.


def exit_code_for(error: BaseException) -> int:
    """The exit status a typed error maps to: its class's ``exit_code`` (the most specific
    class that sets it decides); any other error is :data:`EXIT_INTERNAL`."""
    if isinstance(error, FsmError):
        return error.exit_code
    return EXIT_INTERNAL


#: the usage error of a group called without a command (click 8.2+), which shows the help
_NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_NeverRaised", (click.UsageError,), {})
)


def _ignore_unraisable(_unraisable: Any) -> None:
    """An ``unraisablehook`` that prints nothing (set once Ctrl-C ended the command)."""


def _quiet_stdout() -> None:
    """Point standard output at the null device, so that the interpreter's last flush of what
    is still buffered does not fail again on the closed pipe (Python's documented recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass
    finally:
        os.close(devnull)


def _one_line(text: str) -> str:
    return " ".join(text.split())


class FsmGroup(click.Group):
    """A click group that prints every error as one line on stderr, with its exit status:
    typed errors, usage errors, and Ctrl-C (130); never a traceback."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # `fsm` or `fsm audit` alone: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = ""
            if exc.ctx is not None:
                hint = f" (see: {exc.ctx.command_path} --help)"
            click.echo(f"error: {_one_line(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {_one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            click.echo("error: interrupted (Ctrl-C): nothing more was done", err=True)
            # an object the interrupt left half built (an SDK client caught in its __init__)
            # may fail in its __del__ as the interpreter exits: that is no news to the user
            sys.unraisablehook = _ignore_unraisable
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.ClickException, KeyboardInterrupt):
            raise
        except BrokenPipeError:  # the reader went away (`fsm history c1 | head -1`): done
            _quiet_stdout()
            ctx.exit(0)
        except FsmError as exc:
            click.echo(f"error: {_one_line(str(exc))}", err=True)
            ctx.exit(exit_code_for(exc))
        except OSError as exc:
            click.echo(f"error: {_one_line(str(exc))}", err=True)
            ctx.exit(EXIT_UNUSABLE)
        except Exception as exc:
            if os.environ.get("FSM_DEBUG"):
                raise
            click.echo(
                f"internal error: {type(exc).__name__}: {_one_line(str(exc))} (set FSM_DEBUG=1 "
                "for the traceback; please report it)",
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

    \b
    Exit status (the same for every command):
      0    done
      1    done, and the result is incomplete or not clean (a turn that is not
           complete, recorded as an attempt; violations found; schema not at head)
      2    a usage error or unusable input (an option, a --db URL, a missing
           driver, input that is not a stream)
      3    the store refused (no such database, schema not at head, not found,
           conflict, a value or a file it cannot use)
      4    the database cannot be reached or stayed busy: nothing written, retry
      5    the connection was lost during COMMIT: retry with the same key
      6    the disk or the database is full: nothing written
      7    the database is corrupt
      70   an internal error (a bug: please report it)
      130  interrupted (Ctrl-C)
    """


def _register() -> None:
    from fsm.cli.audit import audit
    from fsm.cli.conversations import conversations
    from fsm.cli.demo import demo
    from fsm.cli.parse import parse_command
    from fsm.cli.replay import replay
    from fsm.cli.store import db, history, ingest

    for command in (parse_command, db, ingest, history, conversations, audit, demo, replay):
        cli.add_command(command)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="fsm")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
