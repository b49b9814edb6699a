"""``fsm conversations``: list the store's conversations, with counts and last activity.

A thin wrapper over :meth:`fsm.store.ConversationStore.list_conversations`, with the shared
paging and output options of :mod:`fsm.cli.options` (a table of 100 rows by default; ``--json``,
``--nl``, ``--csv``, ``--tsv`` print every row, a page at a time, unless ``--limit`` says
otherwise).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import click

from fsm.cli.options import Page, output_options, paging_options, read_db_options
from fsm.cli.output import OutputFormat, emit

__all__ = ["COLUMNS", "conversations"]

#: the columns of the listing, as ``--columns`` names them (the fields of ``ConversationInfo``).
COLUMNS = ("id", "created_at", "messages", "turns", "attempts", "last_activity", "metadata")
#: conversations read per query when a listing has no limit.
_BATCH = 1000


@click.command(name="conversations")
@read_db_options("Opened read-only.")
@paging_options
@output_options
def conversations(url: str | None, page: Page, output: OutputFormat) -> None:
    """List the conversations of the store, in id order: when each was created, its number of
    history messages, of turns (assistant messages) and of recorded attempts, and its last
    activity (its newest message or attempt). Times are UTC.

    \b
    Examples:
      fsm conversations --db sqlite:///chat.db
      fsm conversations --columns id,messages,last_activity --limit 20
      fsm conversations --json | jq -r '.[] | select(.attempts > 0) | .id'
      fsm history --db sqlite:///chat.db "$(fsm conversations --tsv --no-headers --columns id --limit 1)"
    """
    from fsm.cli.readonly import read_only_store
    from fsm.store.core import StoreCore
    from fsm.store.store import check_listing

    page = page.for_output(output)
    key = page.query(key_size=1)["after"]
    after: str | None = None if key is None else key[0]
    if key is not None and not isinstance(after, str):
        raise click.BadParameter(
            f"{page.after!r} is not a cursor of this command", param_hint="--after"
        )
    last: list[Any] = [None]
    with read_only_store(
        url
    ) as engine:  # read-only: a missing SQLite file is an error, never created
        core = StoreCore(engine.url, postgres=engine.dialect.name == "postgresql")

        def rows() -> Iterator[dict[str, Any]]:
            cursor = after
            left = page.offset + page.limit if page.limit else None
            while left is None or left > 0:
                batch = _BATCH if left is None else min(_BATCH, left)
                check_listing(batch, cursor)
                with engine.connect() as conn, conn.begin():
                    found = core.list_conversations(conn, batch, cursor)
                for info in found:
                    last[0] = info.key
                    yield info.as_dict()
                if len(found) < batch:
                    return
                cursor = found[-1].id
                if left is not None:
                    left -= len(found)

        shown = emit(itertools.islice(rows(), page.offset, None), output, columns=COLUMNS)
    page.more(output, shown, None if last[0] is None else [last[0]])
