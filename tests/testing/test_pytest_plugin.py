"""fsm's pytest plugin (fsm/pytest_plugin.py) the way a user gets it: a separate pytest run (in
a subprocess, through pytest's ``pytester``) on a project of their own, with their own
recorded stream, the plugin loaded by its ``pytest11`` entry point."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import tomllib

import pytest

from fsm.replay import EXAMPLES_DIR
from tests.helpers import REPO

pytest_plugins = ["pytester"]

POSTGRES_URL = os.environ.get("FSM_TEST_POSTGRES_URL")

USER_TESTS = """
import sys

import openai
import pytest

from fsm.agent import run_agent_loop


def test_nothing_loaded_until_asked():
    # the plugin is active, yet neither SQLAlchemy nor fsm's store nor its server is imported
    assert "fsm.pytest_plugin" in sys.modules
    loaded = {"sqlalchemy", "alembic", "fsm.store", "fsm.replay", "openai"} & set(sys.modules)
    assert loaded == set() or loaded == {"openai"}, loaded


def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


@pytest.mark.fsm_replay("recordings/calls.sse", "recordings/answer.sse")
def test_my_agent(fsm_replay_server, fsm_store, fsm_engine, fsm_db_url):
    client = openai.OpenAI(base_url=fsm_replay_server.base_url, api_key="t", max_retries=0)
    result = run_agent_loop(
        client, fsm_store, "c1", {"add": add, "multiply": multiply}, model="m",
        messages=[{"role": "user", "content": "sums"}],
    )
    client.close()
    assert result.status == "completed"
    assert fsm_replay_server.failures == [] and fsm_replay_server.served == 2
    assert [m["role"] for m in fsm_store.history("c1")] == [
        "user", "assistant", "tool", "tool", "assistant"
    ]
    print("URL", fsm_db_url)
    print("ENGINE", fsm_engine, fsm_store.history("c1") and fsm_db_url.split(":")[0].split("+")[0])


def test_each_store_is_fresh(fsm_store):
    fsm_store.create_conversation("c1")  # would fail if the other test's data were still there


def test_the_demo_by_default(fsm_replay_server, fsm_examples):
    assert (fsm_examples / "parallel_add_multiply.sse").is_file()
    assert fsm_replay_server.served == 0


def test_the_factory(fsm_replay, fsm_examples):
    one = fsm_replay([fsm_examples / "final_answer.sse"])
    two = fsm_replay()
    assert one.port != two.port
"""


def entry_point_installed() -> bool:
    return any(
        ep.name == "fsm" and ep.value == "fsm.pytest_plugin"
        for ep in importlib.metadata.entry_points(group="pytest11")
    )


def test_the_entry_point_is_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"]["pytest11"] == {"fsm": "fsm.pytest_plugin"}


@pytest.fixture
def user_project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A user's project: its tests, its recordings (fsm's examples, copied), SQLite only unless
    a PostgreSQL URL is given."""
    recordings = pytester.path / "recordings"
    recordings.mkdir()
    shutil.copyfile(EXAMPLES_DIR / "parallel_add_multiply.sse", recordings / "calls.sse")
    shutil.copyfile(EXAMPLES_DIR / "final_answer.sse", recordings / "answer.sse")
    pytester.makepyfile(test_user=USER_TESTS)
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    if not entry_point_installed():
        # fsm was installed before it had the entry point: load the module by name
        args = ("-p", "fsm.pytest_plugin", *args)
    env_free = {k: os.environ.pop(k) for k in ("FSM_TEST_POSTGRES_URL", "FSM_REQUIRE_POSTGRES")
                if k in os.environ}  # fmt: skip
    try:
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-rs", *args)
    finally:
        os.environ.update(env_free)


@pytest.mark.slow  # a pytest process of its own
def test_sqlite_runs_and_postgresql_skips_with_a_reason(user_project: pytest.Pytester) -> None:
    result = run(user_project)
    result.assert_outcomes(passed=5, skipped=2)
    result.stdout.fnmatch_lines(
        ["*ENGINE sqlite sqlite*", "*no PostgreSQL URL: give --fsm-postgres-url*"]
    )


@pytest.mark.slow  # a pytest process of its own
def test_postgresql_required_but_missing_fails(user_project: pytest.Pytester) -> None:
    result = run(user_project, "--fsm-require-postgres")
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines(["*PostgreSQL is required here*"])


@pytest.mark.slow  # a pytest process of its own
def test_the_ini_option_keeps_only_the_listed_engines(user_project: pytest.Pytester) -> None:
    user_project.makeini("[pytest]\nfsm_engines = sqlite\n")
    result = run(user_project, "--fsm-postgres-url", "postgresql://nobody@127.0.0.1:1/none")
    result.assert_outcomes(passed=5, skipped=2)
    result.stdout.fnmatch_lines(["*postgresql is not in the fsm_engines ini option (sqlite)*"])


@pytest.mark.slow  # a pytest process of its own
@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES_URL, reason="FSM_TEST_POSTGRES_URL is not set")
def test_postgresql_from_the_option(user_project: pytest.Pytester) -> None:
    assert POSTGRES_URL is not None
    import sqlalchemy as sa

    def schemas() -> set[str]:
        engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                return set(conn.scalars(sa.text("SELECT nspname FROM pg_namespace")))
        finally:
            engine.dispose()

    result = run(user_project, "--fsm-postgres-url", POSTGRES_URL, "--fsm-require-postgres")
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines(["*ENGINE sqlite sqlite*", "*ENGINE postgresql postgresql*"])
    (used,) = re.findall(r"search_path%3D(fsm_test_\w+)", result.stdout.str())
    assert used not in schemas()  # its own schema, dropped at the end


@pytest.mark.slow  # a pytest process of its own
def test_disabled_with_p_no(user_project: pytest.Pytester) -> None:
    if not entry_point_installed():
        pytest.skip("fsm was installed before the entry point existed: pip install -e .")
    result = user_project.runpytest_subprocess("-p", "no:fsm", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*fixture 'fsm_replay_server' not found*"])
