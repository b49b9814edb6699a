"""An Anthropic Messages stream through the same parser: the format is detected, the thinking
block's signature is kept, and the turn renders back for Anthropic or the Responses API.

No server needed. ``python formats_parse.py``
"""

import json

from fsm import parse


def sse(*events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()


stream = sse(
    {"type": "message_start", "message": {"id": "msg_1", "model": "claude", "content": []}},
    {"type": "content_block_start", "index": 0,
     "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
    {"type": "content_block_delta", "index": 0,
     "delta": {"type": "thinking_delta", "thinking": "Add them."}},
    {"type": "content_block_delta", "index": 0,
     "delta": {"type": "signature_delta", "signature": "EqQB..."}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1,
     "content_block": {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}},
    {"type": "content_block_delta", "index": 1,
     "delta": {"type": "input_json_delta", "partial_json": '{"a": 2, "b": 3}'}},
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
    {"type": "message_stop"},
)  # fmt: skip
result = parse(stream)  # the format is detected: result.format == "anthropic"
turn = result.turn()
assert result.complete and turn.format == "anthropic"
(call,) = turn.tool_calls
messages = turn.to_anthropic(results={call.id: "5"})
assert messages[0]["content"][0]["signature"] == "EqQB..."  # sent back verbatim
assert messages[1]["content"] == [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]
items = turn.to_items(results={call.id: "5"})  # the same turn as Responses input items
assert [i["type"] for i in items] == ["function_call", "function_call_output"]
print(json.dumps(messages, indent=2))
