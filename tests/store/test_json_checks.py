"""The arguments check agrees with JSON's grammar on both engines, for the codec's marked texts
too, and the PostgreSQL helpers (``fsm_json_valid``, ``fsm_try_jsonb``) do what the audit
queries rely on.

The oracle is Python's JSON decoder used for syntax only (numbers are not converted, so a
5,000-digit integer is valid; NaN and Infinity are refused) on the text the stored value stands
for (:func:`fsm.store.codec.decode_text`). SQLite evaluates ``models.SQLITE_ARGUMENTS_CHECK``,
PostgreSQL ``models.PG_ARGUMENTS_CHECK``, each on the stored (encoded) text.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm.store import ConversationStore
from fsm.store.codec import MARK, decode_text, encode_text
from fsm.store.models import PG_ARGUMENTS_CHECK, SQLITE_ARGUMENTS_CHECK, SQLITE_NAME_CHECK


def _reject(_name: str) -> Any:
    raise ValueError("not JSON")


def json_syntax_ok(text: str) -> bool:
    """Blank, or one JSON document by the grammar (raw lone surrogates allowed in strings, as
    the parser allows them)."""
    if not text.strip(" \t\r\n"):
        return True
    try:
        json.loads(text, parse_int=lambda s: 0, parse_float=lambda s: 0.0, parse_constant=_reject)
    except (ValueError, RecursionError):
        return False
    return True


def check(store: ConversationStore, stored: list[str]) -> list[bool]:
    """The engine's arguments check on each stored text."""
    postgres = store.engine.dialect.name == "postgresql"
    sql = PG_ARGUMENTS_CHECK if postgres else SQLITE_ARGUMENTS_CHECK
    cast = "CAST(:a AS text)" if postgres else ":a"
    query = sa.text(f"WITH t(arguments) AS (SELECT {cast}) SELECT ({sql}) FROM t")
    with store.engine.connect() as conn:
        return [bool(conn.execute(query, {"a": text}).scalar()) for text in stored]


TOKENS = [
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    " ",
    "\t",
    "\\",
    "\\\\",
    '\\"',
    "\\u",
    "\\u0041",
    "\\ud83d",
    "\\0",
    "0",
    "1",
    "-",
    "e",
    ".",
    "x",
    "true",
    "null",
    "NaN",
    "\ud83d",
    "\ude00",
    "\udfff",
    "\x00",
    "\x01",
    MARK,
    "\u00e9",
    '{"a": "',
    '"}',
    "[1, ",
]
texts = st.lists(st.sampled_from(TOKENS), max_size=12).map("".join)
json_texts = st.recursive(
    st.one_of(st.none(), st.integers(), st.text(alphabet='ab\\"\ud83d\ude00\x00 ', max_size=4)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=6,
).map(lambda v: json.dumps(v, ensure_ascii=False))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(originals=st.lists(st.one_of(texts, json_texts), min_size=1, max_size=8))
def test_the_arguments_check_is_json_syntax(store: ConversationStore, originals: list[str]) -> None:
    stored = [encode_text(text) for text in originals]
    expected = [json_syntax_ok(decode_text(s)) for s in stored]
    assert check(store, stored) == expected, list(zip(originals, stored, expected, strict=True))


FIXED = [
    "",
    " \r\n\t",
    "{}",
    "[" * 900 + "]" * 900,
    "1" * 5000,
    "1e1000000",
    '"\\u0000"',
    '"\\ud800"',
    '{"a": "\ud83d\ude00"}',
    '{"a": "\\\\\ud83d"}',
    '{"a": "\\\ud83d"}',
    "[\ud83d]",
    '"\x00"',
    "NaN",
    "[Infinity]",
    "{'a': 1}",
    "{} x",
    "\ufeff{}",
    "\u00a0{}",
    MARK + "{}",
    "01",
    "1.",
    '"\\x41"',
    '"tab\there"',
]


@pytest.mark.parametrize("original", FIXED, ids=range(len(FIXED)))
def test_the_arguments_check_on_the_edges(store: ConversationStore, original: str) -> None:
    stored = encode_text(original)
    assert check(store, [stored]) == [json_syntax_ok(original)]


def test_the_name_check(store: ConversationStore) -> None:
    if store.engine.dialect.name != "sqlite":
        pytest.skip("the PostgreSQL twin is tested through raw SQL in test_contract")
    query = sa.text(f"WITH t(name) AS (SELECT :n) SELECT ({SQLITE_NAME_CHECK}) FROM t")
    with store.engine.connect() as conn:
        for name, ok in [("", False), (" \t\r\n", False), (" f ", True), ("\u00a0", True)]:
            assert bool(conn.execute(query, {"n": encode_text(name)}).scalar()) is ok, name


def test_postgresql_helpers_for_the_audit(store: ConversationStore) -> None:
    if store.engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL functions")
    cases = [
        ('{"a": 1}', True, {"a": 1}),
        ("{", False, None),
        ("NaN", False, None),
        ('"\\u0000"', True, None),  # json takes it; jsonb cannot hold U+0000
        ('"\\ud800"', True, None),  # a lone surrogate escape: json yes, jsonb no
        ("1e1000000", True, None),  # beyond numeric
        ('{"a": "\\ud83d\\ude00"}', True, {"a": "\U0001f600"}),
        (encode_text('{"a": "\ud83d"}'), True, None),  # marked: valid, never jsonb
        (MARK + "junk", False, None),
        (" ", False, None),  # blank is the check's business, not the function's
    ]
    with store.engine.connect() as conn:
        for text, valid, as_jsonb in cases:
            row = conn.execute(
                sa.text("SELECT fsm_json_valid(:t), fsm_try_jsonb(:t)"), {"t": text}
            ).one()
            assert row[0] is valid, text
            assert row[1] == as_jsonb, text
        assert conn.execute(sa.text("SELECT fsm_json_valid(NULL)")).scalar() is None
        volatility = conn.execute(
            sa.text(
                "SELECT string_agg(provolatile::text, '') FROM pg_proc"
                " WHERE proname IN ('fsm_json_valid', 'fsm_try_jsonb')"
                " AND pronamespace = current_schema()::regnamespace"
            )
        ).scalar()
        assert volatility == "ii"
