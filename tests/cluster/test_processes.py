"""The local cluster's process handling: a process that ignores SIGTERM is still stopped,
and starting and stopping log with the process's name in a field."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from e2e.cluster.processes import ManagedProcess


def _stubborn(tmp_path: Path) -> ManagedProcess:
    ready = tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; while :; do sleep 0.1; done"
    return ManagedProcess(name="stubborn", argv=["sh", "-c", script],
                          log_path=tmp_path / "stubborn.log")


def test_a_process_ignoring_sigterm_is_killed(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    from e2e.harness.waiting import eventually

    proc = _stubborn(tmp_path)
    with caplog.at_level(logging.INFO, logger="e2e.cluster.processes"):
        proc.start()
        eventually(lambda: (tmp_path / "ready").exists(), timeout=10, what="trap installed")
        proc.stop(timeout_s=0.5)
    assert not proc.alive()
    started = [r for r in caplog.records if r.getMessage() == "process started"]
    assert started
    assert started[0].__dict__["component"] == "stubborn"
    killed = [r for r in caplog.records if "ignored SIGTERM" in r.getMessage()]
    assert killed
    assert killed[0].__dict__["component"] == "stubborn"
