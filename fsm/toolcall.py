"""One streamed tool call, and the JSON checks made when it ends."""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson

from fsm.jsonsyntax import JsonSyntax, check_syntax
from fsm.states import FINAL_STATES, ToolCallState, fire

__all__ = [
    "DEFAULT_MAX_JSON_DEPTH",
    "FLUSH_EVERY",
    "JsonSyntax",
    "ToolCall",
    "is_json",
    "pair_surrogates",
    "repair_json",
]

#: fragments kept apart before they are joined into one block (see ``ToolCall._parts``).
FLUSH_EVERY = 128


_SURROGATE = re.compile("[\ud800-\udfff]")


def pair_surrogates(text: str) -> str:
    """Join UTF-16 surrogate halves that pair up into the real character; lone halves stay.

    A provider that cuts an emoji between two chunks sends ``"\\ud83d"`` then ``"\\ude00"``:
    each chunk decodes to a lone half, and only the concatenation means the character (as it
    does in JavaScript). Applied to joined text fields and to a call's arguments; never to ids
    and names, which are kept exactly as sent.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


class ToolCall:
    """A tool call of one choice, assembled from stream fragments.

    A plain class with identity equality, driven by the shared machine in :mod:`fsm.states`.

    Attributes:
        choice: the choice index the call belongs to.
        ordinal: 0-based opening order within the choice (a stable key while streaming).
        index: the provider's ``index`` (``None`` if it sent none).
        id: the provider's id, byte-exact; ``""`` if the provider never sent one (never invented).
        name: the function name.
        state: a :class:`~fsm.states.ToolCallState`.
        reason: why the call is truncated or aborted, else ``None``.
        repaired: whether opt-in JSON repair appended characters to the arguments.
        position: the call's place in the finished turn (by index, then opening order); ``-1``
            until the turn ends.
    """

    __slots__ = (
        "_blocks",
        "_final_arguments",
        "_name_bytes",
        "_nbytes",
        "_parts",
        "_raw_length",
        "_type",
        "choice",
        "id",
        "index",
        "name",
        "ordinal",
        "over_limit",
        "position",
        "reason",
        "repaired",
        "state",
    )

    def __init__(
        self, *, choice: int, ordinal: int, index: int | None, id: str, name: str, type: str
    ) -> None:
        self.choice = choice
        self.ordinal = ordinal
        self.index = index
        self.id = id
        self.name = name
        self._type = type
        self.state = ToolCallState.OPENED
        self.reason: str | None = None
        self.repaired = False
        self.position = -1
        #: set (to ``limit:<name>``) when the call went past a limit (its arguments, name, id or
        #: type): its later fragments are dropped and it ends ``aborted`` with that reason.
        self.over_limit: str | None = None
        #: UTF-8 size of ``name`` (kept below ``Limits.max_name_bytes``)
        self._name_bytes = 0
        # Fragments are kept in two levels so that memory stays close to the argument size
        # whatever the fragment size: up to FLUSH_EVERY recent fragments in ``_parts``, joined
        # into one string in ``_blocks`` when that many have come (O(fragment) amortised), and
        # everything joined once when the call ends.
        self._parts: list[str] = []
        self._blocks: list[str] = []
        self._nbytes = 0
        self._final_arguments: str | None = None
        self._raw_length = 0

    # -- reading ---------------------------------------------------------------------------
    @property
    def type(self) -> str:
        """The call type: the first non-empty ``type`` the provider sent, else ``"function"``."""
        return self._type or "function"

    @property
    def arguments(self) -> str:
        """The arguments as they go to history: the raw string, plus the appended repair suffix
        when ``repaired`` (so it always starts with :attr:`raw_arguments`)."""
        if self._final_arguments is not None:
            return self._final_arguments
        return "".join(self._blocks) + "".join(self._parts)

    @property
    def raw_arguments(self) -> str:
        """Exactly the argument fragments the provider sent, concatenated in arrival order
        (surrogate halves that pair up across fragments joined, see :func:`pair_surrogates`)."""
        if self._final_arguments is not None:
            return self._final_arguments[: self._raw_length]
        return pair_surrogates("".join(self._blocks) + "".join(self._parts))

    @property
    def argument_bytes(self) -> int:
        """UTF-8 size of the raw arguments received so far (fragments past a limit not counted)."""
        return self._nbytes

    @property
    def final(self) -> bool:
        """Whether the call is in a final state."""
        return self.state in FINAL_STATES

    def to_dict(self) -> dict[str, Any]:
        """The call as the OpenAI ``tool_calls[]`` entry of an assistant message."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def __repr__(self) -> str:
        return (
            f"ToolCall(choice={self.choice}, position={self.position}, index={self.index}, "
            f"id={self.id!r}, name={self.name!r}, state={self.state.value}, "
            f"reason={self.reason!r}, arguments={self.arguments!r})"
        )

    # -- driving (used by the parser) ---------------------------------------------------------
    def _append(self, fragment: str, nbytes: int) -> None:
        if self.state is ToolCallState.OPENED:
            fire(self, "accumulate")
        parts = self._parts
        parts.append(fragment)
        if len(parts) >= FLUSH_EVERY:
            self._flush()
        self._nbytes += nbytes

    def _flush(self) -> None:
        self._blocks.append("".join(self._parts))
        self._parts = []

    def _drop(self) -> None:
        """Forget every fragment (a call past its size limit keeps nothing)."""
        self._parts = []
        self._blocks = []

    def _seal(self) -> str:
        """Join the fragments once; drop the lists (a final call keeps only its result)."""
        raw = pair_surrogates("".join(self._blocks) + "".join(self._parts))
        self._drop()
        self._final_arguments = raw
        self._raw_length = len(raw)
        return raw

    def _end(self, trigger: str, reason: str | None, repair_suffix: str = "") -> None:
        raw = self._seal()
        if repair_suffix:
            self._final_arguments = raw + repair_suffix
            self.repaired = True
        self.reason = reason
        fire(self, trigger)


#: the nesting limit of :func:`is_json` by default (``Limits.max_json_depth``)
DEFAULT_MAX_JSON_DEPTH: Final = 512
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
