"""The README's promises: two set-up commands, CI runs the test command verbatim, a front page of
at most 300 lines whose one example is the file the tests run, and links that lead somewhere.

The examples themselves run in tests/test_examples.py (the README's is
docs/examples/agent_loop.py, checked equal here)."""

from __future__ import annotations

import re

from tests.helpers import REPO

README = REPO / "README.md"


def _setup_commands() -> list[str]:
    readme = README.read_text()
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


def test_main_job_installs_an_extra_that_exists() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for command in _setup_commands():
        for extra in re.findall(r"\.\[([\w,]+)\]", command):
            assert set(extra.split(",")) <= set(extras), extra


def test_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_readme_example_is_the_file_the_tests_run() -> None:
    """The README's one Python example is docs/examples/agent_loop.py, byte for byte."""
    blocks = re.findall(r"```python\n(.*?)\n```", README.read_text(), re.S)
    assert len(blocks) == 1
    example = (REPO / "docs" / "examples" / "agent_loop.py").read_text()
    assert blocks[0] + "\n" == example, "paste docs/examples/agent_loop.py into the README"


def test_readme_links_lead_somewhere() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert len(links) >= 15
    for link in links:
        assert (REPO / link).exists(), link


def test_readme_example_says_how_to_reach_the_replay_server() -> None:
    """The environment the README shows is what ``fsm replay`` prints (its port, its keys)."""
    shown = re.search(r"\$ fsm replay\n((?:export .*\n)+)", README.read_text())
    assert shown is not None
    from fsm.cli.replay import replay_environment

    environment = replay_environment("http://127.0.0.1:8766/v1", "http://127.0.0.1:8766")
    assert shown.group(1).splitlines() == [f"export {k}={v}" for k, v in environment.items()]
    from fsm.cli.replay import replay

    (port,) = [option for option in replay.params if option.name == "port"]
    assert port.default == 8766
