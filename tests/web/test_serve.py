"""``fsm audit serve`` for real: over a socket (any method but GET and HEAD is 405, odd ids
route, HEAD has no body) and as the command (the URL on the first line of stdout, a token for
another host, Ctrl-C exits 130 without a traceback)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from fsm.store import audit
from fsm.web import serve
from fsm.web.html import path_of
from tests.helpers import REPO
from tests.web.data import ODD_ID, build


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    from fsm.store import upgrade

    upgrade(url)
    build(url)
    engine = audit.open_readonly(url)
    serving = serve(engine, label=url, port=0)
    thread = threading.Thread(target=serving.serve_forever, daemon=True)
    thread.start()
    try:
        parts = urllib.parse.urlsplit(serving.url)
        assert parts.hostname is not None and parts.port is not None
        yield parts.hostname, parts.port
    finally:
        serving.shutdown()
        thread.join(5)
        engine.dispose()


def request(where: tuple[str, int], method: str, target: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*where, timeout=10)
    try:
        conn.request(method, target, headers={"Host": f"127.0.0.1:{where[1]}"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_over_a_socket(server: tuple[str, int]) -> None:
    status, headers, body = request(server, "GET", path_of("c", ODD_ID) + "?format=json")
    assert status == 200 and json.loads(body)["conversation_id"] == ODD_ID
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "script-src" not in headers["Content-Security-Policy"]  # default-src 'none': no script
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    for method in ("POST", "PUT", "DELETE", "PATCH", "PROPFIND", "BREW"):
        status, headers, _ = request(server, method, "/")
        assert (status, headers["Allow"]) == (405, "GET, HEAD"), method
    status, headers, body = request(server, "HEAD", "/calls")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 1000


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("FSM_DB_URL", "FSM_DB", "FSM_AUDIT_TOKEN")
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "fsm", "audit", "serve", *args, "--port", "0"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def _stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=20)
    return process.returncode, stderr


def test_the_command_prints_its_url_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    from fsm.store import upgrade

    upgrade(url)
    build(url)
    process, first = _start(["--db", url, "--quiet"])
    try:
        parts = urllib.parse.urlsplit(first)
        assert (parts.scheme, parts.hostname, parts.path, parts.query) == (
            "http",
            "127.0.0.1",
            "/",
            "",
        )
        assert parts.port is not None
        status, _, body = request((parts.hostname, parts.port), "GET", "/?format=json")
        assert status == 200 and b'"plain"' in body
    finally:
        code, stderr = _stop(process)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "stopped" in stderr


def test_another_host_needs_a_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    from fsm.store import upgrade

    upgrade(url)
    process, first = _start(["--db", url, "--host", "0.0.0.0", "--quiet"])
    try:
        parts = urllib.parse.urlsplit(first)
        token = urllib.parse.parse_qs(parts.query)["token"][0]
        assert len(token) >= 24 and parts.port is not None
        where = ("127.0.0.1", parts.port)
        assert request(where, "GET", "/")[0] == 401
        assert request(where, "GET", "/?format=json&token=" + "x" * len(token))[0] == 401
        status, headers, _ = request(where, "GET", f"/?token={token}")
        assert status == 303 and token in headers["Set-Cookie"]
    finally:
        code, stderr = _stop(process)
    assert code == 130 and "Traceback" not in stderr


def test_a_missing_store_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm",
            "audit",
            "serve",
            "--db",
            f"sqlite:///{tmp_path / 'none.db'}",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3 and done.stdout == ""
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_each_engine_over_a_socket(db_url: sa.URL, engine_name: str) -> None:
    """Both engines serve (the read-only engine of each)."""
    build(db_url)
    engine = audit.open_readonly(db_url)
    serving = serve(engine, label=engine_name, port=0)
    thread = threading.Thread(target=serving.serve_forever, daemon=True)
    thread.start()
    try:
        port = urllib.parse.urlsplit(serving.url).port
        assert port is not None
        status, _, body = request(("127.0.0.1", port), "GET", "/c/plain")
        assert status == 200 and b"call_w1" in body and b"truncated" in body
    finally:
        serving.shutdown()
        thread.join(5)
        engine.dispose()


def test_import_fsm_does_not_load_the_viewer() -> None:
    code = (
        "import sys, fsm, fsm.store; assert not [m for m in sys.modules if m.startswith('fsm.web')]"
    )
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True, timeout=60)
