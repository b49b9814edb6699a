"""Crash tests of the tool ledger (issue 14) with real processes, on SQLite and PostgreSQL.

A child process runs the agent loop (``ledger=True``, the sync openai client) against the replay
server's demo conversation (``add`` then ``multiply``, then the final answer). Its tools count
their effects in a side file: ``add`` is a plain (not idempotent) tool that appends an effect on
every run, ``multiply`` is declared idempotent and applies its effect only once per arguments
(an upsert) however often it runs. The child SIGKILLs itself at the point named by
``FSM_KILL_AT``; a second child, the same program, resumes. Its recovery loop is the one the
README shows: on :class:`~fsm.agent.UnknownOutcomeError` it looks the call's effect up in the
side file and resolves the call with it, or runs the tool itself if the effect is not there,
inside ``error.hold()``; on :class:`~fsm.store.errors.TurnInProgressError` (the killed owner's
lease, ``FSM_LEASE`` seconds, has not run out yet) it waits ``retry_after`` and runs again.

Each case checks that every effect happened exactly once, that the final history equals an
uninterrupted run's, that the replay server saw only valid requests, and what the ledger kept.
With ``FSM_LEDGER_TABLE=path`` set, each case appends its row of the crash table to ``path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fsm.store import ConversationStore

REPO = Path(__file__).resolve().parents[2]

#: real processes killed at every point: CI runs them in its own step (pytest -m slow)
pytestmark = pytest.mark.slow

CHILD = r"""
import json, os, signal, sys, time
import openai
from fsm.agent import UnknownOutcomeError, run_agent_loop, tool
from fsm.store import ConversationNotFoundError, ConversationStore, TurnInProgressError
from fsm.store.store import StoreCore

KILL = os.environ.get("FSM_KILL_AT", "")
EFFECTS = os.environ["FSM_EFFECTS"]
URL, BASE, CID = sys.argv[1], sys.argv[2], sys.argv[3]


def die(point):
    if KILL == point:
        os.kill(os.getpid(), signal.SIGKILL)


def effects():
    if not os.path.exists(EFFECTS):
        return []
    with open(EFFECTS) as f:
        return [json.loads(line) for line in f if line.strip()]


def note(kind, name, args, result):
    with open(EFFECTS, "a") as f:
        f.write(json.dumps({"kind": kind, "tool": name, "args": args, "result": result}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def add(a: int, b: int) -> int:
    # a side effect that must not happen twice (a payment)
    note("run", "add", [a, b], a + b)
    note("effect", "add", [a, b], a + b)
    die("after_tool_add")
    return a + b


def multiply(a: int, b: int) -> int:
    # idempotent: the effect is an upsert keyed by the arguments
    note("run", "multiply", [a, b], a * b)
    if not any(e["kind"] == "effect" and e["tool"] == "multiply" and e["args"] == [a, b]
               for e in effects()):
        note("effect", "multiply", [a, b], a * b)
    die("after_tool_multiply")
    return a * b


TOOLS = {"add": tool(add), "multiply": tool(multiply, idempotent=True)}


class Store(ConversationStore):
    ledger_lease = float(os.environ.get("FSM_LEASE", "1.0"))

    def begin(self, *args, **kwargs):
        pending = super().begin(*args, **kwargs)
        die("after_begin")
        return pending

    def started(self, pending, call, **kwargs):
        out = super().started(pending, call, **kwargs)
        die(f"after_started_{call}")
        return out

    def succeeded(self, pending, call, result):
        out = super().succeeded(pending, call, result)
        die(f"after_succeeded_{call}")
        return out

    def commit(self, pending, **kwargs):
        die("before_commit")
        return super().commit(pending, **kwargs)


_commit_turn = StoreCore.commit_turn


def commit_turn(self, conn, *args, ledger=False, **kwargs):
    out = _commit_turn(self, conn, *args, ledger=ledger, **kwargs)
    if ledger:
        die("during_commit")  # the turn's rows are written, the transaction not committed
    return out


_commit_ledger_turn = StoreCore.commit_ledger_turn


def commit_ledger_turn(self, conn, *args, **kwargs):
    # PostgreSQL: the last outcome, the resolution and the turn in one statement, sent in one
    # query that the server commits as it ends: the kill comes after the server's commit
    out = _commit_ledger_turn(self, conn, *args, **kwargs)
    if out is not None:
        die("during_commit")
    return out


StoreCore.commit_turn = commit_turn
StoreCore.commit_ledger_turn = commit_ledger_turn

client = openai.OpenAI(base_url=BASE, api_key="test", max_retries=0)
with Store(URL) as store:
    try:
        store.next_seq(CID)
        messages = []
    except ConversationNotFoundError:
        messages = [{"role": "user", "content": "What are 1234 + 5678 and 12 x 34?"}]
    resolved = []
    while True:  # the recovery loop of the README
        try:
            result = run_agent_loop(client, store, CID, TOOLS, model="demo-model-1",
                                    messages=messages, ledger=True)
            break
        except TurnInProgressError as error:  # its owner may be alive: wait for its lease
            time.sleep(error.retry_after + 0.05)
        except UnknownOutcomeError as error:  # its owner is gone
            with error.hold():
                call, args = error.call, json.loads(error.call.arguments)
                done = [e for e in effects() if e["kind"] == "effect" and e["tool"] == call.name
                        and e["args"] == [args["a"], args["b"]]]
                if done:  # it ran: record what it did
                    error.resolve(call, str(done[0]["result"]))
                    resolved.append(["found", call.name])
                else:  # it never ran: run it now, once, and record it
                    error.resolve(call, str(TOOLS[call.name](**args)))
                    resolved.append(["ran", call.name])
            messages = []
print(json.dumps({"status": result.status, "resolved": resolved}))
"""

#: every point between the loop's store steps: begin (add started with it), add's run, started
#: of multiply (add's outcome recorded with it), multiply's run, the commit (multiply's outcome
#: recorded with it)
POINTS = [
    "after_begin",
    "after_tool_add",
    "after_started_1",
    "after_tool_multiply",
    "before_commit",
    "during_commit",
]


def _child(
    url: str, base: str, cid: str, effects: Path, kill: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FSM_EFFECTS": str(effects), "PYTHONPATH": str(REPO)}
    env.pop("FSM_KILL_AT", None)
    if kill is not None:
        env["FSM_KILL_AT"] = kill
    return subprocess.run(
        [sys.executable, "-c", CHILD, url, base, cid],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _effects(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ledger(url: str, cid: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            turns = conn.execute(
                sa.text(
                    "SELECT id, state, committed_seq FROM fsm_pending_turns"
                    " WHERE conversation_id = :c ORDER BY id"
                ),
                {"c": cid},
            ).all()
            out = []
            for pid, state, seq in turns:
                calls = conn.execute(
                    sa.text(
                        "SELECT name, state, starts FROM fsm_tool_executions"
                        " WHERE conversation_id = :c AND pending_id = :p ORDER BY position"
                    ),
                    {"c": cid, "p": pid},
                ).all()
                out.append(
                    {
                        "state": state,
                        "committed_seq": seq,
                        "calls": [f"{n}:{s}x{k}" for n, s, k in calls],
                    }
                )
            return out
    finally:
        engine.dispose()


@pytest.mark.parametrize("point", POINTS)
def test_a_sigkill_at_each_point_runs_each_effect_once(
    point: str, fsm_engine: str, fsm_db_url: str, fsm_replay: Any, tmp_path: Path
) -> None:
    # the uninterrupted run, on its own server and conversation
    base_server = fsm_replay()
    clean = _child(fsm_db_url, base_server.base_url, "base", tmp_path / "base.jsonl")
    assert clean.returncode == 0, clean.stderr
    server = fsm_replay()
    effects = tmp_path / "effects.jsonl"
    killed = _child(fsm_db_url, server.base_url, "conv", effects, kill=point)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    # PostgreSQL commits the ledger's turn with the one query that records the last outcome
    # (one round trip, committed by the server as it ends): a kill after that statement comes
    # after the commit, and the resumed run finds the turn in history
    committed_at_kill = point == "during_commit" and fsm_engine == "postgresql"
    with ConversationStore(fsm_db_url) as store:
        pending = store.pending("conv")
        if committed_at_kill:
            assert pending is None
            before: list[str] = []
        else:
            # every kill leaves the turn pending (during the commit: its transaction died too)
            assert pending is not None and pending.state == "pending"
            before = [e.state for e in pending.executions]
    resumed = _child(fsm_db_url, server.base_url, "conv", effects)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["status"] == "completed"
    found = _effects(effects)
    applied = {t: sum(1 for e in found if e["kind"] == "effect" and e["tool"] == t) for t in TOOL}
    runs = {t: sum(1 for e in found if e["kind"] == "run" and e["tool"] == t) for t in TOOL}
    assert applied == {"add": 1, "multiply": 1}, found
    assert runs["add"] == 1, found  # the tool that is not idempotent never runs twice
    with ConversationStore(fsm_db_url) as store:
        history = store.history("conv")
        assert history == store.history("base")
        assert store.pending("conv") is None
    assert server.failures == [] and base_server.failures == []
    ledger = _ledger(fsm_db_url, "conv")
    assert [t["state"] for t in ledger] == ["committed"], ledger
    assert ledger[0]["committed_seq"] == 1
    # what the ledger shows of the crash: the unknown outcome of a started call
    if point in ("after_begin", "after_tool_add"):
        assert report["resolved"] == [["ran" if point == "after_begin" else "found", "add"]]
    else:
        assert report["resolved"] == []
    if committed_at_kill:
        assert ledger[0]["calls"] == ["add:succeededx1", "multiply:succeededx1"], ledger
        assert runs["multiply"] == 1, found
    elif point in ("after_started_1", "after_tool_multiply", "before_commit", "during_commit"):
        # multiply's outcome goes with the commit: a kill before it ends loses it, and the
        # resumed run runs multiply (idempotent) again
        assert ledger[0]["calls"][1] == "multiply:succeededx2"
    table = os.environ.get("FSM_LEDGER_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(
                json.dumps(
                    {
                        "point": point,
                        "engine": fsm_engine,
                        "runs": runs,
                        "effects": applied,
                        "history_equal": True,
                        "after_kill": before,
                        "ledger": ledger[0]["calls"],
                        "resolved": report["resolved"],
                    }
                )
                + "\n"
            )


TOOL = ("add", "multiply")

RACE = r"""
import os, sys, time
from fsm.store import ConversationStore, PendingTurnError

URL, CID, ME, OTHER = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
with ConversationStore(URL) as store:
    seen = store.pending(CID)
    open(ME, "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(OTHER) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        mine = store.claim(seen)
    except PendingTurnError as error:
        open(ME + ".done", "w").close()
        print("PendingTurnError", error)
    else:
        open(ME + ".done", "w").close()
        # commit once the other process tried its claim (else it would find the turn committed)
        while not os.path.exists(OTHER + ".done") and time.monotonic() < deadline:
            time.sleep(0.01)
        if mine.executions[1].state != "succeeded":  # multiply (idempotent) died unrecorded
            mine = store.succeeded(store.started(mine, 1), 1, "408")
        store.commit(mine)
        print("won")
"""


def test_two_processes_resuming_one_turn_one_wins(
    fsm_db_url: str, fsm_replay: Any, tmp_path: Path
) -> None:
    server = fsm_replay()
    killed = _child(fsm_db_url, server.base_url, "conv", tmp_path / "e.jsonl", kill="before_commit")
    assert killed.returncode == -9, killed.stderr[-2000:]
    time.sleep(1.2)  # the killed owner's lease (FSM_LEASE, 1 s) runs out
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, fsm_db_url, "conv", str(me), str(other)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me, other in ((a, b), (b, a))
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    lines = sorted(out.strip().splitlines()[-1].split(" ")[0] for out, _ in outs)
    assert lines == ["PendingTurnError", "won"], outs
    with ConversationStore(fsm_db_url) as store:
        assert store.pending("conv") is None
        assert len(store.history("conv")) == 4  # user, assistant, two results: once


# -- the async driver and the loop's own rules, in process ---------------------------------------
def _tools(log: list[str]) -> dict[str, Any]:
    from fsm.agent import tool

    def add(a: int, b: int) -> int:
        log.append("add")
        return a + b

    def multiply(a: int, b: int) -> int:
        log.append("multiply")
        return a * b

    return {"add": tool(add), "multiply": tool(multiply, idempotent=True)}


def test_the_async_loop_resumes_and_raises_the_unknown_outcome(
    fsm_db_url: str, fsm_replay: Any
) -> None:
    import asyncio

    import openai

    from fsm.agent import UnknownOutcomeError, arun_agent_loop
    from fsm.api import parse_file
    from fsm.store.aio import AsyncConversationStore
    from tests.helpers.agent import DEMO, MODEL, USER

    # a crashed run: the demo's turn pending, add started with no outcome, multiply not started
    with ConversationStore(fsm_db_url) as store:
        store.ledger_lease = 0.2
        store.create_conversation("conv")
        store.append("conv", [USER])
        pending = store.begin("conv", parse_file(DEMO).turn(0))
        store.started(pending, 0)
    time.sleep(0.3)  # the crashed owner's lease runs out
    log: list[str] = []
    server = fsm_replay([Path(REPO / "fsm/examples/final_answer.sse")])

    async def body() -> None:
        async with AsyncConversationStore(fsm_db_url) as store:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
            try:
                with pytest.raises(UnknownOutcomeError, match="call 0 \\(add") as caught:
                    await arun_agent_loop(
                        client, store, "conv", _tools(log), model=MODEL, ledger=True
                    )
                assert log == []  # nothing ran: add may have run before the crash
                await caught.value.resolve(caught.value.call, "6912")
                result = await arun_agent_loop(
                    client, store, "conv", _tools(log), model=MODEL, ledger=True
                )
                assert result.status == "completed"
            finally:
                await client.close()
            history = await store.history("conv")
            assert [m.get("content") for m in history[2:4]] == ["6912", "408"]
            assert await store.pending("conv") is None

    asyncio.run(body())
    assert log == ["multiply"]  # add never ran here; multiply ran once
    assert server.failures == []


def test_the_async_loop_through_the_ledger_commits_what_the_plain_loop_does(
    fsm_db_url: str, fsm_replay: Any
) -> None:
    import asyncio

    import openai

    from fsm.agent import arun_agent_loop
    from fsm.store.aio import AsyncConversationStore
    from tests.helpers.agent import MODEL, USER

    log: list[str] = []
    plain, booked = fsm_replay(), fsm_replay()

    async def body() -> None:
        async with AsyncConversationStore(fsm_db_url) as store:
            for cid, server, ledger in (("plain", plain, False), ("booked", booked, True)):
                client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
                try:
                    result = await arun_agent_loop(
                        client, store, cid, _tools(log), model=MODEL, messages=[USER],
                        ledger=ledger,
                    )  # fmt: skip
                finally:
                    await client.close()
                assert result.status == "completed"
            assert await store.history("booked") == await store.history("plain")

    asyncio.run(body())
    assert sorted(log) == ["add", "add", "multiply", "multiply"]
    assert _ledger(fsm_db_url, "booked") == [
        {
            "state": "committed",
            "committed_seq": 1,
            "calls": ["add:succeededx1", "multiply:succeededx1"],
        }
    ]
    assert _ledger(fsm_db_url, "plain") == []


def test_ledger_needs_a_store_that_has_it(fsm_replay: Any) -> None:
    import openai

    from fsm.agent import run_agent_loop

    client = openai.OpenAI(base_url=fsm_replay().base_url, api_key="t", max_retries=0)
    with pytest.raises(TypeError, match="ledger=True needs a store"):
        run_agent_loop(client, object(), "c", {}, model="m", ledger=True)  # type: ignore[arg-type]
    client.close()
