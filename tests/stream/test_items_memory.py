"""Memory of provider items kept verbatim (issue 26, finding 4), measured in a subprocess with
``bench/items_memory.py``: a parser keeps each item as its compact JSON (not a decoded tree),
and a commit serializes the items one at a time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from fsm import Limits, StreamParser
from tests.helpers import REPO, child_json

sys.path.insert(0, str(REPO / "bench"))
import items_memory

MiB = 1 << 20
CHILD = (
    "import json, sys; sys.path.insert(0, 'bench'); import items_memory as m; "
    "print(json.dumps(m.child(sys.argv[1], sys.argv[2], sys.argv[3] == 'commit')))"
)


def measure(tmp_path: Path, case: str, mib: int, *, commit: bool) -> dict[str, Any]:
    path = tmp_path / f"{case}.sse"
    path.write_bytes(items_memory.build(case, mib * MiB))
    result: dict[str, Any] = child_json(
        CHILD, case, str(path), "commit" if commit else "parse", timeout=300
    )
    return result


@pytest.mark.parametrize("case", ["responses", "anthropic"])
def test_items_of_small_objects_stay_within_the_documented_bound(tmp_path: Path, case: str) -> None:
    # 24 MiB of items made of 19-byte objects: decoded trees took ~15x their size (360 MB);
    # kept as exact-size compact JSON, the parser peaks at about 1.4x (the event decoded last
    # included)
    got = measure(tmp_path, case, 24, commit=True)
    assert got["end"] == "done" and got["items"] == 24
    assert got["parse_peak_mib"] < 3 * 24, got
    # the commit holds one decoded item at a time, the JSON text and SQLite's own buffers
    # (about 13x; it was about 32x: every item decoded at once, then copied)
    assert got["commit_peak_mib"] < 16 * 24, got
    assert got["commit_cpu_s"] < 30, got


def _anthropic_blocks(count: int) -> bytes:
    events = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"m"}}\n\n']
    for i in range(count):
        events.append(
            b'event: content_block_start\ndata: {"type":"content_block_start","index":%d,'
            b'"content_block":{"type":"web_search_tool_result","tool_use_id":"s","content":[]}}'
            b"\n\n" % i
        )
    return b"".join(events)


def test_max_items_bounds_the_count_of_kept_items() -> None:
    parser = StreamParser(limits=Limits(max_items=10))
    parser.receive_data(_anthropic_blocks(10))
    assert parser.result().end_how is None
    parser = StreamParser(limits=Limits(max_items=10))
    parser.receive_data(_anthropic_blocks(11))
    result = parser.result()
    assert (result.end_how, result.end_reason) == ("limit", "limit:max_items")
    assert len(result.turns[0].output_items()) == 10


def test_an_item_is_kept_as_compact_json_and_decoded_on_demand() -> None:
    parser = StreamParser()
    parser.receive_data(_anthropic_blocks(1))
    turn = parser.result().turns[0]
    (item,) = turn.items  # type: ignore[attr-defined]
    assert isinstance(item.raw, bytes) and b" " not in item.raw
    assert turn.output_items()[0]["type"] == "web_search_tool_result"
    assert turn.output_items()[0] is not turn.output_items()[0]  # a fresh copy each time
