"""The Chat Completions stream (``POST /v1/chat/completions``, ``stream: true``): chunks of
``choices[].delta`` (``shared/spec/parser.md``), read into the :class:`~fsm.formats.core.StreamCore`.

:class:`ChatFormat` is one implementation of :class:`~fsm.formats.core.Format`; every rule it
shares with the other formats (limits, anomalies, errors, events, endings) is the core's.
"""

from __future__ import annotations

from typing import Any, Final, NoReturn

import orjson

from fsm.events import (
    ContentDelta,
    Event,
    FinishReasonReceived,
    ReasoningDelta,
    ToolCallUpdated,
    cd_choice,
    cd_text,
    rd_choice,
    rd_text,
    refusal_delta,
)
from fsm.formats.core import (
    INT64_MAX,
    INT64_MIN,
    MAX_INDEX,
    Frames,
    StreamCore,
    error_message,
    json_repr,
    json_type,
    utf8_len,
)
from fsm.formats.detect import foreign_format
from fsm.states import KNOWN_FINISH_REASONS, StreamState, ToolCallState
from fsm.toolcall import ToolCall
from fsm.turn import CONTENT, REASONING, REFUSAL, Turn

__all__ = ["ChatFormat"]

_OPEN: Final = StreamState.OPEN
_ACCUMULATING: Final = ToolCallState.ACCUMULATING
_new_event: Final = object.__new__


class ChatFormat:
    """Reads a Chat Completions stream into ``core`` (:class:`~fsm.formats.core.Format`)."""

    __slots__ = ("_meta_missing", "core")

    def __init__(self, core: StreamCore) -> None:
        self.core = core
        #: the response id or model not seen yet: each chunk is read for them
        self._meta_missing = True

    def frames(self, frames: Frames) -> None:
        """SSE events: a JSON chunk to :meth:`chunk`, anything else to the rare cases."""
        core = self.core
        loads = orjson.loads
        chunk = self.chunk
        for name, payload, offset in frames:
            core.event_number += 1
            core.offset = offset
            if payload[:1] == b"{" and not name and core.status is _OPEN:
                try:
                    data = loads(payload)
                except orjson.JSONDecodeError:
                    data = core.decode_slow(payload)
                chunk(data)
            else:
                self._rare_event(name, payload)

    def _rare_event(self, name: str, payload: bytes) -> None:
        # An event named "error" is an error whatever its data, "[DONE]" included: test the name
        # before the data.
        if self.core.status is not _OPEN:
            self.core.anomaly("data_after_end", "an SSE event after the end of the stream")
        elif name == "error":
            self.core.error_event(payload)
        elif payload.strip() == b"[DONE]":
            self.core.end("done", None)
        elif not payload.strip():
            self.core.anomaly("empty_event", "an SSE event with empty data was ignored")
        else:
            self.chunk(self.core.decode_slow(payload))

    def after_end(self, name: str, payload: bytes) -> None:
        """An SSE event after the end of the stream."""
        self.core.anomaly("data_after_end", "an SSE event after the end of the stream")

    def done_sentinel(self) -> None:
        """``[DONE]`` fed as a chunk: the end of a Chat Completions stream."""
        if self.core.status is _OPEN:
            self.core.end("done", None)
        else:
            self.core.anomaly("data_after_end", "[DONE] after the end of the stream")

    def _typed_event(self, chunk: dict[str, Any]) -> None:
        """A chunk with no choices but a ``type``: an event of another format is a protocol
        error (a stream that changes format midway); any other ``type`` is ignored."""
        other = foreign_format(chunk.get("type"))
        if other is not None:
            self.core.fail(
                f"the stream changed format: a {other} event ({chunk['type']!r}) in a Chat "
                "Completions stream",
                "type",
            )

    def chunk(self, chunk: Any) -> None:
        """One chunk (a decoded dict, or anything: a non-dict is a protocol error)."""
        # The hot path: one call per chunk, with the common shapes handled inline and every
        # rare case (new turn, new call, text, finish, errors) out of line.
        core = self.core
        if type(chunk) is not dict:
            core.fail(f"a chunk must be a JSON object, got {json_type(chunk)}", None)
        if self._meta_missing:
            self._metadata(chunk)
            if core.status is not _OPEN:
                return
        usage = chunk.get("usage")
        if usage is not None:
            core.keep_usage(usage)
        choices = chunk.get("choices")
        if choices:
            if type(choices) is not list:
                core.fail(f"must be a list or null, got {json_type(choices)}", "choices")
            turns = core.turns
            ci = -1  # counted by hand: cheaper than enumerate() for the usual single choice
            for choice in choices:
                ci += 1
                if type(choice) is not dict:
                    core.fail(f"must be an object, got {json_type(choice)}", f"choices[{ci}]")
                index = choice.get("index", 0)
                if type(index) is not int or index < 0:
                    self._bad_choice_index(ci, index)
                turn = turns.get(index)
                if turn is None:
                    if index > MAX_INDEX:
                        self._bad_choice_index(ci, index)
                    turn = self._new_turn(index)
                    if turn is None:
                        return
                delta = choice.get("delta")
                if delta:
                    if type(delta) is not dict:
                        core.fail(
                            f"must be an object, got {json_type(delta)}", f"choices[{ci}].delta"
                        )
                    if turn.finish_seen and _has_payload(delta):
                        core.anomaly(
                            "delta_after_finish",
                            f"choice {index} sent data after finish_reason {turn.finish_reason!r}",
                            index,
                        )
                    tool_calls = delta.get("tool_calls")
                    if (tool_calls is None or len(delta) > 1) and not self._texts(turn, delta, ci):
                        return
                    if tool_calls:
                        if type(tool_calls) is not list:
                            core.fail(
                                f"must be a list or null, got {json_type(tool_calls)}",
                                f"choices[{ci}].delta.tool_calls",
                            )
                        by_index = turn.by_index
                        fragment_ok = core.fragment
                        ti = -1  # counted by hand, as ci
                        for entry in tool_calls:
                            ti += 1
                            # The hottest case inline: a continuation {"index": i, "function":
                            # {"arguments": "..."}} of a call already accumulating, routed by
                            # Turn.route's first rule (index, no id), within the limits
                            # StreamCore.fragment checks, appended by ToolCall.append (the one append);
                            # anything else (a limit passed included) goes to _tool_delta.
                            if type(entry) is dict and len(entry) == 2:
                                tindex = entry.get("index")
                                fn = entry.get("function")
                                if type(tindex) is int and type(fn) is dict and len(fn) == 1:
                                    fragment = fn.get("arguments")
                                    call = by_index.get(tindex)
                                    if (
                                        type(fragment) is str
                                        and fragment.isascii()
                                        and call is not None
                                        and call.state is _ACCUMULATING
                                        and call.over_limit is None
                                        and fragment_ok(call, fragment, len(fragment))
                                    ):
                                        continue
                            self._tool_delta(turn, entry, ci, ti)
                            if core.status is not _OPEN:
                                return
                    elif tool_calls is not None and type(tool_calls) is not list:
                        core.fail(
                            f"must be a list or null, got {json_type(tool_calls)}",
                            f"choices[{ci}].delta.tool_calls",
                        )
                elif delta is not None and type(delta) is not dict:
                    core.fail(f"must be an object, got {json_type(delta)}", f"choices[{ci}].delta")
                finish = choice.get("finish_reason")
                if finish is not None:
                    self._finish(turn, finish, ci)
                    if core.status is not _OPEN:
                        return
        elif choices is not None and type(choices) is not list:
            core.fail(f"must be a list or null, got {json_type(choices)}", "choices")
        elif "type" in chunk:
            self._typed_event(chunk)
        error = chunk.get("error")
        if error is not None:
            core.end("error", error_message(error))

    def _metadata(self, chunk: dict[str, Any]) -> None:
        meta = self.core.meta
        rid = chunk.get("id")
        if meta.response_id is None and type(rid) is str and rid:
            if not self.core.identifier(rid, "the response id"):
                return
            meta.response_id = rid
        model = chunk.get("model")
        if model is None:
            model = chunk.get("model_id")  # watsonx
        if meta.model is None and type(model) is str and model:
            if not self.core.identifier(model, "the model"):
                return
            meta.model = model
        created = chunk.get("created")
        if meta.created is None and type(created) is int:
            if INT64_MIN <= created <= INT64_MAX:
                meta.created = created
            else:
                self.core.anomaly(
                    "invalid_created", "created is outside signed 64-bit integers; ignored"
                )
        fp = chunk.get("system_fingerprint")
        if meta.system_fingerprint is None and type(fp) is str and fp:
            if not self.core.identifier(fp, "the system fingerprint"):
                return
            meta.system_fingerprint = fp
        self._meta_missing = meta.response_id is None or meta.model is None

    def _bad_choice_index(self, ci: int, index: Any) -> NoReturn:
        self.core.fail(
            f"must be a non-negative integer (at most {MAX_INDEX}), got {json_repr(index)}",
            f"choices[{ci}].index",
        )

    def _new_turn(self, index: int) -> Turn | None:
        if len(self.core.turns) >= self.core.limits.max_choices:
            self.core.limit("max_choices", f"more than {self.core.limits.max_choices} choices")
            return None
        turn = self.core.turns[index] = Turn(index, self.core.meta)
        return turn

    def _finish(self, turn: Turn, finish: Any, ci: int) -> None:
        if type(finish) is not str:
            self.core.fail(
                f"must be a string or null, got {json_type(finish)}",
                f"choices[{ci}].finish_reason",
            )
        if not finish:
            return
        if finish not in KNOWN_FINISH_REASONS:
            if utf8_len(finish) > self.core.limits.max_id_bytes:
                self.core.limit(
                    "max_id_bytes",
                    f"choice {turn.index}: a finish_reason is longer than "
                    f"{self.core.limits.max_id_bytes} bytes",
                )
                return
            self.core.anomaly(
                "unknown_finish_reason",
                f"finish_reason {finish!r} is not a known value; treated like 'stop'",
                turn.index,
            )
        turn.finish(finish)
        self.core.events.append(FinishReasonReceived(choice=turn.index, finish_reason=finish))

    def _text(self, turn: Turn, value: str, field: int) -> bool:
        """Keep one text fragment (checked to be a non-empty str); ``False`` when a limit ended
        the stream."""
        nbytes = len(value) if value.isascii() else utf8_len(value)
        if not self.core.text_room(turn, nbytes):
            return False
        turn.append_text(field, value, nbytes)
        return True

    def _texts(self, turn: Turn, delta: dict[str, Any], ci: int) -> bool:
        """Apply content, reasoning, refusal and a legacy ``function_call``; ``False`` when a
        limit ended the stream. Content and reasoning (a fragment in most chunks) are kept
        here, within the limits :meth:`_text` checks (which takes over past one)."""
        content = delta.get("content")
        if content is not None:
            if type(content) is not str:
                self._bad_text(content, "content", ci)
            if content:
                nbytes = len(content) if content.isascii() else utf8_len(content)
                stream = self.core.stream_bytes + nbytes
                if (
                    turn.text_bytes + nbytes > self.core.max_text_bytes
                    or stream > self.core.max_stream_bytes
                ):
                    return self._text(turn, content, CONTENT)  # past a limit: it ends the stream
                self.core.stream_bytes = stream
                turn.append_text(CONTENT, content, nbytes)
                event: Event = _new_event(ContentDelta)  # built through its slots (fsm.events)
                cd_choice(event, turn.index)
                cd_text(event, content)
                self.core.events.append(event)
            if len(delta) == 1:
                return True  # the common {"content": "..."}: nothing else to look for
        reasoning = delta.get("reasoning_content")
        field_name = "reasoning_content"
        if reasoning is None:
            reasoning = delta.get("reasoning")
            field_name = "reasoning"
        if reasoning is not None:
            if type(reasoning) is not str:
                self._bad_text(reasoning, field_name, ci)
            if reasoning:
                nbytes = len(reasoning) if reasoning.isascii() else utf8_len(reasoning)
                stream = self.core.stream_bytes + nbytes
                if (
                    turn.text_bytes + nbytes > self.core.max_text_bytes
                    or stream > self.core.max_stream_bytes
                ):
                    return self._text(turn, reasoning, REASONING)
                self.core.stream_bytes = stream
                turn.append_text(REASONING, reasoning, nbytes)
                event = _new_event(ReasoningDelta)  # built through its slots (fsm.events)
                rd_choice(event, turn.index)
                rd_text(event, reasoning)
                self.core.events.append(event)
        refusal = delta.get("refusal")
        if refusal is not None:
            if type(refusal) is not str:
                self._bad_text(refusal, "refusal", ci)
            if refusal:
                if not self._text(turn, refusal, REFUSAL):
                    return False
                self.core.events.append(refusal_delta(turn.index, refusal))
        function_call = delta.get("function_call")
        if function_call is not None:
            return self._function_call(turn, function_call, ci)
        return True

    def _function_call(self, turn: Turn, fc: Any, ci: int) -> bool:
        """Apply a legacy ``delta.function_call`` (spec "Rules added in round 2"): the one call
        of its choice, id ``""``, merged and appended like any call. ``False`` when a limit
        ended the stream."""
        path = f"choices[{ci}].delta.function_call"
        if type(fc) is not dict:
            self.core.fail(f"must be an object or null, got {json_type(fc)}", path)
        name = fc.get("name")
        arguments = fc.get("arguments")
        if name is not None and type(name) is not str:
            self.core.fail(f"must be a string or null, got {json_repr(name)}", f"{path}.name")
        if arguments is not None and type(arguments) is not str:
            self.core.fail(
                f"must be a string or null, got {json_repr(arguments)}", f"{path}.arguments"
            )
        call = turn.legacy_call
        if call is None and turn.call_count:
            self.core.fail(
                "a choice cannot mix the legacy function_call with tool_calls (it already has "
                "tool calls)",
                path,
            )
        if call is None:
            if not name and not arguments:
                return True  # nothing to open a call with
            call = self._open(turn, None, "", name or "", "", legacy=True)
            if call is None:
                return False
        elif name and call.merge(None, name, None, self.core):
            self.core.events.append(
                ToolCallUpdated(
                    choice=turn.index, ordinal=call.ordinal, index=None, id="", name=call.name
                )
            )
        if arguments and call.over_limit is None:
            self.core.arguments(call, arguments, utf8_len(arguments))
        return self.core.status is _OPEN

    def _bad_text(self, value: Any, field: str, ci: int) -> NoReturn:
        self.core.fail(
            f"must be a string or null, got {json_type(value)}", f"choices[{ci}].delta.{field}"
        )

    def _tool_delta(self, turn: Turn, entry: Any, ci: int, ti: int) -> None:
        if turn.legacy_call is not None:
            self.core.fail(
                "a choice cannot mix tool_calls with the legacy function_call (it already has a "
                "function_call)",
                f"choices[{ci}].delta.tool_calls[{ti}]",
            )
        if type(entry) is not dict:
            self.core.fail(
                f"must be an object, got {json_type(entry)}",
                f"choices[{ci}].delta.tool_calls[{ti}]",
            )
        index = entry.get("index")
        fn = entry.get("function")
        if len(entry) > (index is not None) + (fn is not None):
            cid = entry.get("id")
            typ = entry.get("type")
            if cid is not None and type(cid) is not str:
                self._bad_field(ci, ti, "id", "a string or null", cid)
            if typ is not None and type(typ) is not str:
                self._bad_field(ci, ti, "type", "a string or null", typ)
        else:
            cid = typ = None
        if fn is not None:
            if type(fn) is not dict:
                self._bad_field(ci, ti, "function", "an object or null", fn)
            arguments = fn.get("arguments")
            if arguments is not None and type(arguments) is not str:
                self._bad_field(ci, ti, "function.arguments", "a string or null", arguments)
            if len(fn) > (arguments is not None):
                name = fn.get("name")
                if name is not None and type(name) is not str:
                    self._bad_field(ci, ti, "function.name", "a string or null", name)
            else:
                name = None
        else:
            name = arguments = None
        if index is not None and (type(index) is not int or index < 0):
            self._bad_index(ci, ti, index)

        try:
            call = turn.route(index, cid, name)
        except LookupError:
            self.core.anomaly(
                "orphan_continuation",
                f"choice {turn.index}: a tool-call fragment with no index, id or name and no "
                "open call was dropped",
                turn.index,
            )
            return
        if call is None:
            if index is not None and index > MAX_INDEX:
                self._bad_index(ci, ti, index)
            call = self._open(turn, index, cid or "", name or "", typ or "")
            if call is None:
                return
        elif (cid or name or typ) and call.merge(cid, name, typ, self.core):
            self.core.events.append(
                ToolCallUpdated(
                    choice=turn.index, ordinal=call.ordinal, index=call.index, id=call.id,
                    name=call.name,
                )
            )  # fmt: skip
        if not arguments or call.over_limit is not None:
            return
        self.core.arguments(call, arguments, utf8_len(arguments))

    def _bad_index(self, ci: int, ti: int, index: Any) -> NoReturn:
        # the store keeps indices as 32-bit integers: a bigger one could not be committed
        self._bad_field(
            ci, ti, "index", f"a non-negative integer (at most {MAX_INDEX}) or null", index
        )

    def _bad_field(self, ci: int, ti: int, name: str, expected: str, value: Any) -> NoReturn:
        self.core.fail(
            f"must be {expected}, got {json_repr(value)}",
            f"choices[{ci}].delta.tool_calls[{ti}].{name}",
        )

    def _open(
        self, turn: Turn, index: int | None, cid: str, name: str, typ: str, legacy: bool = False
    ) -> ToolCall | None:
        """Open a call within the limits (:meth:`StreamCore.admit_call`); ``None`` when a
        limit ended the stream."""
        core = self.core
        header = core.admit_call(turn, cid, name, typ)
        if header is None:
            return None
        call = ToolCall(
            choice=turn.index, ordinal=turn.call_count, index=index, id=header.cid,
            name=header.name, type=header.typ, legacy=legacy,
        )  # fmt: skip
        core.register_call(turn, call, header.over)
        return call


def _has_payload(delta: dict[str, Any]) -> bool:
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("refusal")
        or delta.get("tool_calls")
        or delta.get("function_call")
    )
