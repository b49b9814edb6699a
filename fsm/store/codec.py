"""How text the engines cannot store as it is goes into the database, losslessly.

A Python ``str`` that fsm's parser accepts may hold characters no engine stores as text:
U+0000 (PostgreSQL ``text`` refuses it) and lone surrogates (U+D800-U+DFFF, which have no UTF-8
form, so neither SQLite nor PostgreSQL can receive them: a provider may send ``"\\ud83d"``, and
ids are kept exactly as sent). Such a value is stored *marked*: the noncharacter U+FDD0 (reserved
by Unicode for a program's internal use) followed by the text with ``\\`` written ``\\\\``, U+0000
written ``\\0`` and each lone surrogate written ``\\uXXXX`` (lower-case hex). Every other value,
which is every value real providers send, is stored exactly as it is, so SQL over the store
(``WHERE name = 'get_weather'``, ``LIKE``, the JSON functions over arguments) sees the real text.
A value that itself starts with U+FDD0 is marked too, so decoding is never ambiguous.

The encoding is deterministic: equal strings give equal stored text, so the database's own
comparisons (a result's ``tool_call_id`` against its call's id, unique keys) hold on the stored
form exactly as on the original. At most it doubles the UTF-8 size, plus three bytes.

Finished tool-call arguments are never marked: valid JSON text has no raw U+0000, no lone
surrogate and cannot start with U+FDD0 (its escapes, such as ``\\u0000``, are plain ASCII).

JSON columns (content parts, metadata, usage, anomalies, attempt results) go through
:class:`StoredJSON`: every string in the value (dict keys too) that would need marking as text
is marked the same way. A JSON escape cannot hold two lone surrogates side by side (every JSON
reader, PostgreSQL's and Python's alike, joins ``"\\ud800\\udc00"`` into one character), so
without the mark such a value would come back changed.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any, Final

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Dialect

__all__ = [
    "MARK",
    "JSONText",
    "StoredJSON",
    "StoredText",
    "as_utc",
    "decode_json",
    "decode_text",
    "encode_json",
    "encode_text",
    "json_text",
    "needs_marking",
]

#: The first character of a marked value.
MARK: Final = "\ufdd0"

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_TO_ESCAPE = re.compile("[\\\\\x00\ud800-\udfff]")
_ESCAPED = re.compile(r"\\(\\|0|u[0-9a-f]{4})")


def needs_marking(value: str) -> bool:
    """Whether ``value`` is stored marked (it holds U+0000 or a lone surrogate, or starts with
    :data:`MARK`)."""
    if value.isascii():
        return "\x00" in value
    return value.startswith(MARK) or _UNSTORABLE.search(value) is not None


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    if char == "\x00":
        return "\\0"
    return f"\\u{ord(char):04x}"


def _unescape(match: re.Match[str]) -> str:
    body = match.group(1)
    if body == "\\":
        return "\\"
    if body == "0":
        return "\x00"
    return chr(int(body[1:], 16))


def encode_text(value: str) -> str:
    """The text stored for ``value`` (``value`` itself unless it :func:`needs_marking`)."""
    if not needs_marking(value):
        return value
    return MARK + _TO_ESCAPE.sub(_escape, value)


def decode_text(stored: str) -> str:
    """The value a stored text stands for (the inverse of :func:`encode_text`)."""
    if not stored.startswith(MARK):
        return stored
    return _ESCAPED.sub(_unescape, stored[1:])


class StoredText(sa.types.TypeDecorator[str]):
    """``TEXT`` (or ``VARCHAR(n)``) whose values go through :func:`encode_text` on the way in
    and :func:`decode_text` on the way out. Comparisons with a literal encode the literal too."""

    impl = sa.Text
    cache_ok = True

    def __init__(self, length: int | None = None) -> None:
        super().__init__()
        self._length = length

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        # the generic type itself: SQLAlchemy adapts it to the dialect (``type_descriptor``
        # here would turn TEXT into the psycopg dialect's VARCHAR in DDL)
        if self._length is not None:
            return sa.String(self._length)
        return sa.Text()

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None or not isinstance(value, str):
            return value
        return encode_text(value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        if not isinstance(value, str):
            return value  # None, or what a database edited by hand holds (a blob on SQLite)
        return decode_text(value)

    def copy(self, **kw: Any) -> StoredText:
        return StoredText(self._length)

    def __repr__(self) -> str:
        return "StoredText()" if self._length is None else f"StoredText({self._length})"


def _any_string(value: Any, test: Any) -> bool:
    """Whether some string in ``value`` (keys included) passes ``test``. Iterative."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if test(item):
                return True
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and test(key):
                    return True
                todo.append(inner)
        elif isinstance(item, list | tuple):
            todo.extend(item)
    return False


def _map_strings(value: Any, convert: Any) -> Any:
    """A copy of ``value`` with every string (keys included) passed through ``convert``
    (tuples become lists). Iterative, so any nesting is copied."""
    if isinstance(value, str):
        return convert(value)
    if not isinstance(value, dict | list | tuple):
        return value
    root: Any = {} if isinstance(value, dict) else []
    todo: list[tuple[Any, Any]] = [(value, root)]
    while todo:
        source, target = todo.pop()
        pairs = source.items() if isinstance(source, dict) else enumerate(source)
        is_dict = isinstance(source, dict)
        for key, inner in pairs:
            if isinstance(inner, str):
                inner = convert(inner)
            elif isinstance(inner, dict | list | tuple):
                new: Any = {} if isinstance(inner, dict) else []
                todo.append((inner, new))
                inner = new
            if is_dict:
                target[convert(key) if isinstance(key, str) else key] = inner
            else:
                target.append(inner)
    return root


def _marked(value: str) -> bool:
    return value.startswith(MARK)


_MARK_UTF8: Final = MARK.encode("utf-8")


def _compact(value: Any) -> bytes | None:
    """``value`` as orjson writes it, or ``None`` where orjson cannot (lone surrogates, integers
    beyond 64 bits, more than 254 levels, keys that are not strings)."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return None


def encode_json(value: Any) -> Any:
    """``value`` (a JSON value: dicts, lists, strings, numbers, bools, ``None``) with every
    string that :func:`needs_marking` encoded by :func:`encode_text`, keys included; the same
    object when nothing needs it. Iterative: any nesting. Most values are told clean in one
    pass of C (orjson: no lone surrogate, no U+0000 escape, no U+FDD0); the others are
    walked."""
    if isinstance(value, dict | list | tuple):
        text = _compact(value)
        if text is not None and b"\\u0000" not in text and _MARK_UTF8 not in text:
            return value
    if not _any_string(value, needs_marking):
        return value
    return _map_strings(value, encode_text)


def decode_json(value: Any) -> Any:
    """The inverse of :func:`encode_json` (the same object when nothing is marked)."""
    if isinstance(value, dict | list | tuple):
        text = _compact(value)
        if text is not None and _MARK_UTF8 not in text:
            return value
    if not _any_string(value, _marked):
        return value
    return _map_strings(value, decode_text)


class JSONText(str):
    """JSON text for a :class:`StoredJSON` column, already encoded (strings marked by
    :func:`encode_json`) and serialized: bound as it is. A writer builds it piece by piece
    (:func:`json_text`) so a large value is never held decoded whole."""

    __slots__ = ()


def json_text(value: Any) -> str:
    """``value`` (a JSON value, checked) as the JSON text a :class:`StoredJSON` column holds:
    strings marked (:func:`encode_json`), ASCII escapes, as fsm's engines serialize it."""
    return json.dumps(encode_json(value), ensure_ascii=True, allow_nan=False)


def _same(text: Any) -> Any:
    return text


def _text_binder(dialect: Dialect) -> Any:
    """How JSON text already serialized is bound on ``dialect``: psycopg takes JSON through its
    ``Json`` wrapper (given the text as its own serialization), SQLite as text."""
    if dialect.name == "postgresql" and dialect.driver.startswith("psycopg"):
        from psycopg.types.json import Json

        return lambda text: Json(text, dumps=_same)
    return str


class StoredJSON(sa.types.TypeDecorator[Any]):
    """``JSON`` whose strings go through :func:`encode_json` on the way in and
    :func:`decode_json` on the way out (``None`` is SQL ``NULL``). A :class:`JSONText` value
    is bound as the text it is."""

    impl = sa.JSON
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(none_as_null=True)

    def bind_processor(self, dialect: Dialect) -> Any:
        inner = super().bind_processor(dialect)
        bind_text = _text_binder(dialect)

        def process(value: Any) -> Any:
            if type(value) is JSONText:
                return bind_text(str(value))
            return inner(value) if inner is not None else value

        return process

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return encode_json(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return decode_json(value)

    def copy(self, **kw: Any) -> StoredJSON:
        return StoredJSON()

    def __repr__(self) -> str:
        return "StoredJSON()"


def as_utc(value: Any) -> datetime | None:
    """A stored time, from either engine, as an aware UTC datetime: SQLite gives naive UTC, or
    text (from ``max()``, or read raw); ``None`` for a value that is not a time (raw SQL can
    store anything in a SQLite column)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
