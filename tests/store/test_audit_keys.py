"""Forged and garbled ``after=`` keys through the Python audit API (issue 26, finding 10): a key
no row of the listing can have (a wrong type in any part, a number the engines cannot hold, a
rank that is not 0 or 1, the wrong length) is an :class:`InvalidFilterError` before any I/O, on
each engine, never a driver's error or a ``TypeError``; a real row's key still pages."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore, audit
from tests.helpers.store import make_turn

FORGED_FAILURE_KEYS: list[Any] = [
    ("a", "b"),
    (1, "2"),
    (10**30, 0),
    (1, -(10**30)),
    (True, 0),
    (1.5, 0),
    (1,),
    (1, 2, 3),
    "12",
    [None, 1],
]
FORGED_CALL_KEYS: list[Any] = [
    (1, "x", 0, 0, 0),
    ("c", 0, 7, 0, 0),
    ("c", 10**30, 1, 0, 0),
    ("c", 0, 1, 0, 2**63),
    ("c", "0", 1, 0, 0),
    ("c", 0, 1, 0),
    ("c", 0, False, 0, 0),
]


def _store(url: sa.URL) -> None:
    with ConversationStore(url) as store:
        store.create_conversation("c")
        store.append("c", [{"role": "user", "content": "q"}])
        for n in range(3):
            cut = make_turn(
                [(f"cut{n}", "lookup", '{"q": "x'), (f"cut{n}b", "lookup", '{"q"')],
                response_id=f"r{n}",
                finish_reason="length",
            )
            store.record_attempt("c", cut)


@pytest.mark.parametrize("key", FORGED_FAILURE_KEYS, ids=repr)
def test_a_forged_failure_key_is_an_invalid_filter(db_url: sa.URL, key: Any) -> None:
    _store(db_url)
    engine = audit.open_readonly(db_url)
    try:
        with pytest.raises(audit.InvalidFilterError, match="is not the key of a row"):
            list(audit.failures(engine, after=key))
        with pytest.raises(audit.InvalidFilterError):
            audit.failure_key(key)
    finally:
        engine.dispose()


@pytest.mark.parametrize("key", FORGED_CALL_KEYS, ids=repr)
def test_a_forged_call_key_is_an_invalid_filter(db_url: sa.URL, key: Any) -> None:
    _store(db_url)
    engine = audit.open_readonly(db_url)
    try:
        with pytest.raises(audit.InvalidFilterError, match="is not the key of a row"):
            list(audit.tool_calls(engine, after=key))
    finally:
        engine.dispose()


def test_real_keys_still_page(db_url: sa.URL) -> None:
    _store(db_url)
    engine = audit.open_readonly(db_url)
    try:
        every = list(audit.failures(engine, limit=None))
        assert len(every) == 6
        first = list(audit.failures(engine, limit=4))
        rest = list(audit.failures(engine, limit=None, after=first[-1].key))
        assert [r.key for r in first + rest] == [r.key for r in every]
        calls = list(audit.tool_calls(engine, limit=None))
        tail = list(audit.tool_calls(engine, limit=None, after=calls[2].key))
        assert [r.key for r in calls[3:]] == [r.key for r in tail]
    finally:
        engine.dispose()
