#!/usr/bin/env python3
"""Fuzz the stream parser (``fsm.StreamParser``) with atheris, or with a plain random loop.

    python fuzz/fuzz_parser.py -atheris_runs=10000           # atheris / libFuzzer
    python fuzz/fuzz_parser.py --plain -atheris_runs=10000   # no atheris: seeded random mutations

The first byte of an input is a mode: how the stream ends (``receive_eof()``, ``abort()``), JSON
repair on or off, tiny limits or the defaults, raw bytes or a token language. In the token
language each input byte below 0xC0 picks a fragment of a chat-completion stream (``data: ``,
``{"choices":[{"index":0,"delta":{"tool_calls":[``, ``"id":"a"``, ``[DONE]``, ...), so the
fuzzer reaches deep parser states without learning JSON first. The second byte seeds the split
points. Checks, for every input (``shared/spec/parser.md``):

* only ``RemoteProtocolError`` escapes (never ``LocalProtocolError``, ``KeyError``, ...);
* the result does not depend on how the bytes are split;
* after the end every call is final; a ``finished`` call has JSON arguments (RFC 8259, or
  empty/whitespace); a repaired call's arguments start with its raw arguments; a call that is
  not finished says why; a ``truncated``/``aborted`` call is never ``repaired``;
* a complete turn becomes a message, an incomplete one refuses with ``IncompleteTurnError``;
  a stream that failed has no complete turn;
* limits hold: with tiny limits, no call holds more argument bytes than ``max_argument_bytes``
  and no choice more calls than ``max_tool_calls``;
* ``result().to_json()`` is JSON-serialisable.

See ``fuzz/README.md``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the repository root, for the tests' helpers (after the installed packages: fsm is not shadowed)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# fuzz_sse decides between atheris and the plain loop (and takes "--plain" off sys.argv)
import fuzz_sse

from tests.helpers import strict_json  # the tests' own JSON oracle (not instrumented)

atheris = fuzz_sse.atheris
if atheris is not None:
    with atheris.instrument_imports():
        from fsm import IncompleteTurnError, Limits, RemoteProtocolError, StreamParser
        from fsm.states import ToolCallState
else:
    from fsm import IncompleteTurnError, Limits, RemoteProtocolError, StreamParser
    from fsm.states import ToolCallState

TINY = Limits(
    max_argument_bytes=64, max_tool_calls=3, max_event_bytes=512, max_text_bytes=64, max_choices=2
)

#: the token language: byte b < len(VOCAB) stands for VOCAB[b]; other bytes stand for themselves
VOCAB: list[bytes] = [
    b"data: ",
    b"\n\n",
    b"data: [DONE]\n\n",
    b'{"choices":[{"index":0,"delta":{"tool_calls":[',
    b'{"choices":[{"index":1,"delta":{"tool_calls":[',
    b"]}}]}",
    b']},"finish_reason":"tool_calls"}]}',
    b']},"finish_reason":"length"}]}',
    b']},"finish_reason":"stop"}]}',
    b']},"finish_reason":"content_filter"}]}',
    b'{"index":0,',
    b'{"index":1,',
    b'{"index":0}',
    b"{",
    b"}",
    b",",
    b'"id":"a",',
    b'"id":"b",',
    b'"id":"",',
    b'"type":"function",',
    b'"function":{"name":"f"}',
    b'"function":{"name":"f","arguments":""}',
    b'"function":{"arguments":"{\\"x\\":"}',
    b'"function":{"arguments":"1}"}',
    b'"function":{"arguments":"NaN"}',
    b'"function":{"arguments":"[\\"\\u00e9\\""}',
    b'"function":{"arguments":"]"}',
    b'"function":{"name":"","arguments":" "}',
    b'{"choices":[{"index":0,"delta":{"content":"hi"}}]}',
    b'{"choices":[],"usage":{"total_tokens":1}}',
    b'{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}',
    b'{"error":{"message":"boom"}}',
    b"event: error\n",
    b": ping\n\n",
    b"\r\n",
    b"\r",
    b"\xef\xbb\xbf",
    b"null",
    b"\\u0000",
    b"\\ud83d",
    b"\xe6\x97",
]
TOKENS = [*fuzz_sse.TOKENS, *VOCAB]


def decode_tokens(body: bytes) -> bytes:
    return b"".join(VOCAB[b] if b < len(VOCAB) else bytes((b,)) for b in body)


def run(
    stream: bytes, points: list[int], *, abort: bool, repair: bool, limits: Limits | None
) -> tuple[StreamParser, RemoteProtocolError | None]:
    parser = StreamParser(repair_json=repair, limits=limits)
    bounds = [0, *points, len(stream)]
    try:
        for a, b in itertools.pairwise(bounds):
            parser.receive_data(stream[a:b])
        if abort:
            parser.abort("fuzz")
        else:
            parser.receive_eof()
    except RemoteProtocolError as exc:
        return parser, exc
    return parser, None


def snapshot(parser: StreamParser, error: RemoteProtocolError | None) -> Any:
    result = parser.result()
    return (
        json.dumps(result.to_json(), sort_keys=True),
        result.end_how,
        result.end_reason,
        [(a.kind, a.event_number) for a in result.anomalies],
        None if error is None else (error.path, error.event_number, error.byte_offset),
    )


def check(data: bytes) -> None:
    if len(data) < 2:
        return
    mode, seed, body = data[0], data[1], data[2:]
    abort = bool(mode & 1)
    repair = bool(mode & 2)
    limits = TINY if mode & 4 else None
    stream = decode_tokens(body) if mode & 8 else body

    parser, error = run(stream, [], abort=abort, repair=repair, limits=limits)
    rng = random.Random(seed)
    points = sorted(rng.randint(0, len(stream)) for _ in range(rng.randint(1, 10)))
    split = run(stream, points, abort=abort, repair=repair, limits=limits)
    assert snapshot(*split) == snapshot(parser, error), "the result depends on the splits"

    result = parser.result()
    assert parser.ended
    assert (error is None) == (result.error is None)
    for turn in result.turns:
        assert turn.ended
        if limits is not None:
            assert len(turn.tool_calls) <= limits.max_tool_calls
        for call in turn.tool_calls:
            assert call.final, call
            if limits is not None:
                assert call.argument_bytes <= limits.max_argument_bytes, call
            if call.state is ToolCallState.FINISHED:
                assert strict_json(call.arguments), f"finished with non-JSON {call!r}"
                assert call.arguments.startswith(call.raw_arguments)
                assert call.repaired == (call.arguments != call.raw_arguments)
                assert call.name, call
            else:
                assert call.reason, call
                assert not call.repaired, call
        if turn.complete:
            assert error is None
            assert all(c.state is ToolCallState.FINISHED for c in turn.tool_calls)
            turn.to_message()
        else:
            try:
                turn.to_message()
            except IncompleteTurnError:
                pass
            else:
                raise AssertionError("an incomplete turn became a message")
    json.dumps(result.to_json())


def TestOneInput(data: bytes) -> None:  # the name atheris expects
    check(data)


def seeds() -> list[bytes]:
    out = [
        b"\x08\x00" + bytes([0, 3, 10, 16, 20, 5, 1, 0, 3, 12, 22, 5, 1, 0, 30, 1, 2]),
        b"\x08\x01" + bytes([0, 3, 10, 16, 20, 5, 1, 0, 3, 12, 23, 6, 1, 2]),
        b"\x0c\x02" + bytes([0, 3, 10, 16, 20, 5, 1, 0, 4, 11, 17, 21, 7, 1, 2]),
        b"\x09\x03" + bytes([32, 0, 31, 1, 0, 28, 1]),
    ]
    for path in fuzz_sse.seed_files():
        with open(path, "rb") as f:
            raw = f.read(16384)
        out.append(b"\x00\x05" + raw)
        out.append(b"\x02\x06" + raw)
    return out


def main() -> None:
    if atheris is not None:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
    else:
        fuzz_sse.TOKENS[:] = TOKENS  # splice stream fragments in as well
        fuzz_sse.plain_loop(TestOneInput, seeds())


if __name__ == "__main__":
    main()
