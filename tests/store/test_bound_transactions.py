"""A host's transaction given to ``store.bind()`` (issue 26, finding 8): what the host's
transaction does to fsm's writes comes out as the store's typed errors, never a raw driver
error or the wrong error.

* Under REPEATABLE READ or SERIALIZABLE (PostgreSQL), a turn committed by another transaction
  after this one's snapshot was taken makes this one's write a lost race: the retryable
  :class:`StoreBusyError` (a serialization failure), never a :class:`ValueRejectedError`; run
  again, the unit of work succeeds. Under READ COMMITTED the same sequence simply succeeds.
* A transaction that has already failed (PostgreSQL SQLSTATE 25P02) gives
  :class:`HostTransactionError`, for every bound method, sync and async.
* A connection to a database whose fsm schema is older gives :class:`SchemaNotAtHeadError`
  naming ``fsm db upgrade``, at ``bind()``, on each engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore, configure_engine, upgrade
from fsm.store.aio import AsyncConversationStore
from fsm.store.errors import (
    HostTransactionError,
    SchemaNotAtHeadError,
    StoreBusyError,
    ValueRejectedError,
)
from tests.helpers.store import make_turn


@pytest.fixture
def shared(db_url: sa.URL) -> Iterator[tuple[sa.Engine, ConversationStore]]:
    engine = sa.create_engine(db_url)
    if db_url.get_backend_name() == "sqlite":
        configure_engine(engine)
    store = ConversationStore(engine=engine)
    store.create_conversation("c")
    store.append("c", [{"role": "user", "content": "q"}])
    try:
        yield engine, store
    finally:
        engine.dispose()


def _turn(tag: str) -> Any:
    return make_turn([(f"call-{tag}", "f", "{}")], response_id=f"r-{tag}")


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("first", ["read", "nothing"])
@pytest.mark.parametrize("write", ["commit_turn", "append", "record_attempt"])
def test_a_stale_snapshot_is_a_retryable_conflict(
    engine_name: str,
    shared: tuple[sa.Engine, ConversationStore],
    level: str,
    first: str,
    write: str,
) -> None:
    if engine_name != "postgresql":
        pytest.skip("SQLite has one writer at a time: no snapshot goes stale under a writer")
    engine, store = shared
    writes: dict[str, Callable[[Any], Any]] = {
        "commit_turn": lambda bound: bound.commit_turn("c", _turn("two"), ["ok"]),
        "append": lambda bound: bound.append("c", [{"role": "user", "content": "two"}]),
        "record_attempt": lambda bound: bound.record_attempt(
            "c", make_turn([("cut", "f", '{"a')], response_id="r-cut", finish_reason="length")
        ),
    }
    with engine.connect().execution_options(isolation_level=level) as second:
        second.begin()
        if first == "read":
            store.bind(second).history("c")
        else:
            second.execute(sa.text("SELECT 1"))  # the snapshot is taken here
        with engine.connect().execution_options(isolation_level=level) as one, one.begin():
            store.bind(one).commit_turn("c", _turn("one"), ["ok"])
        if write == "record_attempt":
            # an attempt has no unique key to break: it goes in at the seq this snapshot saw
            writes[write](store.bind(second))
            second.rollback()
            return
        with pytest.raises(StoreBusyError) as caught:
            writes[write](store.bind(second))
        assert caught.value.retryable and not isinstance(caught.value, ValueRejectedError)
        assert "run the unit of work again" in str(caught.value)
        second.rollback()
    # run again, the unit of work succeeds
    with engine.connect().execution_options(isolation_level=level) as again, again.begin():
        writes[write](store.bind(again))
    assert len(store.history("c")) == (5 if write == "commit_turn" else 4)


def test_read_committed_waits_for_nothing_and_succeeds(
    engine_name: str, shared: tuple[sa.Engine, ConversationStore]
) -> None:
    if engine_name != "postgresql":
        pytest.skip("isolation levels of PostgreSQL")
    engine, store = shared
    with engine.connect() as second:
        second.begin()
        store.bind(second).history("c")
        with engine.connect() as one, one.begin():
            store.bind(one).commit_turn("c", _turn("one"), ["ok"])
        store.bind(second).commit_turn("c", _turn("two"), ["ok"])
        second.commit()
    assert len(store.history("c")) == 5


def _fail(conn: sa.Connection) -> None:
    with pytest.raises(sa.exc.DBAPIError):
        conn.execute(sa.text("SELECT 1 / 0"))


@pytest.mark.parametrize(
    "call",
    ["append", "commit_turn", "record_attempt", "history", "next_seq", "attempts", "create"],
)
def test_a_failed_host_transaction_is_typed(
    engine_name: str, shared: tuple[sa.Engine, ConversationStore], call: str
) -> None:
    if engine_name != "postgresql":
        pytest.skip("SQLite has no aborted transaction state")
    engine, store = shared
    calls: dict[str, Callable[[Any], Any]] = {
        "append": lambda b: b.append("c", [{"role": "user", "content": "x"}]),
        "commit_turn": lambda b: b.commit_turn("c", _turn("x"), ["ok"]),
        "record_attempt": lambda b: b.record_attempt("c", _turn("y")),
        "history": lambda b: b.history("c"),
        "next_seq": lambda b: b.next_seq("c"),
        "attempts": lambda b: b.attempts("c"),
        "create": lambda b: b.create_conversation("d"),
    }
    with engine.connect() as conn, conn.begin():
        bound = store.bind(conn)
        _fail(conn)
        with pytest.raises(HostTransactionError, match="roll the transaction back"):
            calls[call](bound)


def test_a_failed_host_transaction_is_typed_async(engine_name: str, db_url: sa.URL) -> None:
    if engine_name != "postgresql":
        pytest.skip("SQLite has no aborted transaction state")

    async def run() -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(db_url.set(drivername="postgresql+psycopg_async"))
        try:
            async with AsyncConversationStore(engine=engine) as store:
                await store.create_conversation("c")
                async with engine.connect() as conn, conn.begin():
                    bound = await store.bind(conn)
                    with pytest.raises(sa.exc.DBAPIError):
                        await conn.execute(sa.text("SELECT 1 / 0"))
                    with pytest.raises(HostTransactionError):
                        await bound.append("c", [{"role": "user", "content": "x"}])
        finally:
            await engine.dispose()

    asyncio.run(run())


def test_bind_to_an_older_schema_says_to_upgrade(db_url: sa.URL, empty_url: sa.URL) -> None:
    upgrade(empty_url, "0006_token_columns")  # before 0007's stream formats
    old = sa.create_engine(empty_url)
    if empty_url.get_backend_name() == "sqlite":
        configure_engine(old)
    try:
        with ConversationStore(db_url) as store, old.connect() as conn:
            with pytest.raises(SchemaNotAtHeadError, match="fsm db upgrade") as caught:
                store.bind(conn)
            assert "0006_token_columns" in str(caught.value)
            conn.rollback()
        upgrade(empty_url)
        with ConversationStore(db_url) as store, old.connect() as conn, conn.begin():
            bound = store.bind(conn)  # at head now
            bound.create_conversation("c")
            bound.commit_turn("c", _turn("one"), ["ok"])
    finally:
        old.dispose()


def test_bind_begins_no_transaction(db_url: sa.URL, empty_url: sa.URL) -> None:
    """bind() on a connection with no transaction leaves it so (reading the schema's revision
    ends there): the caller's own ``begin()`` after it still works."""
    upgrade(empty_url)
    engine = sa.create_engine(empty_url)
    if empty_url.get_backend_name() == "sqlite":
        configure_engine(engine)
    try:
        with ConversationStore(db_url) as store, engine.connect() as conn:
            bound = store.bind(conn)
            assert not conn.in_transaction()
            with conn.begin():
                bound.create_conversation("c")
        with ConversationStore(empty_url) as store:
            assert store.history("c") == []
    finally:
        engine.dispose()
