"""The implementation of :mod:`fsm.integrations.pydantic_ai` (this module imports pydantic-ai:
import the names from :mod:`fsm.integrations.pydantic_ai`, which loads it when first used).

**The mapping** (:mod:`fsm.integrations.pydantic_ai_messages`): fsm keeps a conversation as
Chat Completions messages, the format that keeps the most of a pydantic-ai history (text, tool
calls with their ids and argument text, results in their slots, system and user messages).

**Calls and results.** A response whose calls are all answered by the request after it goes in
with :meth:`~fsm.store.ConversationStore.import_history` (the contract checked before any
write: a result for no call, a call with no result are typed errors). A response saved without
its returns (the run paused for deferred tools) is begun as the conversation's *pending* turn in
fsm's ledger (:meth:`~fsm.store.ConversationStore.begin`), then released: it is not in
:meth:`~fsm.store.ConversationStore.history`, so nothing sends it back to a model unanswered,
and :meth:`FsmConversationStore.load` returns it at the end of the messages with its unanswered
calls as ``deferred_tool_requests``. The save that brings its returns records each one in the
ledger and commits the turn.

**Revisions.** A conversation's ``revision`` is fsm's next seq (``"seq:12"``; ``"seq:12+p3"``
while pending turn 3 waits): the expected seq of the save's first write, so a save from a stale
copy raises :class:`RevisionConflictError` (a ``ConversationConflict``) and writes nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, cast

from pydantic_ai import messages as pm
from pydantic_ai.conversation import Conversation
from pydantic_ai.conversation_store import (
    ConversationConflict,
    ConversationEntry,
    ConversationRecord,
)
from pydantic_ai.conversation_store import ConversationStore as PydanticAIConversationStore
from pydantic_ai.exceptions import UserError
from pydantic_ai.run import AgentRunResult
from pydantic_ai.tools import DeferredToolRequests
from pydantic_ai.usage import RunUsage

from fsm.completion import parse_completion
from fsm.integrations import errors
from fsm.integrations.errors import IntegrationError
from fsm.integrations.pydantic_ai_messages import (
    UnstorableMessageError,
    as_completion,
    from_chat,
    normal,
    pending_response,
    to_chat,
)
from fsm.store import ConversationStore, PendingTurn
from fsm.store.aio import AsyncConversationStore
from fsm.store.errors import (
    ConflictError,
    ConversationExistsError,
    ConversationNotFoundError,
    LedgerStateError,
    PendingTurnError,
    ResultsError,
    TurnInProgressError,
)

__all__ = [
    "FsmConversationStore",
    "HistoryRewriteError",
    "RevisionConflictError",
    "ScopeNotSupportedError",
    "UnstorableMessageError",
]

#: what a save's writes raise when another writer got there first
_LOST_RACE: Final = (
    ConflictError,
    ConversationExistsError,
    LedgerStateError,
    PendingTurnError,
    TurnInProgressError,
)


class RevisionConflictError(IntegrationError, ConversationConflict):
    """The conversation changed in fsm's store since it was loaded: its revision (fsm's next
    seq) is stale, and the save wrote nothing. It is pydantic-ai's ``ConversationConflict``:
    load the conversation again and retry."""

    def __init__(
        self, conversation_id: str, expected: str | None, actual: str | None, why: str = ""
    ) -> None:
        ConversationConflict.__init__(self, conversation_id)
        self.expected_revision = expected
        self.actual_revision = actual
        have = "no such conversation" if actual is None else f"it is at {actual}"
        loaded = "none (a new conversation)" if expected is None else expected
        self.message = (
            f"conversation {conversation_id!r} changed since it was loaded: the save expected "
            f"revision {loaded}, {have}{why}; load it again and retry"
        )
        self.args = (self.message,)


class HistoryRewriteError(errors.HistoryRewriteError, UserError):
    """What fsm cannot do: rewrite a stored history (``branch``, a save whose earlier messages
    differ from the stored ones). fsm's history only grows; ``fork`` copies into a new
    conversation instead."""

    def __init__(self, message: str) -> None:
        UserError.__init__(self, message)


class ScopeNotSupportedError(IntegrationError, UserError):
    """``scope=`` was given: fsm's conversations have no owner field."""

    def __init__(self, method: str) -> None:
        UserError.__init__(
            self,
            f"{method}(scope=...) is not supported: fsm's store has no scopes; keep each owner's "
            "conversations under their own ids (or their own database or schema) and drop scope=",
        )


# -- the store ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _State:
    """A stored conversation: fsm's history (chat) and its pending turn."""

    history: list[dict[str, Any]]
    pending: PendingTurn | None
    updated_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def seq(self) -> int:
        return len(self.history)

    @property
    def revision(self) -> str:
        mark = "" if self.pending is None else f"+p{self.pending.id}"
        return f"seq:{self.seq}{mark}"

    def messages(self) -> list[tuple[pm.ModelMessage, int]]:
        out = from_chat(self.history)
        if self.pending is not None:
            out.append((pending_response(self.pending), self.pending.at_seq + 1))
        return out

    def deferred(self) -> DeferredToolRequests | None:
        if self.pending is None:
            return None
        calls = [
            pm.ToolCallPart(tool_name=e.call.name, args=e.call.arguments, tool_call_id=e.call.id)
            for e in self.pending.executions
            if not e.finished
        ]
        return DeferredToolRequests(calls=calls) if calls else None


def _entry_id(conversation_id: str, end: int) -> str:
    return f"{conversation_id}@{end}"


def _parse_entry_id(entry_id: str) -> tuple[str, int]:
    conversation_id, at, end = entry_id.rpartition("@")
    if not at or not end.isdigit():
        raise LookupError(f"{entry_id!r} is not an entry id of FsmConversationStore")
    return conversation_id, int(end)


class FsmConversationStore(PydanticAIConversationStore):
    """pydantic-ai's ``ConversationStore`` over fsm's store (sync or asyncio).

    ::

        store = FsmConversationStore(ConversationStore("chat.db"))
        conversation = await store.load(cid) or Conversation(conversation_id=cid)
        result = await agent.run(prompt, conversation=conversation)
        await store.save(result)

    What it keeps and what it does not (the full list is in the guide): messages as Chat
    Completions messages (see the module docstring); a response's ``model_name``,
    ``provider_response_id`` and usage are kept only while it is pending. Not kept: timestamps,
    ``ThinkingPart`` text, instructions (the agent sends its own on each run), a
    conversation's running ``usage`` (a loaded conversation starts from zero), and whether a
    deferred call waits for an approval or an external result (pending calls load as
    ``DeferredToolRequests.calls``). Entry ids name positions (``"<conversation id>@<seq>"``,
    the seq right after the message), not the ids pydantic-ai minted.

    A save is one fsm transaction per step (answering a pending turn, the messages, a new
    pending turn), each checked against the expected seq: a lost race raises
    :class:`RevisionConflictError` at the step that lost it, and the steps before it stay (each
    is a valid history on its own).
    """

    def __init__(self, store: ConversationStore | AsyncConversationStore) -> None:
        if not isinstance(store, ConversationStore | AsyncConversationStore):
            raise TypeError(
                "FsmConversationStore takes an fsm.store.ConversationStore or "
                f"fsm.store.aio.AsyncConversationStore, not {type(store).__name__}"
            )
        self.store = store

    def __repr__(self) -> str:
        return f"FsmConversationStore({self.store!r})"

    # -- calls on the sync or async store ------------------------------------------------------
    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.store, name)
        if isinstance(self.store, AsyncConversationStore):
            return await method(*args, **kwargs)
        return await asyncio.to_thread(method, *args, **kwargs)

    async def _state(self, conversation_id: str) -> _State | None:
        try:
            history = await self._call("history", conversation_id)
        except ConversationNotFoundError:
            return None
        pending = await self._call("pending", conversation_id)
        return _State(cast(list[dict[str, Any]], history), pending)

    # -- pydantic-ai's API ---------------------------------------------------------------------
    async def load(
        self, conversation_id: str, *, limit: int | None = None, scope: str | None = None
    ) -> Conversation | None:
        """The conversation as fsm holds it (with its pending response last, if any), or
        ``None``; ``limit``: only its last ``limit`` messages."""
        _no_scope("load", scope)
        if limit is not None and limit < 0:
            raise UserError("`limit` must not be negative.")
        state = await self._state(conversation_id)
        if state is None:
            return None
        messages = [m for m, _ in state.messages()]
        if limit is not None:
            messages = messages[len(messages) - limit :] if limit else []
        conversation = Conversation(
            messages=messages,
            usage=RunUsage(),
            conversation_id=conversation_id,
            deferred_tool_requests=state.deferred(),
            revision=state.revision,
        )
        conversation.new_message_index = len(messages)
        return conversation

    async def save(
        self, conversation: Conversation | AgentRunResult[Any], *, scope: str | None = None
    ) -> list[ConversationEntry]:
        """Append the messages fsm does not have yet (see the class docstring), checked
        against the conversation's revision; returns their entries and advances the
        conversation's ``revision`` and ``new_message_index`` (a run's result's too)."""
        _no_scope("save", scope)
        result: AgentRunResult[Any] | None = None
        if isinstance(conversation, AgentRunResult):
            result, conversation = conversation, conversation.conversation
        conversation_id = conversation.conversation_id
        expected = conversation.revision
        messages = list(conversation.messages)
        state = await self._state(conversation_id)
        if (state.revision if state is not None else None) != expected:
            raise RevisionConflictError(
                conversation_id, expected, state.revision if state is not None else None
            )
        start = self._unsaved_from(conversation, messages, state)
        entries, revision = await self._append(conversation_id, state, messages[start:])
        conversation.revision = revision
        conversation.new_message_index = len(messages)
        if result is not None:
            # pydantic-ai's own save does this too: the result's next `conversation` continues
            # from the new revision (no public setter in pydantic-ai 2.68)
            result._conversation_saved(revision)
        return entries

    async def branch(
        self,
        conversation_id: str,
        *,
        at: int | None = None,
        from_entry: str | None = None,
        expected_revision: str | None,
        scope: str | None = None,
    ) -> Conversation:
        """Not possible in fsm: raises :class:`HistoryRewriteError` (use :meth:`fork`)."""
        raise HistoryRewriteError(
            f"branch({conversation_id!r}) would rewrite its history, and fsm's history only "
            "grows: fork() it into a new conversation instead"
        )

    async def fork(
        self,
        conversation_id: str,
        *,
        at: int | None = None,
        from_entry: str | None = None,
        new_conversation_id: str | None = None,
        scope: str | None = None,
        source_scope: str | None = None,
    ) -> Conversation:
        """A new fsm conversation holding a copy of the first messages of this one (all of
        them, ``at`` of them, or up to the entry ``from_entry``). A pending response cannot be
        copied: fork before it, or save its returns first."""
        _no_scope("fork", scope if scope is not None else source_scope)
        if at is not None and from_entry is not None:
            raise UserError("Pass at most one of `at` and `from_entry`.")
        state = await self._state(conversation_id)
        if state is None:
            raise UserError(f"Conversation {conversation_id!r} is not in the store.")
        stored = state.messages()
        if from_entry is not None:
            ends = [_entry_id(conversation_id, end) for _, end in stored]
            if from_entry not in ends:
                raise UserError(
                    f"Entry {from_entry!r} is not in the history of conversation "
                    f"{conversation_id!r}."
                )
            at = ends.index(from_entry) + 1
        keep = len(stored) if at is None else at
        if not 0 <= keep <= len(stored):
            raise UserError(
                f"`at` must be between 0 and {len(stored)}, the number of messages in the "
                "conversation."
            )
        if state.pending is not None and keep == len(stored):
            raise HistoryRewriteError(
                f"conversation {conversation_id!r} ends in a pending response (its calls have "
                "no results yet): fork before it (at=...) or save its results first"
            )
        fork_id = new_conversation_id if new_conversation_id is not None else str(uuid.uuid4())
        kept = [m for m, _ in stored[:keep]]
        await self._append(fork_id, None, kept)
        forked = await self.load(fork_id)
        assert forked is not None
        return forked

    # -- the storage primitives ----------------------------------------------------------------
    async def read_record(self, conversation_id: str) -> ConversationRecord | None:
        """The record of a stored conversation: its head entry and fsm's revision; ``usage``
        is not kept (zero), ``deferred_tool_requests`` are the pending turn's open calls."""
        state = await self._state(conversation_id)
        if state is None:
            return None
        return _record(conversation_id, state)

    async def read_records(
        self, *, scope: str | None = None, limit: int | None = None
    ) -> Sequence[ConversationRecord]:
        """The conversations, most recently active first (one history read per listed one)."""
        _no_scope("list_conversations", scope)
        infos = await self._call("list_conversations", limit=None)
        infos = sorted(
            infos,
            key=lambda i: i.last_activity or i.created_at or datetime.min.replace(tzinfo=UTC),
            reverse=True,
        )
        records: list[ConversationRecord] = []
        for info in infos[:limit]:
            state = await self._state(info.id)
            if state is None:
                continue  # deleted since it was listed
            updated = info.last_activity or info.created_at or state.updated_at
            records.append(_record(info.id, _State(state.history, state.pending, updated)))
        return records

    async def write_record(
        self,
        record: ConversationRecord,
        *,
        new_entries: Sequence[ConversationEntry] = (),
        expected_revision: str | None,
    ) -> None:
        """Append ``new_entries`` (which must extend the stored history: the first names the
        stored head as its parent, each the one before it, and ``record.head_id`` the last)
        with ``expected_revision`` as fsm's expected seq. fsm keeps no usage, scope or
        branches: a record with forks or branches raises :class:`HistoryRewriteError`. The
        entries' own ids are not kept (fsm names entries by position)."""
        cid = record.conversation_id
        _no_scope("write_record", record.scope)
        if record.branches or record.forked_from is not None:
            raise HistoryRewriteError(
                f"conversation {cid!r}: branches and forks that share entries are not stored "
                "by fsm (its history only grows; fork() copies)"
            )
        state = await self._state(cid)
        actual = state.revision if state is not None else None
        if actual != expected_revision:
            raise RevisionConflictError(cid, expected_revision, actual)
        head = _head(cid, state)
        parent = head
        for entry in new_entries:
            if entry.parent_id != parent:
                raise HistoryRewriteError(
                    f"conversation {cid!r}: entry {entry.id!r} follows {entry.parent_id!r}, not "
                    f"{parent!r}: fsm's history only grows at its end"
                )
            parent = entry.id
        if record.head_id != parent:
            raise HistoryRewriteError(
                f"conversation {cid!r}: the record's head {record.head_id!r} is not the end of "
                "its history: fsm's history only grows at its end"
            )
        await self._append(cid, state, [e.message for e in new_entries])

    async def delete_record(self, conversation_id: str, *, expected_revision: str) -> None:
        """Delete the conversation from fsm (its messages, calls, attempts and ledger)."""
        state = await self._state(conversation_id)
        actual = state.revision if state is not None else None
        if actual != expected_revision:
            raise RevisionConflictError(conversation_id, expected_revision, actual)
        await self._call("delete_conversation", conversation_id)

    async def read_entry(self, entry_id: str) -> ConversationEntry:
        """The entry ``"<conversation id>@<seq>"``; ``LookupError`` if there is none."""
        cid, end = _parse_entry_id(entry_id)
        for entry in await self.read_history(entry_id):
            if entry.id == entry_id:
                return entry
        raise LookupError(f"conversation {cid!r} has no message ending at seq {end}")

    async def read_history(
        self, head_id: str | None, *, limit: int | None = None
    ) -> list[ConversationEntry]:
        """The entries up to ``head_id``, in order (one read of the conversation)."""
        if head_id is None:
            return []
        cid, end = _parse_entry_id(head_id)
        state = await self._state(cid)
        if state is None:
            raise LookupError(f"conversation {cid!r} is not in the store")
        entries = _entries(cid, state.messages())
        ids = [e.id for e in entries]
        if head_id not in ids:
            raise LookupError(f"conversation {cid!r} has no message ending at seq {end}")
        entries = entries[: ids.index(head_id) + 1]
        return entries if limit is None else entries[len(entries) - limit :] if limit else []

    # -- internals ------------------------------------------------------------------------------
    def _unsaved_from(
        self, conversation: Conversation, messages: list[pm.ModelMessage], state: _State | None
    ) -> int:
        """Where the messages fsm does not have start: all of them for a new conversation,
        ``new_message_index`` when known, else after the stored prefix (compared as fsm stores
        messages; a difference is a rewrite, refused)."""
        if state is None:
            return 0
        if conversation.new_message_index is not None:
            return conversation.new_message_index
        stored = [normal(m) for m in _chats(state.messages())]
        mine = to_chat(messages)
        have = 0
        for index, group in enumerate(mine):
            if have == len(stored):
                return index
            chunk = [normal(m) for m in group]
            if stored[have : have + len(chunk)] != chunk:
                break
            have += len(chunk)
        if have == len(stored):
            return len(messages)
        raise HistoryRewriteError(
            f"conversation {conversation.conversation_id!r}: the messages saved differ from the "
            "stored ones before their end, and fsm's history only grows; load it again, or "
            "fork() it to start from an earlier point"
        )

    async def _append(
        self, conversation_id: str, state: _State | None, messages: Sequence[pm.ModelMessage]
    ) -> tuple[list[ConversationEntry], str]:
        """Write ``messages`` after ``state`` (``None``: a new conversation); returns their
        entries and the new revision."""
        expected = state.revision if state is not None else None
        first = len(state.messages()) if state is not None else 0
        groups = to_chat(messages, first)
        chat = [m for group in groups for m in group]
        try:
            if state is None:
                await self._call("create_conversation", conversation_id)
            await self._write(conversation_id, state, chat, messages)
        except _LOST_RACE as exc:
            now = await self._state(conversation_id)
            raise RevisionConflictError(
                conversation_id,
                expected,
                now.revision if now is not None else None,
                f" ({exc})",
            ) from exc
        after = await self._state(conversation_id)
        assert after is not None
        entries = _entries(conversation_id, after.messages())
        stored = entries[len(entries) - len(messages) :] if messages else []
        if len(stored) == len(messages):  # the entries hold the messages as they were saved
            stored = [
                ConversationEntry(id=e.id, parent_id=e.parent_id, message=m)
                for e, m in zip(stored, messages, strict=True)
            ]
        return stored, after.revision

    async def _write(
        self,
        conversation_id: str,
        state: _State | None,
        chat: list[dict[str, Any]],
        messages: Sequence[pm.ModelMessage],
    ) -> None:
        seq = state.seq if state is not None else 0
        pending = state.pending if state is not None else None
        i = 0
        if pending is not None and chat:
            answers: dict[str, Any] = {}
            while i < len(chat) and chat[i]["role"] == "tool":
                answers[chat[i]["tool_call_id"]] = chat[i]["content"]
                i += 1
            missing = [c for c in pending.calls if c.id not in answers]
            extra = sorted(set(answers) - {c.id for c in pending.calls})
            if missing or extra:
                what = (
                    f"call {missing[0].id!r} ({missing[0].name}) has no result"
                    if missing
                    else f"result for {extra[0]!r} answers no call of it"
                )
                raise ResultsError(
                    f"conversation {conversation_id!r}: the messages saved after its pending "
                    f"response must start with one result per call: {what}"
                )
            claimed = await self._call("claim", pending)
            for position, call in enumerate(pending.calls):
                execution = claimed.execution(position)
                if not execution.finished:
                    if execution.state == "not_started":  # the ledger records a start first
                        claimed = await self._call("started", claimed, position)
                    claimed = await self._call("succeeded", claimed, position, answers[call.id])
            done = await self._call("commit", claimed)
            seq = done.next_seq
        rest = chat[i:]
        tail: dict[str, Any] | None = None
        if rest and rest[-1]["role"] == "assistant" and rest[-1].get("tool_calls"):
            tail = rest.pop()
        if rest:
            seq = await self._call("import_history", conversation_id, rest, expected_seq=seq)
        if tail is not None:
            response = messages[-1]
            assert isinstance(response, pm.ModelResponse)
            turn = parse_completion(as_completion(tail, response))
            begun = await self._call("begin", conversation_id, turn, expected_seq=seq)
            await self._call("release", begun)


def _no_scope(method: str, scope: str | None) -> None:
    if scope is not None:
        raise ScopeNotSupportedError(method)


def _chats(stored: list[tuple[pm.ModelMessage, int]]) -> list[dict[str, Any]]:
    return [m for group in to_chat([m for m, _ in stored]) for m in group]


def _entries(
    conversation_id: str, stored: list[tuple[pm.ModelMessage, int]]
) -> list[ConversationEntry]:
    entries: list[ConversationEntry] = []
    parent: str | None = None
    for message, end in stored:
        entry = ConversationEntry(
            id=_entry_id(conversation_id, end), parent_id=parent, message=message
        )
        entries.append(entry)
        parent = entry.id
    return entries


def _head(conversation_id: str, state: _State | None) -> str | None:
    if state is None:
        return None
    stored = state.messages()
    return _entry_id(conversation_id, stored[-1][1]) if stored else None


def _record(conversation_id: str, state: _State) -> ConversationRecord:
    return ConversationRecord(
        conversation_id=conversation_id,
        head_id=_head(conversation_id, state),
        deferred_tool_requests=state.deferred(),
        revision=state.revision,
        updated_at=state.updated_at,
    )
