"""The README's and the documentation site's Python examples run, offline, as written (see doc_blocks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import ROOT, blocks, encode, pages

PAGES = [p for p in pages() if blocks(p)]


def test_the_readme_and_the_guides_have_examples() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert "README.md" in names
    assert {"docs/occlusion.md", "docs/streams.md", "docs/offloading.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_examples_run(page: Path, tmp_path: Path) -> None:
    script = tmp_path / "blocks.json"
    script.write_text(encode(blocks(page)), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("INCRINF_TOKEN", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("doc_blocks.py")), str(script)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "ran " in proc.stdout  # at least one example of the page ran


def _page(tmp_path: Path, text: str) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    page = docs / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


def test_markers_skip_and_set_up_the_next_block(tmp_path, monkeypatch) -> None:
    import doc_blocks

    monkeypatch.setattr(doc_blocks, "ROOT", tmp_path)
    page = _page(tmp_path, "# t\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip needs a server -->\n```python\n"
                 "y = x\n```\n<!-- docs-test: setup\nz = 2\n-->\n```python\nw = z + x\n```\n\n```bash\nls\n```\n")
    found = blocks(page)
    assert [(b.line, b.skip, b.setup) for b in found] == [(4, None, ""), (9, "needs a server", ""), (15, None, "z = 2")]
    assert doc_blocks.run(encode(found)) == 0


@pytest.mark.parametrize("text", [
    "<!-- docs-test: skip -->\n```python\nx = 1\n```\n",           # no reason
    "<!-- docs-test: skip why -->\n```bash\nls\n```\n",             # not before a python block
    "<!-- docs-test: skip why -->\n\nsome text\n```python\nx\n```\n",  # text in between
    "<!-- docs-test: setup\nx = 1\n",                               # not closed
    "<!-- docs-test: skip why -->\n",                               # nothing after it
])
def test_a_malformed_marker_is_an_error(tmp_path, monkeypatch, text: str) -> None:
    import doc_blocks

    monkeypatch.setattr(doc_blocks, "ROOT", tmp_path)
    with pytest.raises(ValueError, match="docs-test"):
        blocks(_page(tmp_path, text))


def test_a_failing_example_names_its_page_and_line(tmp_path, monkeypatch, capsys) -> None:
    import doc_blocks

    monkeypatch.setattr(doc_blocks, "ROOT", tmp_path)
    page = _page(tmp_path, "# t\n\n```python\nx = 1\nraise ValueError('boom')\n```\n")
    assert doc_blocks.run(encode(blocks(page))) == 1
    err = capsys.readouterr().err
    assert 'File "docs/page.md", line 5' in err and "docs/page.md:4" in err
