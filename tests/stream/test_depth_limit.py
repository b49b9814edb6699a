"""One nesting limit, end to end (issue 26, findings 2 and 3).

``fsm.jsonutil.MAX_JSON_DEPTH`` (512) bounds every JSON value fsm keeps: a call's arguments, a
provider item kept verbatim (Responses output item, Anthropic content block), and metadata. A
value at the limit parses, commits and reads back on both engines; one level more is refused
where it enters, with a typed outcome (a call ``aborted`` / ``limit:max_json_depth``, a stream
ended ``limit:max_json_depth``, or :class:`UnsupportedValueError` before any write), never a
``RecursionError`` and never after a tool ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm import StreamParser
from fsm.jsonutil import MAX_JSON_DEPTH, copy_json, json_depth
from fsm.parser import Limits, ParseResult
from fsm.store import ConversationStore
from fsm.store.errors import UnsupportedValueError

DEEP = "@@DEEP@@"


def deep_text(depth: int) -> str:
    """JSON text of ``depth`` nested objects (``{"a": {"a": ... {}}}``), built as text."""
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def deep_value(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def sse(events: list[dict[str, Any]], deep: int = 0) -> bytes:
    """SSE text of ``events``; the string ``DEEP`` anywhere is replaced by ``deep`` nested
    objects (written as text: the standard library could not encode them)."""
    out = []
    for event in events:
        data = json.dumps(event).replace(f'"{DEEP}"', deep_text(deep))
        out.append(f"event: {event['type']}\ndata: {data}\n\n")
    return "".join(out).encode()


def anthropic_stream(block_extra: dict[str, Any], *, in_message_start: bool = False) -> list[Any]:
    """A tool_use call, then a server_tool_use block with ``block_extra`` fields."""
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}
    server = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
    server.update(block_extra)
    if in_message_start:
        start = {"id": "msg_1", "model": "claude", "content": [tool_use, server]}
        return [
            {"type": "message_start", "message": dict(start, stop_reason="tool_use")},
            {"type": "message_stop"},
        ]
    return [
        {"type": "message_start", "message": {"id": "msg_1", "model": "claude", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": tool_use},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"a": 1}'}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": server},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"},
    ]  # fmt: skip


def anthropic_whole_input(*, in_message_start: bool) -> list[Any]:
    """A programmatic tool_use whose whole input is ``{"x": DEEP}``."""
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"x": DEEP}}
    if in_message_start:
        message = {"id": "m", "model": "c", "content": [tool_use], "stop_reason": "tool_use"}
        return [{"type": "message_start", "message": message}, {"type": "message_stop"}]
    return [
        {"type": "message_start", "message": {"id": "m", "model": "c", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": tool_use},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"},
    ]


def responses_stream(extra: dict[str, Any], *, at: str) -> list[Any]:
    """A function_call item with ``extra`` fields at ``output_item.added`` or ``.done``."""
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add",
            "arguments": ""}  # fmt: skip
    added = dict(item, **extra) if at == "added" else item
    done = dict(item, arguments='{"a": 1}', **(extra if at == "done" else {}))
    return [
        {"type": "response.created", "response": {"id": "resp_1", "model": "gpt"}},
        {"type": "response.output_item.added", "output_index": 0, "item": added},
        {"type": "response.output_item.done", "output_index": 0, "item": done},
        {"type": "response.completed", "response": {"id": "resp_1", "model": "gpt"}},
    ]


def parse(data: bytes, limits: Limits | None = None) -> ParseResult:
    parser = StreamParser(limits=limits)
    parser.receive_data(data)
    parser.receive_eof()
    return parser.result()


# -- the helpers -------------------------------------------------------------------------------
def test_json_depth_counts_the_value_itself_and_stops_early() -> None:
    assert json_depth(1) == 0
    assert json_depth({"a": []}) == 2
    assert json_depth(deep_value(512)) == 512
    assert json_depth(deep_value(5000), 512) == 513
    copied = copy_json(deep_value(3000))
    assert json_depth(copied, 5000) == 3000


# -- finding 3: the Anthropic parser never raises RecursionError --------------------------------
@pytest.mark.parametrize("in_message_start", [False, True], ids=["block_start", "message_start"])
@pytest.mark.parametrize("depth", [600, 1000])
def test_anthropic_deep_whole_input_ends_the_call_at_the_limit(
    in_message_start: bool, depth: int
) -> None:
    result = parse(sse(anthropic_whole_input(in_message_start=in_message_start), depth))
    (call,) = result.turns[0].tool_calls
    assert (call.state.value, call.reason) == ("aborted", "limit:max_json_depth")
    assert not result.turns[0].complete
    assert result.turns[0].output_items()  # renders, no RecursionError


@pytest.mark.parametrize("in_message_start", [False, True], ids=["block_start", "message_start"])
def test_anthropic_whole_input_at_the_limit_is_the_arguments(in_message_start: bool) -> None:
    # {"x": DEEP} is one level more than DEEP: the arguments are exactly 512 deep
    result = parse(sse(anthropic_whole_input(in_message_start=in_message_start), 511))
    (call,) = result.turns[0].tool_calls
    assert call.state.value == "finished"
    assert json_depth(orjson.loads(call.arguments), 1000) == MAX_JSON_DEPTH
    assert result.turns[0].to_anthropic()[0]["content"][0]["input"] == {"x": deep_value(511)}


@pytest.mark.parametrize(
    ("stream", "kept"),
    [
        pytest.param(lambda: anthropic_stream({"extra": DEEP}), MAX_JSON_DEPTH, id="anthropic"),
        pytest.param(
            lambda: anthropic_stream({"extra": DEEP}, in_message_start=True),
            MAX_JSON_DEPTH,
            id="anthropic-message_start",
        ),
        # the item at output_item.done replaces the one added (which was checked all the same)
        pytest.param(
            lambda: responses_stream({"extra": DEEP}, at="added"), 1, id="responses-added"
        ),
        pytest.param(
            lambda: responses_stream({"extra": DEEP}, at="done"),
            MAX_JSON_DEPTH,
            id="responses-done",
        ),
    ],
)
def test_a_provider_item_one_level_too_deep_ends_the_stream(stream: Any, kept: int) -> None:
    # the item is {..., "extra": DEEP}: one level more than DEEP
    at_limit = parse(sse(stream(), MAX_JSON_DEPTH - 1))
    assert at_limit.turns[0].complete
    items = at_limit.turns[0].output_items()
    assert max(json_depth(item, 1000) for item in items) == kept
    past = parse(sse(stream(), MAX_JSON_DEPTH))
    assert past.end_reason == "limit:max_json_depth"
    assert not past.turns[0].complete
    past.turns[0].output_items()  # renders, no RecursionError


def test_the_item_depth_follows_a_lowered_limit() -> None:
    stream = responses_stream({"extra": DEEP}, at="done")
    assert parse(sse(stream, 9), Limits(max_json_depth=10)).turns[0].complete
    result = parse(sse(stream, 10), Limits(max_json_depth=10))
    assert result.end_reason == "limit:max_json_depth"


# -- finding 2: whatever the parser accepts commits and reads back, on both engines -----------
@pytest.mark.parametrize("fmt", ["anthropic", "responses"])
def test_an_item_at_the_limit_commits_and_reads_back(store: ConversationStore, fmt: str) -> None:
    if fmt == "anthropic":
        events = anthropic_stream({"extra": DEEP})
    else:
        events = responses_stream({"extra": DEEP}, at="done")
    result = parse(sse(events, MAX_JSON_DEPTH - 1))
    turn = result.turns[0]
    assert turn.complete
    store.create_conversation("c")
    store.commit_turn("c", result, ["3"])
    history = store.history("c", format=fmt)  # type: ignore[arg-type]
    kept = history[0]["content"][1] if fmt == "anthropic" else history[0]
    assert kept["extra"] == deep_value(MAX_JSON_DEPTH - 1)
    assert store.history("c", format="chat")[0]["tool_calls"][0]["id"] in ("toolu_1", "call_1")


def test_arguments_at_the_limit_commit_and_render_for_anthropic(store: ConversationStore) -> None:
    result = parse(sse(anthropic_whole_input(in_message_start=False), MAX_JSON_DEPTH - 1))
    store.create_conversation("c")
    store.commit_turn("c", result, ["ok"])
    (assistant, _results) = store.history("c", format="anthropic")
    assert assistant["content"][0]["input"] == {"x": deep_value(MAX_JSON_DEPTH - 1)}


def test_metadata_at_the_limit_commits_and_one_more_is_refused(store: ConversationStore) -> None:
    # the metadata mapping is the value: {"k": DEEP(511)} is 512 deep
    store.create_conversation("ok", metadata={"k": deep_value(MAX_JSON_DEPTH - 1)})
    (info,) = [c for c in store.list_conversations() if c.id == "ok"]
    assert info.metadata == {"k": deep_value(MAX_JSON_DEPTH - 1)}
    with pytest.raises(UnsupportedValueError, match="nested deeper than 512"):
        store.create_conversation("no", metadata={"k": deep_value(MAX_JSON_DEPTH)})
    assert [c.id for c in store.list_conversations()] == ["ok"]


def test_metadata_505_deep_with_strings_to_mark_commits(store: ConversationStore) -> None:
    # the codec walks the value (U+0000 is stored marked): iteratively, at any depth
    value: Any = "a\x00b"
    for _ in range(504):
        value = {"k\x00": value}
    store.create_conversation("c", metadata={"m": value})
    (info,) = store.list_conversations()
    assert info.metadata == {"m": value}


# -- through the agent loop: a turn past the limit never runs its tools -------------------------
def _deep_demo(tmp_path: Path, depth: int) -> Path:
    """The Responses demo stream with its reasoning item given a field ``depth - 1`` deep (the
    item is then ``depth`` deep)."""
    from fsm.replay import EXAMPLES_DIR

    data = (EXAMPLES_DIR / "responses_add_multiply.sse").read_text()
    head, sep, rest = data.partition('"type":"response.output_item.done","output_index":0,')
    assert sep
    rest = rest.replace(
        '"type":"reasoning",', f'"type":"reasoning","extra":{deep_text(depth - 1)},', 1
    )
    path = tmp_path / f"deep{depth}.sse"
    path.write_text(head + sep + rest)
    return path


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1])
def test_the_agent_loop_commits_at_the_limit_and_runs_nothing_past_it(
    store: ConversationStore, tmp_path: Path, depth: int
) -> None:
    import openai

    from fsm.agent import run_agent_loop
    from fsm.agent.errors import AgentError
    from fsm.replay import EXAMPLES_DIR, ReplayServer, ReplayTurn

    ran: list[str] = []

    def add(a: int, b: int) -> int:
        """Add."""
        ran.append("add")
        return a + b

    def multiply(a: int, b: int) -> int:
        """Multiply."""
        ran.append("multiply")
        return a * b

    turns = [
        ReplayTurn(_deep_demo(tmp_path, depth)),
        ReplayTurn(EXAMPLES_DIR / "responses_final_answer.sse"),
    ]
    user = {"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}
    with ReplayServer(turns) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)

        def run() -> Any:
            return run_agent_loop(
                client, store, "c", {"add": add, "multiply": multiply}, model="m",
                messages=[user], format="responses",
            )  # fmt: skip

        if depth <= MAX_JSON_DEPTH:
            result = run()
            assert result.status == "completed"
            assert ran == ["add", "multiply"]
            (reasoning,) = [
                i for i in store.history("c", format="responses") if i.get("type") == "reasoning"
            ]
            assert json_depth(reasoning, 1000) == MAX_JSON_DEPTH
        else:
            with pytest.raises(AgentError) as caught:
                run()
            assert ran == []  # the tools never ran: the turn ended at the parser's limit
            assert "max_json_depth" in str(caught.value)
