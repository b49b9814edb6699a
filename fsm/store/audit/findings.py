"""The messages' and tool calls' rules checked in Python on the rows the contract SQL flags, with the detail each violation reports (:mod:`fsm.store.audit.integrity`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final

from fsm.states import ToolCallState
from fsm.store.audit.read import (
    as_int,
    as_opt_text,
    as_text,
)
from fsm.store.audit.violations import Violation

_ROLES: Final = ("system", "developer", "user", "assistant", "tool")


def _typed(*values: Any, nullable: Sequence[Any] = ()) -> bool:
    """Whether ``values`` are integers and ``nullable`` integers or NULL (on SQLite, a row with a
    value of another type is the types check's finding, and the structural rules skip it)."""
    return all(type(v) is int for v in values) and all(
        v is None or type(v) is int for v in nullable
    )


def message_violations(row: Any) -> Iterator[Violation]:
    """The violations of one message row of CHECK_MESSAGES (the SQL only picked it)."""
    (cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos, block_end,
     real_id, call_n, a_role, calls, s_role, s_aseq, s_pos) = row  # fmt: skip
    if not (
        isinstance(cid, str)
        and isinstance(role, str)
        and (call_id is None or isinstance(call_id, str))
        and _typed(seq, n_calls, slots_left, nullable=(prev_seq, prev_slots, aseq, pos, block_end))
    ):
        return
    found = list(
        _message_findings(
            cid, seq, role, n_calls, slots_left, prev_seq, prev_slots, call_id, aseq, pos,
            block_end, real_id if isinstance(real_id, str) else None, as_int(call_n),
            as_opt_text(a_role), as_int(calls) or 0, as_opt_text(s_role), as_int(s_aseq), as_int(s_pos),
        )
    )  # fmt: skip
    if not found:  # the SQL picked it for a reason the findings do not name: never call it clean
        found.append(
            Violation(
                as_text(cid),
                seq,
                "invalid_row",
                f"the {role} message at seq {seq} breaks a rule of the schema (n_calls {n_calls}, "
                f"slots_left {slots_left}, prev_seq {prev_seq}, prev_slots_left {prev_slots}, "
                f"tool_call_id {as_opt_text(call_id)!r}, assistant_seq {aseq}, call_position {pos}, "
                f"block_end_seq {block_end})",
            )
        )
    yield from found


def _message_findings(
    cid: str,
    seq: int,
    role: str,
    n_calls: int,
    slots_left: int,
    prev_seq: int | None,
    prev_slots: int | None,
    call_id: str | None,
    aseq: int | None,
    pos: int | None,
    block_end: int | None,
    real_id: str | None,
    call_n: int | None,
    a_role: str | None,
    calls: int,
    s_role: str | None,
    s_aseq: int | None,
    s_pos: int | None,
) -> Iterator[Violation]:
    shown_id = as_opt_text(call_id)
    conversation = as_text(cid)
    tool = role == "tool"
    linked = aseq is not None and pos is not None
    if (
        role not in _ROLES
        or n_calls < 0
        or (role != "assistant" and n_calls != 0)
        or (tool and (call_id is None or not linked))
        or (not tool and (call_id is not None or aseq is not None or pos is not None))
    ):
        yield Violation(
            conversation,
            seq,
            "invalid_row",
            _invalid_row_detail(role, n_calls, shown_id, aseq, pos),
        )
    misplaced = tool and aseq is not None and pos is not None and seq != aseq + 1 + pos
    if misplaced and aseq is not None and pos is not None:
        slot = aseq + 1 + pos
        if s_role == "tool" and (s_aseq, s_pos) == (aseq, pos):
            yield Violation(
                conversation,
                seq,
                "duplicate_result",
                f"a second result (tool_call_id {shown_id!r}) for call {pos} of the assistant "
                f"message at seq {aseq}, whose slot (seq {slot}) holds its result",
            )
        else:
            yield Violation(
                conversation,
                seq,
                "result_misplaced",
                f"the result of call {pos} of the assistant message at seq {aseq} (tool_call_id "
                f"{shown_id!r}) is at seq {seq}, not in its slot (seq {slot})",
            )
    if tool and linked and (real_id is None or a_role != "assistant"):
        what = (
            "which does not exist"
            if real_id is None
            else "whose seq is missing"
            if a_role is None
            else f"whose seq is a {a_role} message"
        )
        yield Violation(
            conversation,
            seq,
            "orphan_result",
            f"the tool result at seq {seq} (tool_call_id {shown_id!r}) answers call {pos} of the "
            f"assistant message at seq {aseq}, {what}",
        )
    elif real_id is not None and real_id != call_id:
        yield Violation(
            conversation,
            seq,
            "result_id_mismatch",
            f"the tool result at seq {seq} has tool_call_id {shown_id!r}, but its call (position "
            f"{pos} of the assistant message at seq {aseq}) has id {as_text(real_id)!r}",
        )
    if role == "assistant" and n_calls > 0 and calls != n_calls:
        yield Violation(
            conversation,
            seq,
            "call_count_mismatch",
            f"the assistant message at seq {seq} declares {n_calls} tool call(s) (n_calls) but "
            f"has {calls} call row(s)",
        )
    open_slots = None
    if tool and linked and not misplaced and call_n is not None and pos is not None:
        open_slots = call_n - 1 - pos
    wrong = _bookkeeping(
        role, seq, n_calls, slots_left, prev_seq, prev_slots, block_end, open_slots
    )
    if wrong:
        yield Violation(
            conversation, seq, "bookkeeping", f"{role} message: {wrong} disagree with the rows"
        )


def _bookkeeping(
    role: str,
    seq: int,
    n_calls: int,
    slots_left: int,
    prev_seq: int | None,
    prev_slots: int | None,
    block_end: int | None,
    open_slots: int | None,
) -> str:
    """Which enforcement columns of a message are wrong ("" when none); ``open_slots`` is the
    number of result slots its block really has after it (results only)."""
    wrong = []
    if (seq == 0) != (prev_seq is None) or (prev_seq is not None and prev_seq != seq - 1):
        wrong.append(f"prev_seq {prev_seq}")
    if (seq > 0) != (prev_slots is not None) or (
        prev_slots is not None and (prev_slots > 0) != (role == "tool")
    ):
        wrong.append(f"prev_slots_left {prev_slots}")
    expected = {"assistant": n_calls, "tool": None if prev_slots is None else prev_slots - 1}
    if slots_left != expected.get(role, 0) or (open_slots is not None and slots_left != open_slots):
        wrong.append(f"slots_left {slots_left}")
    expected_end = seq + n_calls if role == "assistant" and n_calls > 0 else None
    if block_end != expected_end:
        wrong.append(f"block_end_seq {block_end} (expected {expected_end})")
    return ", ".join(wrong)


def call_violations(row: Any) -> Iterator[Violation]:
    """The violations of one call row of CHECK_CALLS (the SQL only picked it)."""
    (cid, aseq, pos, call_id, name, state, n_decl, repaired, no_raw, has_result, a_role, a_n,
     s_role) = row  # fmt: skip
    if not (
        isinstance(cid, str)
        and isinstance(state, str)
        and repaired in (0, 1)
        and _typed(aseq, pos, n_decl)
    ):
        return
    found = list(
        _call_findings(
            as_text(cid), aseq, pos, as_text(call_id), as_text(name), state, n_decl, bool(repaired),
            bool(no_raw), bool(has_result), as_opt_text(a_role), as_int(a_n), as_opt_text(s_role),
        )
    )  # fmt: skip
    if not found:  # never call a row the SQL picked clean
        found.append(
            Violation(
                as_text(cid),
                aseq,
                "invalid_row",
                f"call {pos} (id {as_text(call_id)!r}) of the message at seq {aseq} breaks a rule "
                f"of the schema (assistant_n_calls {n_decl}, state {state!r})",
            )
        )
    yield from found


def _call_findings(
    cid: str,
    aseq: int,
    pos: int,
    call_id: str,
    name: str,
    state: str,
    n_decl: int,
    repaired: bool,
    no_raw: bool,
    has_result: bool,
    a_role: str | None,
    a_n: int | None,
    s_role: str | None,
) -> Iterator[Violation]:
    assistant = a_role == "assistant"
    where = f"call {pos} ({name}, id {call_id!r}) of the " + (
        f"assistant message at seq {aseq}" if assistant else f"message at seq {aseq}"
    )
    if not assistant:
        yield Violation(
            cid,
            aseq,
            "orphan_call",
            f"{where}: seq {aseq} is "
            + ("missing" if a_role is None else f"{_a(a_role)} message, not an assistant message"),
        )
    elif a_n is not None and (pos < 0 or pos >= a_n):
        yield Violation(
            cid, aseq, "call_count_mismatch", f"{where}: the message declares {a_n} call(s)"
        )
    if not has_result:
        held = (
            "is empty"
            if s_role is None
            else "holds the result of another call"
            if s_role == "tool"
            else f"holds {_a(s_role)} message"
        )
        yield Violation(
            cid,
            aseq,
            "missing_result",
            f"{where} has no result: its slot (seq {aseq + 1 + pos}) {held}",
        )
        if s_role is not None and s_role != "tool":
            yield Violation(
                cid,
                aseq + 1 + pos,
                "interleaved",
                f"{_a(s_role)} message sits in the slot of the result of {where}",
            )
    if state != ToolCallState.FINISHED.value:
        yield Violation(cid, aseq, "not_finished", f"{where} is {state}, not finished")
    wrong = []
    if assistant and n_decl != a_n:
        wrong.append(f"assistant_n_calls {n_decl} (the message has {a_n})")
    elif pos >= n_decl:
        wrong.append(f"assistant_n_calls {n_decl} (position {pos})")
    if repaired == no_raw:
        wrong.append(f"repaired {repaired} with raw_arguments {'NULL' if no_raw else 'set'}")
    if wrong:
        yield Violation(cid, aseq, "bookkeeping", f"{where}: {', '.join(wrong)} disagree")


def _a(word: str) -> str:
    """``word`` with its indefinite article."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _invalid_row_detail(
    role: str, n_calls: int, call_id: str | None, aseq: int | None, pos: int | None
) -> str:
    if role not in _ROLES:
        return f"unknown role {role!r}"
    if (n_calls and role != "assistant") or n_calls < 0:
        return f"{role} message with n_calls {n_calls}"
    if role == "tool":
        return (
            f"tool result without its call's link (tool_call_id {call_id!r}, assistant_seq "
            f"{aseq}, call_position {pos})"
        )
    return f"{role} message with a tool result's link fields"
