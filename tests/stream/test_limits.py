"""Round 2 limits: names, ids, the whole stream, JSON depth; linear appends, compact text, and
peak RSS at the default limits (in a subprocess, for the worst inputs of
``tests/stream/worst_inputs.py``)."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm import Limits, StreamParser, ToolCallUpdated
from fsm.parser import MAX_INDEXED_BYTES, MAX_JSON_DEPTH
from fsm.toolcall import FLUSH_EVERY
from tests.helpers import bytewise, child_json, chunk, cut, sse, tc

SPLITS = settings(max_examples=20, deadline=None)


def run(
    data: bytes, pieces: list[bytes] | None = None, **limits: int
) -> tuple[StreamParser, list[Any]]:
    parser = StreamParser(limits=Limits(**limits) if limits else None)
    events: list[Any] = []
    for piece in pieces if pieces is not None else [data]:
        events += parser.receive_data(piece)
    events += parser.receive_eof()
    return parser, events


def states(parser: StreamParser) -> list[tuple[str, str | None]]:
    return [(c.state.value, c.reason) for t in parser.result().turns for c in t.tool_calls]


def kinds(parser: StreamParser) -> list[str]:
    return [a.kind for a in parser.anomalies]


def same_everywhere(data: bytes, points: list[int], **limits: int) -> StreamParser:
    """Whole, byte by byte and in random pieces: the same result and the same events."""
    whole, events = run(data, **limits)
    for pieces in (bytewise(data), cut(data, points)):
        other, other_events = run(data, pieces, **limits)
        assert other.result().to_json() == whole.result().to_json()
        assert other_events == events
    return whole


# -- Limits itself ---------------------------------------------------------------------------


def test_defaults() -> None:
    limits = Limits()
    assert (limits.max_name_bytes, limits.max_id_bytes) == (512, 512)
    assert limits.max_stream_bytes == 64 * 1024 * 1024
    assert limits.max_json_depth == 512
    assert MAX_INDEXED_BYTES == 512 and MAX_JSON_DEPTH == 512


@pytest.mark.parametrize("name", ["max_name_bytes", "max_id_bytes"])
def test_name_and_id_limits_may_be_lowered_not_raised(name: str) -> None:
    assert getattr(Limits(**{name: 1}), name) == 1
    assert getattr(Limits(**{name: 512}), name) == 512
    with pytest.raises(ValueError, match=r"512.*the most the store can index on PostgreSQL"):
        Limits(**{name: 513})


def test_json_depth_at_most_512() -> None:
    # one nesting limit for every JSON value fsm keeps (fsm.jsonutil.MAX_JSON_DEPTH)
    assert Limits(max_json_depth=512).max_json_depth == 512
    with pytest.raises(ValueError, match="at most 512"):
        Limits(max_json_depth=513)


@pytest.mark.parametrize(
    "name", ["max_name_bytes", "max_id_bytes", "max_stream_bytes", "max_json_depth"]
)
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "5", None])
def test_new_limits_are_validated(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        Limits(**{name: value})


# -- names -----------------------------------------------------------------------------------


def one_call(
    name: str = "f", id: str = "call_1", args: str = "{}", type: str | None = None
) -> bytes:
    return sse(chunk(tc(0, id, name, args, type=type)), chunk(finish="tool_calls"))


@SPLITS
@given(points=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_name_at_the_limit_is_kept(points: list[int]) -> None:
    parser = same_everywhere(one_call(name="n" * 512), points)
    assert states(parser) == [("finished", None)]
    assert parser.result().turns[0].tool_calls[0].name == "n" * 512


@SPLITS
@given(points=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_name_past_the_limit_aborts_the_call(points: list[int]) -> None:
    parser = same_everywhere(one_call(name="n" * 513), points)
    assert states(parser) == [("aborted", "limit:max_name_bytes")]
    assert kinds(parser) == ["limit_exceeded"]
    assert parser.result().complete is False


def test_name_limit_counts_utf8_bytes() -> None:
    parser, _ = run(one_call(name="é" * 256))  # 512 bytes
    assert states(parser) == [("finished", None)]
    parser, _ = run(one_call(name="é" * 256 + "x"))  # 513 bytes, 257 characters
    assert states(parser) == [("aborted", "limit:max_name_bytes")]


def name_in_fragments(count: int) -> bytes:
    parts = [chunk(tc(0, "call_1", "a", ""))]
    parts += [chunk(tc(0, name="ab"[i % 2])) for i in range(1, count)]
    return sse(*parts, chunk(tc(0, args="{}")), chunk(finish="tool_calls"))


def test_name_fragments_up_to_the_limit_and_past_it() -> None:
    parser, events = run(name_in_fragments(512))
    (call,) = parser.result().turns[0].tool_calls
    assert (len(call.name), call.state.value) == (512, "finished")
    parser, events = run(name_in_fragments(600))
    (call,) = parser.result().turns[0].tool_calls
    # later header fragments dropped: the name stops where it was, the call is aborted
    assert len(call.name) == 512
    assert (call.state.value, call.reason) == ("aborted", "limit:max_name_bytes")
    assert kinds(parser) == ["limit_exceeded"]  # one anomaly, not one per dropped fragment
    updates = [e for e in events if isinstance(e, ToolCallUpdated)]
    # what each event holds is bounded by the name limit (no event holds a growing copy)
    assert len(updates) == 511 and max(len(e.name) for e in updates) == 512


def test_lowered_name_limit() -> None:
    parser, _ = run(one_call(name="abcd"), max_name_bytes=3)
    assert states(parser) == [("aborted", "limit:max_name_bytes")]


@pytest.mark.slow
@pytest.mark.serial  # a timing: alone on the machine
def test_many_calls_of_one_byte_name_fragments_stay_linear() -> None:
    """512 one-byte name fragments for each of 256 calls: every append copies at most 512
    bytes, every update event holds at most 512 bytes (whole-buffer parsing)."""
    entries = [[tc(i, f"c{i}", "a", "")] for i in range(256)]
    parts = [chunk(*e) for e in entries]
    for k in range(1, 512):
        parts.append(chunk(*(tc(i, name="ab"[k % 2]) for i in range(256))))
    data = sse(*parts, chunk(finish="tool_calls"))
    parser = StreamParser()
    events = parser.receive_data(data) + parser.receive_eof()
    assert {len(c.name) for c in parser.result().turns[0].tool_calls} == {512}
    held = sum(len(e.name) for e in events if isinstance(e, ToolCallUpdated))
    assert held <= 512 * 511 * 256  # bounded per event: linear in the fragments received


# -- ids, types and stream-level identifiers --------------------------------------------------


@SPLITS
@given(points=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_id_past_the_limit_aborts_the_call(points: list[int]) -> None:
    parser = same_everywhere(one_call(id="i" * 513), points)
    (call,) = parser.result().turns[0].tool_calls
    assert (call.id, call.state.value, call.reason) == ("", "aborted", "limit:max_id_bytes")
    assert kinds(parser) == ["limit_exceeded"]


def test_id_at_the_limit_is_kept() -> None:
    parser, _ = run(one_call(id="i" * 512))
    assert parser.result().turns[0].tool_calls[0].id == "i" * 512
    assert states(parser) == [("finished", None)]


def test_late_id_past_the_limit_aborts_the_call() -> None:
    data = sse(
        chunk(tc(0, name="f", args="{")),
        chunk(tc(0, "x" * 600, args="}")),
        chunk(tc(0, args="ignored")),
        chunk(finish="tool_calls"),
    )
    parser, _ = run(data)
    (call,) = parser.result().turns[0].tool_calls
    assert (call.id, call.state.value, call.reason) == ("", "aborted", "limit:max_id_bytes")
    # what came before is kept; the fragments of that delta and later ones are dropped
    assert call.raw_arguments == "{"


def test_type_past_the_id_limit_aborts_the_call() -> None:
    parser, _ = run(one_call(type="t" * 513))
    assert states(parser) == [("aborted", "limit:max_id_bytes")]
    parser, _ = run(one_call(type="t" * 512))
    assert states(parser) == [("finished", None)]


@pytest.mark.parametrize("field", ["id", "model", "system_fingerprint"])
@SPLITS
@given(points=st.lists(st.integers(0, 1 << 16), max_size=8))
def test_stream_identifiers_past_the_limit_end_the_stream(field: str, points: list[int]) -> None:
    first = chunk(tc(0, "call_1", "f", "{}"))
    first[field] = "m" * 513
    if field == "system_fingerprint":  # read while the response id or model is still unknown
        del first["model"]
    parser = same_everywhere(sse(first, chunk(finish="tool_calls")), points)
    result = parser.result()
    assert (result.end_how, result.end_reason) == ("limit", "limit:max_id_bytes")
    assert kinds(parser) == ["limit_exceeded", "data_after_end", "data_after_end"]


def test_stream_identifiers_at_the_limit_are_kept() -> None:
    first = chunk(tc(0, "call_1", "f", "{}"))
    first.update(id="r" * 512, model="m" * 512, system_fingerprint="s" * 512)
    del first["model"]
    second = chunk(finish="tool_calls")
    second.update(id="r" * 512, model="m" * 512)
    parser, _ = run(sse(first, second))
    result = parser.result()
    assert (result.response_id, result.model, result.system_fingerprint) == (
        "r" * 512, "m" * 512, "s" * 512,
    )  # fmt: skip
    assert result.complete


def test_finish_reason_past_the_limit_ends_the_stream() -> None:
    parser, _ = run(sse(chunk(tc(0, "call_1", "f", "{}")), chunk(finish="z" * 513)))
    result = parser.result()
    assert (result.end_how, result.end_reason) == ("limit", "limit:max_id_bytes")
    assert states(parser) == [("aborted", "limit:max_id_bytes")]
    parser, _ = run(sse(chunk(tc(0, "call_1", "f", "{}")), chunk(finish="z" * 512)))
    assert parser.result().complete  # an unknown finish_reason ends like stop


# -- the whole stream ------------------------------------------------------------------------


def test_max_stream_bytes_counts_text_arguments_names_and_ids_of_every_choice() -> None:
    parts = [
        # response id "chatcmpl-test" (13) + model "test-model" (10) + content (2) + call id,
        # name, type and arguments (2 each): 33
        chunk(tc(0, "ab", "cd", "{}", type="gh"), content="ij"),
        chunk(content="kl", choice=1),  # 35: the other choice counts too
    ]
    data = sse(*parts, chunk(finish="tool_calls"), chunk(finish="stop", choice=1))
    parser, _ = run(data, max_stream_bytes=35)
    assert parser.result().complete
    parser, _ = run(data, max_stream_bytes=34)
    result = parser.result()
    assert (result.end_how, result.end_reason) == ("limit", "limit:max_stream_bytes")
    assert "limit_exceeded" in kinds(parser)
    assert not result.complete


def _mixed_stream() -> bytes:
    parts = []
    for i in range(10):
        parts.append(chunk(tc(i % 3, f"id{i % 3}", "fé", '{"k":"vé'), content="héllo"))
        parts.append(chunk(tc(i % 3, args='"}'), choice=1))
    return sse(*parts, chunk(finish="stop"), chunk(finish="stop", choice=1))


@SPLITS
@given(points=st.lists(st.integers(0, 1 << 16), max_size=12), limit=st.integers(1, 400))
def test_max_stream_bytes_is_exact_and_split_invariant(points: list[int], limit: int) -> None:
    data = _mixed_stream()
    total = run(data)[0]._core.stream_bytes  # every byte the stream holds
    parser = same_everywhere(data, points, max_stream_bytes=limit)
    result = parser.result()
    if limit >= total:
        assert result.end_how == "done"
    else:
        assert (result.end_how, result.end_reason) == ("limit", "limit:max_stream_bytes")


# -- JSON depth --------------------------------------------------------------------------------


@pytest.mark.parametrize(("depth", "state"), [(512, ("finished", None)), (513, None)])
def test_arguments_nested_past_max_json_depth_abort_the_call(
    depth: int, state: tuple[str, None] | None
) -> None:
    args = "[" * depth + "]" * depth
    parser, _ = run(one_call(args=args))
    assert states(parser) == [state or ("aborted", "limit:max_json_depth")]
    assert parser.result().turns[0].tool_calls[0].raw_arguments == args


def test_max_json_depth_counts_objects_and_arrays() -> None:
    args = '{"a": [{"b": [1]}]}'  # 4 levels
    assert states(run(one_call(args=args), max_json_depth=4)[0]) == [("finished", None)]
    assert states(run(one_call(args=args), max_json_depth=3)[0]) == [
        ("aborted", "limit:max_json_depth")
    ]


def test_invalid_and_deep_arguments_are_invalid_json() -> None:
    args = "[" * 600 + "]" * 599
    assert states(run(one_call(args=args))[0]) == [("truncated", "invalid_json")]


def test_repair_never_makes_arguments_deeper_than_the_limit() -> None:
    parser = StreamParser(repair_json=True, limits=Limits(max_json_depth=3))
    parser.receive_data(one_call(args="[[[["))
    parser.receive_eof()
    assert states(parser) == [("truncated", "invalid_json")]


# -- compact text ------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["content", "reasoning_content", "reasoning", "refusal"])
def test_text_is_kept_in_blocks(field: str) -> None:
    parser = StreamParser()
    for i in range(10 * FLUSH_EVERY + 3):
        parser.receive_chunk({"choices": [{"index": 0, "delta": {field: str(i % 10)}}]})
    turn = parser.turns[0]
    attr = {"reasoning_content": "reasoning"}.get(field, field)
    parts, blocks = getattr(turn, f"_{attr}"), getattr(turn, f"_{attr}_blocks")
    assert (len(parts), len(blocks)) == (3, 10)  # not 1,283 fragments kept apart
    expected = "".join(str(i % 10) for i in range(10 * FLUSH_EVERY + 3))
    assert getattr(turn, attr) == expected
    assert getattr(turn, attr) == expected  # read twice: the same


def _fragment(i: int, ascii: bool) -> str:
    # ascii takes the parser's inlined hot path; "é" (not ASCII) takes ToolCall._append
    return str(i % 10) if ascii else "é" + str(i % 10)


@pytest.mark.parametrize("path", ["hot", "append", "mixed"])
def test_arguments_are_kept_in_blocks(path: str) -> None:
    # the memory-bounding flush: every FLUSH_EVERY fragments are joined into one block, so a call
    # keeps fewer than FLUSH_EVERY loose fragments however many come; the arguments stay exact
    count = 10 * FLUSH_EVERY + 3
    fragments = [
        _fragment(i, path == "hot" or (path == "mixed" and i % 3 > 0)) for i in range(count)
    ]
    parser = StreamParser()
    parser.receive_chunk(chunk(tc(0, "call_1", "f", '{"a": "')))
    call = parser.turns[0].tool_calls[0]
    for i, fragment in enumerate(fragments, start=1):
        parser.receive_chunk(chunk(tc(0, args=fragment)))
        # the opening fragment plus i more
        assert len(call._parts) == (i + 1) % FLUSH_EVERY
        assert len(call._blocks) == (i + 1) // FLUSH_EVERY
    assert len(call._blocks) == 10 and len(call._parts) == 4  # not 1,284 fragments kept apart
    expected = '{"a": "' + "".join(fragments)
    assert call.arguments == expected and call.raw_arguments == expected  # read while open
    parser.receive_chunk(chunk(tc(0, args='"}'), finish="tool_calls"))
    parser.receive_eof()
    assert states(parser) == [("finished", None)]
    assert call.raw_arguments == call.arguments == expected + '"}'
    assert json.loads(call.arguments) == {"a": "".join(fragments)}
    assert (call._parts, call._blocks) == ([], [])  # a final call keeps only its result


@pytest.mark.parametrize("field", ["content", "reasoning_content", "refusal"])
def test_text_blocks_stay_exact_across_sse_cuts(field: str) -> None:
    # text past FLUSH_EVERY fragments, multi-byte and fed as SSE bytes cut anywhere: the joined
    # blocks give back exactly the text sent
    count = 3 * FLUSH_EVERY + 5
    fragments = [("é" if i % 2 else "a") + str(i) for i in range(count)]
    data = sse(*(chunk(**{field: f}) for f in fragments), chunk(finish="stop"))
    attr = {"reasoning_content": "reasoning"}.get(field, field)
    for pieces in ([data], cut(data, list(range(7, len(data), 97)))):
        parser = StreamParser()
        for piece in pieces:
            parser.receive_data(piece)
        turn = parser.turns[0]
        parts, blocks = getattr(turn, f"_{attr}"), getattr(turn, f"_{attr}_blocks")
        assert (len(parts), len(blocks)) == (5, 3)
        parser.receive_eof()
        assert getattr(turn, attr) == "".join(fragments)


@pytest.mark.parametrize("field", ["content", "reasoning_content", "refusal"])
@SPLITS
@given(points=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_split_surrogate_pair_becomes_the_character(field: str, points: list[int]) -> None:
    halves = [
        b'data: {"choices":[{"index":0,"delta":{"%s":"a\\ud83d"}}]}\n\n' % field.encode(),
        b'data: {"choices":[{"index":0,"delta":{"%s":"\\ude00b"}}]}\n\n' % field.encode(),
        b'data: {"choices":[{"index":0,"delta":{"%s":"\\ud83d"}}]}\n\n' % field.encode(),
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    parser = same_everywhere(b"".join(halves), points)
    attr = {"reasoning_content": "reasoning"}.get(field, field)
    assert getattr(parser.result().turns[0], attr) == "a\U0001f600b\ud83d"  # last half stays lone


def test_ids_and_names_keep_split_surrogates_as_sent() -> None:
    data = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"i\\ud83d",'
        b'"function":{"name":"f\\ud83d","arguments":"{}"}}]}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
        b'"function":{"name":"\\ude00"}}]}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    )
    parser, _ = run(data)
    (call,) = parser.result().turns[0].tool_calls
    assert (call.id, call.name) == ("i\ud83d", "f\ud83d\ude00")


# -- peak RSS at the default limits, in a subprocess -------------------------------------------

CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, sys, time
    from tests.stream.worst_inputs import WORST
    from fsm import StreamParser

    def peak_kib():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    worst = WORST[sys.argv[1]]
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset the peak to the current RSS (Linux >= 4.0)
    except (OSError, AttributeError):
        pass
    base = peak_kib()
    start = time.perf_counter()
    parser = StreamParser()
    buffer = bytearray()
    for piece in worst.make():
        buffer += piece
        while len(buffer) >= 65536:
            parser.receive_data(bytes(buffer[:65536]))
            del buffer[:65536]
    parser.receive_data(bytes(buffer))
    parser.receive_eof()
    result = parser.result()
    text = sum(len(t.content or "") for t in result.turns)  # reading joins the text
    print(json.dumps({
        "end": [result.end_how, result.end_reason],
        "states": sorted({(c.state.value, c.reason) for t in result.turns
                          for c in t.tool_calls}),
        "calls": sum(len(t.tool_calls) for t in result.turns),
        "text": text,
        "seconds": time.perf_counter() - start,
        "growth_mb": (peak_kib() - base) / 1024,
    }))
    """
)


@pytest.mark.slow  # a process each, measuring its memory
@pytest.mark.parametrize("worst", ["many-calls", "name-fragments", "tiny-content", "wide-text",
                                   "deep-arguments"])  # fmt: skip
def test_peak_rss_at_the_default_limits(worst: str) -> None:
    from tests.stream.worst_inputs import WORST

    case = WORST[worst]
    out = child_json(CHILD, worst, timeout=case.max_seconds * 4 + 60)
    print(f"{worst}: {out['seconds']:.2f} s, peak RSS grew {out['growth_mb']:.1f} MB")
    assert tuple(out["end"]) == case.end
    assert out["growth_mb"] < case.max_rss_mb, out
    assert out["seconds"] < case.max_seconds, out
    if worst == "many-calls":
        assert out["calls"] == 128 * 1024 and out["states"] == [["finished", None]]
    if worst == "name-fragments":
        assert out["calls"] == 1024 and out["states"] == [["finished", None]]
    if worst == "tiny-content":
        assert out["text"] == 1_000_000
    if worst == "deep-arguments":
        assert out["states"] == [["finished", None]]
