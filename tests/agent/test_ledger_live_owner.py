"""A live owner keeps its ledger turn (issue 26, finding 1) and the ledger under faults
(finding 7), through the agent loop (``ledger=True``), on SQLite and PostgreSQL.

* two OS processes: the first runs ``add`` (a tool that must not run twice: it counts its runs in
  a side file) for longer than its lease, kept alive by the heartbeat; the second runs on the
  same conversation meanwhile, following the README's recipe. Before leases the second claimed
  the turn, got :class:`~fsm.agent.UnknownOutcomeError` for a call that was running, found no
  effect yet and ran ``add`` itself: twice;
* the same in one process (two threads on one store, a web server's two requests);
* a crashed owner: :class:`~fsm.store.TurnInProgressError` until its lease runs out, then (and
  only then) :class:`~fsm.agent.UnknownOutcomeError`;
* a store fault while ``succeeded`` is recorded (SQLite: the database locked by another
  connection; PostgreSQL: a network black hole through the fault proxy): a brief one is retried,
  a longer one leaves the result on the error and in hand, and the next run records it instead
  of raising ``UnknownOutcomeError``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore, TurnInProgressError
from tests.helpers.agent import FINAL, MODEL, USER

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
import openai
from fsm.agent import UnknownOutcomeError, run_agent_loop, tool
from fsm.store import ConversationStore, TurnInProgressError

URL, BASE, CID, RUNS = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
SLOW = float(os.environ.get("FSM_SLOW", "0"))
MARK = os.environ.get("FSM_MARK")


def note(kind, name, args, result):
    with open(RUNS, "a") as f:
        f.write(json.dumps({"kind": kind, "tool": name, "args": args, "result": result,
                            "pid": os.getpid()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def find_effect(call):  # ask the system add acts on
    args = json.loads(call.arguments)
    if not os.path.exists(RUNS):
        return None
    with open(RUNS) as f:
        found = [json.loads(line) for line in f if line.strip()]
    done = [e for e in found if e["kind"] == "effect" and e["tool"] == call.name
            and e["args"] == [args["a"], args["b"]]]
    return str(done[0]["result"]) if done else None


def add(a: int, b: int) -> int:  # pays an invoice: never twice
    note("run", "add", [a, b], None)
    if MARK:
        open(MARK, "w").close()
    time.sleep(SLOW)
    note("effect", "add", [a, b], a + b)
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


TOOLS = {"add": tool(add), "multiply": tool(multiply, idempotent=True)}
client = openai.OpenAI(base_url=BASE, api_key="test", max_retries=0)
messages = json.loads(os.environ["FSM_MESSAGES"])
waited, resolved = 0, []
with ConversationStore(URL) as store:
    store.ledger_lease = float(os.environ.get("FSM_LEASE", "1.0"))
    while True:  # the README's recipe
        try:
            result = run_agent_loop(client, store, CID, TOOLS, model="demo-model-1",
                                    messages=messages, ledger=True,
                                    max_turns=int(os.environ.get("FSM_MAX_TURNS", "10")))
            break
        except TurnInProgressError as error:  # another request's tools are running
            waited += 1
            time.sleep(error.retry_after + 0.05)
        except UnknownOutcomeError as error:  # its owner is gone
            with error.hold():
                done = find_effect(error.call)
                if done is not None:
                    error.resolve(error.call, done)
                    resolved.append("found")
                else:
                    error.abandon("no effect found")
                    resolved.append("abandoned")
print(json.dumps({"status": result.status, "waited": waited, "resolved": resolved}))
"""


def _runs(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _child(
    url: str, base: str, runs: Path, messages: list[Any], **env: str
) -> subprocess.Popen[str]:
    environ = {**os.environ, "PYTHONPATH": str(REPO), "FSM_MESSAGES": json.dumps(messages), **env}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, url, base, "conv", str(runs)],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_two_processes_a_live_owner_keeps_its_turn(
    fsm_db_url: str, fsm_replay: Any, tmp_path: Path
) -> None:
    """The red team's scenario: ``add`` runs 3 s under a 1 s lease (the heartbeat keeps it);
    a second process on the conversation waits instead of taking the turn over."""
    first_server, second_server = fsm_replay(), fsm_replay([FINAL])
    runs, mark = tmp_path / "runs.jsonl", tmp_path / "add-started"
    first = _child(
        fsm_db_url,
        first_server.base_url,
        runs,
        [USER],
        FSM_SLOW="3",
        FSM_MARK=str(mark),
        FSM_LEASE="1.0",
        FSM_MAX_TURNS="1",  # the tool turn only: the second process asks the next question
    )
    try:
        _wait_for(mark)
        second = _child(
            fsm_db_url,
            second_server.base_url,
            runs,
            [{"role": "user", "content": "and the total?"}],
            FSM_LEASE="1.0",
        )
        outs = [p.communicate(timeout=120) for p in (first, second)]
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
    assert first.returncode == 0 and second.returncode == 0, outs
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert reports[0]["status"] == "max_turns"
    assert reports[1] == {"status": "completed", "waited": reports[1]["waited"], "resolved": []}
    assert reports[1]["waited"] >= 1  # it saw the turn in progress and waited
    runs_of_add = [r for r in _runs(runs) if r["tool"] == "add"]
    assert [r["kind"] for r in runs_of_add] == ["run", "effect"], runs_of_add  # once
    with ConversationStore(fsm_db_url) as store:
        history = store.history("conv")
        assert [m["role"] for m in history] == [
            "user",
            "assistant",
            "tool",
            "tool",
            "user",
            "assistant",
        ]
        assert history[2]["content"] == "6912"
        assert store.pending("conv") is None
    assert first_server.failures == [] and second_server.failures == []


def _tools(log: list[str], started: threading.Event, release: threading.Event) -> dict[str, Any]:
    from fsm.agent import tool

    def add(a: int, b: int) -> int:
        log.append("add")
        started.set()
        assert release.wait(30)
        return a + b

    def multiply(a: int, b: int) -> int:
        log.append("multiply")
        return a * b

    return {"add": tool(add), "multiply": tool(multiply, idempotent=True)}


def test_one_process_a_second_request_gets_turn_in_progress(
    fsm_db_url: str, fsm_replay: Any
) -> None:
    """The live-owner scenario in one process (one store, two requests): the second request,
    sent while ``add`` runs past its lease, raises TurnInProgressError before it appends or
    sends anything; the first commits."""
    import openai

    from fsm.agent import run_agent_loop

    first_server, second_server = fsm_replay(), fsm_replay([FINAL])
    log: list[str] = []
    started, release = threading.Event(), threading.Event()
    tools = _tools(log, started, release)
    outcome: dict[str, Any] = {}
    with ConversationStore(fsm_db_url) as store:
        store.ledger_lease = 1.0

        def first() -> None:
            client = openai.OpenAI(base_url=first_server.base_url, api_key="t", max_retries=0)
            try:
                outcome["first"] = run_agent_loop(
                    client, store, "conv", tools, model=MODEL, messages=[USER], ledger=True
                )
            except BaseException as exc:  # reported below
                outcome["first"] = exc
            finally:
                client.close()

        thread = threading.Thread(target=first)
        thread.start()
        try:
            assert started.wait(30)
            time.sleep(2.2)  # past two leases: only the heartbeat keeps the turn
            client = openai.OpenAI(base_url=second_server.base_url, api_key="t", max_retries=0)
            try:
                with pytest.raises(TurnInProgressError) as caught:
                    run_agent_loop(
                        client,
                        store,
                        "conv",
                        tools,
                        model=MODEL,
                        messages=[{"role": "user", "content": "again"}],
                        ledger=True,
                    )
            finally:
                client.close()
            assert caught.value.retryable and 0 < caught.value.retry_after <= 1.0
            assert second_server.requests == []  # nothing sent
        finally:
            release.set()
            thread.join(30)
        assert not isinstance(outcome["first"], BaseException), outcome
        assert outcome["first"].status == "completed"
        assert sorted(log) == ["add", "multiply"]  # add ran once
        history = store.history("conv")
        assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
        assert store.pending("conv") is None
    assert first_server.failures == []


def test_a_crashed_owner_is_in_progress_until_its_lease_runs_out(
    fsm_db_url: str, fsm_replay: Any
) -> None:
    """UnknownOutcomeError means only "its owner is gone": before the lease runs out, the
    started call is in progress."""
    import openai

    from fsm.agent import UnknownOutcomeError, run_agent_loop
    from fsm.api import parse_file
    from tests.helpers.agent import DEMO

    log: list[str] = []
    started, release = threading.Event(), threading.Event()
    release.set()
    tools = _tools(log, started, release)
    server = fsm_replay([FINAL])
    with ConversationStore(fsm_db_url) as crashed:  # begins, starts add, then dies
        crashed.ledger_lease = 3.0
        crashed.create_conversation("conv")
        crashed.append("conv", [USER])
        crashed.started(crashed.begin("conv", parse_file(DEMO).turn(0)), 0)
    client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
    try:
        with ConversationStore(fsm_db_url) as store:
            with pytest.raises(TurnInProgressError) as caught:
                run_agent_loop(client, store, "conv", tools, model=MODEL, ledger=True)
            time.sleep(caught.value.retry_after + 0.1)
            with pytest.raises(UnknownOutcomeError) as unknown:
                run_agent_loop(client, store, "conv", tools, model=MODEL, ledger=True)
            assert log == []  # nothing ran
            with unknown.value.hold():
                unknown.value.resolve(unknown.value.call, "6912")  # found its effect
            result = run_agent_loop(client, store, "conv", tools, model=MODEL, ledger=True)
            assert result.status == "completed"
            assert log == ["multiply"]
            assert [m.get("content") for m in store.history("conv")[2:4]] == ["6912", "408"]
    finally:
        client.close()
    assert server.failures == []


# -- finding 7: a store fault while succeeded is recorded ------------------------------------------
def _fault(engine: str, url: str) -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(the URL the store uses, start the fault, end it): SQLite, another connection holds the
    write lock (the store's writes raise StoreBusyError after its busy timeout); PostgreSQL, the
    fault proxy drops everything (StoreUnavailableError at the store's deadline)."""
    if engine == "sqlite":
        path = sa.make_url(url).database
        assert path is not None
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            yield (
                url,
                lambda: holder.execute("BEGIN IMMEDIATE"),
                lambda: holder.execute("ROLLBACK"),
            )
        finally:
            holder.close()
        return
    from tests.helpers.faults import Proxy

    target = sa.make_url(url)
    with Proxy(target.host or "127.0.0.1", target.port or 5432) as proxy:
        yield proxy.url(url), proxy.blackhole, proxy.forward


@pytest.fixture
def fault(fsm_engine: str, fsm_db_url: str) -> Iterator[tuple[str, Any, Any]]:
    yield from _fault(fsm_engine, fsm_db_url)


def _faulty_tools(
    log: list[str], start: Callable[[], None], end: Callable[[], None], seconds: float
) -> dict[str, Any]:
    from fsm.agent import tool

    def add(a: int, b: int) -> int:  # the store fails as add finishes, for `seconds`
        log.append("add")
        start()
        threading.Timer(seconds, end).start()
        return a + b

    def multiply(a: int, b: int) -> int:
        log.append("multiply")
        return a * b

    return {"add": tool(add), "multiply": tool(multiply, idempotent=True)}


def _store(url: str) -> ConversationStore:
    store = ConversationStore(url, busy_timeout=0.2, timeout=1.0)
    store.ledger_lease = 3.0  # the loop retries a recording for 2 s
    return store


def test_a_brief_fault_while_recording_succeeded_is_retried(
    fault: tuple[str, Any, Any], fsm_replay: Any
) -> None:
    import openai

    from fsm.agent import ToolExecuted, run_agent_loop

    url, start, end = fault
    server = fsm_replay()
    log: list[str] = []
    events: list[Any] = []
    client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
    try:
        with _store(url) as store:
            result = run_agent_loop(
                client,
                store,
                "conv",
                _faulty_tools(log, start, end, 0.8),
                model=MODEL,
                messages=[USER],
                ledger=True,
                on_event=events.append,
            )
            assert result.status == "completed"
            assert log == ["add", "multiply"]
            history = store.history("conv")
            assert [m.get("content") for m in history[2:4]] == ["6912", "408"]
            executions = [e for e in events if isinstance(e, ToolExecuted)]
            assert [e.content for e in executions] == ["6912", "408"]
    finally:
        client.close()
    assert server.failures == []


def test_a_long_fault_keeps_the_result_in_hand_for_the_next_run(
    fault: tuple[str, Any, Any], fsm_replay: Any
) -> None:
    """The fault outlasts the loop's retries: the run raises with add's result on the error;
    the next run on the store records that result (no UnknownOutcomeError) and add never runs
    again."""
    import openai

    from fsm.agent import TurnFailedError, UnknownOutcomeError, run_agent_loop

    url, start, end = fault
    server = fsm_replay()
    log: list[str] = []
    client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
    tools = _faulty_tools(log, start, end, 3.5)
    try:
        with _store(url) as store:
            with pytest.raises(TurnFailedError) as caught:
                run_agent_loop(
                    client, store, "conv", tools, model=MODEL, messages=[USER], ledger=True
                )
            assert caught.value.results == ["6912"]  # the result is on the error
            assert log == ["add"]
            time.sleep(3.0)  # the fault ends
            waited = 0
            while True:  # the README's recipe
                try:
                    result = run_agent_loop(client, store, "conv", tools, model=MODEL, ledger=True)
                    break
                except TurnInProgressError as error:  # (the lease could not be released)
                    waited += 1
                    assert waited < 10
                    time.sleep(error.retry_after + 0.05)
                except UnknownOutcomeError:  # the result was in hand: never this
                    pytest.fail("the next run raised UnknownOutcomeError for a result in hand")
            assert result.status == "completed"
            assert log == ["add", "multiply"]  # add ran once
            history = store.history("conv")
            assert [m.get("content") for m in history[2:4]] == ["6912", "408"]
            with store.engine.connect() as conn:
                starts = conn.execute(
                    sa.text("SELECT name, state, starts FROM fsm_tool_executions ORDER BY position")
                ).all()
            assert [tuple(r) for r in starts] == [
                ("add", "succeeded", 1),
                ("multiply", "succeeded", 1),
            ]
    finally:
        client.close()


def test_the_async_loop_keeps_a_result_in_hand_through_a_long_fault(
    fault: tuple[str, Any, Any], fsm_replay: Any
) -> None:
    """The async driver: add and multiply run concurrently; the fault outlasts the retries of
    add's recording. Every tool ends before the run raises (add's result on the error); the next
    run records it from hand and add never runs again."""
    import asyncio

    import openai

    from fsm.agent import TurnFailedError, UnknownOutcomeError, arun_agent_loop
    from fsm.store.aio import AsyncConversationStore

    url, start, end = fault
    server = fsm_replay()
    log: list[str] = []
    tools = _faulty_tools(log, start, end, 3.5)

    async def body() -> None:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        try:
            async with AsyncConversationStore(url, busy_timeout=0.2, timeout=1.0) as store:
                store.ledger_lease = 3.0
                with pytest.raises(TurnFailedError) as caught:
                    await arun_agent_loop(
                        client, store, "conv", tools, model=MODEL, messages=[USER], ledger=True
                    )
                assert "6912" in (caught.value.results or [])
                await asyncio.sleep(3.0)  # the fault ends
                for _ in range(10):
                    try:
                        result = await arun_agent_loop(
                            client, store, "conv", tools, model=MODEL, ledger=True
                        )
                        break
                    except TurnInProgressError as error:
                        await asyncio.sleep(error.retry_after + 0.05)
                    except UnknownOutcomeError:
                        pytest.fail("the next run raised UnknownOutcomeError for a result in hand")
                assert result.status == "completed"
                history = await store.history("conv")
                assert [m.get("content") for m in history[2:4]] == ["6912", "408"]
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(body(), 90))
    assert log.count("add") == 1  # add ran once


# -- a turn resolved between pending() and claim() ----------------------------------------------
def _racing_pending(store: Any, commit: Callable[[], Any]) -> Callable[[str], Any]:
    """``store.pending``, with ``commit`` (the turn's owner committing it) run right after the
    first read that finds the turn: the run that read it then claims a committed turn."""
    read = store.pending

    def pending(cid: str) -> Any:
        found = read(cid)
        if found is not None:
            commit()
        return found

    return pending


def test_a_turn_committed_between_pending_and_claim_is_not_resumed(
    fsm_db_url: str, fsm_replay: Any
) -> None:
    """A request reads the conversation's pending turn just before its owner commits it: its
    claim finds the turn committed, and the run goes on with the conversation as it is (it raised
    LedgerStateError "already committed" before)."""
    import openai

    from fsm.agent import run_agent_loop
    from tests.helpers.store import make_turn

    server = fsm_replay([FINAL])
    with ConversationStore(fsm_db_url) as store:
        store.create_conversation("conv")
        store.append("conv", [USER])
        owner = store.begin("conv", make_turn([("call_1", "add", '{"a": 1, "b": 2}')]))
        owner = store.succeeded(store.started(owner, 0), 0, "3")
        store.pending = _racing_pending(store, lambda: store.commit(owner))  # type: ignore[method-assign]
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        try:
            result = run_agent_loop(
                client,
                store,
                "conv",
                {},
                model=MODEL,
                messages=[{"role": "user", "content": "?"}],
                ledger=True,
            )
        finally:
            client.close()
        assert result.status == "completed"
        roles = [m["role"] for m in store.history("conv")]
        assert roles == ["user", "assistant", "tool", "user", "assistant"]


def test_the_async_loop_too(fsm_db_url: str, fsm_replay: Any) -> None:
    """The same race through ``arun_agent_loop`` and the asyncio store."""
    import asyncio

    import openai

    from fsm.agent import arun_agent_loop
    from fsm.store.aio import AsyncConversationStore
    from tests.helpers.store import make_turn

    server = fsm_replay([FINAL])

    async def body() -> None:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        try:
            async with AsyncConversationStore(fsm_db_url) as store:
                await store.create_conversation("conv")
                await store.append("conv", [USER])
                turn = make_turn([("call_1", "add", '{"a": 1, "b": 2}')])
                owner = await store.begin("conv", turn)
                owner = await store.succeeded(await store.started(owner, 0), 0, "3")
                read = store.pending
                committed: list[Any] = []

                async def pending(cid: str) -> Any:
                    found = await read(cid)
                    if found is not None and not committed:
                        committed.append(await store.commit(owner))
                    return found

                store.pending = pending  # type: ignore[method-assign]
                result = await arun_agent_loop(
                    client,
                    store,
                    "conv",
                    {},
                    model=MODEL,
                    messages=[{"role": "user", "content": "?"}],
                    ledger=True,
                )
                assert result.status == "completed"
                roles = [m["role"] for m in await store.history("conv")]
                assert roles == ["user", "assistant", "tool", "user", "assistant"]
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(body(), 60))
