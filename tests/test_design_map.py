"""DESIGN.md's newcomer map matches the code: every folder its process table names exists,
and the modules it says may import the ``kubernetes`` client are the ones the layering
check allows."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layering import KUBERNETES_IMPORTERS

ROOT = Path(__file__).resolve().parent.parent
DESIGN = (ROOT / "DESIGN.md").read_text()


def _section(title: str) -> str:
    start = DESIGN.index(f"## {title}\n")
    end = DESIGN.find("\n## ", start + 1)
    return DESIGN[start:end if end != -1 else None]


def test_every_folder_of_the_process_table_exists() -> None:
    rows = [line for line in _section("Processes").splitlines()
            if line.startswith("| ") and not line.startswith("| process")]
    folders = [re.findall(r"`([^`]+)`", row.split("|")[2])[0] for row in rows]
    assert len(folders) >= 5
    missing = [f for f in folders if not (ROOT / f).exists()]
    assert not missing


def test_the_kubernetes_importers_named_are_the_allowed_ones() -> None:
    text = _section("Processes")
    paragraph = text[text.index("Modules that may import the `kubernetes` client"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    named = set(re.findall(r"`((?:driver|controller)/[^`]+\.py)`", paragraph))
    assert named == KUBERNETES_IMPORTERS
