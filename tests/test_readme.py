"""The README's promises: two set-up commands, and CI runs the test command verbatim."""

from __future__ import annotations

import re

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
