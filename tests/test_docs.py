"""The manual in docs/ (issue 25): what is generated from the code is complete, the pages are all
reachable, drafts are not built, and a reference to a name that does not exist breaks the build.

The generated pages (exit statuses, state diagram, ending table; docs/_ext/fsmdocs.py) are
written at each build, so they cannot go stale; these tests check that they say everything. The
build itself (``docs/build.sh``, warnings as errors) is a step of ``.ci/run``; the build tests
here need Sphinx (``pip install -e '.[docs]'``) and skip with that reason without it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from click.testing import CliRunner

from fsm.cli.main import cli
from tests.helpers import REPO, docs_extension, require_docs

DOCS = REPO / "docs"


def _fsmdocs() -> ModuleType:
    module: ModuleType = docs_extension()
    return module


def test_exit_status_page_names_every_status_and_every_typed_error() -> None:
    import fsm.cli.main as main

    page = _fsmdocs().exit_status_page()
    constants = [n for n in dir(main) if n.startswith("EXIT_") and n != "EXIT_BY_CLASS"]
    assert len(constants) == 9
    for name in constants:
        assert f"| {getattr(main, name)} | `fsm.cli.main.{name}` | " in page, name
    errors = _fsmdocs().typed_errors()
    assert len(errors) == 16
    for cls in errors:
        path = f"{cls.__module__}.{cls.__qualname__}"
        assert f"| {{class}}`{path}` | {cls.exit_code} | " in page, path


def test_help_lists_the_same_statuses_as_the_constants() -> None:
    """``fsm --help`` carries its own short table of the statuses: it names every one."""
    import fsm.cli.main as main

    help_text = CliRunner().invoke(cli, ["--help"]).output
    listed = {int(n) for n in re.findall(r"^\s+(\d+)\s{2,}\S", help_text, re.M)}
    codes = {getattr(main, n) for n in dir(main) if n.startswith("EXIT_") and n != "EXIT_BY_CLASS"}
    assert listed == codes | {0}


def test_cli_reference_is_generated_from_the_click_group() -> None:
    """The CLI page documents the group itself (sphinx-click walks every command, nested), and
    its notes cover every top-level command."""
    page = (DOCS / "reference" / "cli.md").read_text()
    assert ".. click:: fsm.cli.main:cli" in page and ":nested: full" in page
    for name in cli.commands:  # type: ignore[attr-defined]
        assert f"## `fsm {name}" in page or f"fsm {name}" in page, name


def test_every_page_is_in_the_table_of_contents_and_drafts_are_not_built() -> None:
    index = (DOCS / "index.md").read_text()
    pages = [
        p.relative_to(DOCS).with_suffix("").as_posix()
        for p in DOCS.rglob("*.md")
        if not {"_build", "_generated", "drafts", "examples"} & set(p.parts)
    ]
    for page in pages:
        if page != "index":
            assert f"\n{page}\n" in index, f"{page} is not in docs/index.md's toctree"
    for name in (
        "guides/openai-sdk",
        "guides/services",
        "guides/agent-loop",
        "guides/tool-ledger",
        "guides/formats",
        "guides/host-application",
        "guides/postgresql",
        "guides/testing",
        "guides/audit",
        "reference/cli",
        "reference/exit-status",
        "reference/api",
        "reference/states",
        "reference/limits",
        "reference/errors",
        "decisions",
    ):
        assert name in pages, name
    conf = (DOCS / "conf.py").read_text()
    assert '"drafts"' in conf and '"drafts/**"' in conf
    assert "docs/_build/" in (REPO / ".gitignore").read_text().splitlines()


def test_build_script_turns_warnings_into_errors() -> None:
    script = (DOCS / "build.sh").read_text()
    assert "-m sphinx -W --keep-going -n" in script


# -- the build: a name that does not exist breaks it ---------------------------------------------


def _build(tmp_path: Path, page: str) -> subprocess.CompletedProcess[str]:
    """A one-page Sphinx project configured as the manual is (its conf.py, its extension)."""
    require_docs()
    source = tmp_path / "src"
    source.mkdir()
    conf = (DOCS / "conf.py").read_text()
    conf = conf.replace("HERE = Path(__file__).resolve().parent", f"HERE = Path({str(DOCS)!r})")
    (source / "conf.py").write_text(conf)
    (source / "index.md").write_text(page)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-n",
            "-q",
            "-b",
            "html",
            str(source),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_build_resolves_references_to_fsm_names_wherever_they_are_documented(
    tmp_path: Path,
) -> None:
    page = (
        "# t\n\n```{eval-rst}\n.. autofunction:: fsm.parse\n.. autoclass:: fsm.Turn\n```\n\n"
        "{func}`fsm.parse`, {func}`fsm.api.parse`, {class}`fsm.turn.Turn`, "
        "{class}`fsm.store.ConversationStore` (real, not documented here: shown as code)\n"
    )
    done = _build(tmp_path, page)
    assert done.returncode == 0, done.stderr


def test_build_fails_on_a_reference_to_a_name_that_does_not_exist(tmp_path: Path) -> None:
    done = _build(tmp_path, "# t\n\nSee {func}`fsm.parse_stream_renamed`.\n")
    assert done.returncode != 0
    assert "fsm.parse_stream_renamed" in done.stderr
