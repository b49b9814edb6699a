"""JSON validity by syntax (RFC 8259): ``fsm.jsonsyntax.check_syntax`` and ``is_json`` against a
reference, hand cases, nesting limits, linear time; and depth-safe ``render_json``."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm.jsonsyntax import JsonSyntax, check_syntax, render_json
from fsm.toolcall import is_json, loads_strict

VALID, INVALID, TOO_DEEP = JsonSyntax.VALID, JsonSyntax.INVALID, JsonSyntax.TOO_DEEP


def _reject(constant: str) -> Any:
    raise ValueError(constant)


def _depth(value: Any) -> int:
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            todo.extend((x, depth + 1) for x in item)
    return deepest


def reference(text: str, max_depth: int) -> JsonSyntax:
    """json.loads where it is reliable (no NaN, no raw surrogates, objects kept as pair lists
    so that duplicate keys cannot hide a value), and the nesting measured on the result."""
    try:
        text.encode("utf-8")  # JSON text is UTF-8: a raw lone surrogate cannot be in it
        value = json.loads(text, parse_constant=_reject, object_pairs_hook=lambda kv: list(kv))
    except (ValueError, RecursionError, UnicodeEncodeError):
        return INVALID

    return TOO_DEEP if _depth(_as_lists(value)) > max_depth else VALID


def _as_lists(value: Any) -> Any:
    # object_pairs_hook gives [(key, value), ...]: an object is one level, its pairs are not
    out: list[Any] = []
    todo: list[tuple[Any, list[Any]]] = [(value, out)]
    while todo:
        item, sink = todo.pop()
        if isinstance(item, list):
            inner: list[Any] = []
            sink.append(inner)
            for element in item:
                todo.append((element[1] if isinstance(element, tuple) else element, inner))
        else:
            sink.append(item)
    return out[0]


# -- hand cases --------------------------------------------------------------------------------

CASES = [
    ("1", VALID),
    ("-0", VALID),
    ("0.5e-3", VALID),
    ("1E+5", VALID),
    ('"a"', VALID),
    ('"\\ud83d"', VALID),  # a lone surrogate escape is valid JSON text
    ('"\\ud83d\\ude00"', VALID),
    ('"\\/\\b\\f\\n\\r\\t\\"\\\\"', VALID),
    ('"\x7f"', VALID),
    ("[]", VALID),
    ("{}", VALID),
    (' {"a" : [ true , false , null ] } ', VALID),
    ('[{}, [], {"": ""}]', VALID),
    ("1" * 5000, VALID),  # 5,000 digits: valid by syntax
    ("-" + "9" * 10_000 + ".5e-99999", VALID),
    ("1e400", VALID),
    ("[1e400, -1e400]", VALID),
    ("", INVALID),
    (" \n", INVALID),  # check_syntax: no document (is_json calls it empty arguments)
    ("NaN", INVALID),
    ("Infinity", INVALID),
    ("-Infinity", INVALID),
    ("[1,]", INVALID),
    ('{"a":1,}', INVALID),
    ("[,1]", INVALID),
    ("[1,,2]", INVALID),
    ("{,}", INVALID),
    ('"\x01"', INVALID),  # raw control character
    ('"a\nb"', INVALID),
    ('"\ud83d"', INVALID),  # a raw lone surrogate character: not UTF-8
    ('["\udc00"]', INVALID),
    ("01", INVALID),
    ("-01", INVALID),
    ("1.", INVALID),
    (".5", INVALID),
    ("1e", INVALID),
    ("1e+", INVALID),
    ("[-]", INVALID),
    ('{"a"}', INVALID),
    ("{1:2}", INVALID),
    ("[1 2]", INVALID),
    ('{"a":1 "b":2}', INVALID),
    ('"\\x"', INVALID),
    ('"\\u12"', INVALID),
    ('"\\U1234"', INVALID),
    ("nul", INVALID),
    ("truex", INVALID),
    ('"a"b', INVALID),
    ("[", INVALID),
    ("]", INVALID),
    ('{"a":1}}', INVALID),
    ("[1]]", INVALID),
    ("[}", INVALID),
    ("{]", INVALID),
    ("\u00a0", INVALID),  # not JSON whitespace
    ("1\u2028", INVALID),
    ("\ufeff1", INVALID),  # a BOM is not JSON
    ("1\x0c", INVALID),
    ("[" * 600 + "]" * 600, TOO_DEEP),
    ("[" * 600 + "]" * 599, INVALID),  # invalid, however deep
    ('{"a":' * 513 + "1" + "}" * 513, TOO_DEEP),
    ('{"a":' * 512 + "1" + "}" * 512, VALID),
]


@pytest.mark.parametrize(("text", "verdict"), CASES)
def test_hand_cases(text: str, verdict: JsonSyntax) -> None:
    assert check_syntax(text, 512) is verdict
    if len(text) < 4000 and '"\\ud' not in text:
        assert reference(text, 512) is verdict  # the reference agrees where it is reliable


def test_is_json_verdicts_and_truth() -> None:
    assert is_json("") is VALID and is_json(" \t\r\n") is VALID  # empty arguments are fine
    assert is_json("1" * 5000) is VALID
    assert is_json("1e400") is VALID
    assert is_json('{"emoji": "\\ud83d"}') is VALID
    assert is_json('{"a": NaN}') is INVALID
    assert is_json("[1,]") is INVALID
    assert is_json('"\x00"') is INVALID
    assert is_json('"\ud83d"') is INVALID
    assert is_json("\u2028") is INVALID
    assert is_json("[" * 513 + "]" * 513) is TOO_DEEP
    assert is_json("[" * 3 + "]" * 3, max_depth=2) is TOO_DEEP
    assert is_json("[[]]", max_depth=2) is VALID
    assert bool(VALID) and not INVALID and not TOO_DEEP


def test_is_json_for_big_texts_uses_the_syntax_check() -> None:
    text = json.dumps(["x" * 100] * 20_000)  # over 1 MiB: never handed to orjson
    assert len(text) > 1 << 20
    assert is_json(text) is VALID
    assert is_json(text[:-1]) is INVALID


def test_limit_exactly_at_the_depth() -> None:
    for depth in range(1, 12):
        for max_depth in range(1, 12):
            for doc in ("[" * depth + "]" * depth, '{"k":' * depth + "0" + "}" * depth):
                want = VALID if depth <= max_depth else TOO_DEEP
                assert check_syntax(doc, max_depth) is want, (doc, max_depth)


# -- against the reference -----------------------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(codec="utf-8"), max_size=6),
    st.sampled_from(["[", "]", "{", "}", ":", ",", '"', "\\"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=30,
)
MUTATIONS = [
    "",
    ",",
    "]",
    "}",
    "[",
    "{",
    '"',
    " ",
    "1",
    ":",
    "e",
    ".",
    "-",
    "\\",
    "[]",
    "{}",
    "\x00",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=VALUES,
    indent=st.sampled_from([None, 0, 1]),
    compact=st.booleans(),
    ascii=st.booleans(),
    edits=st.lists(
        st.tuples(st.integers(0, 1 << 16), st.sampled_from(MUTATIONS), st.integers(0, 2)),
        max_size=3,
    ),
    max_depth=st.sampled_from([1, 2, 3, 4, 5, 8, 512]),
)
def test_agrees_with_the_reference(
    value: Any,
    indent: int | None,
    compact: bool,
    ascii: bool,
    edits: list[tuple[int, str, int]],
    max_depth: int,
) -> None:
    text = json.dumps(
        value, indent=indent, ensure_ascii=ascii, separators=(",", ":") if compact else None
    )
    for at, insert, remove in edits:
        at %= len(text) + 1
        text = text[:at] + insert + text[at + remove :]
    assert check_syntax(text, max_depth) is reference(text, max_depth), text
    if _blank(text):
        assert is_json(text, max_depth) is VALID
    else:
        assert is_json(text, max_depth) is reference(text, max_depth), text


def _blank(text: str) -> bool:
    return not text.strip(" \t\r\n")


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from(list('[]{}:,"\\ 0-1.eEtrufalsn\n\t\x00\ud800x')), max_size=40))
def test_random_token_soup_agrees_with_the_reference(text: str) -> None:
    assert check_syntax(text, 3) is reference(text, 3), text


# -- linear time -----------------------------------------------------------------------------

PATHOLOGICAL = {
    "deep": lambda n: "[" * n + "]" * n,
    "deep-with-scalars": lambda n: "[1," * n + "1" + "]" * n,
    "deep-objects": lambda n: '{"a":' * n + "1" + "}" * n,
    "branches": lambda n: "[" + ",".join(["[[[[[]]]]]"] * (n // 11)) + "]",
    "records": lambda n: json.dumps([{"id": 1, "tags": ["a", [1]]}] * (n // 30)),
    "flat": lambda n: json.dumps(["ab"] * (n // 6)),
}


@pytest.mark.slow
@pytest.mark.serial  # a timing: alone on the machine
@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_time_is_linear(name: str) -> None:
    make = PATHOLOGICAL[name]
    check_syntax("[1]", 512)  # compile the expressions first

    def best(n: int) -> float:
        text = make(n)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            check_syntax(text, 512)
            times.append(time.perf_counter() - start)
        return min(times) / len(text)

    small, big = best(50_000), best(400_000)
    # quadratic would be 8x per byte; allow noise on a shared machine
    assert big < small * 3 + 1e-7, (name, small, big)


# -- render_json -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
))  # fmt: skip
def test_render_json_is_json_dumps_when_short(value: Any) -> None:
    expected = json.dumps(value, ensure_ascii=False, sort_keys=True)
    assert render_json(value, len(expected) + 10) == expected
    short = render_json(value, 20)
    assert len(short) <= 23
    if len(expected) > 20:
        assert short.endswith("...") and expected.startswith(short[:-3])


def test_render_json_survives_any_depth_and_size() -> None:
    deep: list[Any] = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    assert render_json({"error": deep}, 60).startswith('{"error": [[[[')
    assert render_json(10**5000, 60) == "<a 16610-bit integer>"
    assert render_json(float("inf"), 60) == "Infinity"
    assert render_json({1: object()}, 60) == '{"1": <object>}'
    start = time.perf_counter()
    render_json(list(range(10**6)), 100)
    assert time.perf_counter() - start < 1.0  # stops at the limit


# -- chunk decoding ----------------------------------------------------------------------------


def test_loads_strict_accepts_numbers_of_any_length() -> None:
    assert loads_strict(b'{"n": ' + b"1" * 5000 + b"}")["n"] == float("inf")
    assert loads_strict(b'{"n": -' + b"1" * 5000 + b"}")["n"] == float("-inf")
    assert loads_strict(b'{"n": 1e400, "s": "\\ud83d"}') == {"n": float("inf"), "s": "\ud83d"}
    with pytest.raises(ValueError):
        loads_strict(b'{"n": NaN}')
