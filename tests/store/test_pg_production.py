"""PostgreSQL in production (issue 27), on the test server: no prepared statements by default,
fsm's own URL options, multi-host URLs, no JIT in the store's transactions, a reader database
for audit reads (history stays on the primary), and the typed errors of a pooler, a read-only
node and a read whose COMMIT lost its connection. The same with the real components (a
PgBouncer, a standby promoted, a full server): tests/store/test_pg_components.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import (
    ConversationNotFoundError,
    ConversationStore,
    DatabaseUrlError,
    PoolerError,
    ReadOnlyNodeError,
    StoreUnavailableError,
)
from fsm.store.engine import create_engine, engine_url_options, normalize_url
from fsm.store.migrate import upgrade
from tests.helpers.store import make_turn, pg_schema_url, postgres_server

# -- URLs (no server needed) ------------------------------------------------------------------


def test_multi_host_url_is_accepted() -> None:
    """The URL pg_auto_failover prints: every host in order, the query kept."""
    url = normalize_url(
        "postgresql://app:secret@host1:5432,host2:5433/db?target_session_attrs=read-write"
    )
    assert url.drivername == "postgresql+psycopg"
    assert url.database == "db" and url.password == "secret"
    assert url.query["host"] == ("host1:5432", "host2:5433")
    assert url.query["target_session_attrs"] == "read-write"
    with pytest.raises(DatabaseUrlError, match="empty host"):
        normalize_url("postgresql://u@host1:5432,,host2/db")


def test_engine_url_options_are_split_off() -> None:
    url, engine, connect = engine_url_options(
        normalize_url("postgresql://u@h/db?prepare_threshold=5&pool_size=4&max_overflow=0&x=1")
    )
    assert dict(url.query) == {"x": "1"}
    assert engine == {"pool_size": 4, "max_overflow": 0}
    assert connect == {"prepare_threshold": 5}
    assert engine_url_options(normalize_url("postgresql://u@h/db?prepare_threshold=None"))[2] == {
        "prepare_threshold": None
    }
    for bad in (
        "prepare_threshold=x",
        "prepare_threshold=0",
        "pool_size=-1",
        "pool_timeout=0",
        "max_overflow=two",
    ):
        with pytest.raises(DatabaseUrlError, match=bad.split("=")[0]):
            create_engine(f"postgresql://u@h/db?{bad}")


# -- on the test server -----------------------------------------------------------------------


@pytest.fixture
def pg_url() -> Iterator[sa.URL]:
    """A fresh schema at head on the test server (its search_path set in the URL)."""
    url, drop = pg_schema_url(postgres_server())
    upgrade(url)
    try:
        yield url
    finally:
        drop()


def _text(url: sa.URL) -> str:
    return url.render_as_string(hide_password=False)


def _commit(store: ConversationStore, conv: str, n: int = 1) -> None:
    for i in range(n):
        turn = make_turn(((f"call_{i}", "get_weather", '{"city": "Paris"}'),), response_id=None)
        store.commit_turn(conv, turn, ["sunny"], idempotency_key=f"{conv}-{i}")


@pytest.mark.postgres
def test_no_server_side_prepared_statements_by_default(pg_url: sa.URL) -> None:
    """psycopg prepares a statement run 5 times on a connection unless told not to: behind a
    transaction pooler another client then runs into it. fsm's engines prepare nothing."""
    with ConversationStore(pg_url) as store:
        conv = store.create_conversation()
        _commit(store, conv, 8)
        for _ in range(8):
            store.history(conv)
        with store.engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None
            prepared = conn.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements")
            assert prepared.scalar() == 0
    # asked for in the URL, it is what the driver gets (not an exit 70)
    with ConversationStore(_text(pg_url) + "&prepare_threshold=5&pool_size=3") as store:
        assert store.engine.pool.size() == 3  # type: ignore[attr-defined]
        with store.engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold == 5


@pytest.mark.postgres
def test_cli_takes_url_options_and_multi_host_urls(pg_url: sa.URL) -> None:
    """``?prepare_threshold=None`` (exit 70 before) and the multi-host URL (exit 2 before):
    a host that refuses comes first, libpq goes on to the next."""
    with ConversationStore(pg_url) as store:
        conv = store.create_conversation()
    text = _text(pg_url)
    base = pg_url.set(host=None, port=None)
    host, port = pg_url.host, pg_url.port or 5432
    multi = _text(base).replace("@/", f"@127.0.0.1:1,{host}:{port}/", 1)
    for url in (
        text + "&prepare_threshold=None",
        text + "&prepare_threshold=5&pool_size=2&max_overflow=0",
        multi + "&target_session_attrs=read-write",
    ):
        result = CliRunner().invoke(cli, ["conversations", "--db", url, "--json"])
        assert result.exit_code == 0, (url, result.output, result.stderr)
        assert conv in result.output
        result = CliRunner().invoke(cli, ["audit", "check", "--db", url])
        assert result.exit_code == 0, (url, result.output, result.stderr)


@pytest.mark.postgres
def test_no_jit_in_the_store_transactions(pg_url: sa.URL) -> None:
    """JIT compiling a short listing on a partitioned store cost 25-30x the query: the store's
    transactions, reads included, run with ``jit = off`` (set locally, pooler-safe)."""
    with ConversationStore(pg_url) as store:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
        raw = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
        try:
            with raw.connect() as conn:
                assert conn.exec_driver_sql("SHOW jit").scalar() == "on"  # the server's default
        finally:
            raw.dispose()


@pytest.mark.postgres
def test_reader_database_gets_audit_reads_history_stays_on_primary(pg_url: sa.URL) -> None:
    """A reader database that lags (here: another schema that never saw the turn): the audit's
    reads go there, history (what goes back to a model) and next_seq read the primary, and a
    conversation missing on the reader says replication lag may be why."""
    replica, drop = pg_schema_url(postgres_server())
    upgrade(replica)
    try:
        with ConversationStore(pg_url, read_url=replica) as store:
            assert store.read_url is not None
            conv = store.create_conversation("c-primary")
            _commit(store, conv, 2)
            assert len(store.history(conv)) == 4  # primary: every acknowledged turn
            assert store.next_seq(conv) == 4
            assert store.list_conversations() == []  # the reader has not seen it yet
            with pytest.raises(ConversationNotFoundError, match="replication lag") as caught:
                store.attempts(conv)
            assert caught.value.replica is not None
        with ConversationStore(pg_url) as store:  # no reader: as before
            assert [c.id for c in store.list_conversations()] == ["c-primary"]
            assert store.attempts("c-primary") == []
            with pytest.raises(ConversationNotFoundError, match="create it first"):
                store.attempts("nope")
        # the CLI: --read-db and $FSM_READ_DB_URL send the audit to the reader
        on_reader = CliRunner().invoke(
            cli, ["conversations", "--db", _text(pg_url), "--read-db", _text(replica), "--json"]
        )
        assert on_reader.exit_code == 0 and "c-primary" not in on_reader.output
        env = CliRunner(env={"FSM_READ_DB_URL": _text(replica)})
        assert "c-primary" not in env.invoke(cli, ["audit", "calls", "--db", _text(pg_url)]).output
        assert (
            "c-primary" in CliRunner().invoke(cli, ["audit", "calls", "--db", _text(pg_url)]).output
        )
    finally:
        drop()


@pytest.mark.postgres
def test_write_on_a_read_only_node_is_typed_and_drops_the_pool(pg_url: sa.URL) -> None:
    """A server that refuses writes (here every session read-only, as a hot standby or a
    demoted primary): ReadOnlyNodeError, retryable, and the pool's connections are dropped so
    that the next call connects again."""
    with ConversationStore(pg_url) as store:
        conv = store.create_conversation()
    url = pg_url.update_query_dict(
        {"options": pg_url.query["options"] + " -cdefault_transaction_read_only=on"}
    )
    with ConversationStore(url) as store:
        store.history(conv)  # reads work there
        with store.engine.connect() as conn:
            before = conn.connection.driver_connection.info.backend_pid
        with pytest.raises(ReadOnlyNodeError, match="accepts no writes") as caught:
            _commit(store, conv)
        assert caught.value.retryable
        with store.engine.connect() as conn:  # the pool was invalidated: a new session
            assert conn.connection.driver_connection.info.backend_pid != before
    with ConversationStore(pg_url) as store:
        assert len(store.history(conv)) == 0  # nothing was written


@pytest.mark.postgres
def test_a_prepared_statement_mixed_up_by_a_pooler_is_typed(pg_url: sa.URL) -> None:
    """What a transaction pooler does to a prepared statement, reproduced on one session: the
    server forgets it (another client's DEALLOCATE ALL, a new server session), psycopg still
    thinks it is there. PoolerError naming the cause and the fix; the connection is dropped and
    the retry works."""
    url = _text(pg_url) + "&prepare_threshold=1&pool_size=1&max_overflow=0"
    with ConversationStore(url) as store:
        conv = store.create_conversation()
        store.history(conv)
        store.history(conv)  # prepared now (the second run)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements").scalar()
            # through libpq itself, as another client of a pooled session would: psycopg does
            # not see it
            conn.connection.driver_connection.pgconn.exec_(b"DEALLOCATE ALL")
            conn.commit()
        with pytest.raises(PoolerError, match="max_prepared_statements") as caught:
            store.history(conv)
        assert caught.value.retryable
        assert store.history(conv) == []


@pytest.mark.postgres
def test_a_read_whose_commit_lost_its_connection_is_typed(pg_url: sa.URL) -> None:
    """The server ends the session while a read's COMMIT is on its way: StoreUnavailableError
    (it was a raw OperationalError)."""
    with ConversationStore(pg_url) as store:
        conv = store.create_conversation()
        _commit(store, conv)
        admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        armed = threading.Event()

        def kill_before_commit(conn: Any) -> None:
            if armed.is_set():
                armed.clear()
                pid = conn.connection.driver_connection.info.backend_pid
                with admin.connect() as other:
                    other.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")

        sa.event.listen(store.engine, "commit", kill_before_commit)
        try:
            armed.set()
            with pytest.raises(StoreUnavailableError, match="was lost") as caught:
                store.history(conv)
            assert type(caught.value) is StoreUnavailableError
            assert len(store.history(conv)) == 2  # the pool connects again
        finally:
            sa.event.remove(store.engine, "commit", kill_before_commit)
            admin.dispose()


def test_read_db_option_is_listed() -> None:
    """Every reading command has --read-db; the writing ones do not."""
    for path in (["conversations"], ["audit", "calls"], ["audit", "check"], ["audit", "serve"]):
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert "--read-db" in result.output and "FSM_READ_DB_URL" in result.output, path
    group = cli.get_command(click.Context(cli), "history")
    assert group is not None and "--read-db" not in CliRunner().invoke(group, ["--help"]).output


@pytest.mark.parametrize(
    "message",
    [
        'connection to server at "db", port 5432 failed: FATAL:  sorry, too many clients already',
        'connection to server at "db", port 5432 failed: FATAL:  remaining connection slots are '
        "reserved for non-replication superuser connections",
        "FATAL:  no more connections allowed (max_client_conn)",
    ],
)
def test_a_connect_refused_for_want_of_slots_is_server_full(message: str) -> None:
    """libpq gives a refused startup no SQLSTATE: the server's (and PgBouncer's) words decide,
    and the error says the server is full, not that it could not be reached. (With a real
    server: tests/store/test_pg_components.py::test_connection_slots_full.)"""
    import psycopg

    from fsm.store import ServerFullError, faults

    error = sa.exc.OperationalError(None, None, psycopg.OperationalError(message))
    typed = faults.translate(error, "postgresql+psycopg://app@db/app", connecting=True)
    assert isinstance(typed, ServerFullError) and typed.retryable
    assert "no connection slot left" in str(typed) and "max_connections" in str(typed)
    refused = psycopg.OperationalError("connection refused")
    other = faults.translate(
        sa.exc.OperationalError(None, None, refused),
        "postgresql+psycopg://app@db/",
        connecting=True,
    )
    assert type(other) is StoreUnavailableError


@pytest.mark.postgres
def test_the_async_store_takes_a_reader_database(pg_url: sa.URL) -> None:
    """AsyncConversationStore(read_url=...): listings and attempts on the reader, history on
    the primary, a conversation missing on the reader names replication lag."""
    import asyncio

    from fsm.store.aio import AsyncConversationStore

    replica, drop = pg_schema_url(postgres_server())
    upgrade(replica)

    async def scenario() -> None:
        async with AsyncConversationStore(pg_url, read_url=replica) as store:
            assert store.read_url is not None
            conv = await store.create_conversation("c-async")
            turn = make_turn(response_id=None)
            await store.commit_turn(conv, turn, ["sunny"], idempotency_key="k")
            assert len(await store.history(conv)) == 2
            assert await store.list_conversations() == []
            with pytest.raises(ConversationNotFoundError, match="replication lag"):
                await store.attempts(conv)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        drop()
