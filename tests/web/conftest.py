"""The browser tests' fixtures: one headless Chromium per session (Debian's ``chromium``,
driven by Playwright through ``executable_path``; never a downloaded browser), and viewers
served on free local ports.

Without chromium or playwright the browser tests skip, saying which is missing, unless
``FSM_REQUIRE_BROWSER=1`` (set by ``.ci/run``, which installs both) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm.store import audit

CHROMIUM = os.environ.get("FSM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _missing() -> str | None:
    if not Path(CHROMIUM).is_file():
        return f"no chromium at {CHROMIUM} (apt-get install -y chromium, or set FSM_CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ModuleNotFoundError:
        return "playwright is not installed (pip install playwright; no `playwright install`)"
    return None


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the whole session."""
    missing = _missing()
    if missing is not None:
        if os.environ.get("FSM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"FSM_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(f"browser tests need chromium and playwright: {missing}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched
        finally:
            launched.close()


class Served:
    """A viewer on a free port: its base URL; :meth:`stop`."""

    def __init__(self, url: str) -> None:
        from fsm.web import serve

        self.engine = audit.open_readonly(url)
        self.serving = serve(self.engine, label=url, port=0, log=None)
        self.thread = threading.Thread(target=self.serving.serve_forever, daemon=True)
        self.thread.start()
        parts = urllib.parse.urlsplit(self.serving.url)
        self.base = f"http://127.0.0.1:{parts.port}"

    def stop(self) -> None:
        self.serving.shutdown()
        self.thread.join(5)
        self.engine.dispose()


@pytest.fixture(scope="session")
def serve_store() -> Iterator[Callable[[str], Served]]:
    """Start viewers on stores (URLs); all stopped at the end of the session."""
    started: list[Served] = []

    def start(url: str) -> Served:
        served = Served(url)
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()
