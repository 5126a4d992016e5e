"""Sphinx configuration of ctuq's documentation site: the guide (the Markdown pages of docs/, through MyST), the
tutorial (docs/tutorial.md, a MyST notebook rendered without executing it: tests/test_tutorial.py executes it) and the
API reference (docs/api/, autodoc over the NumPy docstrings through napoleon).

    make docs        # = bash scripts/dev.sh docs: sphinx-build -W --keep-going docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the source tree, also where ctuq is not installed

import ctuq  # noqa: E402

project = "ctuq"
author = "the ctuq authors"
copyright = "the ctuq authors"  # noqa: A001 - Sphinx's name for it
release = version = ctuq.__version__

extensions = [
    "myst_nb",  # MyST Markdown and MyST notebooks (it brings myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
# docs/README.md is GitHub's index of the folder; the site's index is index.md (README.md is one of its pages)
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
# Links that leave the site, written for GitHub where they resolve: the repository's README.md and CONTRIBUTING.md
# (outside docs/, so not pages of the site; index.md is the site's front page) and the figures/ folder (a listing on
# GitHub). The site shows their text unlinked instead of warning; tests/test_docs_links.py checks that they resolve.
nitpick_ignore = [("myst", str(ROOT / "README")), ("myst", str(ROOT / "CONTRIBUTING")), ("myst", "figures/")]

# MyST: GitHub's anchors for headings (the guide links to #sections), $…$ maths, ::: fences
myst_heading_anchors = 6
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
# The tutorial is rendered as written: the test suite executes it (tests/test_tutorial.py), the site build does not.
nb_execution_mode = "off"

# autodoc: members in source order, signatures without the type hints (they are in the docstrings' tables)
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"ctuq {release}"
