"""Plans: what the store will write, built from a turn, messages or an attempt, with no I/O.

Every function here validates its input and builds the rows (or the messages history will
return) that a transaction body of :class:`~fsm.store.store.StoreCore` then writes; each raises
the store's typed errors (:mod:`fsm.store.errors`) before any transaction begins. Nothing here
touches a database, so the sync and the async store share it as it is.

* :func:`plan_turn`: one complete turn and its results (:func:`_normalize_results`: one result per
  call, by position or by id) -> :class:`TurnPlan`; the assistant message is the parser's own
  :meth:`Turn.to_message() <fsm.parser.Turn.to_message>`;
* :func:`plan_attempt`: a turn or a response of any state -> one ``attempts`` row per choice with
  its calls' rows (:func:`_attempt_row`), every value made storable (:func:`json_safe`);
* :func:`plain_rows`: messages given to ``append`` -> their rows;
* :func:`plan_append`, :func:`plan_commit`, :func:`plan_record`: each write's checks, in the
  order both stores make them;
* :func:`conversation_row`, :func:`check_conversation_id`, :func:`check_idempotency_key`,
  :func:`check_last`: the checks of ids, keys and arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import orjson

from fsm.errors import IncompleteTurnError
from fsm.jsonutil import MAX_JSON_DEPTH as JSONUTIL_MAX_JSON_DEPTH
from fsm.parser import Anomaly, ParseResult, Turn
from fsm.states import ToolCallState
from fsm.store.codec import MARK, JSONText, json_text
from fsm.store.errors import (
    InvalidConversationIdError,
    InvalidIdempotencyKeyError,
    InvalidMessageError,
    InvalidTurnError,
    ResultsError,
    UnsupportedValueError,
)
from fsm.store.models import TOKEN_COLUMNS, TOKEN_MAX
from fsm.store.render import iter_stored_items
from fsm.toolcall import ToolCall, result_message

__all__ = [
    "ATTEMPT_JSON_DEPTH",
    "MAX_JSON_DEPTH",
    "MAX_KEY_BYTES",
    "MAX_SEQ",
    "AttemptPlan",
    "Results",
    "TurnPlan",
    "auto_upgrade",
    "call_columns",
    "check_conversation_id",
    "check_idempotency_key",
    "check_last",
    "conversation_row",
    "json_safe",
    "plain_rows",
    "plan_append",
    "plan_attempt",
    "plan_commit",
    "plan_record",
    "plan_turn",
    "show",
    "tool_message",
    "usage_columns",
]

#: Tool results of a turn: one per call in call order (a string, or a dict with ``content``),
#: or a mapping from call id to result when the turn's ids are unique and non-empty.
Results = Sequence[str | Mapping[str, Any]] | Mapping[str, str | Mapping[str, Any]]

_PLAIN_ROLES = ("system", "developer", "user", "assistant")
_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "reasoning_content", "tool_calls"},
}
_RESULT_KEYS = {"role", "content", "tool_call_id"}

#: The longest call id, tool name, model, response id and idempotency key the store takes, in
#: UTF-8 bytes: the parser's default limit for the same fields, and short enough that an index
#: entry holding one (in the codec's form, at most twice as long) with a conversation id stays
#: within PostgreSQL's b-tree limit (about 2.7 KB).
MAX_KEY_BYTES = 512

#: JSON nesting the store keeps in content parts, metadata and each provider item (deeper is
#: refused before any write): the parser's one limit, :data:`fsm.jsonutil.MAX_JSON_DEPTH`. The
#: JSON of attempts keeps ``ATTEMPT_JSON_DEPTH`` (deeper is kept as a string rendering).
MAX_JSON_DEPTH = JSONUTIL_MAX_JSON_DEPTH
ATTEMPT_JSON_DEPTH = 32
_INT64 = 2**63
_UNCLEAN = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """A turn validated for :meth:`StoreCore.commit_turn` (built by :meth:`StoreCore.plan_turn`
    before any transaction)."""

    turn: Turn
    calls: list[ToolCall]
    contents: list[tuple[str | None, list[Any] | None]]
    assistant: dict[str, Any]
    #: the ``format`` and ``provider_items`` of the assistant row (:func:`render.stored_items`,
    #: as the JSON text the column holds)
    format: str = "chat"
    provider_items: list[Any] | JSONText | None = None


#: The attempts of one :meth:`ConversationStore.record_attempt` call: one ``attempts`` row per
#: choice, each with the rows of its calls (built by :meth:`StoreCore.plan_attempt`).
AttemptPlan = list[tuple[dict[str, Any], list[dict[str, Any]]]]


# -- validation ------------------------------------------------------------------------------------
def check_conversation_id(conversation_id: object) -> None:
    """A conversation id is a non-empty string of at most 255 characters of clean text."""
    problem: str | None
    if not isinstance(conversation_id, str) or not conversation_id:
        problem = "is not a non-empty string"
    elif len(conversation_id) > 255:
        problem = f"has {len(conversation_id)} characters"
    else:
        problem = _unclean(conversation_id)
        if problem is None:
            return
    raise InvalidConversationIdError(
        f"a conversation id is a non-empty string of at most 255 characters, without "
        f"U+0000, surrogates or a leading U+FDD0: {show(conversation_id)} {problem}"
    )


def check_idempotency_key(key: object) -> None:
    """An idempotency key is ``None`` or clean text of at most 512 UTF-8 bytes."""
    if key is None:
        return
    if not isinstance(key, str):
        problem: str | None = f"is a {type(key).__name__}, not a string"
    elif _utf8_len(key) > MAX_KEY_BYTES:
        problem = f"has {_utf8_len(key)} UTF-8 bytes"
    else:
        problem = _unclean(key)
        if problem is None:
            return
    raise InvalidIdempotencyKeyError(
        f"an idempotency key is a string of at most {MAX_KEY_BYTES} UTF-8 bytes, without "
        f"U+0000, surrogates or a leading U+FDD0: {show(key)} {problem}"
    )


# -- plans -----------------------------------------------------------------------------------------
#: more messages than a conversation can hold (seqs are 32-bit): ``history(last=N)`` with ``N``
#: at least this gives the whole history, whatever the size of ``N``
MAX_SEQ: Final = 2**31 - 1


def check_last(last: int | None) -> None:
    """``history(last=...)`` takes ``None`` or a non-negative int (a ``bool`` is not one); any
    size: ``last`` of :data:`MAX_SEQ` or more is the whole history. Anything else raises
    ``ValueError``."""
    if last is not None and (type(last) is bool or not isinstance(last, int) or last < 0):
        raise ValueError(f"last must be a non-negative integer, not {last!r}")


def conversation_row(
    conversation_id: str | None, metadata: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The ``conversations`` row to insert (a new random hex id when none is given)."""
    cid = uuid.uuid4().hex if conversation_id is None else conversation_id
    check_conversation_id(cid)
    meta = dict(metadata) if metadata else None
    if meta is not None:
        problem = _json_problem(meta)
        if problem is not None:
            raise UnsupportedValueError(f"the conversation's metadata {problem}")
    return {"id": cid, "meta": meta}


def plain_rows(messages: Sequence[Mapping[str, Any]], *, start: int = 0) -> list[dict[str, Any]]:
    """The rows (without positions) of plain messages given to ``append`` (errors number them
    from ``start``)."""
    if isinstance(messages, Mapping):
        raise InvalidMessageError("append() takes a list of messages, not a single message")
    return [_plain_row(i, message) for i, message in enumerate(messages, start)]


def plan_turn(turn: Turn | ParseResult, results: Results | None) -> TurnPlan:
    """Check that ``turn`` is one complete turn and ``results`` match its calls."""
    single = _single_turn(turn)
    calls = _complete_calls(single)
    contents = _normalize_results(calls, results)
    assistant: dict[str, Any] = dict(single.to_message())  # the parser's one definition
    _check_key_lengths(single, calls)
    fmt, items = iter_stored_items(single)
    stored: JSONText | None = None
    if items is not None:
        # serialized one item at a time: a turn of large items is never held decoded whole
        parts: list[str] = []
        for i, item in enumerate(items):
            # each item as the parser limits it (the stored list is one level more)
            problem = _json_problem(item)
            if problem is not None:
                raise UnsupportedValueError(f"the turn's provider item {i} {problem}")
            parts.append(json_text(item))
        stored = JSONText("[" + ", ".join(parts) + "]")
        del parts
    return TurnPlan(single, calls, contents, assistant, fmt, stored)


def plan_attempt(
    attempt: Turn | ParseResult,
    anomalies: Sequence[Anomaly] = (),
    *,
    results: Results | None = None,
    error: str | None = None,
) -> AttemptPlan:
    """The ``attempts`` rows (one per choice) and their calls' rows, every value made
    storable (see :meth:`ConversationStore.record_attempt`)."""
    if isinstance(attempt, ParseResult):
        result: ParseResult | None = attempt
        turns: list[Turn | None] = list(attempt.turns) or [None]
        found: Sequence[Anomaly] = attempt.anomalies
    elif isinstance(attempt, Turn):
        result, turns, found = None, [attempt], anomalies
    else:
        raise InvalidTurnError(
            f"record_attempt() takes a Turn or a ParseResult, not {type(attempt).__name__}"
        )
    plan: AttemptPlan = []
    for number, turn in enumerate(turns):
        calls = turn.tool_calls if turn is not None else []
        row = _attempt_row(result, turn, found)
        stored: list[Any] = [None] * len(calls)
        notes: list[str] = []
        if number == 0 and results is not None:
            if len(turns) == 1:
                stored, notes = _attempt_results(calls, results)
            else:
                notes = [f"results given for a response of {len(turns)} choices"]
        row["anomalies"] = json_safe(
            row["anomalies"]
            + [
                {"kind": "unmatched_result", "detail": note, "choice": row["choice"]}
                for note in notes
            ]
        )
        row["usage"] = json_safe(row.get("usage"))
        row["error"] = _text(error)
        for key in ("response_id", "model", "finish_reason", "end_how", "end_reason"):
            row[key] = _text(row.get(key))
        for key in ("content", "reasoning", "refusal"):
            row[key] = _text(row.get(key))
        row["complete"] = bool(row["complete"])
        row["choice"] = _small_int(row["choice"])
        plan.append(
            (
                row,
                [
                    {
                        "position": p,
                        "provider_index": _small_int(call.index),
                        "call_id": _text(call.id) or "",
                        "type": _text(call.type) or "",
                        "name": _text(call.name) or "",
                        "arguments": _text(call.arguments) or "",
                        "raw_arguments": _text(call.raw_arguments) if call.repaired else None,
                        "repaired": bool(call.repaired),
                        "state": call.state,
                        "reason": _text(call.reason),
                        "result": stored[p],
                    }
                    for p, call in enumerate(calls)
                ],
            )
        )
    return plan


# -- one plan per write: its checks before any I/O, in order ---------------------------------------
def plan_append(
    conversation_id: str, messages: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``append``: the conversation id, then the messages' rows."""
    check_conversation_id(conversation_id)
    return plain_rows(messages)


def plan_commit(
    conversation_id: str,
    turn: Turn | ParseResult,
    results: Results | None,
    idempotency_key: str | None,
) -> TurnPlan:
    """``commit_turn``: the conversation id, the idempotency key, then the turn and results."""
    check_conversation_id(conversation_id)
    check_idempotency_key(idempotency_key)
    return plan_turn(turn, results)


def plan_record(
    conversation_id: str,
    attempt: Turn | ParseResult,
    anomalies: Sequence[Anomaly],
    results: Results | None,
    error: str | None,
) -> AttemptPlan:
    """``record_attempt``: the attempt's rows, then the conversation id."""
    plan = plan_attempt(attempt, anomalies, results=results, error=error)
    check_conversation_id(conversation_id)
    return plan


def auto_upgrade(url_given: bool, dialect: str, auto_upgrade: bool | None) -> bool:
    """Whether a store migrates its schema when opened: as asked, else (``None``) only the
    embedded default database (no URL given, SQLite)."""
    return not url_given and dialect == "sqlite" if auto_upgrade is None else auto_upgrade


def _plain_row(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidMessageError(f"message {i} is not a dict: {message!r}")
    role = message.get("role")
    if role == "tool":
        raise InvalidMessageError(
            f"message {i} is a tool result: results go in with their turn, through commit_turn()"
        )
    if role not in _PLAIN_ROLES:
        raise InvalidMessageError(
            f"message {i} has role {role!r}; append() takes {', '.join(_PLAIN_ROLES)}"
        )
    extra = set(message) - _MESSAGE_KEYS[role]
    if extra:
        raise InvalidMessageError(
            f"message {i} ({role}) has keys fsm does not store: {sorted(extra)}"
        )
    if message.get("tool_calls"):
        raise InvalidMessageError(
            f"message {i} is an assistant message with tool calls: commit it with its "
            "results through commit_turn()"
        )
    content = message.get("content")
    refusal = message.get("refusal")
    text, parts = _content(content, f"message {i}")
    if content is None and not (role == "assistant" and refusal is not None):
        raise InvalidMessageError(f"message {i} ({role}) has no content")
    for key in ("name", "refusal", "reasoning_content"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidMessageError(f"message {i}: {key} must be a string, not {value!r}")
    return {
        "role": role,
        "content": text,
        "content_parts": parts,
        "name": message.get("name"),
        "refusal": refusal,
        "reasoning": message.get("reasoning_content"),
    }


def _single_turn(turn: Turn | ParseResult) -> Turn:
    if isinstance(turn, Turn):
        return turn
    if isinstance(turn, ParseResult):
        if len(turn.turns) == 1:
            return turn.turns[0]
        raise InvalidTurnError(
            f"the response has {len(turn.turns)} choices; pass the one to commit "
            "(result.turn(index))"
        )
    raise InvalidTurnError(f"commit_turn() takes a Turn, not {type(turn).__name__}")


def _complete_calls(turn: Turn) -> list[ToolCall]:
    calls = turn.tool_calls
    if turn.complete and all(c.state is ToolCallState.FINISHED for c in calls):
        return calls
    states = {p: (c.state.value, c.reason) for p, c in enumerate(calls)}
    bad = [
        f"call {p} ({c.name or 'no name'}) is {c.state.value}"
        + (f" ({c.reason})" if c.reason else "")
        for p, c in enumerate(calls)
        if c.state is not ToolCallState.FINISHED
    ]
    why = "; ".join(bad) if bad else f"the stream ended with {turn.end_reason or 'no end'}"
    raise IncompleteTurnError(
        f"choice {turn.index} is not a complete turn ({why}): nothing was written to history; "
        "record it with record_attempt() instead",
        choice=turn.index,
        states=states,
    )


def _content(value: Any, where: str) -> tuple[str | None, list[Any] | None]:
    """Split a message content into (text, parts)."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, list) and all(isinstance(part, Mapping) for part in value):
        parts = [dict(part) for part in value]
        problem = _json_problem(parts)
        if problem is not None:
            raise InvalidMessageError(f"{where}: the content parts {problem}")
        return None, parts
    raise InvalidMessageError(
        f"{where}: content must be a string or a list of content-part dicts, not {value!r}"
    )


def _normalize_results(
    calls: Sequence[ToolCall], results: Results | None
) -> list[tuple[str | None, list[Any] | None]]:
    """One (text, parts) per call, in call order; every mismatch is a ResultsError."""
    ids = [c.id for c in calls]
    if results is None:
        results = []
    if isinstance(results, Mapping):
        if not calls:
            ordered: list[Any] = list(results.values())
        else:
            if "" in ids or len(set(ids)) != len(ids):
                raise ResultsError(
                    f"results keyed by id are ambiguous for this turn: its call ids {ids!r} are "
                    "empty or repeated; give a list of results in call order instead"
                )
            unknown = [key for key in results if key not in ids]
            missing = [cid for cid in ids if cid not in results]
            if unknown or missing:
                raise ResultsError(
                    f"results do not match the turn's calls: missing {missing!r}, "
                    f"unknown {unknown!r} (call ids: {ids!r})"
                )
            ordered = [results[cid] for cid in ids]
    elif isinstance(results, str | bytes) or not isinstance(results, Sequence):
        raise ResultsError(
            f"results must be a list in call order or a dict keyed by call id, not "
            f"{type(results).__name__}"
        )
    else:
        ordered = list(results)
    if len(ordered) != len(calls):
        raise ResultsError(
            f"the turn has {len(calls)} tool call(s) but {len(ordered)} result(s) were given; "
            "give exactly one result per call"
        )
    out: list[tuple[str | None, list[Any] | None]] = []
    for p, (call, result) in enumerate(zip(calls, ordered, strict=True)):
        where = f"result {p} (call {call.id!r}, {call.name})"
        if isinstance(result, str):
            out.append((result, None))
            continue
        if not isinstance(result, Mapping):
            raise ResultsError(f"{where} must be a string or a dict, not {result!r}")
        extra = set(result) - _RESULT_KEYS
        if extra:
            raise ResultsError(f"{where} has keys fsm does not store: {sorted(extra)}")
        if result.get("role", "tool") != "tool":
            raise ResultsError(f"{where} has role {result['role']!r}, not 'tool'")
        if "tool_call_id" in result and result["tool_call_id"] != call.id:
            raise ResultsError(
                f"{where} says tool_call_id {result['tool_call_id']!r}: results are out of order "
                "or belong to another turn"
            )
        if result.get("content") is None:
            raise ResultsError(f"{where} has no content")
        try:
            out.append(_content(result["content"], where))
        except InvalidMessageError as exc:
            raise ResultsError(str(exc)) from None
    return out


def tool_message(call: ToolCall, text: str | None, parts: list[Any] | None) -> dict[str, Any]:
    """The result message of ``call`` (a ``function`` message for a legacy call)."""
    return cast(dict[str, Any], result_message(call, text if parts is None else parts))


def _attempt_row(
    result: ParseResult | None, turn: Turn | None, anomalies: Sequence[Anomaly]
) -> dict[str, Any]:
    """The ``attempts`` row of one choice (``turn``) of a response (``result``, if known)."""
    choice = turn.index if turn is not None else None
    row: dict[str, Any] = {
        "choice": choice,
        "anomalies": [
            dataclasses.asdict(a) for a in anomalies if a.choice is None or a.choice == choice
        ],
        "end_how": result.end_how if result is not None else None,
        "end_reason": result.end_reason if result is not None else None,
        "complete": False,
    }
    if result is not None:
        row.update(response_id=result.response_id, model=result.model, usage=result.usage)
        fmt = getattr(result, "format", None)
        row["format"] = fmt if fmt in ("chat", "responses", "anthropic") else None
    if turn is not None:
        fmt = getattr(turn, "format", None)
        if fmt in ("chat", "responses", "anthropic"):
            row["format"] = fmt
        row.update(
            response_id=turn.response_id,
            model=turn.model,
            usage=turn.usage,
            finish_reason=turn.finish_reason,
            complete=turn.complete,
            content=turn.content,
            reasoning=turn.reasoning,
            refusal=turn.refusal,
        )
        row["end_how"] = turn.end_reason or row["end_how"]
    return row


# -- values ----------------------------------------------------------------------------------------
def show(value: object, limit: int = 60) -> str:
    """A short ``repr`` for a one-line message."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _unclean(text: str) -> str | None:
    """Why ``text`` is not clean text (kept as it is, never marked), or ``None``."""
    if "\x00" in text:
        return "contains U+0000"
    if text.isascii():
        return None
    if text.startswith(MARK):
        return "starts with U+FDD0"
    if _UNCLEAN.search(text):
        return "contains a lone surrogate"
    return None


def _check_key_lengths(turn: Turn, calls: Sequence[ToolCall]) -> None:
    """Ids, names, the model and the response id fit the store's indexes (``MAX_KEY_BYTES``)."""
    keys: list[tuple[str, str | None]] = [
        ("model", turn.model),
        ("response id", turn.response_id),
    ]
    for p, call in enumerate(calls):
        keys += [(f"call {p}'s id", call.id), (f"call {p}'s name", call.name)]
    for what, value in keys:
        if value is not None and _utf8_len(value) > MAX_KEY_BYTES:
            raise UnsupportedValueError(
                f"the turn's {what} has {_utf8_len(value)} UTF-8 bytes; the store takes at most "
                f"{MAX_KEY_BYTES} (the parser's default limit): nothing was written"
            )


def _plain_json(value: Any) -> bool:
    """Whether ``value`` is plain JSON, told in two passes of C: orjson takes it (keys are
    strings, integers fit 64 bits, at most 254 levels) and the standard library too (only JSON
    types, every float finite). ``False`` means "walk it" (it may still be fine)."""
    try:
        orjson.dumps(value)
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError, orjson.JSONEncodeError):
        return False
    return True


def _json_problem(value: Any) -> str | None:
    """Why ``value`` cannot be stored as JSON that reads back equal, or ``None``.

    JSON here is what both engines hold: dicts with string keys, lists (tuples), strings,
    booleans, ``None``, finite floats and integers of at most 4,300 digits, nested at most
    ``MAX_JSON_DEPTH`` deep.
    """
    if isinstance(value, dict | list | tuple) and _plain_json(value):
        return None
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, str | bool):
            continue
        if isinstance(item, int):
            try:
                str(item)
            except ValueError:
                return f"holds an integer too long for JSON text ({item.bit_length()} bits)"
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                return f"holds {item!r}, which is not JSON"
            continue
        if depth >= MAX_JSON_DEPTH:
            return f"is nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    return f"has a key {show(key)} that is not a string"
                stack.append((inner, depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((inner, depth + 1) for inner in item)
        else:
            return f"holds a {type(item).__name__}, which is not JSON"
    return None


def _int_text(value: int) -> str:
    try:
        return str(value)
    except ValueError:  # beyond Python's digit limit for decimal text
        return hex(value)


def _render(value: Any, limit: int = 65536) -> str:
    """A JSON-like text of any value, however deep or odd, without recursion (for values of
    attempts nested too deep to keep as JSON); at most about ``limit`` characters."""
    out: list[str] = []
    size = 0
    stack: list[tuple[bool, Any]] = [(False, value)]  # (is a literal piece, item)
    while stack and size < limit:
        literal, item = stack.pop()
        if literal:
            piece = item
        elif isinstance(item, dict):
            pieces: list[tuple[bool, Any]] = [(True, "{")]
            for i, (key, inner) in enumerate(item.items()):
                if i:
                    pieces.append((True, ", "))
                pieces += [(False, key if isinstance(key, str) else _render(key, 256))]
                pieces += [(True, ": "), (False, inner)]
            pieces.append((True, "}"))
            stack.extend(reversed(pieces))
            continue
        elif isinstance(item, list | tuple):
            pieces = [(True, "[")]
            for i, inner in enumerate(item):
                if i:
                    pieces.append((True, ", "))
                pieces.append((False, inner))
            pieces.append((True, "]"))
            stack.extend(reversed(pieces))
            continue
        elif isinstance(item, str):
            piece = json.dumps(item[:limit])
        elif isinstance(item, bool) or item is None:
            piece = json.dumps(item)
        elif isinstance(item, int):
            piece = _int_text(item)
        elif isinstance(item, float):
            piece = repr(item)
        else:
            piece = show(item, 256)
        out.append(piece)
        size += len(piece)
    text = "".join(out)
    return text if not stack else text[:limit] + "..."


def call_columns(call: ToolCall) -> dict[str, Any]:
    """The columns a tool call is stored with, in history (``tool_calls``) and in the ledger
    (``tool_executions``) alike: its id, index, type, name and arguments byte-exact (the
    provider's own bytes too when the arguments were repaired)."""
    return {
        "call_id": call.id,
        "provider_index": call.index,
        "type": call.type,
        "name": call.name,
        "arguments": call.arguments,
        "raw_arguments": call.raw_arguments if call.repaired else None,
        "repaired": call.repaired,
    }


def usage_columns(usage: Any, fmt: str | None = None) -> dict[str, int | None]:
    """The token columns of a message whose ``usage`` is stored as :func:`json_safe` stores it:
    each of :data:`~fsm.store.models.TOKEN_COLUMNS` is the usage's value when that is an
    integer from 0 to :data:`~fsm.store.models.TOKEN_MAX` (not a bool, a float or a string),
    else ``None``; ``usage_unreadable`` is 1 when there is a usage that is not a JSON object.
    Migration 0006 computes the same columns in SQL for the rows written before it (all Chat
    Completions rows). A Responses or Anthropic turn (``fmt``) names its counts
    ``input_tokens`` / ``output_tokens``: they fill ``prompt_tokens`` / ``completion_tokens``
    (Anthropic sends no total: ``total_tokens`` stays NULL)."""
    if usage is None:
        return _NO_USAGE
    if not isinstance(usage, Mapping):
        return _UNREADABLE_USAGE
    columns: dict[str, int | None] = {"usage_unreadable": None}
    names = _FORMAT_TOKEN_NAMES if fmt in ("responses", "anthropic") else _TOKEN_NAMES
    for key in TOKEN_COLUMNS:
        value = usage.get(names[key])
        columns[key] = value if type(value) is int and 0 <= value <= TOKEN_MAX else None
    return columns


_TOKEN_NAMES: Final[dict[str, str]] = {key: key for key in TOKEN_COLUMNS}
_FORMAT_TOKEN_NAMES: Final[dict[str, str]] = {
    **_TOKEN_NAMES,
    "prompt_tokens": "input_tokens",
    "completion_tokens": "output_tokens",
}


_NO_USAGE: dict[str, int | None] = dict.fromkeys((*TOKEN_COLUMNS, "usage_unreadable"))
_UNREADABLE_USAGE: dict[str, int | None] = {**_NO_USAGE, "usage_unreadable": 1}


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON both engines store (for attempts and usage, which must never fail):
    NaN and infinities become strings (``"nan"``, ``"inf"``), integers beyond 64 bits their
    decimal text, non-string keys text, other objects their ``repr``, and anything nested deeper
    than ``ATTEMPT_JSON_DEPTH`` a string rendering of it."""
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, int):
        return int(value) if -_INT64 <= value < _INT64 else _int_text(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if depth >= ATTEMPT_JSON_DEPTH and isinstance(value, Mapping | list | tuple):
        return _render(value)
    if isinstance(value, Mapping):
        return {
            (key if isinstance(key, str) else _render(key, 256)): json_safe(inner, depth + 1)
            for key, inner in value.items()
        }
    if isinstance(value, list | tuple):
        return [json_safe(inner, depth + 1) for inner in value]
    return show(value, 4096)


def _text(value: object) -> str | None:
    """A text column's value for an attempt: any string as it is (the codec stores it), other
    objects as their ``str``."""
    if value is None or isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:
        return show(value)


def _small_int(value: object) -> int | None:
    """An integer column's value for an attempt (``None`` when it does not fit 64 bits)."""
    if isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64:
        return int(value)
    return None


def _result_value(value: Any) -> Any:
    """The stored form of one result given to ``record_attempt`` (its content)."""
    if isinstance(value, Mapping) and "content" in value:
        value = value["content"]
    return json_safe(value)


def _attempt_results(calls: Sequence[ToolCall], results: Any) -> tuple[list[Any], list[str]]:
    """One stored result (or ``None``) per call of an attempt, and a note for each result
    that matches no call. Never raises: an attempt is recorded whatever it was given."""
    stored: list[Any] = [None] * len(calls)
    notes: list[str] = []
    if isinstance(results, Mapping):
        for key, value in results.items():
            free = [p for p, c in enumerate(calls) if c.id == key and stored[p] is None]
            if free:
                stored[free[0]] = _result_value(value)
            else:
                notes.append(f"result for id {show(key)}: no call: {_render(value, 4096)}")
    elif isinstance(results, str | bytes) or not isinstance(results, Sequence):
        notes.append(f"results that are not a list or a dict: {_render(results, 4096)}")
    else:
        for p, value in enumerate(results):
            if p < len(calls):
                stored[p] = _result_value(value)
            else:
                notes.append(
                    f"result {p}: the turn has {len(calls)} call(s): {_render(value, 4096)}"
                )
    return stored, notes
