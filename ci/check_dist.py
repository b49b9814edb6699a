"""Check the built sdist and wheel in ``dist/`` (``.ci/run`` calls it after ``python -m build``
and ``twine check --strict``): one of each, named and versioned as fsm/__about__.py says, the
LICENSE in both, the package data in the wheel, and nothing but fsm in it.

Usage: python ci/check_dist.py DIST_DIR
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "fsm-toolcalls"
STEM = "fsm_toolcalls"
#: files a working install needs beyond the modules (package data)
PACKAGE_DATA = (
    "fsm/py.typed",
    "fsm/examples/parallel_add_multiply.sse",
    "fsm/web/static/style.css",
    "fsm/store/_migrations/env.py",
    "fsm/store/_migrations/versions/0001_initial_schema.py",
)
#: the extras users choose (pyproject.toml); each must be in the metadata
EXTRAS = {"openai", "anthropic", "postgres", "async", "otel"}
URLS = {"Homepage", "Documentation", "Changelog", "Issues"}


def version() -> str:
    text = (REPO / "fsm" / "__about__.py").read_text(encoding="utf-8")
    (found,) = re.findall(r'^__version__ = "([^"]+)"$', text, re.M)
    return found


def fail(message: str) -> None:
    sys.exit(f"ci/check_dist.py: {message}")


def check_metadata(text: str, where: str, want: str) -> None:
    meta = HeaderParser().parsestr(text)
    if meta["Name"] != NAME or meta["Version"] != want:
        fail(f"{where}: Name {meta['Name']!r} Version {meta['Version']!r}, want {NAME} {want}")
    if meta["License-Expression"] != "MIT" or "LICENSE" not in (meta.get_all("License-File") or []):
        fail(f"{where}: License-Expression {meta['License-Expression']!r}, License-File missing")
    urls = {u.split(",", 1)[0].strip() for u in meta.get_all("Project-URL") or []}
    if not urls >= URLS:
        fail(f"{where}: Project-URL lacks {sorted(URLS - urls)}")
    extras = set(meta.get_all("Provides-Extra") or [])
    if not extras >= EXTRAS or "web" in extras or "clients" in extras:
        fail(f"{where}: extras {sorted(extras)}")
    requires = " ".join(meta.get_all("Requires-Dist") or [])
    if "typing-extensions" not in requires.replace("_", "-"):
        fail(f"{where}: typing_extensions is not a dependency")
    if not meta.get_all("Classifier") or not meta["Keywords"]:
        fail(f"{where}: no classifiers or keywords")


def main(dist: Path) -> None:
    want = version()
    sdists = sorted(dist.glob("*.tar.gz"))
    wheels = sorted(dist.glob("*.whl"))
    if [p.name for p in sdists] != [f"{STEM}-{want}.tar.gz"]:
        fail(f"want one sdist {STEM}-{want}.tar.gz, found {[p.name for p in sdists]}")
    if [p.name for p in wheels] != [f"{STEM}-{want}-py3-none-any.whl"]:
        fail(f"want one wheel {STEM}-{want}-py3-none-any.whl, found {[p.name for p in wheels]}")

    with tarfile.open(sdists[0]) as sdist:
        root = f"{STEM}-{want}"
        names = set(sdist.getnames())
        for needed in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO", "fsm/__init__.py"):
            if f"{root}/{needed}" not in names:
                fail(f"the sdist has no {needed}")
        info = sdist.extractfile(f"{root}/PKG-INFO")
        assert info is not None
        check_metadata(info.read().decode(), "the sdist's PKG-INFO", want)

    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        info_dir = f"{STEM}-{want}.dist-info"
        if f"{info_dir}/licenses/LICENSE" not in names:
            fail("the wheel has no LICENSE")
        for needed in PACKAGE_DATA:
            if needed not in names:
                fail(f"the wheel has no {needed}")
        tops = {n.split("/", 1)[0] for n in names}
        if tops != {"fsm", info_dir}:
            fail(f"the wheel holds more than fsm: {sorted(tops)}")
        check_metadata(wheel.read(f"{info_dir}/METADATA").decode(), "the wheel's METADATA", want)
        entry_points = wheel.read(f"{info_dir}/entry_points.txt").decode()
        if "fsm = fsm.cli.main:main" not in entry_points:
            fail("the wheel has no `fsm` command")
    print(f"ci/check_dist.py: {sdists[0].name} and {wheels[0].name} are complete")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
