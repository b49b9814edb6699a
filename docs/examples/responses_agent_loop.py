"""The agent loop over the OpenAI Responses API (``client.responses``): the reasoning item
with its ``encrypted_content`` goes back verbatim with the tool results.

Offline: run ``fsm replay --format responses`` in another terminal and paste the ``export``
lines it prints into this one; then ``python responses_agent_loop.py``.
"""

from openai import OpenAI

from fsm.agent import run_agent_loop
from fsm.store import ConversationStore


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


with ConversationStore("chat.db") as store:
    conversation = store.create_conversation()
    result = run_agent_loop(
        OpenAI(max_retries=0),
        store,
        conversation,
        {"add": add, "multiply": multiply},
        model="gpt-5-mini",
        messages=[{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}],
        format="responses",
    )
    print(result.status, result.content)
    items = store.history(conversation, format="responses")  # the next request's input
    print([item.get("type", item.get("role")) for item in items])
