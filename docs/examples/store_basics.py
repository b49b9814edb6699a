"""The conversation store on its own: commit a complete turn with its tool results in one
transaction, record an incomplete one for audit, and read the history back.

No server needed: the turn is read from one of fsm's recorded streams. ``python
store_basics.py``
"""

import json

from fsm import parse
from fsm.replay import EXAMPLES_DIR
from fsm.store import ConversationStore


def run_tool(name: str, arguments: str) -> str:
    values = json.loads(arguments)
    return str(values["a"] + values["b"] if name == "add" else values["a"] * values["b"])


store = ConversationStore()  # ./fsm.db (or $FSM_DB_URL / $FSM_DB); a new file gets the schema
conversation = store.create_conversation()  # a new random id at each run
store.append(conversation, [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}])

result = parse(EXAMPLES_DIR / "parallel_add_multiply.sse")  # or a live StreamParser
turn = result.turns[0]
if turn.complete:
    results = [run_tool(call.name, call.arguments) for call in turn.tool_calls]
    store.commit_turn(conversation, turn, results)  # assistant message + results, one transaction
else:
    store.record_attempt(conversation, result)  # for audit; never part of history

cut = parse(EXAMPLES_DIR / "cut_off_call.sse")  # a turn cut off mid-call (finish_reason length)
store.record_attempt(conversation, cut)  # kept for audit, never part of history

messages = store.history(conversation)  # the OpenAI messages list, ready to send back
print(json.dumps(messages, indent=2))
print(len(store.attempts(conversation)), "attempt recorded")
store.close()
