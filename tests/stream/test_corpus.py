"""Every real recorded stream gives the result recorded for it in ``expected.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsm import StreamParser
from fsm.api import parse_file, parse_text
from tests.helpers import CORPUS, corpus_expected, corpus_files, corpus_params, require_corpus


def _summary(result: Any) -> dict[str, Any]:
    return {
        "complete": result.complete,
        "choices": [
            {
                "index": t.index,
                "complete": t.complete,
                "finish_reason": t.finish_reason,
                "tool_calls": [
                    {
                        "id": c.id,
                        "name": c.name,
                        "arguments": c.arguments,
                        "state": c.state.value,
                        "reason": c.reason,
                    }
                    for c in t.tool_calls
                ],
            }
            for t in result.turns
        ],
    }


def test_corpus_is_complete() -> None:
    require_corpus()
    assert set(corpus_files()) == set(corpus_expected()), "expected.json and the files disagree"
    assert len(corpus_files()) >= 75


@pytest.mark.parametrize("name", corpus_params())
def test_corpus_stream_matches_expected(name: str | None) -> None:
    require_corpus()
    assert name is not None
    expected = corpus_expected()[name]
    result = parse_file(CORPUS / name)
    assert _summary(result) == {k: expected[k] for k in ("complete", "choices")}
    assert len(result.anomalies) >= expected["anomalies_at_least"]
    assert result.error is None


@pytest.mark.parametrize("name", corpus_params())
def test_corpus_complete_turns_give_messages(name: str | None) -> None:
    """A complete turn's message carries the provider's ids and arguments byte-exact; an
    incomplete one refuses to become a message."""
    require_corpus()
    assert name is not None
    result = parse_file(CORPUS / name)
    for turn in result.turns:
        if not turn.complete:
            with pytest.raises(Exception, match="not a complete turn"):
                turn.to_message()
            continue
        message = turn.to_message()
        assert message["role"] == "assistant"
        calls = message.get("tool_calls", [])
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c.id, c.name, c.raw_arguments) for c in turn.tool_calls
        ]


def test_anomaly_for_delta_after_finish_in_deepinfra_stream() -> None:
    require_corpus()
    name = "openrouter/openrouter-deepinfra-kimi-k2_numeric_string_ids_finish_per_call.sse"
    result = parse_file(CORPUS / name)
    kinds = [a.kind for a in result.anomalies]
    assert kinds.count("delta_after_finish") == 1
    assert result.complete


def test_sse_and_json_lines_forms_agree(tmp_path: Path) -> None:
    """The CLI's JSON-lines input gives what the same chunks give as SSE."""
    require_corpus()
    for name in corpus_files():
        raw = (CORPUS / name).read_bytes()
        if b"event:" in raw:
            continue  # named events (errors) only exist in SSE form
        lines = [
            line[5:].strip()
            for line in raw.splitlines()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
        ]
        done = b"data: [DONE]" in raw
        jsonl = b"\n".join(lines) + (b"\n[DONE]\n" if done else b"\n")
        a = parse_text(raw)
        b = parse_text(jsonl)
        assert a.to_json() == b.to_json(), name


def test_live_view_while_streaming() -> None:
    """``parser.turns`` shows calls (with names) before the stream ends."""
    require_corpus()
    raw = (CORPUS / "openai/openai-gpt-4o_parallel_two_calls.sse").read_bytes()
    parser = StreamParser()
    cut = raw.index(b'"multiply"') + 200
    parser.receive_data(raw[:cut])
    live = parser.turns[0].tool_calls
    assert [c.name for c in live] == ["add", "multiply"]
    assert all(not c.final for c in live)
    assert not parser.turns[0].ended
    parser.receive_data(raw[cut:])
    parser.receive_eof()
    assert parser.turns[0].complete
