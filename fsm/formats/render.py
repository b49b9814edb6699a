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
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsm.errors import ToolResultError
from fsm.formats.ids import anthropic_safe
from fsm.formats.turn import PAUSE_TURN, Item, ItemTurn

if TYPE_CHECKING:
    from fsm.toolcall import ToolCall
    from fsm.turn import Turn

__all__ = [
    "anthropic_messages", "call_results", "iter_output_items", "output_items", "responses_input",
    "to_anthropic", "to_items",
]  # fmt: skip

Results = Mapping[str, Any] | Sequence[Any] | None


def _texts(item: Item, prefix: str) -> list[tuple[int, str]]:
    return sorted(
        (key[1], text.value())
        for key, text in item.texts.items()
        if type(key) is tuple and key[0] == prefix
    )


def _responses_item(item: Item) -> dict[str, Any]:
    data: dict[str, Any] = item.data  # a fresh copy
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
    data: dict[str, Any] = item.data  # a fresh copy
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
    return list(iter_output_items(turn))


def iter_output_items(turn: Turn) -> Iterator[dict[str, Any]]:
    """The items of :func:`output_items`, decoded one at a time (a writer that serializes each
    before the next holds one decoded item at a time, not the whole turn's)."""
    if not isinstance(turn, ItemTurn):
        return
    make = _responses_item if turn.format == "responses" else _anthropic_block
    for item in turn.ordered_items():
        yield make(item)


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
    from fsm.jsonutil import loads_strict

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
        turn.format, output_items(turn), turn.content, _calls(turn),
        [out for _, out in pairs] if results is not None else None,
    )  # fmt: skip


def to_anthropic(turn: Turn, results: Results = None) -> list[dict[str, Any]]:
    """See :meth:`fsm.turn.Turn.to_anthropic`."""
    _check(turn, pause_ok=True)
    pairs = call_results(turn, results)
    return anthropic_safe(
        anthropic_messages(
            turn.format, output_items(turn), turn.content, _calls(turn),
            [out for _, out in pairs] if results is not None else None,
        )
    )  # fmt: skip
