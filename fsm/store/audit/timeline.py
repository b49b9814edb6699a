"""One conversation as a timeline, for the viewer of ``fsm audit serve`` (:mod:`fsm.store.audit.browse`, which re-exports it): its messages, tool calls and attempts, paged by ``seq``, every value read raw and leniently and cut to a page's budget."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import sqlalchemy as sa

from fsm.store.audit.filters import (
    INT64_MAX,
    INT64_MIN,
    row_key,
)
from fsm.store.audit.read import (
    ATTEMPT_CALLS,
    ATTEMPTS,
    CALLS,
    CONVERSATIONS,
    MESSAGES,
    Bind,
    Row,
    as_int,
    as_opt_text,
    as_text,
    connect,
    json_value,
    raw_column,
)
from fsm.store.codec import as_utc
from fsm.store.errors import InvalidFilterError

#: the most rows one page of either listing (the conversations and the timeline) returns.
MAX_PAGE: Final = 1000


# -- one conversation --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineCall(Row):
    """A tool call of history (state ``finished``) or of an attempt (any state), with its
    result: the content of its tool message for a call of history (``result_seq`` is that
    message's seq, ``result_tool_call_id`` the id it names), the result stored with an attempt's
    call otherwise."""

    position: int
    call_id: str
    name: str
    arguments: str
    raw_arguments: str | None
    repaired: bool | None
    state: str
    reason: str | None
    result: Any = None
    result_seq: int | None = None
    result_tool_call_id: str | None = None
    #: the fields cut at :data:`VALUE_CHARS` characters
    cut: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineMessage(Row):
    """A message of history, its tool calls (an assistant message) or the call it answers (a
    tool message: ``tool_call_id``, ``assistant_seq``, ``call_position``)."""

    seq: int
    role: str
    content: Any
    reasoning: str | None
    refusal: str | None
    name: str | None
    model: str | None
    finish_reason: str | None
    usage: Any
    created_at: datetime | None
    tool_call_id: str | None
    assistant_seq: int | None
    call_position: int | None
    calls: list[TimelineCall] = field(default_factory=list)
    #: the fields cut at :data:`VALUE_CHARS` characters (a cut JSON value is the text of its
    #: start)
    cut: list[str] = field(default_factory=list)
    #: whether the message has more than :data:`CALLS_PER_TURN` calls (not shown)
    more_calls: bool = False
    #: an assistant message's API (``chat``, ``responses``, ``anthropic``; one written before
    #: migration 0007 is ``chat``); ``None`` for the other roles
    format: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineAttempt(Row):
    """A recorded attempt (a turn that could not go to history) at ``at_seq``, where its turn
    would have gone, with its calls and the parser's anomalies (each a JSON object, shown as
    stored)."""

    id: int
    at_seq: int
    created_at: datetime | None
    model: str | None
    finish_reason: str | None
    complete: bool | None
    end_how: str | None
    end_reason: str | None
    error: str | None
    content: str | None
    reasoning: str | None
    refusal: str | None
    anomalies: Any
    calls: list[TimelineCall] = field(default_factory=list)
    #: whether the attempt has more than :data:`CALLS_PER_TURN` calls (not shown)
    more_calls: bool = False
    #: the API of the attempt's stream (``None``: unknown)
    format: str | None = None
    #: the fields cut at :data:`VALUE_CHARS` characters
    cut: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """A page of one conversation: its messages from ``after + 1`` on (at most ``limit``), and the
    attempts placed among them (an attempt at ``at_seq`` s comes before the message at s; the
    last page also holds the attempts after the last message), at most a page of them.
    ``next_after`` is the cursor of the next page (``None`` on the last); ``attempts_next`` the
    key of the last attempt shown when the same messages have more attempts (``None`` when
    all are shown)."""

    conversation_id: str
    created_at: datetime | None
    metadata: Any
    #: whether the metadata was cut at :data:`VALUE_CHARS` characters (then its text's start)
    metadata_cut: bool
    messages_total: int
    after: int | None
    messages: list[TimelineMessage]
    attempts: list[TimelineAttempt]
    next_after: int | None
    #: ``attempts_after=`` for the next page of attempts of the same messages (``None``: none)
    attempts_next: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The page as plain data (the viewer's JSON)."""
        return {
            "conversation_id": self.conversation_id,
            "created_at": self.created_at,
            "metadata": self.metadata,
            "metadata_cut": self.metadata_cut,
            "messages_total": self.messages_total,
            "after": self.after,
            "messages": [m.as_dict() for m in self.messages],
            "attempts": [a.as_dict() for a in self.attempts],
            "next_after": self.next_after,
            "attempts_next": None if self.attempts_next is None else list(self.attempts_next),
        }


def timeline(
    bind: Bind,
    conversation_id: str,
    *,
    after: int | None = None,
    limit: int = 200,
    attempts_after: tuple[int, int] | None = None,
    attempts_limit: int = 50,
) -> Timeline | None:
    """A page of the conversation ``conversation_id`` (``None`` when it does not exist): its
    messages with seq > ``after`` (all from 0 when ``None``), at most ``limit``, each assistant
    message with its calls and each call with its result, and the attempts among them: at most
    ``attempts_limit``, in ``(at_seq, id)`` order, after ``attempts_after`` (the
    :attr:`Timeline.attempts_next` of the page before, for a range of messages with more
    attempts than one page holds).

    A page is bounded in size too: each value holds at most :data:`VALUE_CHARS` characters (a
    longer one is cut there and its field named in the row's ``cut``), each turn at most
    :data:`CALLS_PER_TURN` calls (``more_calls`` says there are more), and the messages, then
    the attempts, stop once their values pass :data:`PAGE_CHARS` characters (the page's
    cursors then start after the last one shown)."""
    if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
        raise InvalidFilterError(f"limit must be an integer from 1 to {MAX_PAGE}, not {limit!r}")
    if type(attempts_limit) is not int or not 1 <= attempts_limit <= MAX_PAGE:
        raise InvalidFilterError(
            f"attempts_limit must be an integer from 1 to {MAX_PAGE}, not {attempts_limit!r}"
        )
    if after is not None and (type(after) is not int or not INT64_MIN <= after <= INT64_MAX):
        raise InvalidFilterError(f"after must be a seq (a 64-bit integer), not {after!r}")
    attempts_key = row_key(attempts_after, "ii", "a conversation's attempts")
    _check_lookup_id(conversation_id)
    c, m, t = CONVERSATIONS, MESSAGES, CALLS
    a, ac = ATTEMPTS, ATTEMPT_CALLS
    low = -1 if after is None else after
    with connect(bind, snapshot=True) as conn:
        raw = functools.partial(raw_column, conn)

        def cut(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
            # one character more than is kept: whether the value was cut, without its length
            return sa.func.substr(raw(column), 1, VALUE_CHARS + 1)

        head = conn.execute(
            sa.select(raw(c.c.created_at), cut(c.c.meta)).where(c.c.id == conversation_id)
        ).first()
        if head is None:
            return None
        total = conn.execute(
            sa.select(sa.func.max(m.c.seq)).where(m.c.conversation_id == conversation_id)
        ).scalar()
        rows = conn.execute(
            sa.select(
                m.c.seq,
                raw(m.c.role),
                *(
                    cut(col)
                    for col in (
                        m.c.content,
                        m.c.content_parts,
                        m.c.reasoning,
                        m.c.refusal,
                        m.c.name,
                        m.c.model,
                        m.c.finish_reason,
                        m.c.usage,
                    )
                ),
                raw(m.c.created_at),
                cut(m.c.tool_call_id),
                raw(m.c.assistant_seq),
                raw(m.c.call_position),
                raw(m.c.format),
            )
            .where(m.c.conversation_id == conversation_id, m.c.seq > low)
            .order_by(m.c.seq)
            .limit(limit + 1)
        ).all()
        more = len(rows) > limit
        rows = rows[:limit]
        high = rows[-1][0] if rows else low
        calls = conn.execute(
            sa.select(
                t.c.assistant_seq,
                t.c.position,
                *(cut(col) for col in (t.c.call_id, t.c.name, t.c.arguments, t.c.raw_arguments)),
                raw(t.c.repaired),
                raw(t.c.state),
            )
            .where(
                t.c.conversation_id == conversation_id,
                t.c.assistant_seq > low,
                t.c.assistant_seq <= high,
                t.c.position <= CALLS_PER_TURN,  # one more than shown: there are more
            )
            .order_by(t.c.assistant_seq, t.c.position)
        ).all()
        # the messages up to the page's budget (at least one)
        sizes: dict[int, int] = {}
        for row in calls:
            sizes[row[0]] = sizes.get(row[0], 0) + _size(row[2:6])
        used = 0
        for kept, row in enumerate(rows):
            used += _size(row[1:10]) + _size(row[11:12]) + sizes.get(row[0], 0)
            if used > PAGE_CHARS and kept > 0:
                rows, more = rows[:kept], True
                high = rows[-1][0]
                break
        attempt_bounds = [a.c.conversation_id == conversation_id, a.c.at_seq > low]
        if more:
            attempt_bounds.append(a.c.at_seq <= high)
        if attempts_key is not None:
            attempt_bounds.append(sa.tuple_(a.c.at_seq, a.c.id) > sa.tuple_(*attempts_key))
        # a page of attempts, by the index (conversation_id, at_seq, id)
        page_ids = (
            sa.select(a.c.id)
            .where(*attempt_bounds)
            .order_by(a.c.at_seq, a.c.id)
            .limit(attempts_limit)
            .subquery("page_ids")
        )
        attempts = conn.execute(
            sa.select(
                a.c.id,
                a.c.at_seq,
                raw(a.c.created_at),
                raw(a.c.complete),
                *(
                    cut(col)
                    for col in (
                        a.c.model,
                        a.c.finish_reason,
                        a.c.end_how,
                        a.c.end_reason,
                        a.c.error,
                        a.c.content,
                        a.c.reasoning,
                        a.c.refusal,
                        a.c.anomalies,
                    )
                ),
                raw(a.c.format),
            )
            .where(*attempt_bounds)
            .order_by(a.c.at_seq, a.c.id)
            .limit(attempts_limit + 1)
        ).all()
        more_attempts = len(attempts) > attempts_limit
        attempts = attempts[:attempts_limit]
        attempt_calls: Sequence[Any] = []
        if attempts:
            attempt_calls = conn.execute(
                sa.select(
                    ac.c.attempt_id,
                    ac.c.position,
                    *(
                        cut(col)
                        for col in (
                            ac.c.call_id,
                            ac.c.name,
                            ac.c.arguments,
                            ac.c.raw_arguments,
                        )
                    ),
                    raw(ac.c.repaired),
                    raw(ac.c.state),
                    cut(ac.c.reason),
                    cut(ac.c.result),
                )
                # the page's attempts as a subquery (a list of their ids as bound parameters
                # would meet the drivers' limit of 65,535 of them)
                .select_from(ac.join(page_ids, page_ids.c.id == ac.c.attempt_id))
                .where(ac.c.position <= CALLS_PER_TURN)
                .order_by(ac.c.attempt_id, ac.c.position)
            ).all()
    # the attempts up to the page's budget (at least one)
    attempt_sizes: dict[int, int] = {}
    for row in attempt_calls:
        attempt_sizes[row[0]] = attempt_sizes.get(row[0], 0) + _size(row[2:10])
    used = 0
    for kept, row in enumerate(attempts):
        used += _size(row[4:]) + attempt_sizes.get(row[0], 0)
        if used > PAGE_CHARS and kept > 0:
            attempts, more_attempts = attempts[:kept], True
            break
    results: dict[tuple[int, int], tuple[int, Any, str | None]] = {}
    messages: list[TimelineMessage] = []
    more_calls = {row[0] for row in calls if row[1] >= CALLS_PER_TURN}
    for (seq, role, content, parts, reasoning, refusal, name, model, finish, usage, created,
         tool_call_id, assistant_seq, call_position, fmt) in map(tuple, rows):  # fmt: skip
        cuts = _Cuts()
        value = cuts.json("content", parts) if parts is not None else cuts.text("content", content)
        message = TimelineMessage(
            seq=seq,
            role=as_text(role),
            content=value,
            reasoning=cuts.text("reasoning", reasoning),
            refusal=cuts.text("refusal", refusal),
            name=cuts.text("name", name),
            model=cuts.text("model", model),
            finish_reason=cuts.text("finish_reason", finish),
            usage=cuts.json("usage", usage),
            created_at=as_utc(created),
            tool_call_id=cuts.text("tool_call_id", tool_call_id),
            assistant_seq=as_int(_number(assistant_seq)),
            call_position=as_int(_number(call_position)),
            cut=cuts.names,
            more_calls=seq in more_calls,
            format=(as_opt_text(fmt) or "chat")
            if as_text(role) == "assistant"
            else as_opt_text(fmt),
        )
        messages.append(message)
        if message.assistant_seq is not None and message.call_position is not None:
            key = (message.assistant_seq, message.call_position)
            results.setdefault(key, (seq, value, message.tool_call_id))
    by_seq = {message.seq: message for message in messages}
    for seq, position, call_id, name, arguments, raw_arguments, repaired, state in map(
        tuple, calls
    ):
        owner = by_seq.get(seq)
        if owner is None:
            continue
        if position >= CALLS_PER_TURN:
            continue
        found = results.get((seq, position))
        cuts = _Cuts()
        call = TimelineCall(
            position=position,
            call_id=cuts.text("call_id", call_id) or "",
            name=cuts.text("name", name) or "",
            arguments=cuts.text("arguments", arguments) or "",
            raw_arguments=cuts.text("raw_arguments", raw_arguments),
            repaired=_bool(repaired),
            state=as_text(state),
            reason=None,
            result=None if found is None else found[1],
            result_seq=None if found is None else found[0],
            result_tool_call_id=None if found is None else found[2],
            cut=cuts.names,
        )
        owner.calls.append(call)
    by_attempt: dict[int, list[TimelineCall]] = {}
    attempt_more_calls: set[int] = set()
    for (attempt_id, position, call_id, name, arguments, raw_arguments, repaired, state,
         reason, result) in attempt_calls:  # fmt: skip
        if position >= CALLS_PER_TURN:
            attempt_more_calls.add(attempt_id)
            continue
        cuts = _Cuts()
        by_attempt.setdefault(attempt_id, []).append(
            TimelineCall(
                position=position,
                call_id=cuts.text("call_id", call_id) or "",
                name=cuts.text("name", name) or "",
                arguments=cuts.text("arguments", arguments) or "",
                raw_arguments=cuts.text("raw_arguments", raw_arguments),
                repaired=_bool(repaired),
                state=as_text(state),
                reason=cuts.text("reason", reason),
                result=cuts.json("result", result),
                cut=cuts.names,
            )
        )
    meta_cuts = _Cuts()
    metadata = meta_cuts.json("metadata", head[1])
    out_attempts = []
    for row in attempts:
        cuts = _Cuts()
        out_attempts.append(
            TimelineAttempt(
                id=row[0],
                at_seq=row[1],
                created_at=as_utc(row[2]),
                complete=_bool(row[3]),
                model=cuts.text("model", row[4]),
                finish_reason=cuts.text("finish_reason", row[5]),
                end_how=cuts.text("end_how", row[6]),
                end_reason=cuts.text("end_reason", row[7]),
                error=cuts.text("error", row[8]),
                content=cuts.text("content", row[9]),
                reasoning=cuts.text("reasoning", row[10]),
                refusal=cuts.text("refusal", row[11]),
                anomalies=cuts.json("anomalies", row[12]),
                format=as_opt_text(row[13]),
                calls=by_attempt.get(row[0], []),
                more_calls=row[0] in attempt_more_calls,
                cut=cuts.names,
            )
        )
    return Timeline(
        conversation_id=conversation_id,
        created_at=as_utc(head[0]),
        metadata=metadata,
        metadata_cut=bool(meta_cuts.names),
        messages_total=0 if not isinstance(total, int) else total + 1,
        after=after,
        messages=messages,
        attempts=out_attempts,
        next_after=high if more else None,
        attempts_next=(attempts[-1][1], attempts[-1][0]) if more_attempts else None,
    )


#: the characters of one value a timeline page holds (a longer value is cut there)
VALUE_CHARS: Final = 32_768
#: the characters of values after which a timeline page stops adding messages (then attempts)
PAGE_CHARS: Final = 2_000_000
#: the calls of one turn (a message or an attempt) a timeline page shows
CALLS_PER_TURN: Final = 50


def _size(values: Sequence[Any]) -> int:
    """The characters (or bytes) of values read raw, as the page budget counts them."""
    return sum(len(v) for v in values if isinstance(v, str | bytes))


class _Cuts:
    """The fields of one row whose value was longer than :data:`VALUE_CHARS` (then cut)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def text(self, name: str, value: Any) -> str | None:
        """A text value read (cut to ``VALUE_CHARS + 1``): cut to ``VALUE_CHARS``, noted."""
        text = as_opt_text(value)
        if text is not None and len(text) > VALUE_CHARS:
            self.names.append(name)
            return text[:VALUE_CHARS]
        return text

    def json(self, name: str, value: Any) -> Any:
        """A JSON value read: parsed, or, when cut, the text of its start (not JSON), noted."""
        if isinstance(value, str | bytes) and len(value) > VALUE_CHARS:
            self.names.append(name)
            return as_text(value)[:VALUE_CHARS]
        return json_value(value)


def _check_lookup_id(conversation_id: object) -> None:
    """A conversation id the engines can look up (text, without U+0000 or a lone surrogate,
    which no conversation id holds and no driver can send): :class:`InvalidFilterError`
    otherwise."""
    if not isinstance(conversation_id, str) or UNSENDABLE.search(conversation_id):
        raise InvalidFilterError(
            f"{conversation_id!r} is not a conversation id (ids are text without U+0000 or "
            "surrogates)"
        )


UNSENDABLE: Final = re.compile("[\x00\ud800-\udfff]")


def _number(value: Any) -> Any:
    """An integer column read raw: SQLite gives ints; text that spells one is read as it."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def _bool(value: Any) -> bool | None:
    """A boolean column read raw (SQLite 0/1, PostgreSQL ``true``/``false`` as text)."""
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value in ("true", "false", "0", "1"):
        return value in ("true", "1")
    return None
