"""The format of a stream, chosen once: :func:`make_format` builds the
:class:`~fsm.formats.core.Format` of a named format, and :class:`Detector` (``format="auto"``)
chooses one from the first event that carries JSON, then delegates to it."""

from __future__ import annotations

from typing import Any, Final

import orjson

from fsm.formats.anthropic import AnthropicHandler
from fsm.formats.chat import ChatFormat
from fsm.formats.core import Format, Frames, StreamCore
from fsm.formats.detect import detect
from fsm.formats.responses import ResponsesHandler
from fsm.states import StreamState

__all__ = ["Detector", "make_format"]

_OPEN: Final = StreamState.OPEN


def make_format(core: StreamCore, name: str) -> Format:
    """The format ``name`` (``"auto"``: a :class:`Detector`) reading into ``core``."""
    if name == "auto":
        return Detector(core)
    if name == "responses":
        return ResponsesHandler(core)
    if name == "anthropic":
        return AnthropicHandler(core)
    return ChatFormat(core)


class Detector:
    """``format="auto"``: the first event that carries JSON decides the format; the detector
    makes it the core's handler and hands it that event and the rest of the input. Before
    that, events without JSON follow the Chat Completions rules (a stream of only those is
    read exactly as a Chat Completions stream)."""

    __slots__ = ("chat", "core")

    def __init__(self, core: StreamCore) -> None:
        self.core = core
        #: the Chat Completions format: events before the choice, and the choice if it is chat
        self.chat = ChatFormat(core)

    def _choose(self, event: Any) -> Format:
        core = self.core
        name = detect(event)
        core.format = name
        handler: Format = self.chat if name == "chat" else make_format(core, name)
        core.handler = handler
        return handler

    def frames(self, frames: Frames) -> None:
        """Frames before the format is known: chat rules for events without JSON, the first
        JSON event decides."""
        core = self.core
        for i, frame in enumerate(frames):
            payload = frame[1]
            if payload.lstrip()[:1] == b"{" and core.status is _OPEN:
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    event = None
                self._choose(event).frames(frames[i:])
                return
            self.chat.frames([frame])

    def chunk(self, chunk: Any) -> None:
        """A chunk (``receive_chunk``) before the format is known: it decides."""
        self._choose(chunk).chunk(chunk)

    def after_end(self, name: str, payload: bytes) -> None:
        """An SSE event after the end, no format chosen: the Chat Completions rule."""
        self.chat.after_end(name, payload)

    def done_sentinel(self) -> None:
        """``[DONE]`` as a chunk, no format chosen: the Chat Completions rule."""
        self.chat.done_sentinel()
