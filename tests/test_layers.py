"""The layers a test guards (issue 28): fsm's import graph, read from the source.

Every ``import`` of an fsm module in ``fsm/`` (function-level imports included, ``TYPE_CHECKING``
blocks too) is an edge of the graph. Four rules, each a set of violations:

- **cycles**: the modules of each strongly connected component of more than one module;
- **private**: a name with a leading underscore imported from another module
  (``from fsm.x import _name``);
- **upward**: an import that runs up the layers of ``../shared/guides/architecture.md``
  (:data:`LAYERS`: a module imports only from its own layer or those below);
- **exports**: a package ``__init__`` whose ``__all__`` differs from its public names.

Today's violations are the allow-list ``tests/layers_allowed.json``: the test fails on a violation
that is not on it (a new cycle, a new private import: fix it at its cause), and on an entry that
no longer happens (the list only shrinks: remove the entry). ``python tests/test_layers.py``
prints the violations as that file holds them, to write it anew after a clean-up.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsm"
ALLOWED = Path(__file__).with_name("layers_allowed.json")

#: the layers, lowest first: a module's layer is the first whose prefix names it (the longest
#: prefix wins); a module imports only from its own layer or those below
LAYERS: list[tuple[str, ...]] = [
    (
        "fsm.errors",
        "fsm.exitstatus",
        "fsm.lazy",
        "fsm.events",
        "fsm.states",
        "fsm.types",
        "fsm.sse",
        "fsm.jsonsyntax",
        "fsm.jsonutil",
        "fsm.vocab",
        "fsm.text",
        "fsm.jsontext",
    ),
    ("fsm.toolcall", "fsm.turn", "fsm.shapes", "fsm.chat_completion"),
    ("fsm.formats", "fsm.parser", "fsm.api", "fsm.completion", "fsm.__init__", "fsm.__about__"),
    (
        "fsm.clients",
        "fsm.telemetry_otel",
        "fsm.telemetry_chat",
        "fsm.telemetry",
        "fsm.replay",
        "fsm.replay_formats",
        "fsm.replay_script",
        "fsm.replay_checks",
        "fsm.testing",
        "fsm.pytest_plugin",
        "fsm.store",
    ),
    ("fsm.agent", "fsm.integrations"),
    ("fsm.cli", "fsm.web", "fsm.__main__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "fsm"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_migrations" in path.parts:  # Alembic's revision scripts: not imported by name
            continue
        found[module_name(path)] = path
    return found


def layer(module: str) -> int:
    best, best_len = len(LAYERS), -1
    if module == "fsm":
        module = "fsm.__init__"
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = number, len(prefix)
    return best


def imports(path: Path, name: str, known: dict[str, Path]) -> Iterator[tuple[str, str | None]]:
    """(imported fsm module, imported name or None) of every import in the file."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "fsm" or alias.name.startswith("fsm."):
                    yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            if not (source == "fsm" or source.startswith("fsm.")):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:  # `from fsm.store import engine`: the module itself
                    yield submodule, None
                else:
                    yield source, alias.name


def graph() -> tuple[dict[str, set[str]], list[str], list[str], list[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    private: set[str] = set()
    upward: set[str] = set()
    for name, path in known.items():
        for target, imported in imports(path, name, known):
            if target not in known or target == name:
                continue
            # importing a package's submodule runs the package's __init__ too, but the edge that
            # matters is to the module named
            edges[name].add(target)
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                private.add(f"{name} <- {target}.{imported}")
            if layer(target) > layer(name):
                upward.add(f"{name} -> {target}")
    return edges, sorted(private), sorted(upward), exports(known)


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []
    counter = 0
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(" <-> ".join(sorted(component)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def exports(known: dict[str, Path]) -> list[str]:
    """Packages whose ``__all__`` differs from the public names their ``__init__`` binds (its
    own definitions and what it imports from fsm)."""
    problems = []
    for name, path in known.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        declared: set[str] | None = None
        bound: set[str] = set()
        body = _with_type_checking_imports(tree.body) if _is_lazy(tree) else tree.body
        for node in body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        if target.id == "__all__" and node.value is not None:
                            declared = set(ast.literal_eval(node.value))
                        else:
                            bound.add(target.id)
            elif isinstance(node, ast.ImportFrom) and (node.level or _is_fsm(node.module)):
                # what a package takes from fsm is what it publishes; typing and the standard
                # library's names are tools, not API
                bound.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                bound.add(node.name)
        public = {n for n in bound if not n.startswith("_") and n != "annotations"}
        if declared is None:
            continue
        if public != declared - {"__version__"}:
            missing, extra = sorted(public - declared), sorted(declared - public - {"__version__"})
            problems.append(f"{name}: public but not in __all__ {missing}; in __all__ only {extra}")
    return sorted(problems)


def _is_lazy(tree: ast.Module) -> bool:
    """Whether a package binds a module ``__getattr__`` (PEP 562: its names are lazy)."""
    return any(
        (
            isinstance(node, ast.Name)
            and node.id == "__getattr__"
            and isinstance(node.ctx, ast.Store)
        )
        or (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
        for node in ast.walk(tree)
    )


def _with_type_checking_imports(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module's top level, and those of its ``if TYPE_CHECKING:`` blocks:
    a lazy package (PEP 562, :mod:`fsm.lazy`) binds its names there for mypy and the manual."""
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in {
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        }:
            yield from node.body
        else:
            yield node


def _is_fsm(module: str | None) -> bool:
    return module is not None and (module == "fsm" or module.startswith("fsm."))


def violations() -> dict[str, list[str]]:
    edges, private, upward, exported = graph()
    return {"cycles": cycles(edges), "private": private, "upward": upward, "exports": exported}


def test_every_module_has_a_layer() -> None:
    assert [m for m in modules() if layer(m) == len(LAYERS)] == []


def test_no_new_violation_and_the_allow_list_only_shrinks() -> None:
    allowed: dict[str, list[str]] = json.loads(ALLOWED.read_text())
    found = violations()
    new = {kind: sorted(set(found[kind]) - set(allowed.get(kind, []))) for kind in found}
    gone = {kind: sorted(set(allowed.get(kind, [])) - set(found[kind])) for kind in allowed}
    assert {k: v for k, v in new.items() if v} == {}, (
        "new layer violations: fix them at their cause"
    )
    assert {k: v for k, v in gone.items() if v} == {}, (
        "fixed violations still on tests/layers_allowed.json: remove them (the list only shrinks)"
    )


def test_the_guard_sees_a_cycle_a_private_import_and_an_upward_import(tmp_path: Path) -> None:
    """The rules themselves, on inputs made for the purpose (so the guard cannot pass blind)."""
    init = tmp_path / "__init__.py"
    init.write_text(
        "from typing import Any\nfrom fsm.parser import StreamParser, Turn\n"
        "def helper() -> None: ...\n__all__ = ['StreamParser', 'gone']\n"
    )
    assert exports({"pkg": init}) == [
        "pkg: public but not in __all__ ['Turn', 'helper']; in __all__ only ['gone']"
    ]
    lazy = tmp_path / "lazy" / "__init__.py"
    lazy.parent.mkdir()
    lazy.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from fsm.parser import StreamParser, Turn\n__all__ = ['StreamParser']\n"
        "if not TYPE_CHECKING:\n    __getattr__ = None\n"
    )
    assert exports({"lazy": lazy}) == [
        "lazy: public but not in __all__ ['Turn']; in __all__ only []"
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a <-> b <-> c"]
    assert layer("fsm.errors") < layer("fsm.parser") < layer("fsm.store.store") < layer("fsm.cli")
    assert layer("fsm.store.audit.calls") == layer("fsm.store")
    source = ROOT / "fsm" / "api.py"
    found = list(imports(source, "fsm.api", modules()))
    assert ("fsm.parser", "StreamParser") in found


if __name__ == "__main__":
    print(json.dumps(violations(), indent=2))
