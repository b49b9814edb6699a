import asyncio

import anthropic
from openai import OpenAI

from fsm import parse
from fsm.store import ConversationStore
from fsm.store.aio import AsyncConversationStore
from fsm.types import Message

store = ConversationStore("sqlite:///x.db")
client = OpenAI()
client.chat.completions.create(model="m", messages=store.history("c"))
client.responses.create(model="m", input=store.history("c", format="responses"))
anthropic.Anthropic().messages.create(
    model="m", max_tokens=1, messages=store.history("c", format="anthropic")
)
messages: list[Message] = store.history("c")
turn = parse(b"").turns[0]
messages.append(turn.to_message())
client.chat.completions.create(model="m", messages=messages)


async def main() -> None:
    astore = AsyncConversationStore("sqlite:///x.db")
    client.responses.create(model="m", input=await astore.history("c", format="responses"))
    with store.engine.connect() as conn:
        bound = store.bind(conn)
        client.chat.completions.create(model="m", messages=bound.history("c"))


asyncio.run(main())
