"""The store's bounded waits (issue 20): ``timeout=``, the libpq connection bounds, and the
server-side deadline set per transaction with ``SET LOCAL``.

The faults themselves (black holes, resets, crashes) are in ``test_real_faults.py``; here the
settings are checked on a real server: what each session and each transaction gets, that they
do not outlive the transaction (pooler safe), that a lock held by another session ends in a
typed, retryable error within the deadline, and that bad values are refused before any I/O.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.store.deadline import DEFAULT_TIMEOUT, InvalidTimeoutError, check_timeout
from fsm.store.engine import (
    CONNECT_TIMEOUT_SECONDS,
    create_engine,
    postgres_connect_args,
    server_deadline_ms,
)
from fsm.store.errors import StoreBusyError, StoreError
from tests.helpers.store import make_turn

POSTGRES = [pytest.param("postgresql", marks=pytest.mark.postgres)]
LOCAL_SETTINGS = ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", True, [1]])
def test_a_bad_timeout_is_refused_before_any_io(bad: Any, tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'never.db'}"
    with pytest.raises(InvalidTimeoutError, match="timeout must be"):
        ConversationStore(url, timeout=bad)
    with pytest.raises(InvalidTimeoutError):
        AsyncConversationStore(url, timeout=bad)
    assert not (tmp_path / "never.db").exists()
    assert issubclass(InvalidTimeoutError, StoreError) and issubclass(
        InvalidTimeoutError, ValueError
    )


def test_timeout_values() -> None:
    assert check_timeout(None) is None and check_timeout(2) == 2.0
    assert server_deadline_ms(30) == 29_000 and server_deadline_ms(2) == 1600
    assert DEFAULT_TIMEOUT == 30.0
    default = postgres_connect_args(None)
    assert default == {
        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,
    }
    short = postgres_connect_args(0.5)
    assert short["connect_timeout"] == 2  # libpq's minimum
    assert short["tcp_user_timeout"] == 500
    assert short["keepalives_idle"] == short["keepalives_interval"] == 1


def session_parameters(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        params: dict[str, str] = conn.connection.driver_connection.info.get_parameters()
        return params


@pytest.mark.parametrize("engine_name", POSTGRES, indirect=True)
def test_every_postgres_connection_has_bounded_waits(db_url: sa.URL) -> None:
    with ConversationStore(db_url, timeout=4) as store:
        params = session_parameters(store.engine)
    assert params["connect_timeout"] == "4"
    assert params["tcp_user_timeout"] == "4000"
    assert params["keepalives"] == "1" and params["keepalives_count"] == "3"
    # the URL's own query parameters win
    query = db_url.update_query_dict({"connect_timeout": "7"})
    engine = create_engine(query, timeout=4)
    try:
        assert session_parameters(engine)["connect_timeout"] == "7"
    finally:
        engine.dispose()


@pytest.mark.parametrize("engine_name", POSTGRES, indirect=True)
def test_the_server_side_deadline_is_set_per_transaction(db_url: sa.URL) -> None:
    with ConversationStore(db_url, timeout=3.5) as store:
        conv = store.create_conversation()
        seen: list[str] = []

        def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            seen.append(statement)

        event.listen(store.engine, "before_cursor_execute", before)
        try:
            store.commit_turn(conv, make_turn(response_id="r1"), ["ok"])
            store.history(conv)
        finally:
            event.remove(store.engine, "before_cursor_execute", before)
        # fsm begins each transaction itself, with its settings in the same round trip; the
        # commit is one query, whose settings are local to it (its implicit transaction)
        # 3.5 s less a fifth; the lock wait a tenth shorter still
        deadline = (
            "SET LOCAL statement_timeout = 2800; SET LOCAL lock_timeout = 2520; "
            "SET LOCAL idle_in_transaction_session_timeout = 2800"
        )
        # (the write also turns sequential scans off, and every transaction JIT: issue 27)
        assert seen[0].startswith(
            f"SET LOCAL enable_seqscan = off; SET LOCAL jit = off; {deadline}; SELECT 1 FROM "
        ), seen[0][:300]
        local = [s for s in seen if "SET LOCAL" in s]
        assert len(local) == 2, seen  # the write's query and the read
        # a read: one snapshot for its statements
        assert local[1] == f"BEGIN ISOLATION LEVEL REPEATABLE READ; SET LOCAL jit = off; {deadline}"
        with store.engine.connect() as conn:
            # inside a transaction of the store's engine: the deadline
            shown = {n: conn.exec_driver_sql(f"SHOW {n}").scalar() for n in LOCAL_SETTINGS}
            assert list(shown.values()) == ["2800ms", "2520ms", "2800ms"], shown
            conn.rollback()
            # the session itself keeps the server's defaults (SET LOCAL): safe behind a
            # transaction pooler, where the next transaction may be another client's
            raw = conn.connection.driver_connection
            raw.rollback()
            values = {n: raw.execute(f"SHOW {n}").fetchone()[0] for n in LOCAL_SETTINGS}
            raw.rollback()
            assert set(values.values()) == {"0"}, values
    with ConversationStore(db_url, timeout=None) as untimed:
        seen.clear()
        event.listen(untimed.engine, "before_cursor_execute", before)
        try:
            untimed.history(conv)
        finally:
            event.remove(untimed.engine, "before_cursor_execute", before)
        # no deadline: only JIT is turned off
        assert [s for s in seen if "SET LOCAL" in s] == [
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SET LOCAL jit = off"
        ], seen


@pytest.mark.parametrize("engine_name", POSTGRES, indirect=True)
def test_a_lock_held_elsewhere_ends_in_a_retryable_error_within_the_deadline(
    db_url: sa.URL,
) -> None:
    """Another session holds the conversation's row lock and does not let go: the writer
    waits at most its deadline, then gets the typed, retryable busy error (``lock_timeout``),
    sync and async; once the lock is released the retry goes through."""
    with ConversationStore(db_url, timeout=1.5) as store:
        conv = store.create_conversation()
        holder = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        try:
            with holder.connect() as conn:
                conn.execute(
                    sa.text("SELECT id FROM fsm_conversations WHERE id = :c FOR UPDATE"),
                    {"c": conv},
                )
                started = time.monotonic()
                with pytest.raises(StoreBusyError) as busy:
                    store.commit_turn(conv, make_turn(response_id="r1"), ["ok"])
                waited = time.monotonic() - started
                # the server's lock_timeout (1.08 s) comes before the client's deadline (1.5 s)
                assert busy.value.retryable and 1.0 < waited < 3, waited

                async def async_writer() -> float:
                    async with AsyncConversationStore(db_url, timeout=1.5) as astore:
                        began = time.monotonic()
                        with pytest.raises(StoreBusyError):
                            await astore.commit_turn(conv, make_turn(response_id="r1"), ["ok"])
                        return time.monotonic() - began

                assert 1.0 < asyncio.run(async_writer()) < 3
                conn.rollback()
        finally:
            holder.dispose()
        assert store.commit_turn(conv, make_turn(response_id="r1"), ["ok"]).created


@pytest.mark.parametrize("engine_name", POSTGRES, indirect=True)
def test_a_shorter_wait_of_the_session_is_kept(db_url: sa.URL) -> None:
    """A ``lock_timeout`` the URL gives the session (``options=-c lock_timeout=...``) that is
    shorter than the store's deadline stays in force; the other two still get the deadline."""
    options = db_url.query.get("options", "")
    options = options if isinstance(options, str) else " ".join(options)
    url = db_url.update_query_dict({"options": f"{options} -c lock_timeout=200ms".strip()})
    with ConversationStore(url, timeout=10) as store, store.engine.connect() as conn:
        shown = {n: conn.exec_driver_sql(f"SHOW {n}").scalar() for n in LOCAL_SETTINGS}
    assert shown == {
        "statement_timeout": "9s",
        "lock_timeout": "200ms",
        "idle_in_transaction_session_timeout": "9s",
    }, shown
