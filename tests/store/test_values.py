"""Values at the store's edges: keys that must stay clean text, key lengths, JSON that no engine
stores as it is, and driver errors that never escape untyped (issue 10, items 3 and 4)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import (
    ConversationStore,
    InvalidConversationIdError,
    InvalidIdempotencyKeyError,
    InvalidMessageError,
    ResultsError,
    StoreError,
    UnsupportedValueError,
    ValueRejectedError,
)
from fsm.store.migrate import upgrade
from fsm.store.store import MAX_KEY_BYTES
from tests.helpers.store import dump, make_turn


@pytest.fixture
def conv(store: ConversationStore) -> str:
    return store.create_conversation("conv-values")


BAD_KEYS = [
    ("nul", "key\x00"),
    ("lone surrogate", "key\ud800"),
    ("mark", "\ufdd0key"),
    ("too long", "k" * (MAX_KEY_BYTES + 1)),
    ("too long in UTF-8", "\u00e9" * (MAX_KEY_BYTES // 2 + 1)),
]


@pytest.mark.parametrize(("label", "key"), BAD_KEYS, ids=[k[0] for k in BAD_KEYS])
def test_idempotency_keys_are_clean_and_short(
    store: ConversationStore, conv: str, label: str, key: str
) -> None:
    before = dump(store)
    with pytest.raises(InvalidIdempotencyKeyError) as caught:
        store.commit_turn(conv, make_turn(), ["r"], idempotency_key=key)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, StoreError)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert dump(store) == before


def test_an_idempotency_key_at_the_limit_works(store: ConversationStore, conv: str) -> None:
    key = "\u00e9" * (MAX_KEY_BYTES // 2)
    first = store.commit_turn(conv, make_turn(), ["r"], idempotency_key=key)
    again = store.commit_turn(conv, make_turn(), ["other"], idempotency_key=key)
    assert first.created and not again.created and again.messages == first.messages


@pytest.mark.parametrize(
    "cid", ["", "c" * 256, "c\x00", "c\udfff", "\ufdd0c", 5], ids=lambda c: repr(c)[:12]
)
def test_conversation_ids_are_clean_text_in_every_method(
    store: ConversationStore, cid: Any
) -> None:
    for call in (
        lambda: store.create_conversation(cid),
        lambda: store.append(cid, [{"role": "user", "content": "x"}]),
        lambda: store.commit_turn(cid, make_turn(), ["r"]),
        lambda: store.record_attempt(cid, make_turn()),
        lambda: store.history(cid),
        lambda: store.attempts(cid),
        lambda: store.next_seq(cid),
        lambda: store.delete_conversation(cid),
    ):
        with pytest.raises(InvalidConversationIdError) as caught:
            call()
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("field", ["id", "name", "model", "response_id"])
def test_keys_past_the_limit_are_refused_before_writing(
    store: ConversationStore, conv: str, field: str
) -> None:
    """The parser's limits (512 bytes) keep such a turn from being complete; a turn built or
    changed by hand is refused by the store's own guard before anything is written."""
    long = "\U0001f600" * (MAX_KEY_BYTES // 4) + "x"
    turn = make_turn([("call_1", "f", "{}")])
    assert turn.complete
    call = turn.tool_calls[0]
    if field == "id":
        call.id = long
    elif field == "name":
        call.name = long
    elif field == "model":
        turn._meta.model = long
    else:
        turn._meta.response_id = long
    before = dump(store)
    with pytest.raises(UnsupportedValueError, match="UTF-8 bytes"):
        store.commit_turn(conv, turn, ["r"])
    assert dump(store) == before
    store.record_attempt(conv, turn)  # an attempt holds it


def _deep(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("label", "parts"),
    [
        ("nan", [{"type": "text", "x": math.nan}]),
        ("infinity", [{"type": "text", "x": [math.inf]}]),
        ("object", [{"type": "text", "x": object()}]),
        ("int key", [{"type": "text", "x": {1: "a"}}]),
        ("too deep", [{"type": "text", "x": _deep(600)}]),
        ("too many digits", [{"type": "text", "x": 10**5000}]),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_content_parts_that_are_not_json_are_refused(
    store: ConversationStore, conv: str, label: str, parts: list[Any]
) -> None:
    before = dump(store)
    with pytest.raises(InvalidMessageError, match="content parts"):
        store.append(conv, [{"role": "user", "content": parts}])
    with pytest.raises(ResultsError, match="content parts"):
        store.commit_turn(conv, make_turn(), [{"content": parts}])
    assert dump(store) == before


def test_content_parts_with_hostile_strings_read_back(store: ConversationStore, conv: str) -> None:
    parts = [{"type": "text", "text": "\x00\ud800\ufdd0\\0", "n": 2**70, "f": -0.0}]
    store.append(conv, [{"role": "user", "content": parts}])
    store.commit_turn(conv, make_turn(), [{"content": parts}])
    history = store.history(conv)
    assert history[0]["content"] == parts and history[-1]["content"] == parts


#: two lone surrogates side by side: as JSON escapes every reader would join them into one
#: character, so the store marks such strings (fsm.store.codec.StoredJSON)
PAIR_OF_HALVES = "\ud800\udc00"


def test_lone_halves_side_by_side_in_json_values_read_back(
    store: ConversationStore, conv: str
) -> None:
    parts = [{"type": "text", "text": PAIR_OF_HALVES, PAIR_OF_HALVES: "key"}]
    store.append(conv, [{"role": "user", "content": parts}])
    store.commit_turn(conv, make_turn(response_id="r-halves"), [{"content": parts}])
    history = store.history(conv)
    assert history[0]["content"] == parts and history[-1]["content"] == parts
    store.create_conversation("halves", metadata={"k": PAIR_OF_HALVES, PAIR_OF_HALVES: 1})
    [info] = [c for c in store.list_conversations(limit=None) if c.id == "halves"]
    assert info.metadata == {"k": PAIR_OF_HALVES, PAIR_OF_HALVES: 1}


def test_metadata_must_be_json(store: ConversationStore) -> None:
    with pytest.raises(UnsupportedValueError, match="metadata"):
        store.create_conversation("m", metadata={"x": math.nan})
    store.create_conversation("m", metadata={"x": "\x00\ud800", "n": 2**80})


def test_usage_no_engine_stores_as_it_is_is_kept_as_text(
    store: ConversationStore, conv: str
) -> None:
    turn = make_turn()
    turn._meta.usage = {"total_tokens": math.inf, "n": 10**5000, "x": math.nan, "ok": 3}
    store.commit_turn(conv, turn, ["r"])
    with store.engine.connect() as conn:
        usage = conn.execute(
            sa.text(
                "SELECT usage FROM fsm_messages WHERE conversation_id = :c AND role = 'assistant'"
            ),
            {"c": conv},
        ).scalar_one()
    text = usage if isinstance(usage, str) else __import__("json").dumps(usage)
    assert "Infinity" not in text and "NaN" not in text and '"inf"' in text and '"ok": 3' in text


# -- driver errors become typed errors ---------------------------------------------------------
@pytest.fixture
def guarded(empty_url: sa.URL) -> Iterator[ConversationStore]:
    """A store whose database refuses the content 'forbidden' in any message and the reason
    'forbidden' of an attempt's call (a rule the store does not know about), in a database of its
    own."""
    upgrade(empty_url)
    engine = sa.create_engine(empty_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.execute(
                    sa.text(
                        "ALTER TABLE fsm_messages ADD CONSTRAINT ck_test_forbidden"
                        " CHECK (content IS DISTINCT FROM 'forbidden')"
                    )
                )
                conn.execute(
                    sa.text(
                        "ALTER TABLE fsm_attempt_calls ADD CONSTRAINT ck_test_forbidden"
                        " CHECK (reason IS DISTINCT FROM 'forbidden')"
                    )
                )
            else:
                for table, column in (("fsm_messages", "content"), ("fsm_attempt_calls", "reason")):
                    conn.execute(
                        sa.text(
                            f"CREATE TRIGGER test_forbidden_{table} BEFORE INSERT ON {table}"
                            f" WHEN NEW.{column} = 'forbidden'"
                            " BEGIN SELECT RAISE(ABORT, 'forbidden value'); END"
                        )
                    )
    finally:
        engine.dispose()
    with ConversationStore(empty_url) as store:
        yield store


def test_a_refused_value_is_a_typed_one_line_error(guarded: ConversationStore) -> None:
    cid = guarded.create_conversation()
    guarded.append(cid, [{"role": "user", "content": "hi"}])
    before = dump(guarded)
    for write in (
        lambda: guarded.append(cid, [{"role": "user", "content": "forbidden"}]),
        lambda: guarded.commit_turn(cid, make_turn(), ["forbidden"]),
    ):
        with pytest.raises(ValueRejectedError) as caught:
            write()
        message = str(caught.value)
        assert "\n" not in message and "nothing was written" in message
        assert isinstance(caught.value.__cause__, sa.exc.IntegrityError)
        assert dump(guarded) == before
    if guarded.engine.dialect.name == "postgresql":
        with pytest.raises(ValueRejectedError) as caught:
            guarded.append(cid, [{"role": "user", "content": "forbidden"}])
        assert caught.value.constraint == "ck_test_forbidden"
