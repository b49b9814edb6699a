"""Issue 29, item 4: a history is typed per format, as the installed SDKs accept it.

``mypy --strict`` checks ``tests/typing/history_per_format.py`` (a user's file: each format's
history passed to the official client, ``Turn.to_message()`` appended to a chat history, the
sync, async and bound stores) against whatever openai and anthropic SDKs this environment has:
``.ci/run`` runs it in the main environment (the newest SDKs) and in the lowest-versions one
(openai 1.97.2). ``fsm.types.Message`` and ``AssistantMessage`` are the SDK's own types to a
type checker, so they match every version; a copy of one version's TypedDicts fails on another.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, mypy_cache

USER_FILE = REPO / "tests" / "typing" / "history_per_format.py"


def _mypy(*target: str) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` on ``target`` with this environment's SDKs, fsm from the checkout."""
    pytest.importorskip("mypy")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *mypy_cache(), *target],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "MYPYPATH": str(REPO)},
        timeout=600,
    )


@pytest.mark.slow
def test_each_format_passes_to_the_official_clients_under_mypy() -> None:
    pytest.importorskip("anthropic")
    proc = _mypy(str(USER_FILE))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_mistyped_use_is_caught() -> None:
    """The check can fail: a Responses history handed to Chat Completions is an error."""
    wrong = (
        "from openai import OpenAI\nfrom fsm.store import ConversationStore\n"
        "store = ConversationStore('sqlite:///x.db')\n"
        "OpenAI().chat.completions.create(model='m', "
        "messages=store.history('c', format='responses'))\n"
    )
    proc = _mypy("-c", wrong)
    assert proc.returncode == 1 and "arg-type" in proc.stdout, proc.stdout + proc.stderr
