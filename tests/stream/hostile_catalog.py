"""A catalog of malformed and hostile streams, each with its documented outcome, as data.

``CASES`` are small enough to run in-process (``tests/stream/test_hostile.py`` feeds each one whole and
in small pieces, and checks the outcome). ``BIG`` are the resource attacks (100 MB events, a
million events): each names a generator of 1 MiB-or-smaller pieces, and the test runs it in a
subprocess that measures peak RSS and time.

Where an outcome comes from: "spec" = ``shared/spec/parser.md``; "WHATWG" = the event-stream
rules the spec adopts; "README" = a choice the project documents where the spec is silent;
"orjson" = a limit of the JSON decoder, recorded as observed. An outcome marked ``known_bug``
is what the spec asks for and the parser does not do yet (the test fails until it is fixed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import entry as call

#: the parser's default limits (kept in sync by a test)
MiB = 1024 * 1024

# -- builders ----------------------------------------------------------------------------------


def chunk(
    *entries: dict[str, Any], finish: str | None = None, ci: int = 0, **delta: Any
) -> dict[str, Any]:
    """A chunk with one choice ``ci``; ``entries`` are its ``tool_calls``."""
    d: dict[str, Any] = dict(delta)
    if entries:
        d["tool_calls"] = list(entries)
    return {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": ci, "delta": d, "finish_reason": finish}],
    }


def ev(item: dict[str, Any] | bytes | str, *, ascii: bool = True) -> bytes:
    """One SSE event: a chunk as ``data: <json>`` + blank line; bytes/str are sent raw."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8", "surrogatepass")
    return b"data: " + json.dumps(item, ensure_ascii=ascii).encode() + b"\n\n"


def stream(*items: dict[str, Any] | bytes | str, ascii: bool = True) -> bytes:
    return b"".join(ev(i, ascii=ascii) for i in items)


DONE = b"data: [DONE]\n\n"
#: opens call 0 (``get_weather``) with arguments cut mid-string: a live call to watch
OPEN = ev(chunk(call(0, "call_a", "get_weather", '{"city": "Par')))
#: the rest of that call and a normal end
CLOSE = ev(chunk(call(0, args='is"}'))) + ev(chunk(finish="tool_calls")) + DONE
GOOD = OPEN + CLOSE
GOOD_CALL = {
    "index": 0,
    "id": "call_a",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
    "state": "finished",
    "reason": None,
}
LIVE_ABORTED = {"id": "call_a", "state": "aborted", "reason": "protocol_error"}


def one_call_stream(
    *, id: str = "call_x", name: str = "f", args: str = "{}", ascii: bool = True
) -> bytes:
    return stream(chunk(call(0, id, name, args)), chunk(finish="tool_calls"), ascii=ascii) + DONE


# -- the catalog -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What must happen. ``None`` means "not checked"."""

    #: a RemoteProtocolError must be raised, with this exact ``path`` ...
    raises: bool = False
    error_path: str | None = None
    #: ... this phrase in its message, and this event number
    error_phrase: str = ""
    error_event: int | None = None
    #: ``result.end_how`` / ``result.end_reason`` (``reason`` checked only with ``how``)
    how: str | None = None
    reason: str | None = None
    #: anomaly kinds that must be reported, with multiplicity; ``only_anomalies``: no others
    anomalies: tuple[str, ...] = ()
    only_anomalies: bool = False
    #: the calls in final order (choice by choice): attributes that must match
    calls: tuple[dict[str, Any], ...] | None = None
    #: ``result.complete``
    complete: bool | None = None
    #: per choice: attributes of the Turn that must match (``content``, ``finish_reason``...)
    turns: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: an extra check on the parser after EOF: ``(parser) -> None`` raising AssertionError
    check: Callable[[Any], None] | None = None


@dataclass(frozen=True, kw_only=True)
class Hostile:
    id: str
    #: what the input is, and why the outcome is right (with its source)
    why: str
    #: raw SSE bytes fed with ``receive_data`` ...
    sse: bytes | None = None
    #: ... or chunks fed with ``receive_chunk``
    chunks: tuple[Any, ...] | None = None
    limits: dict[str, int] | None = None
    expect: Outcome
    #: the spec asks for ``expect`` and the parser does not do it yet (reported; test fails)
    known_bug: str | None = None


def _bad(path: str, phrase: str = "", event: int = 2) -> Outcome:
    return Outcome(
        raises=True, error_path=path, error_phrase=phrase, error_event=event, calls=(LIVE_ABORTED,)
    )


def _bad_json(phrase: str = "not valid JSON", event: int = 2) -> Outcome:
    return _bad(None, phrase, event)  # type: ignore[arg-type]


TC = "choices[0].delta.tool_calls[0]"
NUL_ID = "call_\x00\x01\x1b[31m\n\r\t\u2028\u200b"
SQL_ID = "call_'); DROP TABLE fsm_tool_calls; -- \" OR 1=1 /*"
LONG_ID = "call_" + "A" * MiB  # 1 MiB
UNICODE_NAME = "天気_получить_🌦️_طقس"  # CJK, Cyrillic, emoji with VS16, Arabic (RTL)
DEEP = 100_000


def _deep_args_check(parser: Any) -> None:
    (c,) = parser.turns[0].tool_calls
    assert len(c.raw_arguments) == 2 * DEEP


CASES: list[Hostile] = [
    # -- bytes and encodings -------------------------------------------------------------------
    Hostile(
        id="invalid-utf8-in-content",
        why="spec: not a chunk (the data is not UTF-8 JSON) -> RemoteProtocolError; live calls "
        "aborted (protocol_error)",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"content":"a\xff\xfeb"}}]}\n\n',
        expect=_bad_json(),
    ),
    Hostile(
        id="invalid-utf8-in-arguments",
        why="spec: as above, inside a tool-call argument fragment (a cut 3-byte character)",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
        b'"function":{"arguments":"\xe6\x97"}}]}}]}\n\n',
        expect=_bad_json(),
    ),
    Hostile(
        id="invalid-utf8-encoded-surrogate",
        why="spec: CESU-style encoded surrogate bytes are not UTF-8 -> RemoteProtocolError",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"content":"\xed\xa0\xbd"}}]}\n\n',
        expect=_bad_json(),
    ),
    Hostile(
        id="invalid-utf8-in-comment",
        why="WHATWG: comment lines are ignored and never decoded",
        sse=b": \xff\xfe\x00 keep-alive\n\n" + GOOD,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="invalid-utf8-in-event-name",
        why="WHATWG: a field value is decoded with replacement; an event with another name that "
        "carries chunk data is still a chunk (watsonx names its events 'message')",
        sse=b"event: \xff\xfe\n" + GOOD,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True),
    ),
    Hostile(
        id="bom-at-start",
        why="spec/WHATWG: one UTF-8 BOM at the very start is skipped",
        sse=b"\xef\xbb\xbf" + GOOD,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="bom-twice-at-start",
        why="WHATWG: only the first BOM is skipped; the second makes the first line an unknown "
        "field ('\\ufeffdata'), ignored, so that event is lost. Spec routing rule 2: the next "
        "fragment (index 0, no call there) opens a nameless call -> aborted (missing_name): "
        "the lost header can never pass for a complete turn",
        sse=b"\xef\xbb\xbf\xef\xbb\xbf" + GOOD,
        expect=Outcome(
            how="done",
            calls=(
                {
                    "id": "",
                    "name": "",
                    "arguments": 'is"}',
                    "state": "aborted",
                    "reason": "missing_name",
                },
            ),
            complete=False,
            only_anomalies=True,
        ),
    ),
    Hostile(
        id="bom-inside-data",
        why="spec: a BOM before the JSON of a data line is not JSON -> RemoteProtocolError",
        sse=OPEN + b'data: \xef\xbb\xbf{"choices":[]}\n\n',
        expect=_bad_json("BOM"),
    ),
    Hostile(
        id="cr-only-line-endings",
        why="spec/WHATWG: lines may end with a lone CR",
        sse=GOOD.replace(b"\n", b"\r"),
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="crlf-line-endings",
        why="spec/WHATWG: lines may end with CRLF",
        sse=GOOD.replace(b"\n", b"\r\n"),
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="mixed-line-endings",
        why="spec/WHATWG: LF, CRLF and CR mixed in one stream",
        sse=OPEN.replace(b"\n\n", b"\r\n\r")
        + ev(chunk(call(0, args='is"}'))).replace(b"\n\n", b"\r\r")
        + ev(chunk(finish="tool_calls"))
        + b"data: [DONE]\r\n\n",
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="data-without-space",
        why="spec/WHATWG: 'data:' with or without one space",
        sse=GOOD.replace(b"data: ", b"data:"),
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="data-json-split-over-lines",
        why="WHATWG: several data lines join with LF, which is JSON whitespace",
        sse=OPEN + b'data: {"choices":\ndata: [{"index":0,"delta":{"tool_calls":[{"index":0,'
        b'\ndata: "function":{"arguments":"is\\"}"}}]}}]}\n\n'
        + ev(chunk(finish="tool_calls"))
        + DONE,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="raw-nul-byte-in-json-string",
        why="spec: a raw control character inside a JSON string is invalid JSON",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"content":"a\x00b"}}]}\n\n',
        expect=_bad_json("control character"),
    ),
    Hostile(
        id="raw-nul-bytes-between-events",
        why="WHATWG: a line of NUL bytes is an unknown field (its name is NULs): ignored",
        sse=OPEN + b"\x00\x00\x00\n\n" + CLOSE,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="escaped-nul-in-id-name-arguments",
        why="spec: ids, names and arguments are kept byte-exact, \\u0000 included",
        sse=one_call_stream(id="call_\x00", name="f\x00g", args='{"a": "\\u0000"}'),
        expect=Outcome(
            how="done",
            calls=(
                {
                    "id": "call_\x00",
                    "name": "f\x00g",
                    "arguments": '{"a": "\\u0000"}',
                    "state": "finished",
                },
            ),
            complete=True,
        ),
    ),
    Hostile(
        id="lone-surrogate-escape-split-across-chunks",
        why="spec: valid JSON is a chunk, and nothing may be lost. A gateway that cuts text by "
        "UTF-16 code units (JSON.stringify of a split emoji) sends '\\ud83d' then '\\ude00': "
        "both are valid JSON (RFC 8259 grammar); the emoji must survive",
        sse=OPEN
        + b'data: {"choices":[{"index":0,"delta":{"content":"\\ud83d"}}]}\n\n'
        + b'data: {"choices":[{"index":0,"delta":{"content":"\\ude00"}}]}\n\n'
        + CLOSE,
        expect=Outcome(
            how="done",
            complete=True,
            check=lambda p: _assert_emoji(p.turns[0].content),
        ),
        known_bug="orjson refuses lone surrogate escapes; the parser raises RemoteProtocolError "
        "('no low surrogate in string') on valid JSON",
    ),
    # -- JSON shape ------------------------------------------------------------------------------
    Hostile(
        id="truncated-json",
        why="spec: invalid JSON -> RemoteProtocolError saying where (event 2, its byte offset)",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"content":"x\n\n',
        expect=_bad_json(),
    ),
    Hostile(
        id="json-not-an-object",
        why="spec: a chunk must be an object",
        sse=OPEN + b"data: [1, 2, 3]\n\n",
        expect=_bad(None, "must be a JSON object"),  # type: ignore[arg-type]
    ),
    Hostile(
        id="deeply-nested-chunk",
        why="orjson: nesting past 1024 is refused (100k '['): RemoteProtocolError, no crash, "
        "no RecursionError",
        sse=OPEN + b"data: " + b"[" * DEEP + b"\n\n",
        expect=_bad_json("depth"),
    ),
    Hostile(
        id="deeply-nested-unknown-field",
        why="orjson: a valid chunk whose unknown field nests 100k deep is refused the same way "
        "(the spec ignores unknown fields, but the decoder has a depth limit)",
        sse=OPEN + b'data: {"x": ' + b"[" * DEEP + b"]" * DEEP + b', "choices": []}\n\n',
        expect=_bad_json("depth"),
    ),
    Hostile(
        id="deeply-nested-arguments-unbalanced",
        why="spec: 100k '[' as arguments is not valid JSON -> truncated (invalid_json); kept raw",
        sse=one_call_stream(args="[" * DEEP),
        expect=Outcome(
            how="done",
            calls=({"state": "truncated", "reason": "invalid_json"},),
            complete=False,
        ),
    ),
    Hostile(
        id="deeply-nested-arguments-balanced",
        why="spec round 2: valid JSON nested 100k deep passes max_json_depth (512): the call "
        "ends aborted (limit:max_json_depth), never executed; kept raw",
        sse=one_call_stream(args="[" * DEEP + "]" * DEEP),
        expect=Outcome(
            how="done",
            calls=({"state": "aborted", "reason": "limit:max_json_depth"},),
            complete=False,
            check=_deep_args_check,
        ),
    ),
    Hostile(
        id="arguments-nan",
        why="spec: 'finished' needs arguments that parse as JSON; NaN is not JSON (RFC 8259) -> "
        "truncated (invalid_json)",
        sse=one_call_stream(args="NaN"),
        expect=Outcome(
            how="done", calls=({"state": "truncated", "reason": "invalid_json"},), complete=False
        ),
        known_bug="is_json falls back to json.loads, which accepts NaN/Infinity",
    ),
    Hostile(
        id="arguments-infinity-inside-object",
        why="spec: as above, '{\"a\": -Infinity}' is not JSON",
        sse=one_call_stream(args='{"a": -Infinity}'),
        expect=Outcome(
            how="done", calls=({"state": "truncated", "reason": "invalid_json"},), complete=False
        ),
        known_bug="is_json falls back to json.loads, which accepts NaN/Infinity",
    ),
    Hostile(
        id="arguments-unicode-space-only",
        why="spec: 'finished' means valid JSON or empty/whitespace; U+2028 / NBSP are not JSON "
        "whitespace, and json.loads of them fails downstream -> truncated (invalid_json)",
        sse=one_call_stream(args="\u2028\u00a0"),
        expect=Outcome(
            how="done", calls=({"state": "truncated", "reason": "invalid_json"},), complete=False
        ),
        known_bug="is_json uses str.isspace(), which is true for Unicode spaces",
    ),
    Hostile(
        id="arguments-json-scalar",
        why="spec: valid JSON that is not an object still parses -> finished (the spec checks "
        "JSON validity, not the schema)",
        sse=one_call_stream(args="[1, 2]"),
        expect=Outcome(how="done", calls=({"state": "finished"},), complete=True),
    ),
    Hostile(
        id="duplicate-keys-last-wins",
        why="orjson: with duplicate keys the last one wins; here the valid 'choices' comes last",
        sse=OPEN + b'data: {"choices": "bad", "choices": []}\n\n' + CLOSE,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True),
    ),
    Hostile(
        id="choices-as-object",
        why="spec: wrong type -> RemoteProtocolError at 'choices'",
        sse=OPEN + ev({"choices": {"0": {"index": 0, "delta": {}}}}),
        expect=_bad("choices", "must be a list"),
    ),
    Hostile(
        id="tool-calls-as-string",
        why="spec: 'tool_calls not a list' -> RemoteProtocolError at its path",
        sse=OPEN + ev({"choices": [{"index": 0, "delta": {"tool_calls": "get_weather()"}}]}),
        expect=_bad("choices[0].delta.tool_calls", "must be a list"),
    ),
    Hostile(
        id="arguments-as-object",
        why="spec: wrong type -> RemoteProtocolError at function.arguments",
        sse=OPEN + ev(chunk(call(0, args={"city": "Paris"}))),
        expect=_bad(TC + ".function.arguments", "a string or null"),
    ),
    Hostile(
        id="name-as-list",
        why="spec: wrong type -> RemoteProtocolError at function.name",
        sse=OPEN + ev(chunk(call(0, name=["get_weather"]))),
        expect=_bad(TC + ".function.name", "a string or null"),
    ),
    Hostile(
        id="index-as-numeric-string",
        why='spec: \'"index": "x"\' is a wrong type; a numeric string too',
        sse=OPEN + ev(chunk(call("0", args="x"))),
        expect=_bad(TC + ".index", "non-negative integer"),
    ),
    Hostile(
        id="index-negative",
        why="spec: an index is a non-negative integer",
        sse=OPEN + ev(chunk(call(-1, args="x"))),
        expect=_bad(TC + ".index", "non-negative integer"),
    ),
    Hostile(
        id="index-2-63",
        why="README (round 2: values in a result must be storable): an index past 2**31 - 1 "
        "cannot be stored (32-bit column) -> RemoteProtocolError at its path",
        sse=OPEN
        + ev(chunk(call(0, args='is"}')))
        + ev(chunk(call(9223372036854775808, "c2", "f", "{}"))),
        expect=Outcome(
            raises=True,
            error_path=TC + ".index",
            error_phrase="non-negative integer (at most 2147483647)",
            error_event=3,
            calls=({"id": "call_a", "state": "aborted", "reason": "protocol_error"},),
        ),
    ),
    Hostile(
        id="index-2-31-minus-1",
        why="README: the largest storable index, 2**31 - 1, is a legal (odd) index",
        sse=one_call_stream().replace(b'"index": 0, "id"', b'"index": 2147483647, "id"'),
        expect=Outcome(
            how="done", calls=({"index": 2**31 - 1, "state": "finished"},), complete=True
        ),
    ),
    Hostile(
        id="index-10-30",
        why="orjson decodes integers past 64 bits as floats: the index is then not an integer "
        "-> RemoteProtocolError at its path (never a silent wrap-around)",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":'
        b'1000000000000000000000000000000,"function":{"arguments":"x"}}]}}]}\n\n',
        expect=_bad(TC + ".index", "non-negative integer"),
    ),
    Hostile(
        id="index-10-30-as-dict-chunk",
        why="a chunk handed over as a dict keeps Python's exact integers: the index 10**30 is "
        "refused there too (README: past 2**31 - 1 it cannot be stored)",
        chunks=(chunk(call(10**30, "c", "f", "{}")), chunk(finish="tool_calls"), "[DONE]"),
        expect=Outcome(
            raises=True, error_path=TC + ".index", error_phrase="non-negative integer", calls=()
        ),
    ),
    Hostile(
        id="choice-index-negative",
        why="spec: wrong type/value -> RemoteProtocolError at choices[0].index",
        sse=OPEN + ev({"choices": [{"index": -5, "delta": {"content": "x"}}]}),
        expect=_bad("choices[0].index", "non-negative integer"),
    ),
    Hostile(
        id="id-as-number",
        why="spec: wrong type -> RemoteProtocolError at id",
        sse=OPEN + ev(chunk(call(0, id=12345))),
        expect=_bad(TC + ".id", "a string or null"),
    ),
    Hostile(
        id="finish-reason-as-list",
        why="spec: wrong type -> RemoteProtocolError at finish_reason",
        sse=OPEN + ev({"choices": [{"index": 0, "delta": {}, "finish_reason": ["stop"]}]}),
        expect=_bad("choices[0].finish_reason", "a string or null"),
    ),
    Hostile(
        id="usage-as-string",
        why="spec: wrong type -> RemoteProtocolError at usage",
        sse=OPEN + ev({"choices": [], "usage": "12 tokens"}),
        expect=_bad("usage", "an object or null"),
    ),
    Hostile(
        id="bad-second-choice",
        why="spec: the error names the offending choice's path",
        sse=OPEN
        + ev({"choices": [{"index": 0, "delta": {"content": "ok"}}, {"index": 1, "delta": 7}]}),
        expect=_bad("choices[1].delta", "must be an object"),
    ),
    Hostile(
        id="legal-nulls-and-empties",
        why="spec: choices [] / null, a choice without delta, delta null, tool_calls [] / null "
        "are legal",
        sse=OPEN
        + stream(
            {"choices": []},
            {"choices": None},
            {"choices": [{"index": 0}]},
            {"choices": [{"index": 0, "delta": None}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": []}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": None}}]},
        )
        + CLOSE,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    # -- choices ---------------------------------------------------------------------------------
    Hostile(
        id="mixed-choices-interleaved",
        why="spec: several choices are independent turns, interleaved chunk by chunk",
        sse=stream(
            chunk(call(0, "c0", "f", '{"a"'), ci=0),
            chunk(content="hello", ci=1),
            chunk(call(0, "c1", "g", '{"b"'), ci=2),
            chunk(call(0, args=":1}"), ci=0),
            chunk(call(0, args=":2}"), ci=2, finish="length"),
            chunk(finish="tool_calls", ci=0),
            chunk(content=" world", finish="stop", ci=1),
        )
        + DONE,
        expect=Outcome(
            how="done",
            complete=False,
            calls=(
                {"choice": 0, "id": "c0", "arguments": '{"a":1}', "state": "finished"},
                {"choice": 2, "id": "c1", "state": "truncated", "reason": "length"},
            ),
            turns={
                0: {"complete": True},
                1: {"complete": True, "content": "hello world"},
                2: {"complete": False, "finish_reason": "length"},
            },
        ),
    ),
    Hostile(
        id="mixed-choices-same-call-id",
        why="spec: choices are independent: the same call id in two choices is two calls",
        sse=stream(
            chunk(call(0, "dup", "f", "{}"), ci=0),
            chunk(call(0, "dup", "f", "{}"), ci=1),
            chunk(finish="tool_calls", ci=0),
            chunk(finish="tool_calls", ci=1),
        )
        + DONE,
        expect=Outcome(
            how="done",
            complete=True,
            calls=({"choice": 0, "id": "dup"}, {"choice": 1, "id": "dup"}),
        ),
    ),
    Hostile(
        id="choice-index-2-63",
        why="README (round 2): a choice index past 2**31 - 1 cannot be stored -> "
        "RemoteProtocolError at its path",
        sse=stream(
            {"choices": [{"index": 2**63, "delta": {"content": "x"}, "finish_reason": "stop"}]}
        )
        + DONE,
        expect=Outcome(
            raises=True,
            error_path="choices[0].index",
            error_phrase="non-negative integer",
            error_event=1,
            calls=(),
        ),
    ),
    # -- routing oddities ------------------------------------------------------------------------
    Hostile(
        id="same-id-at-two-indices",
        why="spec routing rule 2: an index with no call opens a new call, even with an id "
        "already used at another index (ids are kept, never rewritten)",
        sse=stream(chunk(call(0, "same", "f", "{}")), chunk(call(1, "same", "g", "{}")))
        + ev(chunk(finish="tool_calls"))
        + DONE,
        expect=Outcome(
            how="done",
            complete=True,
            calls=(
                {"index": 0, "id": "same", "name": "f"},
                {"index": 1, "id": "same", "name": "g"},
            ),
        ),
    ),
    Hostile(
        id="orphan-continuation",
        why="spec routing rule 3: no index/id/name and no open call -> dropped, anomaly",
        sse=stream(chunk(call(None, args='{"x": 1}')), chunk(finish="stop")) + DONE,
        expect=Outcome(how="done", anomalies=("orphan_continuation",), calls=(), complete=True),
    ),
    Hostile(
        id="call-without-a-name",
        why="spec: a call that never got a name is aborted (missing_name)",
        sse=stream(chunk(call(0, "call_n", None, "{}")), chunk(finish="tool_calls")) + DONE,
        expect=Outcome(
            how="done", calls=({"state": "aborted", "reason": "missing_name"},), complete=False
        ),
    ),
    Hostile(
        id="delta-after-finish",
        why="spec: deltas after a finish_reason are still merged and reported",
        sse=OPEN + ev(chunk(finish="tool_calls")) + ev(chunk(call(0, args='is"}'))) + DONE,
        expect=Outcome(
            how="done", anomalies=("delta_after_finish",), calls=(GOOD_CALL,), complete=True
        ),
    ),
    Hostile(
        id="unknown-finish-reason",
        why="spec: an unknown finish_reason ends the turn like 'stop', reported",
        sse=OPEN + ev(chunk(call(0, args='is"}'))) + ev(chunk(finish="DROP TABLE")) + DONE,
        expect=Outcome(
            how="done", anomalies=("unknown_finish_reason",), calls=(GOOD_CALL,), complete=True
        ),
    ),
    # -- the end of the stream -------------------------------------------------------------------
    Hostile(
        id="done-twice-as-chunks",
        why="spec: the string '[DONE]' fed as a chunk ends the stream; a second is an anomaly",
        chunks=(
            chunk(call(0, "call_a", "get_weather", '{"city": "Paris"}'), finish="tool_calls"),
            "[DONE]",
            b" [DONE] ",
        ),
        expect=Outcome(
            how="done", anomalies=("data_after_end",), calls=(GOOD_CALL,), complete=True
        ),
    ),
    Hostile(
        id="garbage-chunk-text",
        why="spec: a chunk given as JSON text that is not JSON -> RemoteProtocolError",
        chunks=(chunk(call(0, "call_a", "get_weather", '{"city": "Par')), '{"choices": [}'),
        expect=_bad_json(),
    ),
    Hostile(
        id="done-twice",
        why="spec: input after [DONE] is an anomaly and ignored",
        sse=GOOD + DONE,
        expect=Outcome(
            how="done", anomalies=("data_after_end",), calls=(GOOD_CALL,), complete=True
        ),
    ),
    Hostile(
        id="garbage-after-done",
        why="spec: after [DONE] even invalid JSON is only an anomaly, never an error",
        sse=GOOD + b"data: {not json\n\ndata: [1]\n\n",
        expect=Outcome(
            how="done",
            anomalies=("data_after_end", "data_after_end"),
            calls=(GOOD_CALL,),
            complete=True,
        ),
    ),
    Hostile(
        id="done-with-spaces",
        why="spec: 'data: [DONE]' ends the stream; surrounding whitespace is tolerated",
        sse=OPEN + CLOSE.replace(DONE, b"data:   [DONE]  \n\n"),
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    Hostile(
        id="eof-inside-an-event",
        why="WHATWG: a partial event at EOF is discarded (README: incomplete_event_at_eof); "
        "with no finish_reason the call is aborted (eof)",
        sse=OPEN + b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n',
        expect=Outcome(
            how="eof",
            anomalies=("incomplete_event_at_eof",),
            calls=({"state": "aborted", "reason": "eof"},),
            complete=False,
        ),
    ),
    Hostile(
        id="empty-data-event",
        why="README: an empty data event is reported (empty_event) and ignored",
        sse=OPEN + b"data:\n\n" + CLOSE,
        expect=Outcome(how="done", anomalies=("empty_event",), calls=(GOOD_CALL,), complete=True),
    ),
    Hostile(
        id="named-events-without-data",
        why="spec: named events without chunk data (event: close) are ignored; id:/retry: are "
        "not data; an id with NUL is ignored (WHATWG)",
        sse=OPEN + b"event: close\n\nretry: 10\nid: a\x00b\n\n" + CLOSE,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True, only_anomalies=True),
    ),
    # -- errors from the provider ----------------------------------------------------------------
    Hostile(
        id="error-event-garbage",
        why="spec: an SSE 'event: error' carries an error; its garbage text is the reason",
        sse=OPEN + b"event: error\ndata: <html>502 Bad Gateway{{\n\n",
        expect=Outcome(
            how="error",
            reason="<html>502 Bad Gateway{{",
            calls=({"state": "aborted", "reason": "<html>502 Bad Gateway{{"},),
            complete=False,
        ),
    ),
    Hostile(
        id="error-event-invalid-utf8",
        why="spec: an error event must never vanish, even undecodable: replacement characters",
        sse=OPEN + b"event: error\ndata: \xff\xfeboom\n\n",
        expect=Outcome(
            how="error",
            reason="\ufffd\ufffdboom",
            calls=({"state": "aborted", "reason": "\ufffd\ufffdboom"},),
            complete=False,
        ),
    ),
    Hostile(
        id="error-event-without-data",
        why="README: 'event: error' is dispatched even with no data",
        sse=OPEN + b"event: error\n\n",
        expect=Outcome(how="error", reason="error event", calls=({"state": "aborted"},)),
    ),
    Hostile(
        id="error-object-is-a-string",
        why="spec: an error payload ends the stream; a string error is its own message",
        sse=OPEN + ev({"error": "rate limited; DROP TABLE users"}),
        expect=Outcome(
            how="error",
            reason="rate limited; DROP TABLE users",
            calls=({"state": "aborted", "reason": "rate limited; DROP TABLE users"},),
            complete=False,
        ),
    ),
    Hostile(
        id="error-object-is-a-number",
        why="spec: an error payload ends the stream; a number is shown as JSON",
        sse=OPEN + ev({"error": 429}),
        expect=Outcome(how="error", reason="429", calls=({"state": "aborted", "reason": "429"},)),
    ),
    Hostile(
        id="error-object-message-not-a-string",
        why="spec: the reason is the error's message; without a string message, the error as JSON",
        sse=OPEN + ev({"error": {"message": 5, "code": "x"}}),
        expect=Outcome(how="error", reason='{"code": "x", "message": 5}', complete=False),
    ),
    Hostile(
        id="error-null-is-no-error",
        why="spec: only a non-null error field is an error payload",
        sse=OPEN + ev({"error": None, "choices": []}) + CLOSE,
        expect=Outcome(how="done", calls=(GOOD_CALL,), complete=True),
    ),
    Hostile(
        id="error-after-finish-reason",
        why="spec (openai-node #2046): an error after buffered chunks is not success",
        sse=OPEN + ev(chunk(call(0, args='is"}'), finish="tool_calls")) + ev({"error": "late"}),
        expect=Outcome(
            how="error", calls=({"state": "aborted", "reason": "late"},), complete=False
        ),
    ),
    # -- ids and names kept byte-exact -----------------------------------------------------------
    Hostile(
        id="id-sql-injection",
        why="spec: ids are the provider's, byte-exact (never escaped or rewritten)",
        sse=one_call_stream(id=SQL_ID),
        expect=Outcome(how="done", calls=({"id": SQL_ID, "state": "finished"},), complete=True),
    ),
    Hostile(
        id="id-control-characters",
        why="spec: ids byte-exact, control characters, line separators and ZWSP included",
        sse=one_call_stream(id=NUL_ID),
        expect=Outcome(how="done", calls=({"id": NUL_ID, "state": "finished"},), complete=True),
    ),
    Hostile(
        id="id-1-mib",
        why="spec round 2: ids are limited (max_id_bytes, 512): a 1 MiB id is not kept, the call "
        "ends aborted (limit:max_id_bytes) and the turn is incomplete",
        sse=one_call_stream(id=LONG_ID),
        expect=Outcome(
            how="done",
            anomalies=("limit_exceeded",),
            calls=({"id": "", "state": "aborted", "reason": "limit:max_id_bytes"},),
            complete=False,
        ),
    ),
    Hostile(
        id="non-ascii-name-raw-utf8",
        why="spec: names byte-exact (CJK, Cyrillic, emoji, RTL), sent as raw UTF-8",
        sse=one_call_stream(name=UNICODE_NAME, args='{"ville": "Zürich 🌧"}', ascii=False),
        expect=Outcome(
            how="done",
            calls=({"name": UNICODE_NAME, "arguments": '{"ville": "Zürich 🌧"}'},),
            complete=True,
        ),
    ),
    Hostile(
        id="non-ascii-name-split",
        why="spec: a name split across deltas is joined (here between two CJK characters)",
        sse=stream(
            chunk(call(0, "c", "天", "")),
            chunk(call(0, name="気")),
            chunk(call(0, args="{}"), finish="tool_calls"),
        )
        + DONE,
        expect=Outcome(how="done", calls=({"name": "天気", "state": "finished"},), complete=True),
    ),
    # -- limits, small -----------------------------------------------------------------------------
    Hostile(
        id="max-event-bytes-small",
        why="spec: past max_event_bytes the stream ends, live calls aborted (limit:...)",
        sse=OPEN + ev(chunk(content="x" * 5000)) + CLOSE,
        limits={"max_event_bytes": 4096},
        expect=Outcome(
            how="limit",
            reason="limit:max_event_bytes",
            anomalies=("limit_exceeded",),
            calls=({"state": "aborted", "reason": "limit:max_event_bytes"},),
            complete=False,
        ),
    ),
    Hostile(
        id="tool-calls-100k-in-one-chunk",
        why="spec: max_tool_calls per choice: the 1025th call ends the stream; nothing past it "
        "is opened",
        sse=b'data: {"choices": [{"index": 0, "delta": {"tool_calls": ['
        + b",".join(
            b'{"index": %d, "id": "c%d", "function": {"name": "f", "arguments": "{}"}}' % (i, i)
            for i in range(100_000)
        )
        + b"]}}]}\n\n"
        + DONE,
        expect=Outcome(
            how="limit",
            reason="limit:max_tool_calls",
            anomalies=("limit_exceeded", "data_after_end"),
            complete=False,
            check=lambda p: _assert_calls(p, 1024, "limit:max_tool_calls"),
        ),
    ),
    Hostile(
        id="max-choices",
        why="spec: limits with safe defaults: the 129th choice ends the stream (limit:...)",
        sse=stream(*({"choices": [{"index": i, "delta": {"content": "x"}}]} for i in range(200))),
        expect=Outcome(how="limit", reason="limit:max_choices", complete=False),
    ),
]


def _assert_emoji(content: str | None) -> None:
    assert content is not None
    text = content.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    assert text == "😀", repr(content)


def _assert_calls(parser: Any, count: int, reason: str) -> None:
    calls = parser.turns[0].tool_calls
    assert len(calls) == count
    assert {(c.state.value, c.reason) for c in calls} == {("aborted", reason)}


# -- wrong types at every field, generated ---------------------------------------------------

#: (path of the field, a chunk builder putting ``value`` there)
FIELDS: list[tuple[str, Callable[[Any], dict[str, Any]]]] = [
    ("choices", lambda v: {"choices": v}),
    ("choices[0]", lambda v: {"choices": [v]}),
    ("choices[0].index", lambda v: {"choices": [{"index": v, "delta": {}}]}),
    ("choices[0].delta", lambda v: {"choices": [{"index": 0, "delta": v}]}),
    ("choices[0].finish_reason", lambda v: {"choices": [{"index": 0, "finish_reason": v}]}),
    ("choices[0].delta.content", lambda v: chunk(content=v)),
    ("choices[0].delta.reasoning_content", lambda v: chunk(reasoning_content=v)),
    ("choices[0].delta.reasoning", lambda v: chunk(reasoning=v)),
    ("choices[0].delta.refusal", lambda v: chunk(refusal=v)),
    ("choices[0].delta.tool_calls", lambda v: chunk(tool_calls=v)),
    (TC, lambda v: chunk(v)),
    (TC + ".index", lambda v: chunk(call(v, "i", "f", "{}"))),
    (TC + ".id", lambda v: chunk(call(5, v, "f", "{}"))),
    (TC + ".type", lambda v: chunk(call(5, "i", "f", "{}", type=v))),
    (TC + ".function", lambda v: chunk({"index": 5, "id": "i", "function": v})),
    (TC + ".function.name", lambda v: chunk(call(5, "i", v, "{}"))),
    (TC + ".function.arguments", lambda v: chunk(call(5, "i", "f", v))),
    ("usage", lambda v: {"choices": [], "usage": v}),
]

#: values of each JSON type; a field rejects those its type does not allow
VALUES: dict[str, Any] = {
    "true": True,
    "number": 7,
    "float": 1.5,
    "string": "x",
    "list": [1],
    "object": {"k": 1},
}
#: which of VALUES each field accepts (null is always accepted, or ignored)
ACCEPTS: dict[str, set[str]] = {
    "choices": {"list"},
    "choices[0]": {"object"},
    "choices[0].index": {"number"},
    "choices[0].delta": {"object"},
    "choices[0].finish_reason": {"string"},
    "choices[0].delta.content": {"string"},
    "choices[0].delta.reasoning_content": {"string"},
    "choices[0].delta.reasoning": {"string"},
    "choices[0].delta.refusal": {"string"},
    "choices[0].delta.tool_calls": {"list"},
    TC: {"object"},
    TC + ".index": {"number"},
    TC + ".id": {"string"},
    TC + ".type": {"string"},
    TC + ".function": {"object"},
    TC + ".function.name": {"string"},
    TC + ".function.arguments": {"string"},
    "usage": {"object"},
}


def wrong_type_cases() -> list[tuple[str, bytes, str]]:
    """``(case id, SSE bytes, expected error path)`` for every field x every wrong JSON type.

    A list where an entry must be an object (``choices``, ``tool_calls``) fails at the element:
    ``[1]`` is a list of a number."""
    out = []
    for path, build in FIELDS:
        for kind, value in VALUES.items():
            if kind in ACCEPTS[path]:
                continue
            expected = path
            if kind == "list" and path in ("choices", "choices[0].delta.tool_calls"):
                expected = path + "[0]"
            out.append((f"{path}={kind}", OPEN + ev(build(value)), expected))
    return out


# -- the big ones: run in a subprocess, peak RSS and time measured ---------------------------


@dataclass(frozen=True, kw_only=True)
class Big:
    id: str
    why: str
    #: the name of a generator function in this module yielding byte pieces (each <= ~1 MiB)
    pieces: str
    limits: dict[str, int] | None = None
    #: expected: end_how, end_reason, anomaly kinds with exact counts (any other kind is an
    #: error unless named in ``other_anomalies``)
    how: str
    reason: str | None = None
    anomalies: dict[str, int] = field(default_factory=dict)
    other_anomalies: tuple[str, ...] = ()
    #: the number of calls expected, and their single (state, reason)
    calls: tuple[int, tuple[str, str | None] | None] = (0, None)
    content_length: int | None = None
    #: bounds: peak RSS growth over the baseline taken after the first piece, and wall time
    max_rss_growth_mb: float
    max_seconds: float
    slow: bool = False
    known_bug: str | None = None


ONE_MIB = b"x" * MiB


def fresh_mib() -> bytearray:
    """A new 1 MiB buffer, as a network read gives: reusing one bytes object would let the
    framer hold many references to the same memory and hide what buffering costs."""
    return bytearray(ONE_MIB)


def event_100mb_one_line() -> Iterator[bytes | bytearray]:
    """A single 100 MB 'data:' line with no newline at all, in 1 MiB pieces."""
    yield OPEN + b"data: "
    for _ in range(100):
        yield fresh_mib()
    yield b"\n\n" + CLOSE


def event_100mb_many_lines() -> Iterator[bytes]:
    """A single 100 MB event made of 100 'data:' lines of 1 MiB each."""
    yield OPEN
    for _ in range(100):
        yield b"data: " + ONE_MIB + b"\n"
    yield b"\n" + CLOSE


def line_50mb_default_limits() -> Iterator[bytes | bytearray]:
    """A 50 MB SSE line without newline (a comment-free garbage line) under default limits."""
    yield OPEN
    for _ in range(50):
        yield fresh_mib()


def arguments_64mb() -> Iterator[bytes]:
    """One call whose arguments grow to 64 MB in 1 KiB fragments (1024 fragments per piece)."""
    yield ev(chunk(call(0, "big", "f", "[")))
    frag = ev(chunk(call(0, args="1," * 512)))
    piece = frag * 1024
    for _ in range(64):
        yield piece
    yield ev(chunk(call(0, args="1]"), finish="tool_calls")) + DONE


def ping_comments_1m() -> Iterator[bytes]:
    """A million ': ping' keep-alive comments, then a normal call."""
    piece = b": ping\n\n" * 10_000
    yield OPEN
    for _ in range(100):
        yield piece
    yield CLOSE


def content_deltas_1m() -> Iterator[bytes]:
    """A million one-character content deltas."""
    piece = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n' * 10_000
    yield OPEN
    for _ in range(100):
        yield piece
    yield CLOSE


def tool_calls_1m() -> Iterator[bytes]:
    """A million tool calls, one per event, each with a new index."""
    template = (
        'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":%d,"id":"c%d",'
        '"function":{"name":"f","arguments":"{}"}}]}}]}\n\n'
    )
    for start in range(0, 1_000_000, 10_000):
        yield "".join(template % (i, i) for i in range(start, start + 10_000)).encode()
    yield ev(chunk(finish="tool_calls")) + DONE


def events_after_done_1m() -> Iterator[bytes]:
    """A normal stream, then a million more (tiny) events after [DONE]."""
    yield GOOD
    piece = b"data: {}\n\n" * 10_000
    for _ in range(100):
        yield piece


BIG: list[Big] = [
    Big(
        id="event-100mb-one-line",
        why="spec: past max_event_bytes (1 MiB here) the stream ends (limit:max_event_bytes); "
        "the 100 MB line is never buffered, and the rest is ignored (README)",
        pieces="event_100mb_one_line",
        limits={"max_event_bytes": MiB},
        how="limit",
        reason="limit:max_event_bytes",
        anomalies={"limit_exceeded": 1},
        calls=(1, ("aborted", "limit:max_event_bytes")),
        max_rss_growth_mb=24,
        max_seconds=10,
    ),
    Big(
        id="event-100mb-many-lines",
        why="spec: as above, with the event made of 100 data lines of 1 MiB",
        pieces="event_100mb_many_lines",
        limits={"max_event_bytes": MiB},
        how="limit",
        reason="limit:max_event_bytes",
        anomalies={"limit_exceeded": 1},
        calls=(1, ("aborted", "limit:max_event_bytes")),
        max_rss_growth_mb=24,
        max_seconds=10,
    ),
    Big(
        id="line-50mb-default-limits",
        why="spec: an endless line under the default 16 MiB event limit: the stream ends at "
        "16 MiB (limit:max_event_bytes), the rest is not buffered",
        pieces="line_50mb_default_limits",
        how="limit",
        reason="limit:max_event_bytes",
        anomalies={"limit_exceeded": 1},
        calls=(1, ("aborted", "limit:max_event_bytes")),
        max_rss_growth_mb=16 * 2 + 24,
        max_seconds=10,
    ),
    Big(
        id="arguments-64mb",
        why="spec: past max_argument_bytes (1 MiB here) the call is aborted "
        "(limit:max_argument_bytes) and its further fragments are dropped",
        pieces="arguments_64mb",
        limits={"max_argument_bytes": MiB},
        how="done",
        anomalies={"limit_exceeded": 1},
        calls=(1, ("aborted", "limit:max_argument_bytes")),
        max_rss_growth_mb=32,
        max_seconds=30,
    ),
    Big(
        id="ping-comments-1m",
        why="WHATWG: a million keep-alive comments are nothing; linear time, no memory",
        pieces="ping_comments_1m",
        how="done",
        anomalies={},
        calls=(1, ("finished", None)),
        max_rss_growth_mb=8,
        max_seconds=15,
    ),
    Big(
        id="content-deltas-1m",
        why="spec: a million one-character content deltas are concatenated in linear time; "
        "round 2: text is kept in blocks of 128 fragments, so memory tracks the text (1 MB), "
        "not the fragments (~85 bytes each before)",
        pieces="content_deltas_1m",
        how="done",
        calls=(1, ("finished", None)),
        content_length=1_000_000,
        max_rss_growth_mb=12,
        max_seconds=30,
    ),
    Big(
        id="tool-calls-1m",
        why="spec: max_tool_calls (1024 by default): the 1025th call ends the stream "
        "(limit:max_tool_calls); the rest is input after the end",
        pieces="tool_calls_1m",
        how="limit",
        reason="limit:max_tool_calls",
        anomalies={"limit_exceeded": 1},
        other_anomalies=("data_after_end",),
        calls=(1024, ("aborted", "limit:max_tool_calls")),
        max_rss_growth_mb=48,
        max_seconds=30,
        known_bug="every event after the end adds an Anomaly that is kept: ~110 bytes per event, "
        "unbounded (spec: past a limit, memory stays bounded)",
    ),
    Big(
        id="events-after-done-1m",
        why="spec: input after [DONE] is reported and ignored; memory must stay bounded",
        pieces="events_after_done_1m",
        how="done",
        other_anomalies=("data_after_end",),
        calls=(1, ("finished", None)),
        max_rss_growth_mb=48,
        max_seconds=30,
        known_bug="one Anomaly kept per event after the end: a million events grow RSS ~110 MB",
    ),
]

BY_ID = {case.id: case for case in BIG}
