"""A non-streamed response (``create()`` without ``stream=True``) goes through the same rules as a
stream: ``fsm.parse_completion`` turns it into a ``ParseResult``, and a complete turn is committed
with its tool results, like a streamed one.

No server needed: the ``chat.completion`` is built here, as the API returns it (with the SDK,
pass the ``ChatCompletion`` object itself, or its JSON text). The store is a SQLite file in a
temporary directory. ``python completion_commit.py``
"""

import json
import tempfile
from pathlib import Path

import fsm
from fsm.store import ConversationStore

completion = {
    "id": "chatcmpl-123",
    "object": "chat.completion",
    "created": 1764720000,
    "model": "gpt-4o-mini",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [  # no "index" here: a call's position is its place in the list
                    {
                        "id": "call_add_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1234, "b": 5678}'},
                    },
                    {
                        "id": "call_mul_2",
                        "type": "function",
                        "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'},
                    },
                ],
            },
        }
    ],
}


def run_tool(call: fsm.ToolCall) -> str:
    values = json.loads(call.arguments)
    return str(values["a"] + values["b"] if call.name == "add" else values["a"] * values["b"])


with tempfile.TemporaryDirectory() as folder:
    store = ConversationStore(f"sqlite:///{Path(folder) / 'chat.db'}")
    conversation = store.create_conversation()
    store.append(conversation, [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}])

    result = fsm.parse_completion(completion)  # a dict, its JSON text, or the SDK's object
    turn = result.turns[0]
    if turn.complete:  # every call finished: its arguments are JSON, the turn ended normally
        store.commit_turn(conversation, turn, [run_tool(call) for call in turn.tool_calls])
    else:
        store.record_attempt(conversation, result)  # for audit; never executed

    print(json.dumps(store.history(conversation), indent=2))
    store.close()
