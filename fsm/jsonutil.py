"""JSON helpers of the parser: strict decoding (:func:`loads_strict`), validity by syntax
(:func:`is_json`) and opt-in append-only repair (:func:`repair_json`)."""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson

from fsm.jsonsyntax import JsonSyntax, check_syntax

__all__ = [
    "DEFAULT_MAX_JSON_DEPTH",
    "MAX_JSON_DEPTH",
    "JsonSyntax",
    "copy_json",
    "dumps_kept",
    "is_json",
    "json_depth",
    "loads_strict",
    "repair_json",
]

#: The one nesting limit of every JSON value fsm keeps: a call's arguments (the most
#: ``Limits.max_json_depth`` may be), a provider item kept verbatim (a Responses output item, an
#: Anthropic content block or citation, counted from the item itself), and what the store keeps as
#: JSON (metadata, content parts). Depth counts the containers on the deepest path, the value
#: itself included: ``{"a": []}`` is 2 deep. Every value at most this deep is parsed, kept,
#: committed and read back on both engines; deeper ones are refused with a typed error where they
#: enter (the parser, or the store's API before any write).
MAX_JSON_DEPTH: Final = 512
#: the nesting limit of :func:`is_json` by default (``Limits.max_json_depth``)
DEFAULT_MAX_JSON_DEPTH: Final = MAX_JSON_DEPTH
#: texts longer than this skip orjson in :func:`is_json` (it would build the whole value, up to
#: ~10 times the text in memory; the syntax check builds nothing)
_ORJSON_MAX_CHARS: Final = 1 << 20
_JSON_WHITESPACE: Final = " \t\r\n"
_BLANK = re.compile(r"[ \t\r\n]*+").fullmatch
#: ``int()`` refuses decimal strings of more than 4,300 digits (CPython's guard against slow
#: conversions); longer integers are valid JSON and are decoded as floats (infinite) instead
_MAX_INT_DIGITS: Final = 4000


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_int(digits: str) -> int | float:
    if len(digits) <= _MAX_INT_DIGITS:
        return int(digits)
    return float(digits)


def loads_strict(data: str | bytes) -> Any:
    """Decode one JSON document by the JSON grammar (RFC 8259), no more, no less.

    orjson first (fast); where it refuses valid JSON (lone surrogate escapes such as a split
    emoji's ``"\\ud83d"``, numbers beyond a double such as ``1e400``, which become infinite), the
    standard library decides, with ``NaN``/``Infinity`` refused and integers of any length
    accepted (more than 4,000 digits decode as an infinite float). Raises ``ValueError`` (or
    ``RecursionError`` past the decoders' nesting limits, about 1,000 levels).
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        text = data.decode("utf-8") if isinstance(data, bytes) else data  # strict: no surrogates
        return json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``value`` (decoded JSON) nests: containers on its deepest path, the value itself
    included (a scalar is 0). Iterative; stops at ``limit + 1`` once the value is deeper than
    ``limit``, so the cost is bounded by the value's size, whatever its depth."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    pop, push = todo.pop, todo.append
    while todo:
        item, depth = pop()
        kind = type(item)
        if kind is dict:
            children = item.values()
        elif kind is list or kind is tuple:
            children = item
        else:
            continue
        if depth > deepest:
            deepest = depth
            if depth > limit:
                return limit + 1
        for child in children:
            if type(child) in _CONTAINERS:
                push((child, depth + 1))
    return deepest


_CONTAINERS: Final = frozenset({dict, list, tuple})


def dumps_kept(value: Any) -> bytes:
    """``value`` (decoded JSON at most :data:`MAX_JSON_DEPTH` deep) as compact JSON bytes, keys
    in their order: how the parser keeps a provider item (a fraction of the memory of the
    decoded tree). orjson when it can (up to 255 levels, integers of 64 bits); else the standard
    library, with ASCII escapes (so a lone surrogate survives). ``ValueError`` for a float that
    is not finite (``1e400`` decodes as infinity, which JSON text cannot hold)."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        return text.encode("ascii")


def copy_json(value: Any) -> Any:
    """A deep copy of ``value`` (decoded JSON: dicts, lists, tuples as lists, scalars), made
    without recursion, so any depth is copied."""
    kind = type(value)
    if kind is not dict and kind is not list and kind is not tuple:
        return value
    root: Any = {} if kind is dict else []
    todo: list[tuple[Any, Any]] = [(value, root)]
    while todo:
        source, target = todo.pop()
        if type(source) is dict:
            for key, child in source.items():
                ckind = type(child)
                if ckind is dict or ckind is list or ckind is tuple:
                    new: Any = {} if ckind is dict else []
                    todo.append((child, new))
                    child = new
                target[key] = child
        else:
            for child in source:
                ckind = type(child)
                if ckind is dict or ckind is list or ckind is tuple:
                    new = {} if ckind is dict else []
                    todo.append((child, new))
                    child = new
                target.append(child)
    return root


def is_json(text: str, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> JsonSyntax:
    """Whether ``text`` is one valid JSON document, or empty / JSON whitespace only, by syntax.

    Returns :class:`~fsm.jsonsyntax.JsonSyntax` (true only when ``VALID``): ``TOO_DEEP`` for a
    valid document with more than ``max_depth`` nested containers, else ``INVALID``. A number
    of any length is valid, as is a lone surrogate escape (``"\\ud83d"``); ``NaN``, trailing
    commas, raw control characters in strings and raw surrogate characters are not. orjson
    decides when it accepts a text of at most 1 MiB characters with no more brackets than
    ``max_depth``; otherwise the linear-time syntax check :func:`~fsm.jsonsyntax.check_syntax`.
    """
    if not text or (text[0] in _JSON_WHITESPACE and _BLANK(text) is not None):
        return JsonSyntax.VALID
    if len(text) <= max_depth or (
        len(text) <= _ORJSON_MAX_CHARS and text.count("[") + text.count("{") <= max_depth
    ):
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
        else:
            return JsonSyntax.VALID
    return check_syntax(text, max_depth)


_CLOSERS = {"{": "}", "[": "]"}
_LITERALS = ("true", "false", "null")


def repair_json(text: str, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> str | None:
    """Return the shortest suffix found that makes ``text + suffix`` valid JSON, or ``None``.

    Append-only by construction: it never drops or rewrites a character, so the raw string stays
    a prefix of the repaired one. It closes an open string, completes a cut literal
    (``tru`` -> ``true``) or number (``1.`` -> ``1.0``), supplies ``null`` for a value cut after
    ``:`` or a key cut before its colon, and closes open arrays and objects. A trailing comma or
    anything it cannot end with certainty gives ``None``: the call then stays ``truncated``, as
    it does when the repaired text would nest deeper than ``max_depth``.
    """
    stack: list[str] = []
    in_string = False
    escape = False
    # what the innermost object expects next: "key", "colon", "value", "comma"
    expect: list[str] = []
    token_start = -1
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                if expect and expect[-1] == "key":
                    expect[-1] = "colon"
                elif expect and expect[-1] == "value":
                    expect[-1] = "comma"
            i += 1
            continue
        if ch in " \t\r\n":
            token_start = -1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
            expect.append("key" if ch == "{" else "value")
        elif ch in "}]":
            if not stack:
                return None
            stack.pop()
            expect.pop()
            if expect:
                expect[-1] = "comma"
        elif ch == ":":
            if expect and expect[-1] == "colon":
                expect[-1] = "value"
        elif ch == ",":
            if expect:
                expect[-1] = "key" if stack[-1] == "{" else "value"
        else:
            if token_start < 0:
                token_start = i
            if expect and expect[-1] == "value":
                expect[-1] = "comma"
        if ch in ' \t\r\n"{}[]:,':
            token_start = -1
        i += 1

    suffix = ""
    if in_string:
        if escape:
            return None
        # a cut \uXXXX escape cannot be completed honestly
        tail = text[text.rfind("\\") :] if "\\" in text else ""
        if tail.startswith("\\u") and len(tail) < 6:
            return None
        suffix += '"'
        if expect and expect[-1] == "key":
            suffix += ":null"
            expect[-1] = "comma"
        elif expect and expect[-1] == "value":
            expect[-1] = "comma"
    elif token_start >= 0:
        token = text[token_start:]
        completed = _complete_scalar(token)
        if completed is None:
            return None
        suffix += completed
    if expect:
        state = expect[-1]
        if state == "colon":
            suffix += ":null"
        elif state == "value":
            last = text.rstrip()[-1:] if text.strip() else ""
            if last == ",":
                return None
            if last == ":":
                suffix += "null"
        elif state == "key":
            last = text.rstrip()[-1:]
            if last == ",":
                return None
    for opener in reversed(stack):
        suffix += _CLOSERS[opener]
    if not suffix:
        return None
    return suffix if is_json(text + suffix, max_depth) else None


def _complete_scalar(token: str) -> str | None:
    for literal in _LITERALS:
        if literal.startswith(token):
            return literal[len(token) :]
    if token[-1:] in ("-", "+", ".", "e", "E"):
        return "0"
    try:
        float(token)
    except ValueError:
        return None
    return ""
