"""One predicate across the seam (spec/store.md, round 2): every turn the parser calls complete
commits on SQLite and on PostgreSQL and reads back byte-exact; every other turn is recorded as
an attempt without fail.

Turns are generated as chunk dicts and parsed by the real parser (``fsm.parse``), with hostile
values where the store's engines are weakest: U+0000, lone surrogates, a surrogate pair split
across two chunks (``"\\ud83d"`` + ``"\\ude00"``: valid input, two lone halves once decoded),
text starting with the codec's mark U+FDD0, backslashes that look like the codec's escapes,
multibyte text, ids, names, models and response ids of exactly 512 UTF-8 bytes, huge numbers
and deep JSON in arguments, and usage no engine stores as it is (NaN, 1e400 as a float,
5,000-digit integers). History is compared with ``Turn.to_message()`` and the results given;
the call rows are compared through SQLAlchemy.
"""

from __future__ import annotations

import json
import math
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm import parse
from fsm.parser import Turn
from fsm.store import ConversationStore
from fsm.store.codec import MARK
from fsm.store.models import Message, ToolCallRow

SPECIALS = [
    "\x00",
    "\ud800",
    "\udbff",
    "\udc00",
    "\udfff",
    "\ud83d",
    "\ude00",
    MARK,
    "\\",
    "\\0",
    "\\u0041",
    "\\ud83d",
    '"',
    "\u00e9",
    "\U0001f600",
    "\u2028",
    "\x7f",
    "\t",
    " ",
]
HIGH, LOW = "\ud83d", "\ude00"


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def exactly_512(unit: str) -> str:
    """Text of exactly 512 UTF-8 bytes made of ``unit`` (padded with ASCII)."""
    text = unit * (512 // _utf8(unit))
    return text + "x" * (512 - _utf8(text))


hostile_text = st.lists(
    st.one_of(st.sampled_from(SPECIALS), st.characters(), st.text(max_size=3)), max_size=12
).map("".join)
marked_text = hostile_text.map(lambda s: MARK + s)
long_key = st.sampled_from(["a", "\u00e9", "\U0001f600", "\ud83d", "\x00", MARK + "\x00"]).map(
    exactly_512
)
any_text = st.one_of(hostile_text, marked_text, long_key)
#: a name the parser calls present: at least one non-blank character
name_text = st.one_of(
    st.tuples(hostile_text, st.sampled_from(["f", "\x00", "\u00e9", HIGH, MARK])).map(
        lambda p: p[1] + p[0]
    ),
    long_key,
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    hostile_text,
    st.just(HIGH + LOW),  # a pair, split across chunks below when the split lands between
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(hostile_text, inner, max_size=3)
    ),
    max_leaves=8,
)


def _dumps(value: Any) -> str:
    """JSON text keeping raw non-ASCII, lone surrogates included (what a provider may send)."""
    return json.dumps(value, ensure_ascii=False)


@st.composite
def arguments_text(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["value", "deep", "big number", "blank", "pair"]))
    if kind == "deep":
        depth = draw(st.sampled_from([1, 64, 400]))
        return "[" * depth + _dumps(draw(json_leaf)) + "]" * depth
    if kind == "big number":
        return draw(st.sampled_from(["1" * 300, "-" + "9" * 4000, "1e400", "-1e-400", "0.0e0"]))
    if kind == "blank":
        return draw(st.sampled_from(["", " ", "\t\r\n "]))
    if kind == "pair":
        return '{"emoji": "' + HIGH + LOW + '", "' + HIGH + '": "' + LOW + '"}'
    return _dumps(draw(json_value))


@st.composite
def fragments(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut in pieces, always between the halves of a surrogate pair when there is one
    (so the pair reaches the parser in two chunks), and at drawn places."""
    cuts = {i + 1 for i in range(len(text) - 1) if text[i] == HIGH and text[i + 1] == LOW}
    cuts |= set(draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=3)))
    points = sorted(c for c in cuts if 0 < c < len(text))
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    return [p for p in pieces if p]


@st.composite
def turns(draw: st.DrawFn) -> tuple[Turn, list[Any]]:
    model = draw(any_text)
    response_id = draw(st.one_of(st.none(), any_text))
    content = draw(st.one_of(st.none(), any_text))
    n_calls = draw(st.integers(0, 3))
    usage = draw(
        st.sampled_from(
            [
                None,
                {"total_tokens": 3},
                {"prompt_tokens": math.nan},
                {"total_tokens": math.inf, "x": [1e308 * 10]},
                {"total_tokens": 10**5000},
                {"nested": {"deep": [[[[{"k": "\x00\ud800"}]]]]}},
            ]
        )
    )

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if response_id is not None:
            body["id"] = response_id
        return body

    chunks: list[dict[str, Any]] = []
    if content is not None:
        for piece in draw(fragments(content)) or [content]:
            chunks.append(chunk({"content": piece}))
    for index in range(n_calls):
        call_id = draw(st.one_of(st.just(""), any_text))
        name = draw(name_text)
        arguments = draw(arguments_text())
        header = {"index": index, "id": call_id, "type": "function", "function": {"name": name}}
        chunks.append(chunk({"tool_calls": [header]}))
        for piece in draw(fragments(arguments)):
            chunks.append(
                chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            )
    last = chunk({}, "tool_calls" if n_calls else "stop")
    if usage is not None:
        last["usage"] = usage
    chunks.append(last)
    results = [
        draw(
            st.one_of(
                any_text,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": any_text}),
                    min_size=1,
                    max_size=2,
                ).map(lambda parts: {"content": parts}),
            )
        )
        for _ in range(n_calls)
    ]
    return parse(chunks).turn(0), results


def _tool_message(call_id: str, result: Any) -> dict[str, Any]:
    content = result["content"] if isinstance(result, dict) else result
    return {"role": "tool", "tool_call_id": call_id, "content": content}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=turns())
def test_complete_turns_commit_and_read_back_byte_exact(
    store: ConversationStore, case: tuple[Turn, list[Any]]
) -> None:
    turn, results = case
    cid = store.create_conversation()
    if not turn.complete:
        # the parser said no: the turn is an attempt, and recording it never fails
        [attempt_id] = store.record_attempt(cid, turn, results=results, error="\x00\ud800")
        [attempt] = store.attempts(cid)
        assert attempt["id"] == attempt_id
        assert [c["id"] for c in attempt["tool_calls"]] == [c.id for c in turn.tool_calls]
        assert [c["arguments"] for c in attempt["tool_calls"]] == [
            c.arguments for c in turn.tool_calls
        ]
        return
    committed = store.commit_turn(cid, turn, results)
    expected = [turn.to_message()] + [
        _tool_message(call.id, result)
        for call, result in zip(turn.tool_calls, results, strict=True)
    ]
    assert committed.messages == expected
    assert store.history(cid) == expected
    assert store.history(cid, last=len(expected)) == expected
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                ToolCallRow.call_id, ToolCallRow.name, ToolCallRow.arguments, ToolCallRow.type
            )
            .where(ToolCallRow.conversation_id == cid)
            .order_by(ToolCallRow.position)
        ).all()
        message = conn.execute(
            sa.select(
                Message.model, Message.response_id, Message.finish_reason, Message.usage
            ).where(Message.conversation_id == cid, Message.seq == 0)
        ).one()
    assert [tuple(r) for r in rows] == [
        (c.id, c.name, c.arguments, c.type) for c in turn.tool_calls
    ]
    assert (message.model, message.response_id, message.finish_reason) == (
        turn.model,
        turn.response_id or None,
        turn.finish_reason,
    )
    assert message.usage is None or json.dumps(message.usage, allow_nan=False)
    # the same turn again is an idempotent retry when it has a response id
    if turn.response_id:
        again = store.commit_turn(cid, turn, results)
        assert not again.created and again.messages == expected


def test_a_split_pair_in_every_field(store: ConversationStore) -> None:
    """The finding of issue 10: a split emoji (``"\\ud83d"`` + ``"\\ude00"``) in content,
    arguments, id and name commits on both engines and reads back byte-exact: in content and
    arguments the parser joins the halves into the character; an id, a name, a model, a response
    id and a tool result keep them as sent (stored marked)."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "r" + HIGH,
            "model": "m" + LOW,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    header = {
        "index": 0,
        "id": "id" + HIGH,
        "type": "function",
        "function": {"name": "f" + HIGH + LOW},
    }
    turn = parse(
        [
            chunk({"content": "a" + HIGH}),
            chunk({"content": LOW + "b"}),
            chunk({"tool_calls": [header]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"e": "' + HIGH}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": LOW + '"}'}}]}),
            chunk({}, "tool_calls"),
        ]
    ).turn(0)
    assert turn.complete
    cid = store.create_conversation()
    store.commit_turn(cid, turn, [HIGH + "result" + LOW])
    history = store.history(cid)
    assert history == [
        turn.to_message(),
        _tool_message(turn.tool_calls[0].id, HIGH + "result" + LOW),
    ]
    assert history[0]["content"] == "a\U0001f600b"
    assert history[0]["tool_calls"][0]["function"]["arguments"] == '{"e": "\U0001f600"}'
    assert history[0]["tool_calls"][0]["function"]["name"] == "f" + HIGH + LOW
    assert history[1]["content"] == HIGH + "result" + LOW


def test_a_blank_name_is_never_complete_or_commits(store: ConversationStore) -> None:
    """The database refuses a finished call with a blank name; the parser must not call it
    complete (then it is an attempt), or the seam breaks."""
    chunks = [
        {
            "id": "r",
            "model": "m",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c",
                                "type": "function",
                                "function": {"name": " \t", "arguments": "{}"},
                            }
                        ]
                    },
                    "finish_reason": "tool_calls",
                }
            ],
        }
    ]
    turn = parse(chunks).turn(0)
    cid = store.create_conversation()
    if turn.complete:
        store.commit_turn(cid, turn, ["r"])
    else:
        store.record_attempt(cid, turn)
