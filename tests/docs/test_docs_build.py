"""The documentation site builds in strict mode (what .ci/run does): any Sphinx warning fails, including a broken
link between pages, a page missing from the table of contents, and a reference to an incrinf object the API
reference does not document. Here so that a docstring or page change that breaks the site fails the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest
from doc_blocks import ROOT

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")
pytest.importorskip("furo")


def test_site_builds_strict(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(ROOT / "docs"), str(tmp_path / "html")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for page in ("index", "install", "occlusion", "streams", "offloading", "architecture", "benchmarks",
                 "api/index"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
