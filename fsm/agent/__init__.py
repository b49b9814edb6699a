"""A tool-calling agent loop over the official ``openai`` client and fsm's store.

One step of the loop: read the conversation from the store, send it (``stream=True``, through
``chat.completions.with_streaming_response``), parse the raw bytes of the streamed answer with
fsm as they arrive (:mod:`fsm.clients`; ``[DONE]`` and ``event: error`` included), and then

* a **complete turn with tool calls**: run the tools (arguments validated against the
  function's signature by pydantic, :mod:`fsm.agent.tools`, and passed as keyword arguments;
  invalid arguments, an exception or an unknown tool become an error *result string*, so the
  model hears about it, and a tool whose arguments are invalid never runs), commit the turn together with its results in one transaction, and go on;
* a **complete turn without tool calls** (the answer): commit it and stop;
* an **incomplete turn** (truncated, aborted, cut, a failed request): record it as an attempt
  (``record_attempts=True``, the default), write nothing to history, and raise
  :class:`TurnFailedError`, whose ``reason`` says why;
* a **commit that fails after the tools ran** (a conflict with another writer, a busy or
  unreachable database, a value the database refuses, an idempotency mismatch, a dropped
  connection): record the turn as an attempt *with the tool results* and the error text, and
  raise :class:`TurnFailedError` with reason ``commit_failed: <the error>``, its ``results``
  (what the tools returned) and the store's exception as ``__cause__``. A turn whose tools ran
  is never lost silently: if recording the attempt fails too, :class:`TurnNotRecordedError`
  (a ``TurnFailedError``) says both and still carries the results.

Every request's ``messages`` is ``store.history(conversation)``: what was committed, byte-exact,
tool results right after their assistant message. The loop stops after ``max_turns`` requests
with ``status="max_turns"``.

.. code-block:: python

    from openai import OpenAI
    from fsm.agent import run_agent_loop
    from fsm.store import ConversationStore

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    with ConversationStore("sqlite:///chat.db", auto_upgrade=True) as store:
        result = run_agent_loop(
            OpenAI(), store, "chat-1", {"add": add}, model="gpt-4o-mini",
            messages=[{"role": "user", "content": "What is 1234 + 5678?"}],
            on_event=print,                   # parser events as they stream, and the loop's
        )
    print(result.status, result.content)

:func:`arun_agent_loop` is the asyncio twin (``AsyncOpenAI``,
:class:`~fsm.store.aio.AsyncConversationStore`, tools that may be coroutine functions, run
concurrently). Cancelling its task mid-stream aborts the turn (reason ``cancelled``), records the
attempt when ``record_attempts`` is true, commits nothing, and re-raises
:class:`asyncio.CancelledError`. A cancellation while tools run commits nothing either; one
during the commit records the attempt with the results (error ``cancelled``) and re-raises.

Store errors before any tool runs (creating the conversation, appending ``messages``, reading the
history) propagate: fsm's typed store errors as they are, anything else (a driver's error) as
:class:`AgentStoreError`, naming the operation.

Progress: ``on_event`` receives the parser's events as they arrive
(:class:`~fsm.events.ToolCallOpened` carries a tool's name as soon as the stream names it) and the
loop's own: :class:`RequestSent`, :class:`ToolExecuted`, :class:`TurnCommitted`,
:class:`AttemptRecorded`. ``import fsm`` does not import this module; this module imports neither
``openai`` nor SQLAlchemy (it works on the client and store it is given).

The package: :mod:`fsm.agent.step` holds every rule of the loop without I/O
(:class:`~fsm.agent.step.AgentLoop`: what to do with a complete turn, an incomplete one, a turn
without tool calls, a failed commit, the last request); :mod:`fsm.agent.loop` and
:mod:`fsm.agent.aio` are the two drivers that do the I/O around it; :mod:`fsm.agent.tools`
runs tools and describes them; :mod:`fsm.agent.events` and :mod:`fsm.agent.errors` are what the
loop reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm.lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from fsm.agent.aio import AsyncStoreLike, arun_agent_loop
    from fsm.agent.errors import (
        AgentError,
        AgentStoreError,
        ToolError,
        TurnFailedError,
        TurnNotRecordedError,
        UnknownOutcomeError,
    )
    from fsm.agent.events import (
        AgentEvent,
        AgentResult,
        AttemptRecorded,
        RequestSent,
        ToolExecuted,
        TurnCommitted,
    )
    from fsm.agent.loop import StoreLike, run_agent_loop
    from fsm.agent.tools import Tool, function_tool, is_idempotent, tool

__all__ = [
    "AgentError",
    "AgentEvent",
    "AgentResult",
    "AgentStoreError",
    "AsyncStoreLike",
    "AttemptRecorded",
    "RequestSent",
    "StoreLike",
    "Tool",
    "ToolError",
    "ToolExecuted",
    "TurnCommitted",
    "TurnFailedError",
    "TurnNotRecordedError",
    "UnknownOutcomeError",
    "arun_agent_loop",
    "function_tool",
    "is_idempotent",
    "run_agent_loop",
    "tool",
]

#: where each exported name lives: imported on first use (PEP 562), not by ``import fsm.agent``
_EXPORTS: dict[str, tuple[str, ...]] = {
    "fsm.agent.aio": (
        "AsyncStoreLike",
        "arun_agent_loop",
    ),
    "fsm.agent.errors": (
        "AgentError",
        "AgentStoreError",
        "ToolError",
        "TurnFailedError",
        "TurnNotRecordedError",
        "UnknownOutcomeError",
    ),
    "fsm.agent.events": (
        "AgentEvent",
        "AgentResult",
        "AttemptRecorded",
        "RequestSent",
        "ToolExecuted",
        "TurnCommitted",
    ),
    "fsm.agent.loop": (
        "StoreLike",
        "run_agent_loop",
    ),
    "fsm.agent.tools": (
        "Tool",
        "function_tool",
        "is_idempotent",
        "tool",
    ),
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
