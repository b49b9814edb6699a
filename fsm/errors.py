"""Typed exceptions of ``fsm``.

Two sides, as in h11: :class:`RemoteProtocolError` means the *stream* broke the rules (the provider
sent something that is not a chat-completion chunk); :class:`LocalProtocolError` means the *caller*
used the API wrongly (fed data after ``receive_eof()``). They share no parent but
:class:`FsmError`, so catching one never hides the other.

For any input, bytes or chunks (deep nesting anywhere, numbers of any length, ``retry:`` fields
of any length, invalid UTF-8), the parser raises only :class:`RemoteProtocolError` and
:class:`LocalProtocolError`, and ``Turn.to_message()`` :class:`IncompleteTurnError`;
``ValueError`` / ``TypeError`` come only from invalid constructor arguments (``Limits(...)``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fsm.exitstatus import EXIT_INCOMPLETE, EXIT_UNUSABLE

__all__ = [
    "FsmError",
    "IncompleteTurnError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "ToolResultError",
]


class FsmError(Exception):
    """Base class of every error ``fsm`` raises on purpose."""

    #: the command line's exit status for this error (:mod:`fsm.exitstatus`); subclasses override it
    exit_code: ClassVar[int] = EXIT_INCOMPLETE


class RemoteProtocolError(FsmError):
    """The stream is not a valid Chat Completions stream.

    Raised for input that is not a chunk at all: invalid JSON, a field of the wrong type
    (``"index": "x"``), ``tool_calls`` that is not a list. When it is raised, every live tool call
    of the stream has become ``aborted`` with reason ``protocol_error``, and every later
    ``receive_*`` call raises this class again.

    ``events`` holds the events the failing ``receive_*`` call produced before it raised
    (deltas of earlier events in the same read, and the final ``ToolCallAborted`` /
    ``TurnEnded`` / ``StreamEnded`` events), so nothing is lost whatever the read boundaries.

    Attributes say where: ``event_number`` (1-based count of SSE events / chunks),
    ``byte_offset`` (offset of the event's first byte in the raw stream, when bytes were fed),
    ``path`` (the JSON path of the offending field, e.g. ``choices[0].delta.tool_calls[1].index``)
    and ``reason`` (why, without the location).
    """

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE

    def __init__(
        self,
        reason: str,
        *,
        event_number: int | None = None,
        byte_offset: int | None = None,
        path: str | None = None,
    ) -> None:
        self.reason = reason
        self.event_number = event_number
        self.byte_offset = byte_offset
        self.path = path
        self.events: list[Any] = []
        where = []
        if event_number is not None:
            where.append(f"event {event_number}")
        if byte_offset is not None:
            where.append(f"byte {byte_offset}")
        if path:
            where.append(path)
        prefix = f"invalid stream at {', '.join(where)}: " if where else "invalid stream: "
        super().__init__(prefix + reason)


class LocalProtocolError(FsmError):
    """The parser was used wrongly (for example fed after ``receive_eof()`` or ``abort()``)."""

    #: the command line's exit status: unusable input
    exit_code: ClassVar[int] = EXIT_UNUSABLE


class IncompleteTurnError(FsmError):
    """A turn that did not end complete was asked for something only a complete turn has.

    ``Turn.to_message()`` and ``ConversationStore.commit_turn()`` raise it: an incomplete turn
    (a call truncated, aborted or without a name, or a stream that never ended normally) must
    never reach history by accident. ``states`` maps each call's position to ``(state, reason)``.
    """

    #: the command line's exit status: the result is incomplete
    exit_code: ClassVar[int] = EXIT_INCOMPLETE

    def __init__(
        self,
        message: str,
        *,
        choice: int | None = None,
        states: dict[int, tuple[str, str | None]] | None = None,
    ) -> None:
        self.choice = choice
        self.states = states or {}
        super().__init__(message)


class ToolResultError(FsmError, ValueError):
    """The results given to ``Turn.to_items(results=...)`` / ``Turn.to_anthropic(results=...)``
    do not answer the turn's calls exactly (a call without a result, a result for no call, or a
    list of the wrong length): the real APIs refuse such a follow-up, so it is never rendered."""
