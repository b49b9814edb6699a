"""Call ids and inputs as the Anthropic API takes them: ids that break its pattern (Kimi K2's
``functions.add:0``, ``""``, an id used twice) are sent as ``fsmid_<base64url>``, reversibly,
and an input that is not an object as ``{"value": ...}``. Stored ids never change.

Offline, no server needed: ``python anthropic_ids.py``.
"""

from fsm.formats.ids import anthropic_id, anthropic_input, anthropic_safe, original_id

print(anthropic_id("functions.add:0"))  # fsmid_ZnVuY3Rpb25zLmFkZDow
print(anthropic_id("functions.add:0", use=2))  # fsmid2_ZnVuY3Rpb25zLmFkZDow (its second use)
print(original_id("fsmid2_ZnVuY3Rpb25zLmFkZDow"))  # functions.add:0
print(original_id("toolu_01A"))  # toolu_01A (not encoded)
print(anthropic_input([1, 2]))  # {'value': [1, 2]}

# messages you built yourself, made what the API takes (tool_use and tool_result still match)
messages = [
    {"role": "user", "content": "What is 1 + 2?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "functions.add:0", "name": "add", "input": [1, 2]}],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "functions.add:0", "content": "3"}],
    },
]
safe = anthropic_safe(messages)
print(safe[1]["content"][0])  # id fsmid_ZnVuY3Rpb25zLmFkZDow, input {'value': [1, 2]}
print(safe[2]["content"][0]["tool_use_id"])  # the same fsmid_ id
