"""ci/lowest.txt (the constraints of CI's lowest-versions step in .ci/run) pins every dependency
at exactly the lower bound pyproject.toml declares for it, so the step tests what the package
promises to work with."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import REPO

#: the extras CI installs (``.[test]``) and the ones users choose; ``bench`` pins peers exactly
EXTRAS = ("postgres", "openai", "async", "test")
#: test tools: not the package's dependencies, left to float (anthropic: only its request
#: types, to validate rendered messages; playwright: the viewer's browser tests; fastapi: the
#: manual's FastAPI example)
TOOLS = {
    "pytest",
    "pytest-cov",
    "pytest-xdist",
    "hypothesis",
    "atheris",
    "mypy",
    "ruff",
    "anthropic",
    "playwright",
    "fastapi",
}


def lower_bounds() -> dict[str, Version]:
    """Each dependency's lower bound: the highest ``>=`` bound it has anywhere (the runtime
    dependencies and the extras)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    bounds: dict[str, Version] = {}
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name in TOOLS:
            continue
        lows = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        assert lows, f"{text!r} in pyproject.toml has no lower bound"
        bounds[name] = max([*lows, bounds.get(name, Version("0"))])
    return bounds


def pins() -> dict[str, Version]:
    pinned: dict[str, Version] = {}
    for line in (REPO / "ci" / "lowest.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"ci/lowest.txt pins exactly: {line!r}"
        pinned[canonicalize_name(requirement.name)] = Version(spec.version)
    return pinned


def test_lowest_txt_pins_every_lower_bound() -> None:
    assert pins() == lower_bounds()


def test_every_dependency_has_a_lower_bound() -> None:
    bounds = lower_bounds()
    assert {"sqlalchemy", "openai", "click", "psycopg", "pydantic"} <= set(bounds)
