"""Judging one library's :class:`~_peers.Outcome` against the spec's expected result."""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import Call, Outcome
from .quirks import Turn

__all__ = ["RAISED", "RIGHT", "SYMBOLS", "UNAVAILABLE", "WRONG", "judge", "turns_from_expected"]

RIGHT = "✓"
WRONG = "✗"
RAISED = "E"  # wrong because it raised on a turn that is complete
UNAVAILABLE = "n/a"
SYMBOLS = (RIGHT, WRONG, RAISED, UNAVAILABLE)


def turns_from_expected(entry: dict[str, Any]) -> tuple[Turn, ...]:
    """``expected.json``'s entry for one corpus file, as :class:`Turn` objects."""
    return tuple(
        Turn(
            c["index"],
            c["complete"],
            tuple((t["id"], t["name"], t["arguments"], t["state"]) for t in c["tool_calls"]),
        )
        for c in entry["choices"]
    )


def _show(call: Call | tuple[Any, ...]) -> str:
    if isinstance(call, Call):
        call = (call.id, call.name, call.arguments)
    cid, name, args = call[:3]
    a = args if args is None or len(args) <= 40 else args[:37] + "..."
    return f"{name!r}(id={cid!r}, args={a!r})"


def judge(expected: tuple[Turn, ...], outcome: Outcome) -> tuple[str, str]:
    """``(symbol, why)``: RIGHT when the library's calls are what the spec prescribes.

    * complete turn: the calls it presents as usable are exactly the expected ones (id, name and
      arguments byte-exact; order not judged), none is missing, none is extra, none is flagged.
    * incomplete turn: it presents as usable no call the spec does not end ``finished`` (a call
      it presents must match a ``finished`` one exactly); raising, flagging or dropping is right.
    * raising: right only if every expected turn is incomplete (``E`` otherwise).
    """
    if outcome.raised is not None:
        if all(not t.complete for t in expected):
            return RIGHT, f"raised {outcome.raised}"
        return RAISED, f"raised {outcome.raised}"
    problems: list[str] = []
    seen = set()
    for turn in expected:
        seen.add(turn.index)
        got = outcome.choices.get(turn.index, [])
        usable = [c for c in got if c.usable]
        flagged = [c for c in got if not c.usable]
        want = Counter((i, n, a) for i, n, a, _ in turn.calls)
        have = Counter((c.id, c.name, c.arguments) for c in usable)
        where = f"choice {turn.index}"
        if turn.complete:
            missing = want - have
            extra = have - want
            for call in missing.elements():
                problems.append(f"{where}: missing {_show(call)}")
            for call in extra.elements():
                problems.append(f"{where}: gives {_show(call)}")
            for c in flagged:
                problems.append(f"{where}: flags {_show(c)} ({c.note or 'unusable'})")
        else:
            allowed = Counter((i, n, a) for i, n, a, state in turn.calls if state == "finished")
            for call in usable:
                key = (call.id, call.name, call.arguments)
                if allowed[key] > 0:
                    allowed[key] -= 1
                    continue
                note = f"; {call.note}" if call.note else ""
                problems.append(f"{where}: presents {_show(call)} as usable{note}")
    for index, calls in sorted(outcome.choices.items()):
        if index in seen:
            continue
        for c in calls:
            if c.usable:
                problems.append(f"choice {index} (not in the stream): gives {_show(c)}")
    if problems:
        return WRONG, "; ".join(problems)
    return RIGHT, ""
