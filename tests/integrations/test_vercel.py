"""The Vercel AI SDK UI message stream (issue 30, item 6), checked by the protocol's own code.

What ``fsm.integrations.vercel`` emits for every recording of the corpora (Chat Completions,
Responses, Anthropic Messages) and for hostile streams (truncated, cut, aborted, failed, not
JSON) is given to ``tests/integrations/vercel_check.cjs``, which validates each part with the
``ai`` package's ``uiMessageChunkSchema`` and reads the stream with its ``readUIMessageStream``
(what ``useChat`` runs); the UI message it builds must show exactly fsm's calls: a finished call
as ``input-available`` with its arguments, a truncated or aborted one as ``output-error``.

The ``ai`` package is installed with npm into a cache directory outside the repository
(``$FSM_AI_SDK_DIR``, default ``~/.cache/fsm-tests/ai-sdk``) on first use; without node or npm,
or when the install fails, the checks skip with the reason (fail under
``FSM_REQUIRE_FRAMEWORKS=1``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fsm import StreamParser, ToolCallState, parse
from fsm.integrations.vercel import (
    DONE,
    UI_MESSAGE_STREAM_HEADERS,
    Part,
    UIMessageStreamEncoder,
    UIMessageStreamError,
    encode_sse,
    ui_message_response,
    ui_message_stream,
    ui_parts,
)
from fsm.replay import EXAMPLES_DIR
from tests.helpers import (
    CORPUS,
    FORMAT_CORPORA,
    corpus_files,
    recordings_of,
    require_corpus,
    require_framework,
)

CHECKER = Path(__file__).with_name("vercel_check.cjs")
AI_SDK_DIR = Path(os.environ.get("FSM_AI_SDK_DIR", Path.home() / ".cache" / "fsm-tests" / "ai-sdk"))
#: the major version of the `ai` package whose UI message stream (protocol v1) is checked
AI_VERSION = "ai@6"
FIRST = EXAMPLES_DIR / "parallel_add_multiply.sse"
FINAL = EXAMPLES_DIR / "final_answer.sse"
CUT = EXAMPLES_DIR / "cut_off_call.sse"


def _unavailable(message: str) -> None:
    if os.environ.get("FSM_REQUIRE_FRAMEWORKS") == "1":
        pytest.fail(message + "; FSM_REQUIRE_FRAMEWORKS=1 makes this an error")
    pytest.skip(message)


@cache
def _install() -> str | None:
    """Install ``ai`` into :data:`AI_SDK_DIR` once; why not, or ``None`` when it is there."""
    if (AI_SDK_DIR / "node_modules" / "ai" / "package.json").is_file():
        return None
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        return "the Vercel AI SDK check needs node and npm on PATH"
    AI_SDK_DIR.mkdir(parents=True, exist_ok=True)
    command = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(AI_SDK_DIR), AI_VERSION]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(command)}` took more than 10 minutes"
    if done.returncode != 0:
        return f"`{' '.join(command)}` failed: {done.stderr.strip()[-400:]}"
    return None


def _ai_sdk() -> Path:
    why = _install()
    if why is not None:
        _unavailable(why)
    return AI_SDK_DIR


def _frame(parts: list[Part]) -> bytes:
    return b"".join(encode_sse(p) for p in parts) + DONE


def _check(streams: dict[str, bytes], tmp_path: Path) -> dict[str, Any]:
    """Each framed stream as the ``ai`` package reads it (see vercel_check.cjs)."""
    sdk = _ai_sdk()
    source = tmp_path / "streams.json"
    source.write_text(json.dumps({k: v.decode() for k, v in streams.items()}))
    done = subprocess.run(
        ["node", str(CHECKER), str(sdk), str(source)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def _assert_accepted(name: str, checked: dict[str, Any], parts: list[Part]) -> None:
    assert checked["framing"] == [], (name, checked["framing"])
    assert checked["invalid"] == [], (name, checked["invalid"])
    errors = [e for e in checked["errors"] if e["name"] != "Error"]
    assert errors == [], (name, errors)  # UIMessageStreamError: a part out of order
    said = [e["message"] for e in checked["errors"] if e["name"] == "Error"]
    assert said == [p["errorText"] for p in parts if p["type"] == "error"], name


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _fsm_calls(data: bytes) -> list[tuple[str, bool, str]]:
    """(name, usable, input) of choice 0's calls, as fsm judges them."""
    result = parse(data)
    turns = [t for t in result.turns if t.index == 0]
    calls = []
    for call in turns[0].tool_calls if turns else []:
        usable = call.state is ToolCallState.FINISHED
        if not usable:
            value: Any = None
        elif call.custom:
            value = call.arguments
        else:
            value = json.loads(call.arguments) if call.arguments.strip() else {}
        calls.append((call.name, usable, _canonical(value)))
    return sorted(calls)


def _ui_calls(message: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    """(name, usable, input) of the tool parts of the UI message the SDK built (``None``: the
    stream showed nothing, so the reader built no message)."""
    calls = []
    for part in message["parts"] if message is not None else []:
        if not part["type"].startswith("tool-"):
            continue
        usable = part["state"] == "input-available"
        assert usable or part["state"] == "output-error", part
        value = part["input"] if usable else None
        calls.append((part["type"][len("tool-") :], usable, _canonical(value)))
    return sorted(calls)


def _recordings() -> list[Path]:
    files = [CORPUS / name for name in corpus_files()]
    for folder in FORMAT_CORPORA.values():
        files += [p for p in recordings_of(folder) if p.is_file()]
    return files


def test_every_corpus_recording_is_a_stream_the_sdk_accepts(tmp_path: Path) -> None:
    require_corpus()
    recordings = _recordings()
    assert len(recordings) > 100
    parts = {p.relative_to(p.parents[1]).as_posix(): ui_parts(p.read_bytes()) for p in recordings}
    checked = _check({name: _frame(ps) for name, ps in parts.items()}, tmp_path)
    by_name = {p.relative_to(p.parents[1]).as_posix(): p for p in recordings}
    shown = 0
    for name, result in checked.items():
        _assert_accepted(name, result, parts[name])
        data = by_name[name].read_bytes()
        assert _ui_calls(result["message"]) == _fsm_calls(data), name
        shown += len(_fsm_calls(data))
        kinds = [p["type"] for p in parts[name]]
        assert kinds[:2] == ["start", "start-step"] and kinds[-1] in ("finish", "abort"), name
    assert shown > 50  # the corpus is mostly tool calls


def _cut_points(data: bytes) -> Iterator[bytes]:
    for fraction in (0.2, 0.4, 0.55, 0.7, 0.85):
        yield data[: int(len(data) * fraction)]


def _aborted(data: bytes, at: int) -> list[Part]:
    """A stream the server stops (the user pressed stop) at byte ``at``."""
    encoder = UIMessageStreamEncoder(message_id="msg-abort")
    parser = StreamParser()
    parts = encoder.start() + encoder.start_step() + encoder.feed(parser.receive_data(data[:at]))
    return parts + encoder.feed(parser.abort("the user stopped it"))


def _two_steps() -> list[Part]:
    """A server-side agent loop's message: the calls, their outputs, then the answer."""
    encoder = UIMessageStreamEncoder(message_id="msg-loop")
    parts = encoder.start_step() + encoder.feed(StreamParser().receive_data(FIRST.read_bytes()))
    calls = parse(FIRST.read_bytes()).turn(0).tool_calls
    parts += encoder.tool_output(calls[0].id, 6912)
    parts += encoder.tool_output_error(calls[1].id, "multiply is down")
    parts += encoder.start_step() + encoder.feed(StreamParser().receive_data(FINAL.read_bytes()))
    return parts + encoder.finish()


def _hostile() -> dict[str, list[Part]]:
    first = FIRST.read_bytes()
    streams = {"truncated (finish_reason length)": ui_parts(CUT.read_bytes())}
    for n, cut in enumerate(_cut_points(first)):
        streams[f"cut {n} (EOF mid-stream)"] = ui_parts(cut)
    streams["split in 1-byte reads"] = ui_parts([first[i : i + 1] for i in range(len(first))])
    streams["aborted"] = _aborted(first, len(first) // 2)
    streams["error event"] = ui_parts(
        first[: len(first) // 2].rsplit(b"\n\n", 1)[0]
        + b'\n\nevent: error\ndata: {"error": {"message": "overloaded"}}\n\n'
    )
    streams["not JSON"] = ui_parts(
        first[: len(first) // 2].rsplit(b"\n\n", 1)[0] + b"\n\ndata: {x\n\n"
    )
    streams["two steps with tool outputs"] = _two_steps()
    return streams


def test_hostile_streams_are_streams_the_sdk_accepts(tmp_path: Path) -> None:
    streams = _hostile()
    checked = _check({name: _frame(ps) for name, ps in streams.items()}, tmp_path)
    for name, parts in streams.items():
        _assert_accepted(name, checked[name], parts)
    truncated = checked["truncated (finish_reason length)"]["message"]
    [bad] = [
        p
        for p in truncated["parts"]
        if p["type"].startswith("tool-") and p["state"] != "input-available"
    ]
    assert bad["state"] == "output-error" and "incomplete" in bad["errorText"]
    assert bad["rawInput"] == parse(CUT.read_bytes()).turn(0).tool_calls[-1].arguments
    aborted = streams["aborted"]
    assert aborted[-1] == {"type": "abort", "reason": "the user stopped it"}
    ends = ["tool-input-error", "error", "finish-step", "finish"]
    for name in ("error event", "not JSON", "cut 2 (EOF mid-stream)"):
        assert [p["type"] for p in streams[name]][-4:] == ends, name
        assert streams[name][-1] == {"type": "finish", "finishReason": "error"}
    assert "overloaded" in streams["error event"][-3]["errorText"]
    loop = checked["two steps with tool outputs"]["message"]
    tools = [p for p in loop["parts"] if p["type"].startswith("tool-")]
    assert [(p["type"], p["state"]) for p in tools] == [
        ("tool-add", "output-available"),
        ("tool-multiply", "output-error"),
    ]
    assert tools[0]["output"] == 6912 and tools[0]["input"] == {"a": 1234, "b": 5678}
    assert [p["type"] for p in loop["parts"]].count("step-start") == 2
    answer = "".join(p["text"] for p in loop["parts"] if p["type"] == "text")
    assert parse(FINAL.read_bytes()).turn(0).content in answer


def test_the_encoder_refuses_parts_out_of_order() -> None:
    encoder = UIMessageStreamEncoder()
    encoder.feed(StreamParser().receive_data(FIRST.read_bytes()))
    with pytest.raises(UIMessageStreamError, match="no tool call 'call_nope'"):
        encoder.tool_output("call_nope", 1)
    encoder.finish()
    with pytest.raises(UIMessageStreamError, match="after the message ended"):
        encoder.start_step()


def test_a_call_streams_its_input_once_its_id_and_name_are_known() -> None:
    """Input deltas are held until the call has an id and a name, then sent at once."""
    parts = ui_parts([FIRST.read_bytes()[i : i + 3] for i in range(0, len(FIRST.read_bytes()), 3)])
    for call in parse(FIRST.read_bytes()).turn(0).tool_calls:
        mine = [p for p in parts if p.get("toolCallId") == call.id]
        assert next(p["type"] for p in mine) == "tool-input-start"
        assert mine[0]["toolName"] == call.name
        assert "".join(p["inputTextDelta"] for p in mine if p["type"] == "tool-input-delta") == (
            call.arguments
        )
        assert mine[-1]["type"] == "tool-input-available"


def test_starlette_serves_the_stream_with_the_protocols_header(tmp_path: Path) -> None:
    require_framework("starlette", "proxy")
    require_framework("httpx", "proxy")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Route
    from starlette.testclient import TestClient

    data = FIRST.read_bytes()

    async def provider() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 50):
            await asyncio.sleep(0)
            yield data[start : start + 50]

    async def chat(request: Request) -> Any:
        return ui_message_response(ui_message_stream(provider(), message_id="msg-1"))

    app = Starlette(routes=[Route("/api/chat", chat, methods=["POST"])])
    with TestClient(app) as client:
        response = client.post("/api/chat", json={"messages": []})
    assert response.status_code == 200
    for name, value in UI_MESSAGE_STREAM_HEADERS.items():
        assert response.headers[name].startswith(value)
    assert response.content == _frame(ui_parts(data, message_id="msg-1"))
    checked = _check({"served": response.content}, tmp_path)["served"]
    _assert_accepted("served", checked, ui_parts(data, message_id="msg-1"))
    assert checked["message"]["id"] == "msg-1"


def test_an_upstream_that_fails_ends_the_message_with_error_and_abort() -> None:
    data = FIRST.read_bytes()

    async def provider() -> AsyncIterator[bytes]:
        yield data[: len(data) // 2]
        raise ConnectionResetError("the provider hung up")

    async def collect() -> bytes:
        return b"".join([piece async for piece in ui_message_stream(provider())])

    body = asyncio.run(collect())
    parts = [json.loads(e[6:]) for e in body.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert body.endswith(DONE)
    kinds = [p["type"] for p in parts]
    assert kinds[-4:] == ["error", "tool-input-error", "tool-input-error", "abort"]
    assert "the provider hung up" in next(p for p in parts if p["type"] == "error")["errorText"]


def test_the_guides_server_loop_is_a_message_the_sdk_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/examples/vercel_ui_stream.py's endpoint, against the replay server: the two steps
    (the calls and their outputs, then the answer) as the ``ai`` package reads them."""
    import importlib.util

    require_framework("starlette", "proxy")
    require_framework("openai", "openai")
    from starlette.testclient import TestClient

    from fsm.replay import ReplayServer, demo_script
    from tests.helpers import REPO

    with ReplayServer(demo_script(["6912", "408"])) as provider:
        monkeypatch.setenv("OPENAI_BASE_URL", provider.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "test")
        path = REPO / "docs" / "examples" / "vercel_ui_stream.py"
        spec = importlib.util.spec_from_file_location("vercel_ui_stream_example", path)
        assert spec is not None and spec.loader is not None
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        question = {"role": "user", "parts": [{"type": "text", "text": "1234 + 5678, 12 x 34?"}]}
        with TestClient(example.app) as client:
            response = client.post("/api/chat", json={"messages": [question]})
    assert provider.failures == [] and len(provider.requests) == 2
    assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
    checked = _check({"loop": response.content}, tmp_path)["loop"]
    assert checked["framing"] == [] and checked["invalid"] == [] and checked["errors"] == []
    parts = checked["message"]["parts"]
    tools = [(p["type"], p["state"], p["output"]) for p in parts if p["type"].startswith("tool-")]
    assert tools == [
        ("tool-add", "output-available", 6912),
        ("tool-multiply", "output-available", 408),
    ]
    answer = "".join(p["text"] for p in parts if p["type"] == "text")
    assert parse(FINAL.read_bytes()).turn(0).content in answer
