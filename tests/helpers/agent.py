"""The agent and replay-server tests' helpers: the demo streams, the demo conversation's first
message, the clients the loop runs with, and a bounded ``await``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fsm.api import parse_file
from fsm.testing import EXAMPLES_DIR

DEMO = EXAMPLES_DIR / "parallel_add_multiply.sse"
FINAL = EXAMPLES_DIR / "final_answer.sse"
DEMO_BYTES = DEMO.read_bytes()
USER = {"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}
MODEL = "demo-model-1"
CLIENTS = ["openai", "async-openai"]


async def bounded(coro: Any) -> Any:
    """``await coro``, failing after 30 seconds instead of hanging the suite."""
    async with asyncio.timeout(30):
        return await coro


def streamed(path: Path) -> dict[str, Any]:
    """The assistant message fsm reads from a recorded stream: what history must hold."""
    return parse_file(path).turn(0).to_message()
