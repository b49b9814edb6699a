"""The manual's own Sphinx extension: pages generated from the code, and references checked
against the code.

* At each build, ``docs/_generated/*.md`` is written from the code and included by the pages
  (``{include}``), so it cannot go stale: the tool-call state diagram
  (:func:`fsm.states.mermaid_diagram`), the stream's (:func:`fsm.states.stream_diagram`), each
  format's stop signals (:func:`fsm.states.stop_signal_table`), the ending table
  (:func:`fsm.states.ending_table`) and the exit statuses (the ``EXIT_*`` constants of
  :mod:`fsm.exitstatus` with their ``#:`` comments, and each typed error class's
  ``exit_code``). The CLI reference itself is sphinx-click
  walking the click group.
* A cross-reference to an ``fsm`` name that is not documented under that path (a docstring's
  ``:class:`~fsm.parser.Turn``` where the API reference documents ``fsm.Turn``) is resolved to
  where the object is documented, or shown as code when it is real but not documented. A name
  that does not exist (renamed, removed, misspelt) stays a warning, and the build (``-W``)
  fails. Names outside fsm (the standard library, SQLAlchemy, the SDKs: no inventory is
  fetched, the build is offline) are shown as code.
"""

from __future__ import annotations

import importlib
import inspect
import pydoc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from docutils import nodes

GENERATED = Path(__file__).resolve().parents[1] / "_generated"

#: the modules whose objects the API reference documents, in the order a name is looked up
PUBLIC_MODULES = (
    "fsm",
    "fsm.events",
    "fsm.errors",
    "fsm.store",
    "fsm.store.aio",
    "fsm.store.errors",
    "fsm.store.migrate",
    "fsm.store.audit",
    "fsm.agent",
    "fsm.clients",
    "fsm.types",
    "fsm.replay",
    "fsm.states",
    "fsm.formats.render",
    "fsm.telemetry",
)


# -- generated pages -----------------------------------------------------------------------------


def _attribute_comments(module: Any) -> dict[str, str]:
    """The ``#:`` comment lines right above each ``NAME = ...`` of a module's source, joined
    (what autodoc shows as the attribute's documentation), without importing Sphinx."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(module).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        name = stripped.split("=", 1)[0].split(":", 1)[0].strip()
        if pending and "=" in stripped and name.isidentifier():
            comments[name] = " ".join(pending)
        pending = []
    return comments


def exit_statuses() -> list[tuple[str, int, str]]:
    """``(constant name, status, meaning)`` of every ``EXIT_*`` constant of :mod:`fsm.exitstatus`
    (which :mod:`fsm.cli.main` re-exports), the meaning being the constant's ``#:`` comment, in
    status order."""
    import fsm.exitstatus as statuses

    comments = _attribute_comments(statuses)
    rows = []
    for name in statuses.__all__:
        if name not in comments:
            raise RuntimeError(f"fsm.exitstatus.{name} has no #: comment saying what it means")
        rows.append((name, getattr(statuses, name), comments[name]))
    return sorted(rows, key=lambda row: row[1])


#: the modules that define fsm's typed errors (imported so that every class is found)
ERROR_MODULES = (
    "fsm.errors",
    "fsm.store.errors",
    "fsm.store.deadline",
    "fsm.store.engine",
    "fsm.agent.errors",
    "fsm.clients",
)


def typed_errors() -> list[type]:
    """Every typed error class that sets its own ``exit_code`` (its subclasses inherit it), in
    status order, then by name."""
    from fsm.errors import FsmError

    for module in ERROR_MODULES:
        importlib.import_module(module)
    found: list[type] = []
    todo: list[type] = [FsmError]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    own = [cls for cls in found if "exit_code" in cls.__dict__]
    return sorted(own, key=lambda c: (c.exit_code, c.__module__, c.__qualname__))  # type: ignore[attr-defined]


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def exit_status_page() -> str:
    """The exit statuses as Markdown: one table of the statuses, one of the typed errors."""
    from fsm.exitstatus import EXIT_INTERNAL

    lines = [
        "| status | constant | meaning |",
        "|---|---|---|",
        "| 0 | | done |",
    ]
    for name, code, doc in exit_statuses():
        lines.append(f"| {code} | `fsm.cli.main.{name}` | {doc} |")
    lines += [
        "",
        "The status of each typed error (its class's `exit_code`, which its subclasses inherit:",
        "the most specific class of an error's MRO that sets it decides; any other error is an",
        f"internal error, {EXIT_INTERNAL}):",
        "",
        "| error | status | what it is |",
        "|---|---|---|",
    ]
    for cls in typed_errors():
        path = f"{cls.__module__}.{cls.__qualname__}"
        lines.append(f"| {{class}}`{path}` | {cls.exit_code} | {_first_line(cls)} |")  # type: ignore[attr-defined]
    return "\n".join(lines) + "\n"


def generated_pages() -> dict[str, str]:
    """Every generated include, by file name."""
    from fsm.states import (
        ending_table,
        ledger_diagram,
        mermaid_diagram,
        stop_signal_table,
        stream_diagram,
    )

    return {
        "state-diagram.md": f"```{{mermaid}}\n{mermaid_diagram()}```\n",
        "ending-table.md": ending_table() + "\n",
        "stream-diagram.md": f"```{{mermaid}}\n{stream_diagram()}```\n",
        "stop-signals.md": stop_signal_table() + "\n",
        "ledger-turn-diagram.md": f"```{{mermaid}}\n{ledger_diagram('turn')}```\n",
        "ledger-execution-diagram.md": f"```{{mermaid}}\n{ledger_diagram('execution')}```\n",
        "exit-status.md": exit_status_page(),
    }


def _write_generated(app: Any) -> None:
    GENERATED.mkdir(exist_ok=True)
    for name, text in generated_pages().items():
        path = GENERATED / name
        if not path.exists() or path.read_text() != text:  # unchanged: no rebuild
            path.write_text(text)


# -- references ----------------------------------------------------------------------------------


def _candidates(target: str, context: str | None) -> Iterator[str]:
    yield target
    if context and not target.startswith("fsm"):
        yield f"{context}.{target}"
        parts = context.split(".")
        for end in range(len(parts) - 1, 0, -1):
            yield ".".join(parts[:end]) + "." + target


def _documented_names(obj: Any, target: str) -> Iterator[str]:
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if qualname and module:
        yield f"{module}.{qualname}"
    head, _, attribute = target.rpartition(".")
    owner = pydoc.locate(head) if head else None
    if inspect.isclass(owner) and attribute:  # Class.method: look the class up
        for name in _documented_names(owner, head):
            yield f"{name}.{attribute}"
    short = target.rsplit(".", 1)[-1]
    for module_name in PUBLIC_MODULES:
        try:
            module_obj = importlib.import_module(module_name)
        except ImportError:
            continue
        if getattr(module_obj, short, None) is obj:
            yield f"{module_name}.{short}"


def _dependencies() -> Iterator[tuple[str, Any]]:
    """The SDKs and SQLAlchemy, whose names fsm's annotations use (imported for type checking
    only, so not in fsm's namespaces), as ``("fsm.<name>", module)`` when installed."""
    for name in ("openai", "anthropic", "sqlalchemy"):
        try:
            yield f"fsm.{name}", importlib.import_module(name)
        except ImportError:
            continue


def _missing_reference(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    target: str = node.get("reftarget", "")
    context = node.get("py:module")
    fsm_name = target.startswith("fsm") or (context or "").startswith("fsm")
    if not target.startswith("fsm.") and (" " in target or not fsm_name):
        return contnode  # outside fsm (no inventory offline), or napoleon's prose: as code
    domain = env.get_domain("py")
    for candidate in _candidates(target, context):
        obj = pydoc.locate(candidate)
        if obj is None:
            try:
                obj = importlib.import_module(candidate)
            except ImportError:
                continue
        for name in _documented_names(obj, candidate):
            if name == target:
                continue
            for role in ("class", "func", "meth", "attr", "data", "exc", "obj", "mod"):
                found = domain.resolve_xref(
                    env, node.get("refdoc"), app.builder, role, name, node, contnode
                )
                if found is not None:
                    return found
        return contnode  # real, but not in the API reference: shown as code
    if target.startswith(("~", "_")) or target.split(".", 1)[0].startswith("_"):
        return contnode  # a type variable or a private alias of a dependency's annotation
    if "." not in target and any(
        hasattr(module, target)
        for name, module in [*_dependencies(), *sys.modules.items()]
        if name == "fsm" or name.startswith("fsm.") or name in ("typing", "builtins")
    ):
        return contnode  # a short name that fsm's own code defines or imports
    return None  # a name nothing defines (renamed, removed, misspelt): Sphinx warns


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _write_generated)
    app.connect("missing-reference", _missing_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


__all__ = [
    "ERROR_MODULES",
    "PUBLIC_MODULES",
    "exit_status_page",
    "exit_statuses",
    "generated_pages",
    "nodes",
    "typed_errors",
]
