"""A parsed Chat Completions stream as the one ``chat.completion`` its provider would have
returned (:meth:`fsm.parser.ParseResult.to_chat_completion`): a drop-in for LiteLLM's
``stream_chunk_builder`` and for the hand-written accumulators that rebuild a response from
chunks.

What the builder keeps is what the parser assembled by its routing rules, so parallel calls stay
separate calls even when the provider sends each one whole at the same ``index`` (Groq, Ollama,
Bedrock: LiteLLM #7621 concatenates them into one call): each call's ``id`` exactly as sent
(``""`` when the provider sent none; never invented), its name, and its ``arguments`` exactly as
the fragments came (only an opt-in ``repair_json=True`` parse appends its repair suffix).

Two things it refuses, each a typed error:

- an **incomplete** turn (a call truncated or aborted, a turn cut by ``length`` or by the
  connection, a stream with no choice): :class:`~fsm.errors.IncompleteTurnError`, as
  :meth:`~fsm.turn.Turn.to_message` raises, so a cut call never looks executable;
- a **Responses or Anthropic** stream: :class:`~fsm.errors.LocalProtocolError`. A
  ``chat.completion`` cannot hold what those turns carry (reasoning items with their encrypted
  content, item ids, thinking signatures, server tool blocks), and the conversion could not
  read back as the same turn; send those turns back with ``turn.to_items()`` /
  ``turn.to_anthropic()`` instead.

The result reads back as the same turns: ``fsm.parse_completion(result.to_chat_completion())``
gives the same content, reasoning, refusal, finish reason and calls (ids, names, arguments,
states), and the same response id, model, ``created``, ``system_fingerprint`` and ``usage``.
Only a call's streaming ``index`` is not part of a ``chat.completion``: the calls are in their
final order.

This module sits with :mod:`fsm.turn` (whose :class:`~fsm.turn.ParseResult` calls it) and reads
a result through the small protocols below, so it imports no parser module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

from fsm.errors import IncompleteTurnError, LocalProtocolError

__all__ = ["ChatCompletionSource", "ChatTurnSource", "chat_completion"]

#: what to use instead, by the stream format a chat.completion cannot hold
_OTHER_FORMATS: Final[dict[str, str]] = {
    "responses": "send its turn back with result.turn().to_items()",
    "anthropic": "send its turn back with result.turn().to_anthropic()",
}


class ChatTurnSource(Protocol):
    """What :func:`chat_completion` reads of a turn (:class:`fsm.turn.Turn` is one)."""

    @property
    def index(self) -> int: ...

    @property
    def finish_reason(self) -> str | None: ...

    def to_message(self, *, include_reasoning: bool = False) -> Mapping[str, Any]: ...


class ChatCompletionSource(Protocol):
    """What :func:`chat_completion` reads of a parse result (:class:`fsm.turn.ParseResult`)."""

    @property
    def response_id(self) -> str | None: ...

    @property
    def model(self) -> str | None: ...

    @property
    def created(self) -> int | None: ...

    @property
    def system_fingerprint(self) -> str | None: ...

    @property
    def usage(self) -> dict[str, Any] | None: ...

    @property
    def format(self) -> str | None: ...

    @property
    def turns(self) -> Sequence[ChatTurnSource]: ...


def chat_completion(result: ChatCompletionSource) -> dict[str, Any]:
    """The ``chat.completion`` dict of a parsed Chat Completions stream.

    ``{"id", "object": "chat.completion", "created", "model", "choices": [{"index",
    "message", "finish_reason"}, ...]}``, plus ``system_fingerprint`` and ``usage`` when the
    stream carried them. Each ``message`` is the turn's assistant message
    (:meth:`~fsm.turn.Turn.to_message` with ``reasoning_content`` when the stream had
    reasoning): ``content``, ``refusal``, and ``tool_calls`` (or a legacy ``function_call``)
    with every id and argument string as the provider sent them.

    Raises :class:`~fsm.errors.IncompleteTurnError` when the stream has no choice or a choice is
    not a complete turn, and :class:`~fsm.errors.LocalProtocolError` for a Responses or
    Anthropic stream (see the module's documentation).
    """
    instead = _OTHER_FORMATS.get(result.format or "")
    if instead is not None:
        raise LocalProtocolError(
            f"to_chat_completion() builds Chat Completions only; this is a {result.format} "
            f"stream, whose items a chat.completion cannot hold: {instead}"
        )
    if not result.turns:
        raise IncompleteTurnError(
            "the stream carried no choice: there is no chat.completion to build (check "
            "result.end_how and result.error)"
        )
    choices = [
        {
            "index": turn.index,
            # raises IncompleteTurnError, naming the choice and its calls, for an incomplete turn
            "message": dict(turn.to_message(include_reasoning=True)),
            "finish_reason": turn.finish_reason,
        }
        for turn in result.turns
    ]
    completion: dict[str, Any] = {
        "id": result.response_id,
        "object": "chat.completion",
        "created": result.created,
        "model": result.model,
        "choices": choices,
    }
    if result.system_fingerprint is not None:
        completion["system_fingerprint"] = result.system_fingerprint
    if result.usage is not None:
        completion["usage"] = result.usage
    return completion
