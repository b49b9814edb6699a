"""Audit queries (``fsm.store.audit``) and the ``fsm audit`` / ``fsm history --mermaid`` commands
on a small store with known answers, built through ``ConversationStore`` with the real parser on
recorded provider streams (the corpus) and hand-built ones (``tests/helpers/``)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm import parse
from fsm.api import parse_text
from fsm.cli import audit as audit_cli
from fsm.cli.main import cli
from fsm.cli.output import OutputFormat, emit, mermaid_sequence, mermaid_text
from fsm.store import ConversationStore, SchemaNotAtHeadError
from fsm.store import audit as A
from tests.helpers import CORPUS, chunk, repo_env, require_corpus, sse, tc

PARALLEL = "openai/openai-gpt-4o_parallel_two_calls.sse"  # add + multiply, gpt-4o, usage 156
GPT5 = "openai/openai-gpt-5_single_tool_call.sse"  # weather
DASHSCOPE = "dashscope/dashscope-qwen3-max_empty_string_id_continuations.sse"  # weather, qwen
EMPTY_ARGS = "openai/openai-gpt-4o_parallel_empty_object_args.sse"  # get_country, get_product_name

NESTED = (
    '{"user": {"address": {"city": "Paris"}}, "tags": ["x", "y"], "n": 3, "ok": true, "none": null}'
)
NUL_ESCAPE = '{"note": "a\\u0000b", "city": "Oslo"}'  # valid JSON that jsonb cannot hold
DAY = {"c1": "2026-11-01 10:00:00", "c2": "2026-11-02 10:00:00", "c3": "2026-11-03 10:00:00"}


def corpus(name: str) -> Any:
    return parse_text((CORPUS / name).read_bytes())


def built(*calls: tuple[str, str, str], finish: str = "tool_calls", done: bool = True) -> Any:
    """A response of model ``test-model`` with ``calls`` (id, name, arguments), parsed."""
    chunks = [
        chunk(tc(i, cid, name, args, "function")) for i, (cid, name, args) in enumerate(calls)
    ]
    return parse(sse(*chunks, chunk(finish=finish), done=done))


def build(store: ConversationStore) -> None:
    """c1: user, gpt-4o add+multiply with results 5 and 6, an assistant text; then an attempt
    (gpt-5 weather cut mid-arguments: aborted, eof). c2: user, qwen weather ("sunny"); an attempt
    (test-model get_weather truncated by length); then the retry committed. c3: gpt-4o two calls
    with {} arguments; a test-model turn of three calls (empty arguments, nested JSON, a \\u0000
    escape). Each conversation's rows are dated one day apart (DAY)."""
    store.create_conversation("c1")
    store.append("c1", [{"role": "user", "content": "add and multiply 2 and 3"}])
    store.commit_turn("c1", corpus(PARALLEL).turn(0), ["5", "6"])
    store.append("c1", [{"role": "assistant", "content": "5 and 6"}])
    data = (CORPUS / GPT5).read_bytes()
    store.record_attempt("c1", parse_text(data[: len(data) // 2]))

    store.create_conversation("c2")
    store.append("c2", [{"role": "user", "content": "weather in Paris?"}])
    store.commit_turn("c2", corpus(DASHSCOPE).turn(0), ["sunny"])
    store.record_attempt("c2", built(("call_t", "get_weather", '{"city": "Par'), finish="length"))
    retry = built(("call_g", "get_weather", '{"city": "Paris", "units": "metric"}'))
    store.commit_turn("c2", retry.turn(0), [{"content": '{"temp": 18}'}])

    store.create_conversation("c3")
    store.append("c3", [{"role": "user", "content": "what do we sell, and where?"}])
    store.commit_turn("c3", corpus(EMPTY_ARGS).turn(0), ["FR", "Widget"])
    turn = built(
        ("call_e", "get_time", ""), ("call_n", "lookup", NESTED), ("call_z", "note", NUL_ESCAPE)
    )
    store.commit_turn("c3", turn.turn(0), ["12:00", "found", "noted"])
    with store.engine.begin() as conn:
        for cid, when in DAY.items():
            for table in ("fsm_messages", "fsm_attempts"):
                conn.execute(
                    sa.text(f"UPDATE {table} SET created_at = :t WHERE conversation_id = :c"),
                    {"t": datetime.fromisoformat(when).replace(tzinfo=UTC), "c": cid},
                )


@pytest.fixture
def url(db_url: sa.URL) -> str:
    require_corpus()
    with ConversationStore(db_url) as store:
        build(store)
    return db_url.render_as_string(hide_password=False)


@pytest.fixture
def engine(url: str) -> Any:
    opened = A.open_readonly(url)
    yield opened
    opened.dispose()


def keys(rows: Any) -> list[tuple[str, int, int, str]]:
    return [(r.conversation_id, r.seq, r.position, r.name) for r in rows]


# -- tool_calls ---------------------------------------------------------------------------------
ALL = [
    ("c1", 1, 0, "add"),
    ("c1", 1, 1, "multiply"),
    ("c1", 5, 0, "weather"),  # the attempt, at the seq it would have had
    ("c2", 1, 0, "weather"),
    ("c2", 3, 0, "get_weather"),  # the truncated attempt comes before the retry at seq 3
    ("c2", 3, 0, "get_weather"),
    ("c3", 1, 0, "get_country"),
    ("c3", 1, 1, "get_product_name"),
    ("c3", 4, 0, "get_time"),
    ("c3", 4, 1, "lookup"),
    ("c3", 4, 2, "note"),
]


def test_every_call_in_key_order_with_results_models_and_times(engine: Any) -> None:
    rows = list(A.tool_calls(engine, limit=None))
    assert keys(rows) == ALL
    add = rows[0]
    assert (add.call_id, add.arguments, add.result, add.state) == (
        "call_ehIWdjL1abZk1h8FWGLQ0Hie",
        '{"a": 2, "b": 3}',
        "5",
        "finished",
    )
    assert add.model == "gpt-4o-2024-08-06" and add.attempt_id is None
    assert add.created_at == datetime(2026, 11, 1, 10, tzinfo=UTC)
    cut = rows[2]
    assert (cut.state, cut.reason, cut.result, cut.model) == (
        "aborted",
        "eof",
        None,
        "gpt-5-2025-08-07",
    )
    assert cut.attempt_id is not None and cut.arguments.startswith('{"location":"Flo')
    truncated, retry = rows[4], rows[5]
    assert (truncated.state, truncated.reason, truncated.arguments) == (
        "truncated",
        "length",
        '{"city": "Par',
    )
    assert (retry.state, retry.result, retry.call_id) == ("finished", '{"temp": 18}', "call_g")
    assert sum(r.attempt_id is None for r in rows) == 9  # history; 2 calls of attempts


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"name": "weather"}, [("c1", 5, 0, "weather"), ("c2", 1, 0, "weather")]),
        ({"name": "weather", "source": "history"}, [("c2", 1, 0, "weather")]),
        ({"state": "aborted"}, [("c1", 5, 0, "weather")]),
        ({"state": "truncated"}, [("c2", 3, 0, "get_weather")]),
        (
            {"state": "finished", "conversation": "c2"},
            [("c2", 1, 0, "weather"), ("c2", 3, 0, "get_weather")],
        ),
        ({"model": "qwen3-max"}, [("c2", 1, 0, "weather")]),
        ({"conversation": "c1", "source": "attempts"}, [("c1", 5, 0, "weather")]),
        ({"since": "2026-11-02", "until": "2026-11-03"}, ALL[3:6]),
        ({"since": datetime(2026, 11, 3, 10)}, ALL[6:]),  # naive: UTC; since is inclusive
        ({"until": "2026-11-01T10:00:00Z"}, []),  # until is exclusive
        ({"args": [("city", "Paris")]}, [("c2", 3, 0, "get_weather")]),
        ({"args": [("user.address.city", "Paris")]}, [("c3", 4, 1, "lookup")]),
        (
            {"args": [("$.tags[1]", "y"), ("n", 3), ("ok", True), ("none", None)]},
            [("c3", 4, 1, "lookup")],
        ),
        ({"args": [("n", 3.0)]}, [("c3", 4, 1, "lookup")]),  # numbers compare as numbers
        ({"args": [("n", "3")]}, []),  # ... and a string is not a number
        ({"args": [("city", "Oslo")]}, [("c3", 4, 2, "note")]),  # beside a \u0000 escape
        ({"args": [("a", 2)], "model": "gpt-4o-2024-08-06"}, ALL[:2]),
        ({"args": [("$", None)]}, []),  # the empty arguments of get_time have no value
        ({"args_contains": "Paris"}, [("c2", 3, 0, "get_weather"), ("c3", 4, 1, "lookup")]),
        ({"args_contains": '"Par'}, [*ALL[4:6], ("c3", 4, 1, "lookup")]),  # cut ones too
    ],
)
def test_filters(engine: Any, filters: dict[str, Any], expected: list[Any]) -> None:
    assert keys(A.tool_calls(engine, limit=None, **filters)) == expected


def test_pages_by_key_and_by_offset_give_every_row_once(engine: Any) -> None:
    pages: list[Any] = []
    after = None
    while True:
        page = list(A.tool_calls(engine, limit=3, after=after))
        if not page:
            break
        pages += page
        after = page[-1].key
    assert keys(pages) == ALL
    by_offset = [
        r for start in range(0, 12, 4) for r in A.tool_calls(engine, limit=4, offset=start)
    ]
    assert keys(by_offset) == ALL
    assert keys(A.tool_calls(engine, limit=2, source="history", after=("c2", 1, 1, 0, 0))) == [
        ALL[5],
        ALL[6],
    ]


def test_a_connection_is_used_as_is(engine: Any) -> None:
    with engine.connect() as conn:
        assert len(list(A.tool_calls(conn, conversation="c3"))) == 5
        assert conn.in_transaction()  # the caller's transaction, not closed by the audit


@pytest.mark.parametrize(
    ("filters", "match"),
    [
        ({"state": "done"}, "unknown state"),
        ({"args": [("a..b", 1)]}, "empty key"),
        ({"args": [("a[x]", 1)]}, "not an array index"),
        ({"args": [("a", {"b": 1})]}, "scalar"),
        ({"since": "yesterday"}, "ISO 8601"),
        ({"limit": -1}, "negative"),
        ({"source": "both"}, "source"),
    ],
)
def test_bad_filters_are_typed_errors(engine: Any, filters: dict[str, Any], match: str) -> None:
    with pytest.raises(A.InvalidFilterError, match=match):
        list(A.tool_calls(engine, **filters))


def test_json_paths() -> None:
    assert A.parse_json_path("city") == ("city",)
    assert A.parse_json_path("$.a.b[2].c") == ("a", "b", 2, "c")
    assert A.parse_json_path('$."a.b"[0]') == ("a.b", 0)
    assert A.parse_json_path("items[0]") == ("items", 0)
    assert A.parse_json_path("$") == ()
    with pytest.raises(A.InvalidFilterError):
        A.parse_json_path('$."open')


# -- failures and stats -------------------------------------------------------------------------
def test_failures_with_reasons_anomalies_and_counts(engine: Any) -> None:
    rows = list(A.failures(engine))
    assert [(r.conversation_id, r.seq, r.name, r.state, r.reason) for r in rows] == [
        ("c1", 5, "weather", "aborted", "eof"),
        ("c2", 3, "get_weather", "truncated", "length"),
    ]
    assert rows[0].anomalies == ["incomplete_event_at_eof"] and rows[0].end_how == "eof"
    assert rows[1].finish_reason == "length" and rows[1].anomalies == []
    assert [r.name for r in A.failures(engine, state="truncated")] == ["get_weather"]
    assert [r.name for r in A.failures(engine, reason="eof", model="gpt-5-2025-08-07")] == [
        "weather"
    ]
    assert list(A.failures(engine, since="2026-11-03")) == []
    assert [r.key for r in A.failures(engine, after=rows[0].key)] == [rows[1].key]
    assert [c.as_dict() for c in A.failure_counts(engine)] == [
        {
            "model": "gpt-5-2025-08-07",
            "state": "aborted",
            "reason": "eof",
            "calls": 1,
            "attempts": 1,
        },
        {
            "model": "test-model",
            "state": "truncated",
            "reason": "length",
            "calls": 1,
            "attempts": 1,
        },
    ]
    assert A.failure_counts(engine, name="nothing") == []
    with pytest.raises(A.InvalidFilterError, match="failed calls are"):
        list(A.failures(engine, state="finished"))


GROQ_FAILED = "groq/groq-gpt-oss-120b_tool_use_failed_error_event.sse"


def record_callless(store: ConversationStore, conversation: str) -> None:
    """Three attempts without a tool call (issue 12): Groq's tool_use_failed error event, a text
    turn cut by length, a stream cut (eof) before any call."""
    store.create_conversation(conversation, exist_ok=True)
    store.record_attempt(conversation, corpus(GROQ_FAILED))
    store.record_attempt(
        conversation, parse(sse(chunk(content="Hello wor"), chunk(finish="length")))
    )
    store.record_attempt(conversation, parse(sse(chunk(content="Hel"), done=False)))


def test_failures_include_attempts_without_calls(url: str) -> None:
    with ConversationStore(url) as store:
        record_callless(store, "c4")
    engine = A.open_readonly(url)
    try:
        rows = list(A.failures(engine))
        groq = corpus(GROQ_FAILED)
        assert [(r.conversation_id, r.name, r.state, r.reason) for r in rows] == [
            ("c1", "weather", "aborted", "eof"),
            ("c2", "get_weather", "truncated", "length"),
            ("c4", None, None, groq.end_reason),  # the provider's error message
            ("c4", None, None, "length"),
            ("c4", None, None, "eof"),
        ]
        assert [(r.position, r.call_id, r.arguments) for r in rows[2:]] == [(None, None, None)] * 3
        assert [r.model for r in rows[2:]] == ["openai/gpt-oss-120b", "test-model", "test-model"]
        assert [r.end_how for r in rows[2:]] == ["error", "done", "eof"]
        assert len({r.attempt_id for r in rows}) == 5
        # keyset pages and offsets walk the merged rows in key order
        keys = [r.key for r in rows]
        assert keys == sorted(keys)
        for i in range(len(rows)):
            assert [r.key for r in A.failures(engine, after=rows[i].key)] == keys[i + 1 :]
            assert [r.key for r in A.failures(engine, limit=2, offset=i)] == keys[i : i + 2]
        assert [r.key for r in A.failures(engine, limit=None)] == keys
        # the attempt filters apply to them; a call filter (tool, state, reason) selects calls
        assert len(list(A.failures(engine, conversation="c4"))) == 3
        assert [r.reason for r in A.failures(engine, model="test-model")] == [
            "length",
            "length",
            "eof",
        ]
        assert list(A.failures(engine, conversation="c4", reason="length")) == []
        assert list(A.failures(engine, conversation="c4", state="aborted")) == []
        counts = A.failure_counts(engine, conversation="c4")
        assert sum(c.attempts for c in counts) == 3 and all(c.calls == 0 for c in counts)
        assert sorted((c.model, c.state, c.reason, c.attempts) for c in counts) == sorted(
            [
                ("openai/gpt-oss-120b", None, groq.end_reason, 1),
                ("test-model", None, "length", 1),
                ("test-model", None, "eof", 1),
            ]
        )
        everything = A.failure_counts(engine)
        assert sum(c.attempts for c in everything) == 5
        assert [c.calls for c in everything] == [1, 1, 0, 0, 0]
    finally:
        engine.dispose()


def test_failures_read_attempts_in_windows(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempts without a failed call are read a window of ids at a time: tiny windows give the
    same rows, pages and cursors as one big window."""
    from fsm.store.audit import failed

    with ConversationStore(url) as store:
        record_callless(store, "c4")
        record_callless(store, "c5")
    engine = A.open_readonly(url)
    try:
        whole = [r.key for r in A.failures(engine, limit=None)]
        assert len(whole) == 8
        monkeypatch.setattr(failed, "_WINDOW", 1)
        monkeypatch.setattr(failed, "_MAX_WINDOW", 2)
        assert [r.key for r in A.failures(engine, limit=None)] == whole
        for i in range(len(whole)):
            assert [r.key for r in A.failures(engine, limit=3, after=whole[i])] == whole[
                i + 1 : i + 4
            ]
            assert [r.key for r in A.failures(engine, limit=3, offset=i)] == whole[i : i + 3]
    finally:
        engine.dispose()


def test_failures_counts_command_counts_every_attempt(url: str) -> None:
    """The reported case, as a user runs it: 3 attempts recorded, ``--counts`` shows 3."""
    with ConversationStore(url) as store:
        record_callless(store, "c4")
    result = subprocess.run(
        [sys.executable, "-m", "fsm", "audit", "failures", "--db", url, "--counts", "--csv",
         "--conversation", "c4"],
        capture_output=True, text=True, env=repo_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert sum(int(r["attempts"]) for r in rows) == 3
    assert {(r["model"], r["state"], r["calls"]) for r in rows} == {
        ("openai/gpt-oss-120b", "", "0"),
        ("test-model", "", "0"),
    }
    listed = run("audit", "failures", "--db", url, "--conversation", "c4", "--json")
    assert [(r["state"], r["reason"]) for r in json.loads(listed.stdout)][1:] == [
        (None, "length"),
        (None, "eof"),
    ]


def test_stats(engine: Any) -> None:
    result = A.stats(engine)
    tools = {t.name: (t.calls, t.failed) for t in result.tools}
    assert tools == {
        "add": (1, 0),
        "multiply": (1, 0),
        "weather": (1, 1),
        "get_weather": (1, 1),
        "get_country": (1, 0),
        "get_product_name": (1, 0),
        "get_time": (1, 0),
        "lookup": (1, 0),
        "note": (1, 0),
    }
    models = {m.model: m for m in result.models}
    gpt4o = models["gpt-4o-2024-08-06"]
    assert (gpt4o.turns, gpt4o.calls, gpt4o.attempts) == (2, 4, 0)
    assert (gpt4o.prompt_tokens, gpt4o.completion_tokens, gpt4o.total_tokens) == (470, 90, 560)
    assert (models["gpt-5-2025-08-07"].turns, models["gpt-5-2025-08-07"].incomplete_share) == (
        0,
        1.0,
    )
    test_model = models["test-model"]
    assert (test_model.turns, test_model.calls, test_model.incomplete) == (2, 4, 1)
    assert test_model.incomplete_share == pytest.approx(1 / 3, abs=1e-6)
    assert models[None].turns == 1  # the assistant text appended without a model
    assert [(d.day, d.turns, d.calls, d.incomplete) for d in result.days] == [
        ("2026-11-01", 2, 2, 1),
        ("2026-11-02", 2, 2, 1),
        ("2026-11-03", 2, 5, 0),
    ]
    assert result.totals is not None
    assert (result.totals.turns, result.totals.calls, result.totals.total_tokens) == (
        6,
        9,
        560 + 317,
    )
    only = A.stats(engine, model="qwen3-max", since="2026-11-02", until="2026-11-03")
    assert [(t.name, t.calls) for t in only.tools] == [("weather", 1)]
    assert [(m.model, m.total_tokens) for m in only.models] == [("qwen3-max", 317)]
    assert A.stats(engine, conversation="c3").totals.calls == 5  # type: ignore[union-attr]


# -- read-only ----------------------------------------------------------------------------------
def test_the_audit_connection_refuses_writes(engine: Any) -> None:
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as caught:
        conn.execute(sa.text("DELETE FROM fsm_conversations"))
    message = str(caught.value.orig).lower()
    assert "readonly" in message or "read-only" in message
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM fsm_conversations")).scalar() == 3


def test_a_missing_sqlite_file_is_an_error_and_stays_missing(tmp_path: Path) -> None:
    path = tmp_path / "nothing" / "here.db"
    with pytest.raises(A.DatabaseNotFoundError, match="never create"):
        A.open_readonly(f"sqlite:///{path}")
    assert not path.exists() and not path.parent.exists()
    result = CliRunner().invoke(cli, ["audit", "calls", "--db", f"sqlite:///{path}"])
    assert_one_line_error(result)
    assert not path.parent.exists()


def test_a_path_with_uri_characters(tmp_path: Path) -> None:
    path = tmp_path / "odd ?#% name.db"
    with ConversationStore(f"sqlite:///{path}", auto_upgrade=True) as store:
        store.create_conversation("x")
    engine = A.open_readonly(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT id FROM fsm_conversations")).scalar() == "x"
    finally:
        engine.dispose()


def test_a_database_without_the_schema_names_the_command(empty_url: sa.URL) -> None:
    if empty_url.get_backend_name() == "sqlite":
        sa.create_engine(empty_url).connect().close()  # an empty file
    with pytest.raises(SchemaNotAtHeadError, match="fsm db upgrade"):
        A.open_readonly(empty_url)


# -- the command line ---------------------------------------------------------------------------
def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args))


def assert_one_line_error(result: click.testing.Result) -> None:
    assert result.exit_code not in (0, None)
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_calls_as_table_json_lines_and_csv(url: str) -> None:
    table = run("audit", "calls", "--db", url, "--tool", "weather")
    assert table.exit_code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:5] == ["conversation_id", "seq", "position", "call_id", "name"]
    assert set(lines[1]) == {"-", " "} and len(lines) == 4
    as_json = json.loads(run("audit", "calls", "--db", url, "--json").stdout)
    assert [(r["conversation_id"], r["seq"], r["position"], r["name"]) for r in as_json] == ALL
    # the same precision on every engine (issue 12)
    assert as_json[0]["created_at"] == "2026-11-01T10:00:00.000000+00:00"
    assert as_json[0]["result"] == "5"
    lines_out = run("audit", "calls", "--db", url, "--nl", "--state", "truncated").stdout
    [record] = [json.loads(line) for line in lines_out.splitlines()]
    assert (record["reason"], record["arguments"]) == ("length", '{"city": "Par')
    rows = list(csv.DictReader(io.StringIO(run("audit", "calls", "--db", url, "--csv").stdout)))
    assert (
        len(rows) == len(ALL)
        and rows[0]["attempt_id"] == ""
        and rows[0]["arguments"] == '{"a": 2, "b": 3}'
    )
    assert run("audit", "calls", "--db", url, "--tsv", "--no-headers").stdout.count("\n") == len(
        ALL
    )


def test_calls_arg_filters_and_cursor(url: str) -> None:
    found = run("audit", "calls", "--db", url, "--arg", "city=Paris", "--nl")
    assert [json.loads(x)["call_id"] for x in found.stdout.splitlines()] == ["call_g"]
    found = run("audit", "calls", "--db", url, "--arg", "n=3", "--arg", "ok=true", "--nl")
    assert [json.loads(x)["name"] for x in found.stdout.splitlines()] == ["lookup"]
    assert run("audit", "calls", "--db", url, "--arg", 'n="3"', "--nl").stdout == ""
    first = run("audit", "calls", "--db", url, "--limit", "4")
    assert "more rows may follow: add --after " in first.stderr
    cursor = first.stderr.split("--after ")[1].split()[0]
    rest = run("audit", "calls", "--db", url, "--after", cursor, "--limit", "0", "--json")
    assert [r["name"] for r in json.loads(rest.stdout)] == [k[3] for k in ALL[4:]]
    assert run("audit", "calls", "--db", url, "--after", "nonsense").exit_code == 2


def test_failures_and_stats_commands(url: str) -> None:
    listed = json.loads(run("audit", "failures", "--db", url, "--json").stdout)
    assert [(r["name"], r["reason"]) for r in listed] == [
        ("weather", "eof"),
        ("get_weather", "length"),
    ]
    counts = run("audit", "failures", "--db", url, "--counts", "--csv").stdout.splitlines()
    assert counts[0] == "model,state,reason,calls,attempts"
    assert counts[1:] == ["gpt-5-2025-08-07,aborted,eof,1,1", "test-model,truncated,length,1,1"]
    table = run("audit", "stats", "--db", url)
    assert table.exit_code == 0 and "tools:" in table.stdout and "totals:" in table.stdout
    document = json.loads(run("audit", "stats", "--db", url, "--json").stdout)
    assert set(document) == {"tools", "models", "days", "totals"}
    assert document["totals"]["calls"] == 9
    per_day = run("audit", "stats", "--db", url, "--by", "day", "--csv").stdout.splitlines()
    assert per_day[0].startswith("day,turns,calls") and len(per_day) == 4
    assert run("audit", "stats", "--db", url, "--nl").exit_code == 2  # --nl needs one table


def test_check_command_on_a_clean_store(url: str) -> None:
    result = run("audit", "check", "--db", url, "--progress")
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stdout == "" and "no violations" in result.stderr
    assert json.loads(run("audit", "check", "--db", url, "--json").stdout) == []


def test_one_format_only_and_typed_errors(url: str) -> None:
    both = run("audit", "calls", "--db", url, "--json", "--csv")
    assert both.exit_code == 2 and "choose one output format" in both.stderr
    assert_one_line_error(run("audit", "calls", "--db", url, "--since", "tomorrow"))
    assert_one_line_error(run("audit", "calls", "--db", url, "--arg", "a..b=1"))


def test_every_audit_command_has_help_with_examples() -> None:
    commands: list[tuple[list[str], click.Command]] = [(["audit"], audit_cli.audit)]
    commands += [(["audit", name], command) for name, command in audit_cli.audit.commands.items()]
    assert {name for name in audit_cli.audit.commands} == {
        "calls",
        "failures",
        "stats",
        "check",
        "pending",
        "serve",
    }
    for path, command in commands:
        assert command.help, path
        shown = run(*path, "--help")
        assert shown.exit_code == 0 and "Examples:" in shown.output, path
        if path != ["audit"]:
            # serve answers in the browser (each page's JSON twin: ?format=json)
            flags = ("--db",) if path == ["audit", "serve"] else ("--db", "--json", "--nl", "--csv")
            for flag in flags:
                assert flag in shown.output, (path, flag)


def test_default_database_is_the_embedded_one(
    url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if not url.startswith("sqlite"):
        pytest.skip("the embedded default is a SQLite file")
    monkeypatch.delenv("FSM_DB_URL", raising=False)
    monkeypatch.setenv("FSM_DB", sa.make_url(url).database or "")
    assert len(json.loads(run("audit", "calls", "--json").stdout)) == len(ALL)
    monkeypatch.setenv("FSM_DB", str(tmp_path / "absent.db"))
    assert_one_line_error(run("audit", "stats"))
    assert not (tmp_path / "absent.db").exists()


# -- output and mermaid -------------------------------------------------------------------------
def test_table_cells_are_escaped_cut_and_aligned() -> None:
    out = io.StringIO()
    rows = [
        {"name": "a\x1b[31mred\nline", "n": 1, "wide": "日本語"},
        {"name": "x" * 100, "n": 12345, "wide": None},
    ]
    emit(rows, OutputFormat(max_width=20), file=out)
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue() and "\\x1b[31mred\\nline" in lines[2]
    assert lines[3].startswith("x" * 19 + "…")
    assert lines[2].index("    1") == lines[3].index("12345")  # numbers right-aligned
    emit([], OutputFormat(), file=(empty := io.StringIO()))
    assert empty.getvalue() == ""
    emit([], OutputFormat(kind="json"), file=(empty := io.StringIO()))
    assert empty.getvalue() == "[]\n"


def test_mermaid_escapes_everything_that_could_break_the_diagram() -> None:
    assert mermaid_text("a;b#c:d") == "a#59;b#35;c#58;d"
    assert mermaid_text('%%{init}%% <script>"x"</script>') == (
        "#37;#37;#123;init#125;#37;#37; #60;script#62;#34;x#34;#60;/script#62;"
    )
    assert mermaid_text("line1\nline2") == "line1<br/>line2"
    assert mermaid_text("") == "(empty)" and mermaid_text("end") == "#101;#110;#100;"
    assert mermaid_text("été 東京") == "été 東京"
    assert mermaid_text("x" * 100, 10) == "x" * 9 + "#8230;"
    diagram = mermaid_sequence(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather; and time?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get weather", "arguments": '{"city": "Paris"}'},
                    },
                    {"id": "", "type": "function", "function": {"name": "end", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "", "content": [{"type": "text", "text": "12:00"}]},
            {"role": "assistant", "content": "18 C at 12:00"},
        ]
    )
    assert diagram.splitlines() == [
        "sequenceDiagram",
        "    participant U as user",
        "    participant A as assistant",
        "    participant T1 as get weather",
        "    participant T2 as #101;#110;#100;",
        "    Note over U,A: system: be brief",
        "    U->>A: weather#59; and time?",
        "    A->>T1: get weather(#123;#34;city#34;#58; #34;Paris#34;#125;) id c1",
        "    A->>T2: #101;#110;#100;((empty)) id (empty)",
        "    T1-->>A: 18 C",
        "    T2-->>A: 12#58;00",
        "    A->>U: 18 C at 12#58;00",
    ]


def test_history_mermaid(url: str) -> None:
    result = run("history", "--db", url, "c1", "--mermaid")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:5] == [
        "sequenceDiagram",
        "    participant U as user",
        "    participant A as assistant",
        "    participant T1 as add",
        "    participant T2 as multiply",
    ]
    assert "    T1-->>A: 5" in lines and "    T2-->>A: 6" in lines
    assert run("history", "--db", url, "c1", "--mermaid", "--json").exit_code == 2


def test_audit_imports_no_sqlalchemy_at_cli_start() -> None:
    """The audit group is registered at start-up; SQLAlchemy loads only when a command runs."""
    import subprocess
    import sys

    code = "import sys, fsm.cli.main; print('sqlalchemy' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    ("recorded", "reason"),
    [
        (("stop", "done", None, "the commit failed"), "the commit failed"),
        ((None, "error", "tool_use_failed: bad args", None), "tool_use_failed: bad args"),
        ((None, "eof", None, None), "eof"),
        ((None, "aborted", "cancelled by the caller", None), "cancelled by the caller"),
        (("length", "done", None, None), "length"),
        (("content_filter", "done", None, None), "content_filter"),
        (("stop", "done", None, None), None),
        (("tool_calls", "done", None, None), None),
        ((None, None, None, None), None),
    ],
)
def test_attempt_reason(recorded: tuple[Any, Any, Any, Any], reason: str | None) -> None:
    assert A.attempt_reason(*recorded) == reason
