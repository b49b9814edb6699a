"""Your own loop around the openai SDK: fsm reads the raw bytes of the streamed response, you
decide what to run and when to commit.

Offline: run ``fsm replay`` in another terminal and paste the ``export`` lines it prints into
this one; then ``python own_loop.py``.
"""

import json

from openai import OpenAI

from fsm import ToolCallOpened
from fsm.agent import function_tool
from fsm.clients import iter_openai_events
from fsm.store import ConversationStore


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = {"add": add, "multiply": multiply}
client = OpenAI()
store = ConversationStore("chat.db")
conversation = store.create_conversation()
store.append(conversation, [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}])

with client.chat.completions.with_streaming_response.create(
    model="gpt-4o-mini",
    messages=store.history(conversation),  # list[fsm.types.Message]: the SDK's own shapes
    tools=[function_tool(f) for f in TOOLS.values()],
    stream=True,
) as response:
    events = iter_openai_events(response)  # the raw bytes: [DONE] and event names included
    for event in events:
        if isinstance(event, ToolCallOpened):
            print("calling", event.name)
result = events.result()
turn = result.turns[0]
if turn.complete:
    results = [str(TOOLS[c.name](**json.loads(c.arguments))) for c in turn.tool_calls]
    store.commit_turn(conversation, turn, results)
else:
    store.record_attempt(conversation, result)
print(store.history(conversation)[-2:])
store.close()
