"""Human and machine output of the CLI (issue 12, items 5, 8 and 10): terminal-safe text, the
table fitted to the terminal, ``--columns``, TSV escaping, one timestamp precision on both engines,
machine formats that are never silently cut, and the human outputs of ``history``, ``ingest``,
``parse`` and ``demo`` without Python reprs. Store-backed cases run on both engines; a few
run the CLI as a user does (a subprocess); the many format cases use click's runner."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.cli.output import OutputFormat, emit, safe_text
from fsm.store import ConversationStore
from tests.helpers import CORPUS, repo_env, require_corpus
from tests.helpers.store import make_turn

ESC_NAME = "get_\x1b[31mred"  # a tool name with an ANSI colour sequence
BIDI = "abc\u202edcba"  # a right-to-left override
HOSTILE_RESULT = "line one\nline\ttwo \\ end\x07"
LONG = "x" * 500


def run(*args: str, env: dict[str, str] | None = None) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args), env=env)


def text_url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


@pytest.fixture
def hostile(db_url: sa.URL) -> str:
    """c1: one turn whose call has a hostile name, bidi arguments, a result with a newline, a
    tab, a backslash and BEL; c2: a turn with a 500-character argument text."""
    with ConversationStore(db_url) as store:
        store.create_conversation("c1")
        store.append("c1", [{"role": "user", "content": f"hi {BIDI}"}])
        turn = make_turn(
            [("call_\x1b]0;x\x07", ESC_NAME, json.dumps({"q": BIDI}, ensure_ascii=False))]
        )
        store.commit_turn("c1", turn, [HOSTILE_RESULT])
        store.create_conversation("c2")
        store.commit_turn(
            "c2", make_turn([("call_long", "lookup", json.dumps({"t": LONG}))]), ["ok"]
        )
    return text_url(db_url)


# -- safe_text -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain text", "plain text"),
        ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),  # ESC
        ("csi\x9b31m", "csi\\x9b31m"),  # a C1 control (CSI)
        ("del\x7f", "del\\x7f"),
        ("nul\x00", "nul\\x00"),
        ("a\nb\tc\rd", "a\\nb\\tc\\rd"),
        (BIDI, "abc\\u202edcba"),
        ("iso\u2066late\u2069", "iso\\u2066late\\u2069"),
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
        ("line\u2028sep", "line\\u2028sep"),
        ("lone \ud83d", "lone \\ud83d"),
        ("unassigned \U000e0fff", "unassigned \\U000e0fff"),
        # kept: printable text of any script, emoji sequences, a no-break space
        ("東京 café \u00a0 👩\u200d💻", "東京 café \u00a0 👩\u200d💻"),
    ],
)
def test_safe_text(raw: str, shown: str) -> None:
    assert safe_text(raw) == shown


def test_safe_text_can_keep_line_breaks() -> None:
    assert safe_text("a\nb\x1bc\td", newlines=True) == "a\nb\\x1bc\\td"


# -- emit: TSV, CSV, columns, empty tables, fitting -------------------------------------------------
ROWS = [
    {"id": "a", "n": 1, "text": 'tab\there, "quoted", comma', "tags": ["x", "y"]},
    {"id": "b", "n": 22, "text": "new\nline \\ back", "tags": []},
]
COLS = ("id", "n", "text", "tags")


def emitted(output: OutputFormat, rows: list[dict[str, Any]] = ROWS, **kw: Any) -> str:
    out = io.StringIO()
    emit(iter(rows), output, columns=kw.pop("columns", COLS), file=out, **kw)
    return out.getvalue()


def test_tsv_escapes_instead_of_quoting() -> None:
    assert emitted(OutputFormat(kind="tsv")).splitlines() == [
        "id\tn\ttext\ttags",
        'a\t1\ttab\\there, "quoted", comma\t["x","y"]',
        "b\t22\tnew\\nline \\\\ back\t[]",
    ]


def test_csv_still_quotes() -> None:
    rows = list(csv.reader(io.StringIO(emitted(OutputFormat(kind="csv")))))
    assert rows[1] == ["a", "1", 'tab\there, "quoted", comma', '["x","y"]']
    assert rows[2][2] == "new\nline \\ back"


def test_columns_pick_and_order_in_every_format() -> None:
    output = OutputFormat(kind="csv", columns=("text", "id"))
    assert emitted(output).splitlines()[0] == "text,id"
    assert json.loads(emitted(OutputFormat(kind="json", columns=("n", "id")))) == [
        {"n": 1, "id": "a"},
        {"n": 22, "id": "b"},
    ]
    table = emitted(OutputFormat(columns=("n", "id"), width=0)).splitlines()
    assert table == [" n  id", "--  --", " 1  a", "22  b"]  # numbers right-aligned
    assert emitted(OutputFormat(kind="tsv", columns=("id", "id"))).splitlines()[0] == "id"


def test_unknown_column_is_a_usage_error_listing_the_valid_ones() -> None:
    with pytest.raises(click.UsageError) as caught:
        emitted(OutputFormat(kind="json", columns=("id", "nope")))
    assert (
        caught.value.message == "unknown column nope for --columns: choose from id, n, text, tags"
    )


def test_an_empty_table_prints_its_header() -> None:
    assert emitted(OutputFormat(width=0), rows=[]).splitlines() == [
        "id  n  text  tags",
        "--  -  ----  ----",
    ]
    assert emitted(OutputFormat(width=0), rows=[], empty_table=False) == ""
    assert emitted(OutputFormat(kind="csv"), rows=[]) == "id,n,text,tags\n"
    assert emitted(OutputFormat(kind="tsv"), rows=[]) == "id\tn\ttext\ttags\n"
    assert emitted(OutputFormat(kind="json"), rows=[]) == "[]\n"


def test_a_table_fits_the_width_with_ellipses_and_whole_numbers() -> None:
    rows = [{"id": f"id-{i}", "n": 10**9 + i, "text": LONG, "tags": ["t" * 80]} for i in range(3)]
    for width in (40, 60, 100):
        lines = emitted(OutputFormat(width=width), rows=rows).splitlines()
        assert all(len(line) <= width for line in lines), (width, lines)
        assert all(line.rstrip().endswith("…") for line in lines[2:])
        assert [line.split()[1] for line in lines[2:]] == [str(10**9 + i) for i in range(3)]
    # --max-width 0: nothing is cut, whatever the width
    lines = emitted(OutputFormat(width=40, max_width=0), rows=rows).splitlines()
    assert LONG in lines[2] and "…" not in lines[2]


def test_table_cells_are_escaped_and_machine_formats_exact() -> None:
    rows = [{"id": ESC_NAME, "n": 1, "text": BIDI, "tags": []}]
    table = emitted(OutputFormat(width=0), rows=rows).splitlines()
    assert table[2] == "get_\\x1b[31mred  1  abc\\u202edcba"
    assert json.loads(emitted(OutputFormat(kind="json"), rows=rows))[0]["id"] == ESC_NAME


# -- the audit commands, on both engines --------------------------------------------------------------
def test_audit_columns_and_width_through_the_cli(hostile: str) -> None:
    shown = run("audit", "calls", "--db", hostile, "--columns", "name,call_id,seq", "--csv")
    assert shown.exit_code == 0, shown.stderr
    assert list(csv.reader(io.StringIO(shown.stdout))) == [
        ["name", "call_id", "seq"],
        [ESC_NAME, "call_\x1b]0;x\x07", "1"],
        ["lookup", "call_long", "0"],
    ]
    bad = run("audit", "failures", "--db", hostile, "--columns", "name,bogus")
    assert bad.exit_code == 2
    assert "error: unknown column bogus for --columns: choose from attempt_id, conversation_id" in (
        bad.stderr
    )
    # all 16 columns (issue 17 added the stream format)
    table = run("audit", "calls", "--db", hostile, env={"COLUMNS": "160"})
    lines = table.stdout.splitlines()
    assert lines[0].startswith("conv") and all(len(x) <= 160 for x in lines), lines
    assert "…" in lines[2]  # long cells cut with an ellipsis
    assert "\x1b" not in table.stdout and "get_\\x" in table.stdout
    picked = run(
        "audit", "calls", "--db", hostile, "--columns", "name,arguments", env={"COLUMNS": "30"}
    )
    assert picked.stdout.splitlines() == [  # the name whole (15), the arguments cut to 13
        "name             arguments",
        "---------------  -------------",
        'get_\\x1b[31mred  {"q": "abc\\u…',
        'lookup           {"t": "xxxxx…',
    ]
    wide = run("audit", "calls", "--db", hostile, "--max-width", "0", env={"COLUMNS": "80"})
    assert LONG in wide.stdout


def test_audit_tsv_keeps_one_row_per_line(hostile: str) -> None:
    shown = run("audit", "calls", "--db", hostile, "--tsv", "--columns", "name,result")
    assert shown.stdout.splitlines() == [
        "name\tresult",
        "get_\x1b[31mred\tline one\\nline\\ttwo \\\\ end\x07",
        "lookup\tok",
    ]


def test_audit_empty_table_has_a_header(hostile: str) -> None:
    shown = run("audit", "failures", "--db", hostile, "--columns", "conversation_id,reason")
    assert shown.exit_code == 0 and shown.stdout.splitlines() == [
        "conversation_id  reason",
        "---------------  ------",
    ]


def test_timestamps_have_one_precision_on_both_engines(hostile: str) -> None:
    rows = json.loads(run("audit", "calls", "--db", hostile, "--json").stdout)
    for row in rows:
        stamp = row["created_at"]
        assert len(stamp) == len("2026-11-01T10:00:00.000000+00:00") and stamp.endswith("+00:00")
        assert stamp[19] == "."


# -- machine formats are never cut silently (item 5) ---------------------------------------------------
@pytest.fixture
def many(db_url: sa.URL) -> str:
    """130 calls in history (more than a table's default 100)."""
    with ConversationStore(db_url) as store:
        store.create_conversation("big")
        calls = [(f"call_{i:03d}", "f", "{}") for i in range(130)]
        store.commit_turn("big", make_turn(calls), [str(i) for i in range(130)])
    return text_url(db_url)


def test_machine_formats_print_every_row_by_default(many: str) -> None:
    for flag in ("--json", "--nl", "--csv", "--tsv"):
        shown = run("audit", "calls", "--db", many, flag, "--columns", "call_id")
        assert shown.exit_code == 0 and shown.stderr == "", (flag, shown.stderr)
        lines = shown.stdout.splitlines()
        count = len(json.loads(shown.stdout)) if flag == "--json" else len(lines)
        assert count == 130 + (flag in ("--csv", "--tsv")), flag


def test_a_limit_that_cuts_says_so_in_every_format(many: str) -> None:
    table = run("audit", "calls", "--db", many)
    assert len(table.stdout.splitlines()) == 102  # header, rule, 100 rows
    assert table.stderr.startswith("more rows may follow: add --after ")
    for flag in ("--table", "--json", "--nl", "--csv", "--tsv"):
        shown = run("audit", "calls", "--db", many, flag, "--limit", "30")
        assert shown.stderr.startswith("more rows may follow: add --after "), flag
        cursor = shown.stderr.split("--after ")[1].split()[0]
        rest = run("audit", "calls", "--db", many, "--nl", "--after", cursor)
        assert len(rest.stdout.splitlines()) == 100 and rest.stderr == "", flag
    whole = run("audit", "calls", "--db", many, "--nl", "--limit", "200")
    assert len(whole.stdout.splitlines()) == 130 and whole.stderr == ""


# -- history, ingest and parse as people read them (item 10) --------------------------------------
def test_history_text_is_aligned_and_escaped(hostile: str) -> None:
    shown = run("history", "--db", hostile, "c1")
    assert shown.exit_code == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "    0  user       hi abc\\u202edcba",
        "    1  assistant  (no text)",
        '                  -> get_\\x1b[31mred({"q": "abc\\u202edcba"})  id call_\\x1b]0;x\\x07',
        "    2  tool       line one\\nline\\ttwo \\ end\\x07  (result of call_\\x1b]0;x\\x07)",
    ]
    exact = json.loads(run("history", "--db", hostile, "c1", "--json").stdout)
    assert exact[1]["tool_calls"][0]["function"]["name"] == ESC_NAME
    assert exact[2]["content"] == HOSTILE_RESULT


def test_history_of_a_missing_conversation_points_to_fsm_conversations(hostile: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "fsm", "history", "--db", hostile, "nope"],
        capture_output=True,
        text=True,
        env=repo_env(),
        timeout=120,
    )
    assert shown.returncode != 0 and "Traceback" not in shown.stderr
    [line] = shown.stderr.splitlines()
    where = sa.make_url(hostile).render_as_string(hide_password=True)
    assert line == (
        f"error: no conversation 'nope' in {where}; list them with: "
        f"fsm conversations --db '{where}'"
    )


def test_ingest_names_attempts_by_their_store_wide_id(db_url: sa.URL, tmp_path: Any) -> None:
    require_corpus()
    url = text_url(db_url)
    cut = tmp_path / "cut.sse"
    cut.write_bytes((CORPUS / "openai/openai-gpt-5_single_tool_call.sse").read_bytes()[:600])
    with ConversationStore(db_url) as store:
        store.create_conversation("other")
        store.record_attempt("other", make_turn(finish_reason="length"))
    shown = subprocess.run(
        [sys.executable, "-m", "fsm", "ingest", "--db", url, "--conversation", "c9", str(cut)],
        capture_output=True,
        text=True,
        env=repo_env(),
        timeout=120,
    )
    assert shown.returncode == 1, shown.stderr
    with ConversationStore(db_url) as store:
        [attempt] = store.attempts("c9")
    assert shown.stderr.splitlines() == [
        "the turn is not complete (weather aborted (eof)): nothing added to history; recorded "
        f"as attempt #{attempt['id']} (store-wide id) of conversation 'c9'"
    ]
    assert attempt["id"] > 1  # the other conversation's attempt came first


def test_parse_text_has_no_python_reprs(tmp_path: Any) -> None:
    stream = tmp_path / "s.sse"
    chunk = {
        "id": "r\x1b[1m",
        "model": "m\u202e",
        "choices": [
            {
                "index": 0,
                "delta": {
                    "content": "hi\x1b]0;title\x07",
                    "tool_calls": [
                        {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
    }
    stream.write_text(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")
    shown = run("parse", str(stream))
    assert shown.stdout.splitlines() == [
        "response r\\x1b[1m · model m\\u202e · ended: done",
        "choice 0: complete (finish_reason tool_calls)",
        "  content: hi\\x1b]0;title\\x07",
        "  #0 [index 0] f  id call_1  finished",
        "      arguments: (empty)",
        "COMPLETE: safe to commit",
    ]


def test_stats_columns_need_one_table(hostile: str) -> None:
    both = run("audit", "stats", "--db", hostile, "--columns", "name")
    assert both.exit_code == 2
    assert "--columns picks the columns of one table: choose it with --by" in both.stderr
    tools = run("audit", "stats", "--db", hostile, "--by", "tool", "--csv", "--columns", "name")
    assert tools.exit_code == 0, tools.stderr
    assert sorted(tools.stdout.splitlines()) == sorted(["name", ESC_NAME, "lookup"])


def test_failure_counts_are_never_paged(hostile: str) -> None:
    for extra in (["--limit", "1"], ["--offset", "1"], ["--after", "x"]):
        shown = run("audit", "failures", "--db", hostile, "--counts", *extra)
        assert shown.exit_code == 2, extra
        assert "error: --counts prints every group: --limit, --offset and --after page the " in (
            shown.stderr
        )
    assert run("audit", "failures", "--db", hostile, "--counts").exit_code == 0


def test_a_fitted_table_keeps_ids_names_states_and_times_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 29: at 80-140 columns the columns an auditor reads a row by stay whole; columns
    empty in every row are left out first, then the long texts are cut, then left out from the
    right (numbers first), and a line on stderr names what was left out."""
    when = datetime(2026, 11, 30, 14, 5, 9, 123456, tzinfo=UTC)
    rows = [
        {
            "conversation_id": f"support-ticket-2026-11-30-{n:04d}",
            "seq": 1,
            "position": n,
            "call_id": f"call_{n:02d}_Xq7Zr2mKpA",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "units": "metric", "days": 7}' * 2,
            "state": "truncated" if n else "finished",
            "model": "gpt-4o-mini-2024-07-18",
            "created_at": when,
            "result": "18 C, sunny" * 5 if not n else None,
            "reason": "length" if n else None,
            "duration_ms": None,
        }
        for n in range(3)
    ]
    whole = ("support-ticket-2026-11-30-0001", "call_01_Xq7Zr2mKpA", "get_weather", "truncated")
    for width in (130, 140):  # room for the whole columns: they are not cut
        lines = emitted(OutputFormat(width=width), rows=rows, columns=list(rows[0])).splitlines()
        note = capsys.readouterr().err
        assert all(len(line) <= width for line in lines), (width, lines)
        assert "duration_ms" not in lines[0]  # empty in every row
        for text in (*whole, "2026-11-30T14:05:09Z", "length", "gpt-4o-mini-2024-07-18"):
            assert text in lines[3], (width, text, lines)
        left_out = [c for c in ("seq", "position", "arguments", "result") if c not in lines[0]]
        assert note.startswith(f"({len(left_out) + 1} column(s) left out to fit {width} columns")
        assert all(c in note for c in left_out)
    # 100: every other column left out before a whole column is cut
    lines = emitted(OutputFormat(width=100), rows=rows, columns=list(rows[0])).splitlines()
    assert lines[0].split() == [
        "conversation_id", "call_id", "name", "state", "model", "created_at", "reason"
    ]  # fmt: skip
    assert all(len(line) <= 100 for line in lines)
    assert "seq, position, arguments, result, duration_ms" in capsys.readouterr().err
    # a table that fits is left as it is, empty columns included
    lines = emitted(OutputFormat(width=400), rows=rows, columns=list(rows[0])).splitlines()
    assert lines[0].split() == list(rows[0]) and capsys.readouterr().err == ""
    # --columns keeps what it names, even empty, cutting instead
    picked = OutputFormat(width=60, columns=("name", "duration_ms", "arguments"))
    assert emitted(picked, rows=rows, columns=list(rows[0])).splitlines()[0].split() == [
        "name",
        "duration_ms",
        "arguments",
    ]
