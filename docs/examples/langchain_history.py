"""LangChain's ``RunnableWithMessageHistory`` with fsm's store as its chat history:
``FsmChatMessageHistory(store, session_id)``. Each ``AIMessage`` with tool calls and its
``ToolMessage`` results go in as one fsm turn, all or nothing; the second question sees the first
one's whole exchange, read back from the store.

The model is langchain-core's own fake chat model (answers scripted here), so no server or key
is needed; the store is a SQLite file in a temporary directory. ``python langchain_history.py``
"""

import tempfile
from pathlib import Path

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.runnables.history import RunnableWithMessageHistory

from fsm.integrations.langchain import FsmChatMessageHistory
from fsm.store import ConversationStore

TOOLS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


def tool_call(cid: str, name: str, a: int, b: int) -> dict:
    return {"id": cid, "name": name, "args": {"a": a, "b": b}, "type": "tool_call"}


model = FakeMessagesListChatModel(
    responses=[
        AIMessage("", tool_calls=[tool_call("call_1", "add", 1234, 5678)]),
        AIMessage("1234 + 5678 = 6912."),
        AIMessage("", tool_calls=[tool_call("call_2", "multiply", 6912, 2)]),
        AIMessage("Twice that is 13824."),
    ]
)


def agent(messages: list[BaseMessage]) -> list[BaseMessage]:
    """The model, its tools, the model again, until it answers: the new messages."""
    new: list[BaseMessage] = []
    while True:
        reply = model.invoke(messages + new)
        new.append(reply)
        if not reply.tool_calls:
            return new
        for call in reply.tool_calls:
            output = TOOLS[call["name"]](**call["args"])
            new.append(ToolMessage(str(output), tool_call_id=call["id"]))


with tempfile.TemporaryDirectory() as folder:
    store = ConversationStore(f"sqlite:///{Path(folder) / 'chat.db'}")
    chain = RunnableWithMessageHistory(
        RunnableLambda(agent), lambda session_id: FsmChatMessageHistory(store, session_id)
    )
    config = {"configurable": {"session_id": "user-42"}}
    chain.invoke([HumanMessage("What is 1234 + 5678?")], config=config)
    chain.invoke([HumanMessage("And twice that?")], config=config)

    for message in FsmChatMessageHistory(store, "user-42").messages:
        calls = [
            f"{c['name']}({c['args']}) [{c['id']}]" for c in getattr(message, "tool_calls", [])
        ]
        print(f"{message.type:>5}:", " ".join([str(message.content), *calls]).strip())
    # what fsm stored: the arguments as LangChain re-serialized them (json.dumps of its dict)
    print(store.history("user-42")[1]["tool_calls"][0]["function"]["arguments"])
    store.close()
