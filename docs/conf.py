"""Sphinx configuration of incrinf's documentation site.

Build (strict: any warning, a broken cross-reference or a page missing from the table of contents fails)::

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

Everything the build needs is installed by ``pip install -e ".[docs]"`` (also part of ``.[test]``); it reads
no network (no intersphinx inventories, no fonts or scripts from a CDN), so it works offline.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout, whichever incrinf is installed

project = "incrinf"
author = "incrinf contributors"
copyright = "incrinf contributors"
release = version = "0.1.0"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown pages: headings get anchors so pages can link to sections ([text](page.md#anchor)).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# API reference from the docstrings (Google style: Args / Returns / Raises).
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Strict cross-references (-n): a reference to anything in incrinf must resolve to a documented object. Names from
# other libraries (no intersphinx: the build reads no network) and type-hint fragments are not checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!incrinf\b).+\..+"),  # dotted names outside incrinf: torch.Tensor, numpy.ndarray, ...
    (r"py:.*", r"[A-Z][A-Za-z]*Error|Exception|Warning"),  # built-in exceptions named in docstrings
    (r"py:.*", r"(int|float|str|bytes|bool|None|object|type|dict|list|tuple|set|Any|Callable|Path)"),
]

html_theme = "furo"
html_title = "incrinf"
html_static_path: list[str] = []
