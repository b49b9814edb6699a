"""The viewer's pages through :class:`fsm.web.App` (no socket), on each engine: each page's
JSON twin holds the same rows as the audit functions, pages by keyset, routes odd ids, escapes
hostile values, and every response carries the security headers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import audit
from fsm.web import App
from fsm.web.html import path_of
from fsm.web.pages import as_json
from fsm.web.server import CSP
from tests.store.corrupt import CORRUPTIONS
from tests.web.data import HOSTILE, HOSTILE_CUT, HOSTILE_ID, ODD_ID, build


@pytest.fixture
def app(db_url: sa.URL) -> Iterator[App]:
    build(db_url)
    engine = audit.open_readonly(db_url)
    try:
        yield App(engine, label="test store")
    finally:
        engine.dispose()


def get(app: App, target: str, status: int = 200, **headers: str) -> Any:
    response = app.respond("GET", target, headers)
    assert response.status == status, response.body[:500]
    assert response.all_headers()["Content-Security-Policy"] == CSP
    assert response.all_headers()["X-Content-Type-Options"] == "nosniff"
    if "json" in response.headers.get("Content-Type", ""):
        return json.loads(response.body)
    return response.body.decode("utf-8")


def test_conversations_newest_first_paged_by_keyset(app: App) -> None:
    seen: list[str] = []
    target = "/?format=json&limit=7"
    while True:
        page = get(app, target)
        seen += [row["id"] for row in page["rows"]]
        if page["next"] is None:
            break
        target = f"/?format=json&limit=7&after={page['next']}"
    assert len(seen) == len(set(seen)) == 33  # every conversation once
    first = get(app, "/?format=json&limit=100")["rows"]
    times = [row["created_at"] for row in first]
    assert times == sorted(times, reverse=True)
    plain = next(row for row in first if row["id"] == "plain")
    assert (plain["messages"], plain["calls"], plain["attempts"]) == (3, 1, 1)
    assert [r["id"] for r in get(app, "/?format=json&prefix=bulk-1")["rows"]] == [
        f"bulk-{i}" for i in range(19, 9, -1)
    ]
    by_model = get(app, "/?format=json&model=" + "%3Cb%20onmouseover%3Dalert(7)%3Emodel%3C/b%3E")
    assert [r["id"] for r in by_model["rows"]] == [HOSTILE_ID]
    assert get(app, "/?format=json&since=2999-01-01")["rows"] == []
    html = get(app, "/")
    assert f'href="{path_of("c", ODD_ID)}"' in html and 'rel="next"' not in html


def test_timeline_places_a_truncated_call_with_its_state_and_reason(app: App) -> None:
    page = get(app, "/c/plain?format=json")
    assert [m["role"] for m in page["messages"]] == ["user", "assistant", "tool"]
    (call,) = page["messages"][1]["calls"]
    assert (call["name"], call["call_id"], call["state"]) == ("get_weather", "call_w1", "finished")
    assert (call["result"], call["result_seq"], call["result_tool_call_id"]) == (
        "sunny",
        2,
        "call_w1",
    )
    (attempt,) = page["attempts"]
    assert (attempt["at_seq"], attempt["finish_reason"]) == (3, "length")
    (cut,) = attempt["calls"]
    assert (cut["state"], cut["reason"], cut["arguments"]) == (
        "truncated",
        "length",
        '{"city": "Par',
    )
    html = get(app, "/c/plain")
    anchor = f'id="attempt-{attempt["id"]}-0"'
    card = html[html.index(anchor) :]
    card = card[: card.index("</article>")]
    states = re.findall(r'class="state state-(\w+)"', card)
    assert states == ["opened", "accumulating", "truncated"]  # the machine's path
    assert "reason: <strong>length</strong>" in card and "raw text (cut: not JSON)" in card
    assert 'id="call-1-0"' in html and 'href="#m-2"' in html  # the result, linked


def test_odd_conversation_ids_route(app: App) -> None:
    target = path_of("c", ODD_ID)
    assert target == "/c/team%2Fa%20b%2520c%3Fd%23e%C3%BC%F0%9F%98%80"
    page = get(app, target + "?format=json")
    assert page["conversation_id"] == ODD_ID
    assert page["messages"][1]["calls"][0]["name"] == "echo"
    assert get(app, "/c/team/a?format=json", 404)["error"] == "not found"
    assert get(app, "/c/%FF?format=json", 400)["status"] == 400


def test_calls_twin_is_the_audit_query(app: App) -> None:
    engine = app.viewer.engine
    for query, filters in [
        ("", {}),
        ("&tool=get_weather", {"name": "get_weather"}),
        ("&state=truncated", {"state": "truncated"}),
        ("&arg=city%3DParis", {"args": [("city", "Paris")]}),
        ("&source=attempts", {"source": "attempts"}),
        ("&args_contains=onerror", {"args_contains": "onerror"}),
    ]:
        page = get(app, f"/calls?format=json&limit=500{query}")
        expected = [r.as_dict() for r in audit.tool_calls(engine, limit=500, **filters)]
        assert all(row.pop("cut") == [] for row in page["rows"])  # no value is that long
        assert page["rows"] == json.loads(as_json({"rows": expected}))["rows"], query
        assert page["rows"], query
    # keyset paging covers every call once
    keys: list[Any] = []
    target = "/calls?format=json&limit=9"
    while True:
        page = get(app, target)
        keys += [
            (r["conversation_id"], r["seq"], r["attempt_id"], r["position"]) for r in page["rows"]
        ]
        if page["next"] is None:
            break
        target = f"/calls?format=json&limit=9&after={page['next']}"
    assert len(keys) == len(set(keys)) == len(list(audit.tool_calls(engine, limit=None)))
    html = get(app, "/calls?state=truncated")
    # an attempt's call links to the page of attempts that starts with its attempt
    assert re.search(r'href="/c/plain\?attempts_after=[\w-]+#attempt-\d+-0"', html)
    assert get(app, "/calls?format=json&arg=nonsense", 400)["error"].startswith("arg")
    assert "unknown state" in get(app, "/calls?format=json&state=bogus", 400)["error"]


def test_failures_stats_and_check_twins(app: App) -> None:
    engine = app.viewer.engine
    failures = get(app, "/failures?format=json")
    assert [(r["conversation_id"], r["state"], r["reason"]) for r in failures["rows"]] == [
        (r.conversation_id, r.state, r.reason) for r in audit.failures(engine)
    ]
    assert sorted(
        (c["model"], c["state"], c["reason"], c["calls"]) for c in failures["counts"]
    ) == [
        (HOSTILE["model"], "truncated", "length", 1),
        ("test-model", "truncated", "length", 1),
    ]
    stats = get(app, "/stats?format=json")
    expected = audit.stats(engine)
    assert [(t["name"], t["calls"], t["failed"]) for t in stats["tools"]] == [
        (t.name, t.calls, t.failed) for t in expected.tools
    ]
    assert sum(sum(d.values()) for d in stats["failed_calls_per_day"].values()) == 2
    rates = {r["model"]: r for r in stats["rates"]}
    assert rates[HOSTILE["model"]]["truncated"] == 1 and rates[HOSTILE["model"]]["calls"] == 2
    html = get(app, "/stats")
    assert html.count("<svg") == 4 and "<script" not in html
    check = get(app, "/check?format=json")
    assert check["clean"] is True and all(rule["passed"] for rule in check["rules"])
    assert {rule["kind"] for rule in check["rules"]} == set(audit.VIOLATION_KINDS)


def test_hostile_values_are_text(app: App) -> None:
    html = get(app, path_of("c", HOSTILE_ID))
    for where, value in HOSTILE.items():
        if where == "content":
            continue
        assert value not in html, where  # never as markup
    for needle in ("<script", "<img", "<iframe", "<svg onload", "<b onmouseover"):
        assert needle not in html
    assert re.search(r"<[a-zA-Z][^>]*\son\w+\s*=", html) is None  # no event handler attribute
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;svg onload=alert(3)&gt;" in html
    assert 'href="javascript' not in html and re.search(r"<[^>]*\ssrc=", html) is None
    # the bidi override, ESC, BEL and the zero-width space are shown, not obeyed
    for escape in ("\\u202e", "\\u202c", "\\x1b", "\\x07", "\\u200b"):
        assert f'<span class="ctl" title="an invisible character">{escape}</span>' in html
    assert "\u202e" not in html and "\x1b" not in html
    assert "&lt;img src=x onerror=alert(8)&gt;" in html  # the cut arguments, raw
    assert HOSTILE_CUT not in html
    for target in ("/", "/calls", "/failures", "/stats"):
        page = get(app, target)
        assert "<script" not in page and "<img" not in page, target
        assert re.search(r"<[a-zA-Z][^>]*\son\w+\s*=", page) is None, target


def test_every_response_is_safe_and_read_only(app: App, db_url: sa.URL) -> None:
    def counts() -> list[int]:
        engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            tables = [
                "fsm_conversations",
                "fsm_messages",
                "fsm_tool_calls",
                "fsm_attempts",
                "fsm_attempt_calls",
            ]
            found = [
                conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables
            ]
        engine.dispose()
        return found

    before = counts()
    for target in [
        "/",
        "/c/plain",
        "/calls",
        "/failures",
        "/stats",
        "/check",
        "/nope",
        "/static/style.css",
    ]:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"):
            response = app.respond(method, target, {})
            assert response.status == 405 and response.headers["Allow"] == "GET, HEAD"
            assert response.all_headers()["Content-Security-Policy"] == CSP
        head = app.respond("HEAD", target, {})
        assert head.body == b"" and head.status in (200, 404)
    assert counts() == before
    css = app.respond("GET", "/static/style.css", {})
    assert css.headers["Content-Type"].startswith("text/css") and b"url(" not in css.body
    with app.viewer.engine.connect() as conn, pytest.raises(sa.exc.DBAPIError):
        conn.execute(sa.text("DELETE FROM fsm_conversations"))


def test_token_and_host_rules(db_url: sa.URL) -> None:
    build(db_url)
    engine = audit.open_readonly(db_url)
    try:
        guarded = App(engine, label="t", token="s3cret")
        denied = guarded.respond("GET", "/?format=json", {})
        assert denied.status == 401 and b"token" in denied.body
        assert guarded.respond("GET", "/?token=wrong", {}).status == 401
        assert guarded.respond("POST", "/", {}).status == 401  # no token: 401 before 405
        assert guarded.respond("GET", "/", {"Authorization": "Bearer s3cret"}).status == 200
        moved = guarded.respond("GET", "/calls?token=s3cret&tool=x%20y", {})
        assert moved.status == 303 and moved.headers["Location"] == "/calls?tool=x+y"
        assert (
            "HttpOnly" in moved.headers["Set-Cookie"]
            and "SameSite=Strict" in moved.headers["Set-Cookie"]
        )
        assert (
            guarded.respond("GET", "/calls", {"Cookie": "a=b; fsm_audit_token=s3cret"}).status
            == 200
        )
        loopback = App(engine, label="t", hosts=frozenset({"127.0.0.1:8765"}))
        assert loopback.respond("GET", "/", {"Host": "127.0.0.1:8765"}).status == 200
        assert loopback.respond("GET", "/", {"Host": "evil.example:8765"}).status == 403
    finally:
        engine.dispose()


#: a violation planted with the enforcement switched off, per engine
PLANTED = {
    "sqlite": "sqlite_foreign_keys_off_result_id_mismatch",
    "postgresql": "postgresql_replica_result_id_mismatch",
}


def test_check_page_shows_a_planted_violation(engine_name: str, db_url: sa.URL) -> None:
    corruption = CORRUPTIONS[PLANTED[engine_name]]
    conversation = corruption.build(db_url)
    engine = audit.open_readonly(db_url)
    try:
        app = App(engine, label="t")
        page = get(app, "/check?format=json")
        failed = {rule["kind"] for rule in page["rules"] if not rule["passed"]}
        assert failed & corruption.kinds and page["clean"] is False
        html = get(app, "/check")
        assert 'class="verdict bad"' in html
        assert re.search(rf'href="/c/{conversation}#m-\d+"', html)
        # the broken conversation still renders (values read leniently)
        assert get(app, f"/c/{conversation}?format=json")["conversation_id"] == conversation
    finally:
        engine.dispose()


def test_a_long_computation_answers_at_once_and_reloads(app: App) -> None:
    """A whole-store page whose computation outlasts the wait budget says so (202, a meta
    refresh to the page without refresh=1) while the computation goes on; then it is there."""
    app.viewer._check.budget = 0.0
    first = app.respond("GET", "/check?refresh=1", {})
    assert first.status == 202
    html = first.body.decode()
    assert '<meta http-equiv="refresh" content="2; url=/check">' in html and "<script" not in html
    assert json.loads(app.respond("GET", "/check?format=json", {}).body)["computing"] in (
        True,
        False,
    )
    app.viewer._check.budget = 30.0
    done = get(app, "/check?format=json")
    assert done["clean"] is True and done["rules"]
