"""The history contract of ``spec/store.md`` as set-based SQL over a range of conversations, for the integrity check (:mod:`fsm.store.audit.integrity`), with its per-engine rewriting."""

from __future__ import annotations

import re

CHECK_SEQ = """
SELECT g.conversation_id, g.n, g.d, g.lo, g.hi, CASE WHEN c.id IS NULL THEN 1 ELSE 0 END
FROM (
  SELECT conversation_id, count(*) AS n, {distinct} AS d, min(seq) AS lo, max(seq) AS hi
  FROM fsm_messages m WHERE RANGE(m) AND SEQ_OK(m) GROUP BY conversation_id
) g LEFT JOIN fsm_conversations c ON c.id = g.conversation_id
WHERE g.n <> BIG(g.hi) + 1 OR g.lo <> 0 OR g.d <> g.n OR c.id IS NULL
"""

CHECK_SEQ_DETAIL = """
SELECT conversation_id, seq, p_seq FROM (
  SELECT m.conversation_id, m.seq,
         lag(m.seq) OVER (PARTITION BY m.conversation_id ORDER BY m.seq) AS p_seq
  FROM fsm_messages m WHERE m.conversation_id IN :ids AND SEQ_OK(m)
) x
WHERE (p_seq IS NULL AND seq <> 0) OR seq = p_seq OR seq > BIG(p_seq) + 1
"""

# ``t`` and ``a`` are the checks (lookups that read only a unique index: the call with the
# result's link *and id*, the assistant message with the result's link *and* the n_calls its
# slots_left implies); the failing rows are set apart first (MATERIALIZED: on both engines the
# joins that describe them then run for those rows only). COUNT_CHECK(m) is true when an
# assistant message's call rows do not number its n_calls (see COUNT_CHECKS).
CHECK_MESSAGES = """
WITH bad AS MATERIALIZED (
  SELECT m.conversation_id, m.seq, m.role, m.n_calls, m.slots_left, m.prev_seq,
         m.prev_slots_left, m.tool_call_id, m.assistant_seq, m.call_position, m.block_end_seq
  FROM fsm_messages m
  LEFT JOIN fsm_tool_calls t
    ON t.conversation_id = m.conversation_id AND t.assistant_seq = m.assistant_seq
       AND t.position = m.call_position AND t.call_id = m.tool_call_id
       AND t.assistant_n_calls = BIG(m.slots_left) + m.call_position + 1 AND RANGE(t)
  COUNT_JOIN
  WHERE RANGE(m) AND (
    -- each role's own rules (one branch per row)
    CASE m.role
      WHEN 'tool' THEN CASE
        WHEN m.tool_call_id IS NULL
          OR COALESCE(BIG(m.assistant_seq) + 1 + m.call_position, -1) <> m.seq
          OR m.n_calls <> 0 OR m.block_end_seq IS NOT NULL
          OR COALESCE(m.prev_slots_left, 0) <= 0 OR m.slots_left <> BIG(m.prev_slots_left) - 1
          OR t.conversation_id IS NULL
        THEN 1 ELSE 0 END
      WHEN 'assistant' THEN CASE
        WHEN m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls < 0 OR m.slots_left <> m.n_calls
          OR COALESCE(m.block_end_seq, -1)
             <> CASE WHEN m.n_calls > 0 THEN BIG(m.seq) + m.n_calls ELSE -1 END
          OR COALESCE(m.prev_slots_left, 0) <> 0
          OR (m.n_calls > 0 AND COUNT_CHECK(m))
        THEN 1 ELSE 0 END
      ELSE CASE
        WHEN m.role NOT IN ('system', 'developer', 'user')
          OR m.tool_call_id IS NOT NULL OR m.assistant_seq IS NOT NULL
          OR m.call_position IS NOT NULL OR m.n_calls <> 0 OR m.slots_left <> 0
          OR m.block_end_seq IS NOT NULL OR COALESCE(m.prev_slots_left, 0) <> 0
        THEN 1 ELSE 0 END
    END = 1
    -- every role: the link to the previous row
    OR COALESCE(m.prev_seq, -1) <> BIG(m.seq) - 1
    OR (CASE WHEN m.prev_slots_left IS NULL THEN 0 ELSE 1 END)
       <> (CASE WHEN m.seq = 0 THEN 0 ELSE 1 END)
  )
)
SELECT bad.*,
       (SELECT t2.call_id FROM fsm_tool_calls t2
        WHERE t2.conversation_id = bad.conversation_id AND t2.assistant_seq = bad.assistant_seq
          AND t2.position = bad.call_position),
       (SELECT t2.assistant_n_calls FROM fsm_tool_calls t2
        WHERE t2.conversation_id = bad.conversation_id AND t2.assistant_seq = bad.assistant_seq
          AND t2.position = bad.call_position),
       (SELECT a2.role FROM fsm_messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT count(*) FROM fsm_tool_calls c
        WHERE c.conversation_id = bad.conversation_id AND c.assistant_seq = bad.seq),
       (SELECT s.role FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position),
       (SELECT s.assistant_seq FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position),
       (SELECT s.call_position FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.call_position)
FROM bad
"""

#: per engine: how CHECK_MESSAGES counts an assistant message's calls. SQLite reads the
#: primary key's range of each assistant message (a nested loop is all it has); PostgreSQL
#: hash-joins the batch's counts.
COUNT_CHECKS = {
    "sqlite": (
        "",
        "m.n_calls <> (SELECT count(*) FROM fsm_tool_calls c "
        "WHERE c.conversation_id = m.conversation_id AND c.assistant_seq = m.seq)",
    ),
    "postgresql": (
        "LEFT JOIN (SELECT c.conversation_id, c.assistant_seq, count(*) AS n FROM fsm_tool_calls c "
        "WHERE RANGE(c) GROUP BY c.conversation_id, c.assistant_seq) g "
        "ON g.conversation_id = m.conversation_id AND g.assistant_seq = m.seq",
        "m.n_calls <> COALESCE(g.n, 0)",
    ),
}

CHECK_CALLS = """
WITH bad AS MATERIALIZED (
  SELECT t.conversation_id, t.assistant_seq, t.position, t.call_id, t.name, t.state,
         t.assistant_n_calls, t.repaired, CASE WHEN t.raw_arguments IS NULL THEN 1 ELSE 0 END
         AS no_raw, CASE WHEN r.conversation_id IS NULL THEN 0 ELSE 1 END AS has_result
  FROM fsm_tool_calls t
  LEFT JOIN (
    SELECT a.conversation_id, a.seq, a.n_calls FROM fsm_messages a WHERE a.n_calls > 0 AND RANGE(a)
  ) a
    ON a.conversation_id = t.conversation_id AND a.seq = t.assistant_seq
       AND a.n_calls = t.assistant_n_calls
  LEFT JOIN fsm_messages r
    ON r.conversation_id = t.conversation_id AND r.assistant_seq = t.assistant_seq
       AND r.call_position = t.position AND RANGE(r)
  WHERE RANGE(t) AND (
       a.conversation_id IS NULL OR r.conversation_id IS NULL OR t.state <> 'finished'
    OR t.position < 0 OR t.position >= t.assistant_n_calls
    OR (t.repaired AND t.raw_arguments IS NULL)
    OR (NOT t.repaired AND t.raw_arguments IS NOT NULL)
  )
)
SELECT bad.*,
       (SELECT a2.role FROM fsm_messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT a2.n_calls FROM fsm_messages a2
        WHERE a2.conversation_id = bad.conversation_id AND a2.seq = bad.assistant_seq),
       (SELECT s.role FROM fsm_messages s
        WHERE s.conversation_id = bad.conversation_id
          AND s.seq = BIG(bad.assistant_seq) + 1 + bad.position)
FROM bad
"""

ORPHAN_ATTEMPTS = """
SELECT x.conversation_id, x.n FROM (
  SELECT conversation_id, count(*) AS n FROM fsm_attempts a WHERE RANGE(a) GROUP BY conversation_id
) x WHERE NOT EXISTS (SELECT 1 FROM fsm_conversations c WHERE c.id = x.conversation_id)
"""

ORPHAN_ATTEMPT_CALLS = """
SELECT ac.attempt_id, count(*) FROM fsm_attempt_calls ac
WHERE NOT EXISTS (SELECT 1 FROM fsm_attempts a WHERE a.id = ac.attempt_id)
GROUP BY ac.attempt_id ORDER BY ac.attempt_id
"""


_RANGE = re.compile(r"RANGE\((\w+)(?:\.(\w+))?\)")
_BIG = re.compile(r"BIG\(([\w.]+)\)")
_SEQ_OK = re.compile(r"SEQ_OK\((\w+)\)")


def ranged_sql(sql: str, lo: str | None, hi: str | None) -> str:
    """``sql`` with each ``RANGE(alias)`` (or ``RANGE(alias.column)``) replaced by the batch's
    bounds on that alias's conversation id (or that column)."""

    def bounds(match: re.Match[str]) -> str:
        column = f"{match.group(1)}.{match.group(2) or 'conversation_id'}"
        parts = []
        if lo is not None:
            parts.append(f"{column} >= :lo")
        if hi is not None:
            parts.append(f"{column} < :hi")
        return " AND ".join(parts) or "1 = 1"

    return _RANGE.sub(bounds, sql)


def engine_sql(sql: str, dialect: str) -> str:
    """``sql`` with the engine's ``BIG(x)`` and ``SEQ_OK(alias)``."""
    if dialect == "postgresql":
        sql = _BIG.sub(r"CAST(\1 AS BIGINT)", sql)
        return _SEQ_OK.sub(r"\1.seq IS NOT NULL", sql)
    sql = _BIG.sub(r"\1", sql)
    return _SEQ_OK.sub(r"typeof(\1.seq) = 'integer' AND typeof(\1.conversation_id) = 'text'", sql)
