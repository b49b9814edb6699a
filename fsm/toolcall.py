"""One streamed tool call: it owns appending a fragment, merging id/name/type, and ending.

The JSON helpers live in :mod:`fsm.jsonutil` (re-exported here for old imports)."""

from __future__ import annotations

import re
from typing import Any, Final, Protocol

from fsm.events import (
    Event,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ad_choice,
    ad_delta,
    ad_index,
    ad_ordinal,
)
from fsm.jsonutil import DEFAULT_MAX_JSON_DEPTH, JsonSyntax, is_json, loads_strict, repair_json
from fsm.shapes import tool_call_entry
from fsm.states import FINAL_EVENTS, FINAL_STATES, ToolCallState, fire
from fsm.types import FunctionCall, FunctionMessage, FunctionToolCall, ToolMessage

__all__ = [
    "DEFAULT_MAX_JSON_DEPTH",
    "FLUSH_EVERY",
    "JsonSyntax",
    "ToolCall",
    "is_json",
    "loads_strict",
    "pair_surrogates",
    "repair_json",
    "result_message",
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
        legacy: whether the call came as the deprecated ``delta.function_call`` (the functions
            API): then it is the only call of its choice, its id is ``""`` and its index
            ``None``; the assistant message carries it as ``function_call`` and its result is a
            ``{"role": "function", "name": ..., "content": ...}`` message
            (:func:`result_message`).
    """

    __slots__ = (
        "_blocks",
        "_final_arguments",
        "_name_bytes",
        "_parts",
        "_raw_length",
        "_type",
        "argument_bytes",
        "choice",
        "id",
        "index",
        "legacy",
        "name",
        "ordinal",
        "over_limit",
        "position",
        "reason",
        "repaired",
        "state",
    )

    def __init__(
        self,
        *,
        choice: int,
        ordinal: int,
        index: int | None,
        id: str,
        name: str,
        type: str,
        legacy: bool = False,
    ) -> None:
        self.choice = choice
        self.legacy = legacy
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
        self._name_bytes = _utf8_len(name)
        # Fragments are kept in two levels so that memory stays close to the argument size
        # whatever the fragment size: up to FLUSH_EVERY recent fragments in ``_parts``, joined
        # into one string in ``_blocks`` when that many have come (O(fragment) amortised), and
        # everything joined once when the call ends.
        self._parts: list[str] = []
        self._blocks: list[str] = []
        #: UTF-8 size of the raw arguments received so far (fragments past a limit not counted)
        self.argument_bytes = 0
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
    def final(self) -> bool:
        """Whether the call is in a final state."""
        return self.state in FINAL_STATES

    def to_dict(self) -> FunctionToolCall:
        """The call as the OpenAI ``tool_calls[]`` entry of an assistant message (typed as the
        SDK's function tool call; ``type`` is the provider's, ``"function"`` in practice)."""
        return tool_call_entry(self.id, self.type, self.name, self.arguments)

    #: the Responses output item id of the call (``fc_...``); ``None`` for a Chat Completions or
    #: Anthropic call (:class:`fsm.formats.turn.ItemToolCall` sets it)
    item_id: str | None = None

    @property
    def custom(self) -> bool:
        """Whether the call is a custom tool call (Responses ``custom_tool_call``, Chat
        Completions ``type: "custom"``): its :attr:`arguments` are free text, never parsed as
        JSON. :attr:`type` is then ``"custom"``."""
        return self._type == "custom"

    @property
    def input(self) -> Any:
        """The arguments as a value: the parsed JSON object (``{}`` when the arguments are
        empty), or a custom call's text as is. Raises ``ValueError`` for arguments that are not
        JSON (only a ``finished`` call's are sure to be)."""
        if self.custom:
            return self.arguments
        text = self.arguments
        return loads_strict(text) if text.strip() else {}

    def result_item(self, output: Any) -> dict[str, Any]:
        """The Responses input item that answers this call: ``{"type": "function_call_output",
        "call_id": ..., "output": output}`` (``custom_tool_call_output`` for a custom call)."""
        kind = "custom_tool_call_output" if self.custom else "function_call_output"
        return {"type": kind, "call_id": self.id, "output": output}

    def result_block(self, content: Any, *, is_error: bool = False) -> dict[str, Any]:
        """The Anthropic ``tool_result`` content block that answers this call."""
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": self.id, "content": content}
        if is_error:
            block["is_error"] = True
        return block

    def to_function_call(self) -> FunctionCall:
        """The call as the legacy ``function_call`` of an assistant message."""
        return {"name": self.name, "arguments": self.arguments}

    def __repr__(self) -> str:
        return (
            f"ToolCall(choice={self.choice}, position={self.position}, index={self.index}, "
            f"id={self.id!r}, name={self.name!r}, state={self.state.value}, "
            f"reason={self.reason!r}, arguments={self.arguments!r})"
        )

    # -- driving (used by the parser and the turn) --------------------------------------------
    def append(self, fragment: str, nbytes: int) -> Event:
        """Append one non-empty argument fragment of ``nbytes`` UTF-8 bytes (the caller checked
        the limits) and return its :class:`~fsm.events.ToolCallArgumentsDelta`. The only append
        path: O(fragment), and a trigger only for the first fragment."""
        if self.state is _OPENED:
            fire(self, "accumulate")
        parts = self._parts
        parts.append(fragment)
        if len(parts) >= FLUSH_EVERY:
            self._blocks.append("".join(parts))
            self._parts = []
        self.argument_bytes += nbytes
        event = _new_event(ToolCallArgumentsDelta)
        ad_choice(event, self.choice)
        ad_ordinal(event, self.ordinal)
        ad_index(event, self.index)
        ad_delta(event, fragment)
        return event

    def exceed(self, limit: str, *, drop: bool = False) -> None:
        """Mark the call past ``limit``: its later fragments are dropped and it ends
        ``aborted`` (reason ``limit:<limit>``); ``drop`` forgets the arguments held."""
        self.over_limit = f"limit:{limit}"
        if drop:
            self._drop()

    def merge(self, cid: str | None, name: str | None, typ: str | None, sink: HeaderSink) -> bool:
        """Merge a delta's id, name and type into the call (spec "Merging fields into a call").

        The id is set once (an empty string never overwrites), a name fragment equal to the
        whole name is a repeat and anything else non-empty is appended, the type is set once.
        ``sink`` counts the bytes (``False``: the stream ended), learns a new id and a limit
        passed. Returns whether the id or name changed (a ``ToolCallUpdated`` is due)."""
        # Past a limit the call's header fragments are dropped. A name is at most
        # max_name_bytes (512), so appending a fragment copies at most that much: linear in
        # the bytes received.
        if self.over_limit is not None:
            return False
        changed = False
        if cid and not self.id:
            size = _utf8_len(cid)
            if not self._fits(sink, size, 0, "id", "max_id_bytes", sink.max_id_bytes):
                return False
            self.id = cid
            sink.header_id_set(self)
            changed = True
        if name and name != self.name:
            size = _utf8_len(name)
            held = self._name_bytes
            if not self._fits(sink, size, held, "name", "max_name_bytes", sink.max_name_bytes):
                return False
            self.name += name
            self._name_bytes += size
            changed = True
        if typ and not self._type:
            size = _utf8_len(typ)
            if not self._fits(sink, size, 0, "type", "max_id_bytes", sink.max_id_bytes):
                return False
            self._type = typ
        return changed

    def _fits(
        self, sink: HeaderSink, size: int, held: int, what: str, limit: str, most: int
    ) -> bool:
        """Whether ``size`` more bytes of a header field (``held`` so far) stay within ``most``
        and the stream's limit; past ``limit``, the sink is told."""
        if held + size > most:
            sink.header_over_limit(self, limit, what, most)
            return False
        return sink.count_header_bytes(size)

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

    def end(self, trigger: str, reason: str | None, repair_suffix: str = "") -> Event:
        """Make the call final (``trigger`` from :mod:`fsm.states`) and return its final event
        (:data:`fsm.states.FINAL_EVENTS`)."""
        raw = self._seal()
        if repair_suffix:
            self._final_arguments = raw + repair_suffix
            self.repaired = True
        self.reason = reason
        fire(self, trigger)
        cls: Any = FINAL_EVENTS[self.state]
        if cls is ToolCallFinished:
            return ToolCallFinished(
                choice=self.choice, ordinal=self.ordinal, position=self.position,
                index=self.index, id=self.id, name=self.name, arguments=self.arguments,
                repaired=self.repaired, raw_length=self._raw_length,
            )  # fmt: skip
        event: Event = cls(
            choice=self.choice, ordinal=self.ordinal, position=self.position, index=self.index,
            id=self.id, name=self.name, arguments=self.arguments, reason=reason or "",
        )  # fmt: skip
        return event


def result_message(call: ToolCall, content: Any) -> ToolMessage | FunctionMessage:
    """The message that answers ``call`` with ``content``: ``{"role": "tool", "tool_call_id":
    ..., "content": ...}``, or for a legacy call (:attr:`ToolCall.legacy`) ``{"role":
    "function", "name": ..., "content": ...}``."""
    if call.legacy:
        return {"role": "function", "name": call.name, "content": content}
    return {"role": "tool", "tool_call_id": call.id, "content": content}


class HeaderSink(Protocol):
    """What :meth:`ToolCall.merge` needs from its parser: the header limits, the stream's byte
    count, and where to report a new id and a limit passed."""

    @property
    def max_id_bytes(self) -> int: ...
    @property
    def max_name_bytes(self) -> int: ...
    def count_header_bytes(self, size: int) -> bool: ...
    def header_id_set(self, call: ToolCall) -> None: ...
    def header_over_limit(self, call: ToolCall, limit: str, what: str, size: int) -> None: ...


_new_event: Final = object.__new__
_OPENED: Final = ToolCallState.OPENED


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
