"""The parser on its own: stream a Chat Completions answer over plain HTTP (httpx) and turn it
into events as the bytes arrive, then into the assistant message for history.

Offline: run ``fsm replay`` in another terminal and paste the ``export`` lines it prints into
this one; then ``python parse_stream.py``.
"""

import os

import httpx

from fsm import StreamParser, ToolCallFinished, ToolCallOpened
from fsm.agent import function_tool


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
history = [{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}]
request = {
    "model": "gpt-4o-mini",
    "stream": True,
    "messages": history,
    "tools": [function_tool(add), function_tool(multiply)],
}

parser = StreamParser()
with httpx.stream("POST", url, json=request, headers=headers) as response:
    response.raise_for_status()
    for data in response.iter_bytes():  # split anywhere, even inside a UTF-8 character
        for event in parser.receive_data(data):
            match event:
                case ToolCallOpened(name=name):
                    print(f"calling {name}...")  # names show up as soon as they arrive
                case ToolCallFinished(id=call_id, name=name, arguments=arguments):
                    print("ready:", call_id, name, arguments)
parser.receive_eof()  # or parser.abort("why") when the transport fails

turn = parser.turns[0]
if turn.complete:
    history.append(turn.to_message())  # ids and arguments byte-exact
    print(history[-1])
else:
    for call in turn.tool_calls:  # never executed: truncated / aborted, with a reason
        print(call.name, call.state.value, call.reason)
