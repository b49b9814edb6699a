"""Every page of the viewer bounded in rows and bytes, and every malformed request a 400 with a
one-line reason (issue 26, finding 6), on each engine, through :class:`fsm.web.App` (no socket).

The conversation page pages its attempts (at most ``attempts_limit`` of them, 50 by default,
with a cursor to the next ones): 70,000 attempts at one place give a page of a few tens of
kilobytes, where the page used to hold them all (52 MB at 40,000) and, on PostgreSQL past
65,535 attempts, failed for good (their ids were sent as one bound parameter each)."""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import audit
from fsm.web import App
from tests.web.data import build, clone_attempts


@pytest.fixture
def app(db_url: sa.URL) -> Iterator[App]:
    build(db_url)
    engine = audit.open_readonly(db_url)
    try:
        yield App(engine, label="test store")
    finally:
        engine.dispose()


def _get(app: App, target: str, status: int = 200) -> tuple[Any, int]:
    response = app.respond("GET", target, {})
    assert response.status == status, response.body[:300]
    if "json" in response.headers.get("Content-Type", ""):
        return json.loads(response.body), len(response.body)
    return response.body.decode(), len(response.body)


def _b64(key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def test_many_attempts_are_paged(app: App, db_url: sa.URL) -> None:
    clone_attempts(db_url, "plain", 120)  # 121 attempts, all after the last message
    seen: list[int] = []
    target = "/c/plain?format=json"
    pages = 0
    while True:
        page, size = _get(app, target)
        pages += 1
        assert len(page["attempts"]) <= 50 and size < 100_000
        assert [m["seq"] for m in page["messages"]] == [0, 1, 2]  # the messages stay
        seen += [a["id"] for a in page["attempts"]]
        if page["attempts_next_cursor"] is None:
            break
        target = f"/c/plain?format=json&attempts_after={page['attempts_next_cursor']}"
    assert pages == 3 and len(seen) == len(set(seen)) == 121 and seen == sorted(seen)
    html, size = _get(app, "/c/plain")
    assert size < 300_000 and html.count('class="msg attempt"') == 50
    more = re.search(r'class="next-attempts" href="([^"]+)"', html)
    assert more is not None
    nxt, _ = _get(app, more.group(1).replace("&amp;", "&"))
    assert nxt.count('class="msg attempt"') == 50
    # a smaller page on request, and the limit's own bounds
    assert len(_get(app, "/c/plain?format=json&attempts_limit=7")[0]["attempts"]) == 7
    _get(app, "/c/plain?format=json&attempts_limit=501", 400)
    # a failure's link opens the page of attempts that starts with its attempt
    failures, _ = _get(app, "/failures?format=json&conversation=plain&limit=500")
    last = failures["rows"][-1]
    listing, _ = _get(app, "/failures?conversation=plain&limit=500")
    link = re.findall(r'<a class="place" href="([^"]+)"', listing)[-1].replace("&amp;", "&")
    target, _, anchor = link.partition("#")
    linked, _ = _get(app, target)
    assert anchor == f"attempt-{last['attempt_id']}-{last['position']}"
    assert f'id="{anchor}"' in linked


def test_past_65535_attempts_the_page_answers(app: App, db_url: sa.URL) -> None:
    """PostgreSQL takes at most 65,535 bound parameters: the page's attempts are a subquery."""
    clone_attempts(db_url, "plain", 70_000)
    page, size = _get(app, "/c/plain?format=json")
    assert len(page["attempts"]) == 50 and page["attempts_next_cursor"] is not None
    assert size < 100_000
    _, size = _get(app, "/c/plain")
    assert size < 300_000
    # the listing counts at most 10,000 attempts per conversation, and says so
    home, _ = _get(app, "/?format=json&prefix=plain")
    row = home["rows"][0]
    assert (row["attempts"], row["attempts_capped"], row["calls_capped"]) == (10_000, True, False)
    assert ">10,000+</a>" in _get(app, "/?prefix=plain")[0]


FORGED = _b64(["a", "b"])
BAD_REQUESTS = [
    "/c/%ED%A0%80",  # a lone surrogate, in UTF-8 (which has none)
    "/c/%FF",
    "/c/a%00b",
    f"/failures?after={FORGED}",
    f"/failures?after={_b64([10**30, 0])}",
    f"/failures?after={_b64([1, 2, 3])}",
    "/failures?after=not-base64!",
    f"/calls?after={_b64([1, 'x', 0, 0, 0])}",
    f"/calls?after={_b64(['c', 0, 7, 0, 0])}",
    f"/calls?after={_b64(['c', 10**30, 1, 0, 0])}",
    f"/?after={_b64([1, 2])}",
    f"/c/plain?after={10**30}",
    f"/c/plain?after=-{10**30}",
    "/c/plain?after=%C2%B2",  # a superscript two: a digit to str.isdigit, not a number
    f"/c/plain?attempts_after={FORGED}",
    f"/c/plain?attempts_after={_b64([2**63, 0])}",
    "/c/plain?limit=%C2%B2",
    "/?prefix=%FF",
    "/?model=%ED%A0%80",
    "/calls?conversation=%ED%A0%80",
    "/failures?conversation=%FF",
    "/stats?conversation=%ED%A0%80",
    "/calls?conversation=a%00b",
]


@pytest.mark.parametrize("target", BAD_REQUESTS)
def test_a_malformed_request_is_a_400_with_one_line(app: App, target: str) -> None:
    joined = "&" if "?" in target else "?"
    data, _ = _get(app, f"{target}{joined}format=json", 400)
    assert data["status"] == 400 and "\n" not in data["error"] and len(data["error"]) < 300
    html, _ = _get(app, target, 400)
    assert "Traceback" not in html and '<p class="error">' in html


def test_whole_store_scans_are_shared_and_capped(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """Distinct /stats filters each need a scan: at most two run at once and eight wait; one
    more is a 503 with Retry-After (the rows of /failures still show, without their counts);
    the same filters share one scan; once the scans end, every page answers again."""
    from fsm.web import pages

    release = threading.Event()
    running: list[int] = []
    most = [0]
    lock = threading.Lock()
    real_stats = pages.audit.stats

    def slow_stats(*args: Any, **kwargs: Any) -> Any:
        with lock:
            running.append(1)
            most[0] = max(most[0], len(running))
        try:
            release.wait(30)
            return real_stats(*args, **kwargs)
        finally:
            with lock:
                running.pop()

    monkeypatch.setattr(pages.audit, "stats", slow_stats)
    app.viewer._stats.budget = 0.05
    statuses = [app.respond("GET", f"/stats?model=m{i}", {}).status for i in range(10)]
    assert statuses == [202] * 10  # two running, eight waiting
    assert app.respond("GET", "/stats?model=m3", {}).status == 202  # the same scan, shared
    refused = app.respond("GET", "/stats?model=m10&format=json", {})
    assert refused.status == 503 and refused.headers["Retry-After"] == "5"
    assert "busy" in json.loads(refused.body)["error"]
    failures, _ = _get(app, "/failures?format=json&model=other")  # a count scan, refused
    assert failures["counts_refused"] and failures["counts"] == []
    assert failures["rows"] == []
    assert app.respond("GET", "/?format=json", {}).status == 200  # listings need no scan
    release.set()
    app.viewer._stats.budget = 30.0
    for i in range(11):
        assert app.respond("GET", f"/stats?model=m{i}&format=json", {}).status == 200
    assert most[0] == 2


def test_connections_time_out_and_are_capped(tmp_path: Any) -> None:
    """A connection that sends nothing is closed after the read timeout; past the cap of
    connections served at once, one more is answered 503 at once and closed."""
    from fsm.store import upgrade
    from fsm.web import serve

    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    build(url)
    engine = audit.open_readonly(url)
    serving = serve(engine, label=url, port=0, read_timeout=0.5, max_connections=3)
    thread = threading.Thread(target=serving.serve_forever, daemon=True)
    thread.start()
    port = urllib.parse.urlsplit(serving.url).port
    assert port is not None
    idle: list[socket.socket] = []
    try:
        for _ in range(3):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 2" in answer
        extra.close()
        started = time.monotonic()
        for conn in idle:  # closed by the server after its read timeout
            assert conn.recv(4096) == b""
        assert time.monotonic() - started < 3
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(f"GET /?format=json HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert conn.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        for conn in idle:
            conn.close()
        serving.shutdown()
        thread.join(5)
        engine.dispose()


def test_values_calls_and_the_page_are_bounded_in_size(app: App, db_url: sa.URL) -> None:
    """A value longer than 32,768 characters is cut there (its field named in ``cut``), a turn
    shows at most 50 calls (``more_calls``), and the messages stop at about 2,000,000
    characters of values: the next page starts after the last one shown."""
    from fsm.store import ConversationStore
    from fsm.store.audit import browse
    from tests.helpers.store import make_turn

    big = "x" * 100_000
    with ConversationStore(db_url) as store:
        store.create_conversation("huge", metadata={"note": big})
        store.append("huge", [{"role": "user", "content": big}])
        calls = [(f"call-{k}", "echo", f'{{"k": {k}, "pad": "{big}"}}') for k in range(60)]
        store.commit_turn("huge", make_turn(calls, response_id="r-huge"), ["ok"] * 60)
        store.append("huge", [{"role": "user", "content": big} for _ in range(80)])
    page, size = _get(app, "/c/huge?format=json")
    first, turn = page["messages"][0], page["messages"][1]
    assert first["cut"] == ["content"] and len(first["content"]) == browse.VALUE_CHARS
    assert page["metadata_cut"] is True and isinstance(page["metadata"], str)
    assert len(turn["calls"]) == browse.CALLS_PER_TURN and turn["more_calls"] is True
    assert turn["calls"][0]["cut"] == ["arguments"]
    shown = len(page["messages"])
    assert 3 < shown < 142 and page["next_after"] == page["messages"][-1]["seq"]
    assert size < 3 * browse.PAGE_CHARS
    html, size = _get(app, "/c/huge")
    assert size < 3 * browse.PAGE_CHARS
    assert "content: cut at 32,768 characters" in html and "more than 50 calls" in html
    # every message, once, across the pages
    seqs = [m["seq"] for m in page["messages"]]
    while page["next_after"] is not None:
        page, _ = _get(app, f"/c/huge?format=json&after={page['next_after']}")
        seqs += [m["seq"] for m in page["messages"]]
    assert seqs == list(range(62 + 80))


def test_a_bug_is_a_500_with_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """An exception no rule expects answers 500 with one line (the traceback goes to the
    server's stderr), instead of a connection dropped without an answer."""
    from fsm.store import upgrade
    from fsm.web import serve

    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    engine = audit.open_readonly(url)
    serving = serve(engine, label=url, port=0)

    def broken(query: Any) -> Any:
        raise RuntimeError("planted")

    serving.server.app.viewer.calls = broken  # type: ignore[method-assign]
    thread = threading.Thread(target=serving.serve_forever, daemon=True)
    thread.start()
    port = urllib.parse.urlsplit(serving.url).port
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/calls", headers={"Host": f"127.0.0.1:{port}"})
        answer = conn.getresponse()
        assert answer.status == 500
        body = answer.read()
        conn.close()
        assert body == b"internal error: RuntimeError (a bug in fsm's viewer: please report it)\n"
    finally:
        serving.shutdown()
        thread.join(5)
        engine.dispose()
    assert "planted" in capsys.readouterr().err


def test_listing_rows_cut_long_values(app: App, db_url: sa.URL) -> None:
    """The JSON twins of /calls and /failures cut a value longer than 32,768 characters there
    and name it in the row's ``cut``: a page's size is bounded by its rows."""
    from fsm.store import ConversationStore
    from fsm.store.audit import browse
    from tests.helpers.store import make_turn

    big = "z" * 100_000
    with ConversationStore(db_url) as store:
        store.create_conversation("long")
        store.append("long", [{"role": "user", "content": "q"}])
        store.commit_turn(
            "long", make_turn([("c1", "echo", f'{{"pad": "{big}"}}')], response_id="r1"), [big]
        )
        store.record_attempt(
            "long",
            make_turn(
                [("c2", "echo", f'{{"pad": "{big}')], response_id="r2", finish_reason="length"
            ),
        )
    calls, size = _get(app, "/calls?format=json&conversation=long")
    assert size < 10 * browse.VALUE_CHARS
    by_id = {row["call_id"]: row for row in calls["rows"]}
    assert sorted(by_id["c1"]["cut"]) == ["arguments", "result"]
    assert len(by_id["c1"]["arguments"]) == browse.VALUE_CHARS
    failures, size = _get(app, "/failures?format=json&conversation=long")
    assert size < 10 * browse.VALUE_CHARS and failures["rows"][0]["cut"] == ["arguments"]


def test_whole_store_pages_list_at_most_max_groups(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/stats and /failures list at most MAX_GROUPS tools, models and failure counts (the
    largest first) and say how many there are in all."""
    from fsm.web import pages

    monkeypatch.setattr(pages, "MAX_GROUPS", 1)
    stats, _ = _get(app, "/stats?format=json")
    assert len(stats["tools"]) == 1 and stats["tools_total"] == 4
    assert stats["tools"][0]["name"] == "lookup"  # the most calls
    assert len(stats["models"]) == 1 and stats["models_total"] == 2
    failures, _ = _get(app, "/failures?format=json")
    assert len(failures["counts"]) == 1 and failures["counts_groups"] == 2
    html, _ = _get(app, "/stats")
    assert "1 of 4 shown" in html


def test_a_connection_gives_its_slot_back_once(db_url: sa.URL) -> None:
    """Ctrl-C landing just after a connection's thread started made both the main thread and
    the handler thread give the slot back: "Semaphore released too many times" in the thread,
    and a server that did not stop. Each request gives its slot back once."""
    from fsm.store.engine import create_readonly_engine
    from fsm.web.server import serve

    engine = create_readonly_engine(db_url)
    serving = serve(engine, label=str(db_url), port=0, max_connections=1)
    server: Any = serving.server
    try:
        request = socket.socket()
        assert server.slots.acquire(blocking=False)
        server.held.add(id(request))
        server._free(request)
        server._free(request)  # the second is a no-op, not a ValueError
        assert server.slots.acquire(blocking=False)  # the one slot is free again, once
        assert not server.slots.acquire(blocking=False)
        server.slots.release()
        request.close()
    finally:
        serving.server.server_close()
        engine.dispose()
