"""Stores for the viewer's tests: hostile values everywhere a provider (or an attacker who
controls a tool's output) can put text, written through the store's API."""

from __future__ import annotations

import sqlalchemy as sa

from fsm.store import ConversationStore
from tests.helpers.store import make_turn

#: a conversation id with every character that must be percent-encoded in a path
ODD_ID = "team/a b%20c?d#e\u00fc\U0001f600"
#: the conversation that holds the hostile values
HOSTILE_ID = "<script>alert('id')</script>"
#: hostile values and where they are stored (every one must render as text)
HOSTILE: dict[str, str] = {
    "arguments": '{"q": "<script>alert(1)</script>", "img": "<img src=x onerror=alert(2)>"}',
    "name": "<svg onload=alert(3)>",
    "call_id": '"><script>alert(4)</script>',
    "result": '<iframe src="javascript:alert(5)"></iframe><a href="javascript:alert(6)">x</a>',
    "content": "\u202eevil\u202c \x1b[31mred\x1b[0m \x07bell \u200bzero-width",
    "model": "<b onmouseover=alert(7)>model</b>",
}
#: the cut arguments of the hostile attempt (not JSON, shown raw and marked)
HOSTILE_CUT = '{"html": "<img src=x onerror=alert(8)>'


def build(url: sa.URL | str) -> dict[str, str]:
    """Write the viewer's test data: a plain conversation, one with an odd id, the hostile one,
    and 30 more (to page through); returns their ids by role."""
    with ConversationStore(url) as store:
        store.create_conversation("plain")
        store.append("plain", [{"role": "user", "content": "weather?"}])
        store.commit_turn(
            "plain",
            make_turn([("call_w1", "get_weather", '{"city": "Paris"}')], response_id="r-plain"),
            ["sunny"],
        )
        cut = make_turn(
            [("call_cut", "get_weather", '{"city": "Par')],
            response_id="r-cut",
            finish_reason="length",
        )
        store.record_attempt("plain", cut)

        store.create_conversation(ODD_ID)
        store.append(ODD_ID, [{"role": "user", "content": "odd id"}])
        store.commit_turn(ODD_ID, make_turn([("c-odd", "echo", "{}")], response_id="r-odd"), ["ok"])

        store.create_conversation(HOSTILE_ID)
        store.append(HOSTILE_ID, [{"role": "user", "content": HOSTILE["content"]}])
        store.commit_turn(
            HOSTILE_ID,
            make_turn(
                [(HOSTILE["call_id"], HOSTILE["name"], HOSTILE["arguments"])],
                response_id="r-hostile",
                model=HOSTILE["model"],
                content=HOSTILE["content"],
            ),
            [HOSTILE["result"]],
        )
        store.record_attempt(
            HOSTILE_ID,
            make_turn(
                [("call_cut_hostile", HOSTILE["name"], HOSTILE_CUT)],
                response_id="r-hostile-cut",
                finish_reason="length",
                model=HOSTILE["model"],
            ),
        )
        for i in range(30):
            cid = f"bulk-{i:02d}"
            store.create_conversation(cid)
            store.append(cid, [{"role": "user", "content": f"question {i}"}])
            store.commit_turn(
                cid,
                make_turn(
                    [(f"call_b{i}_{k}", "lookup", f'{{"n": {i}, "k": {k}}}') for k in range(4)],
                    response_id=f"r-bulk-{i}",
                ),
                [f"result {i}.{k}" for k in range(4)],
            )
    return {"plain": "plain", "odd": ODD_ID, "hostile": HOSTILE_ID}


def clone_attempts(url: sa.URL | str, conversation_id: str, count: int) -> None:
    """Add ``count`` copies of the conversation's first attempt (with its calls), in one
    statement per table: a conversation with tens of thousands of attempts in a second or two
    (``record_attempt`` would take minutes)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    numbers = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :count) "
    columns = (
        "conversation_id, created_at, at_seq, model, finish_reason, complete, end_how, "
        "end_reason, content, reasoning, refusal, usage, anomalies, error, format"
    )
    call_columns = (
        "position, provider_index, call_id, type, name, arguments, raw_arguments, repaired, "
        "state, reason, result, conversation_id"
    )
    try:
        with engine.begin() as conn:
            first, top = conn.execute(
                sa.text(
                    "SELECT min(id), (SELECT max(id) FROM fsm_attempts) FROM fsm_attempts "
                    "WHERE conversation_id = :c"
                ),
                {"c": conversation_id},
            ).one()
            params = {"count": count, "first": first, "top": top}
            conn.execute(
                sa.text(
                    f"{numbers}INSERT INTO fsm_attempts (id, response_id, {columns}) "
                    f"SELECT :top + n.i, 'clone-' || n.i, {columns} FROM fsm_attempts, n "
                    "WHERE fsm_attempts.id = :first"
                ),
                params,
            )
            conn.execute(
                sa.text(
                    f"{numbers}INSERT INTO fsm_attempt_calls (attempt_id, {call_columns}) "
                    f"SELECT :top + n.i, {call_columns} FROM fsm_attempt_calls, n "
                    "WHERE fsm_attempt_calls.attempt_id = :first"
                ),
                params,
            )
    finally:
        engine.dispose()
