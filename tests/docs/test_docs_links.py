"""The README's links (the site's own links are checked by its strict build): every relative link names a file
of the repository, and every anchor a heading of that page (GitHub's heading anchors)."""

from __future__ import annotations

import re

from doc_blocks import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's (and MyST's) anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no headings in code
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, flags=re.M)}


def test_anchor_rule() -> None:
    assert anchor("Soak: offloading cameras against a server that is killed twice") == \
        "soak-offloading-cameras-against-a-server-that-is-killed-twice"
    assert anchor("The int8 depthwise kernel") == "the-int8-depthwise-kernel"


def test_readme_links_resolve() -> None:
    readme = ROOT / "README.md"
    text = re.sub(r"```.*?```", "", readme.read_text(encoding="utf-8"), flags=re.S)
    links = [m.group(1) for m in LINK.finditer(text)]
    assert links, "the README links to the documentation"
    bad = []
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue  # an external address: not checked offline
        path, _, frag = link.partition("#")
        target = (readme.parent / path) if path else readme
        if not target.exists():
            bad.append(f"{link}: no file {path}")
        elif frag and (target.suffix != ".md" or frag not in anchors(target)):
            bad.append(f"{link}: no heading #{frag} in {path or 'README.md'}")
    assert not bad, bad
    assert "DESIGN.md" not in readme.read_text(encoding="utf-8")
