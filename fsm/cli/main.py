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

__all__ = [
    "EXIT_BY_CLASS",
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

# One exit status per outcome, the same for every command (the manual's exit status page,
# docs/reference/exit-status.md, is generated from these and their comments):
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
#: the database is corrupt: the engine's own integrity check failed, or the stored history
#: breaks the contract the database enforces (it was edited with enforcement off)
EXIT_CORRUPT = 7
#: an unexpected internal error (a bug: please report it)
EXIT_INTERNAL = 70
#: interrupted (Ctrl-C), as shells report SIGINT
EXIT_INTERRUPTED = 130


#: The exit status of each typed error, by class: the most specific class of an error's MRO
#: listed here decides. Store classes are named by module path, so that the command line does
#: not import the store (and SQLAlchemy) to start; a test checks every name resolves.
EXIT_BY_CLASS: dict[str, int] = {
    "fsm.errors.RemoteProtocolError": EXIT_UNUSABLE,
    "fsm.errors.LocalProtocolError": EXIT_UNUSABLE,
    "fsm.errors.IncompleteTurnError": EXIT_INCOMPLETE,
    "fsm.store.errors.DatabaseUrlError": EXIT_UNUSABLE,
    "fsm.store.errors.DriverMissingError": EXIT_UNUSABLE,
    "fsm.store.errors.InvalidFilterError": EXIT_UNUSABLE,
    "fsm.store.errors.UnknownRevisionError": EXIT_UNUSABLE,
    "fsm.store.errors.StoreLayoutError": EXIT_UNUSABLE,
    "fsm.store.errors.CommitOutcomeUnknownError": EXIT_OUTCOME_UNKNOWN,
    "fsm.store.errors.StoreUnavailableError": EXIT_UNAVAILABLE,
    "fsm.store.errors.StoreBusyError": EXIT_UNAVAILABLE,
    "fsm.store.errors.StorageFullError": EXIT_FULL,
    "fsm.store.errors.DatabaseCorruptError": EXIT_CORRUPT,
    "fsm.store.errors.CorruptStoreError": EXIT_CORRUPT,
    "fsm.store.errors.StoreError": EXIT_STORE,
    "fsm.errors.FsmError": EXIT_INCOMPLETE,
}


def exit_code_for(error: BaseException) -> int:
    """The exit status a typed error maps to (:data:`EXIT_BY_CLASS`; any other error is
    :data:`EXIT_INTERNAL`)."""
    for cls in type(error).__mro__:
        code = EXIT_BY_CLASS.get(f"{cls.__module__}.{cls.__qualname__}")
        if code is not None:
            return code
    return EXIT_INTERNAL


#: the usage error of a group called without a command (click 8.2+), which shows the help
_NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_NeverRaised", (click.UsageError,), {})
)


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
