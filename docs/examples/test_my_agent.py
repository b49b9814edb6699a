"""Testing your agent with fsm's pytest plugin: a replay server and a store per test, once per
engine (SQLite; PostgreSQL too when ``FSM_TEST_POSTGRES_URL`` is set).

Run it with pytest: ``python -m pytest test_my_agent.py`` (the plugin comes with fsm).
"""

from openai import OpenAI

from fsm.agent import run_agent_loop


def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


def test_my_agent(fsm_replay_server, fsm_store):
    client = OpenAI(base_url=fsm_replay_server.base_url, api_key="test", max_retries=0)
    run_agent_loop(
        client,
        fsm_store,
        "c1",
        {"add": add, "multiply": multiply},
        model="m",
        messages=[{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}],
    )
    assert fsm_replay_server.failures == []  # every request the server checked was right
    assert fsm_store.history("c1")[-1]["role"] == "assistant"
