"""pydantic-ai's ConversationStore over fsm (fsm.integrations.pydantic_ai), run with a real
``pydantic_ai.Agent`` whose OpenAI model talks to fsm's ReplayServer over HTTP, on both engines.

The replay server checks every request after a tool call: the assistant message must carry the
streamed calls byte for byte, each followed by its result. The recordings' arguments are compact
JSON because pydantic-ai re-serializes the arguments it sends (``{"a": 1}`` goes out as
``{"a":1}``); what fsm stores is what pydantic-ai holds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.replay import ReplayServer, ReplayTurn
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from tests.helpers import require_framework

pydantic_ai = require_framework("pydantic_ai", "pydantic-ai")

from pydantic_ai import Agent, CallDeferred, DeferredToolRequests, DeferredToolResults  # noqa: E402
from pydantic_ai.conversation import Conversation  # noqa: E402
from pydantic_ai.conversation_store import ConversationConflict  # noqa: E402
from pydantic_ai.exceptions import UserError  # noqa: E402
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

from fsm.integrations.pydantic_ai import (  # noqa: E402
    FsmConversationStore,
    HistoryRewriteError,
    RevisionConflictError,
    ScopeNotSupportedError,
)

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


def stream(response_id: str, *, text: str | None = None, call: tuple[str, ...] = ()) -> bytes:
    """A Chat Completions stream: optional text, then optional one call ``(id, name, args)``
    whose arguments arrive in pieces of 7 characters."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": 1764460800,
            "model": "demo-model-1",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(body)}\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    if text:
        out.append(chunk({"content": text}))
    if call:
        call_id, name, args = call
        start = {"index": 0, "id": call_id, "type": "function"}
        out.append(chunk({"tool_calls": [{**start, "function": {"name": name, "arguments": ""}}]}))
        for i in range(0, len(args), 7):
            piece = {"index": 0, "function": {"arguments": args[i : i + 7]}}
            out.append(chunk({"tool_calls": [piece]}))
    out.append(chunk({}, "tool_calls" if call else "stop"))
    out.append("data: [DONE]\n\n")
    return "".join(out).encode()


async def streamed(_ctx: Any, events: AsyncIterable[Any]) -> None:
    """An event handler: with one, ``agent.run`` streams (the replay server only streams)."""
    async for _event in events:
        pass


def adding_agent(server: ReplayServer) -> Agent[None, str]:
    provider = OpenAIProvider(base_url=server.base_url, api_key="test")
    agent = Agent(OpenAIChatModel("demo-model-1", provider=provider), instructions="Add.")

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        return a + b

    return agent


TWO_RUNS = [
    ReplayTurn(stream("r1", call=("call_1", "add", '{"a":1234,"b":5678}'))),
    ReplayTurn(stream("r2", text="1234 + 5678 = 6912."), expect_tool_results=["6912"]),
    ReplayTurn(stream("r3", text="Adding one.", call=("call_2", "add", '{"a":6912,"b":1}'))),
    ReplayTurn(stream("r4", text="6912 + 1 = 6913."), expect_tool_results=["6913"]),
]

#: the history fsm holds after both runs (Chat Completions messages)
HISTORY = [
    {"role": "user", "content": "What is 1234 + 5678?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a":1234,"b":5678}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "6912"},
    {"role": "assistant", "content": "1234 + 5678 = 6912."},
    {"role": "user", "content": "And plus one?"},
    {
        "role": "assistant",
        "content": "Adding one.",
        "tool_calls": [
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a":6912,"b":1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": "6913"},
    {"role": "assistant", "content": "6912 + 1 = 6913."},
]


@pytest.fixture
def url(db_url: sa.URL) -> str:
    return db_url.render_as_string(hide_password=False)


@pytest.fixture
def fsm_store(db_url: sa.URL) -> Iterator[ConversationStore]:
    with ConversationStore(db_url) as opened:
        yield opened


def audit_clean(url: str) -> None:
    result = CliRunner().invoke(cli, ["audit", "check", "--db", url, "--json"])
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads(result.stdout) == []


async def two_runs(store: FsmConversationStore, server: ReplayServer) -> list[str]:
    agent = adding_agent(server)
    conversation = await store.load("conv-1") or Conversation(conversation_id="conv-1")
    first = await agent.run(
        "What is 1234 + 5678?", conversation=conversation, event_stream_handler=streamed
    )
    saved = await store.save(first)
    assert first.conversation.revision == "seq:4"  # the result continues from what was saved
    assert [e.id for e in saved] == ["conv-1@1", "conv-1@2", "conv-1@3", "conv-1@4"]
    # a new process would do the same: load what fsm holds, run, save
    loaded = await store.load("conv-1")
    assert loaded is not None and loaded.revision == "seq:4"
    second = await agent.run("And plus one?", conversation=loaded, event_stream_handler=streamed)
    await store.save(second)
    return [first.output, second.output]


def test_two_runs_with_a_tool_call_the_second_seeing_the_first(
    fsm_store: ConversationStore, url: str
) -> None:
    with ReplayServer(TWO_RUNS) as server:
        outputs = run(two_runs(FsmConversationStore(fsm_store), server))
    assert outputs == ["1234 + 5678 = 6912.", "6912 + 1 = 6913."]
    assert server.failures == []  # each call went back byte for byte, with its result
    # the second run's first request carried the first run's history, as fsm stored it
    sent = server.requests[2]["messages"]
    assert sent[0] == {"role": "system", "content": "Add."}
    assert [{k: v for k, v in m.items() if v is not None} for m in sent[1:]] == [
        {k: v for k, v in m.items() if v is not None} for m in HISTORY[:5]
    ]
    assert fsm_store.history("conv-1") == HISTORY
    calls = fsm_store.attempts("conv-1")
    assert calls == []  # nothing failed
    audit_clean(url)


def test_the_same_on_the_asyncio_store(url: str, fsm_store: ConversationStore) -> None:
    async def body() -> None:
        async with AsyncConversationStore(url) as store:
            with ReplayServer(TWO_RUNS) as server:
                await two_runs(FsmConversationStore(store), server)
            assert server.failures == []

    run(body())
    assert fsm_store.history("conv-1") == HISTORY
    audit_clean(url)


def test_a_stale_revision_is_a_conflict_and_writes_nothing(fsm_store: ConversationStore) -> None:
    async def body() -> None:
        store = FsmConversationStore(fsm_store)
        with ReplayServer(TWO_RUNS[:2]) as server:
            agent = adding_agent(server)
            first = await agent.run(
                "What is 1234 + 5678?",
                conversation=Conversation(conversation_id="conv-1"),
                event_stream_handler=streamed,
            )
        await store.save(first)
        mine = await store.load("conv-1")
        theirs = await store.load("conv-1")
        assert mine is not None and theirs is not None
        theirs.messages.append(ModelRequest.user_text_prompt("theirs"))
        await store.save(theirs)
        mine.messages.append(ModelRequest.user_text_prompt("mine"))
        with pytest.raises(RevisionConflictError) as caught:
            await store.save(mine)
        assert isinstance(caught.value, ConversationConflict)  # what pydantic-ai users catch
        assert caught.value.expected_revision == "seq:4"
        assert caught.value.actual_revision == "seq:5"
        assert "load it again and retry" in str(caught.value)
        # a conversation saved as new while one with its id exists is one too
        with pytest.raises(RevisionConflictError):
            await store.save(Conversation(conversation_id="conv-1", messages=mine.messages))

    run(body())
    assert [m["content"] for m in fsm_store.history("conv-1")][-2:] == [
        "1234 + 5678 = 6912.",
        "theirs",
    ]


def test_a_call_without_its_return_stays_pending_until_answered(
    fsm_store: ConversationStore, url: str
) -> None:
    script = [
        ReplayTurn(
            stream("r1", text="Asking the warehouse.", call=("call_w", "stock", '{"sku":"A-7"}'))
        ),
        ReplayTurn(stream("r2", text="12 in stock."), expect_tool_results=["12"]),
    ]

    async def body() -> None:
        store = FsmConversationStore(fsm_store)
        with ReplayServer(script) as server:
            provider = OpenAIProvider(base_url=server.base_url, api_key="test")
            agent = Agent(
                OpenAIChatModel("demo-model-1", provider=provider),
                output_type=[str, DeferredToolRequests],
            )

            @agent.tool_plain
            def stock(sku: str) -> int:
                raise CallDeferred  # answered by another system, later

            first = await agent.run(
                "How many A-7?",
                conversation=Conversation(conversation_id="conv-d"),
                event_stream_handler=streamed,
            )
            assert isinstance(first.output, DeferredToolRequests)
            await store.save(first)
            # the unanswered call is pending in fsm's ledger, not in history
            assert fsm_store.history("conv-d") == [{"role": "user", "content": "How many A-7?"}]
            pending = fsm_store.pending("conv-d")
            assert pending is not None and [c.id for c in pending.calls] == ["call_w"]
            assert pending.response_id is not None and pending.response_id.startswith("r1")
            loaded = await store.load("conv-d")
            assert loaded is not None and loaded.revision == f"seq:1+p{pending.id}"
            last = loaded.messages[-1]
            assert isinstance(last, ModelResponse) and last.tool_calls == [
                ToolCallPart(tool_name="stock", args='{"sku":"A-7"}', tool_call_id="call_w")
            ]
            assert loaded.deferred_tool_requests is not None
            assert [c.tool_call_id for c in loaded.deferred_tool_requests.calls] == ["call_w"]
            # pydantic-ai itself will not go on without the answer
            with pytest.raises(UserError, match="unprocessed tool calls"):
                await agent.run("Never mind", conversation=loaded, event_stream_handler=streamed)
            second = await agent.run(
                conversation=loaded,
                deferred_tool_results=DeferredToolResults(calls={"call_w": 12}),
                event_stream_handler=streamed,
            )
            assert second.output == "12 in stock."
            await store.save(second)
            assert server.failures == []

    run(body())
    assert fsm_store.pending("conv-d") is None
    history = fsm_store.history("conv-d")
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[2] == {"role": "tool", "tool_call_id": "call_w", "content": "12"}
    audit_clean(url)


def test_what_fsm_cannot_do_is_a_typed_error(fsm_store: ConversationStore) -> None:
    async def body() -> None:
        store = FsmConversationStore(fsm_store)
        with ReplayServer(TWO_RUNS[:2]) as server:
            first = await adding_agent(server).run(
                "What is 1234 + 5678?",
                conversation=Conversation(conversation_id="conv-1"),
                event_stream_handler=streamed,
            )
        await store.save(first)
        with pytest.raises(HistoryRewriteError, match="only grows"):
            await store.branch("conv-1", at=1, expected_revision="seq:4")
        # a serialized copy (no new_message_index) whose earlier messages differ
        loaded = await store.load("conv-1")
        assert loaded is not None
        edited = Conversation(
            conversation_id="conv-1",
            messages=[ModelRequest.user_text_prompt("something else"), *loaded.messages[1:]],
            revision=loaded.revision,
        )
        with pytest.raises(HistoryRewriteError, match="only grows"):
            await store.save(edited)
        # the same copy unchanged but one message longer is appended
        extended = Conversation(
            conversation_id="conv-1",
            messages=[*loaded.messages, ModelRequest.user_text_prompt("more")],
            revision=loaded.revision,
        )
        assert [e.id for e in await store.save(extended)] == ["conv-1@5"]
        with pytest.raises(ScopeNotSupportedError, match="no scopes"):
            await store.load("conv-1", scope="alice")
        # fork copies: a new conversation with the first four messages
        forked = await store.fork("conv-1", at=4, new_conversation_id="conv-2")
        assert forked.revision == "seq:4" and len(forked.messages) == 4
        # a fork that keeps a call but not its return keeps the call pending
        cut = await store.fork("conv-1", at=2, new_conversation_id="conv-3")
        assert cut.revision is not None and cut.revision.startswith("seq:1+p")
        assert cut.deferred_tool_requests is not None
        listed = [r.conversation_id for r in await store.list_conversations()]
        assert sorted(listed) == ["conv-1", "conv-2", "conv-3"]
        # pydantic-ai's own load_entries / delete, over the primitives
        entries = await store.load_entries("conv-1", limit=2)
        assert entries is not None and [e.id for e in entries] == ["conv-1@4", "conv-1@5"]
        assert entries[1].parent_id == "conv-1@4"
        assert (await store.read_entry("conv-1@2")).message.parts == loaded.messages[1].parts
        with pytest.raises(LookupError):
            await store.read_entry("conv-1@3000")
        assert [m["role"] for m in fsm_store.history("conv-3")] == ["user"]
        await store.delete("conv-3")
        assert await store.load("conv-3") is None

    run(body())
    assert fsm_store.history("conv-2") == fsm_store.history("conv-1")[:4]
    assert fsm_store.history("conv-1")[-1] == {"role": "user", "content": "more"}


def test_each_kind_of_part_maps_to_chat_and_back(fsm_store: ConversationStore, url: str) -> None:
    """What the mapping keeps (system, user text and image URLs, text, calls, returns, retry
    feedback as the text the model is sent) and what it drops (thinking)."""
    from pydantic_ai.messages import (
        BinaryContent,
        FilePart,
        ImageUrl,
        RetryFeedbackPart,
        RetryInfo,
        SystemPromptPart,
        TextPart,
        ThinkingPart,
        ToolReturnPart,
        UserPromptPart,
    )

    from fsm.integrations.pydantic_ai import UnstorableMessageError

    feedback = RetryFeedbackPart(content="Answer in one word.", retry=RetryInfo("model_retry"))
    saved = [
        ModelRequest(
            parts=[
                SystemPromptPart("Be brief."),
                UserPromptPart(["Look:", ImageUrl("https://example.com/cat.png")]),
            ]
        ),
        ModelResponse(
            parts=[
                ThinkingPart("a cat, probably"),
                TextPart("A cat."),
                ToolCallPart("tag", {"label": "cat"}, "call_t"),
            ]
        ),
        ModelRequest(parts=[ToolReturnPart("tag", {"ok": True}, "call_t"), feedback]),
        ModelResponse(parts=[TextPart("Cat.")]),
    ]

    async def body() -> None:
        store = FsmConversationStore(fsm_store)
        entries = await store.save(Conversation(conversation_id="parts", messages=saved))
        assert [e.message for e in entries] == saved  # the entries hold what was saved
        loaded = await store.load("parts")
        assert loaded is not None
        request, response, results, last = loaded.messages
        assert isinstance(request, ModelRequest) and isinstance(results, ModelRequest)
        assert [type(p).__name__ for p in request.parts] == ["SystemPromptPart", "UserPromptPart"]
        assert request.parts[1].content == ["Look:", ImageUrl("https://example.com/cat.png")]
        assert isinstance(response, ModelResponse)
        assert response.parts == [
            TextPart("A cat."),  # the thinking is not kept
            ToolCallPart("tag", '{"label":"cat"}', "call_t"),
        ]
        tool_return, retry = results.parts
        assert isinstance(tool_return, ToolReturnPart) and tool_return.tool_name == "tag"
        assert tool_return.content == '{"ok":true}'  # the text the model saw
        assert isinstance(retry, UserPromptPart) and retry.content == feedback.model_response()
        assert isinstance(last, ModelResponse) and last.parts == [TextPart("Cat.")]
        # a part Chat Completions cannot hold: a typed error, nothing written
        loaded.messages.append(ModelRequest.user_text_prompt("Draw it."))
        loaded.messages.append(
            ModelResponse(parts=[FilePart(BinaryContent(data=b"\x89PNG", media_type="image/png"))])
        )
        with pytest.raises(UnstorableMessageError, match="message 5: a response's 'file' part"):
            await store.save(loaded)

    run(body())
    history = fsm_store.history("parts")
    assert len(history) == 6 and history[-1] == {"role": "assistant", "content": "Cat."}
    assert history[1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        ],
    }
    audit_clean(url)


def test_two_saves_racing_from_one_revision_one_wins(fsm_store: ConversationStore) -> None:
    """Two requests load the same revision and save at once: fsm's expected seq lets one in;
    the other is a conflict, whichever check (the revision read first, or the write's expected
    seq) catches it, and the history holds exactly one of them."""

    async def body() -> list[str]:
        store = FsmConversationStore(fsm_store)
        await store.save(
            Conversation(conversation_id="race", messages=[ModelRequest.user_text_prompt("hi")])
        )
        copies = [await store.load("race") for _ in range(2)]
        for i, copy in enumerate(copies):
            assert copy is not None
            copy.messages.append(ModelResponse(parts=[TextPart(f"answer {i}")]))
        outcomes = await asyncio.gather(
            *(store.save(c) for c in copies if c is not None), return_exceptions=True
        )
        return [type(o).__name__ for o in outcomes]

    from pydantic_ai.messages import TextPart

    for _ in range(5):
        fsm_store.delete_conversation("race")
        outcomes = run(body())
        assert sorted(outcomes) == ["RevisionConflictError", "list"], outcomes
        history = fsm_store.history("race")
        assert len(history) == 2 and history[1]["content"] in ("answer 0", "answer 1")


def test_the_store_gets_what_pydantic_ai_parsed(fsm_store: ConversationStore) -> None:
    """The guide's note, pinned: on fsm's vLLM-style recording (call 1 repeats its name on every
    chunk) pydantic-ai holds a doubled name, which is what its store is given, while fsm.parse
    reads the same bytes right. If pydantic-ai fixes it, update docs/guides/pydantic-ai.md."""
    from fsm import parse
    from fsm.replay import EXAMPLES_DIR

    recording = (EXAMPLES_DIR / "parallel_add_multiply.sse").read_bytes()
    assert [c.name for c in parse(recording).turns[0].tool_calls] == ["add", "multiply"]
    script = [
        ReplayTurn(recording),
        ReplayTurn(EXAMPLES_DIR / "final_answer.sse", check=False),
    ]

    async def body() -> list[str]:
        with ReplayServer(script) as server:
            provider = OpenAIProvider(base_url=server.base_url, api_key="test")
            agent = Agent(OpenAIChatModel("demo-model-1", provider=provider))

            @agent.tool_plain
            def add(a: int, b: int) -> int:
                return a + b

            @agent.tool_plain
            def multiply(a: int, b: int) -> int:
                return a * b

            result = await agent.run(
                "1234 + 5678 and 12 * 34?",
                conversation=Conversation(conversation_id="vllm"),
                event_stream_handler=streamed,
            )
        await FsmConversationStore(fsm_store).save(result)
        response = result.all_messages()[1]
        assert isinstance(response, ModelResponse)
        return [c.tool_name for c in response.tool_calls]

    held = run(body())
    assert held == ["add", "multiply" * 5]
    stored = fsm_store.history("vllm")[1]["tool_calls"]
    assert [c["function"]["name"] for c in stored] == held
