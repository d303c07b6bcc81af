"""``python -m e2e.gpu.policy_run`` end to end without a GPU: the engine simulator stands
in for vLLM on the fake H200, and a short trace window is replayed through the lease
controller's own GPU worker, once in first-come mode and once with rota's defaults. What is
checked is the plumbing (every arrival accounted for, the rules each mode fires, every
engine stopped), never how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.gpu.policy_replay import Arrival
from e2e.gpu.policy_run import read_trace, write_trace
from tests.gpu.models import stop_recorded_engines, write_models

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    write_models(tmp_path / "models")
    try:
        yield tmp_path
    finally:
        stop_recorded_engines(tmp_path / "state")


def _window(path: Path) -> list[Arrival]:
    """Three models whose requests interleave, so that the modes differ in what they do."""
    arrivals = [Arrival(0.25 * i, i % 3, 64, 24) for i in range(18)]
    write_trace(arrivals, path)
    return arrivals


def test_a_window_is_replayed_through_the_controller_in_both_modes(tmp: Path) -> None:
    arrivals = _window(tmp / "window.csv")
    assert read_trace(tmp / "window.csv") == arrivals
    done = subprocess.run(
        [sys.executable, "-m", "e2e.gpu.policy_run", "--launcher", "simulator",
         "--fake-nvml", "h200", "--models", str(tmp / "models"), "--trace",
         str(tmp / "window.csv"), "--out", str(tmp / "out"), "--state-dir", str(tmp / "state"),
         "--kv", "1Gi", "--tokens-per-second", "50", "--client-timeout-s", "20",
         "--deadline-s", "200"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    result = json.loads((tmp / "out" / "policy.json").read_text())
    assert done.returncode == 0, result.get("error") or done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["mode"]: r for r in result["runs"]}
    assert list(runs) == ["first-come", "rota"]
    for run in runs.values():
        assert sum(row["requests"] for row in run["rows"]) == len(arrivals)
        assert len(run["ttft_s"]) == len(arrivals)
        assert all(s["ok"] for s in run["switches"]), run["switches"]
        assert sum(row["wakes"] for row in run["rows"]) == len(run["switches"])
    assert set(runs["first-come"]["rules"]) == {"first_come"}
    assert "first_come" not in runs["rota"]["rules"]
    assert set(result["simulated"]["goodput"]) == {"on-demand", "rota"}
    assert "| first-come | m0 |" in done.stdout
    assert "| rota | m2 |" in done.stdout
    state = json.loads((tmp / "state" / "state.json").read_text())
    assert len(state["engines"]) == 3


def test_the_azure_window_is_cut_into_a_csv(tmp_path: Path) -> None:
    from e2e.bench.policy import DATA

    if not (DATA / "AzureLLMInferenceTrace_code.csv").is_file():
        pytest.skip(f"the Azure trace is not in {DATA}")
    path = tmp_path / "cut.csv"
    done = subprocess.run([sys.executable, "-m", "e2e.gpu.policy_run", "--write-trace",
                           str(path), "--speed", "0.2", "--start-s", "600", "--window-s", "30"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert "arrivals written" in done.stdout
    cut = read_trace(path)
    assert cut
    assert all(0 <= a.at < 30 and a.model in (0, 1, 2) for a in cut)
    assert max(a.context for a in cut) <= 2048
    assert max(a.generated for a in cut) <= 256
