"""The replay server's checks (:mod:`fsm.replay`) that a request is exactly what a correct agent loop sends after the previous turn, in each of the three formats."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from fsm.formats.ids import anthropic_input, original_id
from fsm.replay_formats import (
    ANTHROPIC_PATH,
    RESPONSES_PATH,
    StreamFormat,
)
from fsm.replay_script import CHAT_COMPLETIONS_PATH, Sent


def check_tool_round(
    messages: list[dict[str, Any]], previous: Sent, results: Sequence[str] | None
) -> str | None:
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    last = assistants[-1] if assistants else None
    expected_ids = [c[0] for c in previous.calls]
    if last is None:
        return (
            f"no assistant message: the previous turn streamed tool calls {expected_ids} and "
            "the request must carry them back"
        )
    got = messages[last].get("tool_calls")
    if not isinstance(got, list) or not got:
        return (
            f"the last assistant message (messages[{last}]) has no tool_calls; the previous turn "
            f"streamed {expected_ids}"
        )
    if len(got) != len(previous.calls):
        return (
            f"the last assistant message (messages[{last}]) has {len(got)} tool_calls; the "
            f"previous turn streamed {len(previous.calls)}: {expected_ids}"
        )
    for position, (entry, (cid, ctype, name, arguments)) in enumerate(
        zip(got, previous.calls, strict=True)
    ):
        where = f"messages[{last}].tool_calls[{position}]"
        if not isinstance(entry, dict):
            return f"{where} must be an object"
        function = entry.get("function")
        if not isinstance(function, dict):
            return f"{where}.function must be an object"
        for label, value, want in (
            ("id", entry.get("id"), cid),
            ("type", entry.get("type"), ctype),
            ("function.name", function.get("name"), name),
            ("function.arguments", function.get("arguments"), arguments),
        ):
            if value != want:
                return f"{where}.{label} is {value!r}; the stream sent {want!r}"
    for position, (cid, _type, name, _args) in enumerate(previous.calls):
        at = last + 1 + position
        if at >= len(messages):
            return (
                f"the tool result for call {cid!r} ({name}) is missing: messages[{at}] should be "
                f"a tool message with tool_call_id {cid!r}"
            )
        message = messages[at]
        if message.get("role") != "tool":
            return (
                f"messages[{at}] is a {message.get('role')!r} message where the tool result for "
                f"call {cid!r} ({name}) must come (tool messages must immediately follow the "
                "assistant message, one per call, in call order)"
            )
        if message.get("tool_call_id") != cid:
            return (
                f"messages[{at}].tool_call_id is {message.get('tool_call_id')!r}; call "
                f"{position} of the assistant message has id {cid!r}"
            )
        if results is not None:
            if position >= len(results):
                return f"the script expects {len(results)} tool results, the stream had more calls"
            if message.get("content") != results[position]:
                return (
                    f"messages[{at}].content is {message.get('content')!r}; expected "
                    f"{results[position]!r} for call {cid!r} ({name})"
                )
    return None


API_NAMES: Final[dict[StreamFormat, str]] = {
    "chat": "Chat Completions",
    "responses": "Responses API",
    "anthropic": "Anthropic Messages",
}
PATH_OF_FORMAT: Final[dict[StreamFormat, str]] = {
    "chat": CHAT_COMPLETIONS_PATH,
    "responses": RESPONSES_PATH,
    "anthropic": ANTHROPIC_PATH,
}
_RESPONSES_CALLS: Final = {"function": "function_call", "custom": "custom_tool_call"}


def _incomplete(previous: Sent) -> str:
    return (
        f"the previous turn did not end complete ({previous.result.end_how}: "
        f"{previous.result.end_reason}); an incomplete call must not reach history"
    )


def check_responses_round(
    items: list[dict[str, Any]],
    previous_id: Any,
    previous: Sent,
    results: Sequence[str] | None,
) -> str | None:
    ids = {c[0] for c in previous.calls if c[0]}
    if not previous.complete:
        if previous_id is not None and previous_id == previous.response_id:
            return f"previous_response_id {previous_id!r} names a turn that " + _incomplete(
                previous
            )
        for at, item in enumerate(items):
            if item.get("type") in ("function_call", "custom_tool_call") and (
                item.get("call_id") in ids
            ):
                return f"input[{at}] carries call {item.get('call_id')!r}: " + _incomplete(previous)
        return None
    if not previous.calls:
        return None
    chained = previous_id is not None and previous_id == previous.response_id
    outputs: dict[str, list[Any]] = {}
    for item in items:
        if item.get("type") in ("function_call_output", "custom_tool_call_output"):
            outputs.setdefault(str(item.get("call_id")), []).append(item.get("output"))
    if not chained:
        made = [i for i in items if i.get("type") in ("function_call", "custom_tool_call")]
        for cid, kind, name, arguments in previous.calls:
            want = _RESPONSES_CALLS.get(kind, "function_call")
            field_name = "input" if want == "custom_tool_call" else "arguments"
            match = next((i for i in made if i.get("call_id") == cid), None)
            if match is None:
                return (
                    f"the previous turn streamed call {cid!r} ({name}); the input must carry it "
                    f"back as a {want} item (or chain with previous_response_id)"
                )
            for label, value, expected in (
                ("type", match.get("type"), want),
                ("name", match.get("name"), name),
                (field_name, match.get(field_name), arguments),
            ):
                if value != expected:
                    return f"call {cid!r}: {label} is {value!r}; the stream sent {expected!r}"
        turn = previous.turn
        if turn is not None:
            for item in turn.to_items():
                if item.get("type") != "reasoning" or item.get("encrypted_content") is None:
                    continue
                if not any(
                    i.get("type") == "reasoning"
                    and i.get("encrypted_content") == item["encrypted_content"]
                    for i in items
                ):
                    return (
                        f"reasoning item {item.get('id')!r} of the previous turn is missing or "
                        "its encrypted_content was changed: it must be sent back verbatim"
                    )
    if results is not None:
        for position, (cid, _kind, name, _args) in enumerate(previous.calls):
            got = outputs.get(cid, [])
            if position >= len(results):
                return f"the script expects {len(results)} tool results, the stream had more calls"
            if results[position] not in got:
                return (
                    f"the output for call {cid!r} ({name}) is {got!r}; expected "
                    f"{results[position]!r}"
                )
    return None


def _result_text(block: Mapping[str, Any]) -> Any:
    content = block.get("content")
    if isinstance(content, list):
        texts = [b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        return "".join(t for t in texts if isinstance(t, str))
    return content


def _sent_id(value: Any) -> Any:
    """The call id an id sent to Anthropic stands for (fsm.formats.ids), else the value."""
    if not isinstance(value, str):
        return value
    try:
        return original_id(value)
    except ValueError:
        return value


def check_anthropic_round(
    messages: list[dict[str, Any]], previous: Sent, results: Sequence[str] | None
) -> str | None:
    ids = {c[0] for c in previous.calls if c[0]}
    if not previous.complete:
        for at, message in enumerate(messages):
            content = message.get("content")
            for block in content if isinstance(content, list) else []:
                if block.get("type") == "tool_use" and _sent_id(block.get("id")) in ids:
                    return f"messages[{at}] carries tool_use {block.get('id')!r}: " + _incomplete(
                        previous
                    )
        return None
    if not previous.calls:
        return None
    expected_ids = [c[0] for c in previous.calls]
    found = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].get("role") == "assistant"
            and isinstance(messages[i].get("content"), list)
            and any(b.get("type") == "tool_use" for b in messages[i]["content"])
        ),
        None,
    )
    if found is None:
        return (
            f"no assistant message with tool_use blocks: the previous turn streamed tool calls "
            f"{expected_ids} and the request must carry them back"
        )
    at = found
    uses = [b for b in messages[at]["content"] if b.get("type") == "tool_use"]
    # ids and inputs as fsm renders them for Anthropic (fsm.formats.ids): compared by what
    # they stand for
    if [_sent_id(b.get("id")) for b in uses] != expected_ids:
        return (
            f"messages[{at}] has tool_use ids {[b.get('id') for b in uses]}; the previous turn "
            f"streamed {expected_ids}"
        )
    for block, (cid, _kind, name, arguments) in zip(uses, previous.calls, strict=True):
        if block.get("name") != name:
            return f"tool_use {cid!r}: name is {block.get('name')!r}; the stream sent {name!r}"
        wanted: Any
        try:
            wanted = anthropic_input(json.loads(arguments) if arguments.strip() else {})
        except ValueError:
            wanted = arguments
        if block.get("input") != wanted:
            return (
                f"tool_use {cid!r}: input is {block.get('input')!r}; the stream sent {arguments!r}"
            )
    turn = previous.turn
    if turn is not None:
        sent_blocks = turn.to_anthropic()[0]["content"]
        for block in sent_blocks:
            kind = block.get("type")
            if kind not in ("thinking", "redacted_thinking"):
                continue
            if block not in messages[at]["content"]:
                what = "signature" if kind == "thinking" else "data"
                return (
                    f"messages[{at}]: a {kind} block of the previous turn is missing or its "
                    f"{what} was changed: thinking blocks must be sent back verbatim"
                )
    if results is not None and at + 1 < len(messages):
        answers = [
            b for b in messages[at + 1].get("content") or [] if b.get("type") == "tool_result"
        ]
        for position, (cid, _kind, name, _args) in enumerate(previous.calls):
            if position >= len(results):
                return f"the script expects {len(results)} tool results, the stream had more calls"
            if position >= len(answers) or _sent_id(answers[position].get("tool_use_id")) != cid:
                return (
                    f"messages[{at + 1}]: the tool_result blocks must answer the calls in call "
                    f"order; result {position} is not for {cid!r}"
                )
            if _result_text(answers[position]) != results[position]:
                return (
                    f"the tool_result for {cid!r} ({name}) is "
                    f"{_result_text(answers[position])!r}; expected {results[position]!r}"
                )
    return None


def check_no_salvage(messages: list[dict[str, Any]], previous: Sent) -> str | None:
    ids = {c[0] for c in previous.calls if c[0]}
    if not ids:
        return None
    for at, message in enumerate(messages):
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for entry in calls:
                if isinstance(entry, dict) and entry.get("id") in ids:
                    return (
                        f"messages[{at}] carries tool call {entry.get('id')!r} from the previous "
                        f"turn, which did not end complete ({previous.result.end_how}: "
                        f"{previous.result.end_reason}); an incomplete call must not reach history"
                    )
        if message.get("role") == "tool" and message.get("tool_call_id") in ids:
            return (
                f"messages[{at}] is a tool result for {message.get('tool_call_id')!r} from the "
                "previous turn, which did not end complete"
            )
    return None
