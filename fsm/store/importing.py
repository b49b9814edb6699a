"""``import_history``: a whole existing history, in any of the three formats, planned as the
store's own writes before any I/O.

A history is cut into steps: runs of plain messages (written as :meth:`append` writes them) and
turns (an assistant message with its calls, and the results that follow it, written as
:meth:`commit_turn` writes them). Each assistant turn is replayed through
:func:`fsm.completion.parse_completion` as the non-streamed response that carries it, so it
meets the parser's rules (arguments must be JSON, a call must have a name); each result must sit
in its call's slot (right after the assistant message, in call order, with the call's id). Every
check runs here, before the transaction: a history that breaks one is refused whole, with a typed
error naming the message, and nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fsm.completion import parse_completion
from fsm.errors import FsmError
from fsm.parser import ParseResult, Turn
from fsm.store.errors import InvalidMessageError, ResultsError
from fsm.store.plans import TurnPlan, check_conversation_id, plain_rows, plan_turn
from fsm.store.render import check_format

__all__ = [
    "ImportPlan",
    "is_responses_output",
    "plan_import",
    "responses_result",
    "responses_turn",
]

#: the Responses item types that are input, never a model's output
_RESPONSES_INPUT: Final = frozenset({"function_call_output", "custom_tool_call_output"})
#: the Responses item types of a call, by the key of their text
_RESPONSES_CALLS: Final = {"function_call": "arguments", "custom_tool_call": "input"}


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """The writes of one import, in order: ``("append", rows)`` or ``("turn", plan)``."""

    steps: tuple[tuple[str, Any], ...]
    #: how many messages (items) were given
    count: int


def plan_import(
    conversation_id: str, messages: Sequence[Mapping[str, Any]], fmt: object
) -> ImportPlan:
    """Check a whole history and plan its writes (see the module docstring)."""
    check_conversation_id(conversation_id)
    history_format = check_format(fmt)
    if isinstance(messages, Mapping | str | bytes) or not isinstance(messages, Sequence):
        raise InvalidMessageError(
            f"import_history() takes a list of messages, not {type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidMessageError(f"message {i} is not a dict: {message!r:.80}")
    if history_format == "chat":
        steps = _chat(messages)
    elif history_format == "responses":
        steps = _responses(messages)
    else:
        steps = _anthropic(messages)
    return ImportPlan(tuple(steps), len(messages))


class _Steps:
    """The steps being built: plain messages gather into one ``append`` run until a turn."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, Any]] = []
        self.plain: list[Mapping[str, Any]] = []
        self.first = 0

    def add_plain(self, index: int, message: Mapping[str, Any]) -> None:
        if not self.plain:
            self.first = index
        self.plain.append(message)

    def flush(self) -> None:
        if self.plain:
            self.steps.append(("append", plain_rows(self.plain, start=self.first)))
            self.plain = []

    def add_turn(self, index: int, result: ParseResult, results: list[Any]) -> None:
        self.flush()
        self.steps.append(("turn", _plan(index, result, results)))


def _turn(index: int, response: Mapping[str, Any]) -> ParseResult:
    """Message ``index`` parsed as the non-streamed response that carries it."""
    try:
        result = parse_completion(response)
    except FsmError as exc:
        raise InvalidMessageError(f"message {index} is not a valid assistant turn: {exc}") from None
    turn = result.turns[0] if result.turns else None
    if turn is None:
        raise InvalidMessageError(f"message {index} holds no assistant turn")
    if not turn.complete:
        unusable = [
            f"call {c.id!r} ({c.name or 'no name'}) is {c.state.value}"
            + (f" ({c.reason})" if c.reason else "")
            for c in turn.tool_calls
            if c.state.value != "finished"
        ]
        why = "; ".join(unusable) or (turn.incomplete_reason or "it is not complete")
        raise InvalidMessageError(
            f"message {index} cannot go to history: {why} (history holds only usable calls)"
        )
    return result


def _plan(index: int, result: ParseResult, results: list[Any]) -> TurnPlan:
    try:
        return plan_turn(result, results)
    except (ResultsError, InvalidMessageError) as exc:
        raise type(exc)(f"message {index}: {exc}") from None


def _results(
    messages: Sequence[Mapping[str, Any]],
    index: int,
    turn: Turn,
    answer: Any,
    label: Sequence[int] | None = None,
) -> list[Any]:
    """The results in the slots after ``messages[index]``: one per call of ``turn``, in call
    order, each naming its call; ``answer(message) -> (call id, result) | None``; ``label``:
    the number the user gave each of ``messages`` (when they were split)."""

    def number(at: int) -> int:
        return at if label is None else label[at]

    out: list[Any] = []
    for position, call in enumerate(turn.tool_calls):
        at = index + 1 + position
        found = answer(messages[at]) if at < len(messages) else None
        if found is None:
            where = f"message {number(at)}" if at < len(messages) else "the end of the history"
            raise ResultsError(
                f"message {number(index)}: call {call.id!r} ({call.name}) has no result ({where} "
                "is not one): each call's result follows its assistant message, in call order"
            )
        cid, result = found
        if cid != call.id:
            raise ResultsError(
                f"message {number(at)} answers call {cid!r}, but its slot is call {call.id!r} "
                f"({call.name}) of message {number(index)}: results follow their calls, in call "
                "order"
            )
        out.append(result)
    return out


def _stray(messages: Sequence[Mapping[str, Any]], start: int, answer: Any) -> None:
    """A result where no call waits for one is refused."""
    if start < len(messages):
        found = answer(messages[start])
        if found is not None:
            raise ResultsError(
                f"message {start} is a result for call {found[0]!r}, which no assistant message "
                "right before it made"
            )


# -- Chat Completions --------------------------------------------------------------------------
def _chat_answer(message: Mapping[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    if message.get("role") != "tool":
        return None
    return message.get("tool_call_id"), dict(message)


def _chat(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    steps = _Steps()
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") == "assistant" and message.get("tool_calls"):
            body = {k: v for k, v in message.items() if k != "role"}
            completion = {
                "object": "chat.completion",
                "choices": [
                    {"index": 0, "message": body, "finish_reason": "tool_calls"},
                ],
            }
            result = _turn(i, completion)
            turn = result.turns[0]
            steps.add_turn(i, result, _results(messages, i, turn, _chat_answer))
            i += 1 + len(turn.tool_calls)
            continue
        _stray(messages, i, _chat_answer)
        steps.add_plain(i, message)
        i += 1
    steps.flush()
    return steps.steps


# -- Responses ---------------------------------------------------------------------------------
def _is_output(item: Mapping[str, Any]) -> bool:
    """An item a model produced (a turn's part): reasoning, calls, the assistant's message,
    built-in tool items; not input messages nor call outputs."""
    kind = item.get("type")
    if kind in _RESPONSES_INPUT:
        return False
    if kind in (None, "message"):
        return item.get("role") == "assistant"
    return bool(kind != "item_reference")


def _responses_answer(item: Mapping[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    if item.get("type") not in _RESPONSES_INPUT:
        return None
    output = item.get("output")
    return item.get("call_id"), {"content": _from_parts(output, "input_text", "input_image")}


def _responses(items: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    steps = _Steps()
    i = 0
    while i < len(items):
        if _is_output(items[i]):
            end = i
            while end < len(items) and _is_output(items[end]):
                end += 1
            output = [_output_item(item) for item in items[i:end]]
            response = {"object": "response", "status": "completed", "output": output}
            result = _turn(i, response)
            turn = result.turns[0]
            last = end - 1  # the results follow the turn's last item
            steps.add_turn(i, result, _results(items, last, turn, _responses_answer))
            i = end + len(turn.tool_calls)
            continue
        _stray(items, i, _responses_answer)
        item = items[i]
        role = item.get("role")
        if item.get("type") not in (None, "message") or role is None:
            raise InvalidMessageError(
                f"message {i}: an item of type {item.get('type')!r} fsm cannot store outside a turn"
            )
        content = _from_parts(item.get("content"), "input_text", "input_image")
        steps.add_plain(i, {"role": role, "content": content})
        i += 1
    steps.flush()
    return steps.steps


def _output_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """An output item as a response holds it: an assistant message given as a short input
    message (``{"role": "assistant", "content": "..."}``) becomes its output message."""
    out = dict(item)
    if out.get("type") is None and out.get("role") == "assistant":
        content = out.get("content")
        if isinstance(content, str):
            content = [{"type": "output_text", "text": content, "annotations": []}]
        out = {"type": "message", "role": "assistant", "content": content}
    if out.get("type") in _RESPONSES_CALLS and "status" not in out:
        out["status"] = "completed"
    return out


def _from_parts(content: Any, text: str, image: str) -> Any:
    """Input content as the chat content fsm stores: text as it is; text and image parts as
    chat parts (the renderers' inverse)."""
    if not isinstance(content, list):
        return content
    parts: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == text:
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == image and text == "input_text":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        elif kind == image:
            source = part.get("source")
            url = source.get("url") if isinstance(source, Mapping) else None
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append(part)
    return parts


# -- the Responses pieces other layers build on (fsm.integrations' sessions) ---------------------
def is_responses_output(item: Mapping[str, Any]) -> bool:
    """Whether a Responses item is a model's output (a turn's part: reasoning, an assistant
    message, a call, a built-in tool item), not an input message nor a call's output."""
    return _is_output(item)


def responses_result(item: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """``(call id, result content)`` of a ``function_call_output`` /
    ``custom_tool_call_output`` item (its content as ``commit_turn`` takes a result), or
    ``None`` for any other item."""
    found = _responses_answer(item)
    return None if found is None else (found[0], found[1]["content"])


def responses_turn(items: Sequence[Mapping[str, Any]], index: int = 0) -> ParseResult:
    """The model output ``items`` (one turn's, in order) parsed as the non-streamed response
    that carries them, with :meth:`import_history`'s checks (arguments must be JSON, a call
    must have a name: else :class:`~fsm.store.errors.InvalidMessageError` naming message
    ``index``)."""
    output = [_output_item(item) for item in items]
    return _turn(index, {"object": "response", "status": "completed", "output": output})


# -- Anthropic ---------------------------------------------------------------------------------
def _is_result(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("type") == "tool_result"


def _anthropic(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    steps = _Steps()
    expanded: list[Mapping[str, Any]] = []
    origin: list[int] = []
    # a user message's tool_result blocks are one result each (they come first, as the API
    # requires); what follows them is a user message of its own
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, list):
            results = [b for b in content if _is_result(b)]
            rest = [b for b in content if not _is_result(b)]
            if results and content[: len(results)] != results:
                raise ResultsError(
                    f"message {i}: its tool_result blocks must come first in the message"
                )
            expanded.extend(results)
            origin.extend([i] * len(results))
            if rest or not results:
                expanded.append({"role": "user", "content": rest})
                origin.append(i)
        else:
            expanded.append(message)
            origin.append(i)

    def answer(block: Mapping[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        if block.get("type") != "tool_result":
            return None
        content = _from_parts(block.get("content"), "text", "image")
        return block.get("tool_use_id"), {"content": "" if content is None else content}

    j = 0
    while j < len(expanded):
        message = expanded[j]
        i = origin[j]
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            uses = isinstance(content, list) and any(
                isinstance(b, Mapping) and b.get("type") == "tool_use" for b in content
            )
            response = {
                "type": "message",
                "role": "assistant",
                "content": content,
                "stop_reason": "tool_use" if uses else "end_turn",
            }
            result = _turn(i, response)
            turn = result.turns[0]
            results = _results(expanded, j, turn, answer, origin)
            steps.add_turn(i, result, results)
            j += 1 + len(turn.tool_calls)
            continue
        found = answer(message)
        if found is not None:
            raise ResultsError(
                f"message {i}: a tool_result for {found[0]!r}, which the assistant message "
                "right before it did not call"
            )
        content = _from_parts(message.get("content"), "text", "image")
        steps.add_plain(i, {"role": message.get("role"), "content": content})
        j += 1
    steps.flush()
    return steps.steps
