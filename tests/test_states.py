"""The state machine, table-driven: every (state, trigger) pair."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transitions import Machine

from fsm.states import (
    FINAL_STATES,
    MACHINE,
    TRANSITIONS,
    TRIGGERS,
    MachineError,
    ToolCallState,
    fire,
    mermaid_diagram,
)
from fsm.toolcall import ToolCall

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


def test_readme_diagram_is_generated_from_the_machine() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```mermaid\n(stateDiagram-v2\n.*?)```", readme, re.S)
    assert blocks, "README.md has no mermaid stateDiagram-v2 block"
    assert blocks[0] == mermaid_diagram(), (
        "README.md's state diagram is stale: paste the output of "
        "`python -c 'import fsm.states as s; print(s.mermaid_diagram(), end=\"\")'`"
    )


def test_diagram_lists_every_transition() -> None:
    text = mermaid_diagram()
    for trigger, sources, dest in TRANSITIONS:
        for source in sources:
            assert f"{source.value} --> {dest.value}: {trigger}" in text
