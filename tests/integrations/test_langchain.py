"""Issue 30, item 3: :class:`fsm.integrations.langchain.FsmChatMessageHistory`, LangChain's
``BaseChatMessageHistory`` over fsm's store, run by LangChain's own ``RunnableWithMessageHistory``
around langchain-core's fake chat model, on SQLite and PostgreSQL: two user turns with a tool
call each, the second seeing the first, ``fsm audit check`` clean; a call without a result held
out of what is sent back; the contract errors typed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from fsm.cli.main import cli
from fsm.errors import IncompleteTurnError
from fsm.store import ConversationStore, ResultsError
from tests.helpers import child_json, require_framework

CID = "lc-session-1"


@pytest.fixture(autouse=True)
def _langchain() -> None:
    require_framework("langchain_core", "langchain")


def _history(store: ConversationStore, cid: str = CID) -> Any:
    from fsm.integrations.langchain import FsmChatMessageHistory

    return FsmChatMessageHistory(store, cid)


def _call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "name": name, "args": args, "type": "tool_call"}


def _audit_clean(url: sa.URL) -> None:
    text = url.render_as_string(hide_password=False)
    result = CliRunner().invoke(cli, ["audit", "check", "--db", text, "--nl"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == ""


TOOLS = {
    "get_weather": lambda args: {"Paris": "22C", "Tokyo": "10C"}[args["city"]],
    "add": lambda args: str(args["a"] + args["b"]),
}


@pytest.mark.filterwarnings("ignore:RunnableWithMessageHistory is deprecated")
def test_two_turns_with_tool_calls_through_runnable_with_message_history(
    store: ConversationStore, db_url: sa.URL
) -> None:
    from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
    from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
    from langchain_core.runnables import RunnableLambda
    from langchain_core.runnables.history import RunnableWithMessageHistory

    # the provider's own argument string (spacing, escape) rides along in additional_kwargs,
    # as LangChain's OpenAI-compatible integrations keep it
    raw = '{"city":  "Paris", "note": "caf\\u00e9"}'
    first_call = AIMessage(
        content="",
        tool_calls=[_call("call_w1", "get_weather", {"city": "Paris", "note": "café"})],
        additional_kwargs={
            "tool_calls": [
                {
                    "id": "call_w1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": raw},
                }
            ]
        },
        response_metadata={"model_name": "fake-model", "finish_reason": "tool_calls"},
        id="run-1",
    )
    second_calls = AIMessage(
        content="Let me add those.",
        tool_calls=[
            _call("call_a1", "add", {"a": 22, "b": 10}),
            _call("call_a2", "add", {"a": 1, "b": 2}),
        ],
        id="run-3",
    )
    model = FakeMessagesListChatModel(
        responses=[
            first_call,
            AIMessage(content="It is 22C in Paris.", id="run-2"),
            second_calls,
            AIMessage(content="32, and 3.", id="run-4"),
        ]
    )
    seen: list[list[BaseMessage]] = []

    def agent(messages: list[BaseMessage]) -> list[BaseMessage]:
        """A tool loop: the model, its calls run, the model again, until it answers."""
        messages = list(messages)
        new: list[BaseMessage] = []
        while True:
            seen.append(list(messages))
            reply = model.invoke(messages)
            assert isinstance(reply, AIMessage)
            new.append(reply)
            messages.append(reply)
            if not reply.tool_calls:
                return new
            for call in reply.tool_calls:
                result = ToolMessage(
                    content=TOOLS[call["name"]](call["args"]), tool_call_id=call["id"]
                )
                new.append(result)
                messages.append(result)

    histories = {CID: _history(store)}
    chain = RunnableWithMessageHistory(RunnableLambda(agent), lambda sid: histories[sid])
    config = {"configurable": {"session_id": CID}}

    chain.invoke([HumanMessage(content="Weather in Paris?")], config=config)
    chain.invoke([HumanMessage(content="Add 22 and 10, and 1 and 2.")], config=config)

    # the second user turn's first model call saw the whole first turn, from fsm's store
    second_turn_input = seen[2]
    assert [type(m).__name__ for m in second_turn_input] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
        "HumanMessage",
    ]
    assert second_turn_input[1].tool_calls == [
        _call("call_w1", "get_weather", {"city": "Paris", "note": "café"})
    ]
    assert second_turn_input[2].content == "22C"
    # the provider's argument bytes were kept (they decode to the same args)
    assert second_turn_input[1].additional_kwargs["tool_calls"][0]["function"]["arguments"] == raw

    stored = store.history(CID)
    assert [m["role"] for m in stored] == [
        "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "tool", "assistant",
    ]  # fmt: skip
    assert stored[1]["tool_calls"][0]["function"]["arguments"] == raw
    # without the provider's string LangChain's dict is all there is: json.dumps of it
    assert [c["function"]["arguments"] for c in stored[5]["tool_calls"]] == [
        json.dumps({"a": 22, "b": 10}),
        json.dumps({"a": 1, "b": 2}),
    ]
    assert [m["content"] for m in stored[6:8]] == ["32", "3"]
    # what LangChain reads back is what it wrote (types, tool calls, results)
    back = histories[CID].messages
    assert [(type(m).__name__, m.content) for m in back][-3:] == [
        ("ToolMessage", "32"),
        ("ToolMessage", "3"),
        ("AIMessage", "32, and 3."),
    ]
    assert back[5].tool_calls == second_calls.tool_calls
    _audit_clean(db_url)


def test_a_call_without_its_result_is_held_out_until_the_result_comes(
    store: ConversationStore, db_url: sa.URL
) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    history = _history(store)
    ask = AIMessage(content="", tool_calls=[_call("call_1", "add", {"a": 1, "b": 2})], id="r1")
    history.add_messages([HumanMessage(content="1+2?"), ask])
    # pending in fsm's ledger: not part of what goes back to a model
    assert [type(m).__name__ for m in history.messages] == ["HumanMessage"]
    assert history.pending_message.tool_calls == ask.tool_calls
    # a later history object (LangChain makes one per call) completes it with the result
    later = _history(store)
    later.add_messages([ToolMessage(content="3", tool_call_id="call_1"), AIMessage(content="3")])
    assert [type(m).__name__ for m in later.messages] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
    ]
    assert later.pending_message is None
    _audit_clean(db_url)


def test_a_new_message_instead_of_the_results_gives_the_call_up(store: ConversationStore) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    history = _history(store)
    ask = AIMessage(content="", tool_calls=[_call("call_1", "add", {"a": 1, "b": 2})], id="r1")
    history.add_messages([HumanMessage(content="1+2?"), ask])
    history.add_messages([HumanMessage(content="never mind")])
    assert [m.content for m in history.messages] == ["1+2?", "never mind"]
    assert history.pending_message is None
    assert store.pending(CID) is None


def test_the_contract_errors_are_typed_and_nothing_is_written(store: ConversationStore) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    history = _history(store)
    ask = AIMessage(content="", tool_calls=[_call("call_1", "add", {"a": 1, "b": 2})])
    # a result for another call, in one batch: the store's ResultsError, nothing written
    with pytest.raises(ResultsError):
        history.add_messages(
            [HumanMessage(content="1+2?"), ask, ToolMessage(content="3", tool_call_id="call_9")]
        )
    assert history.messages == []
    # a result for no pending call, in a later batch
    history.add_messages([HumanMessage(content="1+2?"), ask])
    with pytest.raises(ResultsError, match="call_9"):
        history.add_messages([ToolMessage(content="3", tool_call_id="call_9")])
    assert history.pending_message is not None
    # a call whose arguments LangChain could not parse never becomes executable history
    bad = AIMessage(
        content="",
        invalid_tool_calls=[
            {
                "id": "call_2",
                "name": "add",
                "args": '{"a": 1,',
                "error": "bad",
                "type": "invalid_tool_call",
            }
        ],
    )
    other = _history(store, "lc-other")
    with pytest.raises(IncompleteTurnError):
        other.add_messages([HumanMessage(content="?"), bad])
    assert other.messages == []  # nothing of the batch written
    assert [a["tool_calls"][0]["raw_arguments"] for a in store.attempts("lc-other")] == ['{"a": 1,']


def test_clear_deletes_the_conversation_and_a_store_without_delete_says_so(
    store: ConversationStore,
) -> None:
    from langchain_core.messages import HumanMessage

    from fsm.integrations.langchain import FsmChatMessageHistory, HistoryOperationError

    history = _history(store)
    history.add_messages([HumanMessage(content="hi")])
    history.clear()
    assert history.messages == []
    assert store.list_conversations() == []

    class NoDelete:
        pass

    with pytest.raises(HistoryOperationError, match="cannot delete a conversation"):
        FsmChatMessageHistory(NoDelete(), CID).clear()  # type: ignore[arg-type]


def test_the_module_imports_without_langchain_and_names_the_extra() -> None:
    """``import fsm.integrations.langchain`` works without langchain-core (blocked in a child
    Python); using the history then is an ImportError naming the extra."""
    code = (
        "import json, sys\n"
        "sys.modules['langchain_core'] = None\n"
        "import fsm.integrations.langchain as lc\n"
        "try:\n"
        "    lc.FsmChatMessageHistory\n"
        "except ImportError as exc:\n"
        "    print(json.dumps(str(exc)))\n"
    )
    message = child_json(code, timeout=60)
    assert "pip install 'fsm-toolcalls[langchain]'" in message


def test_results_over_several_batches_an_error_result_and_the_async_methods(
    store: ConversationStore, db_url: sa.URL
) -> None:
    """Two calls answered in two batches (the turn stays pending until both have come), one
    result a tool's error (``status="error"``), a system message; LangChain's async methods
    run the same code."""
    import asyncio

    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    history = _history(store)
    ask = AIMessage(
        content="",
        tool_calls=[_call("c1", "add", {"a": 1, "b": 2}), _call("c2", "div", {"a": 1, "b": 0})],
        id="r1",
    )
    asyncio.run(
        history.aadd_messages([SystemMessage(content="Be brief."), HumanMessage(content="?"), ask])
    )
    history.add_messages([ToolMessage(content="3", tool_call_id="c1")])
    assert history.pending_message is not None  # c2 has no result yet
    assert [type(m).__name__ for m in history.messages] == ["SystemMessage", "HumanMessage"]
    history.add_messages(
        [
            ToolMessage(content="division by zero", tool_call_id="c2", status="error"),
            AIMessage(content="3, and 1/0 is undefined."),
        ]
    )
    back = asyncio.run(history.aget_messages())
    assert [(type(m).__name__, m.content) for m in back] == [
        ("SystemMessage", "Be brief."),
        ("HumanMessage", "?"),
        ("AIMessage", ""),
        ("ToolMessage", "3"),
        ("ToolMessage", "division by zero"),
        ("AIMessage", "3, and 1/0 is undefined."),
    ]
    assert back[2].tool_calls == ask.tool_calls
    _audit_clean(db_url)


def test_a_provider_string_that_disagrees_with_args_is_not_trusted(
    store: ConversationStore,
) -> None:
    """``additional_kwargs`` may be stale (a message edited after the model sent it): its string
    is kept only when it decodes to the same ``args``; else ``json.dumps(args)``."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    stale = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":9}'}}
    ask = AIMessage(
        content="",
        tool_calls=[_call("c1", "add", {"a": 1})],
        additional_kwargs={"tool_calls": [stale]},
    )
    _history(store).add_messages(
        [HumanMessage(content="?"), ask, ToolMessage(content="1", tool_call_id="c1")]
    )
    call = store.history(CID)[1]["tool_calls"][0]
    assert call == {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
