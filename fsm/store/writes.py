"""The statements of the store's write path, each built once (no I/O here).

Building a SQLAlchemy statement (``sa.select(...).where(...)``) costs several times what
executing it costs once it is compiled; so every statement a write sends is built once per
*shape*, with bind parameters, and SQLAlchemy's compiled cache does the rest. The shapes:

* :func:`lock`: the conversation's row lock (PostgreSQL: ``SELECT ... FOR UPDATE``), which
  serializes the writers of one conversation;
* :func:`state`: everything a write needs to know before it inserts, in one query: whether the
  conversation exists (when no lock query said so), its pending turn (the tool ledger), where an
  earlier commit of the same turn sits (idempotency), and its last message's seq and open slots.
  Run after the lock, as its own statement: under READ COMMITTED each statement reads a fresh
  snapshot, so it sees what the writer the lock waited for committed. :func:`begin_state` is
  the tool ledger's. Both are text, the same on both engines, and written short: they are also
  parts of the merged PostgreSQL statements below, which must stay within psycopg's statement
  cache;
* :func:`insert_row`: ``INSERT`` into one table (SQLite: one per table; several rows go through
  ``executemany``);
* :func:`insert_turn`: PostgreSQL, a whole turn in one statement: the calls in a data-modifying
  ``WITH`` and the assistant message with its results in the ``INSERT`` (the foreign keys are
  checked at the end of the statement, when every row of it is there): one round trip. The tool
  ledger's commit adds its last outcome and the pending turn's resolution to the same statement;
* :func:`checked_insert_turn`: PostgreSQL's ``commit_turn``, :func:`state` and the insert in one
  statement after the lock, the rows inserted only in the common case the state shows;
* :func:`insert_pending`: PostgreSQL, the tool ledger's pending turn and its executions;
* :func:`lock_first`, :func:`lock_held_first`: PostgreSQL, the lock as the SQL sent first in
  the one query of a write begun at once (:data:`fsm.store.engine_config.AT_ONCE`);
* :func:`at_seq`: a turn's row built for seq 1 moved to its seq, as
  :func:`checked_insert_turn` does in SQL (SQLite's rows bound before the write lock).

The lookup of an earlier commit uses ``min(seq + 0)``, not ``min(seq)``: with a bare ``min(seq)``
SQLite (and PostgreSQL, by its estimates) may walk the primary key in seq order looking for the
first match, which for a new turn (no match) reads the whole conversation; ``seq + 0`` leaves the
planner only the index of the key looked up.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from fsm.states import execution_next, ledger_turn_next
from fsm.store.models import Conversation, Message, PendingTurnRow, ToolCallRow, ToolExecution

if TYPE_CHECKING:
    from fsm.parser import Turn

__all__ = [
    "BY_KEY",
    "BY_RESPONSE",
    "MESSAGES",
    "MOVED_COLUMNS",
    "SEQ_COLUMNS",
    "TOOL_CALLS",
    "at_seq",
    "checked_insert_turn",
    "insert_pending",
    "insert_row",
    "insert_turn",
    "insert_values",
    "lock",
    "lock_first",
    "lock_held_first",
    "same_turn",
    "schema",
    "state",
    "turn_params",
]

#: the two tables of history
MESSAGES: Final = cast(sa.Table, Message.__table__)
TOOL_CALLS: Final = cast(sa.Table, ToolCallRow.__table__)
#: the tool ledger's two tables
PENDING_TURNS: Final = cast(sa.Table, PendingTurnRow.__table__)
EXECUTIONS: Final = cast(sa.Table, ToolExecution.__table__)

#: :func:`state`'s ways of finding an earlier commit of the same turn.
BY_KEY: Final = "key"
BY_RESPONSE: Final = "response"


def _cid() -> sa.BindParameter[str]:
    return sa.bindparam("cid", type_=Conversation.__table__.c.id.type)


def same_turn(turn: Turn, idempotency_key: str | None) -> tuple[str | None, dict[str, Any]]:
    """How a write finds an earlier commit of ``turn``: by its idempotency key (:data:`BY_KEY`,
    bind ``key``), else by its response id and choice (:data:`BY_RESPONSE`, binds
    ``response_id``, ``choice``), else not at all (``None``); with the binds."""
    if idempotency_key is not None:
        return BY_KEY, {"key": idempotency_key}
    if turn.response_id:
        return BY_RESPONSE, {"response_id": turn.response_id, "choice": turn.index}
    return None, {}


def schema(conn: Connection | Engine) -> str | None:
    """The schema ``conn`` (or an engine's connections) maps fsm's tables to (its
    ``schema_translate_map``), for the text statements here; ``None``: the ``search_path``."""
    translate = conn.get_execution_options().get("schema_translate_map") or {}
    return cast("str | None", translate.get(None))


@functools.cache
def lock(*, for_update: bool) -> sa.Select[Any]:
    """The conversation's id (bind ``cid``), with its row lock when ``for_update``."""
    query = sa.select(Conversation.id).where(Conversation.id == _cid())
    return query.with_for_update() if for_update else query


@functools.lru_cache(maxsize=64)
def state(schema: str | None, *, exists: bool, same: str | None) -> sa.TextualSelect:
    """One row about the conversation (bind ``cid``) in ``schema`` (``None``: the
    ``search_path``): ``[exists,] pending_id, pending_at_seq, stored_at, last_seq,
    last_slots_left``.

    ``exists`` (1 or NULL) is there when asked for; ``stored_at`` is the seq of an earlier commit
    of the same turn: by idempotency key (``same=BY_KEY``, bind ``key``), by response id and
    choice (``BY_RESPONSE``, binds ``response_id`` and ``choice``), or NULL (``None``)."""
    return (
        sa.text(_state_sql(schema, exists=exists, same=same))
        .bindparams(*_binds(MESSAGES, "cid", same))
        .columns()
    )


def _state_sql(schema: str | None, *, exists: bool, same: str | None, extra: str = "") -> str:
    """:func:`state`'s SELECT (``extra``: more columns after its own), written short: it is
    also part of :func:`checked_insert_turn`, which must stay within psycopg's statement
    cache (4,096 bytes, 50 parameters; a longer statement is parsed again at every run)."""
    conversations = _name(schema, cast(sa.Table, Conversation.__table__))
    turns, messages = _name(schema, PENDING_TURNS), _name(schema, MESSAGES)
    pending = f"FROM {turns} WHERE conversation_id = :cid AND state = 'pending')"
    last = f"FROM {messages} WHERE conversation_id = :cid ORDER BY seq DESC LIMIT 1)"
    stored = "NULL"
    if same is not None:
        found = (
            "idempotency_key = :key"
            if same == BY_KEY
            else "response_id = :response_id AND choice = :choice AND role = 'assistant'"
        )
        stored = f"(SELECT min(seq + 0) FROM {messages} WHERE conversation_id = :cid AND {found})"
    columns = [f"(SELECT id {pending}", f"(SELECT at_seq {pending}", stored]
    columns += [f"(SELECT seq {last}", f"(SELECT slots_left {last}"]
    if exists:
        columns.insert(0, f"(SELECT 1 FROM {conversations} WHERE id = :cid)")
    return f"SELECT {', '.join(columns)}{extra}"


def begin_state(schema: str | None, *, exists: bool, same: str) -> sa.TextualSelect:
    """What the tool ledger's begin reads before it inserts, in one query (bind ``c``):
    ``[exists,] pending_id, done_id, last_seq, last_slots_left``: the conversation's pending
    turn, the latest ledger turn committed under the same idempotency key (``same="key"``, bind
    ``key``) or response id and choice (``"response"``, binds ``response_id`` and ``choice``;
    ``"none"``: NULL), and its last message (the seq the turn takes)."""
    return (
        sa.text(_begin_state_sql(schema, exists=exists, same=same))
        .bindparams(*_binds(PENDING_TURNS, "c", same))
        .columns()
    )


def _begin_state_sql(schema: str | None, *, exists: bool, same: str, extra: str = "") -> str:
    """:func:`begin_state`'s SELECT (``extra``: more columns), written short as
    :func:`_state_sql` (it is also part of :func:`insert_pending`)."""
    conversations = _name(schema, cast(sa.Table, Conversation.__table__))
    turns, messages = _name(schema, PENDING_TURNS), _name(schema, MESSAGES)
    done = "NULL"
    if same != "none":
        found = (
            "idempotency_key = :key"
            if same == BY_KEY
            else "response_id = :response_id AND choice = :choice"
        )
        done = (
            f"(SELECT id FROM {turns} WHERE conversation_id = :c AND state = 'committed' "
            f"AND {found} ORDER BY id DESC LIMIT 1)"
        )
    last = f"FROM {messages} WHERE conversation_id = :c ORDER BY seq DESC LIMIT 1)"
    columns = [
        f"(SELECT id FROM {turns} WHERE conversation_id = :c AND state = 'pending')",
        done,
        f"(SELECT seq {last}",
        f"(SELECT slots_left {last}",
    ]
    if exists:
        columns.insert(0, f"(SELECT 1 FROM {conversations} WHERE id = :c)")
    return f"SELECT {', '.join(columns)}{extra}"


def _name(schema: str | None, table: sa.Table) -> str:
    """``table``'s name in ``schema``, quoted as PostgreSQL and SQLite need it."""
    quote = _QUOTE.quote
    return quote(table.name) if schema is None else f"{quote(schema)}.{quote(table.name)}"


def _binds(table: sa.Table, conversation: str, same: str | None) -> list[Any]:
    """The binds of a reading of ``same`` (``BY_KEY``, ``BY_RESPONSE`` or neither), each with
    its column's type in ``table`` (the codec's encodings): the conversation (named
    ``conversation``), and the key or the response id and choice."""
    c = table.c
    binds = [sa.bindparam(conversation, type_=c.conversation_id.type)]
    if same == BY_KEY:
        binds.append(sa.bindparam("key", type_=c.idempotency_key.type))
    elif same == BY_RESPONSE:
        binds += [
            sa.bindparam("response_id", type_=c.response_id.type),
            sa.bindparam("choice", type_=c.choice.type),
        ]
    return binds


@functools.lru_cache(maxsize=64)
def insert_values(schema: str | None, table: sa.Table, columns: tuple[str, ...]) -> str:
    """``INSERT INTO table (columns) VALUES (?, ...)`` in ``schema`` (``None``: the main
    database), as driver SQL for SQLite (qmark placeholders)."""
    quote = _QUOTE.quote
    return (
        f"INSERT INTO {_name(schema, table)} ({', '.join(quote(c) for c in columns)}) "
        f"VALUES ({', '.join('?' for _ in columns)})"
    )


@functools.cache
def insert_row(table: sa.Table) -> sa.Insert:
    """``INSERT INTO table``: one row, or several through ``executemany`` (cached compiled)."""
    return sa.insert(table)


@functools.lru_cache(maxsize=256)
def insert_turn(
    schema: str | None,
    message_columns: tuple[str, ...],
    call_columns: tuple[str, ...],
    *,
    ledger: bool = False,
    held: bool = False,
) -> sa.TextClause:
    """PostgreSQL: the ``messages`` rows (the assistant message, then one result per call) and
    the ``tool_calls`` rows of a turn, in one statement, in ``schema`` (``None``: the
    ``search_path``): each table's rows ``unnest``-ed from one array per column (binds
    ``m0``, ``m1``, ... and ``c0``, ... by column; see :func:`turn_params`).

    An array per column, not a placeholder per value: the statement's text and its number of
    parameters stay the same whatever the number of calls and small enough (at most 50
    parameters) for psycopg to cache its conversion of the query, which for a
    placeholder per value (some 150 for a turn of 3 calls) it parsed again at every commit:
    more than half of a commit's time in Python. A text statement with typed binds
    (SQLAlchemy caches its compiled form); each element is bound as its column's type (the
    codec's encodings, JSON).

    ``ledger``: the tool ledger's commit of its pending turn (binds ``l_c``, ``l_p``: the
    turn; ``l_pos``, ``l_state``, ``l_result``, ``l_parts``, ``l_error``: the last call's
    outcome; ``l_seq``: the turn's seq). The same statement records that outcome on the call,
    only if the call is ``started`` (an outcome is recorded once), and marks the pending turn
    committed at ``l_seq``; the rows go in only if the outcome was recorded. It returns a row
    per message written: none when the call was not ``started`` (nothing written).
    ``held`` (with ``ledger``): and only if the pending turn is still pending and the
    holder's (bind ``l_holder``; a statement sent after :func:`lock_held_first`)."""
    quote = _QUOTE.quote
    name = functools.partial(_name, schema)

    gate = " WHERE EXISTS (SELECT FROM recorded)" if ledger else ""

    def insert(table: sa.Table, columns: tuple[str, ...], prefix: str) -> str:
        return (
            f"INSERT INTO {name(table)} ({', '.join(quote(c) for c in columns)}) "
            f"SELECT * FROM unnest({_arrays(table, columns, prefix)}){gate}"
        )

    sql = insert(MESSAGES, message_columns, "m")
    binds = _array_binds(MESSAGES, message_columns, "m")
    ctes = []
    if ledger:
        holder = (
            f" AND EXISTS (SELECT FROM {name(PENDING_TURNS)} WHERE conversation_id = :l_c "
            "AND id = :l_p AND state = 'pending' AND owner = :l_holder)"
            if held
            else ""
        )
        finished = ", ".join(
            f"{column} = :l_{value}"
            for column, value in (
                ("state", "state"),
                ("result", "result"),
                ("result_parts", "parts"),
                ("error", "error"),
            )
        )
        ctes += [
            f"recorded AS (UPDATE {name(EXECUTIONS)} SET {finished}, "
            "finished_at = CURRENT_TIMESTAMP WHERE conversation_id = :l_c AND pending_id = :l_p "
            f"AND position = :l_pos AND state = '{_STARTED}'{holder} RETURNING 1)",
            f"resolved AS (UPDATE {name(PENDING_TURNS)} SET state = '{_COMMITTED}', "
            "committed_seq = :l_seq, resolved_at = CURRENT_TIMESTAMP "
            "WHERE conversation_id = :l_c AND id = :l_p AND EXISTS (SELECT FROM recorded))",
        ]
        e = EXECUTIONS.c
        binds += [
            sa.bindparam("l_c", type_=e.conversation_id.type),
            sa.bindparam("l_p", type_=e.pending_id.type),
            sa.bindparam("l_pos", type_=e.position.type),
            sa.bindparam("l_state", type_=e.state.type),
            sa.bindparam("l_result", type_=e.result.type),
            sa.bindparam("l_parts", type_=e.result_parts.type),
            sa.bindparam("l_error", type_=e.error.type),
            sa.bindparam("l_seq", type_=PENDING_TURNS.c.committed_seq.type),
        ]
        if held:
            binds.append(sa.bindparam("l_holder", type_=PENDING_TURNS.c.owner.type))
        sql += " RETURNING 1"
    if call_columns:  # a turn with calls
        ctes.append(f"written_calls AS ({insert(TOOL_CALLS, call_columns, 'c')})")
        binds += _array_binds(TOOL_CALLS, call_columns, "c")
    if ctes:
        sql = f"WITH {', '.join(ctes)} {sql}"
    return sa.text(sql).bindparams(*binds)


@functools.lru_cache(maxsize=64)
def insert_pending(
    schema: str | None,
    turn_columns: tuple[str, ...],
    call_columns: tuple[str, ...],
    *,
    same: str | None = None,
    exists: bool = False,
) -> sa.TextualSelect:
    """PostgreSQL: the tool ledger's pending turn and its calls' executions, in one statement
    in ``schema`` (as :func:`insert_turn`): the ``pending_turns`` row from binds
    ``t_{column}`` with its lease (bind ``lease``, seconds from now by the database's clock),
    the ``tool_executions`` rows ``unnest``-ed from one array per column (binds ``e0``,
    ``e1``, ... by column; the turn's id, conversation and number of calls taken from the row
    just inserted; ``e_started``, not a column: the call is started now). One row per
    execution in position order (one row without an execution for a turn without calls): the
    turn's columns under their names, each execution's prefixed ``e_``.

    ``same`` (``"key"``, ``"response"`` or ``"none"``): begin's reading of the conversation
    first, in the same statement, run after the conversation's lock: its pending turn (``p``),
    the latest turn committed through the ledger under the same idempotency key (bind
    ``key``) or response id and choice (binds ``response_id``, ``choice``; ``"none"``: NULL)
    (``d``), its last message's seq and open slots (``l``, ``sl``); the turn goes in (at the
    next seq, not a bind) only when there is neither, the last tool block is closed and the
    next seq is the one expected (bind ``expected``, NULL: any). Those four columns come first
    in every row; the turn's are NULL when it did not go in. ``exists`` (with ``same``): and
    only if the conversation exists (a statement sent after :func:`lock_first`)."""
    quote = _QUOTE.quote
    name = functools.partial(_name, schema)

    e, t = EXECUTIONS.c, PENDING_TURNS.c
    values = [f":t_{c}" for c in turn_columns]
    inserted = list(turn_columns)
    ctes, selected, state_binds = [], [], []
    if same is None:
        source = f"VALUES ({', '.join(values)}, {_LEASE})"
    else:
        reading = _begin_state_sql(
            schema, exists=exists, same=same, extra=", CAST(:expected AS INTEGER)"
        )
        ctes += _state_ctes(reading, "p, d, l, sl, e", "d", exists)
        inserted.append("at_seq")
        source = f"SELECT {', '.join(values)}, o.n, {_LEASE} FROM o"
        selected = ["st.p", "st.d", "st.l", "st.sl"]
        state_binds = [
            *_binds(PENDING_TURNS, "c", same),
            sa.bindparam("expected", type_=sa.Integer()),
        ]
    own = ("conversation_id", "pending_id", "pending_n_calls", "started_at")
    if call_columns:
        aliases = ", ".join(f"a{i}" for i in range(len(call_columns)))
        executions = (
            f"INSERT INTO {name(EXECUTIONS)} "
            f"({', '.join(quote(c) for c in (*own, *call_columns))}) "
            "SELECT turn.conversation_id, turn.id, turn.n_calls, "
            f"CASE WHEN u.s THEN CURRENT_TIMESTAMP END, {aliases} FROM turn, "
            f"unnest({_arrays(EXECUTIONS, call_columns, 'e')}, CAST(:e_started AS BOOLEAN[])) "
            f"AS u({aliases}, s) RETURNING *"
        )
    else:  # a turn without calls: no execution
        executions = f"SELECT * FROM {name(EXECUTIONS)} WHERE false"
    ctes += [
        f"turn AS (INSERT INTO {name(PENDING_TURNS)} "
        f"({', '.join(quote(c) for c in (*inserted, 'lease_expires_at'))}) {source} "
        "RETURNING *)",
        f"executions AS ({executions})",
    ]
    selected += [f"turn.{quote(c.name)}" for c in PENDING_TURNS.c]
    selected += [f"executions.{quote(c.name)} AS e_{c.name}" for c in e]
    joined = "st LEFT JOIN turn ON true" if same is not None else "turn"
    sql = (
        f"WITH {', '.join(ctes)} SELECT {', '.join(selected)} "
        f"FROM {joined} LEFT JOIN executions ON true ORDER BY executions.position"
    )
    binds = [sa.bindparam(f"t_{c}", type_=t[c].type) for c in turn_columns] + state_binds
    if call_columns:
        binds += _array_binds(EXECUTIONS, call_columns, "e")
        binds.append(sa.bindparam("e_started", type_=postgresql.ARRAY(sa.Boolean(), dimensions=1)))
    columns = [sa.column(c, sa.Integer()) for c in ("p", "d", "l", "sl")] if same else []
    columns += [sa.column(c.name, c.type) for c in PENDING_TURNS.c]
    columns += [sa.column(f"e_{c.name}", c.type) for c in e]
    return sa.text(sql).bindparams(*binds).columns(*columns)


#: the end of a pending turn's lease: now + the bind ``lease`` seconds, by the database's clock
_LEASE: Final = "clock_timestamp() + make_interval(secs => CAST(:lease AS DOUBLE PRECISION))"


#: the states the ledger's commit moves its last call from and its pending turn to
_STARTED: Final = execution_next("not_started", "start")
_COMMITTED: Final = ledger_turn_next("pending", "commit")


#: the columns of a turn's rows whose values move with the turn's seq (:func:`checked_insert_turn`)
SEQ_COLUMNS: Final = frozenset({"seq", "prev_seq", "block_end_seq", "assistant_seq"})
#: the columns :func:`checked_insert_turn` and :func:`at_seq` change when they move a turn to its
#: seq (:func:`checked_insert_turn` reads them by name, the others by position: shorter)
MOVED_COLUMNS: Final = SEQ_COLUMNS | {"prev_slots_left"}


@functools.lru_cache(maxsize=64)
def lock_first(schema: str | None, conversation: str = "cid") -> str:
    """PostgreSQL: :func:`lock` as the SQL sent first in the same query as a statement whose
    bind ``conversation`` is the conversation (see :data:`fsm.store.engine_config.FIRST`)."""
    conversations = _name(schema, cast(sa.Table, Conversation.__table__))
    return f"SELECT 1 FROM {conversations} WHERE id = %({conversation})s FOR UPDATE"


@functools.lru_cache(maxsize=64)
def lock_held_first(schema: str | None) -> str:
    """PostgreSQL: the tool ledger's pending turn (binds ``l_c``, ``l_p``) if still pending and
    the holder's (``l_holder``), with the conversation's lock, as the SQL sent first in the
    same query as :func:`insert_turn` with ``held`` (both rows locked, as the ledger's
    ``owned_locked``; none when the turn is not held)."""
    conversations = _name(schema, cast(sa.Table, Conversation.__table__))
    return (
        f"SELECT 1 FROM {_name(schema, PENDING_TURNS)} t JOIN {conversations} c "
        "ON c.id = t.conversation_id WHERE t.conversation_id = %(l_c)s AND t.id = %(l_p)s "
        "AND t.state = 'pending' AND t.owner = %(l_holder)s FOR UPDATE"
    )


@functools.lru_cache(maxsize=256)
def checked_insert_turn(
    schema: str | None,
    same: str | None,
    message_columns: tuple[str, ...],
    call_columns: tuple[str, ...],
    *,
    exists: bool = False,
) -> sa.TextualSelect:
    """PostgreSQL: :func:`state` and the insert of :func:`insert_turn` in one statement, run
    after the conversation's lock (its own statement: see the module's note): one row, the
    state (``pending_id, pending_at_seq, stored_at, last_seq, last_slots_left``) and the number
    of messages inserted (binds ``cid``, ``key`` or ``response_id`` and ``choice`` as for
    :func:`state`). The rows go in only in the common case, which the state
    shows: no pending turn, no earlier commit of the same turn, the last message's tool block
    closed, and the next seq the one expected (bind ``expected``, NULL: any); else nothing is
    written and the caller decides from the state (an error, the stored turn, ...).

    The rows are bound as built for seq 1 (arrays as :func:`insert_turn` binds them); the
    statement moves the :data:`SEQ_COLUMNS` to the conversation's next seq, and a turn at seq 0
    gets no predecessor (``prev_seq`` and ``prev_slots_left`` NULL).

    ``exists``: the rows go in only if the conversation exists (a statement whose lock was
    not read by the caller: sent with :func:`lock_first` in one round trip)."""
    quote = _QUOTE.quote
    name = functools.partial(_name, schema)

    state_sql = _state_sql(schema, exists=exists, same=same, extra=", CAST(:expected AS INTEGER)")
    state_binds = [*_binds(MESSAGES, "cid", same), sa.bindparam("expected", type_=sa.Integer())]

    def insert(table: sa.Table, columns: tuple[str, ...], prefix: str) -> str:
        def value(column: str) -> str:
            if column == "prev_seq":  # none before a turn at seq 0 (its assistant's is -1)
                return "NULLIF(u.prev_seq + o.n - 1, -1)"
            if column == "prev_slots_left":  # likewise
                return "CASE WHEN u.prev_seq + o.n > 0 THEN u.prev_slots_left END"
            if column in SEQ_COLUMNS:
                return f"u.{column} + o.n - 1"
            return f"u.a{columns.index(column)}"

        aliases = ", ".join(c if c in MOVED_COLUMNS else f"a{i}" for i, c in enumerate(columns))
        return (
            f"INSERT INTO {name(table)} ({', '.join(quote(c) for c in columns)}) "
            f"SELECT {', '.join(value(c) for c in columns)} "
            f"FROM o, unnest({_arrays(table, columns, prefix)}) AS u({aliases})"
        )

    # st: the state (p: the pending turn's id, a: its at_seq; s: where an earlier commit of
    # the same turn is; l, sl: the last message's seq and open slots; e: the expected seq);
    # o: the next seq, when the turn goes in
    ctes = _state_ctes(state_sql, "p, a, s, l, sl, e", "s", exists)
    binds = _array_binds(MESSAGES, message_columns, "m")
    binds += state_binds
    if call_columns:
        ctes.append(f"written_calls AS ({insert(TOOL_CALLS, call_columns, 'c')})")
        binds += _array_binds(TOOL_CALLS, call_columns, "c")
    ctes.append(f"w AS ({insert(MESSAGES, message_columns, 'm')} RETURNING 1)")
    sql = f"WITH {', '.join(ctes)} SELECT p, a, s, l, sl, (SELECT count(*) FROM w) FROM st"
    return sa.text(sql).bindparams(*binds).columns()


def _state_ctes(reading: str, columns: str, earlier: str, exists: bool) -> list[str]:
    """The CTEs ``st``, what ``reading`` returns (as ``columns``; first ``x``, whether the
    conversation exists, with ``exists``), and ``o``, the next seq, only when the write goes in:
    the conversation exists, no pending turn (``p``), no earlier commit of the same turn
    (``earlier``), the last tool block closed (``l``, ``sl``), the expected seq (``e``)."""
    where = "x = 1 AND " if exists else ""
    return [
        f"st ({'x, ' if exists else ''}{columns}) AS ({reading})",
        f"o AS (SELECT coalesce(l + 1, 0) AS n FROM st WHERE {where}p IS NULL AND {earlier} IS "
        "NULL AND (l IS NULL OR sl = 0) AND (e IS NULL OR e = coalesce(l + 1, 0)))",
    ]


def at_seq(columns: tuple[str, ...], row: tuple[Any, ...], seq: int) -> tuple[Any, ...]:
    """``row`` (values of ``columns``) of a turn built for seq 1, moved to ``seq``: what
    :func:`checked_insert_turn` does in SQL (the :data:`SEQ_COLUMNS` move by ``seq - 1``; a turn
    at seq 0 has no predecessor: ``prev_seq`` and ``prev_slots_left`` NULL)."""
    shift = seq - 1
    if not shift:
        return row
    values = list(row)
    moved, prev, slots = _seq_positions(columns)
    for i in moved:
        if values[i] is not None:
            values[i] += shift
    if prev is not None and values[prev] == -1:  # the assistant message of a turn at seq 0
        values[prev] = None
        if slots is not None:
            values[slots] = None
    return tuple(values)


@functools.lru_cache(maxsize=64)
def _seq_positions(columns: tuple[str, ...]) -> tuple[tuple[int, ...], int | None, int | None]:
    """Where :func:`at_seq`'s columns are in ``columns``: the moved ones, ``prev_seq``,
    ``prev_slots_left``."""
    moved = tuple(i for i, c in enumerate(columns) if c in SEQ_COLUMNS)
    prev = columns.index("prev_seq") if "prev_seq" in columns else None
    slots = columns.index("prev_slots_left") if "prev_slots_left" in columns else None
    return moved, prev, slots


def _arrays(table: sa.Table, columns: tuple[str, ...], prefix: str) -> str:
    """The arrays of ``columns``' values, as ``unnest`` takes them: binds named ``prefix``
    and the column's position (short names keep the statements within psycopg's cache)."""
    return ", ".join(
        f"CAST(:{prefix}{i} AS {table.c[c].type.compile(dialect=_PG)}[])"
        for i, c in enumerate(columns)
    )


def _array_binds(
    table: sa.Table, columns: tuple[str, ...], prefix: str
) -> list[sa.BindParameter[Any]]:
    """The binds of :func:`_arrays`: each a list of a column's values, each value processed
    as the column's type (one dimension: a JSON value that is a list is an element, not a
    nested array)."""
    return [
        sa.bindparam(f"{prefix}{i}", type_=postgresql.ARRAY(table.c[c].type, dimensions=1))
        for i, c in enumerate(columns)
    ]


#: quotes identifiers as PostgreSQL needs them, and renders its types
_PG: Final = postgresql.dialect()  # type: ignore[no-untyped-call]

_QUOTE: Final = _PG.identifier_preparer


def turn_params(
    prefix: str, columns: Sequence[str], rows: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The bind values of ``rows`` for :func:`insert_turn` (``prefix`` ``m`` or ``c``), ...: a
    list per column (named ``prefix`` and the column's position), a row's value or NULL where
    the row lacks the column."""
    return {f"{prefix}{i}": [row.get(c) for row in rows] for i, c in enumerate(columns)}
