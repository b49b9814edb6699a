"""Every machine of the sans-IO core, declared as data: the tool call's, the stream's, the
ending table and each format's stop signals.

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
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from transitions import Event as _MachineEvent
from transitions import Machine, MachineError

from fsm.events import Event, ToolCallAborted, ToolCallFinished, ToolCallTruncated
from fsm.jsonsyntax import JsonSyntax

__all__ = [
    "ANTHROPIC_LENGTH_STOPS",
    "ANTHROPIC_NORMAL_STOPS",
    "ARGUMENT_ENDINGS",
    "CALL_FINISH_REASONS",
    "CALL_NOT_FINISHED",
    "CALL_STOPS",
    "ENDINGS",
    "EXECUTION_OUTCOMES",
    "EXECUTION_STATES",
    "EXECUTION_TRANSITIONS",
    "FAILED_STATES",
    "FINAL_EVENTS",
    "FINAL_STATES",
    "FINISH_CLASSES",
    "ITEM_EOF",
    "KNOWN_FINISH_REASONS",
    "LEDGER_TURN_STATES",
    "LEDGER_TURN_TRANSITIONS",
    "MACHINE",
    "MISSING_NAME",
    "NORMAL_ENDS",
    "NO_TOOL_CALLS",
    "PAUSE_TURN",
    "STOP_SIGNALS",
    "STREAM_ENDS",
    "STREAM_INPUT",
    "STREAM_TRANSITIONS",
    "TRANSITIONS",
    "TRIGGERS",
    "UNKNOWN_STOP",
    "CallEnding",
    "Ending",
    "MachineError",
    "StreamState",
    "ToolCallState",
    "ending",
    "ending_table",
    "execution_next",
    "fire",
    "ledger_diagram",
    "ledger_turn_next",
    "mermaid_diagram",
    "stop_ending",
    "stop_signal_table",
    "stream_diagram",
    "stream_next",
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


#: The stream's transitions as ``(trigger, sources, destination)``: this list *is* the stream's
#: machine (the stream core follows it through :func:`stream_next`; the manual's diagram,
#: :func:`stream_diagram`, and the tests are built from it). ``end``: ``[DONE]``, EOF, an error
#: event, ``abort()``, a limit or a format's terminal event; ``fail``: a protocol error (the
#: stream ends, then fails); ``close``: ``receive_eof()`` or ``abort()`` after the end.
STREAM_TRANSITIONS: Final[tuple[tuple[str, tuple[StreamState, ...], StreamState], ...]] = (
    ("end", (StreamState.OPEN,), StreamState.ENDED),
    ("fail", (StreamState.ENDED,), StreamState.FAILED),
    ("close", (StreamState.ENDED,), StreamState.CLOSED),
)

#: What input does in each state: read, or counted as an anomaly, or refused with an error.
STREAM_INPUT: Final[dict[StreamState, str]] = {
    StreamState.OPEN: "read",
    StreamState.ENDED: "anomaly data_after_end (ignored)",
    StreamState.CLOSED: "LocalProtocolError",
    StreamState.FAILED: "RemoteProtocolError (the same error again)",
}

_STREAM_NEXT: Final[dict[tuple[StreamState, str], StreamState]] = {
    (source, trigger): dest for trigger, sources, dest in STREAM_TRANSITIONS for source in sources
}


def stream_next(state: StreamState, trigger: str) -> StreamState:
    """The stream's state after ``trigger`` from ``state`` (:data:`STREAM_TRANSITIONS`); raises
    :class:`MachineError` for a trigger the state does not allow."""
    try:
        return _STREAM_NEXT[(state, trigger)]
    except KeyError:
        raise MachineError(
            f"{trigger!r} is not allowed from the stream state {state.value!r}"
        ) from None


def stream_diagram() -> str:
    """The stream's states as Mermaid ``stateDiagram-v2`` text, built from
    :data:`STREAM_TRANSITIONS` (the manual shows it, generated at each build)."""
    return _diagram(
        [s.value for s in StreamState],
        [(t, tuple(s.value for s in sources), d.value) for t, sources, d in STREAM_TRANSITIONS],
    )


def _diagram(states: Sequence[str], table: Sequence[tuple[str, tuple[str, ...], str]]) -> str:
    """Mermaid ``stateDiagram-v2`` text of a machine: ``states`` (the first is the initial
    one; those no transition leaves are final) and its ``(trigger, sources, destination)``."""
    lines = ["stateDiagram-v2", f"    [*] --> {states[0]}"]
    for trigger, sources, dest in table:
        for source in sources:
            lines.append(f"    {source} --> {dest}: {trigger}")
    for state in states:
        if not any(state in sources for _, sources, _ in table):
            lines.append(f"    {state} --> [*]")
    return "\n".join(lines) + "\n"


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
# Chat Completions' stop signal is the choice's finish_reason, read by the ending table itself
# (FINISH_CLASSES). The Responses API and Anthropic Messages each map their own signal to a row
# of that table for a stream that ended normally (``done``); at EOF (no terminal event) their
# calls end aborted (``eof``), and the other ends take the table's row.

#: ``Turn.incomplete_reason`` of an Anthropic turn that stopped with ``pause_turn``: send it
#: back as is to let the model continue; nothing is executed
PAUSE_TURN: Final = "pause_turn"

#: stop reasons of an Anthropic message ended by its arguments
ANTHROPIC_NORMAL_STOPS: Final = frozenset({"tool_use", "end_turn", "stop_sequence"})
#: stop reasons meaning the output was cut by a token limit
ANTHROPIC_LENGTH_STOPS: Final = frozenset({"max_tokens", "model_context_window_exceeded"})

#: How an item format's calls end at EOF without its terminal event.
ITEM_EOF: Final = Ending("abort", "eof")

#: Each format's stop signals -> the row for a stream that ended normally. Responses: the
#: ``finish_reason`` (``completed``, or ``incomplete_details.reason`` of ``response.incomplete``:
#: a ``response.incomplete`` whose reason says ``completed`` is still incomplete); Anthropic: the
#: last ``stop_reason``.
STOP_SIGNALS: Final[dict[str, dict[str, Ending]]] = {
    "responses": {
        "completed": ENDINGS[("done", None)],
        "max_output_tokens": ENDINGS[("done", "length")],
        "content_filter": ENDINGS[("done", "content_filter")],
    },
    "anthropic": {
        **{stop: ENDINGS[("done", None)] for stop in sorted(ANTHROPIC_NORMAL_STOPS)},
        **{stop: ENDINGS[("done", "length")] for stop in sorted(ANTHROPIC_LENGTH_STOPS)},
        "refusal": Ending("abort", "refusal"),
        PAUSE_TURN: Ending("abort", PAUSE_TURN),
    },
}
#: A stop signal a format does not list: Responses' calls end aborted with
#: ``incomplete:<signal>`` (``None`` here); Anthropic's are ended by their arguments.
UNKNOWN_STOP: Final[dict[str, Ending | None]] = {
    "responses": None,
    "anthropic": ENDINGS[("done", None)],
}
#: The stop signals that promise at least one call (with none, the turn is ``no_tool_calls``).
CALL_STOPS: Final[dict[str, frozenset[str]]] = {
    "chat": CALL_FINISH_REASONS,
    "responses": frozenset(),
    "anthropic": frozenset({"tool_use"}),
}


def stop_ending(format: str, how: str, signal: str | None, *, incomplete: bool = False) -> Ending:
    """The row of the ending table for a ``responses`` or ``anthropic`` stream that ended
    ``how`` with the stop ``signal`` (``incomplete``: a Responses ``response.incomplete``
    ended it), by :data:`STOP_SIGNALS`."""
    if how == "eof":
        return ITEM_EOF
    if how != "done":
        return ending(how, None)
    if incomplete and signal == "completed":
        return Ending("abort", f"incomplete:{signal}")
    row = STOP_SIGNALS[format].get(signal) if signal is not None else None
    if row is None:
        row = UNKNOWN_STOP[format] or Ending("abort", f"incomplete:{signal}")
    return row


def stop_signal_table() -> str:
    """Each format's stop signals as Markdown rows, built from :data:`STOP_SIGNALS` (the manual
    shows it, generated at each build)."""
    lines = [
        "| format | stop signal | calls | reason |",
        "|---|---|---|---|",
    ]
    for format, signals in STOP_SIGNALS.items():
        rows = [(f"`{signal}`", row) for signal, row in signals.items()]
        unknown = UNKNOWN_STOP[format]
        rows.append(("any other", unknown or Ending("abort", "incomplete:<signal>")))
        rows.append(("none (EOF)", ITEM_EOF))
        for signal, row in rows:
            calls = "by the arguments" if row.trigger is None else row.trigger
            reason = "-" if row.trigger is None else f"`{row.reason}`"
            lines.append(f"| {format} | {signal} | {calls} | {reason} |")
    return "\n".join(lines) + "\n"


# -- the tool ledger's machines (a pending turn, one call's execution) ---------------------------

#: A pending turn's states (``PendingTurn.state``, ``fsm_pending_turns.state``): ``pending``,
#: waiting for its tools (at most one per conversation); ``committed`` into history;
#: ``abandoned``, kept for audit only.
LEDGER_TURN_STATES: Final = ("pending", "committed", "abandoned")

#: A pending turn's transitions as ``(trigger, sources, destination)``: this list *is* the
#: machine (the ledger's steps check it through :func:`ledger_turn_next`; the manual's diagram,
#: :func:`ledger_diagram`, and the tests are built from it). The steps that record a call
#: (``start``, ``succeed``, ``fail``) and move its owner's lease (``claim``, ``renew``,
#: ``release``) leave it ``pending``; every step needs it ``pending``, except a ``commit`` or an
#: ``abandon`` retried after its acknowledgement was lost, which returns the turn as it is.
LEDGER_TURN_TRANSITIONS: Final[tuple[tuple[str, tuple[str, ...], str], ...]] = (
    ("claim", ("pending",), "pending"),
    ("renew", ("pending",), "pending"),
    ("release", ("pending",), "pending"),
    ("record", ("pending",), "pending"),
    ("commit", ("pending",), "committed"),
    ("abandon", ("pending",), "abandoned"),
)

#: One call's execution states (``CallExecution.state``, ``fsm_tool_executions.state``):
#: never started; ``started`` (the tool may have run); and its recorded outcome.
EXECUTION_STATES: Final = ("not_started", "started", "succeeded", "failed")

#: The outcomes a call's execution ends in: what ``commit`` needs of every call.
EXECUTION_OUTCOMES: Final = ("succeeded", "failed")

#: A call's execution transitions as ``(trigger, sources, destination)``: this list *is* the
#: machine (checked through :func:`execution_next`). ``start`` again from ``started``: the same
#: owner retrying (a no-op) or a new owner after a claim, which runs the tool again (``starts``
#: counts them); an outcome is recorded once, after a start (the same outcome again is a
#: retry, a no-op).
EXECUTION_TRANSITIONS: Final[tuple[tuple[str, tuple[str, ...], str], ...]] = (
    ("start", ("not_started", "started"), "started"),
    ("succeed", ("started",), "succeeded"),
    ("fail", ("started",), "failed"),
)

_LEDGER_NEXT: Final[dict[str, dict[tuple[str, str], str]]] = {
    name: {(source, trigger): dest for trigger, sources, dest in table for source in sources}
    for name, table in (
        ("turn", LEDGER_TURN_TRANSITIONS),
        ("execution", EXECUTION_TRANSITIONS),
    )
}


def ledger_turn_next(state: str, trigger: str) -> str | None:
    """A pending turn's state after ``trigger`` from ``state``
    (:data:`LEDGER_TURN_TRANSITIONS`), or ``None`` when the state does not allow it."""
    return _LEDGER_NEXT["turn"].get((state, trigger))


def execution_next(state: str, trigger: str) -> str | None:
    """A call execution's state after ``trigger`` from ``state``
    (:data:`EXECUTION_TRANSITIONS`), or ``None`` when the state does not allow it."""
    return _LEDGER_NEXT["execution"].get((state, trigger))


def ledger_diagram(machine: str) -> str:
    """The tool ledger's ``"turn"`` or ``"execution"`` machine as Mermaid ``stateDiagram-v2``
    text, built from its transitions (the manual shows both, generated at each build)."""
    states, table = {
        "turn": (LEDGER_TURN_STATES, LEDGER_TURN_TRANSITIONS),
        "execution": (EXECUTION_STATES, EXECUTION_TRANSITIONS),
    }[machine]
    return _diagram(states, table)
