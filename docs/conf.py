"""Sphinx configuration of incrinf's documentation site.

Build (strict: any warning fails)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

What fails: a link to a page or a heading that does not exist, a page outside the table of contents, malformed
markup in a page or a docstring, an API entry naming an object that cannot be imported, and a docstring reference
to an ``incrinf`` object that does not exist (:func:`_check_reference`). A docstring reference to an object that
exists but has no entry in the reference (an internal class) renders as code, unlinked.

Everything the build needs is installed by ``pip install -e ".[docs]"`` (also part of ``.[test]``); it reads
no network (no intersphinx inventories, no fonts or scripts from a CDN), so it works offline.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from sphinx.util import logging

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

# Cross-references: not nitpicky (docstrings also name internals the reference does not document, and other
# libraries' objects: there is no intersphinx, the build reads no network); a reference to an incrinf object that
# does not exist is an error all the same (_check_reference).
nitpicky = False

html_theme = "furo"
html_title = "incrinf"
html_static_path: list[str] = []


_logger = logging.getLogger(__name__)


def _exists(dotted: str) -> bool:
    """Whether ``incrinf.a.b.C.d`` names something: a module, then attributes (or dataclass fields) of it."""
    parts = dotted.split(".")
    if not all(parts):
        return False
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if name in fields or name in getattr(obj, "__annotations__", {}):
                return name == parts[-1]
            try:
                obj = getattr(obj, name)
            except AttributeError:
                return False
        return True
    return False


def _check_reference(app, env, node, contnode):
    """An unresolved reference to ``incrinf....``: an error when nothing by that name exists."""
    target = node.get("reftarget", "")
    if node.get("refdomain") == "py" and target.startswith("incrinf") and not _exists(target):
        _logger.warning(f"reference to {target!r}, which does not exist", location=node, type="ref",
                        subtype="incrinf")
    return None


def setup(app):
    app.connect("missing-reference", _check_reference)
