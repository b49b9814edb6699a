"""PostgreSQL in production with the real components (issue 27): private clusters of the
test's own, Debian's PgBouncer in transaction mode, a streaming standby promoted under a commit
loop, a server whose connection slots are full. fsm's defaults throughout.

Each experiment prints (and asserts) one row: what it injected, the turns acknowledged, the
errors by type (0 untyped: every exception a :class:`~fsm.store.errors.StoreError`), the turns
lost (acknowledged, not stored: 0) and doubled (stored twice: 0), and its throughput against
the same load on a direct connection. Clusters and processes are removed even on failure.

Needs ``initdb``/``pg_ctl``/``pg_basebackup`` (``/usr/lib/postgresql/*/bin``) and ``pgbouncer``
(``apt-get install pgbouncer``); skipped with the reason when absent, unless
``FSM_REQUIRE_POSTGRES=1``. Ports: the first free ones from 55432.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import ConversationStore, StoreError, audit
from fsm.store.errors import ConversationNotFoundError, ReadOnlyNodeError, ServerFullError
from fsm.store.ledger import Outcome
from fsm.store.migrate import upgrade
from tests.helpers.faults import PrivatePostgres, pg_tool, postgres_unavailable
from tests.helpers.store import make_turn

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

#: the rows printed at the end of each experiment (and in the report of issue 27)
RESULTS: list[dict[str, Any]] = []


def _unavailable() -> str | None:
    reason = postgres_unavailable()
    if reason is None and pg_tool("pg_basebackup") is None:
        reason = "pg_basebackup is missing (install the PostgreSQL server binaries)"
    if reason is None and shutil.which("pgbouncer") is None:
        reason = "pgbouncer is not installed (apt-get install -y pgbouncer)"
    return reason


def _ports(count: int, start: int = 55432) -> list[int]:
    """The first ``count`` free TCP ports of 127.0.0.1 from ``start``."""
    found: list[int] = []
    port = start
    while len(found) < count and port < start + 500:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                found.append(port)
            except OSError:
                pass
        port += 1
    return found


def _as_postgres(*command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as the ``postgres`` OS user when root (the server refuses root)."""
    args = list(command)
    if os.geteuid() == 0:
        args = ["runuser", "-u", "postgres", "--", *args]
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=timeout)


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(path, user.pw_uid, user.pw_gid)


def _url(port: int, database: str = "postgres", user: str = "postgres") -> str:
    return f"postgresql+psycopg://{user}@127.0.0.1:{port}/{database}"


def _configure(pg: PrivatePostgres, **settings: Any) -> None:
    with (pg.data / "postgresql.conf").open("a") as conf:
        for name, value in settings.items():
            conf.write(f"{name} = {value!r}\n" if isinstance(value, str) else f"{name} = {value}\n")


@dataclass
class PgBouncer:
    """Debian's PgBouncer in front of ``server_port``, transaction pooling, as ``postgres``."""

    server_port: int
    port: int
    pool_size: int = 4
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fsm-bouncer-")))

    @property
    def url(self) -> str:
        return _url(self.port)

    def start(self) -> None:
        _chown(self.root)
        (self.root / "users.txt").write_text('"postgres" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"postgres = host=127.0.0.1 port={self.server_port} dbname=postgres\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir = {self.root}\n"
            f"auth_type = trust\nauth_file = {self.root / 'users.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\nmax_client_conn = 500\n"
            f"logfile = {self.root / 'pgbouncer.log'}\npidfile = {self.root / 'pgbouncer.pid'}\n"
        )
        for name in ("users.txt", "pgbouncer.ini"):
            _chown(self.root / name)
        _as_postgres("pgbouncer", "-d", str(self.root / "pgbouncer.ini"))
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start: {self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "pgbouncer.log").read_text(errors="replace")[-2000:]
        return ""

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.root / "pgbouncer.pid").read_text().strip())
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.02)
        shutil.rmtree(self.root, ignore_errors=True)


# -- the load: writers committing turns, readers reading ----------------------------------------
@dataclass
class Tally:
    """What a load saw: turns acknowledged per conversation (their contents), errors by type."""

    acked: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    untyped: list[str] = field(default_factory=list)
    reads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, exc: BaseException) -> None:
        with self.lock:
            self.errors[type(exc).__name__] += 1
            if not isinstance(exc, StoreError):
                self.untyped.append(f"{type(exc).__name__}: {exc}"[:300])


def _commit_with_retry(
    store: ConversationStore, conv: str, text: str, tally: Tally, give_up: float
) -> bool:
    """Commit one turn (its content ``text``, idempotency key the same), retrying a retryable
    error with the same key until ``give_up`` (monotonic); whether it was acknowledged."""
    turn = make_turn(((f"call_{text}", "get_weather", '{"city": "Paris"}'),), content=text)
    while True:
        try:
            store.commit_turn(conv, turn, ["sunny"], idempotency_key=text)
        except Exception as exc:
            tally.error(exc)
            if not getattr(exc, "retryable", False) or time.monotonic() > give_up:
                return False
            time.sleep(0.02 + random.random() * 0.05)
            continue
        with tally.lock:
            tally.acked[conv].append(text)
        return True


def _ledger_turn(store: ConversationStore, conv: str, text: str, tally: Tally) -> bool:
    """One turn through the tool ledger, as the agent loop runs it (``begin`` with the call
    started, the outcome recorded with the commit); an error is counted (the load expects
    none: no retry here)."""
    turn = make_turn(((f"call_{text}", "get_weather", '{"city": "Paris"}'),), content=text)
    try:
        pending = store.begin(conv, turn, idempotency_key=text, start=0)
        store.commit(pending, recording=Outcome(0, result="sunny"))
    except Exception as exc:
        tally.error(exc)
        return False
    with tally.lock:
        tally.acked[conv].append(text)
    return True


def run_load(
    store: ConversationStore,
    *,
    writers: int,
    readers: int,
    seconds: float,
    prefix: str,
    reader_store: ConversationStore | None = None,
    during: Callable[[], None] | None = None,
    ledger: bool = False,
) -> tuple[Tally, float]:
    """``writers`` threads each committing turns to a conversation of its own (``ledger``:
    through the tool ledger), ``readers`` threads reading history and listings, for
    ``seconds`` (``during`` runs in the middle); the tally and the wall time."""
    tally = Tally()
    convs = [store.create_conversation(f"{prefix}-w{i}") for i in range(writers)]
    stop = threading.Event()

    def write(conv: str) -> None:
        n = 0
        while not stop.is_set():
            text = f"{conv}-t{n}"
            if ledger:
                if not _ledger_turn(store, conv, text, tally):
                    return  # the conversation may hold the pending turn: counted, stop here
            else:
                _commit_with_retry(store, conv, text, tally, time.monotonic() + 30)
            n += 1

    def read() -> None:
        reads = reader_store or store
        while not stop.is_set():
            try:
                reads.history(random.choice(convs), last=4)
                reads.list_conversations(limit=20)
                with tally.lock:
                    tally.reads += 1
            except ConversationNotFoundError as exc:
                tally.error(exc)
            except Exception as exc:
                tally.error(exc)
                time.sleep(0.05)

    threads = [threading.Thread(target=write, args=(c,)) for c in convs]
    threads += [threading.Thread(target=read) for _ in range(readers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        if during is not None:
            time.sleep(seconds / 3)
            during()
            time.sleep(seconds * 2 / 3)
        else:
            time.sleep(seconds)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return tally, time.monotonic() - started


def lost_and_doubled(url: str, tally: Tally) -> tuple[int, int, int]:
    """Read back (from ``url``, the primary) every conversation the load wrote: acknowledged
    turns missing (lost), turns stored more than once (doubled), turns stored in all."""
    lost = doubled = stored = 0
    with ConversationStore(url) as store:
        for conv, texts in tally.acked.items():
            contents = [m["content"] for m in store.history(conv) if m["role"] == "assistant"]
            stored += len(contents)
            counts = collections.Counter(contents)
            lost += sum(1 for text in texts if counts[text] == 0)
            doubled += sum(n - 1 for n in counts.values() if n > 1)
    return lost, doubled, stored


def report(component: str, experiment: str, injected: str, tally: Tally, **extra: Any) -> None:
    row = {
        "component": component,
        "experiment": experiment,
        "injected": injected,
        "acknowledged": sum(len(v) for v in tally.acked.values()),
        "errors": dict(tally.errors),
        "untyped": len(tally.untyped),
        **extra,
    }
    RESULTS.append(row)
    print("\nRESULT " + " | ".join(f"{k}={v}" for k, v in row.items()))


# -- the clusters ------------------------------------------------------------------------------
@dataclass
class Components:
    primary: PrivatePostgres
    standby: PrivatePostgres
    bouncer: PgBouncer


@pytest.fixture(scope="module")
def components() -> Iterator[Components]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("FSM_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"FSM_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(reason)
    ports = _ports(3)
    with contextlib.ExitStack() as stack:
        primary = PrivatePostgres(port=ports[0])
        stack.callback(primary.close)
        primary.init()
        _configure(primary, wal_level="replica", max_wal_senders=4, max_connections=60)
        primary.start()
        upgrade(_url(primary.port))
        standby = PrivatePostgres(port=ports[1])
        stack.callback(standby.close)
        standby.root.mkdir(parents=True, exist_ok=True)
        _chown(standby.root)
        _as_postgres(
            pg_tool("pg_basebackup") or "pg_basebackup",
            *("-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres"),
            *("-D", str(standby.data), "-R", "-X", "stream", "--no-sync"),
        )
        _configure(
            standby,
            port=standby.port,
            unix_socket_directories=str(standby.root),
            hot_standby="on",
            synchronous_standby_names="",
        )
        standby.start()
        # synchronous replication from now on: an acknowledged commit is on the standby too
        admin = sa.create_engine(_url(primary.port), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.exec_driver_sql("SELECT pg_reload_conf()")
        admin.dispose()
        bouncer = PgBouncer(server_port=primary.port, port=ports[2])
        stack.callback(bouncer.close)
        bouncer.start()
        yield Components(primary, standby, bouncer)
        if RESULTS:
            print("\n" + "\n".join(str(row) for row in RESULTS))


WRITERS, READERS, SECONDS = 8, 4, 5.0


def test_pgbouncer_transaction_pooling_with_fsm_defaults(components: Components) -> None:
    """12 threads (8 writers, 4 readers) of one store, and the audit, through PgBouncer's transaction pooling
    onto 4 server connections, fsm's defaults: 0 errors, 0 lost, 0 doubled; the audit check is
    clean through the pooler; throughput against the same load direct."""
    direct_url = _url(components.primary.port)
    with ConversationStore(direct_url) as store:
        direct, direct_s = run_load(
            store, writers=WRITERS, readers=READERS, seconds=SECONDS, prefix="direct"
        )
    with ConversationStore(components.bouncer.url) as store:
        pooled, pooled_s = run_load(
            store, writers=WRITERS, readers=READERS, seconds=SECONDS, prefix="bouncer"
        )
        engine = audit.open_readonly(components.bouncer.url)
        try:
            violations = list(audit.check(engine))
        finally:
            engine.dispose()
    # the audit's listing streams every call through the pooler (it died part-way before)
    listed = CliRunner().invoke(
        cli, ["audit", "calls", "--db", components.bouncer.url, "--nl", "--limit", "0"]
    )
    engine = sa.create_engine(direct_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            calls = conn.exec_driver_sql("SELECT count(*) FROM fsm_tool_calls").scalar_one()
    finally:
        engine.dispose()
    assert listed.exit_code == 0, listed.stderr
    assert len(listed.output.splitlines()) == calls
    lost, doubled, _ = lost_and_doubled(direct_url, pooled)
    direct_rate = sum(map(len, direct.acked.values())) / direct_s
    pooled_rate = sum(map(len, pooled.acked.values())) / pooled_s
    report(
        "PgBouncer 1.18, pool_mode=transaction, default_pool_size=4",
        f"{WRITERS} writers + {READERS} readers, {SECONDS:g} s",
        f"{WRITERS + READERS} threads on one store (pool 16 + 10) and 4 server sessions",
        pooled,
        reads=pooled.reads,
        lost=lost,
        doubled=doubled,
        turns_per_s=round(pooled_rate, 1),
        direct_turns_per_s=round(direct_rate, 1),
        audit_violations=len(violations),
        audit_calls_listed=f"{len(listed.output.splitlines())}/{calls}",
    )
    assert not pooled.untyped and not direct.untyped, pooled.untyped + direct.untyped
    assert not pooled.errors, pooled.errors
    assert (lost, doubled, violations) == (0, 0, [])

    # the tool ledger through the pooler (before the defaults, 11 of its turns were left
    # pending): every turn committed once, none left pending
    with ConversationStore(direct_url) as store:
        direct, direct_s = run_load(
            store, writers=WRITERS, readers=READERS, seconds=SECONDS, prefix="ldirect", ledger=True
        )
    with ConversationStore(components.bouncer.url) as store:
        pooled, pooled_s = run_load(
            store, writers=WRITERS, readers=READERS, seconds=SECONDS, prefix="lbouncer", ledger=True
        )
    lost, doubled, _ = lost_and_doubled(direct_url, pooled)
    engine = sa.create_engine(direct_url, poolclass=sa.pool.NullPool)
    try:
        left = audit.pending_turns(engine, states=["pending"])
        violations = list(audit.check(engine))
    finally:
        engine.dispose()
    report(
        "PgBouncer 1.18, pool_mode=transaction, default_pool_size=4",
        f"the tool ledger: {WRITERS} writers (begin + commit) + {READERS} readers, {SECONDS:g} s",
        f"{WRITERS + READERS} threads on one store and 4 server sessions",
        pooled,
        reads=pooled.reads,
        lost=lost,
        doubled=doubled,
        left_pending=len(left),
        turns_per_s=round(sum(map(len, pooled.acked.values())) / pooled_s, 1),
        direct_turns_per_s=round(sum(map(len, direct.acked.values())) / direct_s, 1),
        audit_violations=len(violations),
    )
    assert not pooled.untyped and not direct.untyped, pooled.untyped + direct.untyped
    assert not pooled.errors and not direct.errors, (pooled.errors, direct.errors)
    assert (lost, doubled, len(left), violations) == (0, 0, 0, [])
    assert pooled.acked and all(pooled.acked.values())
    assert pooled.reads > 0 and pooled.acked


def test_pgbouncer_transaction_pooling_asyncio_store(components: Components) -> None:
    """The asyncio store through PgBouncer's transaction pooling (4 server sessions): a commit
    is one round trip through the pooler (the settings, the lock and the write as one query),
    and 8 tasks committing at once (``commit_turn`` and the ledger's ``begin``/``commit``
    alternating) store every turn once, with 0 errors and none left pending."""
    import asyncio

    from bench.roundtrips import round_trips
    from fsm.store.aio import AsyncConversationStore

    tasks, turns = 8, 20

    async def scenario() -> None:
        async with AsyncConversationStore(components.bouncer.url) as store:
            convs = [await store.create_conversation() for _ in range(tasks)]
            with round_trips(store.engine) as one:
                await store.commit_turn(convs[0], make_turn(response_id="pooled-trips"), ["ok"])
            assert one.total == 1, one.trace

            async def writer(task: int, conv: str) -> None:
                for n in range(turns):
                    turn = make_turn(response_id=f"pooled-{task}-{n}")
                    if n % 2:
                        pending = await store.begin(conv, turn, start=0)
                        await store.commit(pending, recording=Outcome(0, result=f"{task}-{n}"))
                    else:
                        await store.commit_turn(conv, turn, [f"{task}-{n}"])

            started = time.monotonic()
            await asyncio.gather(*(writer(t, c) for t, c in enumerate(convs)))
            elapsed = time.monotonic() - started
            stored = Tally()
            for task, conv in enumerate(convs):
                results = [m["content"] for m in await store.history(conv) if m["role"] == "tool"]
                expected = [f"{task}-{n}" for n in range(turns)]
                assert results == (["ok", *expected] if task == 0 else expected), results
                stored.acked[conv] = results
            assert await store.pending(convs[0]) is None
            report(
                "PgBouncer 1.18, pool_mode=transaction, default_pool_size=4",
                f"asyncio store: {tasks} tasks x {turns} turns (commit_turn and the ledger)",
                "one store, 4 server sessions",
                stored,
                turns_per_s=round(tasks * turns / elapsed, 1),
                round_trips_per_commit=one.total,
            )

    asyncio.run(scenario())


def test_standby_reads_writes_and_promotion_under_a_commit_loop(
    components: Components,
) -> None:
    """Reads from the hot standby (read_url), a write there (ReadOnlyNodeError), then the
    primary is killed (SIGKILL) and the standby promoted while 8 writers commit through the
    multi-host URL with target_session_attrs=read-write: every error typed and retried with
    the idempotency key, 0 lost, 0 doubled on the new primary, its audit clean."""
    primary, standby = components.primary, components.standby
    with (
        ConversationStore(_url(standby.port)) as on_standby,
        pytest.raises(ReadOnlyNodeError, match="accepts no writes"),
    ):
        on_standby.create_conversation("write-on-standby")
    multi = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
        "?target_session_attrs=read-write"
    )
    promoted_at: list[float] = []

    def failover() -> None:
        primary.crash()
        promoted_at.append(time.monotonic())
        _as_postgres(pg_tool("pg_ctl") or "pg_ctl", "-D", str(standby.data), "-w", "promote")
        promoted_at.append(time.monotonic())

    with (
        ConversationStore(multi, timeout=5) as store,
        ConversationStore(multi, read_url=_url(standby.port), timeout=5) as reads,
    ):
        tally, seconds = run_load(
            store,
            writers=WRITERS,
            readers=2,
            seconds=9,
            prefix="failover",
            reader_store=reads,
            during=failover,
        )
    lost, doubled, _ = lost_and_doubled(_url(standby.port), tally)
    engine = audit.open_readonly(_url(standby.port))
    try:
        violations = list(audit.check(engine))
    finally:
        engine.dispose()
    report(
        "primary + hot standby (synchronous), pg_ctl promote",
        f"{WRITERS} writers through the multi-host URL, 2 readers on the standby",
        f"SIGKILL of the primary, promotion in {promoted_at[1] - promoted_at[0]:.2f} s",
        tally,
        reads=tally.reads,
        lost=lost,
        doubled=doubled,
        turns_per_s=round(sum(map(len, tally.acked.values())) / seconds, 1),
        audit_violations=len(violations),
    )
    assert not tally.untyped, tally.untyped
    assert tally.errors, "the failover was not seen"
    assert (lost, doubled, violations) == (0, 0, [])
    with ConversationStore(multi) as store:  # writes go on, on the new primary
        store.create_conversation("after-failover")


def test_connection_slots_full(components: Components) -> None:
    """A server with max_connections=8 (3 reserved for superusers) and 12 stores of one
    connection each, as a role without superuser: ServerFullError (typed, retryable, saying so)
    until slots free up; every turn committed once."""
    ports = _ports(1, start=components.bouncer.port + 1)
    with PrivatePostgres(port=ports[0]) as small:
        _configure(small, max_connections=8, superuser_reserved_connections=3)
        small.stop()
        small.start()
        upgrade(_url(small.port))
        admin = sa.create_engine(_url(small.port), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql("CREATE ROLE app LOGIN")
            conn.exec_driver_sql("GRANT ALL ON ALL TABLES IN SCHEMA public TO app")
            conn.exec_driver_sql("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO app")
            conn.exec_driver_sql("GRANT USAGE, CREATE ON SCHEMA public TO app")
        admin.dispose()
        url = _url(small.port, user="app") + "?pool_size=1&max_overflow=0"
        tally = Tally()
        stores = [ConversationStore(url) for _ in range(5)]  # 5 of the 5 slots for app
        try:
            # a sixth: "remaining connection slots are reserved"
            with pytest.raises(ServerFullError, match="no connection slot left") as caught:
                ConversationStore(url)
            assert caught.value.retryable
            for store in stores:
                store.close()

            def worker(i: int) -> None:
                for attempt in range(200):
                    try:
                        with ConversationStore(url) as store:
                            conv = store.create_conversation(f"full-{i}", exist_ok=True)
                            for n in range(3):
                                _commit_with_retry(
                                    store, conv, f"{conv}-t{n}", tally, time.monotonic() + 30
                                )
                        return
                    except Exception as exc:
                        tally.error(exc)
                        if not getattr(exc, "retryable", False):
                            return
                        time.sleep(0.02 * (1 + attempt % 5))

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
            started = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=90)
            seconds = time.monotonic() - started
        finally:
            for store in stores:
                store.close()
        lost, doubled, stored = lost_and_doubled(_url(small.port), tally)
        report(
            "PostgreSQL max_connections=8 (3 reserved)",
            "12 stores of 1 connection each, as a non-superuser",
            "5 slots for 12 processes",
            tally,
            lost=lost,
            doubled=doubled,
            turns_per_s=round(stored / seconds, 1),
        )
        assert not tally.untyped, tally.untyped
        assert set(tally.errors) <= {"ServerFullError"}, tally.errors
        assert tally.errors["ServerFullError"] > 0, "the slots never filled"
        assert sum(map(len, tally.acked.values())) == 36
        assert (lost, doubled) == (0, 0)
