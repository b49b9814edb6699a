"""Sphinx configuration of fsm's manual (MyST Markdown pages, furo, autodoc from docstrings).

Build: ``docs/build.sh`` (``python -m sphinx -W --keep-going -b html docs docs/_build/html``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # fsm from this checkout, installed or not

import fsm  # noqa: E402

# accessible-pygments (furo's) configures the root logger at INFO when imported: keep the
# migrations' INFO records (imported by autodoc) out of the build's output
logging.getLogger("alembic").setLevel(logging.WARNING)

project = "fsm"
author = "the fsm authors"
copyright = "2026, the fsm authors"
release = fsm.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx_click",
    "sphinxcontrib.mermaid",
    "fsmdocs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/drafts/: other branches' text waiting to be folded into the guides, never built
exclude_patterns = [
    "_build",
    "_generated",
    "drafts",
    "drafts/**",
    "Thumbs.db",
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"fsm {release}"
html_static_path: list[str] = []

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
