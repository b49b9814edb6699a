"""The options the commands share, each declared once (in the style of sqlite-utils).

* :func:`db_option`: ``--db URL``, one help text for every command (a command adds a note:
  read-only for the audit, created or upgraded for the demo); :func:`read_db_options` adds
  ``--read-db URL`` (``$FSM_READ_DB_URL``: a replica) to the commands that only read;
* :func:`filter_options`: the audit's filters (``--tool``, ``--state``, ``--reason``,
  ``--conversation``, ``--model``, ``--since``, ``--until``), handed to the command as one
  ``filters`` mapping of the keywords the :mod:`fsm.store.audit` functions take;
* :func:`paging_options`: ``--limit``, ``--offset``, ``--after``, handed over as one
  :class:`Page`: a table shows 100 rows unless ``--limit`` says otherwise, the machine formats
  every row (streamed); whenever a listing stops at its limit with rows left, stderr says how
  to get the next page, in every format (:meth:`Page.for_output`, :meth:`Page.more`);
* :func:`output_options`: ``--table``, ``--json``, ``--nl``, ``--csv``, ``--tsv``,
  ``--no-headers``, ``--max-width``, ``--columns``, handed over as one
  :class:`~fsm.cli.output.OutputFormat`;
  :func:`json_document_option` is the ``--json`` of a command that prints one document;
* :func:`count_option`: an option that takes a whole number ``N``; :func:`whole_number` is its
  type (at most :data:`INT64_MAX`, so that no number overflows the database's integers).

Choices come from the definitions, not from lists kept here: the states from
:class:`~fsm.states.ToolCallState` (:data:`STATES`, :data:`FAILED_STATES`). Help that lists what
only the store defines (the violation kinds, which need SQLAlchemy, which the command line must not
load at start-up) is generated when it is first read: see :class:`GeneratedHelpCommand`.

(``fsm parse`` declares its own ``--json`` for now: its module belongs to the parser's side.)
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from fsm import states
from fsm.cli.output import FORMATS, OutputFormat
from fsm.states import ToolCallState

__all__ = [
    "FAILED_STATES",
    "INT64_MAX",
    "STATES",
    "TABLE_LIMIT",
    "TIME_HELP",
    "GeneratedHelpCommand",
    "Page",
    "count_option",
    "db_option",
    "filter_options",
    "json_document_option",
    "output_options",
    "paging_options",
    "read_db_options",
    "whole_number",
]

F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[F], F]

#: every state of a tool call, as ``--state`` spells it.
STATES: tuple[str, ...] = tuple(state.value for state in ToolCallState)
#: the states of a call that failed (final, and not finished).
FAILED_STATES: tuple[str, ...] = tuple(state.value for state in states.FAILED_STATES)

_DB_HELP = (
    "Database URL (sqlite:///path.db, postgresql+psycopg://user@host/db) or SQLite file path "
    "(chat.db). Default: $FSM_DB_URL, else the SQLite file $FSM_DB, else ./fsm.db."
)
TIME_HELP = "ISO 8601 date or time; naive times are UTC."


def _apply(function: F, options: Sequence[Callable[[F], F]]) -> F:
    """``function`` with ``options`` added, the first listed shown first in ``--help``."""
    for option in reversed(options):
        function = option(function)
    return function


def _gather(function: F, build: Callable[[dict[str, Any]], tuple[str, Any]]) -> F:
    """``function`` called with the keywords ``build`` turns into one: ``build`` pops the
    options' keywords from the mapping it gets and returns the new keyword and its value."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        name, value = build(kwargs)
        kwargs[name] = value
        return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def db_option(note: str = "") -> Decorator[Any]:
    """``--db URL`` (the command receives ``url``; ``None`` means the default), with ``note``
    after the shared help text."""
    text = f"{_DB_HELP} {note}" if note else _DB_HELP
    return click.option("--db", "url", metavar="URL", default=None, help=text)


_READ_DB_HELP = (
    "Read from this database instead of --db: a streaming replica (hot standby) of it, to keep "
    "audit reads off the primary (a conversation committed a moment ago may not be there yet: "
    "replication lag). Default: $FSM_READ_DB_URL, else --db."
)


def read_db_options(note: str = "") -> Decorator[Any]:
    """``--db URL`` and ``--read-db URL`` (default ``$FSM_READ_DB_URL``) for a command that only
    reads: the command receives ``url``, the read URL when one is given, else ``--db``."""

    def build(kwargs: dict[str, Any]) -> tuple[str, Any]:
        read_url, url = kwargs.pop("read_url"), kwargs.pop("url")
        return "url", read_url or url

    def decorate(function: F) -> F:
        return _apply(
            _gather(function, build),
            [
                db_option(note),
                click.option(
                    "--read-db",
                    "read_url",
                    metavar="URL",
                    default=None,
                    envvar="FSM_READ_DB_URL",
                    help=_READ_DB_HELP,
                ),
            ],
        )

    return decorate


#: the largest whole number an option takes: what both engines hold in a 64-bit integer.
INT64_MAX = 2**63 - 1


def whole_number(minimum: int = 0) -> click.IntRange:
    """The type of an option that takes a whole number from ``minimum`` to :data:`INT64_MAX`
    (a larger one would overflow the database's integers: refused as a usage error)."""
    return click.IntRange(min=minimum, max=INT64_MAX)


def count_option(flag: str, *, default: int, help: str, minimum: int = 0) -> Decorator[Any]:
    """An option that takes a whole number ``N`` of at least ``minimum``, default shown."""
    return click.option(
        flag,
        type=whole_number(minimum),
        default=default,
        show_default=True,
        metavar="N",
        help=help,
    )


# -- the audit's filters -------------------------------------------------------------------------
#: every keyword :func:`filter_options` may hand over (those of the options a command asked for).
_FILTERS = ("name", "state", "reason", "conversation", "model", "since", "until")


def filter_options(
    *,
    tool: bool = False,
    states: Sequence[str] = (),
    state_help: str = "Only this state.",
    reason: bool = False,
) -> Decorator[Any]:
    """The audit's filters: ``--conversation``, ``--model``, ``--since``, ``--until``, and if
    asked ``--tool``, ``--state`` (one of ``states``) and ``--reason``. The command receives them
    as one ``filters`` dict, keyed as the :mod:`fsm.store.audit` functions take them (``name``
    for ``--tool``), each present whether given or not."""
    options: list[Decorator[Any]] = []
    if tool:
        options.append(
            click.option("--tool", "name", metavar="NAME", help="Only calls of this tool.")
        )
    if states:
        options.append(click.option("--state", type=click.Choice(states), help=state_help))
    if reason:
        options.append(
            click.option("--reason", metavar="REASON", help="Only this reason (length, eof, ...).")
        )
    options += [
        click.option("--conversation", metavar="ID", help="Only this conversation."),
        click.option("--model", metavar="NAME", help="Only turns of this model."),
        click.option("--since", metavar="TIME", help=f"From this time on (inclusive). {TIME_HELP}"),
        click.option("--until", metavar="TIME", help=f"Before this time (exclusive). {TIME_HELP}"),
    ]

    def build(kwargs: dict[str, Any]) -> tuple[str, Any]:
        return "filters", {key: kwargs.pop(key) for key in _FILTERS if key in kwargs}

    def decorate(function: F) -> F:
        return _apply(_gather(function, build), options)

    return decorate


# -- paging --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Page:
    """Which rows a listing shows: ``limit`` (0: all of them), ``offset``, and the cursor
    ``after`` (the key of the last row shown, as :meth:`cursor` wrote it); ``limit_given``
    says whether ``--limit`` was given (else :meth:`for_output` picks the format's default)."""

    limit: int = 100
    offset: int = 0
    after: str | None = None
    limit_given: bool = True

    def for_output(self, output: OutputFormat) -> Page:
        """This page for ``output``: without ``--limit``, a table shows :data:`TABLE_LIMIT`
        rows and a machine format (JSON, JSON lines, CSV, TSV) every row, streamed a page at a
        time, so that a script never gets a silently cut listing."""
        if self.limit_given or output.is_table:
            return self
        return Page(0, self.offset, self.after)

    def query(self, key_size: int, check: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """The paging keywords of the :mod:`fsm.store.audit` listings (``limit``, ``offset``,
        ``after``), for a listing whose keys have ``key_size`` parts; ``check`` (the listing's
        key check, such as :func:`fsm.store.audit.call_key`) refuses a key none of its rows can
        have with a ``ValueError``: a usage error, as a cursor that does not decode is."""
        return {
            "limit": self.limit or None,
            "offset": self.offset,
            "after": self._key(key_size, check),
        }

    def _key(self, size: int, check: Callable[[Any], Any] | None) -> tuple[Any, ...] | None:
        text = self.after
        if text is None:
            return None
        try:
            key = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        except (ValueError, binascii.Error):
            key = None
        fits = isinstance(key, list) and len(key) == size and all(map(_key_part, key))
        if fits and check is not None:
            try:
                check(tuple(key))
            except ValueError:
                fits = False
        if not fits:
            raise click.BadParameter(
                f"{text!r} is not a cursor of this command: not one fsm printed (copy the "
                "--after that a full page printed on stderr)",
                param_hint="--after",
            )
        return tuple(key)

    @staticmethod
    def cursor(key: Any) -> str:
        """An opaque, shell-safe cursor for a row key."""
        raw = json.dumps(list(key), separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def more(self, output: OutputFormat, shown: int, last_key: Any) -> None:
        """On a full page, in every format, say on stderr how to get the next one (stdout
        stays exactly the rows)."""
        if self.limit and shown == self.limit and last_key is not None:
            click.echo(f"more rows may follow: add --after {self.cursor(last_key)}", err=True)


#: the rows a table shows when ``--limit`` is not given.
TABLE_LIMIT = 100


def _key_part(value: Any) -> bool:
    """Whether ``value`` can be part of a row key: text, or a whole number the engines hold."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -INT64_MAX - 1 <= value <= INT64_MAX
    return value is None or isinstance(value, str)


def paging_options(function: F) -> F:
    """``--limit``, ``--offset``, ``--after``; the command receives them as ``page: Page``
    (pass it through :meth:`Page.for_output`)."""

    def build(kwargs: dict[str, Any]) -> tuple[str, Any]:
        source = click.get_current_context().get_parameter_source("limit")
        given = source is not None and source is not click.core.ParameterSource.DEFAULT
        page = Page(kwargs.pop("limit"), kwargs.pop("offset"), kwargs.pop("after"), given)
        return "page", page

    return _apply(
        _gather(function, build),
        [
            count_option(
                "--limit",
                default=TABLE_LIMIT,
                help="At most N rows (0: all of them, read a page at a time). Without it a "
                "table shows 100 rows and --json, --nl, --csv, --tsv every row; a listing "
                "that stops at its limit says on stderr how to continue.",
            ),
            click.option(
                "--offset", type=whole_number(), default=0, metavar="N", help="Skip N rows."
            ),
            click.option(
                "--after",
                metavar="CURSOR",
                help="Start after this row (the cursor a full page prints on stderr).",
            ),
        ],
    )


# -- output --------------------------------------------------------------------------------------
#: each format's flag help, in the order of :data:`~fsm.cli.output.FORMATS`.
_FORMAT_HELP: Mapping[str, str] = {
    "table": "An aligned table (the default).",
    "json": "One JSON array of objects.",
    "nl": "One JSON object per line.",
    "csv": "CSV with a header row.",
    "tsv": "Tab-separated values.",
}


def output_options(function: F) -> F:
    """The shared output flags of every listing command; it receives ``output: OutputFormat``."""

    def build(kwargs: dict[str, Any]) -> tuple[str, Any]:
        chosen = [kind for kind in FORMATS if kwargs.pop(f"fmt_{kind}")]
        if len(chosen) > 1:
            flags = ", ".join(f"--{kind}" for kind in chosen)
            raise click.UsageError(f"choose one output format, not {flags}")
        return "output", OutputFormat(
            kind=chosen[0] if chosen else "table",
            headers=not kwargs.pop("no_headers"),
            max_width=kwargs.pop("max_width"),
            columns=_columns(kwargs.pop("columns")),
        )

    return _apply(
        _gather(function, build),
        [
            *(
                click.option(f"--{kind}", f"fmt_{kind}", is_flag=True, help=_FORMAT_HELP[kind])
                for kind in FORMATS
            ),
            click.option("--no-headers", is_flag=True, help="No header row (table, CSV, TSV)."),
            count_option(
                "--max-width",
                default=60,
                help="Cut table cells to N characters, and fit the table to the terminal "
                "($COLUMNS, else the terminal's width) by cutting its widest columns (0: never "
                "cut). Other formats are never cut.",
            ),
            click.option(
                "--columns",
                metavar="A,B,...",
                help="Only these columns, in this order (any format); an unknown name lists "
                "the valid ones.",
            ),
        ],
    )


def _columns(text: str | None) -> tuple[str, ...] | None:
    """``--columns a,b,c`` as names (spaces around them ignored)."""
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of column names", param_hint="--columns"
        )
    return names


def json_document_option(help: str) -> Decorator[Any]:
    """``--json`` for a command that prints one JSON document (it receives ``as_json``)."""
    return click.option("--json", "as_json", is_flag=True, help=help)


# -- help generated from the definitions -----------------------------------------------------------
class GeneratedHelpCommand(click.Command):
    """A command whose help has parts generated from definitions: each ``{name}`` in its
    docstring is replaced by ``parts[name]()`` when the help is first read (``--help``, or
    ``command.help``), so that a definition which needs SQLAlchemy (the violation kinds) is
    loaded then, not when the command line starts. A part may span lines; each of its lines is
    indented as the line of its marker."""

    def __init__(
        self, *args: Any, parts: Mapping[str, Callable[[], str]] | None = None, **kwargs: Any
    ) -> None:
        self._parts = dict(parts or {})
        self._template: str | None = None
        self._filled: str | None = None
        super().__init__(*args, **kwargs)

    @property
    def help(self) -> str | None:
        if self._filled is None and self._template is not None:
            lines = []
            for line in inspect.cleandoc(self._template).splitlines():
                indent = line[: len(line) - len(line.lstrip())]
                for name, make in self._parts.items():
                    marker = "{" + name + "}"
                    if marker in line:
                        line = line.replace(marker, ("\n" + indent).join(make().splitlines()))
                lines.append(line)
            self._filled = "\n".join(lines)
        return self._filled

    @help.setter
    def help(self, value: str | None) -> None:
        self._template = value
        self._filled = None
