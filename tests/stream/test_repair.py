"""Opt-in, append-only JSON repair."""

from __future__ import annotations

import json

import pytest

from fsm.toolcall import is_json, repair_json

REPAIRABLE = [
    ('{"city": "Par', '"}'),
    ('{"a": 1', "}"),
    ('{"a": [1, 2', "]}"),
    ('{"a":', "null}"),
    ('{"a"', ":null}"),
    ('{"a": tr', "ue}"),
    ('{"a": fal', "se}"),
    ('{"a": n', "ull}"),
    ('{"a": 1.', "0}"),
    ('{"a": -', "0}"),
    ("{", "}"),
    ("[", "]"),
    ('[{"a": {"b": "c', '"}}]'),
    ('{"a": "x\\"y', '"}'),
    ('{"a": {}', "}"),
]


@pytest.mark.parametrize(("raw", "suffix"), REPAIRABLE)
def test_repairs_by_appending_only(raw: str, suffix: str) -> None:
    assert not is_json(raw)
    assert repair_json(raw) == suffix
    json.loads(raw + suffix)


@pytest.mark.parametrize(
    "raw",
    ['{"a": 1,', "[1,", '{"a": "\\u12', '{"a": "x\\', "}", '{"a" 1', '{"a": 1}}', "nul l"],
)
def test_refuses_what_it_cannot_end_with_certainty(raw: str) -> None:
    assert repair_json(raw) is None


def test_is_json_accepts_empty_whitespace_and_big_numbers() -> None:
    assert is_json("")
    assert is_json(" \n\t")
    assert is_json("123456789012345678901234567890")
    assert is_json('"\\ud800"')  # a lone surrogate escape is valid JSON text
    assert not is_json("{")
    assert not is_json("[" * 100_000)
