"""The SSE framer (``fsm.sse.SSEFramer``) against the WHATWG ``text/event-stream`` rules.

Most tests feed the same bytes three ways (whole, byte by byte, and cut in two at every position)
and require the same events from each: the framer must not care how the transport splits bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm.sse import EventTooLargeError, SSEEvent, SSEFramer
from tests.helpers import bytewise

BOM = b"\xef\xbb\xbf"


def frame(pieces: Iterable[bytes], max_event_bytes: int = 1 << 20) -> list[SSEEvent]:
    framer = SSEFramer(max_event_bytes)
    events: list[SSEEvent] = []
    for piece in pieces:
        events.extend(framer.events(piece))
    return events


def frame_every_way(data: bytes) -> list[SSEEvent]:
    """Frame ``data`` whole, byte by byte and cut in two at every position; all must agree."""
    whole = frame([data])
    assert frame(bytewise(data)) == whole, "byte-by-byte feeding differs from one feed"
    for cut in range(len(data) + 1):
        assert frame([data[:cut], data[cut:]]) == whole, f"a cut at byte {cut} changes the events"
    return whole


def pairs(events: list[SSEEvent]) -> list[tuple[str, bytes]]:
    return [(e.event, e.data) for e in events]


# -- line endings ------------------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_each_line_ending_frames_the_same_events(eol: bytes) -> None:
    text = b"data: one\n\n: comment\ndata: two\ndata: three\n\nevent: named\ndata: four\n\n"
    events = frame_every_way(text.replace(b"\n", eol))
    assert pairs(events) == [("", b"one"), ("", b"two\nthree"), ("named", b"four")]


def test_mixed_line_endings_in_one_stream() -> None:
    events = frame_every_way(b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r")
    assert pairs(events) == [("", b"a\nb\nc"), ("", b"d")]


def test_crlf_split_across_two_feeds_is_one_line_ending() -> None:
    # If the "\n" after a feed-final "\r" counted as a second (blank) line, "a" would be
    # dispatched alone and "b" would be a second event.
    framer = SSEFramer()
    assert framer.events(b"data: a\r") == []
    assert pairs(framer.events(b"\ndata: b\r\n\r\n")) == [("", b"a\nb")]


def test_crlf_split_with_empty_feeds_in_between() -> None:
    framer = SSEFramer()
    assert framer.events(b"data: a\r") == []
    assert framer.events(b"") == []
    assert framer.events(b"\n") == []
    assert pairs(framer.events(b"\r\n")) == [("", b"a")]


def test_lone_cr_at_end_of_feed_is_a_line_ending() -> None:
    framer = SSEFramer()
    assert framer.events(b"data: a\r") == []
    # the next feed does not start with "\n": the "\r" alone ended the line
    assert framer.events(b"data: b\r") == []
    assert pairs(framer.events(b"\r")) == [("", b"a\nb")]


def test_blank_cr_line_dispatches_at_once_and_a_following_lf_is_swallowed() -> None:
    framer = SSEFramer()
    # "\r" is a complete blank line: the event must not wait for the next feed
    assert pairs(framer.events(b"data: a\n\r")) == [("", b"a")]
    # the "\n" completing that "\r\n" is not another blank line (nothing to dispatch anyway),
    # and the next event is framed normally
    assert framer.events(b"\n") == []
    assert pairs(framer.events(b"data: b\n\n")) == [("", b"b")]


# -- dispatch, data lines ----------------------------------------------------------------------


def test_blank_line_dispatches() -> None:
    framer = SSEFramer()
    assert framer.events(b"data: a\n") == []
    assert framer.events(b"data: b\n") == []
    assert pairs(framer.events(b"\n")) == [("", b"a\nb")]
    assert framer.events(b"\n\n") == []  # blank lines with nothing buffered dispatch nothing


def test_no_event_without_blank_line() -> None:
    assert frame_every_way(b"data: a\ndata: b\n") == []


@pytest.mark.parametrize(
    ("line", "data"),
    [
        (b"data:x", b"x"),
        (b"data: x", b"x"),
        (b"data:  x", b" x"),  # only ONE space is stripped
        (b"data:\tx", b"\tx"),  # a tab is not a space
        (b"data: x ", b"x "),  # trailing space kept
        (b"data:", b""),
        (b"data: ", b""),
        (b"data", b""),  # a field with no colon has an empty value
        (b"data: a: b", b"a: b"),  # only the first colon separates
    ],
)
def test_data_field_value(line: bytes, data: bytes) -> None:
    assert pairs(frame_every_way(line + b"\n\n")) == [("", data)]


def test_several_data_lines_join_with_lf() -> None:
    events = frame_every_way(b'data: {"a":\ndata:\ndata: 1}\n\n')
    assert pairs(events) == [("", b'{"a":\n\n1}')]


def test_data_keeps_non_ascii_bytes_verbatim() -> None:
    payload = "héllo wörld 日本 🎉".encode()
    assert pairs(frame_every_way(b"data: " + payload + b"\n\n")) == [("", payload)]


# -- comments and fields -----------------------------------------------------------------------


def test_comments_are_ignored() -> None:
    text = b": keep-alive\n:\n:data: not data\ndata: a\n: in the middle\ndata: b\n\n: OPENROUTER PROCESSING\n\n"
    assert pairs(frame_every_way(text)) == [("", b"a\nb")]


def test_event_field_names_the_event_and_resets_after_dispatch() -> None:
    text = b"event: delta\ndata: 1\n\ndata: 2\n\nevent:error\ndata: 3\n\n"
    assert pairs(frame_every_way(text)) == [("delta", b"1"), ("", b"2"), ("error", b"3")]


def test_last_event_field_wins() -> None:
    assert pairs(frame_every_way(b"event: a\nevent: b\ndata: x\n\n")) == [("b", b"x")]


def test_id_field() -> None:
    framer = SSEFramer()
    assert framer.last_event_id is None
    framer.feed(b"id: 42\ndata: x\n\n")
    assert framer.last_event_id == "42"
    framer.feed(b"id: 7\n\n")  # an id alone is remembered though nothing is dispatched
    assert framer.last_event_id == "7"
    framer.feed(b"id: bad\x00id\n\n")  # an id containing NUL is ignored (WHATWG)
    assert framer.last_event_id == "7"
    framer.feed(b"id\n\n")  # an empty id resets it
    assert framer.last_event_id == ""


def test_retry_field() -> None:
    framer = SSEFramer()
    assert framer.retry is None
    framer.feed(b"retry: 3000\n\n")
    assert framer.retry == 3000
    for bad in (b"retry: 3s\n\n", b"retry: -1\n\n", b"retry: 1.5\n\n", b"retry:\n\n"):
        framer.feed(bad)  # not all ASCII digits: ignored
        assert framer.retry == 3000
    framer.feed(b"retry:10\n\n")
    assert framer.retry == 10


def test_id_and_retry_are_not_data() -> None:
    assert pairs(frame_every_way(b"id: 1\nretry: 5\ndata: x\n\n")) == [("", b"x")]


def test_unknown_fields_are_ignored() -> None:
    text = (
        b"foo: bar\ndata: x\nDATA: upper case is another field\nData: y\nx-custom\n\nfoo: only\n\n"
    )
    assert pairs(frame_every_way(text)) == [("", b"x")]


@pytest.mark.parametrize(
    "text",
    [
        b"event: close\n\n",
        b"event: ping\nid: 3\nretry: 10\n\n",
        b"id: 1\n\n",
        b": comment\n\n",
        b"foo: bar\n\n",
    ],
)
def test_event_without_data_is_not_dispatched(text: bytes) -> None:
    assert frame_every_way(text) == []


def test_error_event_without_data_is_dispatched() -> None:
    assert pairs(frame_every_way(b"event: error\n\n")) == [("error", b"")]
    assert pairs(frame_every_way(b"event: error\nid: 9\n\ndata: next\n\n")) == [
        ("error", b""),
        ("", b"next"),
    ]


# -- byte order mark ---------------------------------------------------------------------------


def test_bom_at_start_is_skipped() -> None:
    events = frame_every_way(BOM + b"data: a\n\n")
    assert pairs(events) == [("", b"a")]
    assert events[0].offset == 3  # offsets are in the raw stream, BOM included


def test_bom_at_start_skipped_when_fed_byte_by_byte() -> None:
    framer = SSEFramer()
    events: list[SSEEvent] = []
    for piece in bytewise(BOM + b"data: a\n\n"):
        events.extend(framer.events(piece))
    assert pairs(events) == [("", b"a")]


def test_bom_split_then_empty_feeds() -> None:
    framer = SSEFramer()
    for piece in (b"", BOM[:1], b"", BOM[1:2], BOM[2:], b"", b"data: a\n\n"):
        events = framer.events(piece)
    assert pairs(events) == [("", b"a")]


def test_bom_start_only_affects_the_first_line() -> None:
    # a BOM at the start, immediately followed by a field line with an event name
    assert pairs(frame_every_way(BOM + b"event: e\ndata: a\n\n")) == [("e", b"a")]


def test_bom_not_at_start_is_kept() -> None:
    # A BOM later in the stream is part of its line: "\ufeffdata" is an unknown field name.
    assert pairs(frame_every_way(b"data: a\n\n" + BOM + b"data: b\n\n")) == [("", b"a")]
    # A second BOM at the start is not skipped either (only one is).
    assert frame_every_way(BOM + BOM + b"data: a\n\n") == []
    # Inside a value it is data.
    assert pairs(frame_every_way(b"data: " + BOM + b"x\n\n")) == [("", BOM + b"x")]


def test_partial_bom_that_is_not_a_bom_is_kept() -> None:
    # "\xef\xbb" followed by something else is not a BOM: the bytes are kept (an unknown field)
    assert frame_every_way(b"\xef\xbbdata: a\n\n") == []
    assert pairs(frame_every_way(b"\xef\xbb\n\ndata: a\n\n")) == [("", b"a")]


# -- byte offsets ------------------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("bom", [b"", BOM], ids=["no-bom", "bom"])
def test_event_offsets(eol: bytes, bom: bytes) -> None:
    lines = [
        b": keep-alive",
        b"data: first",
        b"",
        b"",
        b": comment before the second event",
        b"event: named",
        b"data: second",
        b"",
        b"data: third",
        b"data: more",
        b"",
    ]
    text = bom + eol.join(lines) + eol
    events = frame_every_way(text)
    assert pairs(events) == [("", b"first"), ("named", b"second"), ("", b"third\nmore")]
    # each offset is the first byte of the event's first field line (comments are not part of it)
    assert [e.offset for e in events] == [
        text.index(b"data: first"),
        text.index(b"event: named"),
        text.index(b"data: third"),
    ]
    assert [text[e.offset : e.offset + 4] for e in events] == [b"data", b"even", b"data"]


def test_feed_returns_tuples_matching_events() -> None:
    text = b"data: a\n\nevent: e\ndata: b\n\n"
    assert SSEFramer().feed(text) == [(e.event, e.data, e.offset) for e in frame([text])]


# -- max_event_bytes ---------------------------------------------------------------------------


def test_long_data_line_without_newline_raises() -> None:
    framer = SSEFramer(max_event_bytes=100)
    framer.feed(b"data: ok\n\n")
    start = len(b"data: ok\n\n")
    with pytest.raises(EventTooLargeError) as info:
        framer.feed(b"data: ")
        for _ in range(1000):  # never a newline: must stop long before 1000 * 64 bytes
            framer.feed(b"x" * 64)
    assert info.value.limit == 100
    assert info.value.offset == start
    assert "100" in str(info.value)


def test_long_data_line_in_one_feed_raises() -> None:
    with pytest.raises(EventTooLargeError) as info:
        SSEFramer(max_event_bytes=100).feed(b"data: " + b"x" * 500)
    assert info.value.offset == 0


def test_many_data_lines_raise() -> None:
    framer = SSEFramer(max_event_bytes=100)
    prefix = b": hello\n"
    with pytest.raises(EventTooLargeError) as info:
        framer.feed(prefix)
        for _ in range(1000):  # each line is small; together they are not
            framer.feed(b"data: 0123456789\n")
    assert info.value.offset == len(prefix)


def test_many_data_lines_in_one_feed_raise() -> None:
    with pytest.raises(EventTooLargeError):
        SSEFramer(max_event_bytes=100).feed(b"data: 0123456789\n" * 20 + b"\n")


def test_limit_applies_per_event() -> None:
    # 30 events of 60 bytes each pass a 100-byte limit: the count restarts at each dispatch
    text = b"data: " + b"y" * 60 + b"\n\n"
    events = frame([text * 30], max_event_bytes=100)
    assert len(events) == 30


def test_event_of_exactly_the_limit_is_accepted_in_one_feed() -> None:
    payload = b"x" * 40
    events = frame([b"data: " + payload + b"\n\n"], max_event_bytes=40)
    assert pairs(events) == [("", payload)]
    with pytest.raises(EventTooLargeError):
        frame([b"data: " + payload + b"x\n\n"], max_event_bytes=40)


def test_event_of_exactly_the_limit_is_accepted_however_split() -> None:
    # The limit is on the bytes of one event (one chunk's JSON text), not on how the transport
    # happened to cut them: an event within the limit in one feed is within it byte by byte.
    payload = b"x" * 40
    text = b"data: " + payload + b"\n\n"
    assert pairs(frame(bytewise(text), max_event_bytes=40)) == [("", payload)]
    assert pairs(frame([text[:20], text[20:]], max_event_bytes=40)) == [("", payload)]


def test_dispatched_event_never_exceeds_the_limit() -> None:
    # ten 5-byte data lines make a 59-byte payload (the joining newlines count): over 55
    text = b"data: aaaaa\n" * 10 + b"\n"
    try:
        events = frame([text], max_event_bytes=55)
    except EventTooLargeError:
        return
    assert all(len(e.data) <= 55 for e in events), [len(e.data) for e in events]


def test_long_comment_line_outcome_does_not_depend_on_splits() -> None:
    text = b": " + b"k" * 200 + b"\ndata: x\n\n"
    outcomes = []
    for pieces in ([text], bytewise(text), [text[:150], text[150:]]):
        try:
            outcomes.append(pairs(frame(pieces, max_event_bytes=64)))
        except EventTooLargeError as exc:
            outcomes.append([("EventTooLargeError", str(exc).encode())])
    assert outcomes[1] == outcomes[0]
    assert outcomes[2] == outcomes[0]


_sse_lines = st.sampled_from(
    [
        b"data: {}",
        b"data:x",
        b"data:  two spaces",
        b"data: " + "é日🎉".encode(),
        b"data",
        b"",
        b"",
        b": comment",
        b"event: error",
        b"event: close",
        b"id: 5",
        b"retry: 10",
        b"unknown: field",
        b"data: " + b"z" * 30,
    ]
)


@settings(max_examples=50, deadline=None)
@given(
    lines=st.lists(_sse_lines, max_size=12),
    eols=st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=12, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
    limit=st.sampled_from([24, 32, 1 << 20]),
)
def test_random_streams_frame_the_same_however_split(
    lines: list[bytes], eols: list[bytes], cuts: list[int], limit: int
) -> None:
    text = b"".join(line + eol for line, eol in zip(lines, eols, strict=False))
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]

    def outcome(feeds: list[bytes]) -> object:
        try:
            return frame(feeds, max_event_bytes=limit)
        except EventTooLargeError as exc:
            return ("too large", exc.offset)

    expected = outcome([text])
    assert outcome(pieces) == expected
    assert outcome(bytewise(text)) == expected


# -- close() -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail",
    [
        b"data: partial",  # a line with no end
        b"data: a\n",  # a complete data line, no blank line
        b"data: a\ndata: b\n",
        b"event: error\n",  # an error event that never got its blank line
    ],
)
def test_close_reports_a_discarded_partial_event(tail: bytes) -> None:
    framer = SSEFramer()
    assert pairs(framer.events(b"data: done\n\n" + tail)) == [("", b"done")]
    assert framer.close() is True
    assert framer.close() is False  # the partial event is gone


@pytest.mark.parametrize("text", [b"", b"data: a\n\n", b"data: a\r\n\r\n", b": c\n", b"id: 1\n\n"])
def test_close_after_complete_events_reports_nothing(text: bytes) -> None:
    framer = SSEFramer()
    framer.feed(text)
    assert framer.close() is False


def test_partial_event_is_never_dispatched_by_close() -> None:
    framer = SSEFramer()
    assert framer.events(b"data: a\n") == []
    framer.close()
    # after close() the buffered "a" is gone: a new event starts clean
    assert pairs(framer.events(b"data: b\n\n")) == [("", b"b")]
