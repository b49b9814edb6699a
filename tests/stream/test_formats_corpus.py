"""The Responses API and Anthropic Messages recordings (``shared/corpus-responses/`` and
``shared/corpus-anthropic/``, 22 streams each): every file gives the result its
``expected.json`` records, whole, byte by byte and in random splits, auto-detected and named;
every cut of every stream never completes early; a complete turn renders back to items that the
official SDKs' own request types accept; ``fsm parse --json`` agrees.

The files are read from ``shared/`` (never copied here); without them these tests skip, and
under ``FSM_REQUIRE_CORPUS=1`` they fail.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm import (
    IncompleteTurnError,
    ParseResult,
    StreamEnded,
    StreamParser,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallOpened,
    ToolCallState,
)
from fsm.api import parse_file
from tests.helpers import CORPUS

SHARED = Path(os.environ.get("FSM_FORMATS_CORPUS_DIR", CORPUS.parent))
CORPORA = {"responses": SHARED / "corpus-responses", "anthropic": SHARED / "corpus-anthropic"}


def expected_complete(exp: dict[str, Any]) -> bool:
    """expected.json's ``complete`` means the stream ended normally (EXPECTED.md); parser.md's
    turn is complete only if, besides, every call is ``finished``: a JSON call whose arguments
    are not JSON ends ``truncated`` / ``invalid_json`` and is never executed. Of the recordings
    here, only the spliced Anthropic stream differs by this rule (its first message's call is
    cut mid-JSON, ``{"value":"Spark``, by a second ``message_start``)."""
    return bool(exp["complete"]) and all(
        c["valid_json"] or c.get("type") == "custom_tool_call" for c in exp["calls"]
    )


@cache
def expected(fmt: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CORPORA[fmt] / "expected.json").read_text())
    return data


def _params() -> list[Any]:
    params: list[Any] = []
    for fmt, folder in CORPORA.items():
        if (folder / "expected.json").is_file():
            params += [pytest.param(fmt, name, id=f"{fmt}/{name}") for name in expected(fmt)]
        else:
            params.append(pytest.param(fmt, None, id=f"{fmt}/absent"))
    return params


PARAMS = _params()


def need(fmt: str, name: str | None) -> Path:
    folder = CORPORA[fmt]
    if name is None or not (folder / "expected.json").is_file():
        message = f"the {fmt} recordings are not at {folder} (set FSM_FORMATS_CORPUS_DIR)"
        if os.environ.get("FSM_REQUIRE_CORPUS") == "1":
            pytest.fail(message + "; FSM_REQUIRE_CORPUS=1 makes this an error")
        pytest.skip(message)
    return folder / name


def stop_of(result: ParseResult) -> str:
    """The ``stop`` of expected.json, read from fsm's result."""
    turn = result.turns[0]
    finish = turn.finish_reason
    if result.format == "responses":
        if result.end_how == "error":
            prefix = "failed" if finish == "failed" else "error"
            return f"{prefix}:{result.error_code}"
        if result.end_how == "eof":
            return "eof"
        return "completed" if finish == "completed" else f"incomplete:{finish}"
    if result.end_how == "error":
        return f"error:{result.error_code}"
    if result.end_how == "eof":
        return f"eof(last stop_reason={finish})"
    return str(finish)


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def summary(result: ParseResult) -> dict[str, Any]:
    turn = result.turns[0]
    return {
        "complete": result.complete,
        "stop": stop_of(result),
        "calls": [
            {"id": c.id, "name": c.name, "arguments": c.arguments,
             "valid_json": _valid_json(c.arguments)}
            for c in turn.tool_calls
        ],
    }  # fmt: skip


def wanted(fmt: str, name: str) -> dict[str, Any]:
    exp = expected(fmt)[name]
    out = {
        "complete": expected_complete(exp),
        "stop": exp["stop"],
        "calls": [
            {k: c[k] for k in ("id", "name", "arguments", "valid_json")} for c in exp["calls"]
        ],
    }
    return out


def feed(raw: bytes, pieces: list[int] | None = None, fmt: str = "auto") -> ParseResult:
    parser = StreamParser(format=fmt)
    events: list[Any] = []
    if pieces is None:
        events += parser.receive_data(raw)
    else:
        start = 0
        for cut in pieces:
            events += parser.receive_data(raw[start:cut])
            start = cut
        events += parser.receive_data(raw[start:])
    events += parser.receive_eof()
    result = parser.result()
    check_events(result, events)
    return result


def check_events(result: ParseResult, events: list[Any]) -> None:
    """The events tell the same story as the result: each call opened once, its deltas add up to
    its arguments (unless a ``done`` text replaced them: then an anomaly says so), one final
    event per call, one StreamEnded."""
    assert sum(isinstance(e, StreamEnded) for e in events) == 1
    calls = result.turns[0].tool_calls if result.turns else []
    opened = [e for e in events if isinstance(e, ToolCallOpened)]
    assert len(opened) == len(calls)
    replaced = any(a.kind == "done_mismatch" for a in result.anomalies)
    for call in calls:
        deltas = "".join(
            e.delta
            for e in events
            if isinstance(e, ToolCallArgumentsDelta) and e.ordinal == call.ordinal
        )
        if not replaced:
            assert deltas == call.raw_arguments
        finals = [e for e in events if getattr(e, "ordinal", None) == call.ordinal
                  and hasattr(e, "position")]  # fmt: skip
        assert len(finals) == 1
        assert isinstance(finals[0], ToolCallFinished) == (call.state is ToolCallState.FINISHED)


@pytest.mark.parametrize(("fmt", "name"), PARAMS)
def test_recording_matches_expected(fmt: str, name: str | None) -> None:
    path = need(fmt, name)
    assert name is not None
    raw = path.read_bytes()
    result = feed(raw)
    assert result.format == fmt
    assert result.error is None
    assert summary(result) == wanted(fmt, name)
    # named, and through the convenience layer: the same
    assert summary(feed(raw, fmt=fmt)) == summary(result)
    assert summary(parse_file(path)) == summary(result)
    turn = result.turns[0]
    assert turn.format == fmt
    # a custom call (free text) is finished whatever its text
    for call, exp in zip(turn.tool_calls, expected(fmt)[name]["calls"], strict=True):
        assert call.custom == (exp.get("type") == "custom_tool_call")
        if result.complete:
            assert call.state is ToolCallState.FINISHED
    # the provider-run tools are opaque items, never client calls
    server = expected(fmt)[name].get("server_tool_calls", [])
    kept = [i for i in turn.output_items() if i["type"] in ("server_tool_use", "mcp_tool_use")]
    assert [(i["id"], i["name"]) for i in kept] == [(s["id"], s["name"]) for s in server]
    for item, exp in zip(kept, server, strict=True):
        assert item["input"] == json.loads(exp["arguments"])
    other = expected(fmt)[name].get("other_items")
    if fmt == "responses" and other is not None:
        types = [i["type"] for i in turn.output_items()]
        assert [t for t in types if t not in ("function_call", "custom_tool_call")] == other


@pytest.mark.parametrize(("fmt", "name"), PARAMS)
def test_recording_byte_by_byte(fmt: str, name: str | None) -> None:
    raw = need(fmt, name).read_bytes()
    assert name is not None
    if len(raw) > 8_000:
        pieces = list(range(1, 8_000)) + list(range(8_000, len(raw), 61))
    else:
        pieces = list(range(1, len(raw)))
    assert summary(feed(raw, pieces)) == wanted(fmt, name)


@pytest.mark.parametrize(("fmt", "name"), PARAMS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_recording_random_splits(fmt: str, name: str | None, data: st.DataObject) -> None:
    raw = need(fmt, name).read_bytes()
    assert name is not None
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=40))))
    assert summary(feed(raw, cuts)) == wanted(fmt, name)


def _end_offset(raw: bytes) -> int | None:
    """The number of bytes after which the whole stream has ended (found by feeding it in
    growing pieces: the byte whose arrival dispatches the terminal event), or ``None``."""
    parser = StreamParser()
    lo = 0
    step = 256
    while lo < len(raw):
        hi = min(len(raw), lo + step)
        if any(isinstance(e, StreamEnded) for e in parser.receive_data(raw[lo:hi])):
            fine = StreamParser()
            fine.receive_data(raw[:lo])
            for k in range(lo, hi):
                if any(isinstance(e, StreamEnded) for e in fine.receive_data(raw[k : k + 1])):
                    return k + 1
        lo = hi
    return None


def _cuts(raw: bytes, end: int | None) -> list[int]:
    n = len(raw)
    if n <= 1500:
        return list(range(n + 1))
    cuts = set(range(0, n + 1, max(1, n // 120)))
    boundaries = [i + 2 for i in range(n - 1) if raw[i : i + 2] == b"\n\n"]
    cuts.update(boundaries[-12:])
    cuts.update(b - 1 for b in boundaries[-12:])
    if end is not None:
        cuts.update(range(max(0, end - 24), min(n, end + 24) + 1))
    cuts.update(range(max(0, n - 24), n + 1))
    return sorted(cuts)


@pytest.mark.parametrize(("fmt", "name"), PARAMS)
def test_every_cut_never_completes_early(fmt: str, name: str | None) -> None:
    """A connection cut at byte k: before the terminal event is whole nothing is complete and no
    call is finished (every call ``aborted`` / ``eof``); from there on the result is the whole
    stream's. ``abort("cut")`` never leaves a complete turn before the end."""
    raw = need(fmt, name).read_bytes()
    whole = summary(feed(raw))
    end = _end_offset(raw)
    for k in _cuts(raw, end):
        parser = StreamParser()
        parser.receive_data(raw[:k])
        parser.receive_eof()
        result = parser.result()
        if end is None or k < end:
            assert not result.complete, k
            for turn in result.turns:
                assert all(c.state is not ToolCallState.FINISHED for c in turn.tool_calls), k
                # cut before the end: eof (or the spliced message's own abort)
                reasons = {c.reason for c in turn.tool_calls}
                assert reasons <= {"eof", "second_message_start"}, (k, reasons)
        else:
            assert summary(result) == whole, k
        if k % 3 == 0:
            aborted = StreamParser()
            aborted.receive_data(raw[:k])
            aborted.abort("cut")
            if end is None or k < end:
                assert not aborted.result().complete


# -- rendering back, checked with the SDKs' own request types -------------------------------------
def _consume(value: Any) -> Any:
    """A validated value made plain: pydantic validates ``Iterable`` fields lazily, so walking
    them is what validates them; models the unions accept become their fields."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return _consume(value.model_dump(exclude_unset=True, by_alias=True))
    if isinstance(value, Mapping):
        return {k: _consume(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return [_consume(v) for v in value]


def validated(type_: Any, value: Any) -> Any:
    """``value`` validated by ``type_`` (a pydantic TypeAdapter over the SDK's TypedDicts),
    walked whole; keys the type does not have are dropped, so ``validated(...) == value`` also
    says nothing was left out."""
    adapter = _adapter(type_)  # kept alive while the lazy iterators are walked
    return _consume(adapter.validate_python(value))


@cache
def _adapter(type_: Any) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(type_)


def _results(turn: Any) -> dict[str, str]:
    return {c.id: f"result of {c.name}" for c in turn.tool_calls}


@pytest.mark.parametrize(("fmt", "name"), PARAMS)
def test_rendered_items_validate_against_the_sdks(fmt: str, name: str | None) -> None:
    pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from openai.types.responses import ResponseInputItemParam

    path = need(fmt, name)
    turn = feed(path.read_bytes()).turns[0]
    paused = turn.incomplete_reason == "pause_turn"
    if not turn.complete and not paused:
        # nothing to send back: rendering refuses, the items stay readable (an attempt)
        with pytest.raises(IncompleteTurnError):
            turn.to_items()
        with pytest.raises(IncompleteTurnError):
            turn.to_anthropic()
        assert json.loads(json.dumps(turn.output_items())) == turn.output_items()
        return
    if turn.complete:
        items = turn.to_items(results=_results(turn))
        assert validated(list[ResponseInputItemParam], items) == items
        outputs = [
            i for i in items if i["type"] in ("function_call_output", "custom_tool_call_output")
        ]
        assert [o["call_id"] for o in outputs] == [c.id for c in turn.tool_calls]
        if fmt == "responses":
            # verbatim: reasoning (encrypted_content included) exactly as the provider sent it
            sent = [i for i in turn.output_items()]
            assert [i["type"] for i in items[: len(sent)]] == [i["type"] for i in sent]
            raw = path.read_text()
            for item in sent:
                if item.get("encrypted_content"):
                    assert item["encrypted_content"] in raw
        message = turn.to_message()
        assert message["role"] == "assistant"
    results = _results(turn) if turn.tool_calls else None
    messages = turn.to_anthropic(results=results)
    blocks = [b["type"] for b in messages[0]["content"]]
    beta = any(kind.startswith("mcp_") for kind in blocks)
    param = anthropic.types.beta.BetaMessageParam if beta else anthropic.types.MessageParam
    assert validated(list[param], messages) == messages  # type: ignore[valid-type]
    assert messages[0]["role"] == "assistant"
    if turn.tool_calls:
        assert len(messages) == 2 and messages[1]["role"] == "user"
        assert [b["tool_use_id"] for b in messages[1]["content"]] == [c.id for c in turn.tool_calls]
    if fmt == "anthropic":
        raw = path.read_text()
        for block in messages[0]["content"]:
            if block["type"] == "thinking":
                assert block["signature"] and block["signature"] in raw.replace("\\/", "/")
            if block["type"] == "redacted_thinking":
                assert block["data"] in raw
            if block["type"] == "tool_use":
                call = next(c for c in turn.tool_calls if c.id == block["id"])
                assert block["input"] == json.loads(call.arguments)


@pytest.mark.parametrize(("fmt", "name"), PARAMS)
def test_fsm_parse_json_matches_expected(fmt: str, name: str | None) -> None:
    from click.testing import CliRunner

    from fsm.cli.main import cli

    path = need(fmt, name)
    assert name is not None
    run = CliRunner().invoke(cli, ["parse", "--json", str(path)])
    want = wanted(fmt, name)
    assert run.exit_code == (0 if want["complete"] else 1), run.output
    data = json.loads(run.stdout)
    assert data["format"] == fmt
    (choice,) = data["choices"]
    assert choice["complete"] == want["complete"]
    calls = [
        {"id": c["id"], "name": c["name"], "arguments": c["arguments"],
         "valid_json": _valid_json(c["arguments"])}
        for c in choice["tool_calls"]
    ]  # fmt: skip
    assert calls == want["calls"]
    named = CliRunner().invoke(cli, ["parse", "--json", "--format", fmt, str(path)])
    assert json.loads(named.stdout) == data
