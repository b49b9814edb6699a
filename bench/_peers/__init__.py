"""Adapters that drive each peer library's public stream-accumulation API, for ``bench/peers.py``.

Every adapter turns a list of Chat Completions chunk dicts (what an SSE decoder yields, in order)
into an :class:`Outcome`: per choice index, the tool calls the library assembled, each with
whether the library presents it as usable. Each module documents exactly how its library is
driven and what "usable" means for it (``HOW`` and ``USABLE``).
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

__all__ = ["PEER_MODULES", "Call", "Outcome", "Peer", "describe", "load_peers"]


def describe(exc: BaseException) -> str:
    """``"Type: message"``, plus where it was raised when the message is empty."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if not str(exc):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            path = last.filename.split("site-packages/")[-1]
            text += f" (`{last.line}` in {path}:{last.lineno})"
    return text


@dataclass(frozen=True, slots=True)
class Call:
    """One tool call as a library assembled it."""

    id: str | None
    name: str | None
    arguments: str | None
    #: whether the library hands this call over as usable (not raised, not marked invalid).
    usable: bool
    #: the library's own words when it flags the call (e.g. LangChain's invalid_tool_calls).
    note: str = ""


@dataclass(slots=True)
class Outcome:
    """What a library made of one stream."""

    #: choice index -> calls, in the library's order.
    choices: dict[int, list[Call]] = field(default_factory=dict)
    #: ``"ExceptionType: message"`` when the library (or the SDK in front of it) raised.
    raised: str | None = None


@dataclass(frozen=True, slots=True)
class Peer:
    """One library under comparison."""

    key: str  # short column name
    kind: str  # what prepare() builds; peers of the same kind can share prepared chunks
    label: str  # what the column means
    dists: tuple[str, ...]  # distributions whose versions are reported
    #: chunk dicts -> the objects the library is handed in real use (untimed: built by the
    #: SDK or the provider wrapper in front of the accumulator)
    prepare: Callable[[list[dict[str, Any]]], Any]
    #: the same for the timing workloads (may build them a cheaper way; equal objects)
    prepare_fast: Callable[[list[dict[str, Any]]], Any]
    #: prepared chunks -> outcome: the library's accumulation, timed
    consume: Callable[[Any], Outcome]
    how: str  # how the library is driven
    usable: str  # what "usable" means for this library
    module: ModuleType | None = None
    error: str | None = None  # why it is unavailable

    @property
    def available(self) -> bool:
        return self.error is None

    def run(self, chunks: list[dict[str, Any]]) -> Outcome:
        return self.consume(self.prepare(chunks))

    def versions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for dist in self.dists:
            try:
                out[dist] = version(dist)
            except PackageNotFoundError:
                out[dist] = "not installed"
        return out


#: (module, column key), in column order; fsm first.
PEER_MODULES: tuple[tuple[str, str], ...] = (
    ("fsm_peer", "fsm"),
    ("openai_peer", "openai"),
    ("langchain_peer", "langchain"),
    ("litellm_peer", "litellm"),
    ("pydantic_ai_peer", "pydantic-ai"),
    ("agents_peer", "openai-agents"),
)


def _unavailable(error: str) -> Callable[[Any], Any]:
    def fail(chunks: Any) -> Any:
        raise RuntimeError(error)

    return fail


def load_peers() -> list[Peer]:
    """Import every adapter; one whose library is missing comes back unavailable, not raising.

    Adapter modules import their library only in ``setup()``, so their descriptions are always
    there even when the library is not installed.
    """
    peers: list[Peer] = []
    for mod_name, key in PEER_MODULES:
        mod = importlib.import_module(f"{__name__}.{mod_name}")
        error: str | None = None
        try:
            mod.setup()
        except ImportError as exc:
            error = f"not importable: {exc}"
        peers.append(
            Peer(
                key=key,
                kind=mod.KIND,
                label=mod.LABEL,
                dists=mod.DISTS,
                prepare=mod.prepare if error is None else _unavailable(error),
                prepare_fast=mod.prepare_fast if error is None else _unavailable(error),
                consume=mod.consume if error is None else _unavailable(error),
                how=mod.HOW,
                usable=mod.USABLE,
                module=mod,
                error=error,
            )
        )
    return peers
