"""fsm.parse / fsm.aparse: the one driver (feed, abort on a failing source), what they take
(paths, bytes, stream text, iterables; programming errors raised), and import cost."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import fsm
from fsm.api import feed, feed_all
from fsm.errors import LocalProtocolError, RemoteProtocolError
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


# -- what parse() and aparse() take (issue 12 item 3) ---------------------------------------------
def test_parse_reads_a_path_like_as_a_file(tmp_path: Path) -> None:
    path = tmp_path / "stream.sse"
    path.write_bytes(_STREAM)
    seen: list[Event] = []
    result = fsm.parse(path, on_event=seen.append)
    assert result.complete
    assert result.to_json() == fsm.parse(_STREAM).to_json()
    assert isinstance(seen[-1], StreamEnded) and seen[-1].how == "done"


def test_parse_reads_a_json_lines_file_and_text(tmp_path: Path) -> None:
    lines = "\n".join(
        json.dumps(c)
        for c in [
            {"id": "r1", "model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
    )
    path = tmp_path / "stream.jsonl"
    path.write_text(lines + "\n")
    for source in (path, lines, lines.encode()):
        result = fsm.parse(source)
        assert result.complete and result.turn(0).content == "hi", source


def test_a_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fsm.parse(tmp_path / "missing.sse")


@pytest.mark.parametrize("text", ["file.sse", "stream.jsonl", "/tmp/x/y.sse", "hello world"])
def test_a_str_that_is_not_stream_text_says_to_pass_a_path(text: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        fsm.parse(text)
    message = str(info.value)
    assert message.startswith(f"parse() got a str that is not stream text ({text!r})")
    assert f"Path({text!r})" in message


@pytest.mark.parametrize(
    "text",
    [
        _STREAM.decode(),
        "\ufeff" + _STREAM.decode(),
        "\n\n" + _STREAM.decode(),
        ": keep-alive\n\n" + _STREAM.decode(),
        "event: message\n" + _STREAM.decode(),
        "data:" + _STREAM.decode()[5:],
        "id: 7\n" + _STREAM.decode(),
        "retry: 100\n" + _STREAM.decode(),
        "data: [DONE]\n\n",
        "",
        "   \n",
    ],
)
def test_stream_text_is_parsed(text: str) -> None:
    result = fsm.parse(text)
    assert result.to_json() == fsm.parse(text.encode()).to_json()


def test_an_empty_str_is_an_empty_stream() -> None:
    result = fsm.parse("")
    assert (result.event_count, result.turns, result.end_how) == (0, [], "eof")


@pytest.mark.parametrize("source", [42, None, 3.5, object()])
def test_a_source_of_the_wrong_type_is_a_type_error(source: object) -> None:
    with pytest.raises(TypeError, match=r"^parse\(\) takes a path \(os.PathLike\), SSE bytes"):
        fsm.parse(source)  # type: ignore[arg-type]


def test_a_programming_error_in_the_source_is_raised_not_an_abort() -> None:
    def source() -> Iterator[bytes]:
        yield _CALL
        raise TypeError("a bug in the caller's generator")

    with pytest.raises(TypeError, match="a bug"):
        fsm.parse(source())


def test_an_item_the_parser_does_not_take_is_raised() -> None:
    with pytest.raises(LocalProtocolError, match="receive_chunk"):
        fsm.parse([_CALL, 42])


def test_an_error_of_on_event_is_raised() -> None:
    def on_event(event: Event) -> None:
        raise ValueError("the callback failed")

    with pytest.raises(ValueError, match="the callback failed"):
        fsm.parse(_pieces(), on_event=on_event)


@pytest.mark.parametrize("source", [Path("x.sse"), b"data: [DONE]\n\n", "data: x", [_CALL], 42])
def test_aparse_takes_only_async_iterables(source: object) -> None:
    with pytest.raises(TypeError, match=r"^aparse\(\) takes an async iterable"):
        asyncio.run(fsm.aparse(source))  # type: ignore[arg-type]


def test_aparse_raises_programming_errors_of_the_source() -> None:
    with pytest.raises(AttributeError, match="oops"):
        asyncio.run(fsm.aparse(_aiter([_CALL], AttributeError("oops"))))
