"""Retrying a commit safely: a turn is committed at most once under its idempotency key, so a
retry after an unknown outcome either writes it now or returns the stored copy.

No server needed. ``python commit_retry.py``
"""

import time

from fsm import parse
from fsm.replay import EXAMPLES_DIR
from fsm.store import ConversationStore
from fsm.store.errors import StoreBusyError, StoreUnavailableError

store = ConversationStore("chat.db", timeout=10)  # or "postgresql+psycopg://app@db/app"


def commit(conversation, turn, results, key):
    for attempt in range(5):
        try:
            return store.commit_turn(conversation, turn, results, idempotency_key=key)
        except (StoreUnavailableError, StoreBusyError):  # CommitOutcomeUnknownError included
            time.sleep(0.2 * 2**attempt)  # the same key: exactly one turn in the end
    raise RuntimeError("the database stayed unreachable")


conversation = store.create_conversation()
turn = parse(EXAMPLES_DIR / "parallel_add_multiply.sse").turns[0]
first = commit(conversation, turn, ["6912", "408"], key="request-42")
again = commit(conversation, turn, ["6912", "408"], key="request-42")  # a retry: no second copy
assert (first.created, again.created) == (True, False)
print("written once:", len(store.history(conversation)), "messages")
store.close()
