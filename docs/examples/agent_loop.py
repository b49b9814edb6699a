"""fsm in an agent: the official openai client, a local tool, every turn stored.

Offline: run ``fsm replay`` in another terminal and paste the ``export`` lines it prints into
this one (they set ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``); then ``python agent_loop.py``.
Against the real API, set ``OPENAI_API_KEY`` alone.
"""

from openai import OpenAI

from fsm.agent import ToolExecuted, run_agent_loop
from fsm.store import ConversationStore


def add(a: int, b: int) -> int:
    """Add two integers."""  # the tool's schema comes from the signature and docstring
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def show(event: object) -> None:
    if isinstance(event, ToolExecuted):
        print(f"ran {event.name}({event.arguments}) -> {event.content}")


with ConversationStore("chat.db") as store:  # a SQLite file, created with its schema
    result = run_agent_loop(
        OpenAI(),  # reads OPENAI_BASE_URL and OPENAI_API_KEY
        store,
        store.create_conversation(),
        {"add": add, "multiply": multiply},
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}],
        on_event=show,  # every event, as it happens
    )
    print(result.status, result.content)  # completed, and the answer: 6912 and 408
    for message in store.history(result.conversation_id):  # what the next request sends
        print(message["role"], message.get("content"), message.get("tool_calls", ""))
