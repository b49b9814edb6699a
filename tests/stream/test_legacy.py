"""Legacy ``delta.function_call`` (spec "Rules added in round 2", first bullet): one call of its
choice, id ``""``, ``legacy=True``, merged and ended like any call, rendered and stored in the
legacy shape."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from typing import Any

import pytest

import fsm
from fsm.errors import RemoteProtocolError
from fsm.events import ToolCallArgumentsDelta, ToolCallFinished, ToolCallOpened, ToolCallUpdated
from fsm.parser import StreamParser
from fsm.states import ToolCallState
from fsm.store import ConversationStore
from fsm.toolcall import result_message
from tests.helpers import bytewise, chunk, cut, repo_env, sse, tc

ARGS = '{"location": "Paris", "unit": "celsius"}'


def fc(name: str | None = None, arguments: str | None = None) -> dict[str, Any]:
    """A chunk whose delta carries a legacy ``function_call``."""
    call: dict[str, Any] = {}
    if name is not None:
        call["name"] = name
    if arguments is not None:
        call["arguments"] = arguments
    return chunk(function_call=call)


def legacy_stream(finish: str = "function_call", *, repeat_name: bool = False) -> bytes:
    """A functions-API stream: role, the name, the arguments in pieces, the finish."""
    pieces = [ARGS[i : i + 5] for i in range(0, len(ARGS), 5)]
    chunks = [chunk(role="assistant", content=None), fc("get_", ""), fc("weather")]
    chunks += [fc("get_weather" if repeat_name else None, p) for p in pieces]
    return sse(*chunks, chunk(finish=finish))


def parse_pieces(pieces: list[bytes]) -> fsm.ParseResult:
    parser = StreamParser()
    for piece in pieces:
        parser.receive_data(piece)
    parser.receive_eof()
    return parser.result()


def test_a_legacy_call_is_one_finished_call_with_an_empty_id() -> None:
    result = fsm.parse(legacy_stream())
    turn = result.turn(0)
    assert turn.complete and turn.finish_reason == "function_call"
    (call,) = turn.tool_calls
    assert call.legacy and turn.legacy_call is call
    assert (call.id, call.index, call.name, call.arguments) == ("", None, "get_weather", ARGS)
    assert call.state is ToolCallState.FINISHED
    assert turn.to_message() == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "get_weather", "arguments": ARGS},
    }
    assert result_message(call, "18") == {
        "role": "function",
        "name": "get_weather",
        "content": "18",
    }


def test_a_repeated_name_is_not_doubled() -> None:
    call = fsm.parse(legacy_stream(repeat_name=True)).turn(0).tool_calls[0]
    assert (call.name, call.arguments) == ("get_weather", ARGS)


def test_events_of_a_legacy_call() -> None:
    events: list[Any] = []
    fsm.parse(legacy_stream(), on_event=events.append)
    opened = [e for e in events if isinstance(e, ToolCallOpened)]
    assert [(e.id, e.index, e.name) for e in opened] == [("", None, "get_")]
    assert [e.name for e in events if isinstance(e, ToolCallUpdated)] == ["get_weather"]
    assert "".join(e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)) == ARGS
    (done,) = [e for e in events if isinstance(e, ToolCallFinished)]
    assert (done.id, done.name, done.arguments) == ("", "get_weather", ARGS)


@pytest.mark.parametrize(
    ("finish", "state", "complete"),
    [
        ("function_call", ToolCallState.FINISHED, True),
        ("stop", ToolCallState.FINISHED, True),
        ("tool_calls", ToolCallState.FINISHED, True),
        ("length", ToolCallState.TRUNCATED, False),
        ("content_filter", ToolCallState.ABORTED, False),
    ],
)
def test_the_same_ending_table(finish: str, state: ToolCallState, complete: bool) -> None:
    turn = fsm.parse(legacy_stream(finish)).turn(0)
    assert (turn.tool_calls[0].state, turn.complete) == (state, complete)


def test_cut_arguments_and_eof_are_never_complete() -> None:
    data = sse(fc("get_weather", '{"location": "Par'), chunk(finish="function_call"))
    call = fsm.parse(data).turn(0).tool_calls[0]
    assert call.state is ToolCallState.TRUNCATED
    cut_off = fsm.parse(sse(fc("get_weather", ARGS), done=False))
    assert not cut_off.complete
    assert cut_off.turn(0).tool_calls[0].state is ToolCallState.ABORTED


def test_a_blank_name_is_missing() -> None:
    turn = fsm.parse(sse(fc("  ", ARGS), chunk(finish="function_call"))).turn(0)
    assert (turn.tool_calls[0].state, turn.tool_calls[0].reason) == (
        ToolCallState.ABORTED,
        "missing_name",
    )


def test_an_empty_function_call_opens_nothing() -> None:
    turn = fsm.parse(sse(chunk(content="hi", function_call={}), chunk(finish="stop"))).turn(0)
    assert turn.complete and turn.tool_calls == [] and turn.legacy_call is None
    assert turn.to_message() == {"role": "assistant", "content": "hi"}


@pytest.mark.parametrize(
    "chunks",
    [
        [fc("f", "{}"), chunk(tc(0, "call_1", "g", "{}"))],  # function_call, then tool_calls
        [chunk(tc(0, "call_1", "g", "{}")), fc("f", "{}")],  # tool_calls, then function_call
        [chunk(tc(0, "call_1", "g", "{}"), function_call={"name": "f"})],  # in one delta
        [fc("f", "{}"), chunk(tc(args="x"))],  # a continuation with no index, id or name
    ],
)
def test_mixing_function_call_and_tool_calls_is_a_protocol_error(
    chunks: list[dict[str, Any]],
) -> None:
    with pytest.raises(RemoteProtocolError, match="cannot mix"):
        fsm.parse(sse(*chunks, chunk(finish="stop")))


@pytest.mark.parametrize(
    ("function_call", "path"),
    [
        ("get_weather", "choices[0].delta.function_call"),
        ({"name": 5}, "choices[0].delta.function_call.name"),
        ({"name": "f", "arguments": {"a": 1}}, "choices[0].delta.function_call.arguments"),
    ],
)
def test_wrong_types_say_where(function_call: Any, path: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        fsm.parse(sse(chunk(function_call=function_call)))
    assert info.value.path == path


def test_another_choice_may_use_tool_calls() -> None:
    first = fc("get_weather", ARGS)
    other = chunk(tc(0, "call_1", "g", "{}"), choice=1)
    result = fsm.parse(
        sse(first, other, chunk(finish="function_call"), chunk(finish="tool_calls", choice=1))
    )
    assert result.complete
    assert result.turn(0).tool_calls[0].legacy
    assert not result.turn(1).tool_calls[0].legacy


def test_limits_hold_for_a_legacy_call() -> None:
    parser = StreamParser(limits=fsm.Limits(max_argument_bytes=8))
    parser.receive_data(sse(fc("f", '{"a": 1234567}'), chunk(finish="function_call")))
    parser.receive_eof()
    call = parser.result().turn(0).tool_calls[0]
    assert (call.state, call.reason) == (ToolCallState.ABORTED, "limit:max_argument_bytes")


def _summary(result: fsm.ParseResult) -> Any:
    return json.dumps(result.to_json(), sort_keys=True)


def test_byte_by_byte_and_random_splits_give_the_same_result() -> None:
    data = legacy_stream(repeat_name=True).replace(b"\n\n", b"\r\n\r\n")
    whole = _summary(fsm.parse(data))
    assert _summary(parse_pieces(bytewise(data))) == whole
    rnd = random.Random(1105)
    for _ in range(200):
        points = [rnd.randrange(len(data) + 1) for _ in range(rnd.randrange(1, 12))]
        assert _summary(parse_pieces(cut(data, points))) == whole, points


def test_fsm_parse_json_shows_the_legacy_call(tmp_path: Any) -> None:
    path = tmp_path / "legacy.sse"
    path.write_bytes(legacy_stream())
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "parse", "--json", str(path)],
        capture_output=True,
        env=repo_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (choice,) = json.loads(proc.stdout)["choices"]
    assert choice["complete"] is True and choice["finish_reason"] == "function_call"
    assert choice["tool_calls"] == [
        {
            "position": 0, "index": None, "id": "", "type": "function", "name": "get_weather",
            "arguments": ARGS, "state": "finished", "reason": None, "repaired": False,
            "legacy": True,
        }
    ]  # fmt: skip


def test_the_store_keeps_a_legacy_turn_and_gives_it_back(store: ConversationStore) -> None:
    conversation = store.create_conversation()
    user = {"role": "user", "content": "Weather in Paris?"}
    store.append(conversation, [user])
    turn = fsm.parse(legacy_stream()).turn(0)
    committed = store.commit_turn(conversation, turn, ["18 degrees"])
    function_result = {"role": "function", "name": "get_weather", "content": "18 degrees"}
    assert committed.messages == [turn.to_message(), function_result]
    store.append(conversation, [{"role": "user", "content": "And tomorrow?"}])
    modern = fsm.parse(
        sse(
            chunk(tc(0, "call_9", "get_weather", ARGS)) | {"id": "chatcmpl-2"},
            chunk(finish="tool_calls") | {"id": "chatcmpl-2"},
        )
    ).turn(0)
    store.commit_turn(conversation, modern, ["17 degrees"])
    history = store.history(conversation)
    assert history == [
        user,
        turn.to_message(),
        function_result,
        {"role": "user", "content": "And tomorrow?"},
        modern.to_message(),
        {"role": "tool", "tool_call_id": "call_9", "content": "17 degrees"},
    ]
    assert store.history(conversation, last=5) == history[1:]
    # never inside a block: the smallest window of at least N messages that keeps blocks whole
    assert store.history(conversation, last=4) == history[1:]
    assert store.history(conversation, last=3) == history[3:]
    # the same turn again is the same commit (idempotency), not a second one
    assert store.commit_turn(conversation, turn, ["18 degrees"]).created is False


def test_the_async_store_gives_the_legacy_shape_back(db_url: Any) -> None:
    from fsm.store.aio import AsyncConversationStore

    turn = fsm.parse(legacy_stream()).turn(0)

    async def run() -> list[dict[str, Any]]:
        async with AsyncConversationStore(db_url) as store:
            conversation = await store.create_conversation()
            await store.append(conversation, [{"role": "user", "content": "Weather?"}])
            await store.commit_turn(conversation, turn, ["18"])
            return await store.history(conversation)

    assert asyncio.run(run()) == [
        {"role": "user", "content": "Weather?"},
        turn.to_message(),
        {"role": "function", "name": "get_weather", "content": "18"},
    ]


def test_a_function_result_naming_another_function_is_corrupt(store: ConversationStore) -> None:
    import sqlalchemy as sa

    from fsm.store.errors import CorruptStoreError

    conversation = store.create_conversation()
    store.append(conversation, [{"role": "user", "content": "Weather?"}])
    store.commit_turn(conversation, fsm.parse(legacy_stream()).turn(0), ["18"])
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE fsm_messages SET name = 'other' WHERE conversation_id = :c AND seq = 2"
            ),
            {"c": conversation},
        )
    with pytest.raises(CorruptStoreError, match="answers function 'other'"):
        store.history(conversation)


def test_fsm_history_prints_a_legacy_turn(store: ConversationStore) -> None:
    conversation = store.create_conversation()
    store.commit_turn(conversation, fsm.parse(legacy_stream()).turn(0), ["18 degrees"])
    url = store.engine.url.render_as_string(hide_password=False)
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "history", "--db", url, conversation],
        capture_output=True,
        text=True,
        env=repo_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "    0  assistant  (no text)",
        f"{'':18}-> get_weather({ARGS})  (legacy function_call)",
        "    1  function   18 degrees  (result of function get_weather)",
    ]
