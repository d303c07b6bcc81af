"""The start-gate directory is made usable for a non-root lease controller: a hostPath
volume creates it 0755 and root-owned, where the controller (group 0) could not listen."""

from __future__ import annotations

import stat
from pathlib import Path

from driver.startgate import START_GATE_DIR_MODE, prepare_start_gate_dir


def test_a_missing_or_root_only_directory_gets_the_start_gate_mode(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "start"
    prepare_start_gate_dir(missing)
    assert stat.S_IMODE(missing.stat().st_mode) == START_GATE_DIR_MODE
    made_by_hostpath = tmp_path / "hostpath"
    made_by_hostpath.mkdir(mode=0o755)
    prepare_start_gate_dir(made_by_hostpath)
    assert stat.S_IMODE(made_by_hostpath.stat().st_mode) == START_GATE_DIR_MODE
