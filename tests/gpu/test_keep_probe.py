"""``python -m e2e.gpu.keep_probe`` end to end without a GPU: the engine simulator stands in
for vLLM on the fake H200, with tiny numbers. What is checked is the probe's plumbing and
what it reports about the call sequences (the simulator keeps vLLM 0.26's semantics: a
plain ``/sleep`` aborts what ``/pause?mode=keep`` kept), never how fast anything was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.gpu.keep_probe import cycle_summary
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


def test_the_probe_keeps_streams_across_sleeps_on_the_simulator(tmp: Path) -> None:
    out = tmp / "out" / "keep.json"
    done = subprocess.run(
        [sys.executable, "-m", "e2e.gpu.keep_probe", "--launcher", "simulator",
         "--fake-nvml", "h200", "--models", str(tmp / "models"), "--kv", "1Gi",
         "--streams", "2", "--max-tokens", "16", "--preempt-after", "4", "--asleep-s", "0.3",
         "--cycles", "4", "--stream-every", "2", "--cycle-max-tokens", "8",
         "--tokens-per-second", "50", "--budget-s", "150", "--out", str(out),
         "--state-dir", str(tmp / "state")],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    result = json.loads(out.read_text())
    assert done.returncode == 0, result.get("error") or done.stdout[-3000:] + done.stderr[-3000:]
    seqs = {s["sequence"]: s for s in result["sequences"]}
    assert list(seqs) == ["A", "B", "B2"]
    for name in ("A", "B2"):
        assert seqs[name]["correct"], seqs[name]
        assert all(s["tokens"] == 16 for s in seqs[name]["streams"])
        assert seqs[name]["moved_while_asleep"] == [0, 0]
        assert seqs[name]["asleep_request_held"]
    # /pause?mode=keep then a plain /sleep: the sleep's default mode (abort) ends them
    assert not seqs["B"]["correct"]
    assert all(s["finish"] == "abort" for s in seqs["B"]["streams"])
    assert seqs["B2"]["tokens_before_resume"]  # /wake_up alone resumed the scheduler
    assert result["cycle_sequence"]["name"] == "B2"
    summary = result["cycles"]["summary"]
    assert summary["cycles"] == 4
    assert summary["frozen_streams"] == summary["frozen_identical"] >= 1
    # a stream is never waited for: later sleeps freeze it again, and a cycle due to start
    # one while it runs freezes it instead (at 50 tokens/s an 8-token stream outlasts the
    # simulator's cycles)
    frozen = result["cycles"]["frozen"]
    assert frozen[0]["cycle"] == 0
    assert all(f["cycle"] % 2 == 0 for f in frozen)
    assert sum(f["freezes"] for f in frozen) == summary["cycles_freezing_a_stream"] >= 2
    assert all(r[8] for r in result["cycles"]["rows"] if r[0] % 2 == 0)  # 0 and 2 froze one
    assert summary["most_freezes_of_a_stream"] == max(f["freezes"] for f in frozen)
    rows = result["cycles"]["rows"]
    assert [r[5] for r in rows if r[0] in {f["cycle"] for f in frozen}] == [True] * len(frozen)
    assert summary["cycle_s_p50"] > 0
    assert summary["read_s_p50"] is not None
    assert summary["asleep_mib"]["first"] < summary["awake_mib"]["first"]
    assert "| A | 2/2 |" in done.stdout
    assert json.loads(done.stdout.strip().splitlines()[-1])["correct"] == {
        "A": True, "B": False, "B2": True}


def test_the_cycle_summary_reports_drift_from_the_first_cycle() -> None:
    rows: list[list[Any]] = [[0, 0.1, 0.2, 800.0, 5000.0, True, 0.4, 0.01, True],
                             [1, 0.1, 0.3, 808.0, 5000.0, None, 0.4, 0.01, True],
                             [2, 0.2, 0.2, 800.0, 4950.0, False, 0.5, 0.01, True]]
    frozen = [{"identical": True, "chunks": 8, "tokens": 8, "reference_tokens": 8,
               "freezes": 2},
              {"identical": False, "chunks": 5, "tokens": 8, "reference_tokens": 8,
               "freezes": 1}]
    summary = cycle_summary(rows, frozen)
    assert summary["asleep_mib"] == {"first": 800.0, "last": 800.0, "max_drift_pct": 1.0}
    assert summary["awake_mib"]["max_drift_pct"] == 1.0
    assert (summary["frozen_identical"], summary["frozen_with_all_chunks"]) == (1, 1)
    assert summary["frozen_tokens_as_reference"] == 2


def test_the_keep_stage_of_run_sh_runs_the_probe(tmp_path: Path) -> None:
    """``e2e/gpu/run.sh keep`` after piece0: the bundle installed, the probe's JSON in
    $OUT/keep.json, its engine's log beside it, its state apart from the bench's."""
    from tests.gpu.test_run_sh import RUN, _bundle

    inputs = tmp_path / "input"
    _bundle(inputs / "bundle")
    write_models(inputs / "models")
    env = dict(os.environ, ROTA_GPU_INPUT=str(inputs), ROTA_GPU_WORK=str(tmp_path / "work"),
               ROTA_GPU_SITE=str(tmp_path / "site"),
               ROTA_GPU_ROTA_SITE=str(tmp_path / "rota-site"),
               ROTA_GPU_STATE=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
               PY=sys.executable, ROTA_GPU_BUDGET_S="200",
               ROTA_KEEP_ARGS="--launcher simulator --fake-nvml h200 --kv 1Gi --streams 1 "
                              "--max-tokens 8 --preempt-after 2 --asleep-s 0.2 "
                              "--sequences A --cycles 2 --stream-every 2 "
                              "--cycle-max-tokens 4 --tokens-per-second 50")
    # piece0's own work (weights, copy floors) is not this stage's: the piece is put in place
    (tmp_path / "work" / "chunks").mkdir(parents=True)
    for name in ("wheels.tar.xz.part-00", "SHA256SUMS", "WHOLE.sha256"):
        shutil.copy(inputs / "bundle" / name, tmp_path / "work" / "chunks" / name)
    try:
        done = subprocess.run(["bash", str(RUN), "keep"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    finally:
        stop_recorded_engines(tmp_path / "state" / "keep")
    out = tmp_path / "out"
    assert done.returncode == 0, done.stdout[-4000:]
    assert "installed 1 wheels" in done.stdout
    result = json.loads((out / "keep.json").read_text())
    assert [s["sequence"] for s in result["sequences"]] == ["A"]
    assert result["cycles"]["summary"]["cycles"] == 2
    assert "keep probe exited with status 0" in (out / "keep.log").read_text()
    assert "===== engine-keep.log" in (out / "keep-engines.log").read_text()
    assert not (tmp_path / "state" / "state.json").exists()
