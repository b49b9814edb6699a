"""The README's promises: two set-up commands, CI runs the test command verbatim, and every
Python example runs as written, twice in a row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsm.replay import ReplayServer, demo_script
from tests.helpers import REPO


def _setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", section, re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert _setup_commands()[1] in ci.splitlines()


def test_main_job_command_names_files_that_exist() -> None:
    for token in _setup_commands()[0].split():
        if token.startswith("fsm/examples/"):
            assert (REPO / token).is_file(), token


# -- every Python example of the README runs, twice in a row (issue 12) --------------------------

#: the names an example uses without defining them (the reader's own code), by a line of the
#: example that tells which one it is; the replay server stands in for the provider
_PRELUDES: dict[str, str] = {
    # self-contained examples (first: a key found in them decides before the keys below)
    "def test_my_agent(": "",
    # issue 17: each starts what it needs (its own replay server for the loop)
    'StreamParser(format="anthropic")': "",
    'demo_script(format="anthropic")': "",
    "result = parse(stream)  # the format is detected": "",
    "def commit(conversation,": "",
    "configure_engine(sa.create_engine(": "",
    "with_streaming_response.create(": "",
    "app = FastAPI()": (
        "async def add(a: int, b: int) -> int:\n    return a + b\n"
        "async def multiply(a: int, b: int) -> int:\n    return a * b\n"
    ),
    "httpx.stream(": (
        "import os\n"
        "url = os.environ['OPENAI_BASE_URL'] + '/chat/completions'\n"
        "request = {'model': 'm', 'stream': True,"
        " 'messages': [{'role': 'user', 'content': 'What is 1234 + 5678?'}]}\n"
        "headers = {'Authorization': 'Bearer test'}\n"
        "history = []\n"
    ),
    "parse(response_bytes)": (
        "from fsm.replay import EXAMPLES_DIR\n"
        "response_bytes = (EXAMPLES_DIR / 'parallel_add_multiply.sse').read_bytes()\n"
        "def run_tool(name, arguments):\n"
        "    import json\n"
        "    a = json.loads(arguments)\n"
        "    return str(a['a'] + a['b'] if name == 'add' else a['a'] * a['b'])\n"
    ),
    "except UnknownOutcomeError as error:": (
        "from openai import OpenAI\n"
        "from fsm.store import ConversationStore\n"
        "client = OpenAI(max_retries=0)\n"
        "store = ConversationStore('sqlite:///chat.db', auto_upgrade=True)\n"
        "cid = store.create_conversation()\n"
        "store.append(cid, [{'role': 'user', 'content': 'What is 1234 + 5678, and 12 * 34?'}])\n"
        "MODEL = 'demo-model-1'\n"
        "def add(a: int, b: int) -> int:\n    return a + b\n"
        "def multiply(a: int, b: int) -> int:\n    return a * b\n"
        "def find_effect(call_id: str) -> str | None:\n    return None\n"
    ),
    "except TurnFailedError as exc:": (
        "from openai import OpenAI\n"
        "from fsm.agent import TurnFailedError, run_agent_loop\n"
        "from fsm.store import ConversationStore\n"
        "client = OpenAI(max_retries=0)\n"
        "store = ConversationStore('sqlite:///chat.db', auto_upgrade=True)\n"
        "tools = {'add': lambda a, b: a + b, 'multiply': lambda a, b: a * b}\n"
    ),
    "= run_agent_loop(\n": "",
    "await arun_agent_loop(\n": "",
}

#: examples that need a package the test environment may lack
_NEEDS = {
    "app = FastAPI()": "fastapi",
    'demo_script(format="anthropic")': "anthropic",
}

#: examples that are a test module, run by pytest with fsm's plugin (its fixtures), not as a script
_PYTEST_MODULES = {"def test_my_agent("}

#: the conftest of such a run: the plugin is loaded by its entry point, or here when the
#: installed fsm predates it (as tests/conftest.py does)
_PLUGIN_CONFTEST = (
    "def pytest_configure(config):\n"
    "    if not config.pluginmanager.has_plugin('fsm'):\n"
    "        config.pluginmanager.import_plugin('fsm.pytest_plugin')\n"
)


def _python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", (REPO / "README.md").read_text(), re.S)


def _prelude_key(example: str) -> str:
    keys = [k for k in _PRELUDES if k in example]
    assert keys, f"a README example with no prelude in tests/test_readme.py:\n{example}"
    return keys[0]


def test_every_python_example_has_a_prelude() -> None:
    examples = _python_examples()
    assert len(examples) >= 6
    assert len({_prelude_key(e) for e in examples}) == len(examples)


@pytest.mark.slow  # two Python processes and a replay server per example
@pytest.mark.parametrize("number", range(len(_python_examples())))
def test_readme_example_runs_twice(number: int, tmp_path: Path) -> None:
    """Each example, as written (after the prelude of the names the reader supplies), in a
    fresh directory, run twice in a row in it: the second run meets the first run's files
    (``./fsm.db``, ``chat.db``) and must pass too. The provider is a replay server."""
    example = _python_examples()[number]
    key = _prelude_key(example)
    if key in _NEEDS:
        pytest.importorskip(_NEEDS[key])
    script = tmp_path / "example.py"
    command = [sys.executable, str(script)]
    if key in _PYTEST_MODULES:
        script = tmp_path / "test_example.py"
        (tmp_path / "conftest.py").write_text(_PLUGIN_CONFTEST)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    script.write_text(_PRELUDES[key] + example + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("FSM_DB_URL", "FSM_DB")}
    with ReplayServer(demo_script()) as server:
        env |= {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "test"}
        for run in (1, 2):
            server.reset(demo_script())
            done = subprocess.run(
                command,
                cwd=tmp_path,
                env=env | {"PYTHONPATH": str(REPO)},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, f"run {run}:\n{done.stdout}\n{done.stderr}"
            assert "Traceback" not in done.stderr
            if key in _PYTEST_MODULES:  # its test ran (and was not skipped)
                assert re.search(r"\b[1-9]\d* passed\b", done.stdout), done.stdout
        assert server.failures == []
