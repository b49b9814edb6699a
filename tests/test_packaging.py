"""The distribution (issue 25): every module fsm imports is declared, every install hint names
the distribution and one of its extras, the version lives in one place, and the README's
editable install is one that mypy follows.

``.ci/run`` does the rest: it builds the sdist and the wheel, checks their metadata and that the
LICENSE is in both, and installs the wheel in a new venv outside the checkout.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import fsm
from fsm.cli.main import cli
from tests.helpers import REPO, mypy_cache

DIST = "fsm-toolcalls"
PROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))[
    "project"
]
#: the extras a user chooses (the others are the project's own tools)
TOOL_EXTRAS = {"test", "bench", "docs"}
#: modules fsm imports that no install of fsm needs: the pytest plugin (fsm/pytest_plugin.py,
#: an entry point) is only ever loaded by pytest itself; an integration's implementation module
#: (fsm/integrations/<framework>_store.py and the like) only by its facade module, once the
#: facade found the framework (else it raises its typed error naming the extra)
LOADED_BY_THEIR_HOST = {
    ("fsm/pytest_plugin.py", "pytest"),
    ("fsm/integrations/pydantic_ai_store.py", "pydantic_ai"),
    ("fsm/integrations/pydantic_ai_messages.py", "pydantic_ai"),
    ("fsm/integrations/langchain_history.py", "langchain_core"),
}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _imports() -> Iterator[tuple[str, str, bool]]:
    """``(file, top-level module, unconditional)`` for each import of a module outside the
    standard library and fsm; unconditional: at a module's top level, not under
    ``if TYPE_CHECKING:`` nor in a ``try:`` (those are optional or for the type checker)."""

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            yield child, top
            inner = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.If | ast.Try | ast.ClassDef
            )
            yield from walk(child, inner)

    for path in sorted((REPO / "fsm").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, top in walk(tree, True):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                name = module.split(".")[0]
                if name != "fsm" and name not in sys.stdlib_module_names:
                    yield path.relative_to(REPO).as_posix(), name, top


@cache
def _providers() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str, declared: set[str]) -> set[str]:
    """The installed distributions that provide the top-level ``module``; for one that is not
    installed (an extra's framework, where the frameworks are not), the declared distribution
    of the same name."""
    provided = _providers().get(module, [])
    if not provided and canonicalize_name(module) in declared:
        return {canonicalize_name(module)}
    assert provided, f"fsm imports {module}, which no installed distribution provides"
    return {canonicalize_name(d) for d in provided}


def test_every_import_is_declared() -> None:
    """What fsm imports at its modules' top level is a dependency; what it imports anywhere
    else (in a function, under ``TYPE_CHECKING``) is a dependency or in a user's extra."""
    required = _names(PROJECT["dependencies"])
    optional = set().union(
        *(
            _names(reqs)
            for extra, reqs in PROJECT["optional-dependencies"].items()
            if extra not in TOOL_EXTRAS
        )
    )
    undeclared, not_required = [], []
    for file, module, top in _imports():
        if (file, module) in LOADED_BY_THEIR_HOST:
            continue
        dists = _distributions(module, required | optional)
        if not dists & (required | optional):
            undeclared.append(f"{file}: {module} ({', '.join(sorted(dists))})")
        elif top and not dists & required:
            not_required.append(f"{file}: {module} (only in an extra)")
    assert undeclared == [], "imported but not declared in pyproject.toml"
    assert not_required == [], "imported unconditionally but not a dependency"


def test_the_import_walk_sees_every_kind_of_import() -> None:
    """The walk above finds the imports it must judge (a test of the test)."""
    seen = {(file, module, top) for file, module, top in _imports()}
    assert ("fsm/types.py", "typing_extensions", True) in seen  # the one that was undeclared
    assert ("fsm/agent/loop.py", "openai", False) in seen  # under TYPE_CHECKING
    assert any(m == "opentelemetry" and not top for _, m, top in seen)  # in a function
    assert any(m == "sqlalchemy" and top for _, m, top in seen)


def _hints() -> list[tuple[str, str]]:
    found = []
    for path in sorted((REPO / "fsm").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"pip install\s+(\S+)", text):
            found.append((path.relative_to(REPO).as_posix(), match.group(1)))
    return found


def test_every_install_hint_names_the_distribution_and_an_extra() -> None:
    """``pip install 'fsm-toolcalls[EXTRA]'`` with an extra that exists (``fsm`` on PyPI is
    another project); the driver fallback ``pip install {driver}`` names the driver itself, and
    the adapters' ``{extra}`` (fsm.integrations.errors) is the extra each adapter names, which
    their own tests check."""
    extras = set(PROJECT["optional-dependencies"]) - TOOL_EXTRAS
    hints = _hints()
    assert len(hints) >= 5
    for file, target in hints:
        if target.startswith("{driver}"):
            continue
        match = re.match(r"'fsm-toolcalls\[([\w-]+|\{package\}|\{extra\})\]'", target)
        assert match, f"{file}: pip install {target}"
        if match.group(1) not in ("{package}", "{extra}"):
            assert match.group(1) in extras, f"{file}: pip install {target}"


@pytest.mark.parametrize(
    ("url", "driver", "extra"),
    [
        ("postgresql+psycopg://app@localhost/app", "psycopg", "postgres"),
        ("postgresql+psycopg_async://app@localhost/app", "psycopg", "postgres"),
        ("sqlite+aiosqlite:///{tmp}/fsm.db", "aiosqlite", "async"),
    ],
)
def test_a_missing_driver_names_the_extra_that_brings_it(
    url: str, driver: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsm.store import DriverMissingError, create_engine
    from fsm.store.engine import create_async_engine

    monkeypatch.setitem(sys.modules, driver, None)  # import fails: ModuleNotFoundError
    factory = create_async_engine if "async" in url or "aiosqlite" in url else create_engine
    with pytest.raises(DriverMissingError) as caught:
        factory(url.format(tmp=tmp_path))
    assert str(caught.value).endswith(f"needs it: pip install 'fsm-toolcalls[{extra}]'")
    assert canonicalize_name(driver) in _names(PROJECT["optional-dependencies"][extra])


@pytest.mark.parametrize("package", ["openai", "anthropic"])
def test_the_demo_names_the_extra_of_a_missing_sdk(
    package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import fails: ModuleNotFoundError
    fmt = "anthropic" if package == "anthropic" else "chat"
    result = CliRunner().invoke(cli, ["demo", "--format", fmt, "--delay", "0"])
    assert result.exit_code == 2
    hint = f"pip install 'fsm-toolcalls[{package}]'"
    assert hint in result.stderr
    assert canonicalize_name(package) in _names(PROJECT["optional-dependencies"][package])


def test_the_version_lives_in_one_place() -> None:
    """fsm/__about__.py holds it; pyproject.toml reads it from there; ``fsm.__version__``,
    ``fsm --version`` and the installed metadata show it."""
    about = (REPO / "fsm" / "__about__.py").read_text(encoding="utf-8")
    (version,) = re.findall(r'^__version__ = "([^"]+)"$', about, re.M)
    assert "version" in PROJECT["dynamic"] and "version" not in PROJECT
    assert fsm.__version__ == version
    assert "__version__" in fsm.__all__
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"fsm, version {version}\n"
    dist = _installed_from_here()
    if dist is not None:
        assert dist.version == version


def _installed_from_here() -> importlib.metadata.Distribution | None:
    """The installed fsm-toolcalls when it is this checkout installed editable, else ``None``
    (an ``*.egg-info`` the editable build leaves in the checkout is found first on the path:
    the installed one is the distribution with a ``direct_url.json``)."""
    for dist in importlib.metadata.distributions(name=DIST):
        text = dist.read_text("direct_url.json")
        if text:
            direct = json.loads(text)
            here = Path(direct["url"].removeprefix("file://")).resolve() == REPO
            return dist if here and direct.get("dir_info", {}).get("editable") else None
    return None


@pytest.mark.slow  # a mypy run
def test_the_editable_install_is_one_mypy_follows(tmp_path: Path) -> None:
    """The README's ``pip install -e '.[test]'`` puts the checkout on the path by a static .pth
    line (not an import hook that only the interpreter runs), so ``mypy --strict`` on a user's
    file outside the checkout finds fsm and its types: ci/user_check.py passes, and a file
    that misuses fsm fails with the type error (not with "cannot find module fsm")."""
    dist = _installed_from_here()
    if dist is None:
        pytest.skip("fsm-toolcalls is not installed editable from this checkout")
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    files = dist.files or []
    pth = [f for f in files if f.name.endswith(".pth")]
    assert pth, "the editable install has no .pth file"
    lines = [line for f in pth for line in (f.read_text() or "").splitlines() if line.strip()]
    assert str(REPO) in lines, lines
    assert not any(line.startswith("import ") for line in lines), lines
    shutil.copy(REPO / "ci" / "user_check.py", tmp_path / "user_check.py")
    (tmp_path / "misuse.py").write_text("import fsm\n\nversion: int = fsm.__version__\n")
    done = subprocess.run(
        [mypy, "--strict", *mypy_cache(), "user_check.py", "misuse.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("misuse.py:3: error: Incompatible types"), (
        done.stdout
    )
