"""The closed vocabularies of fsm's core, declared once: the stream formats, the values of
``StreamParser(format=...)``, the event types that name a format, the roles of a conversation's
messages, and the size and depth limits of one stream (:class:`Limits`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fsm.jsonutil import MAX_JSON_DEPTH as JSONUTIL_MAX_JSON_DEPTH

#: the stream formats
FORMATS: Final = ("chat", "responses", "anthropic")
#: the values of ``StreamParser(format=...)``: a format, or ``"auto"`` (detected)
FORMAT_NAMES: Final = ("auto", *FORMATS)

#: the roles of the messages of a conversation (Chat Completions' words)
ROLES: Final = ("system", "developer", "user", "assistant", "tool")

#: the event types of an Anthropic Messages stream (``error`` is shared with Responses)
ANTHROPIC_EVENTS: Final = frozenset(
    {
        "message_start",
        "message_delta",
        "message_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "ping",
    }
)

#: anomalies of one kind kept with their details (and reported as events); more are only counted.
MAX_ANOMALIES_PER_KIND: Final = 100

#: the most ``max_name_bytes`` / ``max_id_bytes`` may be: the longest value the store can index
#: on PostgreSQL (a b-tree entry holds about 2.7 KB; 512 bytes leaves room for the rest of a key)
MAX_INDEXED_BYTES: Final = 512
#: the most ``max_json_depth`` may be: :data:`fsm.jsonutil.MAX_JSON_DEPTH`, the one nesting
#: limit of every JSON value fsm keeps (arguments, provider items, what the store keeps as JSON)
MAX_JSON_DEPTH: Final = JSONUTIL_MAX_JSON_DEPTH


@dataclass(frozen=True, slots=True)
class Limits:
    """Safe bounds on what one stream may make the parser hold. All sizes are UTF-8 bytes.

    Past ``max_argument_bytes``, ``max_name_bytes`` or ``max_id_bytes`` (a call's id or type) a
    call's further fragments are dropped and the call ends ``aborted`` (reason
    ``limit:<name>``); arguments nested deeper than ``max_json_depth`` end the call ``aborted``
    (``limit:max_json_depth``). Past any other limit, or a stream-level identifier (response
    id, model, system fingerprint, finish_reason) longer than ``max_id_bytes``, the whole stream
    ends: every live call becomes ``aborted`` with the limit's name as reason.

    Every limit may be lowered; ``max_name_bytes`` and ``max_id_bytes`` may not be raised above
    512 (the store indexes those values), nor ``max_json_depth`` above 512 (the one nesting
    limit of every JSON value fsm keeps, :data:`fsm.jsonutil.MAX_JSON_DEPTH`: a provider item
    kept verbatim nested deeper ends the stream, ``limit:max_json_depth``).
    """

    #: UTF-8 bytes of arguments kept per tool call.
    max_argument_bytes: int = 8 * 1024 * 1024
    #: tool calls per choice.
    max_tool_calls: int = 1024
    #: bytes of one SSE event (one chunk's JSON text).
    max_event_bytes: int = 16 * 1024 * 1024
    #: UTF-8 bytes of content + reasoning + refusal text per choice.
    max_text_bytes: int = 64 * 1024 * 1024
    #: distinct choice indices per stream.
    max_choices: int = 128
    #: UTF-8 bytes of a tool call's name (providers allow 64 characters).
    max_name_bytes: int = MAX_INDEXED_BYTES
    #: UTF-8 bytes of a call's id and of its type; and of the response id, model, system
    #: fingerprint and each finish_reason.
    max_id_bytes: int = MAX_INDEXED_BYTES
    #: UTF-8 bytes of text, arguments, names and ids accepted over the whole stream (all choices).
    max_stream_bytes: int = 64 * 1024 * 1024
    #: nesting of the arguments of a finished call (arrays and objects in one another), and of
    #: each provider item kept verbatim (Responses output item, Anthropic content block).
    max_json_depth: int = 512
    #: provider items kept verbatim per stream (Responses output items, Anthropic content blocks
    #: and citations): each costs about 0.5 KB besides its JSON, so this bounds that overhead.
    max_items: int = 16384

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
        for name in ("max_name_bytes", "max_id_bytes"):
            if getattr(self, name) > MAX_INDEXED_BYTES:
                raise ValueError(
                    f"Limits.{name} must be at most {MAX_INDEXED_BYTES}: {MAX_INDEXED_BYTES} bytes "
                    "is the most the store can index on PostgreSQL, got "
                    f"{getattr(self, name)!r}"
                )
        if self.max_json_depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"Limits.max_json_depth must be at most {MAX_JSON_DEPTH} (the nesting every "
                f"JSON value fsm keeps is limited to), got {self.max_json_depth!r}"
            )


DEFAULT_LIMITS: Final = Limits()
