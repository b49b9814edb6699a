"""Hostile input: every entry of ``tests/stream/hostile_catalog.py`` gets its documented outcome.

Small cases run in-process, fed whole and again in 7-byte pieces (the outcome must not depend
on how the bytes arrive). The resource attacks (100 MB events, a million events) run in a
subprocess that measures peak RSS (``VmHWM``, reset after start-up through
``/proc/self/clear_refs`` so imports cannot hide the growth) and time.
"""

from __future__ import annotations

import collections
import json
import textwrap
from functools import cache
from typing import Any

import pytest

from fsm import (
    IncompleteTurnError,
    Limits,
    LocalProtocolError,
    RemoteProtocolError,
    StreamParser,
    ToolCallState,
)
from tests.helpers import child_json, strict_json
from tests.stream import hostile_catalog as catalog

SPLIT_UP_TO = 200_000  # bytes: cases up to this size are also fed in 7-byte pieces


# -- running a case ----------------------------------------------------------------------------


def make_parser(limits: dict[str, int] | None) -> StreamParser:
    return StreamParser(limits=Limits(**limits) if limits else None)


def run_case(
    case: catalog.Hostile, piece: int | None = None
) -> tuple[StreamParser, RemoteProtocolError | None]:
    """Feed the case (whole, or in ``piece``-byte pieces), then EOF."""
    parser = make_parser(case.limits)
    try:
        if case.sse is not None:
            data = case.sse
            step = piece or len(data) or 1
            for i in range(0, len(data), step):
                parser.receive_data(data[i : i + step])
        else:
            assert case.chunks is not None
            for item in case.chunks:
                parser.receive_chunk(item)
        parser.receive_eof()
    except RemoteProtocolError as exc:
        return parser, exc
    return parser, None


def flat_calls(parser: StreamParser) -> list[dict[str, Any]]:
    return [
        {
            "choice": turn.index,
            "index": c.index,
            "id": c.id,
            "name": c.name,
            "arguments": c.arguments,
            "state": c.state.value,
            "reason": c.reason,
        }
        for turn in parser.result().turns
        for c in turn.tool_calls
    ]


def summary(parser: StreamParser, error: RemoteProtocolError | None) -> dict[str, Any]:
    result = parser.result()
    return {
        "result": result.to_json(),
        "end": (result.end_how, result.end_reason),
        "anomalies": [(a.kind, a.event_number) for a in result.anomalies],
        "error": None
        if error is None
        else (error.path, error.reason, error.event_number, error.byte_offset),
    }


def check_outcome(
    case: catalog.Hostile, parser: StreamParser, error: RemoteProtocolError | None
) -> None:
    expect = case.expect
    note = f" [known bug: {case.known_bug}]" if case.known_bug else ""
    result = parser.result()
    if expect.raises:
        assert error is not None, f"expected RemoteProtocolError, got {result.end_how}{note}"
        assert error.path == expect.error_path, str(error)
        assert expect.error_phrase in str(error), str(error)
        assert error.reason and error.reason in str(error)
        if expect.error_event is not None:
            assert error.event_number == expect.error_event, str(error)
            assert f"event {expect.error_event}" in str(error)
        if case.sse is not None and case.sse.startswith(catalog.OPEN) and expect.error_event == 2:
            assert error.byte_offset == len(catalog.OPEN), str(error)
        assert result.error is error
        assert result.end_how == "protocol_error"
        with pytest.raises(RemoteProtocolError):
            parser.receive_data(b"data: [DONE]\n\n")
    else:
        assert error is None, f"unexpected {error!r}{note}"
    if expect.how is not None:
        assert result.end_how == expect.how, note
        if expect.reason is not None or expect.how in ("done", "eof"):
            assert result.end_reason == expect.reason, note
    kinds = collections.Counter(a.kind for a in result.anomalies)
    wanted = collections.Counter(expect.anomalies)
    assert not wanted - kinds, f"missing anomalies {wanted - kinds} in {kinds}{note}"
    if expect.only_anomalies:
        assert kinds == wanted, f"anomalies {kinds}, expected only {wanted}"
    if expect.calls is not None:
        calls = flat_calls(parser)
        assert len(calls) == len(expect.calls), f"{calls!r}{note}"
        for got, want in zip(calls, expect.calls, strict=True):
            want = {"choice": 0, **want}
            assert {k: got[k] for k in want} == want, f"{got!r}{note}"
    if expect.complete is not None:
        assert result.complete is expect.complete, f"{result.to_json()!r}{note}"
    turns = {t.index: t for t in result.turns}
    for index, attrs in expect.turns.items():
        assert index in turns, f"no choice {index}"
        for name, value in attrs.items():
            assert getattr(turns[index], name) == value, f"choice {index}.{name}{note}"
    if expect.check is not None:
        expect.check(parser)
    # whatever the input: every call final, a finished call has JSON arguments, and only a
    # complete turn becomes a message
    for turn in result.turns:
        assert turn.ended
        for c in turn.tool_calls:
            assert c.final
            if c.state is ToolCallState.FINISHED:
                assert strict_json(c.arguments), f"finished with {c.arguments[:80]!r}{note}"
        if turn.complete:
            turn.to_message()
        else:
            with pytest.raises(IncompleteTurnError):
                turn.to_message()


# -- the catalog, in-process -------------------------------------------------------------------


def test_catalog_is_large_and_well_formed() -> None:
    ids = [c.id for c in catalog.CASES] + [c.id for c in catalog.BIG]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(catalog.CASES) + len(catalog.BIG) >= 40
    assert len(catalog.wrong_type_cases()) >= 60
    for case in catalog.CASES:
        assert case.why, case.id
        assert (case.sse is None) != (case.chunks is None), case.id
    for big in catalog.BIG:
        assert callable(getattr(catalog, big.pieces)), big.id
    assert Limits().max_tool_calls == 1024  # the catalog's expectations assume the defaults
    assert Limits().max_event_bytes == 16 * catalog.MiB


@pytest.mark.parametrize("case", catalog.CASES, ids=lambda c: c.id)
def test_hostile_case(case: catalog.Hostile) -> None:
    parser, error = run_case(case)
    check_outcome(case, parser, error)


@pytest.mark.parametrize(
    "case",
    [c for c in catalog.CASES if c.sse is not None and len(c.sse) <= SPLIT_UP_TO],
    ids=lambda c: c.id,
)
def test_hostile_case_outcome_does_not_depend_on_splits(case: catalog.Hostile) -> None:
    whole = summary(*run_case(case))
    assert summary(*run_case(case, piece=7)) == whole


@pytest.mark.parametrize(
    ("sse", "path"),
    [(s, p) for _, s, p in catalog.wrong_type_cases()],
    ids=[i for i, _, _ in catalog.wrong_type_cases()],
)
def test_wrong_type_at_every_field(sse: bytes, path: str) -> None:
    parser = StreamParser()
    with pytest.raises(RemoteProtocolError) as info:
        parser.receive_data(sse)
    error = info.value
    assert error.path == path, str(error)
    assert error.event_number == 2
    assert error.byte_offset == len(catalog.OPEN)
    assert f"{path}:" in str(error)
    (call,) = parser.turns[0].tool_calls
    assert (call.state, call.reason) == (ToolCallState.ABORTED, "protocol_error")
    with pytest.raises(RemoteProtocolError):
        parser.receive_eof()


def test_wrong_types_are_not_accepted_via_chunks_either() -> None:
    for _, sse, path in catalog.wrong_type_cases():
        chunk = json.loads(sse[len(catalog.OPEN) :].removeprefix(b"data: "))
        parser = StreamParser()
        parser.receive_data(catalog.OPEN)
        with pytest.raises(RemoteProtocolError) as info:
            parser.receive_chunk(chunk)
        assert info.value.path == path


def test_api_misuse_after_hostile_input_is_local() -> None:
    """After a hostile stream that ended (limit, error payload), feeding after EOF is the
    caller's mistake: LocalProtocolError, never the remote class."""
    for case_id in ("max-event-bytes-small", "error-object-is-a-string", "done-twice"):
        case = next(c for c in catalog.CASES if c.id == case_id)
        parser, error = run_case(case)
        assert error is None
        with pytest.raises(LocalProtocolError):
            parser.receive_data(b"data: {}\n\n")


# -- the big ones, in a subprocess -------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import collections, ctypes, gc, json, resource, sys, time
    from tests.stream import hostile_catalog as catalog
    from fsm import Limits, RemoteProtocolError, StreamParser

    def status_kib(key):
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith(key):
                        return int(line.split()[1])
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def reset_peak():
        # Give freed start-up memory back first (else the parser reuses it unseen), then reset
        # VmHWM to the current RSS (Linux >= 4.0 "5" into clear_refs), so the start-up peak
        # (imports, building the catalog) cannot hide the growth.
        gc.collect()
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            return True
        except OSError:
            return False

    case = catalog.BY_ID[sys.argv[1]]
    pieces = getattr(catalog, case.pieces)()
    first = next(pieces)
    parser = StreamParser(limits=Limits(**case.limits) if case.limits else None)
    reset = reset_peak()
    baseline = status_kib("VmHWM:")
    start = time.perf_counter()
    error = None
    total = 0
    try:
        total += len(first)
        parser.receive_data(first)
        for piece in pieces:
            total += len(piece)
            parser.receive_data(piece)
        parser.receive_eof()
    except RemoteProtocolError as exc:
        error = str(exc)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM:")
    result = parser.result()
    turn = result.turns[0] if result.turns else None
    calls = turn.tool_calls if turn else []
    print(json.dumps({
        "error": error,
        "how": result.end_how,
        "reason": result.end_reason,
        "anomalies": collections.Counter(a.kind for a in result.anomalies),
        "calls": len(calls),
        "call_states": sorted({(c.state.value, c.reason) for c in calls}),
        "content_length": len(turn.content or "") if turn else None,
        "input_mb": total / 2**20,
        "baseline_mb": baseline / 1024,
        "growth_mb": (peak - baseline) / 1024,
        "seconds": seconds,
        "peak_reset": reset,
    }))
    """
)


@cache
def run_big(case_id: str) -> dict[str, Any]:
    case = catalog.BY_ID[case_id]
    out: dict[str, Any] = child_json(CHILD, case_id, timeout=case.max_seconds * 4 + 60)
    return out


def big_params() -> list[Any]:
    return [
        # each in a process of its own, 1 MB to 100 MB: slow (CI runs them: pytest -m slow)
        pytest.param(c, id=c.id, marks=[pytest.mark.slow])
        for c in catalog.BIG
    ]


@pytest.mark.parametrize("case", big_params())
def test_big_outcome(case: catalog.Big) -> None:
    out = run_big(case.id)
    assert out["error"] is None
    assert (out["how"], out["reason"]) == (case.how, case.reason)
    kinds = {k: v for k, v in out["anomalies"].items() if k not in case.other_anomalies}
    assert kinds == case.anomalies
    count, state = case.calls
    assert out["calls"] == count
    if state is not None:
        assert out["call_states"] == [list(state)]
    if case.content_length is not None:
        assert out["content_length"] == case.content_length


@pytest.mark.parametrize("case", big_params())
def test_big_bounds(case: catalog.Big) -> None:
    """Peak RSS growth and time stay within the case's bounds (printed with ``-s``)."""
    out = run_big(case.id)
    note = f" [known bug: {case.known_bug}]" if case.known_bug else ""
    print(
        f"{case.id}: {out['input_mb']:.0f} MB in {out['seconds']:.2f} s, peak RSS "
        f"{out['baseline_mb']:.0f} MB + {out['growth_mb']:.1f} MB"
    )
    assert out["seconds"] < case.max_seconds, f"{out['seconds']:.1f} s{note}"
    assert out["growth_mb"] < case.max_rss_growth_mb, (
        f"peak RSS grew {out['growth_mb']:.1f} MB (bound {case.max_rss_growth_mb} MB){note}"
    )
