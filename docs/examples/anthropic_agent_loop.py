"""The agent loop over Anthropic Messages with the official anthropic client. Only the tools
given run: ``multiply`` is not registered, so its call is refused (an error result goes back to
the model) and never executed.

Needs ``pip install 'fsm-toolcalls[anthropic]'``. Offline: run ``fsm replay --format anthropic``
in another terminal and paste the ``export`` lines it prints into this one (they set
``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``); then ``python anthropic_agent_loop.py``.
"""

import anthropic

from fsm.agent import ToolExecuted, run_agent_loop
from fsm.store import ConversationStore


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


client = anthropic.Anthropic(max_retries=0)  # reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
store = ConversationStore("sqlite:///agent.db", auto_upgrade=True)
events = []
result = run_agent_loop(
    client,
    store,
    store.create_conversation(),
    {"add": add},  # multiply is not registered: refused, never run
    model="claude-sonnet-4-5",
    messages=[{"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}],
    format="anthropic",
    on_event=events.append,
)
ran = [(e.name, e.refused) for e in events if isinstance(e, ToolExecuted)]
assert ran == [("add", False), ("multiply", True)] and result.status == "completed"
print(result.content)
store.close()
