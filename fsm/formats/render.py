"""Rendering a turn back for the next request: Responses input items
(:meth:`fsm.turn.Turn.to_items`), Anthropic messages (:meth:`fsm.turn.Turn.to_anthropic`), and
the verbatim items themselves (:meth:`fsm.turn.Turn.output_items`).

A turn renders for its own format verbatim (encrypted reasoning, thinking signatures, built-in
tool items, ids as first sent). For the other format only what both understand crosses over:
the assistant's text and the client calls; every other item is provider-bound and dropped
(``fsm.formats.PROVIDER_BOUND``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from fsm.errors import ToolResultError
from fsm.formats.turn import PAUSE_TURN, Item, ItemTurn

if TYPE_CHECKING:
    from fsm.toolcall import ToolCall
    from fsm.turn import Turn

__all__ = ["call_results", "output_items", "to_anthropic", "to_items"]

Results = Mapping[str, Any] | Sequence[Any] | None


def _copy(value: Any) -> Any:
    try:
        return orjson.loads(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        import copy

        return copy.deepcopy(value)


def _texts(item: Item, prefix: str) -> list[tuple[int, str]]:
    return sorted(
        (key[1], text.value())
        for key, text in item.texts.items()
        if type(key) is tuple and key[0] == prefix
    )


def _responses_item(item: Item) -> dict[str, Any]:
    data: dict[str, Any] = _copy(item.data)
    data.update(item.first_ids)
    call = item.call
    if call is not None:
        data["arguments" if item.kind == "function_call" else "input"] = call.arguments
        if call.id:
            data["call_id"] = call.id
        if call.name:
            data["name"] = call.name
    elif not item.done and item.kind == "message":
        content: list[dict[str, Any]] = []
        for key, text in item.texts.items():
            if text.field == 2:  # REFUSAL
                content.append({"type": "refusal", "refusal": text.value()})
            else:
                content.append({"type": "output_text", "text": text.value(), "annotations": []})
            del key
        data["content"] = content
    elif not item.done and item.kind == "reasoning":
        data["summary"] = [{"type": "summary_text", "text": t} for _, t in _texts(item, "s")]
        reasoning = _texts(item, "r")
        if reasoning:
            data["content"] = [{"type": "reasoning_text", "text": t} for _, t in reasoning]
    return data


def _anthropic_block(item: Item) -> dict[str, Any]:
    data: dict[str, Any] = _copy(item.data)
    call = item.call
    if call is not None:
        with contextlib.suppress(ValueError):  # not JSON (incomplete): the block's input stays
            data["input"] = call.input
        if call.id:
            data["id"] = call.id
        if call.name:
            data["name"] = call.name
    elif item.kind == "text":
        text = item.texts.get("text")
        data["text"] = text.value() if text is not None else data.get("text") or ""
    elif item.kind == "thinking":
        thinking = item.texts.get("thinking")
        signature = item.texts.get("signature")
        data["thinking"] = thinking.value() if thinking is not None else data.get("thinking", "")
        data["signature"] = (
            signature.value() if signature is not None else data.get("signature", "")
        )
    return data


def output_items(turn: Turn) -> list[dict[str, Any]]:
    """The turn's items verbatim, in output order (see :meth:`fsm.turn.Turn.output_items`)."""
    if not isinstance(turn, ItemTurn):
        return []
    if turn.format == "responses":
        return [_responses_item(item) for item in turn.ordered_items()]
    return [_anthropic_block(item) for item in turn.ordered_items()]


def call_results(turn: Turn, results: Results) -> list[tuple[ToolCall, Any]]:
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


def to_items(turn: Turn, results: Results = None) -> list[Any]:
    """See :meth:`fsm.turn.Turn.to_items`."""
    _check(turn, pause_ok=False)
    pairs = call_results(turn, results)
    items: list[Any]
    if turn.format == "responses":
        items = output_items(turn)
    else:
        items = []
        content = turn.content
        if content:
            items.append({"type": "message", "role": "assistant", "content": content})
        for call in turn.tool_calls:
            if call.custom:
                items.append(
                    {"type": "custom_tool_call", "call_id": call.id, "name": call.name,
                     "input": call.arguments}
                )  # fmt: skip
            else:
                items.append(
                    {"type": "function_call", "call_id": call.id, "name": call.name,
                     "arguments": call.arguments}
                )  # fmt: skip
    items.extend(call.result_item(output) for call, output in pairs)
    return items


def to_anthropic(turn: Turn, results: Results = None) -> list[dict[str, Any]]:
    """See :meth:`fsm.turn.Turn.to_anthropic`."""
    _check(turn, pause_ok=True)
    pairs = call_results(turn, results)
    if turn.format == "anthropic":
        blocks = output_items(turn)
    else:
        blocks = []
        content = turn.content
        if content:
            blocks.append({"type": "text", "text": content})
        for call in turn.tool_calls:
            value = {"input": call.arguments} if call.custom else call.input
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": value})
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": blocks}]
    if pairs:
        messages.append(
            {"role": "user", "content": [call.result_block(out) for call, out in pairs]}
        )
    return messages
