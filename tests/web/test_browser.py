"""The viewer in a real browser (headless Chromium driven by Playwright): the demo store's
truncated call reached by following links, paging through calls, hostile values that render as
text with no dialog, script or CSP violation, and a planted violation on the check page."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.store import upgrade
from tests.store.corrupt import CORRUPTIONS
from tests.web.conftest import Served
from tests.web.data import HOSTILE, HOSTILE_CUT, HOSTILE_ID, ODD_ID, build


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory, serve_store: Callable[[str], Served]) -> Served:
    """The store ``fsm demo`` writes (and the tests' hostile conversations), served."""
    url = f"sqlite:///{tmp_path_factory.mktemp('demo') / 'demo.db'}"
    result = CliRunner().invoke(cli, ["demo", "--db", url, "--delay", "0"])
    assert result.exit_code == 0, result.output
    assert (
        result.output.splitlines()[-1] == f"see it all in the browser: fsm audit serve --db '{url}'"
    )
    build(url)
    return serve_store(url)


class Watched:
    """A page with every dialog, console error, page error and CSP violation recorded."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", self._dialog)
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def clean(self) -> None:
        assert self.dialogs == [], self.dialogs
        assert self.errors == [], self.errors  # a CSP violation is logged as an error


@pytest.fixture
def page(browser: Any) -> Iterator[Watched]:
    context = browser.new_context()
    try:
        watched = Watched(context.new_page())
        yield watched
        watched.clean()
    finally:
        context.close()


def test_follow_the_demo_to_its_truncated_call(demo: Served, page: Watched) -> None:
    p = page.page
    p.goto(demo.base + "/")
    cut_row = p.locator("table.rows tr", has=p.locator("a.id", has_text="-cut"))
    cut_row.locator("a.bad").click()  # its failed attempts
    p.wait_for_url("**/c/demo-*-cut#attempts")
    card = p.locator("article.call-truncated")
    assert card.locator(".name").inner_text() == "multiply"
    path = card.locator(".path .state").all_inner_texts()
    assert path == ["opened", "accumulating", "truncated"]
    assert card.locator(".reason").inner_text() == "reason: length"
    assert card.locator("pre.raw").inner_text() == '{"a": 99, "b'
    assert "never executed" in card.inner_text()
    # the same call from the failures page, through its link to the timeline's anchor
    p.goto(demo.base + "/failures")
    p.locator("tr", has=p.locator("td", has_text="multiply")).locator("a.place").first.click()
    target = p.locator(":target")
    assert "call-truncated" in (target.get_attribute("class") or "")
    assert target.locator(".reason").inner_text() == "reason: length"


def test_page_through_calls(demo: Served, page: Watched) -> None:
    p = page.page
    with urllib.request.urlopen(demo.base + "/calls?format=json&limit=500") as response:
        every = json.loads(response.read())["rows"]
    p.goto(demo.base + "/calls?limit=25")
    seen: list[str] = []
    pages = 0
    while True:
        pages += 1
        seen += p.locator("table.rows tbody td.mono:nth-child(5)").all_inner_texts()
        following = p.locator("a[rel=next]")
        if following.count() == 0:
            break
        following.click()
        p.wait_for_load_state()
    assert pages >= 5 and len(seen) == len(every)
    assert seen[-1] == every[-1]["call_id"].replace("\n", "\\n")


def test_hostile_values_render_as_text(demo: Served, page: Watched) -> None:
    p = page.page
    p.goto(demo.base + "/")
    p.locator("a.id", has_text="<script>alert('id')</script>").click()
    assert p.locator("h1").inner_text().startswith(f"Conversation {HOSTILE_ID}")
    call = p.locator("article.call-finished")
    assert call.locator(".name").inner_text() == HOSTILE["name"]
    assert call.locator(".callid").inner_text() == HOSTILE["call_id"]
    shown = json.loads(call.locator(".args pre.json").inner_text())
    assert shown == json.loads(HOSTILE["arguments"])
    assert call.locator(".result pre.content").inner_text() == HOSTILE["result"]
    assert p.locator("article.call-truncated pre.raw").inner_text() == HOSTILE_CUT
    assert p.locator(".model").first.inner_text() == HOSTILE["model"]
    p.locator(".model").first.hover()  # an onmouseover would fire here
    content = p.locator("li.msg-user pre.content").inner_text()
    assert content == "\\u202eevil\\u202c \\x1b[31mred\\x1b[0m \\x07bell \\u200bzero-width"
    injected = p.evaluate(
        "() => [document.scripts.length, document.querySelectorAll("
        "'iframe, img, [onerror], [onload], [onmouseover], a[href^=javascript]').length]"
    )
    assert injected == [0, 0]
    for path in ("/calls", "/failures", "/stats", "/?model=" + HOSTILE["model"]):
        p.goto(demo.base + path)
        assert p.evaluate("() => document.scripts.length") == 0
    p.goto(demo.base + "/calls?args_contains=onerror")
    assert "<img src=x onerror=alert(2)>" in p.locator("table.rows").inner_text()


def test_odd_ids_route_in_the_browser(demo: Served, page: Watched) -> None:
    p = page.page
    p.goto(demo.base + "/?prefix=team/")
    p.locator("a.id").first.click()
    assert p.locator("dl.meta dd").first.inner_text() == ODD_ID
    assert "%2F" in p.url


def test_check_page_shows_a_planted_violation(
    browser: Any, tmp_path: Path, serve_store: Callable[[str], Served], page: Watched
) -> None:
    url = f"sqlite:///{tmp_path / 'broken.db'}"
    upgrade(url)
    corruption = CORRUPTIONS["sqlite_foreign_keys_off_result_id_mismatch"]
    conversation = corruption.build(url)
    served = serve_store(url)
    p = page.page
    p.goto(served.base + "/check")
    assert "violation" in p.locator(".verdict.bad").inner_text()
    failed = p.locator("tr.fail td.mono").all_inner_texts()
    assert set(failed) & corruption.kinds
    p.locator("tr.fail a.fail").first.click()
    row = p.locator(":target")
    assert row.locator("td.mono").inner_text() in corruption.kinds
    row.locator("a.id").click()
    assert p.locator("dl.meta dd").first.inner_text() == conversation
    assert p.locator(":target").count() == 1  # the offending message
