"""openai-agents' Runner with its session history in fsm's store: two runs of one session, the
second seeing the first's tool calls and their outputs, then the history as fsm holds it.

Needs openai-agents (``pip install 'fsm-toolcalls[openai-agents]'``). Offline: run
``fsm replay --format responses`` in another terminal and paste the ``export`` lines it prints
into this one; then ``python openai_agents_session.py``.
"""

import asyncio

from agents import Agent, Runner, function_tool, set_tracing_disabled

from fsm.integrations.openai_agents import FsmSession
from fsm.store import ConversationStore

set_tracing_disabled(True)  # the SDK's tracing uploads to OpenAI; nothing leaves the machine here


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


agent = Agent(
    name="calculator", instructions="Use the tools.", model="gpt-5-mini", tools=[add, multiply]
)


async def ask(session: FsmSession, question: str) -> str:
    # streamed because fsm replay only streams; Runner.run makes the same session calls
    result = Runner.run_streamed(agent, question, session=session)
    async for _event in result.stream_events():
        pass
    return str(result.final_output)


async def main() -> None:
    with ConversationStore("chat.db") as store:
        session = FsmSession(store, "user-42")
        await session.clear_session()  # start this example's session afresh
        print(await ask(session, "What are 1234 + 5678 and 12 * 34?"))
        print(await ask(session, "Check both again, please."))  # run 2 sees run 1
        for item in await session.get_items():  # what the next run sends: calls with outputs
            print(item.get("type", item.get("role")), item.get("name") or item.get("output", ""))
        print("pending:", store.pending("user-42"))  # no call waits for its output


asyncio.run(main())
