"""Issue 29, item 3 (what this round does of it): a database whose tables already use fsm's names
is refused with a typed error naming them, nothing changed; ``fsm db upgrade --sql`` prints the
statements an upgrade would run, for a DBA to review, and changes nothing. Both engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import ConversationStore, StoreLayoutError
from fsm.store.migrate import current_revision, head_revision, upgrade, upgrade_statements


def _tables(url: sa.URL) -> dict[str, int]:
    """The tables of the database (of the URL's schema) and their row counts."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            names = sa.inspect(conn).get_table_names()
            return {
                name: conn.execute(sa.text(f'SELECT count(*) FROM "{name}"')).scalar_one()
                for name in names
            }
    finally:
        engine.dispose()


def _host_tables(url: sa.URL, *names: str) -> None:
    """A host application's own tables, ``names[0]`` with a row."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {names[0]} (id INTEGER PRIMARY KEY, body TEXT)"))
            for name in names[1:]:
                conn.execute(sa.text(f"CREATE TABLE {name} (id TEXT)"))
            conn.execute(sa.text(f"INSERT INTO {names[0]} (id, body) VALUES (1, 'hello')"))
    finally:
        engine.dispose()


def test_a_host_table_with_fsms_name_is_refused_and_left_alone(empty_url: sa.URL) -> None:
    _host_tables(empty_url, "fsm_messages", "fsm_conversations")
    before = _tables(empty_url)
    url = empty_url.render_as_string(hide_password=False)
    done = CliRunner().invoke(cli, ["db", "upgrade", "--db", url])
    assert done.exit_code == 2, done.output
    assert done.stderr.startswith("error: ")
    assert (
        "already has table(s) named fsm_conversations, fsm_messages, which fsm did not create"
    ) in done.stderr
    assert "nothing was changed" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    with pytest.raises(StoreLayoutError, match="fsm_conversations, fsm_messages"):
        upgrade(empty_url)
    with pytest.raises(StoreLayoutError, match="fsm_conversations, fsm_messages"):
        ConversationStore(empty_url, auto_upgrade=True)
    assert _tables(empty_url) == before  # the host's tables and row, and nothing of fsm's


def test_a_hosts_messages_and_conversations_are_left_alone(empty_url: sa.URL) -> None:
    """Issue 29: fsm's tables carry its prefix, so a host's own ``messages`` and
    ``conversations`` do not clash; they keep their rows, and fsm works beside them."""
    _host_tables(empty_url, "messages", "conversations")
    url = empty_url.render_as_string(hide_password=False)
    done = CliRunner().invoke(cli, ["db", "upgrade", "--db", url])
    assert done.exit_code == 0, done.output
    assert current_revision(empty_url) == head_revision()
    tables = _tables(empty_url)
    assert tables["messages"] == 1 and tables["conversations"] == 0
    assert {"fsm_messages", "fsm_conversations", "fsm_tool_calls"} <= set(tables)
    with ConversationStore(empty_url) as store:
        cid = store.create_conversation()
        store.append(cid, [{"role": "user", "content": "hi"}])
        assert store.history(cid) == [{"role": "user", "content": "hi"}]
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, body FROM messages")).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(1, "hello")]
    assert _tables(empty_url)["fsm_messages"] == 1
    checked = CliRunner().invoke(cli, ["audit", "check", "--db", url])
    assert checked.exit_code == 0, checked.output


def test_running_the_old_revisions_into_a_hosts_messages_is_refused(empty_url: sa.URL) -> None:
    """Up to revision 0008 the revisions create ``messages`` ...: an upgrade of a new database
    to one of them (not to head, which is built with fsm's names) refuses a host's table."""
    _host_tables(empty_url, "messages")
    with pytest.raises(StoreLayoutError, match="named messages, which fsm did not create"):
        upgrade(empty_url, "0008_ledger_leases")
    assert current_revision(empty_url) is None


def test_upgrade_sql_prints_the_statements_and_changes_nothing(empty_url: sa.URL) -> None:
    url = empty_url.render_as_string(hide_password=False)
    before = _tables(empty_url)
    done = CliRunner().invoke(cli, ["db", "upgrade", "--db", url, "--sql"])
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[0].startswith("-- fsm db upgrade --sql: ")
    assert "from an empty database to head; rolled back, nothing changed" in lines[0]
    text = done.stdout
    for table in (
        "fsm_conversations",
        "fsm_messages",
        "fsm_tool_calls",
        "fsm_attempts",
        "fsm_alembic_version",
    ):
        assert f"CREATE TABLE {table} (" in text or f".{table} (" in text, table
    assert f"'{head_revision()}'" in text  # the revision it records
    statements = upgrade_statements(empty_url)
    assert {s.split(None, 1)[0].upper() for s in statements} <= {
        "CREATE", "ALTER", "DROP", "INSERT", "UPDATE", "DELETE", "COMMENT", "PRAGMA"
    }  # fmt: skip
    assert all("=" in s for s in statements if s.startswith("PRAGMA"))  # settings, not reads
    assert _tables(empty_url) == before  # nothing created
    assert current_revision(empty_url) is None


def test_upgrade_sql_of_an_older_database_shows_only_what_is_left(empty_url: sa.URL) -> None:
    upgrade(empty_url, "0005_tool_ledger")
    statements = upgrade_statements(empty_url)
    assert not any(s.startswith("CREATE TABLE conversations") for s in statements)
    assert any(s.startswith("ALTER TABLE") or "fsm_conversations" in s for s in statements)
    assert any("0007" in s for s in statements)  # the version recorded at the end
    assert current_revision(empty_url) == "0005_tool_ledger"


def test_upgrade_sql_does_not_create_a_new_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "new" / "chat.db"
    done = CliRunner().invoke(cli, ["db", "upgrade", "--db", str(path), "--sql"])
    assert done.exit_code == 0, done.output
    assert "CREATE TABLE fsm_messages (" in done.stdout
    assert not path.exists() and not path.parent.exists()
