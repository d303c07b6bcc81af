"""The docs' fenced blocks and their markers, read from README.md and ``docs/*.md``.

The convention (docs/contributing.md, "Commands in the docs are tested"): every fenced
block of commands (info string ``sh``, ``bash``, ``shell`` or ``console``) has, on the line
right above it, ``<!-- tested: <id> -->`` (run by ``tests/docs/test_docs_commands.py`` in
the scenario that knows ``<id>``) or ``<!-- not-tested: <reason> -->``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND_LANGS = frozenset({"sh", "bash", "shell", "console"})
MARKER = re.compile(r"^<!--\s*(tested|not-tested):\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a doc."""

    path: Path
    line: int
    """The 1-based line of the opening fence."""
    lang: str
    text: str
    marker: str | None
    """``tested``, ``not-tested`` or None (no marker above the fence)."""
    value: str
    """The id of a tested block, the reason of a block not tested."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_commands(self) -> bool:
        return self.lang in COMMAND_LANGS


def doc_files() -> list[Path]:
    """README.md and every ``docs/*.md``."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.group(1), opening.group(2).lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        above = MARKER.match(lines[i - 1]) if i > 0 else None
        found.append(Block(path=path, line=i + 1, lang=lang,
                           text="\n".join(lines[i + 1:end]) + "\n",
                           marker=above.group(1) if above else None,
                           value=above.group(2) if above else ""))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks_of(path)]


def marked(block_id: str) -> list[Block]:
    """The blocks marked ``tested: <block_id>``, in the docs' order."""
    return [b for b in all_blocks() if b.marker == "tested" and b.value == block_id]


def prose_of(path: Path) -> str:
    """The file's text without its fenced blocks (links and headings live here)."""
    out: list[str] = []
    fence: str | None = None
    for line in path.read_text().splitlines():
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            continue
        if fence is not None:
            if line.startswith(fence):
                fence = None
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|<[^>]*>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for line in prose_of(path).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors
