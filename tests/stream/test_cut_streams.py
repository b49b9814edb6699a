"""Cut streams: every recorded stream, cut short at (nearly) every byte offset.

A connection can die anywhere. For each corpus stream the prefix ``raw[:k]`` is fed with one
``receive_data(prefix)`` and then ``receive_eof()`` (and, separately, ``abort("cut")``), and the
outcome is checked against an oracle written from ``shared/spec/parser.md`` alone:

* a cut can only truncate, so a prefix of a valid stream never raises;
* the end of the stream is decided by the complete SSE events in the prefix (WHATWG: an event is
  dispatched by its blank line; a partial event at EOF is discarded and reported as the anomaly
  ``incomplete_event_at_eof``): ``data: [DONE]`` -> ``done``, an error payload -> ``error``, else
  ``eof``;
* per choice, the ending table with the LAST ``finish_reason`` among those complete events:
  before any ``finish_reason`` (and no ``[DONE]``) every call is ``aborted`` (``eof``); after
  ``tool_calls``/``stop``/an unknown value a call is ``finished`` iff its arguments so far are
  valid JSON (else ``truncated``/``invalid_json``); ``length`` -> ``truncated``; ``content_filter``
  -> ``aborted``; a call with no name -> ``aborted`` (``missing_name``);
* so a turn is ``complete`` only at or after its end signal: the end of the first event that
  carries a ``finish_reason`` for the choice (the spec makes EOF after a ``finish_reason`` a
  normal end), or the end of the ``[DONE]`` event;
* what the prefix has assembled is a prefix of what the whole stream assembles (same calls in
  the same opening order, ids either final or still ``""``, names and arguments byte prefixes);
* from the ``[DONE]`` event on, the result is the whole stream's result;
* ``abort("cut")`` before the end makes every call ``aborted`` with reason ``cut`` and no turn
  complete; after the end it changes nothing.

Offsets: every offset of a stream whose every-offset sweep fits a per-stream byte budget, else a
deterministic dense sample (evenly spaced offsets, both sides of event boundaries, and every
offset within 64 bytes of the end and of each event that changes how the stream would end).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest

from fsm import (
    AnomalyDetected,
    Event,
    StreamEnded,
    StreamParser,
    ToolCallAborted,
    ToolCallFinished,
    ToolCallState,
    ToolCallTruncated,
    TurnEnded,
)
from fsm.parser import ParseResult
from tests.helpers import (
    corpus_bytes,
    corpus_files,
    corpus_params,
    need,
    require_corpus,
    strict_json,
)

#: Parsing a prefix costs its length; the every-offset sweep of an N-byte stream costs about
#: N * N / 2 bytes per mode. Streams within this budget get every offset; longer ones a sample
#: whose prefixes add up to about the same.
BYTE_BUDGET = 3_000_000
#: every offset within this many bytes of the end and of each ending-relevant event boundary
NEAR = 64
#: both sides of at most this many event boundaries (evenly chosen) in a sampled stream
MAX_BOUNDARIES = 160

#: the key of ``Oracle.end_signal`` that holds the end of the ``[DONE]`` event
DONE_KEY = -1


# -- the oracle: an independent reading of the recorded stream ---------------------------------


@dataclass
class Ending:
    """What the complete events up to some offset say about the end of the stream."""

    how: str = "eof"  # "done", "error" or "eof"
    reason: str | None = None  # the error message
    finish: dict[int, str] = field(default_factory=dict)  # choice -> last finish_reason


@dataclass
class Oracle:
    raw: bytes
    #: end offset (just after the blank line) of each dispatched event
    ends: list[int]
    #: the ending after each dispatched event (``endings[i]`` after ``ends[i]``)
    endings: list[Ending]
    #: offsets at which EOF discards nothing (no partial line, no data/event field pending)
    clean: set[int]
    #: choice -> end of its first normal finish_reason event; DONE_KEY -> end of [DONE]
    end_signal: dict[int, int]
    #: offsets where the expected ending changes (end of a finish, [DONE] or error event)
    turning_points: list[int]

    def signal(self, choice: int) -> int | None:
        """Where the choice's end signal is: its first normal finish_reason, or [DONE]."""
        points = [self.end_signal.get(choice), self.end_signal.get(DONE_KEY)]
        return min((p for p in points if p is not None), default=None)

    def ending_at(self, k: int) -> Ending:
        i = bisect.bisect_right(self.ends, k)
        return self.endings[i - 1] if i else Ending()


def _error_message(error: Any) -> str:
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    return json.dumps(error, ensure_ascii=False, sort_keys=True)


def build_oracle(raw: bytes) -> Oracle:
    """Frame the recorded stream by hand (the corpus uses LF line ends only) and fold its
    events into endings."""
    assert b"\r" not in raw, "the oracle frames LF-only streams; the corpus changed"
    assert not raw.startswith(b"\xef\xbb\xbf")
    ends: list[int] = []
    endings: list[Ending] = []
    clean = {0}
    end_signal: dict[int, int] = {}
    turning: list[int] = []
    state = Ending()
    data: list[bytes] = []
    event_type = ""
    dirty = False  # a data: or event: line since the last blank line
    pos = 0
    while True:
        nl = raw.find(b"\n", pos)
        if nl < 0:
            break
        line = raw[pos:nl]
        pos = nl + 1
        if line == b"":
            if data or event_type == "error":
                ends.append(pos)
                state = _fold(state, event_type, b"\n".join(data), pos, end_signal, turning)
                endings.append(state)
            data, event_type, dirty = [], "", False
        elif line.startswith(b":"):
            pass
        else:
            name, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if name == b"data":
                data.append(value)
                dirty = True
            elif name == b"event":
                event_type = value.decode()
                dirty = True
        if not dirty:
            clean.add(pos)
    return Oracle(raw, ends, endings, clean, end_signal, turning)


def _fold(
    state: Ending,
    event_type: str,
    data: bytes,
    end: int,
    end_signal: dict[int, int],
    turning: list[int],
) -> Ending:
    if state.how != "eof":
        return state  # after the end nothing counts
    new = Ending(finish=dict(state.finish))
    if data.strip() == b"[DONE]":
        new.how = "done"
        turning.append(end)
        end_signal.setdefault(DONE_KEY, end)
        return new
    if event_type == "error":
        obj = json.loads(data) if data.strip() else None
        new.how = "error"
        if isinstance(obj, dict):
            new.reason = _error_message(obj.get("error", obj))
        else:
            new.reason = data.decode().strip() or "error event without data"
        turning.append(end)
        return new
    if not data.strip():
        return new
    chunk = json.loads(data)
    for choice in chunk.get("choices") or []:
        finish = choice.get("finish_reason")
        if finish:
            new.finish[choice.get("index", 0)] = finish
            turning.append(end)
            if finish not in ("length", "content_filter"):
                end_signal.setdefault(choice.get("index", 0), end)
    if chunk.get("error") is not None:
        new.how = "error"
        new.reason = _error_message(chunk["error"])
        turning.append(end)
    return new


# -- offsets -----------------------------------------------------------------------------------


def cut_offsets(oracle: Oracle) -> list[int]:
    n = len(oracle.raw)
    if n * n // 2 <= BYTE_BUDGET:
        return list(range(n + 1))
    offsets: set[int] = set()
    count = max(200, 2 * BYTE_BUDGET // n)
    offsets.update(round(i * n / (count - 1)) for i in range(count))
    boundaries = [0, *oracle.ends]
    step = max(1, len(boundaries) // MAX_BOUNDARIES)
    chosen = boundaries[::step] + boundaries[-10:]
    for b in chosen:
        offsets.update((b - 2, b - 1, b, b + 1))
    for point in [n, *oracle.turning_points]:
        offsets.update(range(point - NEAR, point + NEAR + 1))
    return sorted(o for o in offsets if 0 <= o <= n)


# -- running -----------------------------------------------------------------------------------


@cache
def whole(name: str) -> ParseResult:
    parser = StreamParser()
    parser.receive_data(corpus_bytes(name))
    parser.receive_eof()
    result = parser.result()
    assert result.error is None
    return result


def expected_call_state(
    call: Any, how: str, reason: str | None, finish: str | None
) -> tuple[ToolCallState, str | None]:
    """The spec's ending table, for one call."""
    if not call.name:
        return ToolCallState.ABORTED, "missing_name"
    if how in ("done", "eof"):
        if finish == "length":
            return ToolCallState.TRUNCATED, "length"
        if finish == "content_filter":
            return ToolCallState.ABORTED, "content_filter"
        if finish is None and how == "eof":
            return ToolCallState.ABORTED, "eof"
        if strict_json(call.raw_arguments):
            return ToolCallState.FINISHED, None
        return ToolCallState.TRUNCATED, "invalid_json"
    assert reason is not None
    return ToolCallState.ABORTED, reason  # an error payload or abort()


def check_final_events(events: list[Event], result: ParseResult) -> None:
    """One final event per call, one TurnEnded per choice, one StreamEnded, last."""
    finals = [
        (e.choice, e.ordinal)
        for e in events
        if isinstance(e, ToolCallFinished | ToolCallTruncated | ToolCallAborted)
    ]
    calls = [(t.index, c.ordinal) for t in result.turns for c in t.tool_calls]
    assert sorted(finals) == sorted(calls)
    assert sorted(e.choice for e in events if isinstance(e, TurnEnded)) == [
        t.index for t in result.turns
    ]
    ended = [e for e in events if isinstance(e, StreamEnded)]
    assert len(ended) == 1
    assert events[-1] is ended[0]
    assert ended[0].complete == result.complete


def check_prefix_of_whole(result: ParseResult, full: ParseResult) -> None:
    """What a prefix assembled is a prefix of what the whole stream assembled."""
    full_turns = {t.index: t for t in full.turns}
    for turn in result.turns:
        assert turn.index in full_turns, f"choice {turn.index} is not in the whole stream"
        full_calls = {c.ordinal: c for c in full_turns[turn.index].tool_calls}
        for call in turn.tool_calls:
            ref = full_calls[call.ordinal]
            assert call.index == ref.index
            assert call.id in ("", ref.id)
            assert ref.name.startswith(call.name)
            assert ref.raw_arguments.startswith(call.raw_arguments)
            assert call.type in (ref.type, "function")
        for attr in ("content", "reasoning", "refusal"):
            mine, theirs = getattr(turn, attr), getattr(full_turns[turn.index], attr)
            assert mine is None or (theirs or "").startswith(mine), attr
    kinds = [
        (a.kind, a.event_number) for a in result.anomalies if a.kind != "incomplete_event_at_eof"
    ]
    full_kinds = [(a.kind, a.event_number) for a in full.anomalies]
    assert kinds == full_kinds[: len(kinds)]


def check_eof_cut(name: str, oracle: Oracle, k: int) -> None:
    raw = oracle.raw
    parser = StreamParser()
    events = parser.receive_data(raw[:k])  # a prefix of a valid stream never raises
    events += parser.receive_eof()
    result = parser.result()
    ending = oracle.ending_at(k)
    where = f"{name} cut at byte {k}/{len(raw)}"

    assert result.error is None, where
    assert result.end_how == ending.how, where
    assert result.end_reason == ending.reason, where
    check_final_events(events, result)
    check_prefix_of_whole(result, whole(name))

    discarded = [a for a in result.anomalies if a.kind == "incomplete_event_at_eof"]
    expect_discard = ending.how == "eof" and k not in oracle.clean
    assert len(discarded) == int(expect_discard), where

    for turn in result.turns:
        finish = ending.finish.get(turn.index)
        assert turn.finish_reason == finish, where
        assert turn.ended, where
        for call in turn.tool_calls:
            expected = expected_call_state(call, ending.how, ending.reason, finish)
            assert (call.state, call.reason) == expected, f"{where}: {call!r}"
            if call.state is not ToolCallState.FINISHED:
                assert not call.repaired
        normal = (
            ending.how in ("done", "eof")
            and finish not in ("length", "content_filter")
            and (finish is not None or ending.how == "done")
        )
        all_finished = all(c.state is ToolCallState.FINISHED for c in turn.tool_calls)
        assert turn.complete == (normal and all_finished), where
        if turn.complete:
            signal = oracle.signal(turn.index)
            assert signal is not None, where
            assert k >= signal, f"{where}: complete before the end signal at {signal}"
            turn.to_message()  # a complete turn becomes a message
    if ending.how == "done":
        assert result.to_json()["choices"] == whole(name).to_json()["choices"], where


def check_abort_cut(name: str, oracle: Oracle, k: int) -> None:
    raw = oracle.raw
    parser = StreamParser()
    parser.receive_data(raw[:k])
    events = parser.abort("cut")
    result = parser.result()
    ending = oracle.ending_at(k)
    where = f"{name} aborted at byte {k}/{len(raw)}"
    assert result.error is None, where
    if ending.how != "eof":
        # the stream had already ended: abort() is a no-op
        assert events == [], where
        assert result.end_how == ending.how, where
        return
    assert result.end_how == "aborted", where
    assert result.end_reason == "cut", where
    assert not result.complete, where
    check_final_events(events, result)
    for turn in result.turns:
        assert turn.finish_reason == ending.finish.get(turn.index), where
        assert not turn.complete, where
        for call in turn.tool_calls:
            expected = (ToolCallState.ABORTED, "cut" if call.name else "missing_name")
            assert (call.state, call.reason) == expected, f"{where}: {call!r}"
    assert not [a for a in result.anomalies if a.kind == "incomplete_event_at_eof"], where
    assert not any(isinstance(e, AnomalyDetected) for e in events), where


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", corpus_params())
def test_cut_stream_then_eof(name: str | None) -> None:
    name = need(name)
    oracle = build_oracle(corpus_bytes(name))
    assert oracle.ends, "the oracle found no event"
    for k in cut_offsets(oracle):
        check_eof_cut(name, oracle, k)


@pytest.mark.parametrize("name", corpus_params())
def test_cut_stream_then_abort(name: str | None) -> None:
    name = need(name)
    oracle = build_oracle(corpus_bytes(name))
    for k in cut_offsets(oracle):
        check_abort_cut(name, oracle, k)


def test_oracle_agrees_with_the_whole_streams() -> None:
    """The hand-written oracle reads each whole stream as the parser does (guards the oracle)."""
    require_corpus()
    seen_how = set()
    for name in corpus_files():
        raw = corpus_bytes(name)
        oracle = build_oracle(raw)
        ending = oracle.ending_at(len(raw))
        full = whole(name)
        seen_how.add(ending.how)
        assert full.end_how == ending.how, name
        assert {t.index: t.finish_reason for t in full.turns} == {
            i: ending.finish.get(i) for i in (t.index for t in full.turns)
        }, name
        assert len(raw) in oracle.clean, name
    assert seen_how == {"done", "eof", "error"}


def test_sampling_is_dense_where_it_matters() -> None:
    require_corpus()
    name = "vllm/vllm-evroc-kimi-k2.6_empty_tool_calls_arrays_eof_without_finish.sse"
    oracle = build_oracle(corpus_bytes(name))
    offsets = set(cut_offsets(oracle))
    n = len(oracle.raw)
    assert set(range(n - NEAR, n + 1)) <= offsets
    assert len(offsets) >= 200
    small = "openrouter/openrouter-deepinfra-kimi-k2_numeric_string_ids_finish_per_call.sse"
    assert cut_offsets(build_oracle(corpus_bytes(small))) == list(
        range(len(corpus_bytes(small)) + 1)
    )


def test_eof_after_a_per_call_finish_reason_is_a_normal_end() -> None:
    """DeepInfra sends ``finish_reason: tool_calls`` with EACH call. Cut after the first call's
    chunk, the spec's table makes EOF a normal end: the turn is complete with one call. This
    pins that reading (a consumer that needs every call must see ``[DONE]``)."""
    require_corpus()
    name = "openrouter/openrouter-deepinfra-kimi-k2_numeric_string_ids_finish_per_call.sse"
    oracle = build_oracle(corpus_bytes(name))
    first_finish = oracle.turning_points[0]
    parser = StreamParser()
    parser.receive_data(oracle.raw[:first_finish])
    parser.receive_eof()
    turn = parser.turns[0]
    assert turn.complete
    assert [c.name for c in turn.tool_calls] == ["add"]
    assert [c.name for c in whole(name).turns[0].tool_calls] == ["add", "multiply"]
