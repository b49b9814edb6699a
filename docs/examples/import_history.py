"""Existing histories into fsm: ``store.import_history`` takes a whole conversation at once, in
the format your code already keeps it (Chat Completions messages, or Anthropic messages here;
Responses input items with ``format="responses"``), all or nothing, after the same contract
checks the database enforces. What went in reads back equal through ``history()`` in the same
format.

No server needed; the store is a SQLite file in a temporary directory. ``python
import_history.py``
"""

import tempfile
from pathlib import Path

from fsm.store import ConversationStore, ResultsError

chat = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
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
    {"role": "tool", "tool_call_id": "call_add_1", "content": "6912"},  # one result per call,
    {"role": "tool", "tool_call_id": "call_mul_2", "content": "408"},  # in call order
    {"role": "assistant", "content": "6912 and 408."},
]

anthropic = [
    {"role": "user", "content": "What is 1234 + 5678?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Adding them."},
            {"type": "tool_use", "id": "toolu_01", "name": "add", "input": {"a": 1234, "b": 5678}},
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "6912"}],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "6912."}]},
]

with tempfile.TemporaryDirectory() as folder:
    store = ConversationStore(f"sqlite:///{Path(folder) / 'chat.db'}")

    chat_id = store.create_conversation()
    store.import_history(chat_id, chat)  # one transaction: all of it, or nothing
    assert store.history(chat_id) == chat

    claude_id = store.create_conversation()
    store.import_history(claude_id, anthropic, format="anthropic")
    assert store.history(claude_id, format="anthropic") == anthropic

    broken = store.create_conversation()
    try:  # a call with no result breaks the contract: refused, nothing written
        store.import_history(broken, chat[:4])
    except ResultsError as exc:
        print("refused:", exc)
    assert store.history(broken) == []

    print(len(store.history(chat_id)), "chat messages and", end=" ")
    print(len(store.history(claude_id, format="anthropic")), "Anthropic messages read back equal")
    store.close()
