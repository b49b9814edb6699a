"""Lazy package attributes (PEP 562): a package's ``__init__`` names what it exports and where
each name lives, and a name's module is imported on first use.

So ``import fsm.web.charts`` (a standard-library SVG module) does not run the viewer's server and
SQLAlchemy, ``import fsm.store.errors`` does not build the engine machinery, and ``import fsm``
loads the parser only when it is used. Each lazy package also imports its names under
``TYPE_CHECKING`` (mypy and the manual see them as before) and lists them in ``__all__``;
``tests/test_import.py`` checks that the three agree and guards the modules each import loads.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package named ``package``: ``exports`` maps
    each module to the names the package takes from it. A public name that is not exported but
    is a submodule is imported as the submodule (as when the eager ``__init__`` had imported
    it); anything else raises :class:`AttributeError`. A name, once loaded, is set on the
    package, so the next lookup is a plain attribute."""
    where = {name: module for module, names in exports.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
