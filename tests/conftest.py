"""Shared fixtures: the recorded corpus, and a fresh database at head on each engine.

The helpers themselves (corpus access, stream builders, store helpers) live in
``tests/helpers/``; tests import them from there, never from a conftest.

Databases: SQLite always runs (a file in the test's tmp_path). PostgreSQL runs when
``FSM_TEST_POSTGRES_URL`` is set (e.g. ``postgresql+psycopg://postgres@127.0.0.1:5432/test``);
tests work in uniquely-named schemas (selected through ``search_path``, dropped afterwards) and
start from empty tables, so they are independent. With ``FSM_REQUIRE_POSTGRES=1`` a missing or
unreachable server is a failure instead of a skip. With ``FSM_TEST_PG_PARTITIONS=N`` the
PostgreSQL database of :func:`db_url` (and so :func:`store`) is created with every table
hash-partitioned into N partitions (``fsm db upgrade --partitions N``); the migration tests'
empty databases stay unpartitioned (they test the revisions one by one).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore
from fsm.store.migrate import upgrade
from tests.helpers import CORPUS, require_corpus
from tests.helpers.store import empty_database, pg_partitions, pg_schema_url, postgres_server


def pytest_configure(config: pytest.Config) -> None:
    # fsm's pytest plugin (fsm/pytest_plugin.py) is loaded by its entry point; an environment
    # whose fsm was installed before the entry point existed gets it here
    if not config.pluginmanager.has_plugin("fsm"):
        config.pluginmanager.import_plugin("fsm.pytest_plugin")


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line fits its tables to ``$COLUMNS``: the runner's own must not decide a
    test's output (a developer's shell may export one; pytest-xdist's workers set 80). A test
    that wants a width sets it."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def corpus_dir() -> Path:
    require_corpus()
    return CORPUS


ENGINES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=ENGINES)
def engine_name(request: pytest.FixtureRequest) -> str:
    """Each test using a database runs once per engine."""
    name: str = request.param
    return name


@pytest.fixture
def empty_url(engine_name: str, tmp_path: Path) -> Iterator[sa.URL]:
    """A URL of an empty database (no tables at all): a new file, or a new schema."""
    yield from empty_database(engine_name, tmp_path / "empty.db")


@pytest.fixture(scope="session")
def _sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "head.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _postgres_at_head() -> Iterator[sa.URL]:
    url, drop = pg_schema_url(postgres_server())
    upgrade(url, partitions=pg_partitions())
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def db_url(engine_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> sa.URL:
    """A URL of a fresh database at head, with no data.

    SQLite: a copy of a database migrated once per session. PostgreSQL: one schema migrated
    once per session, emptied before each test (``DELETE``), which is much faster than
    migrating a new schema for every test; the migration tests use :func:`empty_url`.
    """
    if engine_name == "sqlite":
        path = tmp_path / "store.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_at_head"), path)
        return sa.make_url(f"sqlite:///{path}")
    url: sa.URL = request.getfixturevalue("_postgres_at_head")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            # every table hangs off conversations with ON DELETE CASCADE; much faster than
            # TRUNCATE on tables this small
            conn.execute(sa.text("DELETE FROM fsm_conversations"))
    finally:
        engine.dispose()
    return url


@pytest.fixture
def store(db_url: sa.URL) -> Iterator[ConversationStore]:
    """A store on a fresh database, on each engine."""
    with ConversationStore(db_url) as opened:
        yield opened
