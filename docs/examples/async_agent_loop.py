"""The asyncio agent loop: ``AsyncOpenAI``, ``AsyncConversationStore`` and coroutine tools,
the calls of one turn running concurrently.

Needs ``pip install 'fsm-toolcalls[openai,async]'`` (aiosqlite). Offline: run ``fsm replay`` in
another terminal and paste the ``export`` lines it prints into this one; then ``python
async_agent_loop.py``.
"""

import asyncio

from openai import AsyncOpenAI

from fsm.agent import arun_agent_loop
from fsm.store.aio import AsyncConversationStore


async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    await asyncio.sleep(0.01)  # I/O of your own: the calls of one turn run concurrently
    return a * b


async def main() -> None:
    # or "postgresql+psycopg://app@localhost/app"; auto_upgrade migrates a new database
    async with AsyncConversationStore("sqlite:///chat.db", auto_upgrade=True) as store:
        result = await arun_agent_loop(
            AsyncOpenAI(),
            store,
            await store.create_conversation(),
            {"add": add, "multiply": multiply},
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}],
        )
    print(result.status, result.content)


asyncio.run(main())
