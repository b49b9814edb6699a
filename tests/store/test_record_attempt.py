"""``record_attempt`` never fails for a failed turn it is given (spec/store.md, round 2): the audit
trail of a failure is the last thing that may be lost. Hostile text is kept byte-exact on both
engines; JSON values no engine stores as they are become strings; ``results`` and ``error`` of a
commit that failed after the tools ran are kept with the attempt (sync and async stores)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fsm import parse
from fsm.parser import Anomaly, ParseResult, Turn
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.store.models import Attempt, AttemptCall
from tests.helpers.store import make_turn

HOSTILE_TEXTS = [
    "nul \x00 inside",
    "\x00",
    "lone \ud83d high",
    "lone \udfff low",
    "\ufdd0 starts with the mark",
    "back\\slash \\0 \\u0041 like an escape",
    "emoji \U0001f600 and accents \u00e9",
]


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-x",
        "model": "m",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }


def truncated_turn(name: str = "get_weather", call_id: str = "call_1") -> ParseResult:
    """A stream cut inside a call's arguments (the call ends ``truncated``)."""
    header = {"index": 0, "id": call_id, "type": "function", "function": {"name": name}}
    return parse(
        [
            _chunk({"role": "assistant", "content": "hi"}),
            _chunk({"tool_calls": [header]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]}),
        ]
    )


def hostile(result: ParseResult, text: str) -> ParseResult:
    """The parsed result with every text the store keeps replaced by ``text``-laden values and
    JSON values no engine stores as they are (as a caller's own Turn objects may hold)."""
    turn = result.turns[0]
    for call in turn.tool_calls:
        call.name = f"name {text}"
        call.id = f"id {text}"
        call.reason = f"reason {text}" + "r" * (10 * 1024 * 1024)  # a 10 MB provider message
    deep: Any = "leaf"
    for _ in range(200):
        deep = {"deeper": [deep]}
    usage = {
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "huge": 10**5000,
        "big": 2**64,
        "deep": deep,
        7: "int key",
        "text": text,
    }
    turn._meta.usage = usage
    result.usage = usage
    result.anomalies.append(Anomaly(kind=f"kind {text}", detail=f"detail {text}", choice=0))
    result.end_reason = f"end {text}"
    return result


@pytest.mark.parametrize("text", HOSTILE_TEXTS, ids=range(len(HOSTILE_TEXTS)))
def test_record_attempt_keeps_hostile_values(store: ConversationStore, text: str) -> None:
    cid = store.create_conversation()
    result = hostile(truncated_turn(), text)
    [attempt_id] = store.record_attempt(
        cid,
        result,
        results=[{"content": f"result {text}"}],
        error=f"commit failed: {text}",
    )
    [attempt] = store.attempts(cid)
    assert attempt["id"] == attempt_id
    assert attempt["error"] == f"commit failed: {text}"
    assert attempt["end_reason"] == f"end {text}"
    [call] = attempt["tool_calls"]
    assert call["name"] == f"name {text}" and call["id"] == f"id {text}"
    assert call["reason"] == f"reason {text}" + "r" * (10 * 1024 * 1024)
    assert call["result"] == f"result {text}"
    usage = attempt["usage"]
    assert usage["nan"] == "nan" and usage["inf"] == "inf" and usage["-inf"] == "-inf"
    assert usage["huge"].startswith("0x") and usage["big"] == str(2**64)
    assert usage["text"] == text and usage["7"] == "int key"
    depth, node = 1, usage["deep"]
    while isinstance(node, dict):
        inner = node["deeper"]
        node, depth = (inner, depth) if isinstance(inner, str) else (inner[0], depth + 2)
    assert isinstance(node, str) and node.endswith("]") and "leaf" in node and depth <= 33
    kinds = [a["kind"] for a in attempt["anomalies"]]
    assert f"kind {text}" in kinds


def test_results_in_every_shape(store: ConversationStore) -> None:
    cid = store.create_conversation()
    two = parse(
        [
            _chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "a", "type": "function", "function": {"name": "f"}},
                        {"index": 1, "id": "b", "type": "function", "function": {"name": "g"}},
                    ]
                }
            ),
            _chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{"}}]}),
        ]
    )
    turn = two.turns[0]
    parts = [{"type": "text", "text": "x\x00"}]
    store.record_attempt(cid, turn, results=["only the first ran"])
    store.record_attempt(cid, turn, results={"b": {"content": parts}, "zz": "nobody's"})
    store.record_attempt(cid, turn, results=["a", "b", "a third"], error="boom")
    store.record_attempt(cid, turn, results=42)  # type: ignore[arg-type]
    first, by_id, extra, odd = store.attempts(cid)
    assert [c["result"] for c in first["tool_calls"]] == ["only the first ran", None]
    assert [c["result"] for c in by_id["tool_calls"]] == [None, parts]
    assert any(a["kind"] == "unmatched_result" and "zz" in a["detail"] for a in by_id["anomalies"])
    assert [c["result"] for c in extra["tool_calls"]] == ["a", "b"] and extra["error"] == "boom"
    assert any("a third" in a["detail"] for a in extra["anomalies"])
    assert any(a["kind"] == "unmatched_result" for a in odd["anomalies"])
    assert first["error"] is None


def test_attempt_rows_hold_the_columns(store: ConversationStore) -> None:
    """The new columns, seen through SQLAlchemy: ``attempts.error`` and
    ``attempt_calls.result`` (JSON)."""
    cid = store.create_conversation()
    [attempt_id] = store.record_attempt(cid, truncated_turn(), results=["r\ud800"], error="e\x00")
    with store.engine.connect() as conn:
        error = conn.execute(sa.select(Attempt.error).where(Attempt.id == attempt_id)).scalar()
        result = conn.execute(
            sa.select(AttemptCall.result).where(AttemptCall.attempt_id == attempt_id)
        ).scalar()
    assert error == "e\x00" and result == "r\ud800"


def test_a_bare_turn_and_an_empty_response(store: ConversationStore) -> None:
    cid = store.create_conversation()
    turn: Turn = make_turn(response_id=None)
    store.record_attempt(cid, turn, anomalies=[Anomaly("k\x00", "d\ud800")], error="\x00")
    empty = parse([])
    store.record_attempt(cid, empty, results=["no call"], error=None)
    with_turn, without = store.attempts(cid)
    assert with_turn["anomalies"][0]["kind"] == "k\x00" and with_turn["error"] == "\x00"
    assert without["choice"] is None and without["tool_calls"] == []


def test_async_record_attempt(db_url: sa.URL, tmp_path: Path) -> None:
    async def run() -> list[dict[str, Any]]:
        async with AsyncConversationStore(db_url) as store:
            cid = await store.create_conversation()
            result = hostile(truncated_turn(), "\x00\ud800")
            await store.record_attempt(cid, result, results=["r\x00"], error="e\ud83d")
            return await store.attempts(cid)

    [attempt] = asyncio.run(run())
    assert attempt["error"] == "e\ud83d"
    assert attempt["tool_calls"][0]["result"] == "r\x00"
    assert attempt["usage"]["nan"] == "nan"
