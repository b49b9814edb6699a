"""The core imports without the store, Alembic or the command-line library."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import child_json


def test_import_fsm_loads_no_store_or_cli_modules() -> None:
    code = (
        "import sys, json, fsm\n"
        "p = fsm.StreamParser(); p.receive_data(b'data: [DONE]\\n\\n'); p.receive_eof()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('sqlalchemy', 'alembic', 'click', 'psycopg') or m.startswith(('fsm.cli', 'fsm.store'))]\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_api_is_explicit() -> None:
    import fsm

    assert "StreamParser" in fsm.__all__
    for name in fsm.__all__:
        assert hasattr(fsm, name), name


# -- what each import loads (issue 28: the heavy packages' __init__s are lazy) -----------------
#: the libraries that only the store, the viewer, the agent and the command line need
_HEAVY = ("sqlalchemy", "alembic", "click", "psycopg", "openai", "pydantic")


def _loaded_by(module: str) -> list[str]:
    """The modules that ``import module`` loads in a fresh interpreter (the interpreter's own
    start-up modules left out)."""
    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        f"import {module}\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    return list(child_json(code, timeout=60))


def _fsm_modules(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m == "fsm" or m.startswith("fsm.")]


def _heavy(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m.split(".")[0] in _HEAVY]


def test_import_fsm_loads_nothing_until_a_name_is_used() -> None:
    loaded = _loaded_by("fsm")
    assert _fsm_modules(loaded) == ["fsm", "fsm.__about__", "fsm.lazy"]
    assert _heavy(loaded) == []


def test_the_svg_charts_load_neither_the_store_nor_the_server() -> None:
    """``fsm.web.charts`` is standard-library SVG: before the packages were lazy it loaded 48 fsm
    modules and SQLAlchemy (531 modules in all)."""
    loaded = _loaded_by("fsm.web.charts")
    assert _fsm_modules(loaded) == [
        "fsm",
        "fsm.__about__",
        "fsm.lazy",
        "fsm.web",
        "fsm.web.charts",
        "fsm.web.html",
    ]
    assert _heavy(loaded) == []
    assert len(loaded) < 100, len(loaded)


def test_the_store_package_and_its_errors_load_no_database_library() -> None:
    """``import fsm.store`` (34 fsm modules and SQLAlchemy before) and ``import
    fsm.store.errors`` (what the command line and the agent catch) load the error classes
    only; ``fsm.store.ConversationStore`` loads the store when it is used."""
    assert _fsm_modules(_loaded_by("fsm.store")) == [
        "fsm",
        "fsm.__about__",
        "fsm.lazy",
        "fsm.store",
    ]
    loaded = _loaded_by("fsm.store.errors")
    assert _fsm_modules(loaded) == [
        "fsm",
        "fsm.__about__",
        "fsm.errors",
        "fsm.exitstatus",
        "fsm.lazy",
        "fsm.store",
        "fsm.store.errors",
    ]
    assert _heavy(loaded) == []
    code = (
        "import sys, json, fsm.store\n"
        "fsm.store.ConversationStore\n"
        "print(json.dumps(['sqlalchemy' in sys.modules, 'fsm.store.store' in sys.modules]))\n"
    )
    assert child_json(code, timeout=60) == [True, True]


def test_the_command_line_starts_without_the_store() -> None:
    """The ``fsm`` entry point (``fsm.cli.main``) loads click and the parser, never the store,
    the viewer, the agent or a database library: each command imports those when it runs."""
    loaded = _loaded_by("fsm.cli.main")
    fsm_modules = _fsm_modules(loaded)
    assert not [m for m in fsm_modules if m.startswith(("fsm.store", "fsm.web", "fsm.agent"))]
    assert "click" in loaded
    assert [m for m in _heavy(loaded) if m.split(".")[0] != "click"] == []
    # the CLI's modules and the parser's (the core is split by concern: formats/core, chat,
    # responses, anthropic, auto, shapes, vocab...): 38 today; more means something new loads
    assert len(fsm_modules) <= 40, fsm_modules


def test_the_lazy_packages_export_what_they_declare() -> None:
    """Each lazy package's ``__all__``, the names it imports for mypy under ``TYPE_CHECKING``
    and its table of where each name lives (``_EXPORTS``) are the same names, and each name is
    the object of the module the table names."""
    import ast
    import importlib
    import inspect

    for name in ("fsm", "fsm.store", "fsm.web", "fsm.agent"):
        package = importlib.import_module(name)
        table: dict[str, tuple[str, ...]] = package._EXPORTS
        typed: dict[str, tuple[str, ...]] = {}
        for node in ast.parse(inspect.getsource(package)).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                for imp in node.body:
                    assert isinstance(imp, ast.ImportFrom) and imp.module, name
                    typed[imp.module] = (*typed.get(imp.module, ()), *(a.name for a in imp.names))
        assert typed == table, name
        exported = {n for names in table.values() for n in names}
        assert exported == set(package.__all__) - {"__version__"}, name
        for module, names in table.items():
            for attribute in names:
                value = getattr(package, attribute)
                assert value is getattr(importlib.import_module(module), attribute), attribute
                assert attribute in dir(package)


def test_a_lazy_package_still_gives_its_submodules_and_refuses_the_rest() -> None:
    """``import fsm`` then ``fsm.parser`` worked when the package imported it eagerly: the
    lazy package imports a submodule named so; any other name is an AttributeError."""
    code = (
        "import json, fsm, fsm.store\n"
        "ok = [fsm.parser.StreamParser is fsm.StreamParser,\n"
        "      fsm.store.engine.create_engine is fsm.store.engine.create_engine]\n"
        "for package, name in ((fsm, 'no_such_name'), (fsm.store, '_private'), (fsm, '__main__')):\n"
        "    try:\n"
        "        getattr(package, name)\n"
        "    except AttributeError as exc:\n"
        "        ok.append(name in str(exc))\n"
        "    else:\n"
        "        ok.append(False)\n"
        "print(json.dumps(ok))\n"
    )
    assert child_json(code, timeout=60) == [True] * 5
