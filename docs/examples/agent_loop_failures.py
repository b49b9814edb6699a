"""When a turn fails: a turn that does not end complete never reaches history and raises
``TurnFailedError``; a turn whose tools ran but whose commit failed carries the turn and its
results, so it can be committed later without running a tool again.

Offline: run ``fsm replay`` in another terminal and paste the ``export`` lines it prints into
this one; then ``python agent_loop_failures.py``.
"""

from openai import OpenAI

from fsm.agent import TurnFailedError, run_agent_loop
from fsm.store import ConversationStore


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


client = OpenAI(max_retries=0)
store = ConversationStore("chat.db")
conversation = store.create_conversation()
question = [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}]
tools = {"add": add, "multiply": multiply}
try:
    result = run_agent_loop(
        client, store, conversation, tools, model="gpt-4o-mini", messages=question
    )
    print(result.status, result.content)
except TurnFailedError as exc:
    if exc.results is not None and exc.retryable:  # the tools ran; the commit lost a race
        store.commit_turn(conversation, exc.turn, exc.results, expected_seq=exc.expected_seq)
    else:  # cut off, truncated, a provider error: recorded as an attempt, never history
        print("the turn failed:", exc.reason)
        raise
finally:
    store.close()
