"""Attempts keyed by conversation (revision 0004) and databases hash-partitioned by conversation
(``fsm db upgrade --partitions N``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from fsm.store import ConversationStore, current_revision, head_revision
from fsm.store.errors import StoreLayoutError
from fsm.store.migrate import alembic_config, downgrade, upgrade
from fsm.store.partitions import PARTITION_KEYS, partition_count
from tests.helpers.store import make_turn

REPO = Path(__file__).resolve().parents[2]
#: the revision that keys attempts by conversation, and the one before it (one place).
KEYED = "0004_attempts_by_conversation"
BEFORE = "0003"


def _engine(url: sa.URL) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def _fsm(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FSM_SCHEMA", None)
    return subprocess.run(
        [sys.executable, "-m", "fsm", *args], capture_output=True, text=True, env=env, check=False
    )


def _pg_only(url: sa.URL) -> None:
    if url.get_backend_name() != "postgresql":
        pytest.skip("hash partitions are a PostgreSQL feature")


# -- revision 0004: existing data --------------------------------------------------------------
def test_existing_attempts_keep_their_ids_and_get_their_conversation(empty_url: sa.URL) -> None:
    upgrade(empty_url, BEFORE)
    engine = _engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO conversations (id) VALUES ('a'), ('b')"))
            for attempt_id, cid in ((7, "a"), (41, "b")):
                conn.execute(
                    sa.text(
                        "INSERT INTO attempts (id, conversation_id, at_seq, complete, anomalies)"
                        " VALUES (:id, :cid, 0, false, '[]')"
                    ),
                    {"id": attempt_id, "cid": cid},
                )
                conn.execute(
                    sa.text(
                        "INSERT INTO attempt_calls (attempt_id, position, call_id, type, name,"
                        " arguments, repaired, state) VALUES (:id, 0, 'c', 'function', 'f', '{',"
                        " false, 'truncated')"
                    ),
                    {"id": attempt_id},
                )
            if engine.dialect.name == "postgresql":  # the serial as an older fsm left it
                conn.execute(sa.text("SELECT setval('attempts_id_seq', 41)"))
    finally:
        engine.dispose()
    upgrade(empty_url)
    assert current_revision(empty_url) == head_revision()
    command.check(alembic_config(empty_url))
    engine = _engine(empty_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT conversation_id, attempt_id FROM fsm_attempt_calls ORDER BY 2")
            ).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [("a", 7), ("b", 41)]
    with ConversationStore(empty_url) as store:
        assert [a["id"] for a in store.attempts("a")] == [7]
        assert [c["id"] for c in store.attempts("b")[0]["tool_calls"]] == ["c"]
        [new] = store.record_attempt("a", make_turn())
        assert new > 41  # the identity (PostgreSQL) / rowid (SQLite) continues past the old ids
        assert [a["id"] for a in store.attempts("a")] == [7, new]
        assert store.delete_conversation("b")
        assert store.attempts("a")[1]["tool_calls"][0]["name"] == "get_weather"
    # and back: the old keys, the same rows
    downgrade(empty_url, BEFORE)
    engine = _engine(empty_url)
    try:
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("attempt_calls")}
            ids = conn.execute(sa.text("SELECT attempt_id FROM attempt_calls ORDER BY 1")).all()
    finally:
        engine.dispose()
    assert "conversation_id" not in columns
    assert [r[0] for r in ids] == [7, new]
    upgrade(empty_url)
    assert current_revision(empty_url) == head_revision()


def test_a_call_of_no_attempt_stops_the_upgrade(tmp_path: Path) -> None:
    """Only a session with foreign keys off can write one (SQLite's default for other
    programs): the upgrade names the way out and changes nothing."""
    url = sa.make_url(f"sqlite:///{tmp_path / 'orphan.db'}")
    upgrade(url, BEFORE)
    engine = _engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO attempt_calls (attempt_id, position, call_id, type, name,"
                    " arguments, repaired, state) VALUES (99, 0, 'c', 'function', 'f', '{',"
                    " 0, 'truncated')"
                )
            )
    finally:
        engine.dispose()
    with pytest.raises(RuntimeError, match=r"belong to no attempt.*fsm audit check"):
        upgrade(url)
    assert current_revision(url) == BEFORE


def test_keys_lead_with_the_conversation(db_url: sa.URL) -> None:
    engine = _engine(db_url)
    try:
        inspector = sa.inspect(engine)
        pg = engine.dialect.name == "postgresql"
        keys = {t: inspector.get_pk_constraint(t)["constrained_columns"] for t in PARTITION_KEYS}
        [fk] = inspector.get_foreign_keys("fsm_attempt_calls")
        columns = {c["name"]: c for c in inspector.get_columns("fsm_attempts")}
    finally:
        engine.dispose()
    assert keys["fsm_attempt_calls"] == ["conversation_id", "attempt_id", "position"]
    assert keys["fsm_attempts"] == (["conversation_id", "id"] if pg else ["id"])  # SQLite: rowid
    assert fk["constrained_columns"] == ["conversation_id", "attempt_id"]
    assert fk["referred_columns"] == ["conversation_id", "id"]
    if pg:
        assert isinstance(columns["id"]["type"], sa.BigInteger)
        assert columns["id"].get("identity") is not None
    for table, key in keys.items():
        assert key[0] == PARTITION_KEYS[table] or not pg, table


# -- fsm db upgrade --partitions N -------------------------------------------------------------
def test_partitions_are_refused_on_sqlite_and_out_of_range(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'p.db'}"
    done = _fsm("db", "upgrade", "--db", db, "--partitions", "4")
    assert done.returncode != 0
    assert "PostgreSQL feature" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "p.db").exists()
    for bad in ("1", "5000", "x"):
        done = _fsm("db", "upgrade", "--db", db, "--partitions", bad)
        assert done.returncode == 2 and "--partitions" in done.stderr, bad
    with pytest.raises(StoreLayoutError, match="between 2 and 1024"):
        upgrade("postgresql+psycopg://nobody@127.0.0.1:1/none", partitions=0)


@pytest.mark.postgres
def test_a_partitioned_database_holds_the_whole_contract(empty_url: sa.URL) -> None:
    _pg_only(empty_url)
    url = empty_url.render_as_string(hide_password=False)
    done = _fsm("db", "upgrade", "--db", url, "--partitions", "4")
    assert done.returncode == 0, done.stderr
    assert current_revision(empty_url) == head_revision()
    engine = _engine(empty_url)
    try:
        with engine.connect() as conn:
            counts = {t: partition_count(conn, None, t) for t in PARTITION_KEYS}
    finally:
        engine.dispose()
    assert counts == dict.fromkeys(PARTITION_KEYS, 4)
    command.check(alembic_config(empty_url))  # the models, partitions aside: no drift
    with ConversationStore(empty_url) as store:
        cids = [store.create_conversation() for _ in range(12)]
        for cid in cids:
            store.commit_turn(cid, make_turn(), results=["ok"])
            store.record_attempt(cid, make_turn(finish_reason="length"))
        assert store.history(cids[0])[1] == {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "ok",
        }
        assert store.delete_conversation(cids[0])
    engine = _engine(empty_url)
    try:
        with engine.connect() as conn:
            spread = conn.execute(
                sa.text(
                    "SELECT tableoid::regclass::text, count(*) FROM fsm_messages GROUP BY 1 ORDER BY 1"
                )
            ).all()
            total = conn.execute(sa.text("SELECT count(*) FROM fsm_attempt_calls")).scalar_one()
    finally:
        engine.dispose()
    assert len(spread) > 1 and all(name.startswith("fsm_messages_p") for name, _ in spread)
    assert sum(n for _, n in spread) == 2 * 11 and total == 11
    # the same N again: upgraded as usual; another N, or none on SQLite: refused
    assert _fsm("db", "upgrade", "--db", url, "--partitions", "4").returncode == 0
    with pytest.raises(StoreLayoutError, match="into 4 partitions per table, not 8"):
        upgrade(empty_url, partitions=8)
    with pytest.raises(RuntimeError, match="cannot be undone on a partitioned database"):
        downgrade(empty_url, BEFORE)
    assert current_revision(empty_url) == head_revision()


@pytest.mark.postgres
def test_an_unpartitioned_database_is_not_partitioned_in_place(empty_url: sa.URL) -> None:
    _pg_only(empty_url)
    upgrade(empty_url, BEFORE)
    url = empty_url.render_as_string(hide_password=False)
    done = _fsm("db", "upgrade", "--db", url, "--partitions", "4")
    assert done.returncode != 0 and "created unpartitioned" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert current_revision(empty_url) == BEFORE  # nothing changed
    with pytest.raises(StoreLayoutError, match="created at head"):
        upgrade(_fresh_schema_url(empty_url), BEFORE, partitions=4)


def _fresh_schema_url(url: sa.URL) -> sa.URL:
    """The same server with a search path naming a schema that does not exist yet (the
    upgrade refuses before creating anything in it)."""
    return url.update_query_dict({"options": "-csearch_path=fsm_test_never_created"})


def _bench_seed() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_seed_p", REPO / "bench" / "seed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_seed_fills_a_partitioned_store(empty_url: sa.URL) -> None:
    """bench/seed.py on a partitioned store (it failed: it dropped the keys PostgreSQL keeps
    for each partition, and re-added them NOT VALID, which a partitioned table refuses): every
    row loaded, every key back and valid, the audit check clean."""
    _pg_only(empty_url)
    from fsm.store import audit

    upgrade(empty_url, partitions=4)
    seed = _bench_seed()
    engine = _engine(empty_url)
    try:
        with engine.connect() as conn:
            keys_before = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_constraint WHERE contype = 'f' "
                    "AND connamespace = current_schema()::regnamespace"
                )
            ).scalar_one()
        report = seed.seed(empty_url, 3000, attempt_rate=0.3)  # type: ignore[attr-defined]
        with engine.connect() as conn:
            keys_after = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_constraint WHERE contype = 'f' AND convalidated "
                    "AND connamespace = current_schema()::regnamespace"
                )
            ).scalar_one()
            calls = conn.execute(sa.text("SELECT count(*) FROM fsm_tool_calls")).scalar_one()
            spread = conn.execute(
                sa.text("SELECT count(DISTINCT tableoid) FROM fsm_tool_calls")
            ).scalar_one()
    finally:
        engine.dispose()
    assert report.calls == calls == 3000 and spread == 4
    assert keys_after == keys_before
    readonly = audit.open_readonly(empty_url)
    try:
        assert list(audit.check(readonly)) == []
    finally:
        readonly.dispose()
