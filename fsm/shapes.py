"""Every wire shape of a turn, built once: the Chat Completions ``tool_calls`` entry and
assistant message (:func:`tool_call_entry`, :func:`assistant_message`), Responses API input items (:func:`responses_input`,
:func:`to_items`), Anthropic messages (:func:`anthropic_messages`, :func:`to_anthropic`), the
results of a turn's calls in both, and the pairing of calls with their results
(:func:`call_results`); and the ids and inputs the Anthropic API takes (below).

A turn renders for its own format verbatim (encrypted reasoning, thinking signatures, built-in
tool items, ids as first sent). For the other format only what both understand crosses over:
the assistant's text and the client calls; every other item is provider-bound and dropped
(``fsm.formats.PROVIDER_BOUND``).

Anthropic ids and inputs.

The API refuses a ``tool_use`` whose ``id`` (and a ``tool_result`` whose ``tool_use_id``) does
not match ``^[a-zA-Z0-9_-]+$``, a ``tool_use`` id used twice in one request, and a
``tool_use.input`` that is not an object. Other providers send such ids (Kimi K2:
``functions.add:0``, reused in every turn; a lost id is ``""``) and arguments that are JSON
but not objects (``[1, 2]``, ``"x"``, ``3``, ``null``). fsm never rewrites a stored id: only
the *rendering* for Anthropic (``history(format="anthropic")``, ``Turn.to_anthropic()``)
applies this rule, to the ``tool_use`` ids and to the ``tool_result`` ids that answer them, so
every pair still matches:

* an id that matches the pattern, does not start like an encoded id and was not used before in
  the request is sent as it is (every id Anthropic itself produced);
* any other id is sent as :data:`PREFIX` (``fsmid_``) followed by the base64url form (no
  padding) of its UTF-8 bytes; the second use of the same id in one request gets ``fsmid2_``,
  the third ``fsmid3_``, and so on, so ids stay unique;
* :func:`original_id` reverses it: ``original_id(anthropic_id(x, n)) == x`` for every string
  ``x`` (lone surrogates included) and use ``n``;
* an ``input`` that is not an object is sent wrapped as ``{"value": <input>}``
  (:func:`anthropic_input`).

"""

from __future__ import annotations

import base64
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from fsm.errors import ToolResultError
from fsm.jsonutil import loads_strict
from fsm.states import PAUSE_TURN

if TYPE_CHECKING:
    from fsm.types import AssistantMessage, FunctionToolCall

__all__ = [
    "ANTHROPIC_ID_PATTERN", "PREFIX", "VALUE_KEY", "Call", "Turn", "anthropic_id",
    "anthropic_input", "anthropic_messages", "anthropic_safe", "assistant_message",
    "call_results", "original_id", "responses_input", "to_anthropic", "to_items",
    "tool_call_entry",
]  # fmt: skip

Results = Mapping[str, Any] | Sequence[Any] | None


class Call(Protocol):
    """What rendering reads of a tool call (:class:`fsm.toolcall.ToolCall`)."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def arguments(self) -> str: ...
    @property
    def custom(self) -> bool: ...


class Turn(Protocol):
    """What rendering reads of a turn (:class:`fsm.turn.Turn` and the format turns)."""

    @property
    def format(self) -> str: ...
    @property
    def complete(self) -> bool: ...
    @property
    def ended(self) -> bool: ...
    @property
    def incomplete_reason(self) -> str | None: ...
    @property
    def content(self) -> str | None: ...
    @property
    def tool_calls(self) -> Sequence[Call]: ...
    def to_message(self) -> Any: ...
    def output_items(self) -> list[dict[str, Any]]: ...


#: The pattern the Anthropic API requires of ``tool_use.id`` and ``tool_result.tool_use_id``.
ANTHROPIC_ID_PATTERN: Final = re.compile(r"[a-zA-Z0-9_-]+")
#: What an encoded id starts with (``fsmid2_`` ... for later uses of one id).
PREFIX: Final = "fsmid_"
_ENCODED: Final = re.compile(r"fsmid([0-9]*)_")
#: The key a non-object ``tool_use.input`` is wrapped in.
VALUE_KEY: Final = "value"


def anthropic_id(call_id: str, use: int = 1) -> str:
    """The id sent to Anthropic for ``call_id`` at its ``use``-th use in one request (see the
    module docstring)."""
    if (
        use == 1
        and ANTHROPIC_ID_PATTERN.fullmatch(call_id) is not None
        and _ENCODED.match(call_id) is None
    ):
        return call_id
    data = call_id.encode("utf-8", "surrogatepass")
    body = base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")
    return f"fsmid{use if use > 1 else ''}_{body}"


def original_id(sent: str) -> str:
    """The call id an id sent to Anthropic stands for (the inverse of :func:`anthropic_id`;
    an id that was not encoded is itself). ``ValueError`` for a malformed encoded id."""
    match = _ENCODED.match(sent)
    if match is None:
        return sent
    digits = match.group(1)
    if digits and (digits[0] == "0" or digits == "1"):
        raise ValueError(f"{sent!r} is not an id encoded by fsm")
    body = sent[match.end() :]
    try:
        data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        call_id = data.decode("utf-8", "surrogatepass")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{sent!r} is not an id encoded by fsm") from exc
    # only the one form encoding gives (the decoder skips what is not base64url)
    if anthropic_id(call_id, int(digits or 1)) != sent:
        raise ValueError(f"{sent!r} is not an id encoded by fsm")
    return call_id


def anthropic_input(value: Any) -> dict[str, Any]:
    """``tool_use.input`` as Anthropic takes it: an object as it is, anything else wrapped as
    ``{"value": value}``."""
    return value if type(value) is dict else {VALUE_KEY: value}


def anthropic_safe(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (Anthropic messages as fsm renders them: each assistant message's
    ``tool_use`` blocks answered by the ``tool_result`` blocks of the user message after it)
    with every ``tool_use`` id, ``tool_result.tool_use_id`` and ``tool_use.input`` made what the
    API takes, by the module's rule. New message and block objects where something changed;
    the input is not modified."""
    uses: Counter[str] = Counter()
    sent: dict[str, list[str]] = {}  # the last assistant message's ids: original -> sent
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        role = message.get("role")
        blocks: list[Any] = []
        if role == "assistant":
            sent = {}
            for block in content:
                if isinstance(block, Mapping) and block.get("type") == "tool_use":
                    block = dict(block)
                    cid = block.get("id")
                    if isinstance(cid, str):
                        uses[cid] += 1
                        new = anthropic_id(cid, uses[cid])
                        sent.setdefault(cid, []).append(new)
                        block["id"] = new
                    block["input"] = anthropic_input(block.get("input"))
                blocks.append(block)
        else:
            answered: Counter[str] = Counter()
            for block in content:
                if isinstance(block, Mapping) and block.get("type") == "tool_result":
                    cid = block.get("tool_use_id")
                    if isinstance(cid, str):
                        block = dict(block)
                        made = sent.get(cid, [])
                        k = answered[cid]
                        answered[cid] += 1
                        # answers pair with the calls in order; an answer to no call keeps a
                        # first-use form (the API refuses it, as it refuses the original)
                        block["tool_use_id"] = made[k] if k < len(made) else anthropic_id(cid)
                blocks.append(block)
            sent = {}
        out.append({**message, "content": blocks})
    return out


# -- Chat Completions: the tool_calls entry and the assistant message ----------------------------


def tool_call_entry(
    call_id: str, type: str, name: str, arguments: str, *, custom: bool = False
) -> FunctionToolCall:
    """A Chat Completions ``tool_calls[]`` entry: ``{"id", "type", "function": {"name",
    "arguments"}}``; a custom call (free-text input) in the custom shape ``{"id", "type":
    "custom", "custom": {"name", "input"}}``."""
    if custom:
        entry: dict[str, Any] = {
            "id": call_id,
            "type": "custom",
            "custom": {"name": name, "input": arguments},
        }
    else:
        entry = {"id": call_id, "type": type, "function": {"name": name, "arguments": arguments}}
    return cast("FunctionToolCall", entry)


def assistant_message(
    content: str | None,
    *,
    refusal: str | None = None,
    reasoning: str | None = None,
    tool_calls: Sequence[FunctionToolCall] = (),
    function_call: Mapping[str, Any] | None = None,
) -> AssistantMessage:
    """A Chat Completions assistant message: ``content`` (``None`` kept), then ``refusal`` and
    ``reasoning_content`` when given, then ``function_call`` (a legacy call) or ``tool_calls``
    (when there are any)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if refusal is not None:
        message["refusal"] = refusal
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if function_call is not None:
        message["function_call"] = function_call
    elif tool_calls:
        message["tool_calls"] = list(tool_calls)
    return cast("AssistantMessage", message)


# -- a turn rendered for the next request --------------------------------------------------------


def call_results(turn: Turn, results: Results) -> list[tuple[Call, Any]]:
    """Pair each call of ``turn`` (in call order) with its result: ``results`` maps call ids
    to results, or lists them in call order. Raises :class:`~fsm.errors.ToolResultError` unless
    every call has exactly one."""
    calls = turn.tool_calls
    if results is None:
        return []
    if isinstance(results, Mapping):
        ids = [c.id for c in calls]
        if len(set(ids)) != len(ids):
            raise ToolResultError(
                "the turn has calls with the same id; give the results as a list in call order"
            )
        missing = [i for i in ids if i not in results]
        extra = [k for k in results if k not in set(ids)]
        if missing or extra:
            raise ToolResultError(
                f"the results do not answer the turn's calls: missing {missing}, unknown {extra}"
            )
        return [(c, results[c.id]) for c in calls]
    if isinstance(results, str | bytes) or not isinstance(results, Sequence):
        raise ToolResultError(
            "results must be a mapping of call id to result, or a list in call order"
        )
    if len(results) != len(calls):
        raise ToolResultError(
            f"{len(results)} result(s) for {len(calls)} call(s); give one result per call"
        )
    return list(zip(calls, results, strict=True))


def _check(turn: Turn, *, pause_ok: bool) -> None:
    if turn.complete:
        return
    if pause_ok and turn.ended and turn.incomplete_reason == PAUSE_TURN:
        return
    turn.to_message()  # raises IncompleteTurnError, saying why
    raise AssertionError("unreachable")  # pragma: no cover


def responses_input(
    fmt: str,
    items: Sequence[Mapping[str, Any]],
    content: str | None,
    calls: Sequence[Mapping[str, Any]],
    outputs: Sequence[Any] | None = None,
) -> list[dict[str, Any]]:
    """Responses API input items for one assistant turn, from what a store keeps: the turn's
    format ``fmt``, its verbatim ``items`` (:meth:`fsm.turn.Turn.output_items`), its text
    ``content`` and its ``calls`` (mappings with ``id``, ``name``, ``arguments`` and optionally
    ``custom``), then one output item per call for ``outputs`` (in call order).

    A ``responses`` turn is its items verbatim (``status`` dropped from ``custom_tool_call``,
    which the input item does not take); any other turn is a ``message`` with the text and one
    ``function_call`` / ``custom_tool_call`` per call (its provider-bound items dropped)."""
    out: list[dict[str, Any]]
    if fmt == "responses":
        # one level copied (``status`` is dropped below); nested values are shared with
        # ``items``: a deep copy would double the memory of a history of large items
        out = [dict(item) for item in items]
        for item in out:
            if item.get("type") == "custom_tool_call":
                item.pop("status", None)
    else:
        out = []
        if content:
            out.append({"type": "message", "role": "assistant", "content": content})
        for call in calls:
            if call.get("custom"):
                out.append(
                    {"type": "custom_tool_call", "call_id": call["id"], "name": call["name"],
                     "input": call["arguments"]}
                )  # fmt: skip
            else:
                out.append(
                    {"type": "function_call", "call_id": call["id"], "name": call["name"],
                     "arguments": call["arguments"]}
                )  # fmt: skip
    if outputs is not None:
        for call, output in zip(calls, outputs, strict=True):
            kind = "custom_tool_call_output" if call.get("custom") else "function_call_output"
            out.append({"type": kind, "call_id": call["id"], "output": output})
    return out


def _input(call: Mapping[str, Any]) -> Any:
    if call.get("custom"):
        return {"input": call["arguments"]}
    text = call["arguments"]
    return loads_strict(text) if text.strip() else {}


def anthropic_messages(
    fmt: str,
    items: Sequence[Mapping[str, Any]],
    content: str | None,
    calls: Sequence[Mapping[str, Any]],
    outputs: Sequence[Any] | None = None,
) -> list[dict[str, Any]]:
    """Anthropic messages for one assistant turn, from what a store keeps (see
    :func:`responses_input`): the assistant message (an ``anthropic`` turn's blocks verbatim;
    else a text block and one ``tool_use`` per call, ``input`` the parsed arguments, a custom
    call's text as ``{"input": text}``), then, for ``outputs``, ONE user message of
    ``tool_result`` blocks in call order."""
    if fmt == "anthropic":
        blocks = [dict(item) for item in items]  # nested values shared with ``items``
    else:
        blocks = []
        if content:
            blocks.append({"type": "text", "text": content})
        for call in calls:
            blocks.append(
                {"type": "tool_use", "id": call["id"], "name": call["name"], "input": _input(call)}
            )
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": blocks}]
    if outputs is not None and calls:
        messages.append(
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": output}
                for call, output in zip(calls, outputs, strict=True)]}
        )  # fmt: skip
    return messages


def _calls(turn: Turn) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "name": c.name, "arguments": c.arguments, "custom": c.custom}
        for c in turn.tool_calls
    ]


def to_items(turn: Turn, results: Results = None) -> list[Any]:
    """See :meth:`fsm.turn.Turn.to_items`."""
    _check(turn, pause_ok=False)
    pairs = call_results(turn, results)
    return responses_input(
        turn.format, turn.output_items(), turn.content, _calls(turn),
        [out for _, out in pairs] if results is not None else None,
    )  # fmt: skip


def to_anthropic(turn: Turn, results: Results = None) -> list[dict[str, Any]]:
    """See :meth:`fsm.turn.Turn.to_anthropic`."""
    _check(turn, pause_ok=True)
    pairs = call_results(turn, results)
    return anthropic_safe(
        anthropic_messages(
            turn.format, turn.output_items(), turn.content, _calls(turn),
            [out for _, out in pairs] if results is not None else None,
        )
    )  # fmt: skip
