"""fsm's pytest plugin: a replay server and a fresh conversation store for the tests of code
built on fsm.

Installed with fsm (entry point ``pytest11``, name ``fsm``), it is active in every pytest run of
an environment where fsm is installed, and costs nothing there until a test asks for one of its
fixtures: this module imports only pytest and the standard library, and loads
:mod:`fsm.replay`, SQLAlchemy and :mod:`fsm.store` when a fixture first needs them. Disable it
with ``-p no:fsm``.

Fixtures:

``fsm_replay``
    A factory: ``fsm_replay(script=None, **options)`` starts a
    :class:`~fsm.replay.ReplayServer` on ``127.0.0.1`` and stops it after the test. ``script``
    is a list of :class:`~fsm.replay.ReplayTurn`, paths of recorded ``.sse`` files, or their
    bytes (one per request); ``None`` is fsm's demo conversation
    (:func:`~fsm.replay.demo_script`). ``options`` go to ``ReplayServer``.
``fsm_replay_server``
    A server already started with the streams of the test's ``@pytest.mark.fsm_replay(...)``
    marker (paths, bytes or ``ReplayTurn``; relative paths are relative to the test's file),
    else with the demo conversation.
``fsm_examples``
    The directory of fsm's example streams (``parallel_add_multiply.sse``,
    ``final_answer.sse``).
``fsm_engine``
    ``"sqlite"`` or ``"postgresql"``: every test using a store fixture runs once per engine.
    PostgreSQL runs when a URL is given (``--fsm-postgres-url URL`` or the environment variable
    ``FSM_TEST_POSTGRES_URL``) and is skipped with a reason otherwise (``--fsm-require-postgres``
    or ``FSM_REQUIRE_POSTGRES=1``: a failure instead). The ini option ``fsm_engines`` (e.g.
    ``fsm_engines = sqlite``) keeps only the engines it lists.
``fsm_db_url``
    The URL (a ``str``) of a fresh, empty database at fsm's head revision: a SQLite file in the
    test's ``tmp_path`` (a copy of one migrated once per session), or a PostgreSQL schema of its
    own (migrated once per session, emptied before each test, dropped at the end). Open any
    store on it: ``ConversationStore(fsm_db_url)``, ``AsyncConversationStore(fsm_db_url)``.
``fsm_store``
    A :class:`~fsm.store.ConversationStore` open on ``fsm_db_url``, closed after the test.

::

    import pytest
    from openai import OpenAI
    from fsm.agent import run_agent_loop

    @pytest.mark.fsm_replay("recordings/weather.sse", "recordings/answer.sse")
    def test_my_agent(fsm_replay_server, fsm_store):
        client = OpenAI(base_url=fsm_replay_server.base_url, api_key="test")
        run_agent_loop(client, fsm_store, "c1", {"get_weather": get_weather}, model="m")
        assert fsm_replay_server.failures == []  # the requests the server checked
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fsm.replay import ReplayServer, ReplayTurn
    from fsm.store import ConversationStore

__all__ = [
    "fsm_db_url",
    "fsm_engine",
    "fsm_examples",
    "fsm_replay",
    "fsm_replay_server",
    "fsm_store",
]

_URL_ENV = "FSM_TEST_POSTGRES_URL"
_REQUIRE_ENV = "FSM_REQUIRE_POSTGRES"
ENGINES = ("sqlite", "postgresql")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsm", "fsm's replay server and conversation store fixtures")
    group.addoption(
        "--fsm-postgres-url",
        default=None,
        help=f"PostgreSQL URL for the fsm_store / fsm_db_url fixtures (default: ${_URL_ENV})",
    )
    group.addoption(
        "--fsm-require-postgres",
        action="store_true",
        default=False,
        help=f"fail instead of skipping when PostgreSQL is not given or unreachable "
        f"(also {_REQUIRE_ENV}=1)",
    )
    parser.addini(
        "fsm_engines",
        "engines the fsm store fixtures run on (comma-separated: sqlite, postgresql)",
        default="sqlite,postgresql",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fsm_replay(*streams): the script of the fsm_replay_server fixture"
    )


# -- the replay server ------------------------------------------------------------------------
@pytest.fixture
def fsm_examples() -> Path:
    """The directory of fsm's example streams."""
    from fsm.replay import EXAMPLES_DIR

    return EXAMPLES_DIR


@pytest.fixture
def fsm_replay() -> Iterator[Callable[..., ReplayServer]]:
    """A factory of started replay servers, stopped after the test:
    ``fsm_replay(script=None, **options)``."""
    servers: list[ReplayServer] = []

    def start(
        script: Sequence[ReplayTurn | str | os.PathLike[str] | bytes] | None = None,
        **options: Any,
    ) -> ReplayServer:
        from fsm.replay import ReplayServer, ReplayTurn, demo_script

        turns = (
            demo_script()
            if script is None
            else [t if isinstance(t, ReplayTurn) else ReplayTurn(t) for t in script]
        )
        server = ReplayServer(turns, **options)
        server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.fixture
def fsm_replay_server(
    request: pytest.FixtureRequest, fsm_replay: Callable[..., ReplayServer]
) -> ReplayServer:
    """A replay server serving the test's ``@pytest.mark.fsm_replay(...)`` streams (paths
    relative to the test's file), or fsm's demo conversation."""
    marker = request.node.get_closest_marker("fsm_replay")
    if marker is None:
        return fsm_replay()
    base = Path(str(request.node.path)).parent
    script = [
        base / s if isinstance(s, str | os.PathLike) and not Path(s).is_absolute() else s
        for s in marker.args
    ]
    return fsm_replay(script, **marker.kwargs)


# -- the store ------------------------------------------------------------------------------------
@pytest.fixture(params=ENGINES)
def fsm_engine(request: pytest.FixtureRequest) -> str:
    """The engine of this run of the test: ``sqlite`` or ``postgresql``."""
    name: str = request.param
    wanted = [e.strip() for e in str(request.config.getini("fsm_engines")).split(",")]
    if name not in wanted:
        pytest.skip(f"{name} is not in the fsm_engines ini option ({', '.join(wanted)})")
    return name


def _postgres_server(config: pytest.Config) -> Any:
    """The PostgreSQL server URL (an ``sa.URL``), or a skip / failure with the reason."""
    import sqlalchemy as sa

    from fsm.store.engine import normalize_url

    required = bool(_option(config, "fsm_require_postgres", False)) or (
        os.environ.get(_REQUIRE_ENV) == "1"
    )
    raw = _option(config, "fsm_postgres_url", None) or os.environ.get(_URL_ENV)

    def unavailable(reason: str) -> None:
        if required:
            pytest.fail(f"{reason} (PostgreSQL is required here)")
        pytest.skip(reason)

    if not raw:
        unavailable(
            f"no PostgreSQL URL: give --fsm-postgres-url or {_URL_ENV} "
            "(e.g. postgresql+psycopg://postgres@localhost/test)"
        )
    url = normalize_url(raw)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        unavailable(
            f"PostgreSQL at {url.render_as_string(hide_password=True)} is unreachable: {exc.orig}"
        )
    finally:
        engine.dispose()
    return url


def _option(config: pytest.Config, name: str, default: Any) -> Any:
    try:
        return config.getoption(name)
    except ValueError:  # the plugin was registered after the command line was parsed
        return default


@pytest.fixture(scope="session")
def _fsm_sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fsm.store.migrate import upgrade

    path = tmp_path_factory.mktemp("fsm-template") / "head.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _fsm_postgres_at_head(request: pytest.FixtureRequest) -> Iterator[Any]:
    import sqlalchemy as sa

    from fsm.store.migrate import upgrade

    server = _postgres_server(request.config)
    schema = f"fsm_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        url = server.update_query_dict({"options": f"-csearch_path={schema}"})
        try:
            upgrade(url)
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        admin.dispose()


@pytest.fixture
def fsm_db_url(fsm_engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh database at head with no data, on ``fsm_engine``."""
    if fsm_engine == "sqlite":
        path = tmp_path / "fsm.db"
        shutil.copyfile(request.getfixturevalue("_fsm_sqlite_at_head"), path)
        return f"sqlite:///{path}"
    import sqlalchemy as sa

    url = request.getfixturevalue("_fsm_postgres_at_head")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            # every table hangs off conversations (ON DELETE CASCADE)
            conn.execute(sa.text("DELETE FROM fsm_conversations"))
    finally:
        engine.dispose()
    rendered: str = url.render_as_string(hide_password=False)
    return rendered


@pytest.fixture
def fsm_store(fsm_db_url: str) -> Iterator[ConversationStore]:
    """A :class:`~fsm.store.ConversationStore` on a fresh database at head."""
    from fsm.store import ConversationStore

    with ConversationStore(fsm_db_url) as store:
        yield store
