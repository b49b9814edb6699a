"""The agent loop never loses a turn whose tools ran.

Each test injects one failure *after* the tools of a complete turn ran (the demo stream: ``add``
and ``multiply``, which count their runs), on both engines, with the sync and the async loop:
typed store errors, real conflicts and idempotency mismatches, a write lock held past the busy
timeout, a full disk, a database that refuses the rows, a dropped connection, a deleted
conversation, a cancellation. The loop must record the attempt with the tool results and the
error, raise :class:`TurnFailedError` (reason ``commit_failed: ...``, chained to the store's
error, the results on it), leave history as it was, and not run a tool again. When recording
fails too, :class:`TurnNotRecordedError` says both and still carries the results.

Store failures before any tool runs propagate typed: fsm's store errors as they are, a driver's
error as :class:`AgentStoreError`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import sqlalchemy as sa
from sqlalchemy import event

from fsm import StreamEnded, parse
from fsm.agent import (
    AgentEvent,
    AgentResult,
    AgentStoreError,
    AttemptRecorded,
    ToolExecuted,
    TurnCommitted,
    TurnFailedError,
    TurnNotRecordedError,
    arun_agent_loop,
    run_agent_loop,
)
from fsm.api import parse_file
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.store.errors import (
    ConflictError,
    ConversationNotFoundError,
    CorruptStoreError,
    IdempotencyMismatchError,
    ResultsError,
    StorageFullError,
    StoreBusyError,
    StoreError,
    StoreUnavailableError,
    UnsupportedValueError,
    ValueRejectedError,
)
from fsm.testing import ReplayServer, ReplayTurn, demo_script
from tests.helpers.agent import CLIENTS, DEMO, FINAL, MODEL, USER, bounded, streamed
from tests.helpers.store import make_turn

DEMO_TURN = parse_file(DEMO).turn(0)
RESULTS = ["6912", "408"]
CALL_IDS = ["call_add_7Qz2", "call_mul_9Xk4"]
#: the demo's tools, each run once per turn
RAN_ONCE = ["add", "multiply"]
POSTGRES_ONLY = pytest.mark.parametrize(
    "engine_name", [pytest.param("postgresql", marks=pytest.mark.postgres)]
)
ASYNC_ONLY = "async-openai"


@pytest.fixture
def url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


# -- the harness ---------------------------------------------------------------------------------
@dataclass
class Faults:
    """Hooks around the real store's methods: ``before[name]`` runs before the method (it may
    raise: an injected failure), ``after[name]`` after it, whatever happened. ``calls`` lists
    the methods called, in order."""

    before: dict[str, Callable[[], object]] = field(default_factory=dict)
    after: dict[str, Callable[[], object]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)


class SyncFaulty:
    """A :class:`ConversationStore` with :class:`Faults` around its methods."""

    def __init__(self, store: ConversationStore, faults: Faults) -> None:
        self._store = store
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        faults = self._faults

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            faults.calls.append(name)
            try:
                if name in faults.before:
                    faults.before[name]()
                return method(*args, **kwargs)
            finally:
                if name in faults.after:
                    faults.after[name]()

        return wrapped


class AsyncFaulty:
    """An :class:`AsyncConversationStore` with :class:`Faults` around its methods (a ``before``
    hook may return an awaitable, which is awaited)."""

    def __init__(self, store: AsyncConversationStore, faults: Faults) -> None:
        self._store = store
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        faults = self._faults

        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            faults.calls.append(name)
            try:
                if name in faults.before:
                    outcome = faults.before[name]()
                    if asyncio.iscoroutine(outcome):
                        await outcome
                return await method(*args, **kwargs)
            finally:
                if name in faults.after:
                    faults.after[name]()

        return wrapped


@dataclass
class Run:
    """One run of the loop: its result or error, its events, what the tools did, and the store
    after it (read by a fresh store)."""

    result: AgentResult | None = None
    error: BaseException | None = None
    events: list[AgentEvent] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    gone: bool = False  # the conversation no longer exists


def counting_tools(
    run: Run, pad: str = "", results: Mapping[str, str] | None = None
) -> dict[str, Callable[..., Any]]:
    """The demo's tools, appending their name to ``run.runs`` each time they run; each returns
    its answer followed by ``pad``, or ``results[name]`` when given."""

    def add(a: int, b: int) -> str:
        """Add two integers."""
        run.runs.append("add")
        return results["add"] if results else f"{a + b}{pad}"

    def multiply(a: int, b: int) -> str:
        """Multiply two integers."""
        run.runs.append("multiply")
        return results["multiply"] if results else f"{a * b}{pad}"

    return {"add": add, "multiply": multiply}


def drive(
    kind: str,
    url: str,
    server: ReplayServer,
    *,
    faults: Faults | None = None,
    after_tools: Callable[[], object] | None = None,
    on_store: Callable[[Any], object] | None = None,
    store_options: Mapping[str, Any] | None = None,
    pad: str = "",
    results: Mapping[str, str] | None = None,
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    conversation: str = "conv",
    **kwargs: Any,
) -> Run:
    """Run the loop with the ``kind`` of client and the matching store against ``server``.

    ``after_tools`` runs once the demo turn's two tools have run (on the second
    :class:`ToolExecuted`), before the loop commits: where most failures are injected.
    ``faults`` wraps the store; ``on_store`` is called with the real store once it is open.
    History and attempts are read afterwards by a fresh store on the plain ``url`` without
    ``store_options`` (query options of ``url`` are dropped for PostgreSQL, except the schema).
    """
    run = Run()
    faults = faults or Faults()
    options = dict(store_options or {})
    user_callback = kwargs.pop("on_event", None)

    def on_event(event: AgentEvent) -> None:
        run.events.append(event)
        executed = sum(isinstance(e, ToolExecuted) for e in run.events)
        if isinstance(event, ToolExecuted) and executed == 2 and after_tools is not None:
            after_tools()
        if user_callback is not None:
            user_callback(event)

    tools = counting_tools(run, pad, results)
    if kind == "openai":
        with ConversationStore(url, **options) as real:
            if on_store is not None:
                on_store(real)
            client = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            try:
                run.result = run_agent_loop(
                    client, SyncFaulty(real, faults), conversation, tools,  # type: ignore[arg-type]
                    model=MODEL, on_event=on_event, **kwargs,
                )  # fmt: skip
            except catch as exc:
                run.error = exc
            finally:
                client.close()
    else:

        async def body() -> None:
            async with AsyncConversationStore(url, **options) as real:
                if on_store is not None:
                    on_store(real)
                client = openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
                try:
                    run.result = await arun_agent_loop(
                        client, AsyncFaulty(real, faults), conversation, tools,  # type: ignore[arg-type]
                        model=MODEL, on_event=on_event, **kwargs,
                    )  # fmt: skip
                except catch as exc:
                    run.error = exc
                finally:
                    await client.close()

        asyncio.run(bounded(body()))
    with ConversationStore(plain(url)) as reader:
        try:
            run.history = reader.history(conversation)
            run.attempts = reader.attempts(conversation)
        except ConversationNotFoundError:
            run.gone = True
    return run


def plain(url: str) -> str:
    """``url`` without the session settings tests add (PostgreSQL: only the schema's
    search_path and synchronous_commit are kept)."""
    parsed = sa.make_url(url)
    options = parsed.query.get("options")
    if not isinstance(options, str):
        return url
    kept = " ".join(o for o in options.split() if o.startswith(("-csearch_path", "-csynchronous")))
    query = {k: v for k, v in parsed.query.items() if k not in ("options", "application_name")}
    query["options"] = kept
    return parsed.set(query=query).render_as_string(hide_password=False)


def with_options(url: str, **settings: str) -> str:
    """``url`` with more PostgreSQL session settings (``-c name=value``) and connection
    parameters (``application_name``)."""
    parsed = sa.make_url(url)
    query = dict(parsed.query)
    extra = " ".join(f"-c{k}={v}" for k, v in settings.items() if k != "application_name")
    if extra:
        query["options"] = f"{query.get('options', '')} {extra}".strip()
    if "application_name" in settings:
        query["application_name"] = settings["application_name"]
    return parsed.update_query_dict(query).render_as_string(hide_password=False)


def assert_recorded(
    run: Run,
    *,
    cause: type[BaseException],
    says: str,
    results: list[str] = RESULTS,
    retryable: bool | None = None,
    history: list[dict[str, Any]] | None = None,
) -> TurnFailedError:
    """The turn of request 1 failed to commit after its tools ran once each: TurnFailedError
    chained to ``cause``, the attempt recorded with the results and the error (which says
    ``says``), history unchanged (``[USER]`` unless given)."""
    error = run.error
    assert isinstance(error, TurnFailedError), repr(error)
    assert not isinstance(error, TurnNotRecordedError), error
    assert error.step == 1
    assert error.reason.startswith("commit_failed: ") and "\n" not in error.reason
    assert says in error.reason, error.reason
    assert isinstance(error.__cause__, cause), repr(error.__cause__)
    assert error.results == results
    assert error.turn is not None and error.turn.to_message() == streamed(DEMO)
    assert "committing it failed" in str(error)
    if retryable is not None:
        assert error.retryable is retryable
    assert run.runs == RAN_ONCE  # each tool ran exactly once
    assert run.history == (history or [USER])  # nothing of the turn went to history
    (attempt,) = run.attempts
    assert error.attempt_ids == [attempt["id"]]
    assert says in attempt["error"] and "[SQL:" not in attempt["error"]
    assert attempt["complete"] is True and attempt["content"] == DEMO_TURN.content
    assert [(c["id"], c["state"], c["result"]) for c in attempt["tool_calls"]] == [
        (call_id, "finished", result) for call_id, result in zip(CALL_IDS, results, strict=True)
    ]
    recorded = [e for e in run.events if isinstance(e, AttemptRecorded)]
    assert [(e.step, e.attempt_ids, e.reason) for e in recorded] == [
        (1, error.attempt_ids, error.reason)
    ]
    assert not any(isinstance(e, TurnCommitted) for e in run.events)
    return error


def assert_not_recorded(
    run: Run, *, cause: type[BaseException], record_error: type[BaseException]
) -> TurnNotRecordedError:
    """The commit failed after the tools ran and recording the attempt failed too."""
    error = run.error
    assert isinstance(error, TurnNotRecordedError), repr(error)
    assert isinstance(error.__cause__, cause), repr(error.__cause__)
    assert isinstance(error.record_error, record_error), repr(error.record_error)
    assert error.reason.startswith("commit_failed: ")
    message = str(error)
    assert error.reason in message and "recording it as an attempt failed too" in message
    assert str(error.record_error).splitlines()[0][:100] in message
    assert error.results == RESULTS and error.attempt_ids == []
    assert run.runs == RAN_ONCE
    assert not any(isinstance(e, AttemptRecorded | TurnCommitted) for e in run.events)
    return error


# -- locks, full disks, refusals, dropped connections ---------------------------------------------
class WriteLock:
    """Another connection holding the write lock: SQLite's database lock (``BEGIN
    IMMEDIATE``), PostgreSQL's row lock on the conversation (``FOR UPDATE``)."""

    def __init__(self, url: str, conversation: str = "conv") -> None:
        self.url = sa.make_url(url)
        self.conversation = conversation
        self._sqlite: sqlite3.Connection | None = None
        self._pg: sa.Connection | None = None
        self._engine: sa.Engine | None = None

    def acquire(self) -> None:
        if self.url.get_backend_name() == "sqlite":
            assert self.url.database is not None
            self._sqlite = sqlite3.connect(self.url.database, isolation_level=None)
            self._sqlite.execute("BEGIN IMMEDIATE")
            return
        self._engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        self._pg = self._engine.connect()
        self._pg.begin()
        locked = self._pg.execute(
            sa.text("SELECT id FROM fsm_conversations WHERE id = :id FOR UPDATE"),
            {"id": self.conversation},
        ).all()
        assert locked, "the conversation must exist to be locked"

    def release(self) -> None:
        if self._sqlite is not None:
            self._sqlite.rollback()
            self._sqlite.close()
            self._sqlite = None
        if self._pg is not None:
            self._pg.rollback()
            self._pg.close()
            self._pg = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


#: the store's options so that a held lock fails fast: SQLite's busy timeout; PostgreSQL's
#: lock_timeout goes in the URL (``busy_url``)
BUSY_TIMEOUT = 0.3


def busy_url(url: str) -> str:
    if sa.make_url(url).get_backend_name() == "sqlite":
        return url
    return with_options(url, lock_timeout=f"{int(BUSY_TIMEOUT * 1000)}ms")


@contextmanager
def trigger(url: str, *, sqlite: str | None, pg_errcode: str, message: str) -> Iterator[None]:
    """A trigger that makes the database refuse every tool result row (``messages`` with role
    ``tool``): SQLite ``RAISE(<sqlite>, message)`` (none when ``sqlite`` is ``None``),
    PostgreSQL ``RAISE EXCEPTION message USING ERRCODE = pg_errcode``. Dropped afterwards (the
    PostgreSQL schema is shared by the session's tests)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    on_sqlite = engine.dialect.name == "sqlite"
    if on_sqlite and sqlite is None:
        engine.dispose()
        yield
        return
    try:
        with engine.begin() as conn:
            if on_sqlite:
                conn.exec_driver_sql(
                    "CREATE TRIGGER fsm_test_refuse BEFORE INSERT ON fsm_messages "
                    f"WHEN NEW.role = 'tool' BEGIN SELECT RAISE({sqlite}, '{message}'); END"
                )
            else:
                conn.exec_driver_sql(
                    "CREATE FUNCTION fsm_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    f"BEGIN RAISE EXCEPTION '{message}' USING ERRCODE = '{pg_errcode}'; END $$"
                )
                conn.exec_driver_sql(
                    "CREATE TRIGGER fsm_test_refuse BEFORE INSERT ON fsm_messages FOR EACH ROW "
                    "WHEN (NEW.role = 'tool') EXECUTE FUNCTION fsm_test_refuse()"
                )
        yield
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "DROP TRIGGER IF EXISTS fsm_test_refuse" + ("" if on_sqlite else " ON fsm_messages")
            )
            if not on_sqlite:
                conn.exec_driver_sql("DROP FUNCTION IF EXISTS fsm_test_refuse()")
        engine.dispose()


def terminate_backends(url: str, application_name: str) -> int:
    """``pg_terminate_backend`` every connection named ``application_name``; how many."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
                    "FROM pg_stat_activity WHERE application_name = :name"
                ),
                {"name": application_name},
            ).scalar_one()
    finally:
        engine.dispose()
    return int(killed)


def make_conversation(url: str, conversation: str = "conv") -> None:
    with ConversationStore(url) as store:
        store.create_conversation(conversation)
        store.append(conversation, [USER])


# -- typed errors at the commit ------------------------------------------------------------------
def _driver_error() -> Exception:
    return sa.exc.OperationalError(
        "INSERT INTO fsm_messages (content) VALUES (?)",
        {"content": "6912"},
        Exception("server closed the connection unexpectedly"),
    )


INJECTED: dict[str, tuple[Callable[[], Exception], type[BaseException], str, bool]] = {
    "conflict": (lambda: ConflictError("conv", 1, 2), ConflictError, "moved on", True),
    "busy": (
        lambda: StoreBusyError("the database stayed locked (injected)"),
        StoreBusyError,
        "stayed locked",
        True,
    ),
    "unsupported-value": (
        lambda: UnsupportedValueError("a tool result this engine cannot store (injected)"),
        UnsupportedValueError,
        "cannot store",
        False,
    ),
    "idempotency-mismatch": (
        lambda: IdempotencyMismatchError("a different turn under this key (injected)"),
        IdempotencyMismatchError,
        "different turn",
        False,
    ),
    "results": (
        lambda: ResultsError("results do not match (injected)"),
        ResultsError,
        "match",
        False,
    ),
    "value-rejected": (
        lambda: ValueRejectedError("the database refused the write (injected)"),
        ValueRejectedError,
        "refused the write",
        False,
    ),
    "driver-error": (_driver_error, sa.exc.OperationalError, "server closed the connection", False),
    "bug": (lambda: RuntimeError("something unexpected"), RuntimeError, "RuntimeError", False),
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("failure", sorted(INJECTED))
def test_an_error_at_the_commit_records_the_turn_with_its_results(
    kind: str, failure: str, url: str
) -> None:
    make_error, cause, says, retryable = INJECTED[failure]

    def fail() -> None:
        raise make_error()

    faults = Faults(before={"commit_turn": fail})
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER])
    assert_recorded(run, cause=cause, says=says, retryable=retryable)
    assert server.served == 1 and server.failures == []
    assert faults.calls[-2:] == ["commit_turn", "record_attempt"]


# -- real failures at the commit -----------------------------------------------------------------
ME_TOO = {"role": "user", "content": "me too"}


@pytest.mark.parametrize("kind", CLIENTS)
def test_another_writer_while_the_tools_run_is_a_recorded_conflict(kind: str, url: str) -> None:
    def meddle() -> None:
        with ConversationStore(url) as other:
            other.append("conv", [ME_TOO])

    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, messages=[USER], after_tools=meddle)
    error = assert_recorded(
        run, cause=ConflictError, says="moved on", retryable=True, history=[USER, ME_TOO]
    )
    assert isinstance(error.__cause__, ConflictError)
    assert (error.__cause__.expected_seq, error.__cause__.actual_seq) == (1, 2)


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_reused_response_id_is_a_recorded_idempotency_mismatch(kind: str, url: str) -> None:
    """The conversation already holds another turn under the demo's response id (a server that
    reuses ids): the store refuses the demo turn, after its tools ran."""
    earlier = make_turn(
        [("call_other", "add", '{"a": 1, "b": 2}')], response_id=DEMO_TURN.response_id
    )
    with ConversationStore(url) as store:
        store.create_conversation("conv")
        store.append("conv", [USER])
        store.commit_turn("conv", earlier, ["3"])
        before = store.history("conv")
    with ReplayServer(demo_script(), response_ids="recorded") as server:  # it reuses ids
        run = drive(kind, url, server)
    assert_recorded(
        run, cause=IdempotencyMismatchError, says="different turn", retryable=False,
        history=before,
    )  # fmt: skip


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_write_lock_held_past_the_busy_timeout_is_recorded_and_the_results_commit_later(
    kind: str, url: str
) -> None:
    """Another connection takes the write lock once the tools ran and keeps it until the
    commit failed (SQLite: the busy timeout; PostgreSQL: lock_timeout). The turn and results on
    the error commit later as they are, and the conversation goes on from there."""
    lock = WriteLock(url)
    faults = Faults(after={"commit_turn": lock.release})
    with ReplayServer(demo_script(RESULTS)) as server:
        try:
            run = drive(
                kind, busy_url(url), server, faults=faults, messages=[USER],
                after_tools=lock.acquire, store_options={"busy_timeout": BUSY_TIMEOUT},
            )  # fmt: skip
        finally:
            lock.release()
        error = assert_recorded(run, cause=StoreBusyError, says="locked", retryable=True)
        assert error.turn is not None and error.results is not None and error.expected_seq == 1
        with ConversationStore(url) as store:
            store.commit_turn("conv", error.turn, error.results, expected_seq=error.expected_seq)
        again = drive(kind, url, server)
    assert again.error is None, again.error
    assert again.runs == [] and server.failures == []
    assert again.history == [
        USER,
        streamed(DEMO),
        *(
            {"role": "tool", "tool_call_id": i, "content": r}
            for i, r in zip(CALL_IDS, RESULTS, strict=True)
        ),
        streamed(FINAL),
    ]


def _fill_the_disk(full: dict[str, bool]) -> Callable[[Any], None]:
    """SQLite: while ``full["on"]``, every connection the store checks out may not grow the
    database file (``PRAGMA max_page_count`` at its current size): writes that need a new page
    fail with SQLITE_FULL."""

    def on_store(store: Any) -> None:
        engine = store.engine
        engine = getattr(engine, "sync_engine", engine)
        if engine.dialect.name != "sqlite":
            return  # PostgreSQL: the trigger of the test

        @event.listens_for(engine, "checkout")
        def limit(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA max_page_count = {1 if full['on'] else 4294967294}")
            finally:
                cursor.close()

    return on_store


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_full_disk_at_the_commit_is_a_recorded_storage_full_error(kind: str, url: str) -> None:
    """SQLite: the store's connection may not grow the file: SQLITE_FULL. PostgreSQL: a
    trigger fails the results' insert with SQLSTATE 53100 (disk_full). Both are typed as
    StorageFullError (by code, issue 12). The disk has room again for the attempt."""
    pad = "." * 200_000  # results that need new pages
    full = {"on": False}
    faults = Faults(after={"commit_turn": lambda: full.update(on=False)})
    with (
        ReplayServer(demo_script()) as server,
        trigger(url, sqlite=None, pg_errcode="53100", message="disk full: could not extend"),
    ):  # fmt: skip
        run = drive(
            kind, url, server, faults=faults, messages=[USER], pad=pad,
            after_tools=lambda: full.update(on=True), on_store=_fill_the_disk(full),
        )  # fmt: skip
    assert_recorded(run, cause=StorageFullError, says="full", results=[r + pad for r in RESULTS])


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_database_that_refuses_the_results_is_a_recorded_rejection(kind: str, url: str) -> None:
    """A trigger refuses every tool result row (SQLite ``RAISE(ABORT)``, PostgreSQL
    check_violation): the store types the driver's ``IntegrityError`` as ValueRejectedError."""
    with (
        ReplayServer(demo_script()) as server,
        trigger(url, sqlite="ABORT", pg_errcode="23514", message="refused by policy"),
    ):
        run = drive(kind, url, server, messages=[USER])
    error = assert_recorded(run, cause=ValueRejectedError, says="refused by policy")
    assert isinstance(error.__cause__.__cause__, sa.exc.IntegrityError)


@POSTGRES_ONLY
@pytest.mark.parametrize("kind", CLIENTS)
def test_a_dropped_connection_at_the_commit_is_a_recorded_unavailable_error(
    kind: str, url: str
) -> None:
    """``pg_terminate_backend`` on the store's connections once the tools ran: the commit gets
    a dead connection before COMMIT (StoreUnavailableError: nothing written, retryable; issue
    12); the attempt goes in on a new one."""
    name = f"fsm-agent-{uuid.uuid4().hex[:8]}"
    killed: list[int] = []
    with ReplayServer(demo_script()) as server:
        run = drive(
            kind, with_options(url, application_name=name), server, messages=[USER],
            after_tools=lambda: killed.append(terminate_backends(url, name)),
        )  # fmt: skip
    assert killed and killed[0] >= 1
    assert_recorded(run, cause=StoreUnavailableError, says="stopped answering", retryable=True)


# -- when recording fails too --------------------------------------------------------------------
@pytest.mark.parametrize("kind", CLIENTS)
def test_a_lock_held_through_the_commit_and_the_recording_says_both(kind: str, url: str) -> None:
    lock = WriteLock(url)
    with ReplayServer(demo_script()) as server:
        try:
            run = drive(
                kind, busy_url(url), server, messages=[USER], after_tools=lock.acquire,
                store_options={"busy_timeout": BUSY_TIMEOUT},
            )  # fmt: skip
        finally:
            lock.release()
    assert_not_recorded(run, cause=StoreBusyError, record_error=StoreBusyError)
    assert run.history == [USER] and run.attempts == []


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_conversation_deleted_while_the_tools_run_says_both(kind: str, url: str) -> None:
    def delete() -> None:
        with ConversationStore(url) as other:
            assert other.delete_conversation("conv")

    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, messages=[USER], after_tools=delete)
    error = assert_not_recorded(
        run, cause=ConversationNotFoundError, record_error=ConversationNotFoundError
    )
    assert run.gone
    assert "exist only on this error" in str(error)


@pytest.mark.parametrize("kind", CLIENTS)
def test_injected_commit_and_record_failures_are_both_named(kind: str, url: str) -> None:
    def conflict() -> None:
        raise ConflictError("conv", 1, 2)

    def driver() -> None:
        raise _driver_error()

    faults = Faults(before={"commit_turn": conflict, "record_attempt": driver})
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER])
    error = assert_not_recorded(run, cause=ConflictError, record_error=sa.exc.OperationalError)
    assert "moved on" in str(error) and "server closed the connection" in str(error)
    assert "[SQL:" not in str(error)
    assert error.retryable  # the commit's error decides
    assert run.history == [USER] and run.attempts == []


# -- other turns, other ends ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", CLIENTS)
def test_a_final_answer_whose_commit_fails_is_recorded(kind: str, url: str) -> None:
    commits: list[int] = []

    def second_fails() -> None:
        commits.append(1)
        if len(commits) == 2:
            raise StoreBusyError("the database stayed locked (injected)")

    faults = Faults(before={"commit_turn": second_fails})
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER])
    error = run.error
    assert isinstance(error, TurnFailedError) and error.step == 2, repr(error)
    assert error.reason.startswith("commit_failed: ") and error.results == []
    assert "without tool calls" in str(error) and error.expected_seq == 4
    assert error.turn is not None and error.turn.to_message() == streamed(FINAL)
    assert isinstance(error.__cause__, StoreBusyError)
    assert run.runs == RAN_ONCE
    assert len(run.history) == 4  # the first turn and its results; not the answer
    (attempt,) = run.attempts
    assert attempt["content"] == streamed(FINAL)["content"] and attempt["tool_calls"] == []
    assert "stayed locked" in attempt["error"] and attempt["at_seq"] == 4


@pytest.mark.parametrize("kind", CLIENTS)
def test_without_recording_the_results_are_still_on_the_error(kind: str, url: str) -> None:
    def busy() -> None:
        raise StoreBusyError("the database stayed locked (injected)")

    faults = Faults(before={"commit_turn": busy})
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER], record_attempts=False)
    error = run.error
    assert isinstance(error, TurnFailedError) and not isinstance(error, TurnNotRecordedError)
    assert error.results == RESULTS and error.attempt_ids == [] and "not recorded" in str(error)
    assert run.attempts == [] and run.history == [USER] and "record_attempt" not in faults.calls
    assert run.runs == RAN_ONCE


def test_keyboard_interrupt_during_the_commit_records_the_results(url: str) -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    faults = Faults(before={"commit_turn": interrupt})
    with ReplayServer(demo_script()) as server:
        run = drive("openai", url, server, faults=faults, messages=[USER], catch=KeyboardInterrupt)
    assert isinstance(run.error, KeyboardInterrupt)
    assert run.runs == RAN_ONCE and run.history == [USER]
    (attempt,) = run.attempts
    assert attempt["error"] == "KeyboardInterrupt"
    assert [c["result"] for c in attempt["tool_calls"]] == RESULTS
    (recorded,) = [e for e in run.events if isinstance(e, AttemptRecorded)]
    assert recorded.reason == "commit_failed: KeyboardInterrupt"


def test_cancelled_during_the_commit_records_the_results_and_re_raises(url: str) -> None:
    """The task is cancelled while its commit waits (a hook that never returns): the attempt
    is recorded with the results, error ``cancelled``, and the cancellation goes on."""
    run = Run()

    async def scenario(server: ReplayServer) -> None:
        committing = asyncio.Event()

        async def hang() -> None:
            committing.set()
            await asyncio.Event().wait()

        faults = Faults(before={"commit_turn": hang})
        async with AsyncConversationStore(url) as real:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            task = asyncio.create_task(
                arun_agent_loop(
                    client, AsyncFaulty(real, faults), "conv", counting_tools(run),  # type: ignore[arg-type]
                    model=MODEL, messages=[USER], on_event=run.events.append,
                )
            )  # fmt: skip
            await committing.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.close()
            run.history = await real.history("conv")
            run.attempts = await real.attempts("conv")

    with ReplayServer(demo_script()) as server:
        asyncio.run(bounded(scenario(server)))
    assert run.runs == RAN_ONCE and run.history == [USER]
    (attempt,) = run.attempts
    assert attempt["error"] == "cancelled"
    assert [c["result"] for c in attempt["tool_calls"]] == RESULTS
    (recorded,) = [e for e in run.events if isinstance(e, AttemptRecorded)]
    assert recorded.reason == "commit_failed: cancelled" and recorded.attempt_ids == [attempt["id"]]


HOSTILE_RESULTS = {
    "nul": "before\x00after",
    "lone-surrogate": "half \ud83d of a pair",
    "split-pair": "\ud83d" + "\ude00",
    "mark": "\ufdd0starts with the codec's mark \\0 \\u0000",
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("value", sorted(HOSTILE_RESULTS))
def test_hostile_tool_results_commit_byte_exact_or_fail_typed(
    kind: str, value: str, url: str
) -> None:
    """A tool may return any str: it commits and reads back byte-exact, or the commit fails
    typed and the attempt holds it byte-exact; never an untyped crash, never lost."""
    text = HOSTILE_RESULTS[value]
    results = {"add": text, "multiply": "408"}
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, messages=[USER], results=results, max_turns=1)
    if run.error is None:
        assert [m["content"] for m in run.history[2:4]] == [text, "408"]
        return
    assert_recorded(run, cause=StoreError, says="", results=[text, "408"])


# -- store failures before the tools run ---------------------------------------------------------
def _raise(make: Callable[[], BaseException]) -> Callable[[], None]:
    def hook() -> None:
        raise make()

    return hook


BEFORE_TOOLS: dict[str, tuple[str, Callable[[], BaseException]]] = {
    "history-typed": ("history", lambda: StoreBusyError("stayed locked (injected)")),
    "history-driver-error": ("history", _driver_error),
    "next_seq-driver-error": ("next_seq", _driver_error),
    "append-typed": ("append", lambda: ConversationNotFoundError("conv")),
    "history-corrupt": (
        "history",
        lambda: CorruptStoreError("conv", "sqlite:///x.db", "a result without its call"),
    ),
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", sorted(BEFORE_TOOLS))
def test_store_errors_before_the_tools_propagate_typed(kind: str, case: str, url: str) -> None:
    method, make = BEFORE_TOOLS[case]
    faults = Faults(before={method: _raise(make)})
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER])
    assert server.served == 0 and run.runs == []
    expected = make()
    if isinstance(expected, StoreError):
        assert type(run.error) is type(expected) and str(run.error) == str(expected)
        return
    error = run.error
    assert isinstance(error, AgentStoreError), repr(error)
    assert error.operation == method and error.step == (1 if method == "history" else 0)
    assert isinstance(error.__cause__, sa.exc.OperationalError)
    assert "server closed the connection" in str(error) and "[SQL:" not in str(error)


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_write_lock_held_before_the_first_request_is_a_busy_error(kind: str, url: str) -> None:
    with ConversationStore(url) as store:
        store.create_conversation("conv")
    lock = WriteLock(url)
    lock.acquire()
    with ReplayServer(demo_script()) as server:
        try:
            run = drive(
                kind, busy_url(url), server, messages=[USER],
                store_options={"busy_timeout": BUSY_TIMEOUT},
            )  # fmt: skip
        finally:
            lock.release()
    assert isinstance(run.error, StoreBusyError), repr(run.error)
    assert server.served == 0 and run.runs == [] and run.history == []


@POSTGRES_ONLY
@pytest.mark.parametrize("kind", CLIENTS)
def test_a_dropped_connection_before_a_request_is_a_store_unavailable_error(
    kind: str, url: str
) -> None:
    """The store's connections are terminated once the first turn committed: reading the
    history for request 2 fails with StoreUnavailableError (the driver's error typed by code,
    issue 12), which the loop passes on as it is."""
    name = f"fsm-agent-{uuid.uuid4().hex[:8]}"

    def on_event(event: AgentEvent) -> None:
        if isinstance(event, TurnCommitted):
            assert terminate_backends(url, name) >= 1

    with ReplayServer(demo_script()) as server:
        run = drive(
            kind, with_options(url, application_name=name), server, messages=[USER],
            on_event=on_event,
        )  # fmt: skip
    error = run.error
    assert isinstance(error, StoreUnavailableError), repr(error)
    assert error.retryable and "nothing was written" in str(error)
    assert len(run.history) == 4 and server.served == 1  # the first turn is safe


@pytest.mark.parametrize("kind", CLIENTS)
def test_an_incomplete_turn_whose_recording_fails_says_both(kind: str, url: str) -> None:
    faults = Faults(before={"record_attempt": _raise(_driver_error)})
    demo = DEMO.read_bytes()
    with ReplayServer([ReplayTurn(demo, cut_at=len(demo) // 2)]) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER])
    error = run.error
    assert isinstance(error, TurnNotRecordedError), repr(error)
    assert "incomplete chunked read" in error.reason and error.results is None  # raw bytes
    assert isinstance(error.record_error, sa.exc.OperationalError)
    assert "did not give a complete turn" in str(error)
    assert "server closed the connection" in str(error)
    assert run.runs == [] and run.history == [USER] and run.attempts == []


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_failing_callback_whose_recording_fails_keeps_its_error(kind: str, url: str) -> None:
    def on_event(event: AgentEvent) -> None:
        if isinstance(event, StreamEnded):
            raise RuntimeError("display crashed")

    faults = Faults(before={"record_attempt": _raise(_driver_error)})
    with ReplayServer(demo_script()) as server:
        run = drive(kind, url, server, faults=faults, messages=[USER], on_event=on_event)
    assert isinstance(run.error, RuntimeError) and str(run.error) == "display crashed"
    assert any("recording the turn as an attempt failed too" in n for n in run.error.__notes__)
    assert run.runs == [] and run.attempts == []


@pytest.mark.parametrize("kind", CLIENTS)
def test_the_split_emoji_of_the_issue_commits_or_is_recorded(kind: str, url: str) -> None:
    """Issue 10's finding: an emoji sent as ``"\\ud83d"`` + ``"\\ude00"`` (valid input) in a
    complete tool-call turn made the commit fail with UnicodeEncodeError after the tools ran,
    and the loop crashed with no attempt. Now the turn commits byte-exact, or the failure is a
    TurnFailedError with the attempt holding the turn and its results."""
    data = (
        DEMO.read_bytes()
        .replace(b'"content":"I\'ll "', b'"content":"I\'ll \\ud83d"')
        .replace(b'"content":"work out "', b'"content":"\\ude00 work out "')
    )
    streamed_turn = parse(data).turn(0)
    assert streamed_turn.complete and len(streamed_turn.tool_calls) == 2
    with ReplayServer([ReplayTurn(data)]) as server:
        run = drive(kind, url, server, messages=[USER], max_turns=1)
    assert run.runs == RAN_ONCE
    if run.error is None:
        assert run.history[1] == streamed_turn.to_message()
        assert [m["content"] for m in run.history[2:4]] == RESULTS
        return
    error = run.error
    assert isinstance(error, TurnFailedError), repr(error)
    assert not isinstance(error, TurnNotRecordedError), error
    assert error.reason.startswith("commit_failed: ") and error.results == RESULTS
    assert run.history == [USER]
    (attempt,) = run.attempts
    assert attempt["content"] == streamed_turn.content
    assert [c["result"] for c in attempt["tool_calls"]] == RESULTS
