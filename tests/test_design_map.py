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
    folders = _first_column_folders("| process", 2)
    assert len(folders) >= 5
    missing = [f for f in folders if not (ROOT / f).exists()]
    assert not missing


def _first_column_folders(header: str, column: int) -> list[str]:
    """The folder named in ``column`` of each row of the Processes table whose header
    row starts with ``header``."""
    text = _section("Processes")
    table = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    return [re.findall(r"`([^`]+)`", row.split("|")[column])[0] for row in table]


def test_every_shared_package_of_the_map_exists_and_no_other() -> None:
    named = {f.rstrip("/") for f in _first_column_folders("| package", 1)}
    present = {f"rota/{p.name}" for p in (ROOT / "rota").iterdir()
               if (p / "__init__.py").exists()}
    assert named == present


def test_the_kubernetes_importers_named_are_the_allowed_ones() -> None:
    text = _section("Processes")
    paragraph = text[text.index("Modules that may import the `kubernetes` client"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    named = set(re.findall(r"`((?:driver|controller|rota)/[^`]+\.py)`", paragraph))
    assert named == KUBERNETES_IMPORTERS


def test_the_harness_map_names_every_folder_of_e2e_and_no_module_is_loose() -> None:
    """``e2e/`` is grouped by purpose: each folder is in DESIGN.md's harness table, each
    folder of the table exists, and nothing but the package marker sits at its top."""
    named = {f.rstrip("/") for f in _first_column_folders("| folder | holds", 1)}
    e2e = ROOT / "e2e"
    present = {f"e2e/{p.name}" for p in e2e.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert named == present
    loose = sorted(p.name for p in e2e.iterdir()
                   if p.is_file() and p.name not in ("__init__.py", "py.typed", "README.md"))
    assert not loose
