"""One store API, four facades (issue 28): :class:`ConversationStore`, its asyncio twin, and
each bound to a caller's transaction have the same operations with the same parameters, the
async ones awaited. The sync store is the reference; a parameter added to one facade and not the
others, or an operation left out of one, fails here."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from fsm.store import BoundStore, ConversationStore
from fsm.store.aio import AsyncBoundStore, AsyncConversationStore

#: what a facade bound to a caller's transaction leaves out: the listing (not a conversation's
#: write) and the tool ledger (its steps are transactions of their own, one per step)
STORE_ONLY = {
    "list_conversations",
    "begin",
    "pending",
    "claim",
    "renew",
    "release",
    "heartbeat",
    "started",
    "succeeded",
    "failed",
    "commit",
    "abandon",
}

#: the store's life (open, close, bind, properties), which differs by facade on purpose
LIFECYCLE = {"open", "close", "bind", "engine", "url", "read_url", "owns_engine", "dialect"}
LIFECYCLE |= {"connection", "caller_transaction", "ledger_lease", "ledger_outcome"}


def operations(cls: type) -> dict[str, Any]:
    """The public operations of ``cls``: its public methods, the life cycle left out."""
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and name not in LIFECYCLE and callable(member)
    }


def parameters(function: Any) -> list[tuple[str, Any, Any, str]]:
    """``function``'s parameters after ``self``: name, kind, default, annotation (as text)."""
    signature = inspect.signature(function)
    return [
        (p.name, p.kind, p.default, str(p.annotation))
        for p in list(signature.parameters.values())[1:]
    ]


REFERENCE = operations(ConversationStore)
PAIRS = [
    (AsyncConversationStore, set(REFERENCE)),
    (BoundStore, set(REFERENCE) - STORE_ONLY),
    (AsyncBoundStore, set(REFERENCE) - STORE_ONLY),
]


def test_the_reference_has_every_operation() -> None:
    assert set(REFERENCE) >= STORE_ONLY
    assert {"append", "commit_turn", "import_history", "record_attempt", "history"} <= set(
        REFERENCE
    )


@pytest.mark.parametrize(("facade", "expected"), PAIRS, ids=[f.__name__ for f, _ in PAIRS])
def test_each_facade_has_the_same_operations(facade: type, expected: set[str]) -> None:
    assert set(operations(facade)) == expected


@pytest.mark.parametrize(("facade", "expected"), PAIRS, ids=[f.__name__ for f, _ in PAIRS])
def test_each_operation_takes_the_same_parameters(facade: type, expected: set[str]) -> None:
    found = operations(facade)
    for name in sorted(expected):
        assert parameters(found[name]) == parameters(REFERENCE[name]), f"{facade.__name__}.{name}"


@pytest.mark.parametrize("facade", [AsyncConversationStore, AsyncBoundStore])
def test_the_async_facades_are_awaited(facade: type) -> None:
    for name, method in operations(facade).items():
        if name == "heartbeat":  # an async context manager: ``async with store.heartbeat(p)``
            assert inspect.isasyncgenfunction(inspect.unwrap(method)), name
        else:
            assert inspect.iscoroutinefunction(method), name


def test_every_operation_of_a_facade_is_documented() -> None:
    for facade, _ in PAIRS:
        for name, method in operations(facade).items():
            assert (method.__doc__ or "").strip(), f"{facade.__name__}.{name}"
