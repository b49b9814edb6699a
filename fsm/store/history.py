"""The history reader, and what the store's writes and the tool ledger share.

:func:`read_history` reads a conversation's history (or a window, or one turn) in one snapshot
and checks it against the contract as it merges it (:class:`Corrupt` when a database edited with
its enforcement switched off breaks it); :func:`require_conversation`, :func:`next_seq` and
:func:`check_expected` are the first steps of every write. :class:`StoreCoreLike` declares what
the tool ledger's transaction bodies (:mod:`fsm.store.ledger`) use of the store's core
(:class:`fsm.store.store.StoreCore`), so that the ledger does not import the store that mixes it
in. Not part of the public API.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.states import ToolCallState
from fsm.store import writes
from fsm.store.codec import MARK, decode_json, decode_text
from fsm.store.contract import READER_RULES
from fsm.store.errors import ConflictError, ConversationNotFoundError
from fsm.store.models import Message, ToolCallRow
from fsm.store.plans import MAX_SEQ, show
from fsm.toolcall import is_json
from fsm.types import Message as HistoryMessage

if TYPE_CHECKING:
    from fsm.store.plans import TurnPlan

__all__ = [
    "BoundRows",
    "CommittedTurn",
    "Corrupt",
    "StoreCoreLike",
    "WriteState",
    "check_expected",
    "first_line",
    "is_int",
    "next_seq",
    "read_history",
    "read_provider",
    "require_conversation",
]


@dataclass(frozen=True, slots=True)
class CommittedTurn:
    """What :meth:`ConversationStore.commit_turn` stored (or had stored before).

    ``messages`` is the assistant message followed by its tool results, exactly as
    :meth:`ConversationStore.history` returns them; ``seq`` is the assistant message's seq;
    ``created`` is false when the same turn had been committed before and the stored copy is
    returned (an idempotent retry).
    """

    conversation_id: str
    seq: int
    messages: list[HistoryMessage]
    created: bool

    @property
    def next_seq(self) -> int:
        """The seq right after this turn's last result."""
        return self.seq + len(self.messages)


class BoundRows(Protocol):
    """A turn's rows bound before the transaction (:class:`fsm.store.sqlite_turn.BoundTurn`)."""

    def write(self, conn: Connection, seq: int) -> None:
        """Insert the turn at ``seq``."""
        ...


class StoreCoreLike(Protocol):
    """What the tool ledger's transaction bodies use of the store's core
    (:class:`fsm.store.store.StoreCore` implements it)."""

    postgres: bool

    def translate(self) -> AbstractContextManager[None]:
        """Driver errors a caller can act on, as typed store errors."""
        ...

    def reading(self, conversation_id: str) -> AbstractContextManager[None]:
        """A broken stored history found while reading, as ``CorruptStoreError``."""
        ...

    def commit_turn(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        expected_seq: int | None,
        idempotency_key: str | None,
        *,
        ledger: bool = False,
    ) -> CommittedTurn:
        """Write a planned turn and its results (or return the stored copy of the same turn)."""
        ...

    def commit_ledger_turn(
        self,
        conn: Connection,
        conversation_id: str,
        plan: TurnPlan,
        seq: int,
        idempotency_key: str | None,
        outcome: Mapping[str, Any],
        holder: str | None = None,
    ) -> CommittedTurn | None:
        """PostgreSQL: the ledger's last outcome, its resolution and the turn in one statement
        (``None``: the outcome was not recorded, nothing written); ``holder``: sent at once
        after the lock, and only while the turn is ``holder``'s."""
        ...


def require_conversation(conn: Connection, conversation_id: str, *, lock: bool = False) -> None:
    """Raise ConversationNotFoundError unless the conversation exists; ``lock`` takes its
    row lock (``SELECT ... FOR UPDATE``) for the rest of the transaction."""
    if conn.execute(writes.lock(for_update=lock), {"cid": conversation_id}).first() is None:
        raise ConversationNotFoundError(conversation_id)


def next_seq(conn: Connection, conversation_id: str) -> int:
    query = writes.state(writes.schema(conn), exists=False, same=None)
    return WriteState.read(conn.execute(query, {"cid": conversation_id}).one()).next_seq()


@dataclass(frozen=True, slots=True)
class WriteState:
    """What :meth:`StoreCore.write_state` read: the conversation's pending turn (its id and
    at_seq, or ``None``), the seq of an earlier commit of the same turn (or ``None``), and its
    last message's seq and open result slots (``None``: no message yet)."""

    pending: tuple[object, object] | None
    stored_at: object
    last_seq: object
    slots_left: object

    @classmethod
    def read(cls, row: Sequence[Any]) -> WriteState:
        """From a row of :func:`fsm.store.writes.state` (``pending_id, pending_at_seq,
        stored_at, last_seq, last_slots_left``)."""
        pending_id, pending_at, stored_at, last_seq, slots_left = row
        pending = None if pending_id is None else (pending_id, pending_at)
        return cls(pending, stored_at, last_seq, slots_left)

    def next_seq(self) -> int:
        """The seq the next message gets (``Corrupt`` if the last message is broken)."""
        return 0 if self.last_seq is None else _after(self.last_seq, self.slots_left)


def read_history(
    conn: Connection,
    conversation_id: str,
    *,
    turn_at: int | None = None,
    last: int | None = None,
    include_reasoning: bool,
) -> list[dict[str, Any]]:
    """The whole history, the window of the ``last`` messages, or the turn whose assistant
    message is at seq ``turn_at``.

    Two plain range scans of primary keys (messages, then tool calls), merged here: their
    cost is linear in what is read whatever the planner's statistics say (a join can be
    planned as a nested loop on tables that were never analyzed). Call it inside one
    transaction with a stable snapshot, so both scans see the same commits.

    The columns are read as the driver returns them (no per-value type processing: a history
    of 10,000 messages is 100,000 values) and decoded here: a text through
    :func:`~fsm.store.codec.decode_text` only when it is marked, content parts parsed from
    their JSON text (also on PostgreSQL, whose ``json`` is cast to text in the query) and
    decoded only when they may hold a marked string.

    What is read is checked against the contract as it is merged (dense seqs, whole tool
    blocks, results answering their calls, finished calls, values of the right types): a
    database edited with its enforcement switched off raises ``Corrupt`` instead of giving a
    history the model would refuse.
    """
    m, t = Message, ToolCallRow
    query = _messages_query(conn.dialect.name == "postgresql", include_reasoning)
    if turn_at is not None:
        turn_calls = (
            sa.select(m.n_calls)
            .where(m.conversation_id == conversation_id, m.seq == turn_at)
            .scalar_subquery()
        )
        query = query.where(m.seq >= turn_at, m.seq <= turn_at + turn_calls)
    if last is not None and last >= MAX_SEQ:
        last = None  # at least every message there can be: the whole history
    if last is not None:
        if last == 0:
            return []
        # the smallest window of at least ``last`` messages that does not split a tool block:
        # the last ``last`` messages, started at their block's assistant message when the
        # first of them is a tool result
        first = (
            sa.select(sa.func.max(m.seq) - (last - 1))
            .where(m.conversation_id == conversation_id)
            .scalar_subquery()
        )
        owner = (
            sa.select(m.assistant_seq)
            .where(m.conversation_id == conversation_id, m.seq == first)
            .scalar_subquery()
        )
        query = query.where(m.seq >= sa.func.coalesce(owner, first))
    rows = _fetch(conn, query, conversation_id)
    messages: list[dict[str, Any]] = []
    append = messages.append
    calls_of: dict[int, list[dict[str, Any]]] = {}
    #: for each assistant message with calls: its n_calls and its results' tool_call_ids
    blocks: dict[int, tuple[int, list[str]]] = {}
    #: the assistant messages with calls, and those whose one call is a legacy function_call
    assistants: dict[int, dict[str, Any]] = {}
    legacy: dict[int, str] = {}  # assistant seq -> the name its function result carries
    expected: int | None = None
    block: int | None = None  # the assistant seq whose results are being read
    size = 0
    answered: list[str] = []
    roles = _ROLES
    for (
        seq,
        role,
        content,
        parts,
        name,
        refusal,
        reasoning,
        tool_call_id,
        n_calls,
        assistant_seq,
        call_position,
    ) in rows:
        if type(seq) is not int:
            raise Corrupt("invalid_type", f"a message has seq {show(seq)}, not an integer")
        if seq != expected:
            if expected is not None:
                if seq < expected:
                    raise Corrupt("seq_duplicate", f"seq {seq} is held by two messages")
                raise Corrupt(
                    "seq_gap", f"seq {expected} is missing (the next message has seq {seq})"
                )
            want = seq if last is not None else (0 if turn_at is None else turn_at)
            if seq != want:
                raise Corrupt(
                    "seq_start", f"seq {want} is missing (the first message has seq {seq})"
                )
        expected = seq + 1
        if role not in roles:
            raise Corrupt("invalid_row", f"message {seq} has role {show(role)}")
        if type(n_calls) is not int or (n_calls != 0 and (n_calls < 0 or role != "assistant")):
            raise Corrupt("invalid_row", f"message {seq} ({role}) has n_calls {show(n_calls)}")
        if content is not None:
            if type(content) is not str:
                raise Corrupt(
                    "invalid_type", f"message {seq} has content {show(content)}, not text"
                )
            if content[:1] == MARK:
                content = decode_text(content)
        listed = None if parts is None else _content_parts(seq, parts)
        if listed is None and content is None and role != "assistant":
            raise Corrupt("missing_content", f"message {seq} ({role}) has no content")
        message: dict[str, Any]
        if role == "tool":
            if block is None:
                raise Corrupt(
                    "orphan_result", f"message {seq} is a tool result outside a tool block"
                )
            if assistant_seq != block or call_position != len(answered):
                raise Corrupt(
                    "result_misplaced",
                    f"message {seq} is the result of call ({show(assistant_seq)}, "
                    f"{show(call_position)}), but its slot is call {len(answered)} of "
                    f"message {block}",
                )
            if type(tool_call_id) is not str:
                raise Corrupt("invalid_row", f"message {seq} has tool_call_id {show(tool_call_id)}")
            if tool_call_id[:1] == MARK:
                tool_call_id = decode_text(tool_call_id)
            answered.append(tool_call_id)
            block_seq = block
            if len(answered) == size:
                block = None
            if name is not None:  # the result of a legacy function_call (see commit)
                if type(name) is not str:
                    raise Corrupt("invalid_type", f"message {seq} has name {show(name)}, not text")
                if name[:1] == MARK:
                    name = decode_text(name)
                if size != 1:
                    raise Corrupt(
                        "invalid_row",
                        f"message {seq} is a function result in a block of {size} calls (a "
                        "legacy function_call is the only call of its message)",
                    )
                legacy[block_seq] = name
                message = {"role": "function", "name": name, "content": content}
            else:
                message = {"role": role, "tool_call_id": tool_call_id, "content": content}
        else:
            if block is not None:
                raise Corrupt(
                    "interleaved",
                    f"message {block} has {size} tool call(s) but {len(answered)} result(s) "
                    f"before message {seq}",
                )
            message = {"role": role, "content": content}
            if name is not None or refusal is not None or reasoning is not None:
                for key, value in (
                    ("name", name),
                    ("refusal", refusal),
                    ("reasoning_content", reasoning),
                ):
                    if value is not None:
                        if type(value) is not str:
                            raise Corrupt(
                                "invalid_type", f"message {seq} has {key} {show(value)}, not text"
                            )
                        message[key] = decode_text(value) if value[:1] == MARK else value
            if n_calls:
                calls_of[seq] = message["tool_calls"] = []
                assistants[seq] = message
                size, answered = n_calls, []
                blocks[seq] = (size, answered)
                block = seq
        if listed is not None:
            message["content"] = listed
        append(message)
    if block is not None:
        raise Corrupt(
            "missing_result",
            f"message {block} has {size} tool call(s) but {len(answered)} result(s) "
            "(the history ends there)",
        )
    if turn_at is not None and not messages:
        raise Corrupt("seq_gap", f"message {turn_at} cannot be read")
    whole = last is None and turn_at is None
    if calls_of or (whole and messages):
        calls_query = _calls_query()
        if not whole:  # a window: the calls of its messages (a whole read checks them all)
            calls_query = calls_query.where(
                t.assistant_seq >= min(calls_of), t.assistant_seq <= max(calls_of)
            )
        calls = _fetch(conn, calls_query, conversation_id)
        for assistant_seq, position, call_id, kind, name, arguments, state in calls:
            target = calls_of.get(assistant_seq) if type(assistant_seq) is int else None
            if target is None:
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt(
                    "orphan_call", f"{where} belongs to no assistant message with tool calls"
                )
            size, answered = blocks[assistant_seq]
            if position != len(target) or len(target) >= size:
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt("call_count_mismatch", f"{where} is not call {len(target)} of {size}")
            if state != _FINISHED:
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt("not_finished", f"{where} is {show(state)}, not finished")
            if not (
                type(call_id) is str
                and type(kind) is str
                and type(name) is str
                and type(arguments) is str
            ):
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt("invalid_type", f"{where} has a value that is not text")
            if call_id[:1] == MARK:
                call_id = decode_text(call_id)
            if kind[:1] == MARK:
                kind = decode_text(kind)
            if name[:1] == MARK:
                name = decode_text(name)
            if arguments[:1] == MARK:
                arguments = decode_text(arguments)
            if not name.strip(_JSON_WHITESPACE):
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt("invalid_name", f"{where} has a blank name")
            if kind != "custom" and not is_json(arguments):  # custom: free text (0007)
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt("invalid_arguments", f"{where} has arguments that are not JSON")
            if call_id != answered[position]:
                where = f"call {show(position)} of message {show(assistant_seq)}"
                raise Corrupt(
                    "result_id_mismatch",
                    f"the result of {where} answers {show(answered[position])}, "
                    f"not the call's id {show(call_id)}",
                )
            target.append(
                {"id": call_id, "type": kind, "custom": {"name": name, "input": arguments}}
                if kind == "custom"  # a free-text call, as Chat Completions sends custom tools
                else {
                    "id": call_id,
                    "type": kind,
                    "function": {"name": name, "arguments": arguments},
                }
            )
        for seq, found in calls_of.items():
            if len(found) != blocks[seq][0]:
                raise Corrupt(
                    "call_count_mismatch",
                    f"message {seq} has {blocks[seq][0]} tool call(s) but {len(found)} call row(s)",
                )
    for seq, answered_by in legacy.items():  # the legacy shape: "function_call", not "tool_calls"
        assistant = assistants[seq]
        function = assistant.pop("tool_calls")[0]["function"]
        if function["name"] != answered_by:
            raise Corrupt(
                "result_id_mismatch",
                f"message {seq + 1} answers function {show(answered_by)}, but message {seq} "
                f"calls {show(function['name'])}",
            )
        assistant["function_call"] = function
    return messages


@functools.cache
def _messages_query(postgres: bool, include_reasoning: bool) -> sa.Select[Any]:
    """:func:`read_history`'s SELECT of a conversation's messages (bind ``cid``), built once
    per engine kind: building a statement costs about as much as SQLAlchemy's execution of
    it once compiled."""
    m, raw = Message, sa.Text
    query = (
        sa.select(
            m.seq,
            sa.type_coerce(m.role, raw),
            sa.type_coerce(m.content, raw),
            # PostgreSQL: the json as its text (psycopg would parse it); SQLite: as stored
            sa.cast(m.content_parts, raw) if postgres else sa.type_coerce(m.content_parts, raw),
            sa.type_coerce(m.name, raw),
            sa.type_coerce(m.refusal, raw),
            sa.type_coerce(m.reasoning, raw) if include_reasoning else sa.null(),
            sa.type_coerce(m.tool_call_id, raw),
            m.n_calls,
            m.assistant_seq,
            m.call_position,
        )
        .where(m.conversation_id == sa.bindparam("cid", type_=m.conversation_id.type))
        .order_by(m.seq)
    )
    return cast("sa.Select[Any]", query)


@functools.cache
def _calls_query() -> sa.Select[Any]:
    """:func:`read_history`'s SELECT of a conversation's tool calls (bind ``cid``), built
    once."""
    t, raw = ToolCallRow, sa.Text
    query = (
        sa.select(
            t.assistant_seq,
            t.position,
            sa.type_coerce(t.call_id, raw),
            sa.type_coerce(t.type, raw),
            sa.type_coerce(t.name, raw),
            sa.type_coerce(t.arguments, raw),
            sa.type_coerce(t.state, raw),
        )
        .where(t.conversation_id == sa.bindparam("cid", type_=t.conversation_id.type))
        .order_by(t.assistant_seq, t.position)
    )
    return cast("sa.Select[Any]", query)


def _fetch(conn: Connection, query: sa.Executable, conversation_id: str) -> Sequence[Any]:
    """All rows of ``query`` (bind ``cid``: the conversation) as the driver's tuples: the
    columns are read as the driver returns them anyway (no type processing), and
    SQLAlchemy's ``Row`` objects would cost a third of a long read. A driver error while
    fetching (SQLite steps the statement in ``fetchall``) is met again through SQLAlchemy's
    own fetch, whose error handling types it."""
    params = {"cid": conversation_id}
    result = conn.execute(query, params)
    try:
        return result.cursor.fetchall()
    except conn.dialect.loaded_dbapi.Error:
        result.close()
    return conn.execute(query, params).all()


def read_provider(
    conn: Connection, conversation_id: str, count: int
) -> tuple[list[int], dict[int, tuple[Any, Any]]]:
    """The seqs of the last ``count`` messages (what :func:`read_history` just read, in the same
    snapshot: dense seqs ending at the last message) and the ``format`` and
    ``provider_items`` of their assistant messages, for :func:`~fsm.store.render.render`."""
    m = Message
    last = conn.execute(
        sa.select(sa.func.max(m.seq)).where(m.conversation_id == conversation_id)
    ).scalar_one()
    first = int(last) + 1 - count
    try:
        rows = conn.execute(
            sa.select(m.seq, m.format, m.provider_items).where(
                m.conversation_id == conversation_id,
                m.seq >= first,
                sa.type_coerce(m.role, sa.String) == "assistant",
                m.format.is_not(None),
            )
        ).all()
    except (ValueError, TypeError) as exc:  # JSON that is not JSON
        raise Corrupt(
            "invalid_type", f"stored provider items cannot be read back: {first_line(exc)}"
        ) from None
    provider = {seq: (fmt, items) for seq, fmt, items in rows}
    for seq, (_fmt, items) in provider.items():
        if items is not None and not isinstance(items, list):
            raise Corrupt(
                "invalid_type", f"message {seq} has provider items {show(items)}, not a list"
            )
    return list(range(first, first + count)), provider


#: a JSON text that may hold a string marked by :mod:`fsm.store.codec` (the mark itself, or
#: its escape: fsm writes JSON with ASCII escapes)
_MAY_HOLD_MARK = re.compile("\ufdd0|\\\\u[fF][dD][dD]0")
_FINISHED = ToolCallState.FINISHED.value


def _content_parts(seq: int, stored: object) -> list[Any]:
    """A message's content parts, from the JSON text the query reads (``Corrupt`` when it is
    not a JSON list)."""
    if type(stored) is not str:
        raise Corrupt("invalid_type", f"message {seq} has content parts {show(stored)}, not a list")
    try:
        parts = json.loads(stored)
    except ValueError as exc:  # JSON that is not JSON
        raise Corrupt(
            "invalid_type", f"a stored message cannot be read back: {first_line(exc)}"
        ) from None
    if not isinstance(parts, list):
        raise Corrupt("invalid_type", f"message {seq} has content parts {show(parts)}, not a list")
    if _MAY_HOLD_MARK.search(stored) is not None:
        return cast("list[Any]", decode_json(parts))
    return parts


def _after(last_seq: object, slots_left: object) -> int:
    """The seq after the conversation's last message (``last_seq``), which must close its
    tool block (``slots_left`` 0)."""
    if not isinstance(last_seq, int) or not is_int(last_seq):
        raise Corrupt("invalid_type", f"a message has seq {show(last_seq)}, not an integer")
    if slots_left != 0:
        raise Corrupt(
            "missing_result",
            f"the last message (seq {last_seq}) leaves {show(slots_left)} tool result slot(s) open",
        )
    return last_seq + 1


def check_expected(conversation_id: str, expected: int | None, actual: int) -> None:
    if expected is not None and expected != actual:
        raise ConflictError(conversation_id, expected, actual)


# -- values --------------------------------------------------------------------------------------
class Corrupt(Exception):
    """A stored history that breaks the contract (becomes ``CorruptStoreError``): ``kind``
    names the rule it breaks (:data:`fsm.store.contract.READER_RULES`), ``problem`` where."""

    def __init__(self, kind: str, problem: str) -> None:
        assert kind in READER_RULES, kind
        super().__init__(problem)
        self.kind = kind
        self.problem = problem


_ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))
_JSON_WHITESPACE = " \t\r\n"


def is_int(value: object) -> bool:
    return type(value) is int


def first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return (text.splitlines() or [type(exc).__name__])[0][:300]
