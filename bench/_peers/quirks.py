"""Hand-written streams, one per provider quirk named in ``shared/spec/parser.md``.

Each case is a small SSE stream and the result the spec prescribes for it, written from the
spec's rules (routing, merging, ending a turn), never from any library's output. Expected calls
are ``(id, name, arguments, state)`` per choice; ``complete`` is the turn's completeness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["QUIRKS", "Quirk", "Turn"]

_MISSING: Any = object()

#: A call the spec says ends ``finished`` / ``truncated`` / ``aborted``.
ExpectedCall = tuple[str, str, str, str]


@dataclass(frozen=True, slots=True)
class Turn:
    index: int
    complete: bool
    calls: tuple[ExpectedCall, ...]


@dataclass(frozen=True, slots=True)
class Quirk:
    key: str
    title: str  # the quirk, and who does it
    spec: str  # the spec rule that decides the expected result
    events: tuple[Any, ...]  # chunk dicts, "[DONE]", or raw SSE text (str ending in a blank line)
    expected: tuple[Turn, ...]

    def sse(self) -> bytes:
        parts = []
        for event in self.events:
            if isinstance(event, dict):
                parts.append(f"data: {json.dumps(event, separators=(',', ':'))}\n\n")
            elif event == "[DONE]":
                parts.append("data: [DONE]\n\n")
            else:
                parts.append(event)
        return "".join(parts).encode("utf-8")


def tc(
    index: Any = _MISSING,
    id: Any = _MISSING,
    name: Any = _MISSING,
    args: Any = _MISSING,
    type: Any = _MISSING,
) -> dict[str, Any]:
    """One ``delta.tool_calls[]`` entry; keys left out are absent from the JSON."""
    entry: dict[str, Any] = {}
    if index is not _MISSING:
        entry["index"] = index
    if id is not _MISSING:
        entry["id"] = id
    if type is not _MISSING:
        entry["type"] = type
    fn: dict[str, Any] = {}
    if name is not _MISSING:
        fn["name"] = name
    if args is not _MISSING:
        fn["arguments"] = args
    if fn:
        entry["function"] = fn
    return entry


def head(index: int, id: str, name: str, args: str = "") -> dict[str, Any]:
    """An OpenAI-style header delta: index, id, type, name and (usually empty) arguments."""
    return tc(index=index, id=id, type="function", name=name, args=args)


def chunk(
    *tool_calls: dict[str, Any],
    content: str | None = None,
    finish: str | None = None,
    choice: int = 0,
    role: bool = False,
    delta: Any = _MISSING,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice."""
    if delta is _MISSING:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = list(tool_calls)
    c: dict[str, Any] = {"index": choice, "finish_reason": finish}
    if delta is not None:
        c["delta"] = delta
    return {
        "id": "chatcmpl-quirk",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "quirk-model",
        "choices": [c],
    }


def raw_chunk(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "chatcmpl-quirk",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "quirk-model",
    }
    base.update(fields)
    return base


ROLE = chunk(role=True, content="")
W = "get_weather"
T = "get_time"
PARIS = '{"city": "Paris"}'
CET = '{"tz": "CET"}'


def ok(*calls: tuple[str, str, str]) -> tuple[Turn, ...]:
    """One complete turn (choice 0) whose calls all end finished."""
    return (Turn(0, True, tuple((i, n, a, "finished") for i, n, a in calls)),)


def bad(*calls: tuple[str, str, str, str]) -> tuple[Turn, ...]:
    """One incomplete turn (choice 0)."""
    return (Turn(0, False, tuple(calls)),)


QUIRKS: tuple[Quirk, ...] = (
    Quirk(
        "vllm_repeated_id_and_name",
        "id and full name repeated in every chunk (vLLM, llama.cpp, MiniMax)",
        "a name fragment equal to the whole name held is a repeat: ignored; the same id: same call",
        (
            ROLE,
            chunk(head(0, "chatcmpl-tool-1", W, '{"city": ')),
            chunk(head(0, "chatcmpl-tool-1", W, '"Paris"')),
            chunk(head(0, "chatcmpl-tool-1", W, "}")),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("chatcmpl-tool-1", W, PARIS)),
    ),
    Quirk(
        "empty_id_and_name_on_continuations",
        'continuations carry `id: ""` and `name: ""` (Alibaba compatible mode)',
        "an empty id never overwrites; an empty name is ignored",
        (
            ROLE,
            chunk(head(0, "call_1", W)),
            chunk(tc(index=0, id="", type="function", name="", args='{"city": ')),
            chunk(tc(index=0, id="", type="function", name="", args='"Paris"}')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "indexless_continuations",
        "continuations with no index, id or name (LangChain #34654)",
        "index absent, no id, no name: append to the most recently opened live call",
        (
            ROLE,
            chunk(head(0, "call_1", W)),
            chunk(tc(args='{"city": ')),
            chunk(tc(args='"Paris"}')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "same_index_distinct_ids_whole",
        "every call at index 0 with distinct ids, each whole in one chunk (Groq, Ollama)",
        "same index, a different non-empty id: a new call at the same index",
        (
            ROLE,
            chunk(head(0, "call_a", W, PARIS)),
            chunk(head(0, "call_b", T, CET)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "same_index_distinct_ids_fragmented",
        "every call at index 0 with distinct ids, arguments in fragments (Bedrock)",
        "a new id at the same index opens a new call; later deltas go to the latest one",
        (
            ROLE,
            chunk(head(0, "call_a", W)),
            chunk(tc(index=0, args='{"city": ')),
            chunk(tc(index=0, args='"Paris"}')),
            chunk(head(0, "call_b", T)),
            chunk(tc(index=0, args='{"tz": ')),
            chunk(tc(index=0, args='"CET"}')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "missing_ids",
        "no `id` at all (Ollama, sglang; LiteLLM #11262)",
        'if the provider never sends an id, the id stays "": never generate one',
        (
            ROLE,
            chunk(tc(index=0, type="function", name=W, args=PARIS)),
            chunk(tc(index=1, type="function", name=T, args=CET)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("", W, PARIS), ("", T, CET)),
    ),
    Quirk(
        "split_name",
        "the name split across deltas: `get_` + `weather`",
        "any other non-empty name fragment is appended",
        (
            ROLE,
            chunk(head(0, "call_1", "get_")),
            chunk(tc(index=0, name="weather", args='{"city": ')),
            chunk(tc(index=0, args='"Paris"}')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "name_after_header",
        "a header with an id but no name; the name comes in the next delta (watsonx)",
        "a nameless delta with an id opens a call whose name is backfilled",
        (
            ROLE,
            chunk(tc(index=0, id="call_1", type="function", args="")),
            chunk(tc(index=0, name=W)),
            chunk(tc(index=0, args=PARIS)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "two_fragments_in_one_delta",
        "one delta carries two fragments of the same call",
        "apply the entries of one delta in order",
        (
            ROLE,
            chunk(head(0, "call_1", W, '{"city": '), tc(index=0, args='"Paris"}')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "last_fragment_with_finish",
        "the last fragment and `finish_reason` in the same chunk (Mistral)",
        "a chunk with deltas and finish_reason: apply the deltas first",
        (
            ROLE,
            chunk(head(0, "call_1", W, '{"city": ')),
            chunk(tc(index=0, args='"Paris"}'), finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "indexless_calls_with_ids",
        "two calls without `index`, each with its own id (Mistral-style)",
        "index absent, a new non-empty id: a new call",
        (
            ROLE,
            chunk(tc(id="call_a", name=W, args=PARIS)),
            chunk(tc(id="call_b", name=T, args=CET)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "sparse_indices_from_1",
        "indices start at 1 and are sparse: 1, 3 (Anthropic-passthrough gateways)",
        "indices may start at 1 and be sparse; final order by index",
        (
            ROLE,
            chunk(head(1, "call_a", W)),
            chunk(tc(index=1, args=PARIS)),
            chunk(head(3, "call_b", T)),
            chunk(tc(index=3, args=CET)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "interleaved_indices",
        "two calls' fragments interleaved 0,1,0,1",
        "route by index; a call is final only when the stream ends",
        (
            ROLE,
            chunk(head(0, "call_a", W)),
            chunk(head(1, "call_b", T)),
            chunk(tc(index=0, args='{"city": ')),
            chunk(tc(index=1, args='{"tz": ')),
            chunk(tc(index=0, args='"Paris"}')),
            chunk(tc(index=1, args='"CET"}')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "content_between_calls",
        "assistant text before, between and after the calls (Avian)",
        "content may come before, between or after tool-call deltas",
        (
            ROLE,
            chunk(content="Checking both."),
            chunk(head(0, "call_a", W)),
            chunk(tc(index=0, args=PARIS)),
            chunk(content=" "),
            chunk(head(1, "call_b", T)),
            chunk(tc(index=1, args=CET)),
            chunk(content=" Done."),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "finish_reason_per_call",
        "`finish_reason` after each call, with another call after it (DeepInfra via OpenRouter)",
        "not final at the first finish_reason; later deltas still merge (an anomaly)",
        (
            ROLE,
            chunk(head(0, "call_a", W, PARIS)),
            chunk(finish="tool_calls"),
            chunk(head(1, "call_b", T, CET)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_a", W, PARIS), ("call_b", T, CET)),
    ),
    Quirk(
        "fragment_after_finish",
        "an argument fragment after the `finish_reason` chunk",
        "deltas after a finish_reason are still merged and reported as an anomaly",
        (
            ROLE,
            chunk(head(0, "call_1", W, '{"city": ')),
            chunk(finish="tool_calls"),
            chunk(tc(index=0, args='"Paris"}')),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "n2_choices",
        "`n=2`: two choices, each with its own call at index 0",
        "several choices are independent turns",
        (
            chunk(role=True, content="", choice=0),
            chunk(role=True, content="", choice=1),
            chunk(head(0, "call_c0", W, PARIS), choice=0),
            chunk(head(0, "call_c1", T, CET), choice=1),
            chunk(finish="tool_calls", choice=0),
            chunk(finish="tool_calls", choice=1),
            "[DONE]",
        ),
        (
            Turn(0, True, (("call_c0", W, PARIS, "finished"),)),
            Turn(1, True, (("call_c1", T, CET, "finished"),)),
        ),
    ),
    Quirk(
        "empty_arguments",
        'a call whose arguments stay "" (a tool without parameters)',
        'finished if the arguments parse or are empty; arguments are the raw string ""',
        (
            ROLE,
            chunk(head(0, "call_1", "get_time_now")),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", "get_time_now", "")),
    ),
    Quirk(
        "done_without_finish_reason",
        "no `finish_reason` at all, but `data: [DONE]`",
        "no finish_reason but [DONE]: as for stop",
        (ROLE, chunk(head(0, "call_1", W, PARIS)), "[DONE]"),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "unknown_finish_reason",
        "an unknown `finish_reason` (`eos_token`)",
        "an unknown value ends the turn like stop (and is an anomaly)",
        (ROLE, chunk(head(0, "call_1", W, PARIS)), chunk(finish="eos_token"), "[DONE]"),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "empty_choices_and_no_delta",
        "`choices: []`, `choices: null` and a choice without `delta` (Azure)",
        "such chunks are legal and carry nothing",
        (
            raw_chunk(choices=[], prompt_filter_results=[{"prompt_index": 0}]),
            ROLE,
            chunk(head(0, "call_1", W, PARIS)),
            raw_chunk(choices=[{"index": 0, "finish_reason": None, "content_filter_results": {}}]),
            raw_chunk(choices=None),
            chunk(finish="tool_calls"),
            raw_chunk(choices=[], usage={"prompt_tokens": 5, "completion_tokens": 7}),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "orphan_continuation",
        "a fragment with no index, id or name before any call (openai-agents makes a phantom call)",
        "no open call: drop it and report an anomaly; never invent a call",
        (
            ROLE,
            chunk(tc(args='{"stray": 1}')),
            chunk(head(0, "call_1", W, PARIS)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "data_after_done",
        "another call after `data: [DONE]`",
        "input after the end of the stream is an anomaly and ignored",
        (
            ROLE,
            chunk(head(0, "call_1", W, PARIS)),
            chunk(finish="tool_calls"),
            "[DONE]",
            chunk(head(1, "call_2", T, CET)),
            "[DONE]",
        ),
        ok(("call_1", W, PARIS)),
    ),
    Quirk(
        "finish_length_truncated",
        "arguments cut by `max_tokens`: `finish_reason: length` (LangChain #39275)",
        "length: truncated (reason length), never repaired; the turn is not complete",
        (
            ROLE,
            chunk(head(0, "call_1", W, '{"city": ')),
            chunk(tc(index=0, args='"Pa'), finish="length"),
            "[DONE]",
        ),
        bad(("call_1", W, '{"city": "Pa', "truncated")),
    ),
    Quirk(
        "invalid_json_with_tool_calls",
        "invalid JSON arguments with `finish_reason: tool_calls` (vLLM #47963)",
        "ended normally but not valid JSON: truncated (invalid_json); the turn is not complete",
        (
            ROLE,
            chunk(head(0, "call_1", W, '{"city": ')),
            chunk(tc(index=0, args='"Paris"')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        bad(("call_1", W, '{"city": "Paris"', "truncated")),
    ),
    Quirk(
        "invalid_json_second_call",
        "two calls, the second's arguments invalid, `finish_reason: tool_calls`",
        "each call is judged alone; the turn is complete only if every call is finished",
        (
            ROLE,
            chunk(head(0, "call_a", W, PARIS)),
            chunk(head(1, "call_b", T, '{"tz": "CE')),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        bad(("call_a", W, PARIS, "finished"), ("call_b", T, '{"tz": "CE', "truncated")),
    ),
    Quirk(
        "eof_without_finish_or_done",
        "the connection closes: no `finish_reason`, no `[DONE]` (arguments happen to parse)",
        "EOF with neither a finish_reason nor [DONE]: aborted (eof)",
        (ROLE, chunk(head(0, "call_1", W, '{"city": ')), chunk(tc(index=0, args='"Paris"}'))),
        bad(("call_1", W, PARIS, "aborted")),
    ),
    Quirk(
        "error_payload_after_chunks",
        'a `data: {"error": ...}` payload after buffered chunks (openai-node #2046)',
        "an error payload ends the stream: aborted (the error's message)",
        (
            ROLE,
            chunk(head(0, "call_1", W, PARIS)),
            {"error": {"message": "The server had an error", "type": "server_error"}},
        ),
        bad(("call_1", W, PARIS, "aborted")),
    ),
    Quirk(
        "sse_error_event_then_done",
        "an SSE `event: error` (no `error` key in its data), then `[DONE]`",
        "an SSE event named error carries an error: aborted; the [DONE] after it is ignored",
        (
            ROLE,
            chunk(head(0, "call_1", W, PARIS)),
            'event: error\ndata: {"message":"upstream overloaded","code":529}\n\n',
            "[DONE]",
        ),
        bad(("call_1", W, PARIS, "aborted")),
    ),
    Quirk(
        "content_filter",
        "`finish_reason: content_filter` after a call",
        "content_filter: aborted (content_filter); the turn is not complete",
        (ROLE, chunk(head(0, "call_1", W, PARIS)), chunk(finish="content_filter"), "[DONE]"),
        bad(("call_1", W, PARIS, "aborted")),
    ),
    Quirk(
        "missing_name",
        "a call that never gets a name",
        "a call that never got a name: aborted (missing_name)",
        (
            ROLE,
            chunk(tc(index=0, id="call_1", type="function", args=PARIS)),
            chunk(finish="tool_calls"),
            "[DONE]",
        ),
        bad(("call_1", "", PARIS, "aborted")),
    ),
)
