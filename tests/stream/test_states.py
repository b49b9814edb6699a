"""The state machine, table-driven: every (state, trigger) pair."""

from __future__ import annotations

from pathlib import Path

import pytest
from transitions import Machine

from fsm.errors import RemoteProtocolError
from fsm.events import ToolCallAborted, ToolCallFinished, ToolCallTruncated
from fsm.jsonsyntax import JsonSyntax
from fsm.parser import Limits, StreamParser
from fsm.states import (
    ARGUMENT_ENDINGS,
    CALL_FINISH_REASONS,
    CALL_NOT_FINISHED,
    ENDINGS,
    FAILED_STATES,
    FINAL_EVENTS,
    FINAL_STATES,
    FINISH_CLASSES,
    MACHINE,
    MISSING_NAME,
    NO_TOOL_CALLS,
    STREAM_ENDS,
    TRANSITIONS,
    TRIGGERS,
    MachineError,
    StreamState,
    ToolCallState,
    ending,
    ending_table,
    fire,
    mermaid_diagram,
)
from fsm.toolcall import ToolCall
from tests.helpers import docs_extension

S = ToolCallState
# the whole table, written out independently of TRANSITIONS: (state, trigger) -> next state
EXPECTED: dict[tuple[ToolCallState, str], ToolCallState | None] = {
    (S.OPENED, "accumulate"): S.ACCUMULATING,
    (S.OPENED, "finish"): S.FINISHED,
    (S.OPENED, "truncate"): S.TRUNCATED,
    (S.OPENED, "abort"): S.ABORTED,
    (S.ACCUMULATING, "accumulate"): None,  # appending more fragments is not a transition
    (S.ACCUMULATING, "finish"): S.FINISHED,
    (S.ACCUMULATING, "truncate"): S.TRUNCATED,
    (S.ACCUMULATING, "abort"): S.ABORTED,
    **{(final, trigger): None for final in FINAL_STATES for trigger in TRIGGERS},
}


def _call_in(state: ToolCallState) -> ToolCall:
    call = ToolCall(choice=0, ordinal=0, index=0, id="x", name="f", type="")
    call.state = state
    return call


def test_table_covers_every_pair() -> None:
    assert set(EXPECTED) == {(s, t) for s in ToolCallState for t in TRIGGERS}


@pytest.mark.parametrize(("state", "trigger"), sorted(EXPECTED, key=lambda k: (k[0].value, k[1])))
def test_every_state_trigger_pair(state: ToolCallState, trigger: str) -> None:
    call = _call_in(state)
    expected = EXPECTED[(state, trigger)]
    if expected is None:
        with pytest.raises(MachineError):
            fire(call, trigger)
        assert call.state is state
    else:
        fire(call, trigger)
        assert call.state is expected


def test_one_shared_transitions_machine_with_no_models() -> None:
    assert isinstance(MACHINE, Machine)
    assert MACHINE.models == []
    calls = [_call_in(S.OPENED) for _ in range(100)]
    for call in calls:
        fire(call, "accumulate")
    assert MACHINE.models == []  # driving calls registers nothing per call
    assert not MACHINE.auto_transitions


def test_final_states_have_no_way_out() -> None:
    for _trigger, sources, _dest in TRANSITIONS:
        assert not FINAL_STATES & set(sources)


def test_manual_diagram_is_generated_from_the_machine() -> None:
    """The manual's state diagram is generated from the machine at each build (docs/_ext:
    ``_generated/state-diagram.md``, included by docs/reference/states.md): it cannot go stale."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    page = (docs / "reference" / "states.md").read_text()
    assert "```{include} ../_generated/state-diagram.md" in page
    assert "stateDiagram-v2" not in page  # no hand-made copy beside it
    assert docs_extension().generated_pages()["state-diagram.md"] == (
        f"```{{mermaid}}\n{mermaid_diagram()}```\n"
    )


def test_diagram_lists_every_transition() -> None:
    text = mermaid_diagram()
    for trigger, sources, dest in TRANSITIONS:
        for source in sources:
            assert f"{source.value} --> {dest.value}: {trigger}" in text


# -- the ending table (fsm.states.ENDINGS), every row driven through a real parser -------------

#: the table written out independently: (how, finish class) -> (trigger, reason) where trigger
#: None means "by the arguments" and reason None "the stream's own reason"
EXPECTED_ENDINGS: dict[tuple[str, str | None], tuple[str | None, str | None]] = {
    ("done", None): (None, None),
    ("done", "stop"): (None, None),
    ("done", "length"): ("truncate", "length"),
    ("done", "content_filter"): ("abort", "content_filter"),
    ("eof", None): ("abort", "eof"),
    ("eof", "stop"): (None, None),
    ("eof", "length"): ("truncate", "length"),
    ("eof", "content_filter"): ("abort", "content_filter"),
    **{
        (how, finish): ("abort", None)
        for how in ("error", "aborted", "protocol_error", "limit")
        for finish in (None, "stop", "length", "content_filter")
    },
}
#: the reason each failing end gives in the driver below
_STREAM_REASONS = {
    "error": "boom",
    "aborted": "cancelled here",
    "protocol_error": "protocol_error",
    "limit": "limit:max_choices",
}
#: finish_reason values standing for each class ("stop": any normal or unknown value)
_FINISH_VALUES: dict[str | None, tuple[str | None, ...]] = {
    None: (None,),
    "stop": ("stop", "tool_calls", "function_call", "something_new"),
    "length": ("length",),
    "content_filter": ("content_filter",),
}


def test_ending_table_is_the_expected_table() -> None:
    assert {k: tuple(v) for k, v in ENDINGS.items()} == EXPECTED_ENDINGS
    assert set(ENDINGS) == {(h, f) for h in STREAM_ENDS for f in FINISH_CLASSES}


def _ended(how: str, finish: str | None, arguments: str) -> StreamParser:
    parser = StreamParser(limits=Limits(max_choices=1))
    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": arguments}}
    parser.receive_chunk(
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}]}
    )
    if how == "done":
        parser.receive_chunk("[DONE]")
    elif how == "eof":
        parser.receive_eof()
    elif how == "error":
        parser.receive_chunk({"error": {"message": "boom"}})
    elif how == "aborted":
        parser.abort("cancelled here")
    elif how == "protocol_error":
        with pytest.raises(RemoteProtocolError):
            parser.receive_chunk("not json")
    else:
        parser.receive_chunk({"choices": [{"index": 1, "delta": {"content": "x"}}]})
    assert parser.result().end_how == how
    return parser


@pytest.mark.parametrize(("how", "finish_class"), sorted(EXPECTED_ENDINGS, key=str))
@pytest.mark.parametrize("arguments", ['{"a": 1}', '{"a": '])
def test_every_ending_row(how: str, finish_class: str | None, arguments: str) -> None:
    trigger, reason = EXPECTED_ENDINGS[(how, finish_class)]
    for finish in _FINISH_VALUES[finish_class]:
        assert ending(how, finish) == (trigger, reason)
        turn = _ended(how, finish, arguments).turns[0]
        (call,) = turn.tool_calls
        if trigger is None:  # by the arguments
            if arguments.endswith("}"):
                assert (call.state, call.reason) == (S.FINISHED, None)
                assert turn.complete and turn.incomplete_reason is None
            else:
                assert (call.state, call.reason) == (S.TRUNCATED, "invalid_json")
                assert turn.incomplete_reason == CALL_NOT_FINISHED
        else:
            expected_reason = reason if reason is not None else _STREAM_REASONS[how]
            state = {"truncate": S.TRUNCATED, "abort": S.ABORTED}[trigger]
            assert (call.state, call.reason) == (state, expected_reason)
            assert turn.incomplete_reason == expected_reason
            assert not turn.complete


@pytest.mark.parametrize("finish", ["tool_calls", "function_call"])
def test_call_finish_reason_without_a_call_is_no_tool_calls(finish: str) -> None:
    assert finish in CALL_FINISH_REASONS
    parser = StreamParser()
    parser.receive_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    parser.receive_eof()
    assert parser.turns[0].incomplete_reason == NO_TOOL_CALLS


def test_argument_endings_and_missing_name() -> None:
    assert ARGUMENT_ENDINGS == {
        JsonSyntax.VALID: ("finish", None),
        JsonSyntax.TOO_DEEP: ("abort", "limit:max_json_depth"),
        JsonSyntax.INVALID: ("truncate", "invalid_json"),
    }
    assert MISSING_NAME == ("abort", "missing_name")
    parser = StreamParser()
    parser.receive_chunk(
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}
    )
    parser.receive_chunk("[DONE]")
    (call,) = parser.turns[0].tool_calls
    assert (call.state, call.reason) == (S.ABORTED, "missing_name")


def test_final_event_per_final_state_and_failed_states() -> None:
    assert set(FINAL_EVENTS) == FINAL_STATES
    assert FINAL_EVENTS[S.FINISHED] is ToolCallFinished
    assert FINAL_EVENTS[S.TRUNCATED] is ToolCallTruncated
    assert FINAL_EVENTS[S.ABORTED] is ToolCallAborted
    assert FAILED_STATES == (S.TRUNCATED, S.ABORTED)
    assert set(FAILED_STATES) == FINAL_STATES - {S.FINISHED}
    from fsm.cli.options import FAILED_STATES as CLI_FAILED

    assert tuple(s.value for s in FAILED_STATES) == CLI_FAILED


def test_stream_states() -> None:
    parser = StreamParser()
    assert parser._core.status is StreamState.OPEN
    parser.receive_chunk("[DONE]")
    assert parser._core.status is StreamState.ENDED
    parser.receive_eof()
    assert parser._core.status is StreamState.CLOSED
    failed = StreamParser()
    with pytest.raises(RemoteProtocolError):
        failed.receive_chunk("[")
    assert failed._core.status is StreamState.FAILED
    assert [s.value for s in StreamState] == ["open", "ended", "closed", "failed"]


def test_manual_ending_table_is_generated_from_the_table() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    page = (docs / "reference" / "states.md").read_text()
    assert "```{include} ../_generated/ending-table.md" in page
    assert ending_table().splitlines()[2] not in page  # no hand-made copy beside it
    assert docs_extension().generated_pages()["ending-table.md"] == ending_table() + "\n"


def test_machine_callbacks_take_transitions_own_path() -> None:
    """fire()'s direct path is only for a machine without callbacks: on a machine built the
    same way with a callback added, transitions runs it, and the outcome is the same."""
    from fsm.states import _build_machine

    machine = _build_machine()
    seen: list[tuple[str, str]] = []
    machine.after_state_change.append(
        lambda event: seen.append((event.transition.source, event.transition.dest))
    )
    call = _call_in(S.OPENED)
    machine.events["accumulate"].trigger(call)
    machine.events["finish"].trigger(call)
    assert call.state is S.FINISHED
    assert seen == [("OPENED", "ACCUMULATING"), ("ACCUMULATING", "FINISHED")]
    with pytest.raises(MachineError):
        machine.events["abort"].trigger(call)
    # and on a state's enter callback
    machine = _build_machine()
    machine.get_state(S.ACCUMULATING).on_enter.append(lambda event: seen.append(("enter", "")))
    call = _call_in(S.OPENED)
    machine.events["accumulate"].trigger(call)
    assert call.state is S.ACCUMULATING and seen[-1] == ("enter", "")


# -- the stream's machine and each format's stop signals (issue 28) -------------------------------


@pytest.mark.parametrize("state", list(StreamState))
@pytest.mark.parametrize("trigger", ["end", "fail", "close"])
def test_every_stream_state_trigger_pair(state: StreamState, trigger: str) -> None:
    from fsm.states import STREAM_TRANSITIONS, stream_next

    allowed = {dest for t, sources, dest in STREAM_TRANSITIONS if t == trigger and state in sources}
    if allowed:
        assert stream_next(state, trigger) in allowed
    else:
        with pytest.raises(MachineError, match=f"'{trigger}' is not allowed"):
            stream_next(state, trigger)


def test_the_stream_follows_its_table() -> None:
    """Each public call of the parser moves the stream along STREAM_TRANSITIONS only."""
    from fsm.states import STREAM_INPUT, STREAM_TRANSITIONS

    assert [(t, [s.value for s in src], d.value) for t, src, d in STREAM_TRANSITIONS] == [
        ("end", ["open"], "ended"),
        ("fail", ["ended"], "failed"),
        ("close", ["ended"], "closed"),
    ]
    assert set(STREAM_INPUT) == set(StreamState)
    aborted = StreamParser()
    aborted.abort("gone")
    assert aborted._core.status is StreamState.CLOSED
    assert aborted.abort() == []  # closed: abort is a no-op, no transition
    eof = StreamParser()
    eof.receive_eof()
    assert eof._core.status is StreamState.CLOSED


def test_manual_stream_diagram_and_stop_signals_are_generated() -> None:
    from fsm.states import stop_signal_table, stream_diagram

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "states.md").read_text()
    assert "```{include} ../_generated/stream-diagram.md" in page
    assert "```{include} ../_generated/stop-signals.md" in page
    assert stop_signal_table().splitlines()[2] not in page  # no hand-made copy beside it
    pages = docs_extension().generated_pages()
    assert pages["stream-diagram.md"] == f"```{{mermaid}}\n{stream_diagram()}```\n"
    assert pages["stop-signals.md"] == stop_signal_table() + "\n"
    assert stream_diagram().splitlines()[1:] == [
        "    [*] --> open",
        "    open --> ended: end",
        "    ended --> failed: fail",
        "    ended --> closed: close",
        "    closed --> [*]",
        "    failed --> [*]",
    ]


#: (format, how, stop signal, a Responses response.incomplete) -> (trigger, reason): the rules
#: the turns of fsm.formats.turn wrote as if-chains before STOP_SIGNALS, kept as the reference
_STOP_ROWS = [
    ("responses", "done", "completed", False, None, None),
    ("responses", "done", "completed", True, "abort", "incomplete:completed"),
    ("responses", "done", "max_output_tokens", True, "truncate", "length"),
    ("responses", "done", "content_filter", True, "abort", "content_filter"),
    ("responses", "done", "failed", False, "abort", "incomplete:failed"),
    ("responses", "done", None, False, "abort", "incomplete:None"),
    ("responses", "eof", "completed", False, "abort", "eof"),
    ("responses", "error", "completed", False, "abort", None),
    ("responses", "limit", None, False, "abort", None),
    ("anthropic", "done", "tool_use", False, None, None),
    ("anthropic", "done", "end_turn", False, None, None),
    ("anthropic", "done", "stop_sequence", False, None, None),
    ("anthropic", "done", "max_tokens", False, "truncate", "length"),
    ("anthropic", "done", "model_context_window_exceeded", False, "truncate", "length"),
    ("anthropic", "done", "refusal", False, "abort", "refusal"),
    ("anthropic", "done", "pause_turn", False, "abort", "pause_turn"),
    ("anthropic", "done", "something_new", False, None, None),
    ("anthropic", "done", None, False, None, None),
    ("anthropic", "eof", "tool_use", False, "abort", "eof"),
    ("anthropic", "aborted", "tool_use", False, "abort", None),
]


@pytest.mark.parametrize(("fmt", "how", "signal", "incomplete", "trigger", "reason"), _STOP_ROWS)
def test_each_format_stop_signal_row(
    fmt: str,
    how: str,
    signal: str | None,
    incomplete: bool,
    trigger: str | None,
    reason: str | None,
) -> None:
    from fsm.formats.turn import AnthropicTurn, ResponsesTurn
    from fsm.states import stop_ending
    from fsm.turn import Meta

    assert stop_ending(fmt, how, signal, incomplete=incomplete) == (trigger, reason)
    turn = (ResponsesTurn if fmt == "responses" else AnthropicTurn)(0, Meta())
    turn.finish_reason = signal
    if isinstance(turn, ResponsesTurn):
        turn.incomplete_event = incomplete
    assert turn.ending_row(how) == (trigger, reason)


def test_stop_signal_table_lists_every_signal() -> None:
    from fsm.states import STOP_SIGNALS, stop_signal_table

    table = stop_signal_table()
    for fmt, signals in STOP_SIGNALS.items():
        for signal in signals:
            assert f"| {fmt} | `{signal}` |" in table
