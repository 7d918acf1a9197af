"""The Python examples of the README and the documentation pages, as the docs' example tests run them.

Every fenced ```` ```python ```` block of a page is an example; a page's blocks run in order in one namespace (a
later block may use an earlier one's names), in a fresh process whose working directory is an empty temporary
folder. Two HTML comments, invisible on GitHub and in the built site, control a block when they stand on the
lines just before its fence:

- ``<!-- docs-test: skip REASON -->``: the block is not run (it needs a server, a GPU, a cluster, or runs for
  minutes); the reason is required and shows in the test report.
- ``<!-- docs-test: setup`` ... ``-->``: the Python between the markers runs before the block (it makes the files
  an example reads, e.g. a folder of photos), so the example itself stays as a user would write it.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s+(\S.*?)\s*-->\s*$")
SETUP_OPEN = re.compile(r"^<!--\s*docs-test:\s*setup\s*$")
MARKER = re.compile(r"<!--\s*docs-test")


@dataclass(frozen=True)
class Block:
    """One fenced Python block: its source, where it starts, and its test markers."""

    path: str  # relative to the repository root
    line: int  # 1-based line of the block's first code line
    source: str
    skip: str | None = None  # why it does not run
    setup: str = ""  # hidden Python run before it


def pages() -> list[Path]:
    """The README and every Markdown page of the documentation site."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


def blocks(page: Path) -> list[Block]:
    """The Python blocks of one Markdown page, with their markers; a marker that is not followed by a Python
    block, or a malformed one, is a ``ValueError`` (so a typo cannot silently run or skip an example)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    rel = page.relative_to(ROOT).as_posix()
    found: list[Block] = []
    skip: str | None = None
    setup: list[str] = []
    pending = 0  # line of a marker still waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            indent, mark, lang = fence.groups()
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(mark):
                end += 1
            if lang in ("python", "py"):
                code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end])
                found.append(Block(rel, i + 2, code, skip, "\n".join(setup)))
            elif pending:
                raise ValueError(f"{rel}:{pending}: a docs-test marker must stand right before a python block")
            skip, setup, pending = None, [], 0
            i = end + 1
            continue
        if SKIP.match(line):
            skip, pending = SKIP.match(line).group(1), i + 1
        elif SETUP_OPEN.match(line):
            pending = i + 1
            i += 1
            while i < len(lines) and lines[i].strip() != "-->":
                setup.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{rel}:{pending}: a docs-test setup comment is not closed by a '-->' line")
        elif MARKER.search(line):
            raise ValueError(f"{rel}:{i + 1}: unknown docs-test marker {line.strip()!r}")
        elif line.strip() and pending:
            raise ValueError(f"{rel}:{pending}: a docs-test marker must stand right before a python block")
        i += 1
    if pending:
        raise ValueError(f"{rel}:{pending}: a docs-test marker must stand right before a python block")
    return found


def run(blocks_json: str) -> int:
    """Run a page's blocks in order in one namespace (this process); report the first failure with the page's
    own file name and line numbers in the traceback."""
    namespace: dict = {"__name__": "__main__"}
    for raw in json.loads(blocks_json):
        block = Block(**raw)
        if block.skip:
            print(f"skipped {block.path}:{block.line}: {block.skip}")
            continue
        try:
            if block.setup:
                exec(compile(block.setup, f"{block.path}:{block.line} (setup)", "exec"), namespace)
            # padded with blank lines so the traceback's line numbers are the page's
            exec(compile("\n" * (block.line - 1) + block.source, block.path, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: the example at {block.path}:{block.line}", file=sys.stderr)
            return 1
        print(f"ran {block.path}:{block.line}")
    return 0


def encode(found: list[Block]) -> str:
    return json.dumps([asdict(b) for b in found])


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]).read_text(encoding="utf-8")))
