"""The command line's exit statuses: one per outcome, the same for every command.

Every typed error carries its status as the class attribute ``exit_code`` (:class:`fsm.errors.
FsmError` and its subclasses, inherited like any attribute: the most specific class that sets it
decides), so the command line maps an error to its status without a table of class names and
without importing the store. The manual's exit status page (``docs/reference/exit-status.md``) is
generated from these constants, their comments and the classes.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CORRUPT",
    "EXIT_FULL",
    "EXIT_INCOMPLETE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OUTCOME_UNKNOWN",
    "EXIT_STORE",
    "EXIT_UNAVAILABLE",
    "EXIT_UNUSABLE",
]

#: the work was done and the result is incomplete or not clean (a stream that did not complete,
#: a turn recorded as a failed attempt, an audit check that found violations)
EXIT_INCOMPLETE = 1
#: a usage error or unusable input (a bad option or URL, input that is not a stream)
EXIT_UNUSABLE = 2
#: the store refused the request (not found, conflict, schema not at head, value rejected)
EXIT_STORE = 3
#: the database could not be reached or stayed busy: nothing was written, retry later
EXIT_UNAVAILABLE = 4
#: the connection was lost while COMMIT was in flight: retry with the same idempotency key
EXIT_OUTCOME_UNKNOWN = 5
#: the disk or the database is full: nothing was written
EXIT_FULL = 6
#: the database is corrupt: the engine's own integrity check failed, or the stored history
#: breaks the contract the database enforces (it was edited with enforcement off)
EXIT_CORRUPT = 7
#: an unexpected internal error (a bug: please report it)
EXIT_INTERNAL = 70
#: interrupted (Ctrl-C), as shells report SIGINT
EXIT_INTERRUPTED = 130
