"""The GPU switch benchmark (``e2e/bench/gpu.py``) runs end to end without a GPU.

The script is run as the lead runs it on the accelerator machine, as a subprocess, but
with the fake NVML backend on the shipped H200 fixture, counted simulator memory, tiny
engines and two handoffs. Its last line must be the JSON summary. With
``--tensor-parallel 2`` it runs on the eight-GPU fixture: a TP=2 engine taking turns with
two TP=1 engines through gang switches, the one-awake invariant sampled on both GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from driver.nvml import fixture_path

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.controller, pytest.mark.slow]


def _run_bench(*extra: str, fixture: str = "h200"
               ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    command = [sys.executable, "-m", "e2e.bench.gpu",
               "--fake-nvml", str(fixture_path(fixture)), "--memory-backend", "fake",
               "--handoffs", "2", "--a-awake", "3Gi", "--a-resident", "512Mi",
               "--a-weights", "2Gi", "--b-awake", "1Gi", "--b-resident", "256Mi",
               "--b-weights", "512Mi", "--tokens-per-second", "2000", "--concurrency", "2",
               "--rounds", "1", "--max-tokens", "16", "--skip-h2d", "--deadline-s", "90",
               *extra]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{done.stderr[-3000:]}"
    try:
        summary = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"last line is not JSON: {lines[-1][:300]!r}\nstderr:\n{done.stderr[-3000:]}")
    assert isinstance(summary, dict)
    return done, summary


def test_two_handoffs_on_the_fake_gpu() -> None:
    done, summary = _run_bench()
    assert done.returncode == 0, f"{summary.get('error')}\nstderr:\n{done.stderr[-3000:]}"

    expected = {"benchmark", "cluster", "note", "ok", "error", "device", "nvml",
                "memory_backend", "handoffs_requested", "handoffs_ok", "failures",
                "first_sleep_s", "timings_s", "timings_by_target_s", "memory_mib",
                "throughput", "h2d", "wake_floor", "handoffs", "wall_s"}
    assert expected <= summary.keys(), expected - summary.keys()
    assert summary["ok"] is True
    assert summary["error"] is None
    assert summary["cluster"] is False
    assert "WITHOUT a Kubernetes cluster" in summary["note"]
    assert summary["nvml"] == "fake"
    assert summary["device"] == "NVIDIA H200"
    assert summary["handoffs_requested"] == 2
    assert summary["handoffs_ok"] == 2
    assert summary["failures"] == []
    assert [(h["from"], h["to"], h["ok"]) for h in summary["handoffs"]] == [
        ("a", "b", True), ("b", "a", True)]

    # Both first sleeps are reported on their own: B's by reconciliation, A's in handoff 1.
    assert set(summary["first_sleep_s"]) == {"a", "b"}
    timings = summary["timings_s"]
    for name in ("handoff_to_first_token", "wake_call", "recovery_to_first_token", "sleep"):
        assert {"p50", "p90", "max"} <= timings[name].keys()
    assert timings["wake_call"]["n"] == 2
    assert timings["handoff_to_first_token"]["n"] == 1  # handoff 1 held A's first sleep
    assert timings["recovery_to_first_token"]["p50"] >= timings["wake_call"]["p50"]

    # What the fake NVML saw, exactly the simulators' knobs (counted memory, no context).
    memory = summary["memory_mib"]
    assert {"both_initialised", "a_awake_b_asleep", "b_awake_a_asleep"} <= memory.keys()
    assert (memory["both_initialised"]["a_mib"], memory["both_initialised"]["b_mib"]) == (
        3072, 1024)
    assert (memory["a_awake_b_asleep"]["a_mib"], memory["a_awake_b_asleep"]["b_mib"]) == (
        3072, 256)
    assert (memory["b_awake_a_asleep"]["a_mib"], memory["b_awake_a_asleep"]["b_mib"]) == (
        512, 1024)
    for phase in memory.values():
        assert phase["other_processes_mib"] == 0
        assert phase["used_mib"] + phase["free_mib"] == pytest.approx(phase["total_mib"],
                                                                      abs=0.2)

    throughput = summary["throughput"]
    assert throughput["before"]["tokens_per_s"] > 0
    assert throughput["after"]["tokens_per_s"] > 0
    assert throughput["after"]["after_handoff"] == 2

    assert summary["h2d"]["measured"] is False
    assert summary["h2d"]["bytes_per_s"] == 54e9
    floor_a = summary["wake_floor"]["a"]
    assert floor_a["floor_s"] == pytest.approx(2 * 2**30 / 54e9, abs=1e-4)
    assert floor_a["ratio_p50"] is not None


def test_a_run_out_of_time_still_ends_with_json() -> None:
    done, summary = _run_bench("--deadline-s", "0.001")
    assert done.returncode == 1
    assert summary["ok"] is False
    assert summary["error"]
    assert summary["cluster"] is False


def test_a_tensor_parallel_engine_takes_turns_through_gang_switches() -> None:
    done, summary = _run_bench("--tensor-parallel", "2", "--sample-interval-s", "0.002",
                               fixture="h200x8")
    assert done.returncode == 0, f"{summary.get('error')}\nstderr:\n{done.stderr[-3000:]}"
    assert summary["ok"] is True
    assert summary["error"] is None
    assert summary["cluster"] is False
    assert "GangSwitcher" in summary["note"]
    assert summary["tensor_parallel"] == 2
    assert [g["name"] for g in summary["gpus"]] == ["gpu-0", "gpu-1"]
    assert {k: e["tensor_parallel"] for k, e in summary["engines"].items()} == {
        "a": 2, "b0": 1, "b1": 1}
    assert summary["handoffs_ok"] == 2
    assert summary["failures"] == []

    to_a, to_b = summary["handoffs"]
    # B0 and B1 both sleep in one gang switch over both GPUs; A wakes on both.
    assert (to_a["direction"], sorted(to_a["from"]), to_a["to"]) == ("to_a", ["b0", "b1"], ["a"])
    assert to_a["gang_set"] == ["gpu-0", "gpu-1"]
    assert set(to_a["inspect_by_gpu_s"]) == {"gpu-0", "gpu-1"}
    assert set(to_a["sleep_call_s"]) == {"b0", "b1"}
    assert to_a["first_sleep"] is True
    assert to_a["leases"] == {"gpu-0": "a", "gpu-1": "a"}
    # A sleeps in the gang switch to B0 (both GPUs in its set); B1 wakes on idle gpu-1.
    assert (to_b["direction"], to_b["from"], to_b["to"]) == ("to_b", ["a"], ["b0", "b1"])
    assert to_b["gang_set"] == ["gpu-0", "gpu-1"]
    assert [f["to"] for f in to_b["follow_up"]] == ["b1"]
    assert to_b["follow_up"][0]["ok"] is True
    assert to_b["leases"] == {"gpu-0": "b0", "gpu-1": "b1"}
    for entry in (to_a, to_b):
        for name in ("gang_switch_s", "sleep_all_s", "wake_call_s", "probe_ttft_s"):
            assert entry[name] is not None, name

    # What the fake NVML showed: A's shard on each GPU, each B on its own.
    memory = summary["memory_mib"]
    assert {"all_initialised", "b_awake_a_asleep"} <= memory.keys()
    assert memory["b_awake_a_asleep"]["gpu-0"]["a_mib"] == 512  # A's 512Mi resident per GPU
    assert memory["b_awake_a_asleep"]["gpu-1"]["b1_mib"] == 1024
    assert to_a["nvml"]["gpu-1"]["a_mib"] == 3072
    assert to_b["nvml"]["gpu-1"]["b1_mib"] == 1024

    invariant = summary["invariant"]
    assert invariant["samples"] > 0
    assert invariant["violations"] == 0
    assert summary["double_awake_violations"] == 0
    assert set(invariant["max_awake_per_gpu"]) == {"gpu-0", "gpu-1"}
    assert {"gang_switch", "sleep_all_parallel", "inspect_per_gpu", "wake_call",
            "probe_ttft"} <= summary["timings_s"].keys()
    assert set(summary["inspect_by_gpu_s"]) == {"gpu-0", "gpu-1"}


def test_tensor_parallel_needs_more_gpus_than_the_fixture_has() -> None:
    done, summary = _run_bench("--tensor-parallel", "2")  # the one-GPU H200 fixture
    assert done.returncode == 1
    assert summary["ok"] is False
    assert "NVML index [1]" in summary["error"]


def test_tensor_parallel_refuses_real_memory_up_front() -> None:
    done = subprocess.run([sys.executable, "-m", "e2e.bench.gpu", "--tensor-parallel", "2",
                           "--memory-backend", "cuda"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 2
    assert "--memory-backend fake" in done.stderr
