"""Histories rendered for Anthropic are what the API takes (issue 26, finding 5).

Call ids such as Kimi K2's ``functions.add:0`` (and ``""``) break ``tool_use.id``'s pattern
``^[a-zA-Z0-9_-]+$``; arguments that are JSON but not objects break ``tool_use.input``. fsm keeps
the stored id as sent and renders for Anthropic by the reversible rule of
:mod:`fsm.formats.ids`; the replay server refuses what the real API refuses.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from fsm.api import parse_file
from fsm.errors import RemoteProtocolError
from fsm.formats.ids import anthropic_id, anthropic_safe, original_id
from fsm.replay import EXAMPLES_DIR, ReplayServer, ReplayTurn
from fsm.replay_formats import check_anthropic_blocks, check_anthropic_tools
from fsm.store import ConversationStore
from tests.helpers import CORPUS, require_corpus
from tests.helpers.store import make_turn

PATTERN = re.compile(r"^[a-zA-Z0-9_-]+$")
#: the corpus streams whose call ids are Kimi K2's ``functions.<name>:<n>``
KIMI = [
    "huggingface-router/hf-router-kimi-k2_content_then_parallel_calls.sse",
    "avian/avian-kimi-k2.5_reasoning_parallel_finish_twice.sse",
    "groq/groq-kimi-k2_content_then_parallel_calls.sse",
    "openrouter/openrouter-fireworks-kimi-k2_content_then_parallel.sse",
    "openrouter/openrouter-baseten-kimi-k2_id_repeated_empty_name_continuations.sse",
]
Q = {"role": "user", "content": "go"}


def assert_api_accepts(messages: list[dict[str, Any]]) -> None:
    """What the Anthropic API checks of tool blocks (the pattern written out here, so this
    fails whatever the replay server's own check says)."""
    for message in messages:
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_use":
                assert PATTERN.match(block["id"]), block["id"]
                assert isinstance(block["input"], dict), block["input"]
            elif block.get("type") == "tool_result":
                assert PATTERN.match(block["tool_use_id"]), block["tool_use_id"]
    uses = [
        b["id"]
        for m in messages
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if b.get("type") == "tool_use"
    ]
    assert len(uses) == len(set(uses)), uses
    assert check_anthropic_blocks(messages) is None
    assert check_anthropic_tools(messages) is None


# -- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call_id",
    ["toolu_01A", "call_abc-1", "functions.add:0", "", " ", "a/b", "é", "\ud83d", "fsmid_x",
     "fsmid2_eA", "x" * 512],
)  # fmt: skip
@pytest.mark.parametrize("use", [1, 2, 3, 12])
def test_ids_map_into_the_pattern_and_back(call_id: str, use: int) -> None:
    sent = anthropic_id(call_id, use)
    assert PATTERN.match(sent)
    assert original_id(sent) == call_id
    if use == 1 and PATTERN.match(call_id) and not call_id.startswith("fsmid"):
        assert sent == call_id  # what Anthropic itself sent goes back as it is


def test_distinct_ids_and_uses_never_collide() -> None:
    ids = ["", "a", "functions.add:0", "functions.add:1", "fsmid_", "fsmid_YQ"]
    sent = [anthropic_id(i, n) for i in ids for n in (1, 2, 3)]
    assert len(set(sent)) == len(sent)


@pytest.mark.parametrize("bad", ["fsmid_!!", "fsmid1_YQ", "fsmid01_YQ", "fsmid_\u00e9"])
def test_a_malformed_encoded_id_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="not an id encoded by fsm"):
        original_id(bad)


# -- real streams ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", KIMI)
def test_kimi_ids_render_for_anthropic_and_round_trip(store: ConversationStore, name: str) -> None:
    require_corpus()
    path = CORPUS / name
    result = parse_file(path)
    turns = [t for t in result.turns if t.complete and t.tool_calls]
    if not turns:
        pytest.skip(f"{name} has no complete turn with calls")
    turn = turns[0]
    ids = [c.id for c in turn.tool_calls]
    assert any(not PATTERN.match(i) for i in ids), ids  # the case of the finding
    results = [f"r{p}" for p in range(len(ids))]
    store.create_conversation("c")
    for n in range(2):  # Kimi numbers calls per turn: the same ids again in the next turn
        store.append("c", [Q])
        store.commit_turn("c", turn, results, idempotency_key=f"turn-{n}")
    chat = store.history("c")
    assert [c["id"] for c in chat[1]["tool_calls"]] == ids  # stored as sent, never rewritten
    rendered = store.history("c", format="anthropic")
    assert_api_accepts(rendered)
    assistants = [m for m in rendered if m["role"] == "assistant"]
    for assistant, answers in zip(assistants, [rendered[2], rendered[5]], strict=True):
        uses = [b["id"] for b in assistant["content"] if b["type"] == "tool_use"]
        assert [original_id(u) for u in uses] == ids
        assert [b["tool_use_id"] for b in answers["content"]] == uses  # pairs still match
    assert_api_accepts([Q, *turn.to_anthropic(results)])


def test_an_empty_id_and_repeated_ids_in_one_turn() -> None:
    turn = make_turn((("", "add", "{}"), ("", "add", "{}"), ("x.y", "mul", "{}")))
    messages = turn.to_anthropic(["1", "2", "3"])
    assert_api_accepts(messages)
    uses = [b["id"] for b in messages[0]["content"] if b["type"] == "tool_use"]
    assert [original_id(u) for u in uses] == ["", "", "x.y"]
    assert [b["tool_use_id"] for b in messages[1]["content"]] == uses


@pytest.mark.parametrize("arguments", ["[1, 2]", '"text"', "3", "null", "true"])
def test_an_input_that_is_not_an_object_is_wrapped(
    store: ConversationStore, arguments: str
) -> None:
    turn = make_turn((("call_1", "f", arguments),))
    store.create_conversation("c")
    store.append("c", [Q])
    store.commit_turn("c", turn, ["ok"])
    for messages in (store.history("c", format="anthropic"), [Q, *turn.to_anthropic(["ok"])]):
        assert_api_accepts(messages)
        (use,) = [b for b in messages[1]["content"] if b["type"] == "tool_use"]
        assert use["input"] == {"value": json.loads(arguments)}


def test_anthropic_safe_leaves_valid_histories_alone() -> None:
    messages = [
        Q,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
    ]  # fmt: skip
    assert anthropic_safe(messages) == messages


# -- the replay server refuses what the API refuses -------------------------------------------------
def _request(*messages: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "max_tokens": 64, "messages": list(messages)}


def _history(call_id: str, tool_input: Any, answer_id: str | None = None) -> list[Any]:
    return [
        Q,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": call_id, "name": "add", "input": tool_input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": answer_id or call_id, "content": "3"}]},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("history", "message"),
    [
        (_history("functions.add:0", {}), "tool_use.id: String should match pattern"),
        (_history("", {}), "tool_use.id: String should match pattern"),
        (_history("toolu_1", [1, 2]), "tool_use.input: Input should be a valid dictionary"),
        (_history("toolu_1", "x"), "tool_use.input: Input should be a valid dictionary"),
        (_history("toolu_1", None), "tool_use.input: Input should be a valid dictionary"),
        pytest.param(
            _history("toolu_1", {}, "functions.add:0"),
            "tool_result.tool_use_id: String should match pattern",
            id="a-result-for-no-call",
        ),
        (
            [*_history("toolu_1", {}), *_history("toolu_1", {})[1:]],
            "`tool_use` ids must be unique",
        ),
    ],
)
def test_the_replay_server_refuses_what_the_api_refuses(history: list[Any], message: str) -> None:
    with ReplayServer([ReplayTurn(EXAMPLES_DIR / "anthropic_final_answer.sse")]) as server:
        refused = httpx.post(server.url + "/v1/messages", json=_request(*history), timeout=10)
        assert refused.status_code == 400
        body = refused.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert message in body["error"]["message"]
        if "functions.add:0" in str(history[2]) and "functions" not in str(history[1]):
            return  # a result that answers no call: refused however it is written
        # the same history as fsm renders it is taken
        taken = httpx.post(
            server.url + "/v1/messages", json=_request(*anthropic_safe(history)), timeout=10
        )
        assert taken.is_success, taken.text


def test_every_corpus_turn_renders_for_anthropic() -> None:
    """Every complete turn with calls of the three corpora, whatever its ids (the streams of
    the finding and any other), renders as the API takes it, and its ids round-trip."""
    require_corpus()
    shared = CORPUS.parent
    breaking = []
    for path in sorted(
        p
        for d in ("corpus", "corpus-responses", "corpus-anthropic")
        for p in (shared / d).rglob("*.sse")
    ):
        try:
            result = parse_file(path)
        except RemoteProtocolError:  # a stream the parser refuses has nothing to render
            continue
        for turn in result.turns:
            if not (turn.complete and turn.tool_calls):
                continue
            ids = [c.id for c in turn.tool_calls]
            if any(not PATTERN.match(i) for i in ids) or len(set(ids)) < len(ids):
                breaking.append(path.name)
            messages = [Q, *turn.to_anthropic([f"r{p}" for p in range(len(ids))])]
            assert_api_accepts(messages)
            uses = [b["id"] for b in messages[1]["content"] if b["type"] == "tool_use"]
            assert [original_id(u) for u in uses] == ids, path
    assert len(breaking) >= 5, breaking  # the Kimi K2 streams of the finding, at least
