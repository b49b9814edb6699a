"""JSON by its grammar (RFC 8259): a syntax check with a nesting limit, and depth-safe rendering.

:func:`check_syntax` decides whether a ``str`` is one JSON document by syntax alone: a 5,000-digit
integer, ``1e400`` and lone surrogate escapes (``"\\ud83d"``) are valid JSON; ``NaN``,
``Infinity``, trailing commas, raw control characters in strings, and raw lone surrogate
*characters* in the Python string (JSON text is UTF-8, which cannot hold them) are not. It is
iterative (an explicit stack of one byte per open container, so no recursion limit applies),
linear in the length of the text (tokens are matched by regular expressions whose quantifiers
never backtrack; runs of scalars in one container are matched by one expression), and it tells a
valid document nested deeper than the limit (``TOO_DEEP``) from an invalid one.

:func:`render_json` writes a value decoded from JSON back as (possibly truncated) JSON text in
bounded time and without recursion, whatever its nesting: error messages use it.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any, Final, cast

__all__ = ["JsonSyntax", "check_syntax", "render_json"]


class JsonSyntax(enum.Enum):
    """The verdict of :func:`check_syntax`. Only ``VALID`` is true in a boolean context."""

    VALID = "valid"
    INVALID = "invalid"
    #: valid JSON, but nested deeper than the limit
    TOO_DEEP = "too_deep"

    def __bool__(self) -> bool:
        return self is JsonSyntax.VALID


VALID: Final = JsonSyntax.VALID
INVALID: Final = JsonSyntax.INVALID
TOO_DEEP: Final = JsonSyntax.TOO_DEEP

# -- tokens (possessive quantifiers: every match is found without backtracking) ---------------
_WS = r"[ \t\n\r]*+"
# A string: no raw quote, backslash, control character or surrogate code point; escapes are the
# eight single-character ones and \uXXXX (which may name a lone surrogate: that is valid JSON).
_CHARS = r'[^"\\\x00-\x1f\ud800-\udfff]*+'
_STRING = rf'"{_CHARS}(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{{4}}){_CHARS})*+"'
_NUMBER = r"-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][+-]?+[0-9]++)?+"
_SCALAR = rf"(?:{_STRING}|{_NUMBER}|true|false|null)"

#: how many levels of nesting one expression matches whole (see ``_value``)
_LEVELS: Final = 3


def _value(levels: int) -> str:
    """A value nested at most ``levels`` deep, as one expression: a scalar, or a container of
    such values one level less deep. After each element comes a comma not followed by the
    closer, or the closer itself (a look-ahead), so each level appears once per container kind.
    """
    if levels == 0:
        return _SCALAR
    inner = _value(levels - 1)
    array = rf"\[{_WS}(?:{inner}{_WS}(?:,{_WS}(?!\])|(?=\])))*+\]"
    obj = rf"\{{{_WS}(?:{_STRING}{_WS}:{_WS}{inner}{_WS}(?:,{_WS}(?!\}})|(?=\}})))*+\}}"
    return rf"(?:{_SCALAR}|{array}|{obj})"


Matcher = Callable[[str, int], "re.Match[str] | None"]
#: a pattern that matches everywhere (possibly the empty string)
Skipper = Callable[[str, int], "re.Match[str]"]


def _matcher(pattern: str) -> Matcher:
    return re.compile(pattern).match


def _skipper(pattern: str) -> Skipper:
    return cast(Skipper, re.compile(pattern).match)


def _openers(levels: int, most: int = 0) -> Matcher:
    # A run of openers (at most ``most`` of them), each with the elements before its first
    # container child: ``[`` then ``value ,`` pairs, or ``{`` then ``"key": value ,`` pairs and
    # one ``"key":``. Deep nesting then costs a few expressions per run, not per level.
    value = _value(levels)
    return _matcher(
        rf"(?:\[{_WS}(?:{value}{_WS},{_WS})*+"
        rf"|\{{{_WS}(?:{_STRING}{_WS}:{_WS}{value}{_WS},{_WS})*+{_STRING}{_WS}:{_WS})"
        + (rf"{{1,{most}}}+" if most else "++")
    )


#: openers at most this many at a time while the depth limit is not passed
_RUN: Final = 64


class _Patterns:
    """The big expressions, compiled on first use (about 0.1 s, once; most streams never need
    them).

    Pairs are indexed by whether nested elements (``_LEVELS`` deep) may be matched whole:
    ``0`` near the depth limit (scalars only: containers are then counted one by one), ``1``
    elsewhere."""

    def __init__(self) -> None:
        values = (_value(0), _value(_LEVELS))
        #: a value where one is expected, and the whitespace after it
        self.value_ws = tuple(_matcher(v + _WS) for v in values)
        #: in an array where a value is expected: any run of ``value ,``, then whitespace
        self.array_run = tuple(_skipper(rf"(?:{_WS}{v}{_WS},)*+{_WS}") for v in values)
        #: in an object where a key is expected: any run of ``"key": value ,``, then a key
        self.object_run = tuple(
            _matcher(rf"(?:{_WS}{_STRING}{_WS}:{_WS}{v}{_WS},)*+{_WS}{_STRING}{_WS}:{_WS}")
            for v in values
        )
        self.openers_scalars = _openers(0)
        self.openers_nested = _openers(_LEVELS)
        self.openers_nested_some = _openers(_LEVELS, _RUN)


@functools.cache
def _patterns() -> _Patterns:
    return _Patterns()


_CLOSERS = _matcher(rf"(?:[\]}}]{_WS})++")
_STRINGS = re.compile(_STRING)
_BALANCED = re.compile(r"\[[^][{}]*\]|\{[^][{}]*\}")
_NOT_OPENER = re.compile(r"[^[{]")
_NOT_BRACKETS: Final = str.maketrans("", "", " \t\n\r")
_CLOSER_TO_OPENER: Final = str.maketrans("]}", "[{")


def _opened(run: str) -> str:
    """The containers a run of openers leaves open, outermost first (``[`` or ``{`` each)."""
    skeleton = _STRINGS.sub("", run)
    for _ in range(_LEVELS):
        skeleton, count = _BALANCED.subn("", skeleton)
        if not count:
            break
    return _NOT_OPENER.sub("", skeleton)


_SKIP_WS = _skipper(_WS)

_ARRAY: Final = 0x5B  # "[", as kept on the stack
_OBJECT: Final = 0x7B  # "{"


def check_syntax(text: str, max_depth: int) -> JsonSyntax:
    """Whether ``text`` is exactly one JSON document (surrounding JSON whitespace allowed).

    ``TOO_DEEP`` when it is valid but has more than ``max_depth`` containers nested in one
    another; ``INVALID`` when it is not JSON (an empty text is not). Linear time; memory one byte
    per open container.
    """
    p = _patterns()
    n = len(text)
    stack = bytearray()  # the open containers, innermost last: b"[" or b"{"
    too_deep = False
    pos = _SKIP_WS(text, 0).end()
    fresh = False  # whether pos is just after an array's "[" (so "]" may close it)
    while True:
        # -- a value is expected at pos
        # whether nested elements may be matched whole: they fit under the limit, or it is
        # passed already (then nesting no longer matters)
        room = 1 if too_deep or len(stack) + _LEVELS <= max_depth else 0
        if stack and stack[-1] == _ARRAY:
            start = pos
            pos = p.array_run[room](text, pos).end()
            fresh = fresh and pos == start
        m = p.value_ws[room](text, pos)
        if m is not None:
            pos = m.end()
        else:
            # Past the limit, nesting no longer matters; far from it, a bounded run of openers
            # with nested elements stays under it; near it, elements are scalars (exact count).
            if too_deep:
                m = p.openers_nested(text, pos)
            elif len(stack) + _RUN + _LEVELS <= max_depth:
                m = p.openers_nested_some(text, pos)
            else:
                m = p.openers_scalars(text, pos)
            if m is not None:
                run = m.group()
                stack += _opened(run).encode("ascii")
                if len(stack) > max_depth:
                    too_deep = True
                fresh = run.rstrip(" \t\n\r")[-1] == "["
                pos = m.end()
                continue
            ch = text[pos] if pos < n else ""
            if ch == "{":  # "{" with no key: only "{}" is valid (a key would be an opener)
                close = _SKIP_WS(text, pos + 1).end()
                if close >= n or text[close] != "}":
                    return INVALID
                if len(stack) >= max_depth:
                    too_deep = True
                pos = _SKIP_WS(text, close + 1).end()
            elif ch == "]" and fresh:  # the empty array just opened
                stack.pop()
                pos = _SKIP_WS(text, pos + 1).end()
            else:
                return INVALID
        fresh = False
        # -- a value ended at pos (the whitespace after it skipped)
        while True:
            if not stack:
                if pos != n:
                    return INVALID
                return TOO_DEEP if too_deep else VALID
            if pos >= n:
                return INVALID
            if text[pos] == ",":
                if stack[-1] == _ARRAY:
                    pos += 1
                else:
                    room = 1 if too_deep or len(stack) + _LEVELS <= max_depth else 0
                    m = p.object_run[room](text, pos + 1)
                    if m is None:
                        return INVALID
                    pos = m.end()
                break
            m = _CLOSERS(text, pos)
            if m is None:
                return INVALID
            closed = m.group().translate(_NOT_BRACKETS)
            k = len(closed)
            if k > len(stack) or stack[-k:] != closed[::-1].translate(_CLOSER_TO_OPENER).encode():
                return INVALID
            del stack[-k:]
            pos = m.end()


# -- rendering ----------------------------------------------------------------------------------
_encode_string: Callable[[str], str] = json.encoder.encode_basestring


class _Raw(str):
    """Text written as is by :func:`render_json` (brackets, separators, keys)."""

    __slots__ = ()


def render_json(value: Any, limit: int) -> str:
    """``value`` as JSON text in the style of ``json.dumps(value, ensure_ascii=False,
    sort_keys=True)``, cut to about ``limit`` characters (``...`` marks a cut).

    Iterative, so no nesting depth can make it raise; the work stops once ``limit`` characters
    are written. Values that are not JSON types are shown with their type name; integers too
    long to print in decimal are shown by their size.
    """
    out: list[str] = []
    size = 0
    # work items: values still to write, and _Raw text written as is
    todo: list[Any] = [value]
    while todo:
        if size > limit:
            break
        item = todo.pop()
        piece: str
        if type(item) is _Raw:
            piece = item
        elif item is None:
            piece = "null"
        elif item is True:
            piece = "true"
        elif item is False:
            piece = "false"
        elif isinstance(item, str):
            piece = _encode_string(item[: limit + 1])
        elif isinstance(item, int):
            piece = (
                str(item) if item.bit_length() < 4000 else f"<a {item.bit_length()}-bit integer>"
            )
        elif isinstance(item, float):
            if math.isfinite(item):
                piece = repr(item)
            else:
                piece = "NaN" if math.isnan(item) else ("Infinity" if item > 0 else "-Infinity")
        elif isinstance(item, list | tuple):
            if not item:
                piece = "[]"
            else:
                piece = "["
                rest: list[Any] = [_Raw("]")]
                for element in reversed(item[: limit + 1]):
                    rest.append(element)
                    rest.append(_Raw(", "))
                rest.pop()  # no separator before the first element
                todo.extend(rest)
        elif isinstance(item, dict):
            if not item:
                piece = "{}"
            else:
                piece = "{"
                try:
                    keys = sorted(item)
                except TypeError:
                    keys = list(item)
                rest = [_Raw("}")]
                for key in reversed(keys[: limit + 1]):
                    rest.append(item[key])
                    rest.append(_Raw(_encode_string(str(key)[: limit + 1]) + ": "))
                    rest.append(_Raw(", "))
                rest.pop()
                todo.extend(rest)
        else:
            piece = f"<{type(item).__name__}>"
        out.append(piece)
        size += len(piece)
    text = "".join(out)
    if todo or len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    return text
