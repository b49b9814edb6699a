"""fsm.testing.ReplayServer: real HTTP on 127.0.0.1, the recording's framing, cuts and failures,
and the agent-loop check of the second request."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from fsm.api import parse_text
from fsm.clients import iter_openai_events
from fsm.parser import StreamParser
from fsm.replay import EXAMPLES_DIR
from fsm.sse import SSEFramer
from fsm.testing import (
    ReplayFailure,
    ReplayServer,
    ReplayTurn,
    demo_script,
    split_events,
)
from tests.helpers import CORPUS, corpus_files, corpus_params, require_corpus
from tests.helpers.agent import DEMO, DEMO_BYTES, FINAL

USER = {"role": "user", "content": "What are 1234 + 5678 and 12 \u00d7 34?"}
ADD_ID, MUL_ID = "call_add_7Qz2", "call_mul_9Xk4"
ADD_ARGS, MUL_ARGS = '{"a": 1234, "b": 5678}', '{"a": 12, "b": 34}'


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="test", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "demo-model-1", "messages": messages, "stream": True}


def raw_exchange(server: ReplayServer, payload: dict[str, Any]) -> tuple[bytes, bytes]:
    """POST by hand on a plain socket (``Connection: close``); returns (head, raw body) exactly as
    sent on the wire, before any chunked decoding."""
    data = json.dumps(payload).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + data
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, raw = received.partition(b"\r\n\r\n")
    return head, raw


def dechunk(raw: bytes) -> tuple[list[bytes], bool]:
    """The HTTP chunks of a chunked body, and whether the terminating chunk arrived."""
    chunks: list[bytes] = []
    while raw:
        size_line, sep, rest = raw.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return chunks, True
        chunks.append(rest[:size])
        raw = rest[size + 2 :]
    return chunks, False


# -- the recording's framing ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [
        b"data: a\n\ndata: b\n\n",
        b"data: a\r\n\r\n: c\r\ndata: b\r\n\r\n",
        b"data: a\r\rdata: b\r\r",
        b"\n\ndata: a\n\ndata: tail-without-blank-line\n",
        b"",
    ],
)
def test_split_events_keeps_every_byte_and_ends_pieces_after_blank_lines(data: bytes) -> None:
    pieces = split_events(data)
    assert b"".join(pieces) == data
    for piece in pieces[:-1]:
        assert piece.endswith((b"\n\n", b"\r\n\r\n", b"\r\r", b"\n")), piece


@pytest.mark.parametrize("name", corpus_params())
def test_split_events_on_the_corpus_gives_one_piece_per_event(name: str | None) -> None:
    require_corpus()
    assert name is not None
    data = (CORPUS / name).read_bytes()
    pieces = split_events(data)
    assert b"".join(pieces) == data
    # each piece holds at most one whole event, and together they hold every event
    counts = [len(SSEFramer(1 << 30).feed(piece)) for piece in pieces]
    assert max(counts) == 1
    assert sum(counts) == len(SSEFramer(1 << 30).feed(data))


def test_stream_is_chunked_event_stream_one_http_chunk_per_event() -> None:
    with ReplayServer([ReplayTurn(DEMO)], response_ids="recorded") as server:
        head, raw = raw_exchange(server, body([USER]))
    lines = head.decode().lower().split("\r\n")
    assert lines[0] == "http/1.1 200 ok"
    assert "transfer-encoding: chunked" in lines
    assert "content-type: text/event-stream" in lines
    chunks, terminated = dechunk(raw)
    assert terminated
    assert chunks == split_events(DEMO_BYTES)
    assert b"".join(chunks) == DEMO_BYTES


def test_base_url_is_local_with_a_free_port() -> None:
    with ReplayServer([]) as one, ReplayServer([]) as two:
        assert one.base_url == f"http://127.0.0.1:{one.port}/v1"
        assert one.chat_url == f"http://127.0.0.1:{one.port}/v1/chat/completions"
        assert one.port != two.port
        assert one.port > 0
    with pytest.raises(RuntimeError, match="not running"):
        _ = one.port


def test_every_corpus_stream_is_sent_byte_exact(http: httpx.Client) -> None:
    require_corpus()
    for name in corpus_files():
        data = (CORPUS / name).read_bytes()
        with ReplayServer([ReplayTurn(CORPUS / name)], response_ids="recorded") as server:
            response = http.post(server.chat_url, json=body([USER]))
        assert response.status_code == 200
        assert response.content == data, name
        assert server.failures == []


# -- cuts and failures ------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 1, 200, len(DEMO_BYTES) // 2, len(DEMO_BYTES) - 1])
def test_cut_at_sends_exactly_that_many_bytes_and_no_final_chunk(offset: int) -> None:
    with ReplayServer([ReplayTurn(DEMO, cut_at=offset)], response_ids="recorded") as server:
        _head, raw = raw_exchange(server, body([USER]))
    chunks, terminated = dechunk(raw)
    assert not terminated
    assert b"".join(chunks) == DEMO_BYTES[:offset]


def test_cut_is_an_incomplete_body_for_httpx(http: httpx.Client) -> None:
    with (
        ReplayServer([ReplayTurn(DEMO, cut_at=300)]) as server,
        pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"),
    ):
        http.post(server.chat_url, json=body([USER]))


def test_error_at_sends_an_error_event_at_the_next_event_boundary() -> None:
    turn = ReplayTurn(DEMO, error_at=10, error_message="upstream overloaded")
    with ReplayServer([turn]) as server:
        _head, raw = raw_exchange(server, body([USER]))
    chunks, terminated = dechunk(raw)
    assert terminated
    first = split_events(DEMO_BYTES)[0]
    assert chunks[0] == first
    assert chunks[1].startswith(b"event: error\ndata: ")
    error = json.loads(chunks[1].split(b"data: ", 1)[1])
    assert error["error"]["message"] == "upstream overloaded"
    assert len(chunks) == 2


def test_reset_at_drops_the_connection(http: httpx.Client) -> None:
    with ReplayServer([ReplayTurn(DEMO, reset_at=500)]) as server:
        with pytest.raises(httpx.TransportError):
            http.post(server.chat_url, json=body([USER]))
        assert server.served == 1


def test_hold_at_stalls_until_released(http: httpx.Client) -> None:
    hold = DEMO_BYTES.index(b"\n\n", DEMO_BYTES.index(b"tool_calls")) + 2
    with ReplayServer([ReplayTurn(DEMO, hold_at=hold - 5)], response_ids="recorded") as server:
        received = b""
        with http.stream("POST", server.chat_url, json=body([USER])) as response:
            for data in response.iter_bytes():
                received += data
                if len(received) >= hold - 5:
                    server.release()
        assert received == DEMO_BYTES


def test_hold_gives_up_after_hold_timeout(http: httpx.Client) -> None:
    with ReplayServer(
        [ReplayTurn(DEMO, hold_at=100)], hold_timeout=0.01, response_ids="recorded"
    ) as server:
        assert http.post(server.chat_url, json=body([USER])).content == DEMO_BYTES


def test_paced_stream_arrives_whole(http: httpx.Client) -> None:
    with ReplayServer([ReplayTurn(FINAL, delay=0.001)], response_ids="recorded") as server:
        assert http.post(server.chat_url, json=body([USER])).content == FINAL.read_bytes()


def test_status_turn_answers_an_openai_error(client: openai.OpenAI) -> None:
    script = [ReplayTurn(DEMO, status=429, error_message="slow down"), ReplayTurn(FINAL)]
    with ReplayServer(script) as server:
        sdk = client.with_options(base_url=server.base_url)
        with pytest.raises(openai.RateLimitError, match="slow down"):
            sdk.chat.completions.create(model="m", messages=[USER], stream=True)
        # the retry after an HTTP error is checked against the turn before (none here)
        stream = sdk.chat.completions.create(model="m", messages=[USER], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert server.failures == []
    assert server.served == 2


def test_turn_from_bytes_or_str_path(http: httpx.Client) -> None:
    with ReplayServer(
        [ReplayTurn(b"data: [DONE]\n\n"), ReplayTurn(str(FINAL))], response_ids="recorded"
    ) as server:
        assert http.post(server.chat_url, json=body([USER])).content == b"data: [DONE]\n\n"
        assert http.post(server.chat_url, json=body([USER])).content == FINAL.read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cut_at": 1, "error_at": 2}, "at most one"),
        ({"reset_at": -1}, ">= 0"),
        ({"delay": -1.0}, "delay"),
        ({"status": 700}, "HTTP status"),
    ],
)
def test_turn_arguments_are_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayTurn(DEMO, **kwargs)


# -- the agent-loop check ---------------------------------------------------------------------------
def assistant(*calls: tuple[str, str, str], content: str | None = None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ],
    }


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


GOOD = [
    USER,
    assistant((ADD_ID, "add", ADD_ARGS), (MUL_ID, "multiply", MUL_ARGS)),
    tool(ADD_ID, "6912"),
    tool(MUL_ID, "408"),
]


def first_turn(server: ReplayServer, http: httpx.Client) -> None:
    response = http.post(server.chat_url, json=body([USER]))
    assert response.status_code == 200


def test_agent_loop_with_the_sdk_is_accepted(client: openai.OpenAI) -> None:
    """The demo conversation end to end: stream, parse, send back history, get the answer."""
    with ReplayServer(demo_script(["6912", "408"])) as server:
        sdk = client.with_options(base_url=server.base_url)
        stream = sdk.chat.completions.create(model="demo-model-1", messages=[USER], stream=True)
        with stream:
            events = iter_openai_events(stream)
            list(events)
        turn = events.result().turn(0)
        assert turn.complete
        message = turn.to_message()
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]
        ]
        assert calls == [(ADD_ID, "add", ADD_ARGS), (MUL_ID, "multiply", MUL_ARGS)]
        results = {"add": "6912", "multiply": "408"}
        history = [USER, message] + [
            tool(c["id"], results[c["function"]["name"]]) for c in message["tool_calls"]
        ]
        stream = sdk.chat.completions.create(model="demo-model-1", messages=history, stream=True)
        with stream:
            final = iter_openai_events(stream)
            list(final)
        assert final.result().turn(0).content == "1234 + 5678 = 6912, and 12 \u00d7 34 = 408."
        assert final.result().complete
    assert server.failures == []
    assert server.requests[1]["messages"] == history
    assert len(server.requests) == 2


def test_correct_second_request_without_expected_results_is_accepted(http: httpx.Client) -> None:
    with ReplayServer(demo_script()) as server:
        first_turn(server, http)
        messages = [*GOOD[:2], tool(ADD_ID, "anything"), tool(MUL_ID, "at all")]
        assert http.post(server.chat_url, json=body(messages)).status_code == 200
    assert server.failures == []


BAD_SECOND_REQUESTS = {
    "wrong tool_call_id": (
        [*GOOD[:3], tool("call_mul_WRONG", "408")],
        "tool_call_id is 'call_mul_WRONG'",
    ),
    "missing tool message": (
        GOOD[:3],
        "tool result for call 'call_mul_9Xk4' (multiply) is missing",
    ),
    "user message between": (
        [*GOOD[:2], {"role": "user", "content": "well?"}, *GOOD[2:]],
        "is a 'user' message where the tool result",
    ),
    "tool results in the wrong order": (
        [*GOOD[:2], GOOD[3], GOOD[2]],
        "tool_call_id is 'call_mul_9Xk4'",
    ),
    "arguments not byte-exact": (
        [
            USER,
            assistant((ADD_ID, "add", '{"a":1234,"b":5678}'), (MUL_ID, "multiply", MUL_ARGS)),
            *GOOD[2:],
        ],
        "function.arguments is",
    ),
    "an id rewritten": (
        [USER, assistant(("call_0", "add", ADD_ARGS), (MUL_ID, "multiply", MUL_ARGS)), *GOOD[2:]],
        "tool_calls[0].id is 'call_0'",
    ),
    "calls reordered": (
        [USER, assistant((MUL_ID, "multiply", MUL_ARGS), (ADD_ID, "add", ADD_ARGS)), *GOOD[2:]],
        "tool_calls[0].id is 'call_mul_9Xk4'",
    ),
    "a call dropped": (
        [USER, assistant((ADD_ID, "add", ADD_ARGS)), GOOD[2]],
        "has 1 tool_calls; the previous turn streamed 2",
    ),
    "no assistant message": ([USER, *GOOD[2:]], "no assistant message"),
    "assistant message without tool_calls": (
        [USER, {"role": "assistant", "content": "hm"}, *GOOD[2:]],
        "has no tool_calls",
    ),
    "a wrong tool result": ([*GOOD[:3], tool(MUL_ID, "407")], "content is '407'; expected '408'"),
    "not streaming": (None, '"stream": true'),
}


@pytest.mark.parametrize("case", BAD_SECOND_REQUESTS)
def test_wrong_second_request_is_rejected_with_400(case: str, client: openai.OpenAI) -> None:
    messages, match = BAD_SECOND_REQUESTS[case]
    with ReplayServer(demo_script(["6912", "408"])) as server:
        sdk = client.with_options(base_url=server.base_url)
        list(sdk.chat.completions.create(model="m", messages=[USER], stream=True))
        with pytest.raises(openai.BadRequestError, match=re.escape(match)) as info:
            sdk.chat.completions.create(
                model="m",
                messages=messages if messages is not None else GOOD,
                stream=messages is not None,
            )
        assert info.value.status_code == 400
        assert info.value.type == "invalid_request_error"
        assert len(server.failures) == 1
        assert server.failures[0].request == 1
        assert server.failures[0].message in info.value.message
        # a rejected request does not use up the script: the correct one still gets its turn
        answer = sdk.chat.completions.create(model="m", messages=GOOD, stream=True)
        assert [c for c in answer if c.choices and c.choices[0].delta.content]
        assert server.served == 2
        assert len(server.failures) == 1


def test_rejection_body_is_openai_shaped(http: httpx.Client) -> None:
    with ReplayServer(demo_script()) as server:
        first_turn(server, http)
        response = http.post(server.chat_url, json=body([USER]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "no assistant message" in error["message"]
    assert server.failures == [ReplayFailure(1, error["message"])]


def test_calls_of_a_cut_turn_must_not_be_salvaged(http: httpx.Client) -> None:
    cut = DEMO_BYTES.index(b'"arguments":"4}"')  # both calls open, neither complete
    script = [ReplayTurn(DEMO, cut_at=cut), ReplayTurn(DEMO)]
    with ReplayServer(script) as server:
        with pytest.raises(httpx.RemoteProtocolError):
            http.post(server.chat_url, json=body([USER]))
        salvaged = http.post(server.chat_url, json=body(GOOD))
        assert salvaged.status_code == 400
        assert "must not reach history" in salvaged.json()["error"]["message"]
        orphan = http.post(server.chat_url, json=body([USER, tool(ADD_ID, "6912")]))
        assert orphan.status_code == 400
        assert "did not end complete" in orphan.json()["error"]["message"]
        assert http.post(server.chat_url, json=body([USER])).status_code == 200  # a clean retry
    assert [f.request for f in server.failures] == [1, 2]


def test_no_check_after_a_turn_without_tool_calls(http: httpx.Client) -> None:
    with ReplayServer([ReplayTurn(FINAL), ReplayTurn(FINAL)]) as server:
        assert http.post(server.chat_url, json=body([USER])).status_code == 200
        assert http.post(server.chat_url, json=body([USER])).status_code == 200
    assert server.failures == []


def test_check_can_be_turned_off(http: httpx.Client) -> None:
    with ReplayServer([ReplayTurn(DEMO), ReplayTurn(FINAL, check=False)]) as server:
        first_turn(server, http)
        assert http.post(server.chat_url, json=body([USER])).status_code == 200
    assert server.failures == []


def test_requests_outside_the_script_are_rejected(http: httpx.Client) -> None:
    with ReplayServer([ReplayTurn(FINAL)]) as server:
        assert http.post(server.url + "/v1/completions", json=body([USER])).status_code == 404
        bad_json = http.post(server.chat_url, content=b"{nope")
        assert bad_json.status_code == 400
        assert http.post(server.chat_url, json=body([USER])).status_code == 200
        exhausted = http.post(server.chat_url, json=body([USER]))
        assert exhausted.status_code == 400
        assert "no turn left" in exhausted.json()["error"]["message"]
    assert [f.request for f in server.failures] == [0, 1, 3]
    assert server.requests[1] is None


def test_chunked_request_body_is_read(http: httpx.Client) -> None:
    payload = json.dumps(body([USER])).encode()
    with ReplayServer([ReplayTurn(FINAL)]) as server:
        response = http.post(server.chat_url, content=iter([payload[:10], payload[10:]]))
        assert response.status_code == 200
    assert server.requests == [body([USER])]


def test_reset_starts_a_new_script(http: httpx.Client) -> None:
    with ReplayServer(demo_script()) as server:
        first_turn(server, http)
        server.reset([ReplayTurn(FINAL)])
        assert http.post(server.chat_url, json=body([USER])).status_code == 200
        assert server.requests == [body([USER])]
    assert server.failures == []


def test_server_can_restart_only_after_stop() -> None:
    server = ReplayServer([]).start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            server.start()
    finally:
        server.stop()
    server.stop()  # idempotent


def test_demo_script_points_at_the_project_examples() -> None:
    script = demo_script(["1", "2"])
    assert [Path(str(t.stream)).name for t in script] == [
        "parallel_add_multiply.sse",
        "final_answer.sse",
    ]
    assert script[1].expect_tool_results == ["1", "2"]


def test_importing_fsm_testing_loads_no_http_client() -> None:
    code = (
        "import sys, json, fsm.testing\n"
        "print(json.dumps([m for m in ('openai', 'httpx', 'httpx2', 'fsm.clients') "
        "if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_each_response_gets_its_own_id(http: httpx.Client) -> None:
    """Two requests, two servers: four ids, each the recorded one plus its own suffix, and
    nothing else of the recording changed (issue 12: a rerun must not meet idempotency)."""
    ids = []
    for _ in range(2):
        with ReplayServer([ReplayTurn(FINAL), ReplayTurn(FINAL, check=False)]) as server:
            for _ in range(2):
                result = parse_text(http.post(server.chat_url, json=body([USER])).content)
                assert result.complete
                ids.append(result.response_id)
    recorded = parse_text(FINAL.read_bytes()).response_id
    assert recorded is not None
    assert len(set(ids)) == 4
    assert all(re.fullmatch(re.escape(recorded) + r"-[0-9a-f]{8}-[12]", i or "") for i in ids), ids
    with ReplayServer([ReplayTurn(FINAL)]) as server:
        sent = http.post(server.chat_url, json=body([USER])).content
    new_id = parse_text(sent).response_id
    assert new_id is not None
    assert sent.replace(json.dumps(new_id).encode(), json.dumps(recorded).encode()) == (
        FINAL.read_bytes()
    )
    with pytest.raises(ValueError, match="response_ids"):
        ReplayServer([], response_ids="random")  # type: ignore[arg-type]


# -- issue 17: the Responses API and Anthropic Messages -----------------------------------------
RESPONSES_FIRST = EXAMPLES_DIR / "responses_add_multiply.sse"
RESPONSES_FINAL = EXAMPLES_DIR / "responses_final_answer.sse"
ANTHROPIC_FIRST = EXAMPLES_DIR / "anthropic_add_multiply.sse"
ANTHROPIC_FINAL = EXAMPLES_DIR / "anthropic_final_answer.sse"
SHARED = CORPUS.parent
TYPED_CORPORA = {"responses": SHARED / "corpus-responses", "anthropic": SHARED / "corpus-anthropic"}
RESULTS = ["6912", "408"]
Q = {"role": "user", "content": "What are 1234 + 5678 and 12 \u00d7 34?"}


def typed_turn(path: Path, fmt: str) -> Any:
    parser = StreamParser(format=fmt)  # type: ignore[arg-type]
    parser.receive_data(path.read_bytes())
    parser.receive_eof()
    return parser.result().turns[0]


def responses_script() -> list[ReplayTurn]:
    return [ReplayTurn(RESPONSES_FIRST), ReplayTurn(RESPONSES_FINAL, expect_tool_results=RESULTS)]


def anthropic_script() -> list[ReplayTurn]:
    return [ReplayTurn(ANTHROPIC_FIRST), ReplayTurn(ANTHROPIC_FINAL, expect_tool_results=RESULTS)]


def test_the_openai_sdk_runs_a_responses_turn_and_its_follow_up() -> None:
    turn = typed_turn(RESPONSES_FIRST, "responses")
    with ReplayServer(responses_script()) as server:
        sdk = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        events = list(sdk.responses.create(model="m", input=[Q], stream=True))
        assert events[-1].type == "response.completed"
        calls = [i for i in events[-1].response.output if i.type == "function_call"]
        assert [(c.call_id, c.arguments) for c in calls] == [
            (c.id, c.arguments) for c in turn.tool_calls
        ]
        follow_up = sdk.responses.create(model="m", input=[Q, *turn.to_items(RESULTS)], stream=True)
        assert [e.type for e in follow_up][-1] == "response.completed"
    assert server.failures == [] and server.served == 2


def test_the_anthropic_sdk_runs_a_messages_turn_and_its_follow_up() -> None:
    turn = typed_turn(ANTHROPIC_FIRST, "anthropic")
    with ReplayServer(anthropic_script()) as server:
        sdk = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
        with sdk.messages.stream(model="m", max_tokens=64, messages=[Q]) as stream:
            message = stream.get_final_message()
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
        again = sdk.messages.create(
            model="m", max_tokens=64, messages=[Q, *turn.to_anthropic(RESULTS)], stream=True
        )
        assert [e.type for e in again][-1] == "message_stop"
    assert server.failures == [] and server.served == 2


def _responses_cases() -> dict[str, Any]:
    turn = typed_turn(RESPONSES_FIRST, "responses")
    good = [Q, *turn.to_items(RESULTS)]
    calls = [i for i, item in enumerate(good) if item.get("type") == "function_call"]
    outputs = [i for i, item in enumerate(good) if item.get("type") == "function_call_output"]
    reasoning = next(i for i, item in enumerate(good) if item.get("type") == "reasoning")

    def changed(at: int, **values: Any) -> list[Any]:
        items = [dict(item) for item in good]
        items[at].update(values)
        return items

    return {
        "a_call_without_output": (
            [item for i, item in enumerate(good) if i != outputs[1]],
            "No tool output found for function call call_mul_9Xk4.",
        ),
        "an_output_for_no_call": (
            [*good, {"type": "function_call_output", "call_id": "call_nope", "output": "1"}],
            "No tool call found for function call output with call_id call_nope.",
        ),
        "a_second_output_for_one_call": (
            [*good, dict(good[outputs[0]])],
            "No tool call found for function call output with call_id call_add_7Qz2.",
        ),
        "the_calls_left_out": (
            [item for i, item in enumerate(good) if i not in calls],
            "No tool call found for function call output",
        ),
        "changed_arguments": (
            changed(calls[0], arguments='{"a": 1234, "b": 5679}'),
            'the stream sent \'{"a": 1234, "b": 5678}\'',
        ),
        "changed_encrypted_reasoning": (
            changed(reasoning, encrypted_content="gAAAA-edited"),
            "must be sent back verbatim",
        ),
        "a_wrong_result": (changed(outputs[1], output="407"), "expected '408'"),
        "an_unknown_previous_response": (
            {"previous_response_id": "resp_unknown", "input": good[outputs[0] :]},
            "Previous response with id 'resp_unknown' not found.",
        ),
    }


@pytest.mark.parametrize("case", sorted(_responses_cases()))
def test_a_responses_follow_up_that_does_not_match_its_calls_is_refused(case: str) -> None:
    payload, message = _responses_cases()[case]
    request = payload if isinstance(payload, dict) else {"input": payload}
    with ReplayServer(responses_script()) as server:
        sdk = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        list(sdk.responses.create(model="m", input=[Q], stream=True))
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model="m", stream=True, **request)
        assert message in refused.value.message
        assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        assert [f.request for f in server.failures] == [1] and server.served == 1


def test_a_responses_follow_up_may_chain_with_previous_response_id(http: httpx.Client) -> None:
    with ReplayServer(responses_script()) as server:
        first = parse_text(http.post(server.url + "/v1/responses", json=_responses_body(Q)).content)
        assert first.format == "responses" and first.response_id is not None
        assert first.response_id.startswith("resp_fsmdemo0001-")  # each response its own id
        outputs = [
            {"type": "function_call_output", "call_id": c.id, "output": r}
            for c, r in zip(first.turns[0].tool_calls, RESULTS, strict=True)
        ]
        chained = {"previous_response_id": first.response_id, "input": outputs}
        assert http.post(server.url + "/v1/responses", json=_responses_body(**chained)).is_success
    assert server.failures == []


def _responses_body(*items: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "input": list(items), **fields}


def _anthropic_body(*messages: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "max_tokens": 64, "messages": list(messages)}


def _anthropic_cases() -> dict[str, Any]:
    turn = typed_turn(ANTHROPIC_FIRST, "anthropic")
    assistant, results = turn.to_anthropic(RESULTS)
    add, mul = results["content"]

    def blocks(*content: Any) -> dict[str, Any]:
        return {"role": "user", "content": list(content)}

    signed = [dict(b) for b in assistant["content"]]
    signed[0]["signature"] = "edited"
    edited_input = [dict(b) for b in assistant["content"]]
    edited_input[2]["input"] = {"a": 1, "b": 5678}
    return {
        "a_call_without_result": (
            [Q, assistant, blocks(add)],
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately "
            "after: toolu_fsmdemo_mul.",
        ),
        "a_result_for_no_call": (
            [Q, assistant, blocks(add, mul, {**mul, "tool_use_id": "toolu_nope"})],
            "messages.2.content.2: unexpected `tool_use_id` found in `tool_result` blocks: "
            "toolu_nope.",
        ),
        "results_split_over_two_messages": (
            [Q, assistant, blocks(add), blocks(mul)],
            "messages.3.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
            "toolu_fsmdemo_mul.",
        ),
        "results_after_a_user_text": (
            [Q, assistant, {"role": "user", "content": "and?"}, blocks(add, mul)],
            "messages.3.content.0: unexpected `tool_use_id`",
        ),
        "no_results_at_all": (
            [Q, assistant, {"role": "user", "content": "and?"}],
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately "
            "after: toolu_fsmdemo_add, toolu_fsmdemo_mul.",
        ),
        "a_changed_signature": (
            [Q, {**assistant, "content": signed}, results],
            "thinking blocks must be sent back verbatim",
        ),
        "a_changed_input": ([Q, {**assistant, "content": edited_input}, results], "input is"),
        "results_out_of_order": ([Q, assistant, blocks(mul, add)], "in call order"),
        "no_max_tokens": ("no_max_tokens", "max_tokens: Field required"),
        "a_system_message": (
            [{"role": "system", "content": "be brief"}, Q],
            "messages.0.role: Input should be 'user' or 'assistant'",
        ),
    }


@pytest.mark.parametrize("case", sorted(_anthropic_cases()))
def test_an_anthropic_follow_up_that_does_not_match_its_calls_is_refused(
    case: str, http: httpx.Client
) -> None:
    messages, message = _anthropic_cases()[case]
    if messages == "no_max_tokens":
        turn = typed_turn(ANTHROPIC_FIRST, "anthropic")
        request = {"model": "m", "stream": True, "messages": [Q, *turn.to_anthropic(RESULTS)]}
    else:
        request = _anthropic_body(*messages)
    with ReplayServer(anthropic_script()) as server:
        assert http.post(server.url + "/v1/messages", json=_anthropic_body(Q)).is_success
        refused = http.post(server.url + "/v1/messages", json=request)
    assert refused.status_code == 400
    body = refused.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]
    assert [f.request for f in server.failures] == [1] and server.served == 1


def test_a_turn_is_served_only_at_its_own_path(http: httpx.Client) -> None:
    with ReplayServer([ReplayTurn(ANTHROPIC_FIRST)]) as server:
        wrong = http.post(server.url + "/v1/responses", json=_responses_body(Q))
        assert wrong.status_code == 400
        assert (
            "Anthropic Messages stream, served at POST /v1/messages"
            in (wrong.json()["error"]["message"])
        )
        assert http.post(server.url + "/v1/messages", json=_anthropic_body(Q)).is_success
    with pytest.raises(ValueError, match=r"ReplayTurn\.format"):
        ReplayTurn(ANTHROPIC_FIRST, format="gemini")  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["responses", "anthropic"])
def test_calls_of_a_cut_typed_turn_must_not_be_salvaged(fmt: str, http: httpx.Client) -> None:
    first, final = (
        (RESPONSES_FIRST, RESPONSES_FINAL)
        if fmt == "responses"
        else (ANTHROPIC_FIRST, ANTHROPIC_FINAL)
    )
    data = first.read_bytes()
    whole = typed_turn(first, fmt)
    cut = data.index(b"multiply")  # add complete, multiply open: the turn is not
    path = "/v1/responses" if fmt == "responses" else "/v1/messages"
    body = _responses_body if fmt == "responses" else _anthropic_body
    salvage = (
        [Q, *whole.to_items(RESULTS)] if fmt == "responses" else [Q, *whole.to_anthropic(RESULTS)]
    )
    with ReplayServer([ReplayTurn(first, cut_at=cut), ReplayTurn(final)]) as server:
        with pytest.raises(httpx.RemoteProtocolError):
            http.post(server.url + path, json=body(Q))
        refused = http.post(server.url + path, json=body(*salvage))
        assert refused.status_code == 400
        assert "an incomplete call must not reach history" in refused.text
        assert http.post(server.url + path, json=body(Q)).is_success  # a clean retry
    assert [f.request for f in server.failures] == [1]


def test_error_at_sends_the_formats_own_error_event(http: httpx.Client) -> None:
    for first, path, body, fmt in (
        (RESPONSES_FIRST, "/v1/responses", _responses_body, "responses"),
        (ANTHROPIC_FIRST, "/v1/messages", _anthropic_body, "anthropic"),
    ):
        with ReplayServer([ReplayTurn(first, error_at=400, error_message="overloaded")]) as server:
            sent = http.post(server.url + path, json=body(Q)).content
        result = parse_text(sent)
        assert result.format == fmt and result.end_how == "error"
        assert result.end_reason is not None and "overloaded" in result.end_reason
        assert not result.turns[0].complete


def _typed_corpus() -> list[Any]:
    found = [
        pytest.param(fmt, p, id=f"{fmt}/{p.name}")
        for fmt, folder in TYPED_CORPORA.items()
        for p in sorted(folder.glob("*.sse"))
    ]
    return found or [pytest.param(None, None, id="no-corpus")]


@pytest.mark.parametrize(("fmt", "path"), _typed_corpus())
def test_every_typed_recording_is_sent_byte_exact_at_its_path(
    fmt: str | None, path: Path | None, http: httpx.Client
) -> None:
    if fmt is None or path is None:
        require_corpus()
        pytest.fail(f"no recordings in {TYPED_CORPORA}")
    route, body = (
        ("/v1/responses", _responses_body(Q))
        if fmt == "responses"
        else ("/v1/messages", _anthropic_body(Q))
    )
    with ReplayServer([ReplayTurn(path)], response_ids="recorded") as server:
        got = http.post(server.url + route, json=body)
    assert got.status_code == 200
    assert got.content == path.read_bytes()
