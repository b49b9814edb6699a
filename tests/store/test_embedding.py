"""fsm inside a host application: the host's engine, the host's transaction (issue 13).

A host app has its own engine (made by SQLAlchemy, not fsm) and its own table. It hands the
engine to ``ConversationStore(engine=...)`` (after ``configure_engine``) and writes an fsm turn
inside its own transaction with ``store.bind(conn)``: its row and the turn commit together, or
neither does. On both engines, sync and async.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine
from sqlalchemy.orm import Session

from fsm.store import (
    BoundStore,
    ConflictError,
    ConversationExistsError,
    ConversationStore,
    EngineNotConfiguredError,
    configure_engine,
)
from fsm.store.aio import AsyncConversationStore
from fsm.store.engine import async_url, create_readonly_engine
from tests.helpers.store import assert_blocks_whole, assert_openai_accepts, make_turn

host = sa.MetaData()
orders = sa.Table(
    "host_orders",
    host,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.String(20), nullable=False),
)
USER = {"role": "user", "content": "Pay order 7"}


class Boom(Exception):
    """The host's unit of work fails after writing."""


@pytest.fixture
def host_engine(db_url: sa.URL) -> Iterator[sa.Engine]:
    """The host's own engine (plain SQLAlchemy), set up for fsm, with the host's own table."""
    engine = configure_engine(sa.create_engine(db_url))
    host.create_all(engine)
    try:
        yield engine
    finally:
        host.drop_all(engine)  # PostgreSQL's test schema is shared by the session's tests
        engine.dispose()


def _orders(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(orders).order_by(orders.c.id))]


def test_host_row_and_turn_commit_in_one_transaction(
    host_engine: sa.Engine, db_url: sa.URL
) -> None:
    store = ConversationStore(engine=host_engine)
    cid = store.create_conversation("c1")
    turn = make_turn()
    with ConversationStore(db_url) as outsider, host_engine.begin() as conn:
        conn.execute(orders.insert().values(id=7, status="paid"))
        bound = store.bind(conn)
        assert isinstance(bound, BoundStore)
        assert bound.append(cid, [USER]) == 1
        done = bound.commit_turn(cid, turn, ["18 C, sunny"])
        assert done.created and done.seq == 1
        # inside the transaction, fsm reads its own uncommitted writes
        assert bound.history(cid) == [USER, *done.messages]
        assert bound.next_seq(cid) == 3
        # outside it, nothing is visible yet: neither the host's row nor the turn
        assert outsider.history(cid) == []
    assert _orders(host_engine) == [(7, "paid")]
    history = store.history(cid)
    assert history == [USER, *done.messages]
    assert_blocks_whole(history)
    assert_openai_accepts(history)
    store.close()


def test_rollback_removes_the_host_row_and_the_turn(host_engine: sa.Engine) -> None:
    store = ConversationStore(engine=host_engine)
    cid = store.create_conversation("c1")
    with pytest.raises(Boom), host_engine.begin() as conn:
        conn.execute(orders.insert().values(id=7, status="paid"))
        bound = store.bind(conn)
        bound.append(cid, [USER])
        bound.commit_turn(cid, make_turn(), ["18 C"])
        bound.record_attempt(cid, make_turn(response_id="chatcmpl-2"))
        bound.create_conversation("c2")
        raise Boom
    assert _orders(host_engine) == []
    assert store.history(cid) == []
    assert store.attempts(cid) == []
    assert store.next_seq(cid) == 0
    with pytest.raises(LookupError):
        store.next_seq("c2")


def test_an_orm_session_commits_its_rows_and_the_turn_together(host_engine: sa.Engine) -> None:
    store = ConversationStore(engine=host_engine)
    cid = store.create_conversation("c1")
    with Session(host_engine) as session, session.begin():
        session.execute(orders.insert().values(id=7, status="paid"))
        store.bind(session.connection()).commit_turn(cid, make_turn(), ["r"])
    assert _orders(host_engine) == [(7, "paid")]
    assert len(store.history(cid)) == 2
    with pytest.raises(Boom), Session(host_engine) as session, session.begin():
        session.execute(orders.insert().values(id=8, status="paid"))
        store.bind(session.connection()).append(cid, [USER])
        raise Boom
    assert _orders(host_engine) == [(7, "paid")]
    assert len(store.history(cid)) == 2


def test_a_failed_fsm_write_leaves_the_callers_transaction_usable(
    host_engine: sa.Engine,
) -> None:
    """Each bound write runs in a savepoint: a database error inside it (here a duplicate key,
    which aborts a whole PostgreSQL transaction otherwise) rolls back only fsm's part."""
    store = ConversationStore(engine=host_engine)
    cid = store.create_conversation("c1")
    with host_engine.begin() as conn:
        conn.execute(orders.insert().values(id=7, status="paid"))
        bound = store.bind(conn)
        with pytest.raises(ConversationExistsError):
            bound.create_conversation("c1")
        assert bound.create_conversation("c1", exist_ok=True) == "c1"
        bound.append(cid, [USER])
        conn.execute(orders.update().values(status="shipped"))
    assert _orders(host_engine) == [(7, "shipped")]
    assert store.history(cid) == [USER]


def test_a_conflict_in_the_callers_transaction_is_raised_not_retried(
    host_engine: sa.Engine,
) -> None:
    store = ConversationStore(engine=host_engine)
    cid = store.create_conversation("c1")
    store.append(cid, [USER])
    with host_engine.begin() as conn:
        conn.execute(orders.insert().values(id=7, status="paid"))
        with pytest.raises(ConflictError) as caught:
            store.bind(conn).commit_turn(cid, make_turn(), ["r"], expected_seq=0)
        assert caught.value.retryable and caught.value.actual_seq == 1
    # the caller decided to commit its own row anyway; the turn is not there
    assert _orders(host_engine) == [(7, "paid")]
    assert store.history(cid) == [USER]


def test_the_store_never_disposes_an_engine_it_did_not_create(host_engine: sa.Engine) -> None:
    pool = host_engine.pool
    with ConversationStore(engine=host_engine) as store:
        assert not store.owns_engine
        assert store.engine is host_engine
        store.create_conversation("c1")
    assert host_engine.pool is pool  # dispose() would have replaced the pool
    with host_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM fsm_conversations")).scalar_one() == 1


def test_url_and_engine_together_are_refused(host_engine: sa.Engine, db_url: sa.URL) -> None:
    with pytest.raises(TypeError, match="not both"):
        ConversationStore(db_url, engine=host_engine)


def test_an_sqlite_engine_not_set_up_for_fsm_is_refused(
    engine_name: str, db_url: sa.URL, host_engine: sa.Engine
) -> None:
    if engine_name != "sqlite":
        pytest.skip("PostgreSQL needs no engine set-up")
    plain = sa.create_engine(db_url)
    try:
        with pytest.raises(EngineNotConfiguredError, match=r"configure_engine\(engine\)"):
            ConversationStore(engine=plain)
        store = ConversationStore(engine=host_engine)
        with plain.connect() as conn, pytest.raises(EngineNotConfiguredError):
            store.bind(conn)
    finally:
        plain.dispose()


def test_configure_engine_sets_sqlite_pragmas_once(engine_name: str, db_url: sa.URL) -> None:
    if engine_name != "sqlite":
        pytest.skip("SQLite pragmas")
    engine = sa.create_engine(db_url)
    try:
        assert configure_engine(engine, busy_timeout=2.5) is engine
        assert configure_engine(engine) is engine  # a second call adds nothing
        with engine.begin() as conn:  # one BEGIN (two listeners would begin twice and fail)
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 2500
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
            conn.execute(sa.text("SAVEPOINT s1"))
            conn.execute(sa.text("RELEASE s1"))
        seen: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
        with engine.connect() as conn, conn.begin():
            conn.execute(sa.text("SELECT 1"))
        with engine.connect().execution_options(fsm_write=True) as conn, conn.begin():
            conn.execute(sa.text("SELECT 1"))
        assert [s for s in seen if s.startswith("BEGIN")] == ["BEGIN", "BEGIN IMMEDIATE"]
    finally:
        engine.dispose()


def test_configure_engine_after_the_engine_connected_still_works(
    engine_name: str, db_url: sa.URL
) -> None:
    """Issue 29: configure_engine() called after the host's engine connected: the pool's old
    connections are closed, so the store works at once; a connection the host still holds is
    refused with a message saying to open a new one (not "call configure_engine")."""
    if engine_name != "sqlite":
        pytest.skip("SQLite connections carry fsm's settings; PostgreSQL needs none")
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:  # the host's app ran before fsm was set up
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 0
        held = engine.connect()
        configure_engine(engine)
        store = ConversationStore(engine=engine)
        cid = store.create_conversation()
        store.commit_turn(cid, make_turn(), ["r"])
        with engine.begin() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
            store.bind(conn).append(cid, [{"role": "user", "content": "next"}])
        with pytest.raises(EngineNotConfiguredError, match=r"opened before .*open a new one"):
            store.bind(held)
        held.close()
    finally:
        engine.dispose()


def test_postgres_sessions_carry_no_fsm_setting(engine_name: str, db_url: sa.URL) -> None:
    """Transaction-pooling safe: fsm sets nothing per session; its write transactions set
    ``enable_seqscan`` with ``SET LOCAL``, and read-only transactions are ``READ ONLY`` one
    transaction at a time."""
    if engine_name != "postgresql":
        pytest.skip("PostgreSQL settings")
    seen: list[str] = []
    with ConversationStore(db_url) as store:
        sa.event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append(a[2].strip()))
        cid = store.create_conversation("c1")
        store.commit_turn(cid, make_turn(), ["r"])
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW enable_seqscan").scalar_one() == "on"
    # fsm begins its transactions itself, with their settings in the same round trip
    parts = [part for statement in seen for part in statement.split("; ")]
    sets = [s for s in parts if s.upper().startswith("SET")]
    assert sets and all(s.startswith("SET LOCAL ") for s in sets), sets
    # (commit_turn's one query has no BEGIN: its implicit transaction takes them)
    assert all(s.startswith(("BEGIN; SET LOCAL ", "SET LOCAL ")) for s in seen if "SET LOCAL" in s)
    # each write transaction begins with it (with the store's deadline, in the same round
    # trip): create_conversation, then commit_turn
    plan = [s for s in sets if s.startswith("SET LOCAL enable_seqscan = off")]
    assert len(plan) == 2, sets
    readonly = create_readonly_engine(db_url)
    try:
        with readonly.connect() as conn:
            assert conn.exec_driver_sql("SHOW transaction_read_only").scalar_one() == "on"
            conn.rollback()
            # the session itself is not read-only: only fsm's transactions are
            assert conn.exec_driver_sql("SHOW default_transaction_read_only").scalar_one() == "off"
    finally:
        readonly.dispose()


def test_a_host_postgres_engine_works_without_configure_engine(
    engine_name: str, db_url: sa.URL
) -> None:
    if engine_name != "postgresql":
        pytest.skip("PostgreSQL needs no engine set-up")
    engine = sa.create_engine(db_url)
    host.create_all(engine)
    try:
        store = ConversationStore(engine=engine)
        cid = store.create_conversation("c1")
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=1, status="new"))
            store.bind(conn).commit_turn(cid, make_turn(), ["r"])
        assert len(store.history(cid)) == 2
        assert _orders(engine) == [(1, "new")]
    finally:
        host.drop_all(engine)
        engine.dispose()


def test_a_host_postgres_engine_keeps_psycopg_s_own_begin(engine_name: str, db_url: sa.URL) -> None:
    """fsm's own engines send each transaction's BEGIN with its settings (psycopg kept in
    autocommit); a host's engine given to configure_engine is left as psycopg drives it: the
    store's writes through it and the host's own transactions send no BEGIN of fsm's, and its
    connections are not switched to autocommit."""
    if engine_name != "postgresql":
        pytest.skip("PostgreSQL's BEGIN")
    engine = configure_engine(sa.create_engine(db_url))
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2].strip()))
    try:
        store = ConversationStore(engine=engine)
        cid = store.create_conversation("c1")
        store.commit_turn(cid, make_turn(), ["r"])
        assert len(store.history(cid)) == 2
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            assert conn.connection.driver_connection.autocommit is False
            assert conn.connection.driver_connection.info.transaction_status == 2  # INTRANS
        assert seen and not any(s.upper().startswith("BEGIN") for s in seen), seen
    finally:
        engine.dispose()
    with ConversationStore(db_url) as own:  # and fsm's own engine does send it
        seen.clear()
        sa.event.listen(own.engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
        own.history(cid)
        assert seen[0].startswith("BEGIN ISOLATION LEVEL REPEATABLE READ; "), seen


# -- async ---------------------------------------------------------------------------------------
def _host_async_engine(db_url: sa.URL) -> AsyncEngine:
    engine = sa_create_async_engine(async_url(db_url))
    return configure_engine(engine)


def test_async_host_row_and_turn_commit_or_roll_back_together(db_url: sa.URL) -> None:
    async def body() -> None:
        engine = _host_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(host.create_all)
            store = AsyncConversationStore(engine=engine)
            assert not store.owns_engine
            cid = await store.create_conversation("c1")
            async with engine.begin() as conn:
                await conn.execute(orders.insert().values(id=7, status="paid"))
                bound = await store.bind(conn)
                assert await bound.append(cid, [USER]) == 1
                done = await bound.commit_turn(cid, make_turn(), ["18 C"])
                assert await bound.history(cid) == [USER, *done.messages]
                assert await bound.next_seq(cid) == 3
            assert await store.history(cid) == [USER, *done.messages]
            with pytest.raises(Boom):
                async with engine.begin() as conn:
                    await conn.execute(orders.insert().values(id=8, status="paid"))
                    bound = await store.bind(conn)
                    await bound.commit_turn(cid, make_turn(response_id="chatcmpl-2"), ["x"])
                    await bound.record_attempt(cid, make_turn(response_id="chatcmpl-3"))
                    raise Boom
            assert await store.history(cid) == [USER, *done.messages]
            assert await store.attempts(cid) == []
            async with engine.connect() as conn:
                rows = (await conn.execute(sa.select(orders.c.id))).scalars().all()
            assert rows == [7]
            async with engine.begin() as conn:
                bound = await store.bind(conn)
                with pytest.raises(ConflictError):
                    await bound.append(cid, [USER], expected_seq=0)
                with pytest.raises(ConversationExistsError):
                    await bound.create_conversation("c1")
                await bound.append(cid, [USER])
            assert len(await store.history(cid)) == 4
            await store.close()
            async with engine.connect() as conn:  # still open: the store did not dispose it
                assert (await conn.execute(sa.text("SELECT 1"))).scalar_one() == 1
        finally:
            async with engine.begin() as conn:
                await conn.run_sync(host.drop_all)
            await engine.dispose()

    asyncio.run(body())


def test_async_unconfigured_sqlite_engine_is_refused(engine_name: str, db_url: sa.URL) -> None:
    if engine_name != "sqlite":
        pytest.skip("PostgreSQL needs no engine set-up")

    async def body() -> None:
        engine = sa_create_async_engine(async_url(db_url))
        try:
            with pytest.raises(EngineNotConfiguredError):
                await AsyncConversationStore(engine=engine).open()
        finally:
            await engine.dispose()

    asyncio.run(body())
