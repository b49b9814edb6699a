"""Exactly-once tools: with ``ledger=True`` each turn is stored pending before its tools run,
every tool's outcome is recorded as it finishes, and a run after a crash resumes the pending
turn without running a non-idempotent tool twice. While the turn's owner lives (its lease
holds) another run gets ``TurnInProgressError`` and waits; once the owner is gone, a call it
started with no recorded outcome is decided here, holding the turn meanwhile.

Offline: run ``fsm replay`` in another terminal and paste the ``export`` lines it prints into
this one; then ``python tool_ledger.py``.
"""

import json
import time
from pathlib import Path

from openai import OpenAI

from fsm.agent import UnknownOutcomeError, run_agent_loop, tool
from fsm.store import ConversationStore, TurnInProgressError

EFFECTS = Path("effects.jsonl")  # the system add acts on (say, your payments), by call id


def add(a: int, b: int) -> int:
    """Add two integers (imagine it pays an invoice: it must never run twice)."""
    with EFFECTS.open("a") as log:
        log.write(json.dumps({"a": a, "b": b, "result": a + b}) + "\n")
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers (no side effect: safe to repeat)."""
    return a * b


def find_effect(arguments: str) -> str | None:
    """Ask the system the tool acts on whether the call took effect, and what it returned."""
    wanted = json.loads(arguments)
    lines = EFFECTS.read_text().splitlines() if EFFECTS.exists() else []
    for effect in map(json.loads, lines):
        if (effect["a"], effect["b"]) == (wanted["a"], wanted["b"]):
            return str(effect["result"])
    return None


# add has a side effect: never run twice; multiply is safe to repeat
tools = {"add": tool(add), "multiply": tool(multiply, idempotent=True)}
client = OpenAI(max_retries=0)
store = ConversationStore("chat.db")
cid = store.create_conversation()
messages = [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}]
while True:
    try:
        result = run_agent_loop(
            client, store, cid, tools, model="gpt-4o-mini", messages=messages, ledger=True
        )
        break
    except TurnInProgressError as error:  # another request's tools are running: its owner lives
        time.sleep(error.retry_after)  # nothing was appended: send the question again
    except UnknownOutcomeError as error:  # its owner is gone: add started, no outcome recorded
        messages = []  # the question is stored already: the next run resumes the turn
        with error.hold():  # keep the turn while you look: nobody else takes it over
            done = find_effect(error.call.arguments)  # ask the system it acts on
            if done is not None:
                error.resolve(error.call, done)  # it ran: record what it did
            else:
                error.abandon("no effect found")  # or run it yourself, then resolve()
print(result.status, result.content)
print(store.pending(cid))  # None: nothing left pending
store.close()
