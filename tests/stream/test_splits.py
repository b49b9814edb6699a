"""Split invariance, in the style of h11's tests: how the transport cuts the bytes, or how the
provider cuts the argument strings, must never change what the parser makes of a stream.

For every recorded stream, and for synthetic streams full of multi-byte UTF-8, feeding the bytes
whole, byte by byte, or cut at random points (inside multi-byte characters too) must give the same
result and the same sequence of events (the grouping of events per ``receive_data`` call differs,
so the lists are concatenated before comparing).
"""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm import Event, Limits, RemoteProtocolError, StreamParser
from fsm.parser import ParseResult
from tests.helpers import bytewise, corpus_bytes, corpus_params, cut, need

SETTINGS = settings(max_examples=25, deadline=None)
UNICODE = "héllo wörld 日本 🎉"

# -- running a stream --------------------------------------------------------------------------


def normalise(parser: StreamParser, error: RemoteProtocolError | None) -> dict[str, Any]:
    result: ParseResult = parser.result()
    return {
        "result": result.to_json(),
        "anomaly_kinds": [a.kind for a in result.anomalies],
        "anomaly_events": [a.event_number for a in result.anomalies],
        "end": (result.end_how, result.end_reason),
        "complete": result.complete,
        "created": result.created,
        "system_fingerprint": result.system_fingerprint,
        "raw_arguments": [[c.raw_arguments for c in t.tool_calls] for t in result.turns],
        "error": None if error is None else (str(error), error.event_number, error.byte_offset),
    }


def run_bytes(
    pieces: list[bytes], *, repair_json: bool = False
) -> tuple[dict[str, Any], list[Event]]:
    """Feed ``pieces`` then EOF; return the normalised result and every event, concatenated."""
    parser = StreamParser(repair_json=repair_json)
    events: list[Event] = []
    error = None
    try:
        for piece in pieces:
            events.extend(parser.receive_data(piece))
        events.extend(parser.receive_eof())
    except RemoteProtocolError as exc:
        error = exc
    return normalise(parser, error), events


def run_chunks(chunks: list[Any]) -> dict[str, Any]:
    parser = StreamParser()
    for item in chunks:
        parser.receive_chunk(item)
    parser.receive_eof()
    return normalise(parser, None)


def check_invariant(data: bytes, pieces: list[bytes], *, repair_json: bool = False) -> None:
    assert b"".join(pieces) == data
    expected = run_bytes([data], repair_json=repair_json)
    norm, events = run_bytes(pieces, repair_json=repair_json)
    assert norm == expected[0]
    assert events == expected[1]


# -- the recorded corpus -----------------------------------------------------------------------


@cache
def corpus_reference(name: str) -> tuple[dict[str, Any], list[Event]]:
    return run_bytes([corpus_bytes(name)])


@pytest.mark.parametrize("name", corpus_params())
def test_corpus_reference_is_sane(name: str | None) -> None:
    # guards the invariance tests against comparing two empty results
    name = need(name)
    norm, events = corpus_reference(name)
    assert norm["error"] is None
    assert norm["result"]["choices"], "the stream produced no choice"
    assert events, "the stream produced no event"
    assert norm["end"][0] in ("done", "eof", "error")


@pytest.mark.parametrize("name", corpus_params())
def test_corpus_byte_by_byte(name: str | None) -> None:
    name = need(name)
    data = corpus_bytes(name)
    norm, events = run_bytes(bytewise(data))
    assert norm == corpus_reference(name)[0]
    assert events == corpus_reference(name)[1]


@pytest.mark.parametrize("name", corpus_params())
def test_corpus_crlf_and_cr_line_endings(name: str | None) -> None:
    # the same stream with other WHATWG line endings is the same stream (offsets aside)
    name = need(name)
    data = corpus_bytes(name)
    assert b"\r" not in data
    reference = corpus_reference(name)
    for eol in (b"\r\n", b"\r"):
        norm, events = run_bytes(bytewise(data.replace(b"\n", eol)))
        assert norm["result"] == reference[0]["result"]
        assert norm["end"] == reference[0]["end"]
        assert events == reference[1]


@pytest.mark.parametrize("name", corpus_params())
@SETTINGS
@given(points=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=40))
def test_corpus_random_splits(name: str | None, points: list[int]) -> None:
    name = need(name)
    data = corpus_bytes(name)
    pieces = cut(data, points)
    norm, events = run_bytes(pieces)
    assert norm == corpus_reference(name)[0]
    assert events == corpus_reference(name)[1]


@pytest.mark.parametrize("name", corpus_params())
@settings(max_examples=3, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=5))
def test_corpus_small_irregular_pieces(name: str | None, sizes: list[int]) -> None:
    # many small pieces of varying size (a slow network): every event boundary lands mid-piece
    name = need(name)
    data = corpus_bytes(name)
    pieces, i, k = [], 0, 0
    while i < len(data):
        pieces.append(data[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    norm, events = run_bytes(pieces)
    assert norm == corpus_reference(name)[0]
    assert events == corpus_reference(name)[1]


# -- synthetic streams with multi-byte UTF-8 ---------------------------------------------------


def sse_bytes(items: list[dict[str, Any] | str], *, eol: str = "\n") -> bytes:
    """Chunks as SSE with raw UTF-8 (``ensure_ascii=False``); a str item is sent as-is."""
    out = []
    for item in items:
        text = item if isinstance(item, str) else "data: " + json.dumps(item, ensure_ascii=False)
        out.append(text + eol + eol)
    return "".join(out).encode("utf-8")


def chunk(choice: int = 0, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-ünï",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "modèle-🎉",
        "choices": [{"index": choice, "delta": delta, "finish_reason": finish}],
    }


ARGS_A = json.dumps({"city": "Zürich", "note": UNICODE}, ensure_ascii=False)
ARGS_B = json.dumps({"q": "Ünïcødé ✓ 中文 🚀", "n": [1, 2, {"日": "本"}]}, ensure_ascii=False)


def unicode_stream(eol: str = "\n") -> bytes:
    items: list[dict[str, Any] | str] = [
        ": keep-alive ✓",
        chunk(role="assistant", content=""),
        chunk(reasoning_content="思考中… 🤔"),
        chunk(content=UNICODE[:7]),
        chunk(content=UNICODE[7:]),
        chunk(
            tool_calls=[
                {
                    "index": 0,
                    "id": "call_é",
                    "type": "function",
                    "function": {"name": "wéather", "arguments": ""},
                }
            ]
        ),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": ARGS_A[:13]}}]),
        chunk(
            tool_calls=[
                {
                    "index": 1,
                    "id": "call_日本",
                    "function": {"name": "検索", "arguments": ARGS_B[:9]},
                }
            ]
        ),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": ARGS_A[13:]}}]),
        chunk(tool_calls=[{"index": 1, "function": {"arguments": ARGS_B[9:]}}]),
        chunk(finish="tool_calls"),
        {
            "id": "chatcmpl-ünï",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5},
        },
        "data: [DONE]",
        ": after the end ✓",
    ]
    return sse_bytes(items, eol=eol)


def multibyte_cut_points(data: bytes) -> list[int]:
    """Every position that falls strictly inside a multi-byte UTF-8 character."""
    return [i for i, byte in enumerate(data) if 0x80 <= byte <= 0xBF]


def test_unicode_stream_reference() -> None:
    norm, _ = run_bytes([unicode_stream()])
    assert norm["error"] is None
    assert norm["anomaly_kinds"] == []
    (choice,) = norm["result"]["choices"]
    assert choice["content"] == UNICODE
    assert choice["reasoning"] == "思考中… 🤔"
    assert choice["complete"] is True
    assert [(c["name"], c["id"], c["arguments"], c["state"]) for c in choice["tool_calls"]] == [
        ("wéather", "call_é", ARGS_A, "finished"),
        ("検索", "call_日本", ARGS_B, "finished"),
    ]
    assert norm["result"]["model"] == "modèle-🎉"
    assert len(multibyte_cut_points(unicode_stream())) > 50  # the test below means something


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_unicode_stream_cut_inside_every_multibyte_character(eol: str) -> None:
    data = unicode_stream(eol)
    expected = run_bytes([data])
    for point in multibyte_cut_points(data):
        norm, events = run_bytes([data[:point], data[point:]])
        assert norm == expected[0], f"cut at byte {point}"
        assert events == expected[1], f"cut at byte {point}"


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_unicode_stream_byte_by_byte(eol: str) -> None:
    data = unicode_stream(eol)
    check_invariant(data, bytewise(data))


def test_unicode_stream_line_endings_agree() -> None:
    lf = run_bytes([unicode_stream("\n")])
    for eol in ("\r\n", "\r"):
        other = run_bytes([unicode_stream(eol)])
        assert other[0]["result"] == lf[0]["result"]
        assert other[1] == lf[1]


@SETTINGS
@given(
    points=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=30),
    eol=st.sampled_from(["\n", "\r\n", "\r"]),
    bom=st.booleans(),
)
def test_unicode_stream_random_splits(points: list[int], eol: str, bom: bool) -> None:
    data = (b"\xef\xbb\xbf" if bom else b"") + unicode_stream(eol)
    check_invariant(data, cut(data, points))


@SETTINGS
@given(st.data())
def test_unicode_stream_random_cuts_inside_characters(data: st.DataObject) -> None:
    stream = unicode_stream()
    inside = multibyte_cut_points(stream)
    points = data.draw(st.lists(st.sampled_from(inside), min_size=1, max_size=20))
    check_invariant(stream, cut(stream, points))


def test_invariance_holds_with_repair_and_truncation() -> None:
    # a turn that ends normally with broken JSON (repaired), another cut by length: the repair
    # decision is made once, at the end, on the whole string, never per piece
    items: list[dict[str, Any] | str] = [
        chunk(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": "é'}}]),
        chunk(finish="stop"),
        chunk(choice=1, tool_calls=[{"index": 0, "id": "c2", "function": {"name": "g", "arguments": '{"b": 1'}}]),
        chunk(choice=1, finish="length"),
        "data: [DONE]",
    ]  # fmt: skip
    data = sse_bytes(items)
    for repair in (False, True):
        expected = run_bytes([data], repair_json=repair)
        calls = [c for t in expected[0]["result"]["choices"] for c in t["tool_calls"]]
        assert [c["state"] for c in calls] == (
            ["finished", "truncated"] if repair else ["truncated", "truncated"]
        )
        check_invariant(data, bytewise(data), repair_json=repair)
        for point in multibyte_cut_points(data):
            check_invariant(data, [data[:point], data[point:]], repair_json=repair)


def test_protocol_error_position_does_not_depend_on_splits() -> None:
    # the error names the same event and byte offset, and leaves the same state, however split
    # (the events of the failing receive_data call are not compared: that call raises)
    items: list[dict[str, Any] | str] = [
        chunk(content=UNICODE),
        chunk(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{"}}]),
        'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "x"}]}}]}',
        chunk(content="never read"),
    ]
    data = sse_bytes(items)
    reference, _ = run_bytes([data])
    assert reference["error"] is not None
    assert reference["error"][1] == 3
    assert reference["error"][2] == data.index(b'data: {"choices": [{"index": 0, "delta": {"tool')
    assert reference["end"] == ("protocol_error", "protocol_error")
    for pieces in (bytewise(data), *([data[:p], data[p:]] for p in range(0, len(data), 7))):
        norm, _ = run_bytes(pieces)
        assert norm == reference


def run_limited(pieces: list[bytes], limits: Limits) -> dict[str, Any]:
    parser = StreamParser(limits=limits)
    for piece in pieces:
        parser.receive_data(piece)
    parser.receive_eof()
    return normalise(parser, None)


def test_event_size_limit_outcome_does_not_depend_on_splits() -> None:
    # The events before an oversized one were received and must count however the bytes were
    # cut; what follows it is ignored the same way whether it came in the same piece or later.
    items: list[dict[str, Any] | str] = [
        chunk(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]),
        chunk(content=UNICODE),
        chunk(content="x" * 400),  # over the limit below
        chunk(finish="tool_calls"),
        "data: [DONE]",
    ]
    data = sse_bytes(items)
    limits = Limits(max_event_bytes=300)
    reference = run_limited([data], limits)
    assert reference["end"] == ("limit", "limit:max_event_bytes")
    for pieces in (
        bytewise(data),
        *([data[:p], data[p:]] for p in range(0, len(data), 11)),
        [data[:200], data[200:]],
    ):
        assert run_limited(pieces, limits) == reference


# -- re-fragmenting the argument strings -------------------------------------------------------


def fragments(text: str, points: list[int]) -> list[str]:
    """``text`` cut at ``points`` (modulo ``len(text) + 1``); repeated points give ``""``."""
    at = sorted(p % (len(text) + 1) for p in points)
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


def regenerate(
    result: dict[str, Any],
    end: tuple[str | None, str | None],
    cuts: list[list[int]],
    style: str,
    rnd: random.Random,
) -> list[Any]:
    """Rebuild a chunk stream for ``result`` with every call's arguments cut at new points.

    ``style``: ``indexed`` (every delta carries the call's index; calls interleave at random),
    ``index_zero`` (every call at index 0 with a distinct id, Groq/Bedrock/Ollama style;
    continuations carry index 0 only) or ``no_index`` (headers carry id and name, continuations
    carry nothing at all).
    """
    out: list[Any] = []
    k = 0
    for turn in result["choices"]:
        ci = turn["index"]
        out.append(chunk(ci, role="assistant"))  # the turn exists even without calls
        per_call: list[list[dict[str, Any]]] = []
        ids = [c["id"] for c in turn["tool_calls"]]
        for position, call in enumerate(turn["tool_calls"]):
            # the unindexed styles route by id: make one up where it is empty or shared
            cid = call["id"] if call["id"] and ids.count(call["id"]) == 1 else f"gen_{position}"
            raw = call["raw_arguments"]
            pieces = fragments(raw, cuts[k % len(cuts)] if cuts else [])
            k += 1
            if style == "indexed":
                header = {"index": position, "id": call["id"], "type": call["type"]}
                cont: dict[str, Any] = {"index": position}
            elif style == "index_zero":
                header = {"index": 0, "id": cid, "type": call["type"]}
                cont = {"index": 0}
            else:
                header = {"id": cid, "type": call["type"]}
                cont = {}
            header["function"] = {"name": call["name"], "arguments": pieces[0]}
            deltas = [header] + [{**cont, "function": {"arguments": p}} for p in pieces[1:]]
            per_call.append([chunk(ci, tool_calls=[d]) for d in deltas])
        if style == "indexed":
            # interleave the calls' chunks at random, keeping each call's own order
            queues = [list(q) for q in per_call]
            while any(queues):
                q = rnd.choice([q for q in queues if q])
                out.append(q.pop(0))
        else:
            for q in per_call:
                out.extend(q)
        if turn["finish_reason"] is not None:
            out.append(chunk(ci, finish=turn["finish_reason"]))
    how, reason = end
    if how == "done":
        out.append("[DONE]")
    elif how == "error":
        out.append({"error": {"message": reason}})
    return out


def call_summary(norm: dict[str, Any], *, ids: bool = True) -> list[Any]:
    return [
        (
            t["index"],
            t["complete"],
            t["finish_reason"],
            [
                (c["id"] if ids else None, c["name"], c["arguments"], c["state"], c["reason"])
                for c in t["tool_calls"]
            ],
        )
        for t in norm["result"]["choices"]
    ]


def with_raw(norm: dict[str, Any]) -> dict[str, Any]:
    result = json.loads(json.dumps(norm["result"]))
    for turn, raws in zip(result["choices"], norm["raw_arguments"], strict=True):
        for call, raw in zip(turn["tool_calls"], raws, strict=True):
            call["raw_arguments"] = raw
    return result


def fragmentable(norm: dict[str, Any]) -> bool:
    return norm["end"][0] in ("done", "eof", "error") and norm["error"] is None


@pytest.mark.parametrize("style", ["indexed", "index_zero", "no_index"])
@pytest.mark.parametrize("name", corpus_params())
@settings(max_examples=10, deadline=None)  # x 3 styles x every corpus file
@given(
    cuts=st.lists(st.lists(st.integers(min_value=0, max_value=1 << 12), max_size=12), max_size=4),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_corpus_refragmented_arguments(
    name: str | None, style: str, cuts: list[list[int]], seed: int
) -> None:
    name = need(name)
    reference = corpus_reference(name)[0]
    assert fragmentable(reference)
    if style != "indexed" and any(
        c["name"] == "" for t in reference["result"]["choices"] for c in t["tool_calls"]
    ):
        pytest.skip("a nameless call cannot be rebuilt without an index")
    chunks = regenerate(with_raw(reference), reference["end"], cuts, style, random.Random(seed))
    norm = run_chunks(chunks)
    ids = style == "indexed"  # the other styles need ids, so empty ones were made up
    assert call_summary(norm, ids=ids) == call_summary(reference, ids=ids)
    assert norm["raw_arguments"] == reference["raw_arguments"]


def unicode_reference() -> dict[str, Any]:
    return run_bytes([unicode_stream()])[0]


@pytest.mark.parametrize("style", ["indexed", "index_zero", "no_index"])
@SETTINGS
@given(
    cuts=st.lists(st.lists(st.integers(min_value=0, max_value=200), max_size=25), min_size=1),
    seed=st.integers(min_value=0, max_value=1000),
    points=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=15),
)
def test_unicode_refragmented_arguments(
    style: str, cuts: list[list[int]], seed: int, points: list[int]
) -> None:
    reference = unicode_reference()
    chunks = regenerate(with_raw(reference), reference["end"], cuts, style, random.Random(seed))
    # as dicts
    assert call_summary(run_chunks(chunks)) == call_summary(reference)
    # as raw UTF-8 SSE bytes, cut anywhere (inside characters too)
    data = sse_bytes([c if isinstance(c, dict) else "data: " + c for c in chunks])
    norm, _ = run_bytes(cut(data, points))
    assert call_summary(norm) == call_summary(reference)
    assert norm["raw_arguments"] == reference["raw_arguments"]


@SETTINGS
@given(
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=25),
    finish=st.sampled_from(["tool_calls", "stop", "length", "content_filter", None]),
    done=st.booleans(),
)
def test_refragmented_truncated_arguments_keep_their_state(
    cuts: list[int], finish: str | None, done: bool
) -> None:
    # a call whose arguments are cut short: the final state depends on how the stream ended,
    # never on how the fragments were cut
    args = ARGS_A[: len(ARGS_A) // 2]
    whole = [
        chunk(tool_calls=[{"index": 0, "id": "c", "function": {"name": "f", "arguments": args}}]),
        *([chunk(finish=finish)] if finish else []),
        *(["[DONE]"] if done else []),
    ]
    pieces = fragments(args, cuts)
    split = [
        chunk(tool_calls=[{"index": 0, "id": "c", "function": {"name": "f", "arguments": pieces[0]}}]),
        *(chunk(tool_calls=[{"index": 0, "function": {"arguments": p}}]) for p in pieces[1:]),
        *([chunk(finish=finish)] if finish else []),
        *(["[DONE]"] if done else []),
    ]  # fmt: skip
    assert call_summary(run_chunks(split)) == call_summary(run_chunks(whole))
    state = call_summary(run_chunks(whole))[0][3][0][3]
    expected = {
        "length": "truncated",
        "content_filter": "aborted",
        None: "truncated" if done else "aborted",
    }.get(finish, "truncated")
    assert state == expected
