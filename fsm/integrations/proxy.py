"""A recording proxy for FastAPI/Starlette: forward a provider's streamed bytes untouched to the
client while fsm parses and records them (issue 30).

A proxy between an agent (or a browser's backend) and the model sees every request and every
streamed response of a conversation. Two functions record them, and the tool calls the client
runs itself go through the tool ledger::

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        cid = request.headers["x-conversation-id"]
        seq = await record_request(store, cid, body["messages"])  # results close the pending turn
        upstream = await http.send(http.build_request("POST", URL, json=body), stream=True)
        return recording_response(upstream, store, cid, expected_seq=seq)

- :func:`record_request` (before the request goes upstream): a pending turn of the
  conversation is closed by the request's tool results (each recorded as its call's outcome,
  then the turn committed, one history), and the messages the store has not seen yet are
  appended (:meth:`~fsm.store.ConversationStore.import_history`).
- :func:`record_stream` / :func:`recording_response` (the response): every byte of the
  upstream body goes to the client as it came, and fsm's parser reads the same bytes. When the
  stream ends, *before* its last piece is forwarded (so the client cannot send its next request
  before the record exists): a turn with tool calls is begun in the ledger, its calls started
  (handed to the client) and its lease released (the proxy does not run them: the next
  request's results close it); a final answer is committed; anything else (truncated calls, an
  error event, a protocol error, a client that disconnected, an upstream that failed) is
  recorded as an attempt (:meth:`~fsm.store.ConversationStore.record_attempt`), never as a
  half turn.

The store is an :class:`~fsm.store.aio.AsyncConversationStore` (awaited) or a
:class:`~fsm.store.ConversationStore` (its calls run in a worker thread). Chat Completions
requests; the response may be any format the parser detects (Chat Completions, Responses,
Anthropic Messages), but :func:`record_request` reads Chat Completions ``messages``.

A failure to *record* never changes what the client receives: it is logged on the
``fsm.integrations.proxy`` logger (and, when the store still takes it, recorded as an attempt
saying why). Starlette (and its anyio) is imported only when a response is streamed: the
``proxy`` extra.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

from fsm.errors import FsmError, RemoteProtocolError
from fsm.integrations.errors import FrameworkMissingError, IntegrationError
from fsm.parser import Limits, ParseResult, StreamParser
from fsm.store.errors import ConversationNotFoundError, StoreError
from fsm.store.ledger import Outcome, PendingTurn

if TYPE_CHECKING:
    import starlette.responses

    from fsm.store import CommittedTurn, ConversationStore
    from fsm.store.aio import AsyncConversationStore

__all__ = [
    "FrameworkMissingError",
    "ProxyError",
    "ProxyHistoryError",
    "close_pending",
    "record_request",
    "record_stream",
    "recording_response",
]

logger = logging.getLogger("fsm.integrations.proxy")

#: a store the proxy records into
Store: TypeAlias = "AsyncConversationStore | ConversationStore"

#: the headers of the upstream response that are the connection's, not the body's: not
#: forwarded (the body may be decoded, so its length and encoding are the proxy's own)
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
    }
)


class ProxyError(IntegrationError):
    """Base class of the recording proxy's errors."""


class ProxyHistoryError(ProxyError):
    """The request's messages do not continue the recorded conversation (the client dropped,
    edited or reordered history, or did not answer the pending turn's tool calls)."""


class _Upstream(Protocol):
    """What :func:`record_stream` reads from an ``httpx.Response`` opened with ``stream=True``."""

    headers: Any

    def aiter_raw(self) -> AsyncIterator[bytes]: ...
    def aiter_bytes(self) -> AsyncIterator[bytes]: ...
    async def aclose(self) -> None: ...


def _anyio() -> Any:
    try:
        import anyio
    except ImportError as exc:  # pragma: no cover - starlette depends on anyio
        raise FrameworkMissingError("Starlette", "proxy", str(exc)) from exc
    return anyio


async def _call(store: Store, method: str, *args: Any, **kwargs: Any) -> Any:
    """``store.method(*args, **kwargs)``: awaited on the async store, in a worker thread on the
    sync one (so the event loop never waits on the database)."""
    fn = getattr(store, method)
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await _anyio().to_thread.run_sync(functools.partial(fn, *args, **kwargs))


# -- the request ------------------------------------------------------------------------------
def _tool_results(pending: PendingTurn, messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The request's result for each call of ``pending``, in call order."""
    at = pending.at_seq
    cid = pending.conversation_id
    if len(messages) <= at:
        raise ProxyHistoryError(
            f"conversation {cid!r} has a pending turn at message {at} (its tool calls wait for "
            f"results), but the request carries {len(messages)} message(s): send the tool "
            "results, or abandon the pending turn (store.abandon)"
        )
    assistant = messages[at]
    calls = pending.calls
    if calls and calls[0].legacy:  # a legacy function_call answered by a `function` message
        answer = messages[at + 1] if len(messages) > at + 1 else None
        if answer is None or answer.get("role") != "function":
            raise ProxyHistoryError(
                f"message {at + 1} of the request is not the result of the pending function "
                f"call {calls[0].name!r} of conversation {cid!r}: send it, or abandon the turn"
            )
        return [answer.get("content")]
    sent = [c.get("id") for c in assistant.get("tool_calls") or () if isinstance(c, Mapping)]
    if assistant.get("role") != "assistant" or sent != [c.id for c in calls]:
        raise ProxyHistoryError(
            f"message {at} of the request is not the pending turn of conversation {cid!r} "
            f"(an assistant message calling {[c.id for c in calls]}, found role "
            f"{assistant.get('role')!r} calling {sent}): the client's history differs from the "
            "record; use a new conversation id, or abandon the pending turn"
        )
    by_id: dict[str, Any] = {}
    for message in messages[at + 1 :]:
        if message.get("role") != "tool":
            break
        by_id[str(message.get("tool_call_id"))] = message.get("content")
    missing = [c.id for c in calls if c.id not in by_id]
    if missing:
        raise ProxyHistoryError(
            f"the request does not answer the tool call(s) {missing} of conversation {cid!r}'s "
            "pending turn (each needs a `tool` message after the assistant message): send "
            "them, or abandon the pending turn"
        )
    return [by_id[c.id] for c in calls]


async def close_pending(
    store: Store, conversation_id: str, messages: Sequence[Mapping[str, Any]]
) -> CommittedTurn | None:
    """Close the conversation's pending turn with the tool results the request carries.

    ``messages``: the request's Chat Completions ``messages`` (the whole conversation, as the
    client sends it). Each pending call's ``tool`` message (matched by ``tool_call_id``)
    becomes its outcome, and the turn is committed with them in one history write. Returns
    the committed turn, or ``None`` when there was no pending turn. A request that does not
    answer every call raises :class:`ProxyHistoryError` (nothing written); another request
    closing the same turn at the same moment makes one of them raise
    :class:`~fsm.store.errors.PendingTurnError` (retryable). Calling it again after a lost
    answer is safe: outcomes already recorded are kept.
    """
    pending = cast("PendingTurn | None", await _call(store, "pending", conversation_id))
    if pending is None:
        return None
    results = _tool_results(pending, messages)
    claimed = cast(PendingTurn, await _call(store, "claim", pending))
    owed: Outcome | None = None
    for position, execution in enumerate(claimed.executions):
        if execution.finished:
            continue
        if execution.state == "not_started":
            claimed = await _call(store, "started", claimed, position, recording=owed)
        elif owed is not None:
            claimed = await _call(store, "succeeded", claimed, owed.call, owed.result)
        owed = Outcome(position, result=results[position])
    done: CommittedTurn = await _call(store, "commit", claimed, recording=owed)
    return done


async def record_request(
    store: Store, conversation_id: str, messages: Sequence[Mapping[str, Any]]
) -> int:
    """Record a Chat Completions request before it goes upstream; the seq its response's turn
    will take (pass it to :func:`record_stream` as ``expected_seq``).

    Creates the conversation if it does not exist, closes its pending turn with the request's
    tool results (:func:`close_pending`), then appends the messages the record does not hold
    yet (the new user message, usually; a tool round the client made elsewhere goes in whole,
    checked as :meth:`~fsm.store.ConversationStore.import_history` checks it). A request that
    carries fewer messages than the record holds raises :class:`ProxyHistoryError`.
    """
    try:
        await close_pending(store, conversation_id, messages)
    except ConversationNotFoundError:  # its first request (a write only then)
        await _call(store, "create_conversation", conversation_id, exist_ok=True)
    count = int(await _call(store, "next_seq", conversation_id))
    if len(messages) < count:
        raise ProxyHistoryError(
            f"the request carries {len(messages)} message(s) but conversation "
            f"{conversation_id!r} has {count} recorded: the client dropped or edited history; "
            "use a new conversation id for a new history"
        )
    new = [dict(m) for m in messages[count:]]
    if not new:
        return count
    return int(await _call(store, "import_history", conversation_id, new, expected_seq=count))


# -- the response -----------------------------------------------------------------------------
def _why(result: ParseResult) -> str:
    """Why a response is an attempt, not a turn: in fsm's own words."""
    if len(result.turns) > 1:
        return f"{len(result.turns)} choices: the proxy cannot know which one the client keeps"
    for turn in result.turns:
        if not turn.complete:
            return f"incomplete turn: {turn.incomplete_reason}"
    if not result.turns:
        return f"no choice in the response (end: {result.end_how}, {result.end_reason})"
    return f"the stream ended {result.end_how}: {result.end_reason}"


async def _attempt(store: Store, cid: str, result: ParseResult, error: str) -> None:
    try:
        await _call(store, "record_attempt", cid, result, error=error)
    except (FsmError, OSError) as exc:
        logger.error("fsm proxy: conversation %r: attempt not recorded: %s", cid, exc)


async def _record(
    store: Store, cid: str, parser: StreamParser, expected_seq: int | None, failure: str | None
) -> None:
    """Record what the parser read: a pending turn, a committed one, or an attempt."""
    result = parser.result()
    if failure is not None or not (len(result.turns) == 1 and result.turns[0].complete):
        await _attempt(store, cid, result, failure or _why(result))
        return
    turn = result.turns[0]
    try:
        if turn.tool_calls:
            pending = await _call(store, "begin", cid, result, expected_seq=expected_seq, start=0)
            for position in range(1, len(turn.tool_calls)):  # handed to the client: started
                pending = await _call(store, "started", pending, position)
            await _call(store, "release", pending)  # the next request's results close it
        else:
            await _call(store, "commit_turn", cid, result, expected_seq=expected_seq)
    except StoreError as exc:
        logger.error("fsm proxy: conversation %r: turn not recorded: %s", cid, exc)
        await _attempt(store, cid, result, f"not recorded by the proxy: {exc}")


def _body(upstream: AsyncIterable[bytes] | _Upstream) -> AsyncIterator[bytes]:
    raw = getattr(upstream, "aiter_raw", None)
    if raw is None:
        return aiter(cast(AsyncIterable[bytes], upstream))
    response = cast(_Upstream, upstream)
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    # a compressed body is forwarded decoded (the parser reads text): its encoding header is
    # not forwarded either (recording_response drops it)
    return response.aiter_raw() if encoding in ("", "identity") else response.aiter_bytes()


async def record_stream(
    upstream: AsyncIterable[bytes] | _Upstream,
    store: Store,
    conversation_id: str,
    *,
    expected_seq: int | None = None,
    format: str = "auto",
    repair_json: bool = False,
    limits: Limits | None = None,
) -> AsyncIterator[bytes]:
    """The upstream body's bytes, unchanged, while fsm parses and records them.

    ``upstream``: an async iterator of the provider's body bytes, or an ``httpx.Response``
    opened with ``stream=True`` (read with ``aiter_raw``; closed when this iterator ends).
    ``expected_seq``: the seq the turn must take (what :func:`record_request` returned), so a
    turn never lands after messages another request appended meanwhile. ``format``,
    ``repair_json``, ``limits``: the parser's (:class:`~fsm.StreamParser`).

    When the stream ends (``[DONE]``, the format's end event, an error event, a protocol
    error, or the upstream closing), the record is written before the piece that ended it is
    forwarded: a complete turn with tool calls is begun in the tool ledger (pending, its
    calls started, its lease released) for the next request to close; a complete final answer
    is committed; anything else is an attempt. A client that goes away (this iterator closed or
    cancelled before the end) and an upstream that fails mid-stream leave an attempt too; the
    upstream's failure is raised again.
    """
    parser = StreamParser(format=format, repair_json=repair_json, limits=limits)
    body = _body(upstream)
    recorded = False
    failure: str | None = None
    try:
        try:
            async for data in body:
                if not recorded:
                    try:
                        parser.receive_data(data)
                    except RemoteProtocolError as exc:
                        failure = f"protocol error: {exc}"
                    if failure is not None or parser.ended:
                        recorded = True
                        await _record(store, conversation_id, parser, expected_seq, failure)
                yield data
        except Exception as exc:  # the upstream failed mid-stream
            if not recorded:
                recorded = True
                parser.abort(f"upstream: {type(exc).__name__}: {exc}")
                await _record(
                    store,
                    conversation_id,
                    parser,
                    expected_seq,
                    f"the upstream failed: {type(exc).__name__}: {exc}",
                )
            raise
        except BaseException:  # the client went away: cancelled, or the iterator closed
            if not recorded:
                recorded = True
                parser.abort("client_disconnected")
                with _anyio().CancelScope(shield=True):
                    await _attempt(
                        store,
                        conversation_id,
                        parser.result(),
                        "the client disconnected before the end of the stream",
                    )
            raise
        if not recorded:  # the upstream closed without the format's end
            recorded = True
            parser.receive_eof()
            await _record(store, conversation_id, parser, expected_seq, None)
    finally:
        closer = getattr(upstream, "aclose", None)
        if closer is not None:
            with _anyio().CancelScope(shield=True):
                await closer()


def recording_response(
    upstream: _Upstream,
    store: Store,
    conversation_id: str,
    *,
    expected_seq: int | None = None,
    format: str = "auto",
    repair_json: bool = False,
    limits: Limits | None = None,
) -> starlette.responses.StreamingResponse:
    """A Starlette ``StreamingResponse`` that forwards an ``httpx.Response`` (opened with
    ``stream=True``) to the client: its status, its headers (but the connection's own and the
    body's length and encoding), and its body through :func:`record_stream`. An upstream error
    status (not a stream) is forwarded as it is and not recorded. The body's iterator is closed
    when the response ends however it ends, so a client that disconnects is recorded at once.
    """
    try:
        from starlette.responses import StreamingResponse
    except ImportError as exc:
        raise FrameworkMissingError("Starlette", "proxy", str(exc)) from exc
    response = cast(Any, upstream)
    status = int(response.status_code)
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP}
    streaming = status < 400 and "text/event-stream" in headers.get("content-type", "")
    body: AsyncIterator[bytes] = (
        record_stream(
            upstream,
            store,
            conversation_id,
            expected_seq=expected_seq,
            format=format,
            repair_json=repair_json,
            limits=limits,
        )
        if streaming
        else _passthrough(upstream)
    )

    class _Closing(StreamingResponse):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                closer = getattr(body, "aclose", None)
                if closer is not None:
                    with _anyio().CancelScope(shield=True):
                        await closer()

    return _Closing(body, status_code=status, headers=headers)


async def _passthrough(upstream: _Upstream) -> AsyncIterator[bytes]:
    try:
        async for data in _body(upstream):
            yield data
    finally:
        await upstream.aclose()
