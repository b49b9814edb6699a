"""One history, three APIs: a turn parsed from an Anthropic Messages stream, committed like any
other, read back for Anthropic, the Responses API and Chat Completions.

No server needed. ``python formats_history.py``
"""

from fsm.parser import StreamParser
from fsm.replay import EXAMPLES_DIR
from fsm.store import ConversationStore

parser = StreamParser(format="anthropic")  # or "auto": detected from the first event
parser.receive_data((EXAMPLES_DIR / "anthropic_add_multiply.sse").read_bytes())
parser.receive_eof()
turn = parser.result().turns[0]

store = ConversationStore("sqlite:///formats.db", auto_upgrade=True)
conversation = store.create_conversation()
store.append(conversation, [{"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}])
store.commit_turn(conversation, turn, ["6912", "408"])

claude = store.history(conversation, format="anthropic")  # thinking signature kept verbatim
assert claude[1:] == turn.to_anthropic(["6912", "408"])
openai_input = store.history(conversation, format="responses")  # no thinking: provider-bound
chat = store.history(conversation)  # the same calls and results as Chat Completions messages
print([item.get("type", item.get("role")) for item in openai_input])
print([message["role"] for message in chat])
store.close()
