"""The audit viewer: ``fsm audit serve``, a read-only view of a store's history in the browser.

Pages (each with a JSON twin, ``?format=json``): ``/`` the conversations newest first, ``/c/{id}``
one conversation as a timeline (messages, each tool call as a card with its result and its path
through the state machine, the failed attempts at their place in time), ``/calls`` (``fsm audit
calls``), ``/failures``, ``/stats`` (charts drawn on the server as SVG) and ``/check`` (the
integrity check, rule by rule).

It uses only the standard library's HTTP server (no web framework, no template engine, no
script, no CDN): :mod:`fsm.web.server` (requests, access rules, headers), :mod:`fsm.web.pages`
(the pages), :mod:`fsm.web.html` (escaping and layout), :mod:`fsm.web.charts` (SVG). ``import
fsm`` does not import it.

.. code-block:: python

    from fsm.store import audit
    from fsm.web import serve

    engine = audit.open_readonly("sqlite:///chat.db")
    serving = serve(engine, label="sqlite:///chat.db", port=0)
    print(serving.url)  # http://127.0.0.1:PORT/
    serving.serve_forever()  # until Ctrl-C
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm.lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from fsm.web.server import App, Response, Serving, serve

__all__ = ["App", "Response", "Serving", "serve"]

#: where each exported name lives: imported on first use (PEP 562), not by ``import fsm.web``
_EXPORTS: dict[str, tuple[str, ...]] = {
    "fsm.web.server": (
        "App",
        "Response",
        "Serving",
        "serve",
    ),
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
