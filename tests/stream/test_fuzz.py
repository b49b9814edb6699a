"""Differential fuzzing of the parser (hypothesis), and the atheris harnesses run briefly.

1. Reassembly: random tool calls (ids, names and argument JSON full of unicode) are streamed the
   way real providers do it (``shared/spec/parser.md``, "Real cases": vLLM repeating id and name,
   ``""`` ids and names on continuations, no index, several calls at index 0 with distinct ids,
   indices starting at 1 or sparse, interleaved indices, names and arguments split anywhere,
   several entries per delta, ``finish_reason`` more than once, a usage-only ``choices: []``
   chunk, keep-alive comments, multi-line data, CR/CRLF line ends, a BOM, no ``[DONE]`` after a
   ``finish_reason``), serialised to SSE, and fed in random byte splits. The parser must give back
   exactly the calls that went in: ids, names and arguments byte-exact, all ``finished``, every
   turn complete.
2. Mutation: the same streams with bytes flipped, inserted or deleted and events dropped or
   repeated must never raise anything but ``RemoteProtocolError`` / ``LocalProtocolError``, and
   must never yield a ``finished`` call whose arguments are not JSON.
3. The atheris harnesses in ``fuzz/`` run for a few thousand inputs in a subprocess.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm import (
    IncompleteTurnError,
    Limits,
    LocalProtocolError,
    RemoteProtocolError,
    StreamParser,
    ToolCallState,
)
from tests.helpers import REPO, cut, repo_env, strict_json

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- random calls ------------------------------------------------------------------------------

# text of any kind (hypothesis never draws lone surrogates), with the characters that trip
# encoders over-represented
TRICKY = st.sampled_from(
    ['"', "\\", "\n", "\x00", "\u2028", "é", "日", "🎉", "\U0001f468\u200d👩", " "]
)
TEXT = st.lists(st.characters(codec="utf-8") | TRICKY, max_size=10).map("".join)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
JSON_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def argument_strings(draw: st.DrawFn) -> str:
    """A call's arguments: JSON text as a provider writes it, or empty (no arguments)."""
    if draw(st.integers(0, 9)) == 0:
        return ""
    value = draw(st.dictionaries(TEXT, JSON_VALUE, max_size=5) | JSON_VALUE)
    indent = draw(st.sampled_from([None, None, 1, 2]))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()), indent=indent)
    return draw(st.sampled_from(["", " ", "\n"])) + text + draw(st.sampled_from(["", " ", "\n"]))


# a name made only of whitespace counts as missing (spec round 2): names here have a visible part
NAMES = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12
).filter(lambda name: bool(name.strip()))
IDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=16)


@dataclass
class Call:
    id: str
    name: str
    arguments: str
    index: int | None = None


def split_text(draw: st.DrawFn, text: str, max_parts: int) -> list[str]:
    """Cut ``text`` at random character positions (possibly into empty pieces)."""
    if not text:
        return [text]
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=max_parts - 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def split_name(draw: st.DrawFn, name: str) -> list[str]:
    """Cut a name into non-empty parts that the parser can join: a part equal to the whole name
    held so far reads as a vLLM-style repeat (spec), so such a part is glued to the previous."""
    parts: list[str] = []
    for piece in split_text(draw, name, 4):
        if not piece:
            continue
        if parts and piece == "".join(parts):
            parts[-1] += piece
        else:
            parts.append(piece)
    return parts


# -- streaming them the way providers do -------------------------------------------------------

ROUTINGS = ["indexed", "index0_distinct_ids", "no_index"]
CONTINUATIONS = ["bare", "repeat_id_and_name", "empty_id_and_name", "repeat_type"]


@dataclass
class Plan:
    """One choice: its calls, and the tool-call delta entries that stream them, in order."""

    choice: int
    calls: list[Call]
    entries: list[dict[str, Any]] = field(default_factory=list)
    content: list[str] = field(default_factory=list)


@st.composite
def choice_plans(draw: st.DrawFn, choice: int) -> Plan:
    routing = draw(st.sampled_from(ROUTINGS))
    style = draw(st.sampled_from(CONTINUATIONS))
    with_ids = routing != "indexed" or draw(st.integers(0, 3)) > 0  # Ollama/sglang omit ids
    count = draw(st.integers(0 if routing == "indexed" else 1, 4))
    ids = draw(st.lists(IDS, min_size=count, max_size=count, unique=True)) if with_ids else []
    indices: list[int | None]
    if routing == "indexed":
        start = draw(st.sampled_from([0, 0, 1]))  # Anthropic-passthrough gateways start at 1
        if draw(st.booleans()):  # sparse
            pool = st.integers(start, start + 3 * count)
            indices = [*sorted(draw(st.lists(pool, min_size=count, max_size=count, unique=True)))]
        else:
            indices = [*range(start, start + count)]
        if draw(st.booleans()):
            indices = draw(st.permutations(indices))  # opened out of index order
    elif routing == "index0_distinct_ids":
        indices = [0] * count
    else:
        indices = [None] * count
    calls = [
        Call(
            id=ids[i] if with_ids else "",
            name=draw(NAMES),
            arguments=draw(argument_strings()),
            index=indices[i],
        )
        for i in range(count)
    ]

    per_call: list[list[dict[str, Any]]] = []
    for call in calls:
        per_call.append(call_entries(draw, call, routing, style, with_ids))
    if routing == "indexed" and draw(st.booleans()):
        entries = interleave(draw, per_call)  # 0,1,0,1: routing by index keeps them apart
    else:
        entries = [e for seq in per_call for e in seq]
    return Plan(choice=choice, calls=calls, entries=entries)


def call_entries(
    draw: st.DrawFn, call: Call, routing: str, style: str, with_ids: bool
) -> list[dict[str, Any]]:
    """The delta entries of one call: a header, maybe the rest of the name, then arguments."""
    key: dict[str, Any] = {} if call.index is None else {"index": call.index}
    # a name may be split (and come after the header) only where the spec routes such a
    # fragment back to the call: by index; without an index a name with no id opens a new call
    can_split_name = routing != "no_index" and style != "repeat_id_and_name"
    names = split_name(draw, call.name) if can_split_name else [call.name]
    header: dict[str, Any] = {**key, "type": "function"}
    if with_ids:
        header["id"] = call.id
    late_name = can_split_name and routing == "indexed" and draw(st.integers(0, 3)) == 0
    if not late_name:
        header["function"] = {"name": names.pop(0)}
        if draw(st.booleans()):
            header["function"]["arguments"] = ""  # OpenAI's header shape
    entries = [header]
    for part in names:
        entries.append({**key, "function": {"name": part}})
    for fragment in split_text(draw, call.arguments, 8):
        entries.append(continuation(key, call, style, with_ids, {"arguments": fragment}))
    if draw(st.integers(0, 4)) == 0:  # a trailing empty-arguments delta (vLLM, Fireworks)
        entries.append(continuation(key, call, style, with_ids, {"arguments": ""}))
    return entries


def continuation(
    key: dict[str, Any], call: Call, style: str, with_ids: bool, function: dict[str, Any]
) -> dict[str, Any]:
    entry: dict[str, Any] = dict(key)
    if style == "repeat_id_and_name" and with_ids:
        entry["id"] = call.id  # vLLM / BaseTen: id and whole name in every chunk
        function = {"name": call.name, **function}
    elif style == "empty_id_and_name" and key:
        entry["id"] = ""  # Alibaba compatible mode: "" on continuations
        function = {"name": "", **function}
    elif style == "repeat_type":
        entry["type"] = "function"
    entry["function"] = function
    return entry


def interleave(draw: st.DrawFn, sequences: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    queues = [list(s) for s in sequences if s]
    out: list[dict[str, Any]] = []
    while queues:
        i = draw(st.integers(0, len(queues) - 1))
        out.append(queues[i].pop(0))
        if not queues[i]:
            queues.pop(i)
    return out


@dataclass
class Stream:
    plans: list[Plan]
    data: bytes
    done: bool


def base_chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fuzz",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "fuzz",
        "choices": choices,
    }


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    n_choices = draw(st.sampled_from([1, 1, 1, 2]))
    plans = [draw(choice_plans(ci)) for ci in range(n_choices)]
    finish = draw(st.sampled_from(["tool_calls", "tool_calls", "stop", "function_call"]))

    # chunks per choice: groups of entries (one delta may carry several, even of one call),
    # content in between, finish_reason sometimes early and repeated (OpenRouter, DeepInfra)
    per_choice: list[list[dict[str, Any]]] = []
    for plan in plans:
        chunks: list[dict[str, Any]] = []
        entries = plan.entries
        i = 0
        if draw(st.booleans()):
            chunks.append(base_chunk([{"index": plan.choice, "delta": {"role": "assistant"}}]))
        while i < len(entries):
            size = draw(st.integers(1, 3))
            delta: dict[str, Any] = {"tool_calls": entries[i : i + size]}
            if draw(st.integers(0, 5)) == 0:
                text = draw(TEXT)
                delta["content"] = text
                plan.content.append(text)
            early = draw(st.integers(0, 9)) == 0
            chunks.append(
                base_chunk(
                    [
                        {
                            "index": plan.choice,
                            "delta": delta,
                            "finish_reason": finish if early else None,
                        }
                    ]
                )
            )
            i += size
        last: dict[str, Any] = {"index": plan.choice, "delta": {}, "finish_reason": finish}
        if draw(st.booleans()) and chunks:
            chunks[-1]["choices"][0]["finish_reason"] = finish  # deltas and finish in one chunk
        else:
            chunks.append(base_chunk([last]))
        if draw(st.integers(0, 4)) == 0:
            chunks.append(base_chunk([last]))  # finish_reason twice
        per_choice.append(chunks)
    ordered = [c for chunks in per_choice for c in chunks]
    if n_choices > 1 and draw(st.booleans()):
        ordered = interleave(draw, per_choice)
    if draw(st.booleans()):
        ordered.append({"id": "chatcmpl-fuzz", "choices": [], "usage": {"total_tokens": 3}})
    done = draw(st.booleans())  # without [DONE], EOF after the finish_reason ends normally
    return Stream(plans=plans, data=to_sse(draw, ordered, done), done=done)


def to_sse(draw: st.DrawFn, chunks: list[dict[str, Any]], done: bool) -> bytes:
    eol = draw(st.sampled_from(["\n", "\n", "\r\n", "\r"]))
    space = draw(st.sampled_from([" ", " ", ""]))
    out = ["\ufeff"] if draw(st.integers(0, 5)) == 0 else []
    for c in chunks:
        if draw(st.integers(0, 6)) == 0:
            out.append(": keep-alive" + eol + eol)
        text = json.dumps(
            c, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, None, 1]))
        )
        for line in text.split("\n"):  # multi-line data joins with "\n" (WHATWG)
            out.append("data:" + space + line + eol)
        out.append(eol)
    if done:
        out.append("data:" + space + "[DONE]" + eol + eol)
    return "".join(out).encode("utf-8")


# -- checks ------------------------------------------------------------------------------------


def expected_order(calls: list[Call]) -> list[Call]:
    """The spec's final order: by index, then by opening order; no index after indexed."""
    return sorted(calls, key=lambda c: (c.index is None, c.index or 0))


@pytest.mark.slow
@FUZZ
@given(stream=streams(), points=st.lists(st.integers(0, 1 << 20), max_size=30))
def test_random_streams_reassemble_exactly(stream: Stream, points: list[int]) -> None:
    parser = StreamParser()
    for piece in cut(stream.data, points):
        parser.receive_data(piece)
    parser.receive_eof()
    result = parser.result()
    assert result.error is None
    assert result.end_how == ("done" if stream.done else "eof")
    assert [t.index for t in result.turns] == [p.choice for p in stream.plans]
    for plan, turn in zip(stream.plans, result.turns, strict=True):
        got = [(c.index, c.id, c.name, c.arguments, c.state, c.reason) for c in turn.tool_calls]
        want = [
            (c.index, c.id, c.name, c.arguments, ToolCallState.FINISHED, None)
            for c in expected_order(plan.calls)
        ]
        assert got == want
        assert all(c.raw_arguments == c.arguments and not c.repaired for c in turn.tool_calls)
        assert turn.content == ("".join(plan.content) or None)
        if not plan.calls and turn.finish_reason in ("tool_calls", "function_call"):
            # finish_reason says calls were made and none arrived: not complete (round 2)
            assert (turn.complete, turn.incomplete_reason) == (False, "no_tool_calls")
            with pytest.raises(IncompleteTurnError, match="no tool call"):
                turn.to_message()
            continue
        assert turn.complete
        message = turn.to_message()
        assert [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ] == [(c.id, c.name, c.arguments) for c in expected_order(plan.calls)]
    assert result.complete == all(t.complete for t in result.turns)
    kinds = {a.kind for a in result.anomalies}
    # blank_id: an id of whitespace only is kept as sent and reported
    assert kinds <= {"delta_after_finish", "no_tool_calls", "blank_id"}, kinds


@pytest.mark.slow
@FUZZ
@given(stream=streams())
def test_random_streams_whole_and_bytewise_agree(stream: Stream) -> None:
    """Whole and one byte at a time give the same result (the sample above splits randomly)."""
    a, b = StreamParser(), StreamParser()
    a.receive_data(stream.data)
    a.receive_eof()
    for i in range(len(stream.data)):
        b.receive_data(stream.data[i : i + 1])
    b.receive_eof()
    assert a.result().to_json() == b.result().to_json()


# -- mutations ---------------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    stream = draw(streams())
    data = bytearray(stream.data)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(
            st.sampled_from(["flip", "insert", "delete", "drop_event", "repeat_event", "cut"])
        )
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif op == "insert":
            data[at:at] = draw(
                st.binary(max_size=8)
                | st.sampled_from(
                    [
                        b"\n",
                        b"\n\n",
                        b"\r",
                        b"data: ",
                        b"[DONE]",
                        b"NaN",
                        b"\xff",
                        b"\x00",
                        b'"',
                        b"}",
                    ]
                )
            )
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "cut":
            del data[at:]
        else:
            events = bytes(data).split(b"\n\n")
            k = draw(st.integers(0, len(events) - 1))
            if op == "drop_event":
                del events[k]
            else:
                events.insert(k, events[k])
            data = bytearray(b"\n\n".join(events))
    return bytes(data)


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=mutated(), points=st.lists(st.integers(0, 1 << 20), max_size=10), abort=st.booleans())
def test_mutated_streams_fail_only_with_protocol_errors(
    data: bytes, points: list[int], abort: bool
) -> None:
    parser = StreamParser()
    error: Exception | None = None
    try:
        for piece in cut(data, points):
            parser.receive_data(piece)
        if abort:
            parser.abort("fuzz")
        else:
            parser.receive_eof()
    except (RemoteProtocolError, LocalProtocolError) as exc:
        error = exc
    result = parser.result()
    assert (error is None) == (result.error is None)
    assert parser.ended
    for turn in result.turns:
        assert turn.ended
        for call in turn.tool_calls:
            assert call.final
            if call.state is ToolCallState.FINISHED:
                assert strict_json(call.arguments), call
            else:
                assert call.reason
        if turn.complete:
            assert error is None
            turn.to_message()
        else:
            with pytest.raises(IncompleteTurnError):
                turn.to_message()


def test_anomalies_after_the_end_do_not_depend_on_splits() -> None:
    """Found by ``fuzz/fuzz_parser.py`` (a corpus stream under tiny limits). After a limit ended
    the stream, each later SSE event is a ``data_after_end`` anomaly (README). When a later
    event is oversized, the events framed before it in the same ``receive_data()`` call must
    still count: the result may not depend on how the bytes were split (spec: "Bytes may be
    split anywhere"; architecture guide: whole, byte by byte and random splits give the same)."""
    head = b'data: {"choices":[{"index":0,"delta":{"content":"xx"}}]}\n\n'
    tail = b"data: {}\n\ndata: {}\n\ndata: " + b"x" * 100 + b"\n\n"

    def kinds(pieces: list[bytes]) -> list[str]:
        parser = StreamParser(limits=Limits(max_text_bytes=1, max_event_bytes=64))
        for piece in pieces:
            parser.receive_data(piece)
        parser.receive_eof()
        assert parser.result().end_reason == "limit:max_text_bytes"
        return [a.kind for a in parser.anomalies]

    whole = kinds([head + tail])
    assert whole == ["limit_exceeded", "data_after_end", "data_after_end"]
    assert kinds([head, tail]) == whole
    assert kinds([head[:-1], head[-1:] + tail]) == whole


@pytest.mark.slow
def test_the_generator_covers_the_quirks() -> None:
    """Guard against a generator that silently stopped producing the provider quirks."""
    seen: set[str] = set()

    @settings(
        max_examples=400,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.nested_given, HealthCheck.too_slow],
    )
    @given(stream=streams())
    def collect(stream: Stream) -> None:
        text = stream.data
        seen.add("done" if stream.done else "no_done")
        if b"\r\n" in text:
            seen.add("crlf")
        elif b"\r" in text:
            seen.add("cr")
        if text.startswith(b"\xef\xbb\xbf"):
            seen.add("bom")
        if b": keep-alive" in text:
            seen.add("comment")
        if b'"choices": []' in text:
            seen.add("usage_only")
        for plan in stream.plans:
            indices = [c.index for c in plan.calls]
            if len(plan.calls) > 1 and indices and all(i == 0 for i in indices):
                seen.add("index0_distinct_ids")
            if indices and all(i is None for i in indices):
                seen.add("no_index")
            if indices and indices[0] not in (None, 0):
                seen.add("index_from_1_or_sparse")
            if any(c.id == "" for c in plan.calls):
                seen.add("no_ids")
            entries = plan.entries
            if any(e.get("id") == "" for e in entries):
                seen.add("empty_id_continuation")
            if sum(1 for e in entries if "name" in e.get("function", {})) > len(plan.calls):
                seen.add("name_repeated_or_split")

    collect()
    assert seen >= {
        "done",
        "no_done",
        "crlf",
        "cr",
        "bom",
        "comment",
        "usage_only",
        "index0_distinct_ids",
        "no_index",
        "index_from_1_or_sparse",
        "no_ids",
        "empty_id_continuation",
        "name_repeated_or_split",
    }, seen


# -- the atheris harnesses ---------------------------------------------------------------------

HARNESSES = ["fuzz_sse.py", "fuzz_parser.py"]
HAVE_ATHERIS = importlib.util.find_spec("atheris") is not None


def run_harness(name: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a harness in ``cwd`` (libFuzzer and the plain loop write crash files there)."""
    env = repo_env()
    return subprocess.run(
        [sys.executable, str(REPO / "fuzz" / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_ATHERIS, reason="atheris is not installed (pip install atheris)")
@pytest.mark.parametrize("name", HARNESSES)
def test_atheris_harness_runs(name: str, tmp_path: Path) -> None:
    proc = run_harness(name, tmp_path, "-atheris_runs=2000", "-seed=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"Done 2000 (runs )?in", proc.stderr), proc.stderr[-2000:]
    assert not list(tmp_path.glob("crash-*"))


@pytest.mark.slow
@pytest.mark.parametrize("name", HARNESSES)
def test_harness_runs_without_atheris(name: str, tmp_path: Path) -> None:
    """The plain-Python fallback loop (for where atheris does not build) runs the same checks."""
    proc = run_harness(name, tmp_path, "--plain", "-atheris_runs=300", "-seed=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "300 inputs, no failure" in proc.stdout, proc.stdout[-2000:]


def import_harness(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Import a harness in plain mode (no atheris instrumentation in the test process)."""
    monkeypatch.syspath_prepend(str(REPO / "fuzz"))
    monkeypatch.setattr(sys, "argv", [name, "--plain"])
    return importlib.import_module(name)


def test_harness_reports_a_failing_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness checks can fail, and the plain loop saves the failing input."""
    fuzz_sse = import_harness("fuzz_sse", monkeypatch)
    fuzz_parser = import_harness("fuzz_parser", monkeypatch)
    for seed in fuzz_parser.seeds():
        fuzz_parser.check(seed)  # the seeds are good streams
    assert fuzz_parser.strict_json('{"a": [1]}')
    assert not fuzz_parser.strict_json("NaN")
    assert not fuzz_parser.strict_json("\u2028")

    def broken(data: bytes) -> None:
        assert b"DONE" not in data, "found it"

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fuzz_sse.py", "-atheris_runs=5000", "-seed=3"])
    with pytest.raises(AssertionError, match="found it"):
        fuzz_sse.plain_loop(broken, [b"\x00\x00data: [DO"])
    (crash,) = tmp_path.glob("crash-*")
    assert b"DONE" in crash.read_bytes()
