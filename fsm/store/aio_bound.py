""":class:`AsyncBoundStore`: an async store inside a caller's
:class:`~sqlalchemy.ext.asyncio.AsyncConnection` (:meth:`fsm.store.aio.AsyncConversationStore.bind`;
:mod:`fsm.store.aio` re-exports it), the methods of :class:`~fsm.store.bound.BoundStore` awaited."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, overload

from sqlalchemy.ext.asyncio import AsyncConnection

from fsm.store.bound import BoundStore
from fsm.store.core import StoreCore
from fsm.store.render import HistoryFormat
from fsm.telemetry import store_write
from fsm.types import AnthropicMessage, Message, ResponsesItem

P = ParamSpec("P")
R = TypeVar("R")


def _awaited(
    method: Callable[Concatenate[BoundStore, P], R],
) -> Callable[Concatenate[AsyncBoundStore, P], Coroutine[Any, Any, R]]:
    """:class:`BoundStore`'s ``method``, awaited: run on the caller's connection through
    :meth:`~sqlalchemy.ext.asyncio.AsyncConnection.run_sync`, its parameters and result the
    same (its logging/tracing decorator left out: the async method has its own)."""
    inner: Callable[..., R] = getattr(method, "__wrapped__", method)

    async def run(self: AsyncBoundStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        bound = self._sync
        result: R = await self._conn.run_sync(lambda _conn: inner(bound, *args, **kwargs))
        return result

    functools.update_wrapper(run, method)
    name = method.__name__
    run.__qualname__ = f"AsyncBoundStore.{name}"
    run.__doc__ = (
        f":meth:`BoundStore.{name} <fsm.store.BoundStore.{name}>`, awaited, in the caller's "
        "transaction."
    )
    return run


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

    # Every operation but ``history`` (whose overloads say what each format returns) is the
    # BoundStore's, awaited: one table, not a copy of each method.
    create_conversation = _awaited(BoundStore.create_conversation)
    delete_conversation = _awaited(BoundStore.delete_conversation)
    next_seq = _awaited(BoundStore.next_seq)
    append = store_write("append")(_awaited(BoundStore.append))
    commit_turn = store_write("commit_turn")(_awaited(BoundStore.commit_turn))
    import_history = store_write("import_history")(_awaited(BoundStore.import_history))
    record_attempt = store_write("record_attempt")(_awaited(BoundStore.record_attempt))
    attempts = _awaited(BoundStore.attempts)

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
