"""Issue 17, the store: Responses and Anthropic turns of the recordings committed and read back.

Every complete turn of ``../shared/corpus-responses`` and ``../shared/corpus-anthropic`` is
parsed by fsm's parser, committed with its results, and read back in its own format: the
history equals what the parser's ``Turn.to_items(results)`` / ``Turn.to_anthropic(results)``
gives (ids, arguments, signatures, encrypted reasoning byte-exact), on SQLite and PostgreSQL.
Read in each of the three formats it validates against the SDKs' own request types, and the
tool blocks keep the target API's shape. The database checks the new columns with raw SQL.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic.types
import openai.types.responses
import pytest
import sqlalchemy as sa
from pydantic import TypeAdapter

from fsm.errors import IncompleteTurnError
from fsm.parser import StreamParser, Turn
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.store.audit import check, tool_calls
from fsm.store.models import PG_CALL_ARGUMENTS_CHECK
from fsm.store.render import CALL_REF
from tests.helpers import REPO, require_recording
from tests.helpers.store import assert_openai_accepts, call_row, make_turn, result_row, user_row

SHARED = Path(os.environ.get("FSM_SHARED_DIR", REPO.parent / "shared"))
CORPORA = {"responses": SHARED / "corpus-responses", "anthropic": SHARED / "corpus-anthropic"}

RESPONSES_INPUT = TypeAdapter(openai.types.responses.ResponseInputParam)
ANTHROPIC_MESSAGES = TypeAdapter(list[anthropic.types.MessageParam])
#: the beta API's types: MCP connector blocks (``mcp_tool_use``, ...) are only there
ANTHROPIC_BETA_MESSAGES = TypeAdapter(list[anthropic.types.beta.BetaMessageParam])


def _files() -> list[Any]:
    found = [
        pytest.param(fmt, p.name, id=f"{fmt}/{p.name}")
        for fmt, folder in CORPORA.items()
        for p in sorted(folder.glob("*.sse"))
    ]
    if found:
        return found
    return [pytest.param(None, None, id="no-corpus")]


def _parsed(fmt: str | None, name: str | None) -> Turn | None:
    """The turn of a recording (complete or not), ``None`` if it has none."""
    if fmt is None or name is None:
        message = f"the recordings of issue 17 are not in {SHARED}"
        if os.environ.get("FSM_REQUIRE_CORPUS") == "1":
            pytest.fail(message + "; FSM_REQUIRE_CORPUS=1 makes this an error")
        pytest.skip(message)
    parser = StreamParser(format=fmt)  # type: ignore[arg-type]
    parser.receive_data(_recording(fmt, name).read_bytes())
    parser.receive_eof()
    result = parser.result()
    return result.turns[0] if result.turns else None


def _recording(fmt: str, name: str) -> Path:
    """The recording ``name`` of issue 17's ``fmt`` corpus; skips (fails under
    FSM_REQUIRE_CORPUS=1) when ``../shared`` does not hold it."""
    return require_recording(CORPORA[fmt] / name, f"{fmt} recording")


def _turn(fmt: str | None, name: str | None) -> Turn:
    """The complete turn of a recording."""
    turn = _parsed(fmt, name)
    assert turn is not None and turn.complete, name
    return turn


def _results(turn: Turn) -> list[str]:
    return [f"result of {call.name} #{p}" for p, call in enumerate(turn.tool_calls)]


def _validate(fmt: str, history: list[Any]) -> None:
    if fmt == "chat":
        assert_openai_accepts(history)
    elif fmt == "responses":
        RESPONSES_INPUT.validate_python(history)
    else:
        try:
            ANTHROPIC_MESSAGES.validate_python(history)
        except ValueError:
            beta = {"mcp_tool_use", "mcp_tool_result"}
            used = {b.get("type") for m in history for b in m["content"] if isinstance(b, dict)}
            assert used & beta, "only the beta API's blocks may need its types"
            ANTHROPIC_BETA_MESSAGES.validate_python(history)


def _check_blocks(fmt: str, history: list[Any], turn: Turn) -> None:
    """The tool blocks are valid for ``fmt``: Responses, one output per call_id right after
    the calls; Anthropic, ONE user message of every tool_result in call order right after the
    assistant message."""
    ids = [c.id for c in turn.tool_calls]
    if fmt == "responses":
        outputs = [i for i in history if i.get("type", "").endswith("_call_output")]
        assert [o["call_id"] for o in outputs] == ids
        calls = [i for i in history if i.get("type") in ("function_call", "custom_tool_call")]
        assert [c["call_id"] for c in calls] == ids
        if ids:
            assert history.index(outputs[0]) > max(history.index(c) for c in calls)
    elif fmt == "anthropic":
        assert all(m["role"] in ("user", "assistant") for m in history)
        assistant = next(i for i, m in enumerate(history) if m["role"] == "assistant")
        uses = [b["id"] for b in history[assistant]["content"] if b["type"] == "tool_use"]
        assert uses == ids
        if ids:
            answers = history[assistant + 1]
            assert answers["role"] == "user"
            assert [b["tool_use_id"] for b in answers["content"]] == ids
            assert assistant + 2 == len(history)


@pytest.mark.parametrize(("fmt", "name"), _files())
def test_a_recorded_turn_round_trips_byte_exact(
    store: ConversationStore, fmt: str | None, name: str | None
) -> None:
    parsed = _parsed(fmt, name)
    assert fmt is not None
    store.create_conversation("c")
    store.append("c", [{"role": "user", "content": "go"}])
    if parsed is None or not parsed.complete:  # never in history; an attempt keeps its format
        if parsed is not None:
            with pytest.raises(IncompleteTurnError):
                store.commit_turn("c", parsed, _results(parsed))
        parser = StreamParser(format=fmt)  # type: ignore[arg-type]
        parser.receive_data((CORPORA[fmt] / str(name)).read_bytes())
        parser.receive_eof()
        store.record_attempt("c", parser.result())
        assert [r.format for r in tool_calls(store.engine, source="attempts")] == [fmt] * len(
            parsed.tool_calls if parsed is not None else []
        )
        assert store.history("c", format=fmt) == [{"role": "user", "content": "go"}]  # type: ignore[arg-type]
        return
    turn = parsed
    results = _results(turn)
    store.commit_turn("c", turn, results)
    native = store.history("c", format=fmt)  # type: ignore[arg-type]
    want = turn.to_items(results) if fmt == "responses" else turn.to_anthropic(results)
    assert native[1:] == want
    # byte-exact through JSON too (key order aside): ids, arguments, signatures, reasoning
    assert json.dumps(native[1:], sort_keys=True) == json.dumps(want, sort_keys=True)
    chat = store.history("c")
    if turn.tool_calls:
        stored = chat[1]["tool_calls"]
        for call, row in zip(turn.tool_calls, stored, strict=True):
            assert row["id"] == call.id
            body = row["custom"] if call.custom else row["function"]
            assert body["name"] == call.name
            assert body["input" if call.custom else "arguments"] == call.arguments
    for target in ("chat", "responses", "anthropic"):
        history = store.history("c", format=target)  # type: ignore[arg-type]
        _validate(target, history)
        _check_blocks(target, history, turn)


def test_provider_items_hold_references_not_copies_of_the_calls(store: ConversationStore) -> None:
    turn = _turn("responses", "fantasy__openai-gpt-5_reasoning_summary_single_call.sse")
    store.create_conversation("c")
    store.commit_turn("c", turn, _results(turn))
    with store.engine.connect() as conn:
        fmt, raw = conn.execute(
            sa.text("SELECT format, provider_items FROM fsm_messages WHERE seq = 0")
        ).one()
    items = json.loads(raw) if isinstance(raw, str) else raw
    assert fmt == "responses"
    refs = [i for i in items if CALL_REF in i]
    assert [r[CALL_REF] for r in refs] == [0]
    assert not {"call_id", "name", "arguments"} & set(refs[0])
    assert refs[0]["id"].startswith("fc_")  # the item id is provider-only: kept
    assert any(i["type"] == "reasoning" for i in items)


def test_cross_provider_rendering_drops_only_provider_bound_items(
    store: ConversationStore,
) -> None:
    """An Anthropic turn with a thinking block read for Responses and Chat: the thinking and
    its signature are gone, the text and the call stay, results are per call_id."""
    turn = _turn("anthropic", "llm-anthropic__claude-haiku-4-5_thinking_then_empty_args_call.sse")
    assert any(i["type"] == "thinking" for i in turn.output_items())
    store.create_conversation("c")
    store.append("c", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}])
    store.commit_turn("c", turn, ["done"])
    call = turn.tool_calls[0]
    responses = store.history("c", format="responses")
    assert [i.get("type", i.get("role")) for i in responses] == [
        "system",
        "user",
        *(["message"] if turn.content else []),
        "function_call",
        "function_call_output",
    ]
    assert responses[-2] == {
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }
    assert responses[-1] == {"type": "function_call_output", "call_id": call.id, "output": "done"}
    assert "signature" not in json.dumps(responses)
    # the same conversation for Anthropic keeps the signature, and leaves the system prompt out
    native = store.history("c", format="anthropic")
    assert [m["role"] for m in native] == ["user", "assistant", "user"]
    assert native[1]["content"] == turn.to_anthropic()[0]["content"]
    # and a Responses turn read for Anthropic loses its reasoning items, keeps its call
    other = _turn("responses", "fantasy__azure-gpt-5-mini_reasoning_single_call.sse")
    store.create_conversation("r")
    store.commit_turn("r", other, ["ok"])
    rendered = store.history("r", format="anthropic")
    assert rendered[0]["content"][-1] == {
        "type": "tool_use",
        "id": other.tool_calls[0].id,
        "name": other.tool_calls[0].name,
        "input": json.loads(other.tool_calls[0].arguments),
    }
    assert all(b["type"] in ("text", "tool_use") for b in rendered[0]["content"])
    assert rendered[1] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": other.tool_calls[0].id, "content": "ok"}
        ],
    }


def test_a_chat_conversation_renders_for_the_other_apis(store: ConversationStore) -> None:
    store.create_conversation("c")
    store.append("c", [{"role": "user", "content": "add and multiply"}])
    calls = [("call_a", "add", '{"a": 1, "b": 2}'), ("call_m", "multiply", '{"a": 3, "b": 4}')]
    store.commit_turn("c", make_turn(calls, content="On it."), ["3", "12"])
    store.commit_turn(
        "c", make_turn([], content="3 and 12", finish_reason="stop", response_id="r2")
    )
    responses = store.history("c", format="responses")
    RESPONSES_INPUT.validate_python(responses)
    assert [i.get("type") for i in responses] == [
        None,
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "message",
    ]
    claude = store.history("c", format="anthropic")
    _validate("anthropic", claude)
    assert [m["role"] for m in claude] == ["user", "assistant", "user", "assistant"]
    assert claude[1]["content"] == [
        {"type": "text", "text": "On it."},
        {"type": "tool_use", "id": "call_a", "name": "add", "input": {"a": 1, "b": 2}},
        {"type": "tool_use", "id": "call_m", "name": "multiply", "input": {"a": 3, "b": 4}},
    ]
    assert [b["tool_use_id"] for b in claude[2]["content"]] == ["call_a", "call_m"]
    # a window never splits the Anthropic result message from its calls
    assert store.history("c", last=2, format="anthropic") == claude[1:]
    with pytest.raises(ValueError, match="format must be"):
        store.history("c", format="gemini")  # type: ignore[arg-type]


def test_a_custom_tool_call_is_free_text_in_every_format(store: ConversationStore) -> None:
    turn = _turn("responses", "vercel-ai__hw_custom_tool_call_free_text.sse")
    call = turn.tool_calls[0]
    assert call.custom
    store.create_conversation("c")
    store.commit_turn("c", turn, ["3 rows"])
    chat = store.history("c")
    assert chat[0]["tool_calls"] == [
        {"id": call.id, "type": "custom", "custom": {"name": call.name, "input": call.arguments}}
    ]
    assert store.history("c", format="responses")[-1] == {
        "type": "custom_tool_call_output",
        "call_id": call.id,
        "output": "3 rows",
    }
    claude = store.history("c", format="anthropic")
    assert claude[0]["content"][-1]["input"] == {"input": call.arguments}
    _validate("anthropic", claude)
    # the audit lists it with its format; the integrity check accepts its free text
    rows = list(tool_calls(store.engine, format="responses"))
    assert [(r.call_id, r.format, r.arguments) for r in rows] == [
        (call.id, "responses", call.arguments)
    ]
    assert list(check(store.engine)) == []
    # a function call with the same free text is broken, and fsm audit check says so
    with store.engine.begin() as conn:
        if store.engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA ignore_check_constraints = ON")
            conn.execute(sa.text("UPDATE fsm_tool_calls SET type = 'function'"))
            conn.exec_driver_sql("PRAGMA ignore_check_constraints = OFF")
        else:
            conn.execute(
                sa.text("ALTER TABLE fsm_tool_calls DROP CONSTRAINT ck_fsm_tool_calls_arguments")
            )
            conn.execute(sa.text("UPDATE fsm_tool_calls SET type = 'function'"))
    try:
        found = list(check(store.engine))
    finally:
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE fsm_tool_calls SET type = 'custom'"))
            if store.engine.dialect.name == "postgresql":  # the schema is shared: restore it
                conn.execute(
                    sa.text(
                        "ALTER TABLE fsm_tool_calls ADD CONSTRAINT ck_fsm_tool_calls_arguments"
                        f" CHECK ({PG_CALL_ARGUMENTS_CHECK})"
                    )
                )
    # on both engines by its rule (SQLite's quick_check, which runs the checks on the store's
    # engine, finds the row too: no damage to the file, so no "corrupt")
    assert "invalid_arguments" in [v.kind for v in found], found
    assert "corrupt" not in [v.kind for v in found], found
    assert list(check(store.engine)) == []


def test_audit_lists_and_filters_calls_of_every_format(store: ConversationStore) -> None:
    store.create_conversation("chat")
    store.commit_turn("chat", make_turn([("call_1", "f", "{}")]), ["r"])
    for fmt, name in (
        ("responses", "fantasy__openai-gpt-4o_single_call.sse"),
        ("anthropic", "fantasy__claude-sonnet-4_text_then_single_call.sse"),
    ):
        store.create_conversation(fmt)
        store.commit_turn(fmt, _turn(fmt, name), ["r"])
    everything = {(r.conversation_id, r.format) for r in tool_calls(store.engine)}
    assert everything == {("chat", "chat"), ("responses", "responses"), ("anthropic", "anthropic")}
    for fmt in ("chat", "responses", "anthropic"):
        assert [r.conversation_id for r in tool_calls(store.engine, format=fmt)] == [fmt]
    # an attempt keeps its stream's format
    parser = StreamParser()
    data = _recording(
        "anthropic", "anthropic-sdk-python__claude-3-7-sonnet_max_tokens_mid_call.sse"
    )
    parser.receive_data(data.read_bytes())
    parser.receive_eof()
    store.record_attempt("anthropic", parser.result())
    failed = list(tool_calls(store.engine, source="attempts", format="anthropic"))
    assert [r.state for r in failed] == [c.state.value for c in parser.result().turns[0].tool_calls]
    assert failed[0].state != "finished"


# -- the database checks the new columns ---------------------------------------------------------
def _insert(conn: sa.Connection, table: str, row: dict[str, Any]) -> None:
    columns = ", ".join(row)
    values = ", ".join(f":{k}" for k in row)
    conn.execute(sa.text(f"INSERT INTO {table} ({columns}) VALUES ({values})"), row)


@pytest.fixture
def seeded(store: ConversationStore) -> Iterator[ConversationStore]:
    store.create_conversation("c")
    store.append("c", [{"role": "user", "content": "hi"}])
    yield store


def _assistant(seq: int, **values: Any) -> dict[str, Any]:
    row = {**user_row("c", seq), "role": "assistant", "content": "x"}
    row.update(values)
    return row


@pytest.mark.parametrize(
    ("rows", "constraint"),
    [
        ([("fsm_messages", _assistant(1, format="gemini"))], "ck_fsm_messages_format"),
        ([("fsm_messages", {**user_row("c", 1), "format": "chat"})], "ck_fsm_messages_format"),
        (
            [("fsm_messages", {**user_row("c", 1), "provider_items": "[]"})],
            "ck_fsm_messages_format",
        ),
        (
            [
                (
                    "fsm_messages",
                    {**_assistant(1), "n_calls": 1, "slots_left": 1, "block_end_seq": 2},
                ),
                ("fsm_tool_calls", {**call_row("c", 1, 0, 1, "p"), "arguments": "SELECT 1"}),
                ("fsm_messages", result_row("c", 2, 1, 0, 1, "p")),
            ],
            "ck_fsm_tool_calls_arguments",
        ),
    ],
    ids=["unknown_format", "format_on_a_user_row", "items_on_a_user_row", "free_text_function"],
)
def test_raw_sql_breaking_the_format_columns_is_rejected(
    seeded: ConversationStore, rows: list[tuple[str, dict[str, Any]]], constraint: str
) -> None:
    with pytest.raises(sa.exc.IntegrityError) as caught, seeded.engine.begin() as conn:
        for table, row in rows:
            _insert(conn, table, row)
    assert constraint in str(caught.value.orig)


def test_raw_sql_within_the_format_columns_is_accepted(seeded: ConversationStore) -> None:
    with seeded.engine.begin() as conn:
        _insert(
            conn,
            "fsm_messages",
            {
                **_assistant(1),
                "n_calls": 1,
                "slots_left": 1,
                "block_end_seq": 2,
                "format": "responses",
                "provider_items": json.dumps([{"type": "custom_tool_call", CALL_REF: 0}]),
            },
        )
        _insert(
            conn,
            "fsm_tool_calls",
            {**call_row("c", 1, 0, 1, "p"), "type": "custom", "arguments": "SELECT 1"},
        )
        _insert(conn, "fsm_messages", result_row("c", 2, 1, 0, 1, "p"))
    assert seeded.history("c", format="responses")[1:] == [
        {"type": "custom_tool_call", "call_id": "p", "name": "f", "input": "SELECT 1"},
        {"type": "custom_tool_call_output", "call_id": "p", "output": "result"},
    ]


def test_sqlite_pins_the_types_of_the_format_columns(seeded: ConversationStore) -> None:
    if seeded.engine.dialect.name != "sqlite":
        pytest.skip("PostgreSQL's column types refuse the value")
    for values, constraint in (
        ({"format": 5}, "ck_fsm_messages_format"),
        ({"provider_items": "not json"}, "ck_fsm_messages_format_types"),
    ):
        with pytest.raises(sa.exc.IntegrityError, match=constraint), seeded.engine.begin() as conn:
            _insert(conn, "fsm_messages", _assistant(1, **values))


def test_the_async_store_renders_the_same_history(db_url: sa.URL) -> None:
    turn = _turn("anthropic", "fantasy__claude-sonnet-4_text_then_parallel_two_calls.sse")
    with ConversationStore(db_url) as sync:
        sync.create_conversation("c")
        sync.commit_turn("c", turn, ["1", "2"])
        want = sync.history("c", format="anthropic")

    async def read() -> list[Any]:
        async with AsyncConversationStore(db_url.render_as_string(hide_password=False)) as store:
            return list(await store.history("c", format="anthropic"))

    assert asyncio.run(read()) == want
    assert want == turn.to_anthropic(["1", "2"])
