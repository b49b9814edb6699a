"""The tool-call state machine, declared as data.

This module owns every state rule of a tool call (as h11's ``_state.py`` does for HTTP): the
states, the transitions between them, and the single shared :mod:`transitions` machine that
drives every call. Nothing else in ``fsm`` assigns a call's state.

The machine is built once, with no models attached (``model=None``): a transition is fired for a
call with ``MACHINE.events[trigger].trigger(call)``, which costs nothing per call (no
``add_model``, no per-call bookkeeping). Triggers are fired for state *changes* only, never for
each argument fragment appended while ``accumulating``.
"""

from __future__ import annotations

import enum
from typing import Any, Final

from transitions import Machine, MachineError

__all__ = [
    "FINAL_STATES",
    "MACHINE",
    "TRANSITIONS",
    "TRIGGERS",
    "MachineError",
    "ToolCallState",
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

_LIVE = [ToolCallState.OPENED, ToolCallState.ACCUMULATING]

#: Every transition as ``(trigger, sources, destination)``. This list *is* the machine: the
#: :data:`MACHINE`, the README diagram and the table-driven tests are all built from it.
TRANSITIONS: Final[tuple[tuple[str, tuple[ToolCallState, ...], ToolCallState], ...]] = (
    ("accumulate", (ToolCallState.OPENED,), ToolCallState.ACCUMULATING),
    ("finish", tuple(_LIVE), ToolCallState.FINISHED),
    ("truncate", tuple(_LIVE), ToolCallState.TRUNCATED),
    ("abort", tuple(_LIVE), ToolCallState.ABORTED),
)

#: The trigger names, in declaration order.
TRIGGERS: Final = tuple(t[0] for t in TRANSITIONS)


def _build_machine() -> Machine:
    return Machine(
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

    The README embeds this text; a test fails when the README's copy is stale.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {ToolCallState.OPENED.value}"]
    for trigger, sources, dest in TRANSITIONS:
        for source in sources:
            lines.append(f"    {source.value} --> {dest.value}: {trigger}")
    for state in ToolCallState:
        if state in FINAL_STATES:
            lines.append(f"    {state.value} --> [*]")
    return "\n".join(lines) + "\n"
