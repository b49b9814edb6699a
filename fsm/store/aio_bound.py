""":class:`AsyncBoundStore`: an async store inside a caller's
:class:`~sqlalchemy.ext.asyncio.AsyncConnection` (:meth:`fsm.store.aio.AsyncConversationStore.bind`;
:mod:`fsm.store.aio` re-exports it), the methods of :class:`~fsm.store.bound.BoundStore` awaited."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from sqlalchemy.ext.asyncio import AsyncConnection

from fsm.parser import Anomaly, ParseResult, Turn
from fsm.store.bound import BoundStore
from fsm.store.core import StoreCore
from fsm.store.history import CommittedTurn
from fsm.store.render import HistoryFormat
from fsm.store.store import Results
from fsm.telemetry import store_write
from fsm.types import AnthropicMessage, Message, ResponsesItem


class AsyncBoundStore:
    """An async store's view inside a caller's
    :class:`~sqlalchemy.ext.asyncio.AsyncConnection` (:meth:`AsyncConversationStore.bind`): the
    methods of :class:`~fsm.store.store.BoundStore`, awaited, each run on the caller's
    connection through :meth:`~sqlalchemy.ext.asyncio.AsyncConnection.run_sync`.

    .. code-block:: python

        async with engine.begin() as conn:        # the host's AsyncEngine and transaction
            await conn.execute(orders.insert().values(id=7, status="paid"))
            bound = await store.bind(conn)
            await bound.commit_turn(cid, turn, results)
    """

    caller_transaction = True

    def __init__(self, core: StoreCore, connection: AsyncConnection, sync: BoundStore) -> None:
        self._core = core
        self._conn = connection
        self._sync = sync

    @property
    def connection(self) -> AsyncConnection:
        """The caller's connection."""
        return self._conn

    @property
    def dialect(self) -> str:
        """The database's dialect: ``sqlite`` or ``postgresql``."""
        return str(self._conn.dialect.name)

    def __repr__(self) -> str:
        return f"AsyncBoundStore({self._core.url!r})"

    async def create_conversation(
        self,
        conversation_id: str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        exist_ok: bool = False,
    ) -> str:
        """:meth:`AsyncConversationStore.create_conversation`, in the caller's transaction."""
        bound = self._sync
        result: str = await self._conn.run_sync(
            lambda _conn: bound.create_conversation(
                conversation_id, metadata=metadata, exist_ok=exist_ok
            )
        )
        return result

    async def delete_conversation(self, conversation_id: str) -> bool:
        """:meth:`AsyncConversationStore.delete_conversation`, in the caller's transaction."""
        bound = self._sync
        result: bool = await self._conn.run_sync(
            lambda _conn: bound.delete_conversation(conversation_id)
        )
        return result

    async def next_seq(self, conversation_id: str) -> int:
        """:meth:`AsyncConversationStore.next_seq`, in the caller's transaction."""
        bound = self._sync
        result: int = await self._conn.run_sync(lambda _conn: bound.next_seq(conversation_id))
        return result

    @store_write("append")
    async def append(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        expected_seq: int | None = None,
    ) -> int:
        """:meth:`AsyncConversationStore.append`, in the caller's transaction."""
        bound = self._sync
        result: int = await self._conn.run_sync(
            lambda _conn: _undecorated(bound.append)(
                conversation_id, messages, expected_seq=expected_seq
            )
        )
        return result

    @store_write("commit_turn")
    async def commit_turn(
        self,
        conversation_id: str,
        turn: Turn | ParseResult,
        results: Results | None = None,
        *,
        expected_seq: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommittedTurn:
        """:meth:`AsyncConversationStore.commit_turn`, in the caller's transaction."""
        bound = self._sync
        result: CommittedTurn = await self._conn.run_sync(
            lambda _conn: _undecorated(bound.commit_turn)(
                conversation_id,
                turn,
                results,
                expected_seq=expected_seq,
                idempotency_key=idempotency_key,
            )
        )
        return result

    @store_write("import_history")
    async def import_history(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        format: str = "chat",
        expected_seq: int | None = None,
    ) -> int:
        """:meth:`BoundStore.import_history <fsm.store.BoundStore.import_history>`, in the
        caller's transaction."""
        bound = self._sync
        seq: int = await self._conn.run_sync(
            lambda _conn: _undecorated(bound.import_history)(
                conversation_id, messages, format=format, expected_seq=expected_seq
            )
        )
        return seq

    @store_write("record_attempt")
    async def record_attempt(
        self,
        conversation_id: str,
        attempt: Turn | ParseResult,
        *,
        results: Results | None = None,
        error: str | None = None,
        anomalies: Sequence[Anomaly] = (),
    ) -> list[int]:
        """:meth:`AsyncConversationStore.record_attempt`, in the caller's transaction."""
        bound = self._sync
        result: list[int] = await self._conn.run_sync(
            lambda _conn: _undecorated(bound.record_attempt)(
                conversation_id, attempt, results=results, error=error, anomalies=anomalies
            )
        )
        return result

    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["chat"] = ...,
    ) -> list[Message]: ...
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["responses"],
    ) -> list[ResponsesItem]: ...
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: Literal["anthropic"],
    ) -> list[AnthropicMessage]: ...
    @overload
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = ...,
        include_reasoning: bool = ...,
        format: HistoryFormat = ...,
    ) -> list[Message] | list[ResponsesItem] | list[AnthropicMessage]: ...
    async def history(
        self,
        conversation_id: str,
        *,
        last: int | None = None,
        include_reasoning: bool = False,
        format: HistoryFormat = "chat",
    ) -> list[Message] | list[ResponsesItem] | list[AnthropicMessage]:
        """:meth:`AsyncConversationStore.history`, in the caller's transaction."""
        bound = self._sync
        result: list[Message] | list[ResponsesItem] | list[AnthropicMessage]
        result = await self._conn.run_sync(
            lambda _conn: bound.history(
                conversation_id, last=last, include_reasoning=include_reasoning, format=format
            )
        )
        return result

    async def attempts(self, conversation_id: str) -> list[dict[str, Any]]:
        """:meth:`AsyncConversationStore.attempts`, in the caller's transaction."""
        bound = self._sync
        result: list[dict[str, Any]] = await self._conn.run_sync(
            lambda _conn: bound.attempts(conversation_id)
        )
        return result


def _undecorated(method: Any) -> Any:
    """A bound method without its logging/tracing decorator (the async caller has its own)."""
    inner = getattr(method, "__wrapped__", None)
    if inner is None:
        return method
    return functools.partial(inner, method.__self__)
