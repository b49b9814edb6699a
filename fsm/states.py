"""The tool-call state machine, declared as data.

This module owns every state decision of the parser, as data (as h11's ``_state.py`` does for
HTTP): a call's states, the transitions between them and the single shared :mod:`transitions`
machine that drives every call; the failure states; the final event of each final state; the
ending table (how the stream ended x the choice's last finish_reason -> trigger and reason,
read by :meth:`fsm.turn.Turn.end` and the agent); and the stream's own states
(:class:`StreamState`). Nothing else in ``fsm`` assigns a call's state or re-derives an ending.

The machine is built once, with no models attached (``model=None``): a transition is fired for a
call with ``MACHINE.events[trigger].trigger(call)``, which costs nothing per call (no
``add_model``, no per-call bookkeeping). Triggers are fired for state *changes* only, never for
each argument fragment appended while ``accumulating``.
"""

from __future__ import annotations

import enum
from typing import Any, Final, NamedTuple

from transitions import Event as _MachineEvent
from transitions import Machine, MachineError

from fsm.events import Event, ToolCallAborted, ToolCallFinished, ToolCallTruncated
from fsm.jsonsyntax import JsonSyntax

__all__ = [
    "ARGUMENT_ENDINGS",
    "CALL_FINISH_REASONS",
    "CALL_NOT_FINISHED",
    "ENDINGS",
    "FAILED_STATES",
    "FINAL_EVENTS",
    "FINAL_STATES",
    "FINISH_CLASSES",
    "KNOWN_FINISH_REASONS",
    "MACHINE",
    "MISSING_NAME",
    "NORMAL_ENDS",
    "NO_TOOL_CALLS",
    "STREAM_ENDS",
    "TRANSITIONS",
    "TRIGGERS",
    "CallEnding",
    "Ending",
    "MachineError",
    "StreamState",
    "ToolCallState",
    "ending",
    "ending_table",
    "fire",
    "mermaid_diagram",
]


class ToolCallState(enum.Enum):
    """The life of one streamed tool call."""

    #: The call exists (a header delta was seen); no argument bytes yet.
    OPENED = "opened"
    #: At least one non-empty argument fragment has been appended.
    ACCUMULATING = "accumulating"
    #: The turn ended normally and the arguments are valid JSON (or empty). Final.
    FINISHED = "finished"
    #: The arguments are known to be incomplete: ``finish_reason`` ``length``, or the turn ended
    #: normally but the arguments are not valid JSON. Final; never executed.
    TRUNCATED = "truncated"
    #: The stream failed, was cancelled or filtered, hit a limit, or the call has no name. Final.
    ABORTED = "aborted"


#: States nothing leaves.
FINAL_STATES: Final = frozenset(
    {ToolCallState.FINISHED, ToolCallState.TRUNCATED, ToolCallState.ABORTED}
)

#: The final states of a call that did not finish (what the audit and ``fsm failures`` list),
#: in declaration order.
FAILED_STATES: Final = tuple(
    state
    for state in ToolCallState
    if state in FINAL_STATES and state is not ToolCallState.FINISHED
)

#: The event class reported when a call reaches each final state.
FINAL_EVENTS: Final[dict[ToolCallState, type[Event]]] = {
    ToolCallState.FINISHED: ToolCallFinished,
    ToolCallState.TRUNCATED: ToolCallTruncated,
    ToolCallState.ABORTED: ToolCallAborted,
}

_LIVE = [ToolCallState.OPENED, ToolCallState.ACCUMULATING]

#: Every transition as ``(trigger, sources, destination)``. This list *is* the machine: the
#: :data:`MACHINE`, the manual's diagram and the table-driven tests are all built from it.
TRANSITIONS: Final[tuple[tuple[str, tuple[ToolCallState, ...], ToolCallState], ...]] = (
    ("accumulate", (ToolCallState.OPENED,), ToolCallState.ACCUMULATING),
    ("finish", tuple(_LIVE), ToolCallState.FINISHED),
    ("truncate", tuple(_LIVE), ToolCallState.TRUNCATED),
    ("abort", tuple(_LIVE), ToolCallState.ABORTED),
)

#: The trigger names, in declaration order.
TRIGGERS: Final = tuple(t[0] for t in TRANSITIONS)


class _Event(_MachineEvent):
    """:class:`transitions.Event` with a direct path for what :data:`MACHINE` is: transitions
    with no condition and no callback (on the transition, its states or the machine), no queue.

    transitions' own ``trigger`` runs about ninety Python calls for such a transition (event
    data, callback lists resolved and run empty, debug logging); the direct path reads the same
    transition table (``self.transitions``, keyed by the source state's name) and sets the
    model's ``state`` to the destination's value, as ``Machine.set_state`` does, in about a
    tenth of the time. Anything else (a trigger not allowed from the state, which raises
    :class:`MachineError`; trigger arguments; a callback, condition or queue added to the
    machine) takes transitions' own path, so the outcome is always the one transitions gives.
    """

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        machine = self.machine
        if not (args or kwargs) and _plain_machine(machine):
            name = _STATE_NAMES.get(getattr(model, "state", None))
            found = None if name is None else self.transitions.get(name)
            if found is not None and len(found) == 1:
                transition = found[0]
                if not (
                    transition.prepare
                    or transition.conditions
                    or transition.before
                    or transition.after
                ):
                    states = machine.states
                    source = states[transition.source]
                    dest = None if transition.dest is None else states.get(transition.dest)
                    if dest is not None and not (
                        source.on_exit or dest.on_enter or getattr(dest, "final", False)
                    ):
                        model.state = dest.value
                        return True
        result: bool = super().trigger(model, *args, **kwargs)
        return result


def _plain_machine(machine: Machine) -> bool:
    """Whether ``machine`` has no machine-wide callback and no queue (see :class:`_Event`).
    Read with ``getattr``: older ``transitions`` releases lack some (0.8.0 has no
    ``on_exception``, ``on_final`` or ``model_attribute``)."""
    return not (
        machine.has_queue
        or machine.prepare_event
        or machine.before_state_change
        or machine.after_state_change
        or machine.finalize_event
        or getattr(machine, "on_exception", None)
        or getattr(machine, "on_final", None)
        or getattr(machine, "model_attribute", "state") != "state"
    )


def _build_machine() -> Machine:
    class _Machine(Machine):
        event_cls = _Event

    return _Machine(
        model=None,
        states=ToolCallState,
        initial=None,
        transitions=[
            {"trigger": trigger, "source": list(sources), "dest": dest}
            for trigger, sources, dest in TRANSITIONS
        ],
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )


#: The name of each state, as the machine's transition table is keyed (``Enum.name`` is a
#: descriptor call; this is one dict lookup).
_STATE_NAMES: Final[dict[Any, str]] = {state: state.name for state in ToolCallState}

#: The one machine shared by every tool call of every parser.
MACHINE: Final = _build_machine()


def fire(call: Any, trigger: str) -> None:
    """Fire ``trigger`` for ``call`` (an object with a ``state`` attribute).

    Raises :class:`transitions.MachineError` when ``trigger`` is not allowed from the call's
    current state (for example anything from a final state).
    """
    MACHINE.events[trigger].trigger(call)


def mermaid_diagram() -> str:
    """Return the state diagram as Mermaid ``stateDiagram-v2`` text, built from :data:`TRANSITIONS`.

    The manual (docs/reference/states.md) shows this text, generated at each build.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {ToolCallState.OPENED.value}"]
    for trigger, sources, dest in TRANSITIONS:
        for source in sources:
            lines.append(f"    {source.value} --> {dest.value}: {trigger}")
    for state in ToolCallState:
        if state in FINAL_STATES:
            lines.append(f"    {state.value} --> [*]")
    return "\n".join(lines) + "\n"


class StreamState(enum.Enum):
    """The life of one stream (of a :class:`~fsm.parser.StreamParser`)."""

    #: Receiving input.
    OPEN = "open"
    #: Ended (``[DONE]``, EOF, an error payload, ``abort()``, a limit); later input is an
    #: anomaly (``data_after_end``) and ignored.
    ENDED = "ended"
    #: Closed by ``receive_eof()`` or ``abort()``: feeding it is a local error.
    CLOSED = "closed"
    #: A protocol error ended it: feeding it raises the same error class again.
    FAILED = "failed"


# -- ending a turn (spec "Ending a turn") ---------------------------------------------------------

#: How a stream can end (``StreamEnded.how``, ``ParseResult.end_how``).
STREAM_ENDS: Final = ("done", "eof", "error", "aborted", "protocol_error", "limit")
#: The ends after which a call may finish: ``[DONE]`` and a clean EOF.
NORMAL_ENDS: Final = ("done", "eof")

#: finish_reason values with a meaning of their own; any other value ends a turn like ``stop``.
KNOWN_FINISH_REASONS: Final = frozenset(
    {"stop", "tool_calls", "function_call", "length", "content_filter"}
)
#: finish_reasons that promise at least one call (with none, the turn is ``no_tool_calls``).
CALL_FINISH_REASONS: Final = frozenset({"tool_calls", "function_call"})

#: The columns of :data:`ENDINGS`: the choice's last finish_reason, as the table reads it.
#: ``"stop"`` stands for ``stop``, ``tool_calls``, ``function_call`` and any unknown value.
FINISH_CLASSES: Final = (None, "stop", "length", "content_filter")


class Ending(NamedTuple):
    """What ending does to a call (and why a turn is incomplete)."""

    #: the trigger fired for every call, or ``None``: decided by each call's arguments
    #: (:data:`ARGUMENT_ENDINGS`).
    trigger: str | None
    #: the reason given to the calls and to the turn (``Turn.incomplete_reason``); ``None``
    #: with a trigger: the stream's own reason (the error message, abort reason or limit).
    reason: str | None


class CallEnding(NamedTuple):
    """How one call ends: the trigger fired and the call's reason."""

    trigger: str
    reason: str | None


_BY_ARGUMENTS: Final = Ending(None, None)

#: The ending table: (how the stream ended, finish class) -> :class:`Ending`.
ENDINGS: Final[dict[tuple[str, str | None], Ending]] = {
    ("done", None): _BY_ARGUMENTS,
    ("done", "stop"): _BY_ARGUMENTS,
    ("done", "length"): Ending("truncate", "length"),
    ("done", "content_filter"): Ending("abort", "content_filter"),
    ("eof", None): Ending("abort", "eof"),
    ("eof", "stop"): _BY_ARGUMENTS,
    ("eof", "length"): Ending("truncate", "length"),
    ("eof", "content_filter"): Ending("abort", "content_filter"),
    **{
        (how, finish): Ending("abort", None)
        for how in STREAM_ENDS
        if how not in NORMAL_ENDS
        for finish in FINISH_CLASSES
    },
}

#: A call of a turn decided by its arguments: their JSON syntax -> :class:`Ending`. ``INVALID``
#: becomes ``finish`` (``repaired``) instead when opt-in repair finds a suffix.
ARGUMENT_ENDINGS: Final[dict[JsonSyntax, CallEnding]] = {
    JsonSyntax.VALID: CallEnding("finish", None),
    JsonSyntax.TOO_DEEP: CallEnding("abort", "limit:max_json_depth"),
    JsonSyntax.INVALID: CallEnding("truncate", "invalid_json"),
}

#: Whatever the row, a call that went past a limit ends ``abort`` with its ``limit:<name>``; and
#: a call with no name (empty or whitespace only) this way.
MISSING_NAME: Final = CallEnding("abort", "missing_name")

#: ``Turn.incomplete_reason`` of a turn ended by arguments: finish_reason ``tool_calls`` or
#: ``function_call`` but no call at all.
NO_TOOL_CALLS: Final = "no_tool_calls"
#: ``Turn.incomplete_reason`` of a turn ended by arguments with a call not ``finished``.
CALL_NOT_FINISHED: Final = "call_not_finished"


def ending(how: str, finish_reason: str | None) -> Ending:
    """The row of :data:`ENDINGS` for a stream that ended ``how`` and a choice whose last
    finish_reason is ``finish_reason``."""
    if finish_reason is not None and finish_reason not in _SPECIAL_FINISH:
        finish_reason = "stop"
    return ENDINGS[(how, finish_reason)]


_SPECIAL_FINISH: Final = frozenset({"length", "content_filter"})


def ending_table() -> str:
    """The ending table as Markdown rows, built from :data:`ENDINGS` (the manual shows it,
    generated at each build)."""
    lines = [
        "| how the stream ended | finish_reason | calls | reason |",
        "|---|---|---|---|",
    ]
    for (how, finish), row in ENDINGS.items():
        calls = "by the arguments" if row.trigger is None else row.trigger
        reason = "-" if row.trigger is None else (row.reason or "the stream's reason")
        lines.append(
            f"| `{how}` | {'none' if finish is None else f'`{finish}`'} | {calls} | {reason} |"
        )
    return "\n".join(lines) + "\n"


# -- each format's stop signals ------------------------------------------------------------------

#: ``Turn.incomplete_reason`` of an Anthropic turn that stopped with ``pause_turn``: send it
#: back as is to let the model continue; nothing is executed
PAUSE_TURN: Final = "pause_turn"
