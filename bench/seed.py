"""Seed a realistic conversation store with N tool calls, fast, valid under every constraint.

The rows are what ``ConversationStore`` would write for agent conversations: an optional system
prompt, then exchanges of a user message, one to three assistant turns with 1-6 parallel tool
calls each (and their results), and a final assistant answer. Tools, models, arguments, usage
and timestamps (spread over ``--days`` days) follow skewed, realistic distributions; a few call
ids are ``""`` or repeated, as some providers send them. About ``--attempt-rate`` of the tool
turns are preceded by a recorded attempt (truncated by ``length``, cut at EOF, stopped by a
content filter or a server error, or with invalid JSON) with its calls and anomalies.

Conversations run side by side (a batch of 200 at a time, as on a busy server), so the rows of
one conversation are interleaved with others' in insertion order, and each conversation's rows are
generated and inserted in seq order: the ``prev`` chain, the result slots and the block ends of
:mod:`fsm.store.models` all hold.

Loading, in bulk, not row by row through the ORM:

* **SQLite**: ``executemany`` of plain tuples with foreign keys ON, so every row is checked as it
  goes in; a batch of conversations is inserted in layers (the messages up to an assistant
  message, its calls, its results, ...) so that each row's parents exist before it; one
  transaction per batch.
* **PostgreSQL**: ``COPY`` in one transaction. The foreign keys of the five tables are dropped
  first and re-created afterwards from their exact definitions (``pg_get_constraintdef``) as
  ``NOT VALID`` followed by ``VALIDATE CONSTRAINT``: PostgreSQL then checks every row with one
  set-based join per key instead of one trigger call per row, which is how ``pg_restore`` loads
  too. Checks, unique keys and indexes stay in force during the load.

The store must be at head (it is upgraded first) and hold no conversations. PostgreSQL is then
analyzed (as autovacuum would); SQLite is left un-analyzed, as fsm's stores are in practice.

Usage::

    python bench/seed.py --db sqlite:///big.db --calls 1000000
    python bench/seed.py --db postgresql+psycopg://postgres@localhost/test --calls 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from queue import Queue
from typing import Any

import sqlalchemy as sa

from fsm.store import upgrade
from fsm.store.engine import create_engine, display_url, normalize_url
from fsm.store.plans import usage_columns

TABLES = (
    "fsm_conversations",
    "fsm_messages",
    "fsm_tool_calls",
    "fsm_attempts",
    "fsm_attempt_calls",
)

MESSAGE_COLUMNS = (
    "conversation_id",
    "seq",
    "role",
    "content",
    "model",
    "response_id",
    "choice",
    "finish_reason",
    "usage",
    "created_at",
    "n_calls",
    "slots_left",
    "prev_seq",
    "prev_slots_left",
    "tool_call_id",
    "assistant_seq",
    "call_position",
    "block_end_seq",
    # the token columns of migration 0006, as the store writes them (plans.usage_columns)
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "usage_unreadable",
)
CALL_COLUMNS = (
    "conversation_id",
    "assistant_seq",
    "position",
    "assistant_n_calls",
    "call_id",
    "provider_index",
    "type",
    "name",
    "arguments",
    "raw_arguments",
    "repaired",
    "state",
)
CONVERSATION_COLUMNS = ("id", "created_at", "meta")
ATTEMPT_COLUMNS = (
    "id",
    "conversation_id",
    "created_at",
    "at_seq",
    "response_id",
    "choice",
    "model",
    "finish_reason",
    "complete",
    "end_how",
    "end_reason",
    "content",
    "usage",
    "anomalies",
)
ATTEMPT_CALL_COLUMNS = (
    "conversation_id",
    "attempt_id",
    "position",
    "provider_index",
    "call_id",
    "type",
    "name",
    "arguments",
    "raw_arguments",
    "repaired",
    "state",
    "reason",
)

#: (model, share of conversations, share of its tool turns preceded by a failed attempt, x rate)
MODELS: list[tuple[str, float, float]] = [
    ("gpt-4o-2024-08-06", 0.38, 1.0),
    ("gpt-4o-mini", 0.27, 1.3),
    ("deepseek-chat", 0.15, 1.6),
    ("qwen3-max", 0.12, 2.0),
    ("llama-3.3-70b-versatile", 0.08, 3.0),
]

CITIES = ["Paris", "Berlin", "Tokyo", "São Paulo", "Zürich", "Lagos", "Montréal", "Москва", "Oslo"]
WORDS = ["invoice", "refund", "latency", "outage", "release", "sqlite", "quota", "budget", "deploy"]


# Arguments are formatted directly (the values need no JSON escaping), except where noted.
def _weather(rng: random.Random) -> str:
    units = "metric" if rng.random() < 0.7 else "imperial"
    return f'{{"city": "{CITIES[int(rng.random() * len(CITIES))]}", "units": "{units}"}}'


def _search(rng: random.Random) -> str:
    words = " ".join(rng.sample(WORDS, 3))
    return f'{{"query": "{words}", "max_results": {(3, 5, 10)[int(rng.random() * 3)]}}}'


def _read_file(rng: random.Random) -> str:
    return f'{{"path": "/srv/app/src/module_{int(rng.random() * 400)}.py"}}'


def _sql(rng: random.Random) -> str:
    customer = int(rng.random() * 10**6)
    return f'{{"query": "SELECT * FROM orders WHERE customer_id = {customer} LIMIT 20"}}'


def _order(rng: random.Random) -> str:
    items = "true" if rng.random() < 0.5 else "false"
    return f'{{"order_id": {int(rng.random() * 10**7)}, "include_items": {items}}}'


def _email(rng: random.Random) -> str:
    return json.dumps(
        {
            "to": f"user{rng.randrange(10**5)}@example.com",
            "subject": f"About your {rng.choice(WORDS)}",
            "body": "Hello,\nplease find the details below.\n",
        }
    )


def _calc(rng: random.Random) -> str:
    return f'{{"expression": "{int(rng.random() * 1000)} * {int(rng.random() * 1000)} + 7"}}'


def _ticket(rng: random.Random) -> str:
    priority = rng.choice(["low", "normal", "normal", "high", "urgent"])
    return json.dumps({"title": f"{rng.choice(WORDS)} issue", "priority": priority})


def _translate(rng: random.Random) -> str:
    text = rng.choice(["good morning", "thank you", "where is the station?"])
    return json.dumps({"text": text, "target": rng.choice(["fr", "de", "ja"])})


def _no_args(rng: random.Random) -> str:
    return rng.choice(["", "{}", "{}", "{}"])


def _delete(rng: random.Random) -> str:
    return json.dumps({"user_id": rng.randrange(10**6), "confirm": True})


#: (tool name, weight, arguments generator). ``delete_account`` is deliberately rare.
TOOLS: list[tuple[str, float, Any]] = [
    ("get_weather", 22, _weather),
    ("search_web", 18, _search),
    ("read_file", 14, _read_file),
    ("run_sql", 10, _sql),
    ("lookup_order", 9, _order),
    ("calculator", 8, _calc),
    ("get_time", 6, _no_args),
    ("create_ticket", 5, _ticket),
    ("translate", 4, _translate),
    ("send_email", 3, _email),
    ("list_files", 1, _no_args),
    ("delete_account", 0.02, _delete),
]

RESULTS = [
    '{"ok": true}',
    '{"temp_c": 18, "sky": "sunny"}',
    '{"rows": 3}',
    '{"results": ["a", "b", "c"]}',
    "done",
    '{"error": "not found"}',
]

#: failure scenarios of an attempt: (finish_reason, end_how, end_reason, call state, reason,
#: anomaly kind or None, weight)
FAILURES: list[tuple[str | None, str, str | None, str, str, str | None, float]] = [
    ("length", "done", None, "truncated", "length", None, 45),
    (None, "eof", None, "aborted", "eof", "incomplete_event_at_eof", 25),
    ("content_filter", "done", None, "aborted", "content_filter", None, 8),
    (
        None,
        "error",
        "upstream error: overloaded",
        "aborted",
        "upstream error: overloaded",
        None,
        12,
    ),
    ("tool_calls", "done", None, "truncated", "invalid_json", "delta_after_finish", 10),
]


@dataclass
class Batch:
    """Rows of a batch of complete conversations, messages and calls in dependency layers."""

    conversations: list[tuple[Any, ...]] = field(default_factory=list)
    #: layers alternate: messages (even), tool calls (odd)
    layers: list[list[tuple[Any, ...]]] = field(default_factory=list)
    attempts: list[tuple[Any, ...]] = field(default_factory=list)
    attempt_calls: list[tuple[Any, ...]] = field(default_factory=list)
    calls: int = 0
    messages: int = 0


@dataclass
class SeedReport:
    """What :func:`seed` wrote, and how long it took."""

    url: str
    conversations: int
    messages: int
    calls: int
    attempts: int
    attempt_calls: int
    seconds: float
    #: seconds spent validating foreign keys and analyzing (PostgreSQL), included in ``seconds``
    finish_seconds: float

    def summary(self) -> str:
        rate = self.calls / self.seconds if self.seconds else 0.0
        return (
            f"{self.url}: {self.conversations:,} conversations, {self.messages:,} messages, "
            f"{self.calls:,} tool calls, {self.attempts:,} attempts ({self.attempt_calls:,} "
            f"calls) in {self.seconds:.1f} s ({rate:,.0f} calls/s; of which "
            f"{self.finish_seconds:.1f} s validating/analyzing)"
        )


class Generator:
    """Generates conversations; every random choice comes from one seeded ``Random``."""

    def __init__(self, *, seed: int, days: float, attempt_rate: float, now: datetime) -> None:
        self.rng = random.Random(seed)
        self.epoch = int((now - timedelta(days=days)).timestamp())
        self.dates: dict[int, str] = {}
        self.span = days * 86400.0
        self.attempt_rate = attempt_rate
        self.next_attempt_id = 1
        self.tool_names = [t[0] for t in TOOLS]
        self.tool_weights = [t[1] for t in TOOLS]
        self.tool_args = {t[0]: t[2] for t in TOOLS}
        self.model_names = [m[0] for m in MODELS]
        self.model_weights = [m[1] for m in MODELS]
        self.model_failure = {m[0]: m[2] for m in MODELS}
        self.n_conversations = 0

    def _call_id(self, position: int, style: int) -> str:
        if style == 1:  # a provider that sends "" ids (Alibaba's compatible mode)
            return ""
        if style == 2:  # a provider that numbers calls per message (ids repeat across turns)
            return f"call_{position}"
        return f"call_{self.rng.getrandbits(96):024x}"

    def _ts(self, t: float) -> str:
        """``t`` seconds after the start, as SQLite's ``CURRENT_TIMESTAMP`` writes it (UTC)."""
        seconds = self.epoch + int(t)
        day, rest = divmod(seconds, 86400)
        date = self.dates.get(day)
        if date is None:
            date = self.dates[day] = datetime.fromtimestamp(day * 86400, UTC).strftime("%Y-%m-%d")
        hours, rest = divmod(rest, 3600)
        return f"{date} {hours:02d}:{rest // 60:02d}:{rest % 60:02d}"

    def conversation(self, batch: Batch, target_calls: int) -> int:
        """Append one conversation's rows to ``batch``; return its number of calls."""
        rng = self.rng
        self.n_conversations += 1
        cid = f"conv-{self.n_conversations:08d}-{rng.getrandbits(32):08x}"
        model = rng.choices(self.model_names, self.model_weights)[0]
        fail_rate = self.attempt_rate * self.model_failure[model]
        style = rng.choices([0, 1, 2], [0.96, 0.015, 0.025])[0]
        t = rng.random() * self.span
        batch.conversations.append((cid, self._ts(t), None))
        layers: list[list[tuple[Any, ...]]] = [[]]
        seq = 0
        calls = 0

        def message(role: str, content: str | None, **extra: Any) -> tuple[Any, ...]:
            nonlocal seq
            n_calls = extra.get("n_calls", 0)
            if role == "assistant":
                slots_left = n_calls
            elif role == "tool":
                slots_left = extra["prev_slots_left"] - 1
            else:
                slots_left = 0
            row = (
                cid,
                seq,
                role,
                content,
                extra.get("model"),
                extra.get("response_id"),
                extra.get("choice"),
                extra.get("finish_reason"),
                extra.get("usage"),
                self._ts(t),
                n_calls,
                slots_left,
                seq - 1 if seq else None,
                extra.get("prev_slots_left", 0) if seq else None,
                extra.get("tool_call_id"),
                extra.get("assistant_seq"),
                extra.get("call_position"),
                seq + n_calls if role == "assistant" and n_calls else None,
                *_token_columns(extra.get("usage")),
            )
            seq += 1
            return row

        def usage() -> str:
            prompt = rng.randrange(200, 6000) + 40 * seq
            completion = rng.randrange(10, 400)
            return (
                f'{{"prompt_tokens": {prompt}, "completion_tokens": {completion}, '
                f'"total_tokens": {prompt + completion}}}'
            )

        if rng.random() < 0.7:
            layers[-1].append(message("system", "You are a helpful operations assistant."))
        while calls < target_calls:
            t += rng.uniform(5, 600)
            layers[-1].append(
                message("user", f"Question {seq}: can you check the {WORDS[seq % 9]}?")
            )
            for _turn in range(rng.choices([1, 2, 3], [0.55, 0.3, 0.15])[0]):
                if calls >= target_calls:
                    break
                n = rng.choices([1, 2, 3, 4, 6], [0.6, 0.25, 0.1, 0.04, 0.01])[0]
                n = min(n, target_calls - calls)
                names = rng.choices(self.tool_names, self.tool_weights, k=n)
                args = [self.tool_args[name](rng) for name in names]
                ids = [self._call_id(p, style) for p in range(n)]
                t += rng.uniform(0.5, 8)
                if rng.random() < fail_rate:
                    self._attempt(batch, cid, seq, model, names, args, self._ts(t))
                    t += rng.uniform(0.5, 5)
                response_id = f"chatcmpl-{rng.getrandbits(64):016x}"
                aseq = seq
                layers[-1].append(
                    message(
                        "assistant",
                        None,
                        model=model,
                        response_id=response_id,
                        choice=0,
                        finish_reason="tool_calls",
                        usage=usage(),
                        n_calls=n,
                    )
                )
                layers.append(
                    [
                        (
                            cid,
                            aseq,
                            p,
                            n,
                            ids[p],
                            p,
                            "function",
                            names[p],
                            args[p],
                            None,
                            False,
                            "finished",
                        )
                        for p in range(n)
                    ]
                )
                layers.append([])
                t += rng.uniform(0.1, 3)
                for p in range(n):
                    layers[-1].append(
                        message(
                            "tool",
                            rng.choice(RESULTS),
                            tool_call_id=ids[p],
                            assistant_seq=aseq,
                            call_position=p,
                            prev_slots_left=n - p,
                        )
                    )
                calls += n
            t += rng.uniform(1, 20)
            layers[-1].append(
                message(
                    "assistant",
                    "Here is what I found: everything looks fine.",
                    model=model,
                    response_id=f"chatcmpl-{rng.getrandbits(64):016x}",
                    choice=0,
                    finish_reason="stop",
                    usage=usage(),
                )
            )
        # merge this conversation's layers into the batch's, layer by layer
        for i, layer in enumerate(layers):
            if i == len(batch.layers):
                batch.layers.append([])
            batch.layers[i].extend(layer)
        batch.calls += calls
        batch.messages += seq
        return calls

    def _attempt(
        self,
        batch: Batch,
        cid: str,
        at_seq: int,
        model: str,
        names: Sequence[str],
        args: Sequence[str],
        created_at: str,
    ) -> None:
        rng = self.rng
        finish, how, end_reason, state, reason, anomaly, _w = rng.choices(
            FAILURES, [f[-1] for f in FAILURES]
        )[0]
        attempt_id = self.next_attempt_id
        self.next_attempt_id += 1
        anomalies = []
        if anomaly is not None:
            anomalies.append(
                {"kind": anomaly, "detail": f"seeded {anomaly}", "choice": 0, "event_number": 9}
            )
        batch.attempts.append(
            (
                attempt_id,
                cid,
                created_at,
                at_seq,
                f"chatcmpl-{rng.getrandbits(64):016x}",
                0,
                model,
                finish,
                False,
                how,
                end_reason,
                None,
                json.dumps({"prompt_tokens": rng.randrange(200, 6000), "completion_tokens": 0}),
                json.dumps(anomalies),
            )
        )
        last = len(names) - 1
        for p, (name, full) in enumerate(zip(names, args, strict=True)):
            cut = full[: max(1, len(full) * 2 // 3)] if full else ""
            if reason == "invalid_json" and p != last:
                row_state, row_reason, arguments = "finished", None, full
            else:
                row_state, row_reason, arguments = state, reason, cut if p == last else full
            batch.attempt_calls.append(
                (
                    cid,
                    attempt_id,
                    p,
                    p,
                    f"call_{rng.getrandbits(96):024x}",
                    "function",
                    name,
                    arguments,
                    None,
                    False,
                    row_state,
                    row_reason,
                )
            )

    def batches(self, calls: int, *, batch_conversations: int) -> Iterator[Batch]:
        """Batches of complete conversations until ``calls`` committed calls are generated.

        The conversations of a batch are interleaved layer by layer (see :class:`Batch`), as
        the turns of concurrent conversations are on a busy server.
        """
        left = calls
        while left > 0:
            batch = Batch()
            for _ in range(batch_conversations):
                if left <= 0:
                    break
                target = min(left, max(1, int(self.rng.lognormvariate(2.7, 0.7))))
                left -= self.conversation(batch, target)
            yield batch


def _prefetch(batches: Iterator[Batch], depth: int = 3) -> Iterator[Batch]:
    """Generate batches in a thread while the caller loads the previous ones (the drivers let
    other threads run while the database works)."""
    queue: Queue[Batch | BaseException | None] = Queue(maxsize=depth)

    def produce() -> None:
        try:
            for batch in batches:
                queue.put(batch)
        except BaseException as exc:  # handed to the consumer
            queue.put(exc)
        else:
            queue.put(None)

    thread = threading.Thread(target=produce, name="seed-generator", daemon=True)
    thread.start()
    while True:
        item = queue.get()
        if item is None:
            break
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()


# -- loading ------------------------------------------------------------------------------------
def _token_columns(usage: str | None) -> tuple[int | None, ...]:
    """The token columns of a message with this usage text, as the store computes them."""
    columns = usage_columns(None if usage is None else json.loads(usage))
    return tuple(columns[key] for key in MESSAGE_COLUMNS[-4:])


def _insert_sql(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _load_sqlite(engine: sa.Engine, batches: Iterator[Batch], report: dict[str, int]) -> None:
    raw = engine.raw_connection()
    try:
        driver = raw.driver_connection
        assert driver is not None
        cursor = driver.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=OFF")
        cursor.execute("PRAGMA cache_size=-262144")
        sqls = {
            "conversations": _insert_sql("fsm_conversations", CONVERSATION_COLUMNS),
            "messages": _insert_sql("fsm_messages", MESSAGE_COLUMNS),
            "tool_calls": _insert_sql("fsm_tool_calls", CALL_COLUMNS),
            "attempts": _insert_sql("fsm_attempts", ATTEMPT_COLUMNS),
            "attempt_calls": _insert_sql("fsm_attempt_calls", ATTEMPT_CALL_COLUMNS),
        }
        for batch in batches:
            cursor.execute("BEGIN IMMEDIATE")
            cursor.executemany(sqls["conversations"], batch.conversations)
            for i, layer in enumerate(batch.layers):
                cursor.executemany(sqls["tool_calls" if i % 2 else "messages"], layer)
            cursor.executemany(sqls["attempts"], batch.attempts)
            cursor.executemany(sqls["attempt_calls"], batch.attempt_calls)
            cursor.execute("COMMIT")
            _count(report, batch)
        cursor.close()
    finally:
        raw.close()


def _load_postgres(engine: sa.Engine, batches: Iterator[Batch], report: dict[str, int]) -> float:
    """COPY everything in one transaction with the foreign keys re-created and validated at the
    end; returns the seconds spent validating and analyzing."""
    raw = engine.raw_connection()
    finish = 0.0
    try:
        pg = raw.driver_connection
        assert pg is not None
        with pg.cursor() as cur:
            cur.execute("SET LOCAL synchronous_commit = off")
            cur.execute("SET LOCAL TimeZone = 'UTC'")  # the generated timestamps are UTC
            cur.execute("SET LOCAL maintenance_work_mem = '512MB'")
            cur.execute("SET LOCAL work_mem = '256MB'")
            # a hash-partitioned store (fsm db upgrade --partitions N): only the keys declared
            # on the tables themselves (conparentid = 0), not the copies PostgreSQL keeps for
            # each partition of the referenced table, which go and come back with them
            cur.execute(
                "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid), "
                "r.relkind = 'p' "
                "FROM pg_constraint c JOIN pg_class r ON r.oid = c.conrelid "
                "WHERE c.contype = 'f' AND c.conparentid = 0 "
                "AND c.conrelid = ANY(%s::regclass[]) ORDER BY c.conname",
                (list(TABLES),),
            )
            fks = cur.fetchall()
            for table, name, _definition, _partitioned in fks:
                cur.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
            copies = [
                ("conversations", CONVERSATION_COLUMNS),
                ("messages", MESSAGE_COLUMNS),
                ("tool_calls", CALL_COLUMNS),
                ("attempts", ATTEMPT_COLUMNS),
                ("attempt_calls", ATTEMPT_CALL_COLUMNS),
            ]
            for batch in batches:
                rows = {
                    "conversations": batch.conversations,
                    "messages": [
                        r for i, layer in enumerate(batch.layers) if not i % 2 for r in layer
                    ],
                    "tool_calls": [
                        r for i, layer in enumerate(batch.layers) if i % 2 for r in layer
                    ],
                    "attempts": batch.attempts,
                    "attempt_calls": batch.attempt_calls,
                }
                for table, columns in copies:
                    if not rows[table]:
                        continue
                    with cur.copy(f"COPY fsm_{table} ({', '.join(columns)}) FROM STDIN") as copy:
                        for row in rows[table]:
                            copy.write_row(row)
                _count(report, batch)
            begin = time.perf_counter()
            for table, name, definition, partitioned in fks:
                # PostgreSQL (before 18) has no NOT VALID key on a partitioned table: added
                # there, the key is checked at once (set-based too)
                later = "" if partitioned else " NOT VALID"
                cur.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}{later}')
            for table, name, _definition, partitioned in fks:
                if not partitioned:
                    cur.execute(f'ALTER TABLE {table} VALIDATE CONSTRAINT "{name}"')
            cur.execute(
                "SELECT setval(pg_get_serial_sequence('fsm_attempts', 'id'), "
                "(SELECT coalesce(max(id), 0) + 1 FROM fsm_attempts), false)"
            )
            finish += time.perf_counter() - begin
        pg.commit()
        begin = time.perf_counter()
        pg.autocommit = True
        with pg.cursor() as cur:
            for table in TABLES:
                cur.execute(f"VACUUM (ANALYZE) {table}")
        finish += time.perf_counter() - begin
    finally:
        raw.close()
    return finish


def _count(report: dict[str, int], batch: Batch) -> None:
    report["conversations"] += len(batch.conversations)
    report["messages"] += batch.messages
    report["calls"] += batch.calls
    report["attempts"] += len(batch.attempts)
    report["attempt_calls"] += len(batch.attempt_calls)


def seed(
    url: str | sa.URL,
    calls: int,
    *,
    seed: int = 0,
    days: float = 30.0,
    attempt_rate: float = 0.03,
    batch_conversations: int = 200,
    now: datetime | None = None,
) -> SeedReport:
    """Fill the (empty) store at ``url`` with about ``calls`` tool calls (exactly ``calls``
    committed calls, plus the calls of attempts) and return what was written."""
    parsed = normalize_url(url)
    upgrade(parsed)
    engine = create_engine(parsed, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if conn.execute(sa.text("SELECT count(*) FROM fsm_conversations")).scalar():
                raise SystemExit(
                    f"{display_url(parsed)} already holds conversations: seed an empty store"
                )
        generator = Generator(
            seed=seed,
            days=days,
            attempt_rate=attempt_rate,
            now=now or datetime(2026, 11, 30, tzinfo=UTC),
        )
        batches = _prefetch(generator.batches(calls, batch_conversations=batch_conversations))
        report = dict.fromkeys(
            ("conversations", "messages", "calls", "attempts", "attempt_calls"), 0
        )
        start = time.perf_counter()
        finish = 0.0
        if engine.dialect.name == "postgresql":
            finish = _load_postgres(engine, batches, report)
        else:
            _load_sqlite(engine, batches, report)
        seconds = time.perf_counter() - start
    finally:
        engine.dispose()
    return SeedReport(url=display_url(parsed), seconds=seconds, finish_seconds=finish, **report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", required=True, metavar="URL", help="SQLAlchemy URL of the store")
    parser.add_argument("--calls", type=int, default=1_000_000, help="committed tool calls")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same rows)")
    parser.add_argument("--days", type=float, default=30.0, help="time span of the data")
    parser.add_argument(
        "--attempt-rate", type=float, default=0.03, help="share of tool turns with a failed attempt"
    )
    args = parser.parse_args(argv)
    report = seed(
        args.db, args.calls, seed=args.seed, days=args.days, attempt_rate=args.attempt_rate
    )
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
