"""An openai-agents ``Session`` over fsm's store: the runner's history, enforced by the database.

::

    from agents import Agent, Runner
    from fsm.store import ConversationStore
    from fsm.integrations.openai_agents import FsmSession

    store = ConversationStore("chat.db")
    session = FsmSession(store, "user-42")
    result = await Runner.run(agent, "What is 1234 + 5678?", session=session)

:class:`FsmSession` implements the openai-agents ``Session`` protocol (``get_items``,
``add_items``, ``pop_item``, ``clear_session``, with ``session_id`` and ``session_settings``)
over a :class:`~fsm.store.ConversationStore` (its calls run in a worker thread, as the protocol
is async) or an :class:`~fsm.store.aio.AsyncConversationStore`. The session is the fsm
conversation ``session_id`` (created on the first write) and the runner's items are Responses
API items, which fsm stores as they are (``history(format="responses")`` gives them back):

- input messages are plain messages; each run of model output items (reasoning, the assistant's
  message, ``function_call`` items, built-in tool items) is an assistant turn, parsed by fsm's
  parser as the response that carried it (arguments must be JSON, a call must have a name), and
  committed with the ``function_call_output`` items that answer its calls: one transaction, the
  store's tool-call contract enforced by the database;
- a turn whose calls are not all answered by the end of a batch (an approval interruption, a
  tool that has not returned) goes to fsm's **tool ledger** as the conversation's pending turn
  (``fsm audit pending`` lists it), with the outputs that came recorded. It is not history, so
  :meth:`~FsmSession.get_items` never hands the model a call without its output. The outputs of
  a later batch (the run resumed) are recorded on it and commit it. If the runner writes
  anything else first, the calls' outputs will never come: the pending turn is abandoned
  (kept in the ledger for audit, with the reason) or, with ``unanswered="raise"``,
  :class:`~fsm.integrations.errors.UnansweredCallsError` is raised and it stays pending;
- fsm's history is append-only: :meth:`~FsmSession.pop_item` of a committed item raises
  :class:`~fsm.integrations.errors.HistoryRewriteError`; :meth:`~FsmSession.clear_session`
  deletes the conversation (``delete_conversation``: its messages, calls, attempts and ledger).

The module imports ``agents`` only when a session is made: without it, :class:`FsmSession`
raises :class:`~fsm.integrations.errors.FrameworkMissingError` naming
``pip install 'fsm-toolcalls[openai-agents]'``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

from fsm.integrations.errors import (
    FrameworkMissingError,
    HistoryRewriteError,
    UnansweredCallsError,
)
from fsm.store.errors import ConversationNotFoundError, InvalidMessageError, ResultsError
from fsm.store.importing import is_responses_output, responses_result, responses_turn
from fsm.store.ledger import Outcome, PendingTurn
from fsm.store.plans import check_conversation_id

__all__ = ["FsmSession"]

#: the extra that installs openai-agents
EXTRA = "openai-agents"


def _require_agents() -> Any:
    """The ``agents.memory`` module, or :class:`FrameworkMissingError` naming the extra."""
    try:
        return importlib.import_module("agents.memory")
    except ImportError as exc:
        raise FrameworkMissingError("openai-agents", EXTRA, str(exc)) from None


class FsmSession:
    """The openai-agents ``Session`` protocol over an fsm store (see the module).

    Args:
        store: a :class:`~fsm.store.ConversationStore` (each call runs in a worker thread) or an
            :class:`~fsm.store.aio.AsyncConversationStore` (awaited). A bound store (``bind()``)
            has no tool ledger and is refused (``TypeError``).
        session_id: the fsm conversation id (a non-empty string of at most 255 characters);
            the conversation is created on the first write if it does not exist.
        session_settings: openai-agents' ``SessionSettings`` (or a dict of them), e.g. a
            default ``limit`` for the runner's reads.
        unanswered: what to do when the runner writes past calls whose outputs never came:
            ``"abandon"`` (the default) abandons the pending turn in the ledger (kept for audit
            with the reason, never history) and goes on; ``"raise"`` raises
            :class:`~fsm.integrations.errors.UnansweredCallsError` and leaves it pending.

    Raises :class:`~fsm.integrations.errors.FrameworkMissingError` without openai-agents, and
    :class:`~fsm.store.errors.InvalidConversationIdError` for a bad ``session_id``.
    """

    def __init__(
        self,
        store: Any,
        session_id: str,
        *,
        session_settings: Any = None,
        unanswered: Literal["abandon", "raise"] = "abandon",
    ) -> None:
        memory = _require_agents()
        check_conversation_id(session_id)
        if unanswered not in ("abandon", "raise"):
            raise ValueError(f"unanswered must be 'abandon' or 'raise', got {unanswered!r}")
        if not callable(getattr(store, "begin", None)) or not callable(
            getattr(store, "history", None)
        ):
            raise TypeError(
                "FsmSession takes a ConversationStore or an AsyncConversationStore (a store "
                f"with the tool ledger), not {type(store).__name__}"
            )
        self.store = store
        self.session_id: str = session_id
        self.session_settings: Any = (
            memory.SessionSettings()
            if session_settings is None
            else memory.session_settings.coerce_session_settings(session_settings)
        )
        self.unanswered = unanswered
        self._async = inspect.iscoroutinefunction(store.history)
        self._created = False
        self._lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"FsmSession({self.store!r}, {self.session_id!r})"

    # -- the Session protocol --------------------------------------------------------------------
    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The session's history as Responses input items, oldest first: every committed turn
        with its calls' outputs (a pending turn is not history, so no call comes back without
        its output). ``limit``: only the latest ``limit`` items (``None``: all; the
        ``session_settings`` default is the runner's to apply)."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"limit is an int or None, not {type(limit).__name__}")
        if limit is not None and limit <= 0:
            return []
        try:
            if limit is not None:
                # a window of at least ``limit`` messages holds at least ``limit`` items
                items = await self._call("history", self.session_id, last=limit, format="responses")
                if len(items) >= limit:
                    return list(items[-limit:])
            items = await self._call("history", self.session_id, format="responses")
        except ConversationNotFoundError:
            return []
        return list(items if limit is None else items[-limit:])

    async def add_items(self, items: Sequence[Any]) -> None:
        """Append the runner's ``items`` (Responses input items, dicts) to the conversation.

        Leading ``function_call_output`` items answer the pending turn's calls (recorded on
        it; when all are answered, it commits). Then the complete part (plain messages, turns
        with all their outputs) goes in as ``import_history`` writes it, in one transaction,
        and a last turn whose calls are not all answered becomes the pending turn, with the
        outputs that came. Breaking the tool-call contract is a typed error
        (:class:`~fsm.store.errors.ResultsError`: an output for no call, out of its slot;
        :class:`~fsm.store.errors.InvalidMessageError`: arguments that are not JSON, an item
        fsm cannot store) and that part is not written.
        """
        batch = [_as_item(i, item) for i, item in enumerate(items)]
        if not batch:
            return
        async with self._locked():
            await self._ensure_conversation()
            rest = await self._settle_pending(batch)
            if rest:
                await self._append(rest)

    async def pop_item(self) -> Any:
        """``None`` for an empty session; otherwise
        :class:`~fsm.integrations.errors.HistoryRewriteError`: fsm's history is append-only,
        and the last item is part of a committed message or turn."""
        async with self._locked():
            last = await self.get_items(limit=1)
            pending = await self._pending()
        if not last and pending is None:
            return None
        what = (
            f"a pending turn with call(s) {_names(pending)}"
            if pending is not None
            else f"a committed {last[-1].get('type') or 'message'} item"
        )
        raise HistoryRewriteError(
            f"pop_item() cannot remove the last item of session {self.session_id!r} ({what}): "
            "fsm's history is append-only; start a new session_id, or clear_session() to delete "
            "the whole conversation"
        )

    async def clear_session(self) -> None:
        """Delete the conversation with everything fsm holds for it (messages, calls,
        attempts, the ledger's turns): ``delete_conversation``. The next write starts it
        anew."""
        async with self._locked():
            await self._call("delete_conversation", self.session_id)
            self._created = False

    # -- what fsm adds ---------------------------------------------------------------------------
    async def pending(self) -> PendingTurn | None:
        """The session's pending turn (calls whose outputs have not all come), or ``None``."""
        return await self._pending()

    # -- internals -------------------------------------------------------------------------------
    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.store, name)
        if self._async:
            return await method(*args, **kwargs)
        return await asyncio.to_thread(partial(method, *args, **kwargs))

    async def _ensure_conversation(self) -> None:
        if not self._created:
            await self._call("create_conversation", self.session_id, exist_ok=True)
            self._created = True

    async def _pending(self) -> PendingTurn | None:
        try:
            found: PendingTurn | None = await self._call("pending", self.session_id)
        except ConversationNotFoundError:
            return None
        return found

    async def _settle_pending(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Record the batch's leading outputs on the pending turn (committing it once every
        call is answered); the rest of the batch."""
        pending = await self._pending()
        if pending is None:
            return batch
        open_calls = {e.call.id: e.call.position for e in pending.executions if not e.finished}
        answers: list[tuple[int, Any]] = []
        at = 0
        while at < len(batch):
            found = responses_result(batch[at])
            if found is None or found[0] not in open_calls:
                break
            answers.append((open_calls.pop(found[0]), found[1]))
            at += 1
        rest = batch[at:]
        if rest and open_calls and self.unanswered == "raise":
            raise UnansweredCallsError(
                f"session {self.session_id!r}: call(s) {_names(pending, open_calls)} of the "
                "pending turn have no output and the runner wrote past them; give their "
                "function_call_output items first, or use unanswered='abandon'"
            )
        pending = await self._call("claim", pending)
        if open_calls and rest:
            # the run went on: these outputs will never come
            await self._call(
                "abandon",
                pending,
                f"openai-agents session {self.session_id!r} went on without outputs for call(s) "
                f"{_names(pending, open_calls)}; never handed back to the model unanswered",
            )
            return rest
        await self._record(pending, answers, commit=not open_calls)
        return rest

    async def _record(
        self, pending: PendingTurn, answers: list[tuple[int, Any]], *, commit: bool
    ) -> None:
        """Record each answer on the owned ``pending`` turn; commit it (``commit``) or leave it
        pending, released for the next writer."""
        previous: Outcome | None = None
        for position, content in answers:
            pending = await self._call("started", pending, position, recording=previous)
            previous = Outcome(position, result=content)
        if commit:
            await self._call("commit", pending, recording=previous)
            return
        if previous is not None:
            pending = await self._call("succeeded", pending, previous.call, previous.result)
        await self._call("release", pending)

    async def _append(self, batch: list[dict[str, Any]]) -> None:
        """Write ``batch`` (no pending turn before it): the complete part as an import, a last
        turn with unanswered calls as the pending turn."""
        start, end = _last_turn(batch)
        if start is not None:
            result = responses_turn(batch[start:end], start)
            calls = result.turns[0].tool_calls
            ids = {c.id: position for position, c in enumerate(calls)}
            answers: list[tuple[int, Any]] = []
            for item in batch[end:]:
                found = responses_result(item)
                if found is None or found[0] not in ids:
                    break
                answers.append((ids.pop(found[0]), found[1]))
            else:
                if ids:  # calls left unanswered at the end of the batch: the ledger's
                    if start:
                        await self._import(batch[:start])
                    pending = await self._call("begin", self.session_id, result)
                    await self._record(pending, answers, commit=False)
                    return
                # outputs out of call order: each goes to its call's slot
                batch = batch[:end] + _in_call_order(batch[end:], [c.id for c in calls])
        await self._import(batch)

    async def _import(self, batch: list[dict[str, Any]]) -> None:
        await self._call("import_history", self.session_id, batch, format="responses")


def _as_item(index: int, item: Any) -> dict[str, Any]:
    """A runner's item as a plain dict (the runner gives dicts; a pydantic model of one is
    dumped)."""
    if isinstance(item, Mapping):
        return dict(item)
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        dumped = dump(exclude_unset=True, mode="json")
        if isinstance(dumped, dict):
            return dumped
    raise InvalidMessageError(
        f"item {index} is not a Responses input item (a dict): {type(item).__name__}"
    )


def _last_turn(batch: list[dict[str, Any]]) -> tuple[int | None, int]:
    """``(start, end)`` of the last run of model output items whose calls' outputs are all
    that follows it, or ``(None, 0)``."""
    end = len(batch)
    while end and responses_result(batch[end - 1]) is not None:
        end -= 1
    if not end or not is_responses_output(batch[end - 1]):
        return None, 0
    start = end
    while start and is_responses_output(batch[start - 1]):
        start -= 1
    return start, end


def _in_call_order(outputs: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    rank = {call_id: n for n, call_id in enumerate(order)}
    keyed = [(rank.get(str(item.get("call_id")), len(rank)), n) for n, item in enumerate(outputs)]
    if len({k for k, _ in keyed}) != len(keyed):
        raise ResultsError(
            "two function_call_output items answer the same call: each call has one output"
        )
    return [outputs[n] for _, n in sorted(keyed)]


def _names(pending: PendingTurn | None, only: Mapping[str, int] | None = None) -> str:
    if pending is None:
        return ""
    calls = [e.call for e in pending.executions if only is None or e.call.id in only]
    return ", ".join(f"{c.id!r} ({c.name})" for c in calls)
