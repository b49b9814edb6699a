"""fsm.parse / fsm.aparse: the one driver (feed, abort on a failing source), and import cost."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

import fsm
from fsm.api import feed, feed_all
from fsm.errors import RemoteProtocolError
from fsm.events import Event, StreamEnded
from fsm.parser import StreamParser
from fsm.parser import feed_all as parser_feed_all

_CALL = (
    b'data: {"id":"r1","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
    b'"id":"c1","function":{"name":"f","arguments":"{\\"a\\": 1}"}}]}}]}\n\n'
)
_FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
_STREAM = _CALL + _FINISH + b"data: [DONE]\n\n"


def _pieces() -> list[bytes]:
    return [_STREAM[i : i + 7] for i in range(0, len(_STREAM), 7)]


async def _aiter(items: list[object], fail: BaseException | None = None) -> AsyncIterator[object]:
    for item in items:
        await asyncio.sleep(0)
        yield item
    if fail is not None:
        raise fail


def test_import_fsm_does_not_load_asyncio() -> None:
    code = "import sys, fsm; fsm.aparse; print('asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_aparse_matches_parse() -> None:
    seen: list[Event] = []
    result = asyncio.run(fsm.aparse(_aiter(list(_pieces())), on_event=seen.append))
    expected = fsm.parse(_pieces())
    assert result.complete and expected.complete
    assert result.to_json() == expected.to_json()
    assert isinstance(seen[-1], StreamEnded) and seen[-1].how == "done"


def test_aparse_aborts_when_the_source_fails() -> None:
    result = asyncio.run(fsm.aparse(_aiter([_CALL], OSError("reset"))))
    assert not result.complete
    assert (result.end_how, result.end_reason) == ("aborted", "OSError: reset")
    assert result.turn(0).tool_calls[0].reason == "OSError: reset"


def test_aparse_cancelled_aborts_and_reraises() -> None:
    seen: list[Event] = []

    seen_result: list[object] = []

    async def run() -> None:
        parser_source = _aiter([_CALL], asyncio.CancelledError())
        try:
            await fsm.aparse(parser_source, on_event=seen.append)
        except asyncio.CancelledError:
            seen_result.append("cancelled")

    asyncio.run(run())
    assert seen_result == ["cancelled"]
    end = seen[-1]
    assert isinstance(end, StreamEnded) and (end.how, end.reason) == ("aborted", "cancelled")


def test_aparse_raises_protocol_errors_as_is() -> None:
    with pytest.raises(RemoteProtocolError):
        asyncio.run(fsm.aparse(_aiter([b"data: [\n\n"])))


def test_parse_aborts_when_the_source_fails() -> None:
    def source() -> Iterator[bytes]:
        yield _CALL
        raise ConnectionError("gone")

    result = fsm.parse(source())
    assert (result.end_how, result.end_reason) == ("aborted", "ConnectionError: gone")


def test_feed_takes_bytes_text_and_chunks() -> None:
    parser = StreamParser()
    feed(parser, _CALL.decode())
    feed(parser, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    feed(parser, bytearray(b"data: [DONE]\n\n"))
    assert parser.result().complete
    assert parser_feed_all(StreamParser(), [_STREAM]) == feed_all(StreamParser(), [_STREAM])
