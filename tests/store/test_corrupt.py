"""A database edited with the store's enforcement switched off: every bypass switch lets its
violation in (the database's own enforcement does not look back), and the store's reads raise
:class:`~fsm.store.errors.CorruptStoreError`, which names ``fsm audit check``, instead of
returning a history the model would refuse (or crashing with an IndexError / KeyError /
TypeError). Writes at the broken end of a conversation raise it too."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore, CorruptStoreError, audit
from fsm.store.contract import READER_RULES, RULES
from fsm.store.migrate import upgrade
from tests.store.corrupt import CORRUPTIONS, seed

CASES = [
    pytest.param(
        c.engine,
        name,
        id=name,
        marks=[pytest.mark.postgres] if c.engine == "postgresql" else [],
    )
    for name, c in CORRUPTIONS.items()
]


@pytest.mark.parametrize(("engine_name", "name"), CASES)
def test_history_of_a_corrupt_store_names_the_check(empty_url: sa.URL, name: str) -> None:
    corruption = CORRUPTIONS[name]
    upgrade(empty_url)
    cid = corruption.build(empty_url)
    with ConversationStore(empty_url) as store:
        with pytest.raises(CorruptStoreError, match="run: fsm audit check --db") as caught:
            store.history(cid)
        message = str(caught.value)
        assert "\n" not in message and caught.value.conversation_id == cid
        # the rule broken, named as the integrity check reports it (one rule list)
        assert caught.value.kind in corruption.kinds, (caught.value.kind, message)
        assert f"({caught.value.kind}: " in message
        # (on the store's own engine, which runs the checks: quick_check then finds the rows
        # that break one, which are no damage to the file)
        reported = {v.kind for v in audit.check(store.engine) if v.conversation_id == cid}
        assert caught.value.kind in reported, (caught.value.kind, reported)
        if corruption.breaks_the_tail:
            with pytest.raises(CorruptStoreError):
                store.next_seq(cid)
            with pytest.raises(CorruptStoreError):
                store.append(cid, [{"role": "user", "content": "more"}])
        # the other conversations of the store are still readable
        store.create_conversation("fine")
        store.append("fine", [{"role": "user", "content": "x"}])
        assert store.history("fine") == [{"role": "user", "content": "x"}]


def test_the_builders_seed_a_valid_history(db_url: sa.URL) -> None:
    """Control: before it is broken, the conversation reads back whole."""
    cid = seed(db_url)
    with ConversationStore(db_url) as store:
        roles = [m["role"] for m in store.history(cid)]
    assert roles == ["user", "assistant", "tool", "tool", "user"]


def test_every_rule_a_read_can_find_is_broken_by_a_builder() -> None:
    """The rule list is the tests' list too: every rule of ``READER_RULES`` has a corruption
    that breaks it (the test above then sees the reader and the check both name it), and every
    kind a builder expects is a rule of the list."""
    expected = {kind for c in CORRUPTIONS.values() for kind in c.kinds}
    assert expected >= READER_RULES, sorted(READER_RULES - expected)
    assert expected <= RULES.keys(), sorted(expected - RULES.keys())
    assert {c.engine for c in CORRUPTIONS.values()} == {"sqlite", "postgresql"}
