"""``python -m e2e.bench.gpu --engine vllm`` end to end without a GPU: the engine simulator
stands in for vLLM (``--launcher simulator``) on the fake H200, so that the process
management, the scenario runner, the state kept between commands and the report run as
they will on the GPU machine. Two commands, as the GPU calls make them: the first starts
the engines and keeps them, the second goes on with the remaining scenarios on the same
engines and stops them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.gpu.context import BenchState
from e2e.gpu.engines import process_group
from e2e.harness.waiting import eventually
from tests.gpu.models import stop_recorded_engines, write_fake_weights, write_models

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]


def _bench(tmp: Path, stage: str, *extra: str, timeout: float = 240
           ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    command = [sys.executable, "-m", "e2e.bench.gpu", "--engine", "vllm",
               "--launcher", "simulator", "--fake-nvml", "h200", "--stage", stage,
               "--out", str(tmp / "out"), "--state-dir", str(tmp / "state"),
               "--models", str(tmp / "models"), "--handoffs", "3", "--wake-cycles", "3",
               "--level2-cycles", "1", "--graph-handoffs", "2", "--long-tokens", "3000",
               "--abandon-after-s", "0.3", "--kill-delay-s", "0", "--concurrency", "2",
               "--rounds", "1",
               "--max-tokens", "16", "--deadline-s", "200", *extra]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)
    path = tmp / "out" / f"{stage}.json"
    assert path.is_file(), f"no result file; stdout:\n{done.stdout[-3000:]}\n" \
                           f"stderr:\n{done.stderr[-3000:]}"
    return done, json.loads(path.read_text())


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    write_models(tmp_path / "models")
    write_fake_weights(tmp_path / "state" / "weights" / "model-small")
    try:
        yield tmp_path
    finally:
        stop_recorded_engines(tmp_path / "state")


def test_two_commands_share_the_engines_and_run_every_scenario(tmp: Path) -> None:
    done, first = _bench(tmp, "bench", "--scenarios", "startup,main,wake_detail,level2",
                         "--keep-engines")
    assert done.returncode == 0, first.get("error") or done.stdout[-3000:]
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert headline["ok"] is True
    scenarios = first["scenarios"]
    assert list(scenarios) == ["startup", "main", "wake_detail", "level2"]
    assert all(s["ok"] and s["invariant_violations"] == 0 for s in scenarios.values())

    # Start-up admission: A and B proved and put through their first sleep before traffic;
    # B fits beside awake A, so A stays up while B starts (two above resident, allowed).
    startup = scenarios["startup"]
    assert startup["a"]["first_wake_s"] is not None
    assert startup["b"]["fits_beside_awake"] is True
    assert "holder_to_sleep" not in startup["b"]
    engines = first["engines"]
    assert engines["a"]["first_sleep_s"] is not None
    assert engines["b"]["load_format"] == "auto"  # real weight files: level 2 can reload
    assert engines["a"]["awake_mib"] > 30000  # 26.5 GB of weights and the KV cache
    assert engines["a"]["asleep_mib"] == 800.0

    main = scenarios["main"]
    assert [(e["from"], e["to"]) for e in main["handoffs"]] == [("a", "b"), ("b", "a"),
                                                                ("a", "b")]
    assert main["summary"]["ok"] == 3
    assert main["throughput"]["after"]["after_handoff"] == 2
    entry = main["handoffs"][0]
    paths = [c["path"] for c in entry["http"]]
    essential = [p for p in paths if p in ("/sleep", "/wake_up", "/v1/chat/completions")]
    assert essential == ["/sleep", "/wake_up", "/v1/chat/completions"]
    assert paths.index("/is_sleeping") > paths.index("/sleep")  # each call confirmed
    assert paths[paths.index("/wake_up") + 1:].count("/is_sleeping") == 1
    assert all(c["ms"] is not None and c["status"] == 200 for c in entry["http"])
    assert entry["controller_overhead_s"] is not None
    assert main["summary"]["first_user_visible"]["direction"] == "a_to_b"

    cycles = scenarios["wake_detail"]["cycles"]
    assert [c["mode"] for c in cycles] == ["sequential", "overlapped", "split"]
    assert all(c["probe_ok"] and c["is_sleeping_after"] is False for c in cycles)
    assert scenarios["wake_detail"]["decomposition"]["copy_floor_s"] > 0

    level2 = scenarios["level2"]
    assert set(level2["level2_wakes"]["steps"]) == {"wake_up_weights", "reload_weights",
                                                    "wake_up_kv_cache", "reset_prefix_cache"}
    assert all(g["ok"] for g in level2["generation_after_wake"])
    assert level2["memory_mib"]["b_asleep_level2"]["b_mib"] == 800.0

    state = BenchState.model_validate_json((tmp / "state" / "state.json").read_text())
    pids = {k: r.pid for k, r in state.engines.items()}
    assert all(process_group(pid) for pid in pids.values())  # kept running

    done, second = _bench(tmp, "more", "--scenarios", "next", "--stop-engines")
    assert done.returncode in (0, 1), second.get("error")
    assert second["error"] is None
    scenarios = second["scenarios"]
    assert list(scenarios) == ["cuda_graphs", "abandoned_sleep", "killed_mid_switch",
                               "admission_nofit", "wake_oom", "admission_counterexample"]
    assert {k: second["engines"][k]["pid"] for k in pids} == pids  # the same engines
    for name, result in scenarios.items():
        assert result["invariant_violations"] == 0, name
        assert "error" not in result, (name, result.get("error"))
    assert scenarios["cuda_graphs"]["ok"]
    assert second["engines"]["g"]["enforce_eager"] is False

    killed = scenarios["killed_mid_switch"]
    assert killed["ok"], killed
    assert killed["kill_landed_mid_switch"] is True
    assert killed["switch"]["reason"] in ("unreachable", "state_unknown")
    assert killed["restored_by"] in ("rota", "bench (after NVML released the dead engine)")
    assert second["engines"][killed["target"]]["dead"] is True

    admission = scenarios["admission_nofit"]
    assert admission["ok"]
    assert admission["admission"]["fits_beside_awake"] is False
    assert admission["admission"]["holder_to_sleep"]["slept"] == "a"
    assert admission["admission"]["holder_back"]["ok"]

    oom = scenarios["wake_oom"]
    assert oom["plan"]["x_declared_awake_mib"] < oom["plan"]["x_real_awake_mib"]
    assert oom["reason"] == "gpu_oom"  # the simulator's memory runs out as CUDA's does
    assert oom["holder_proved"]["ok"]
    assert oom["ok"]
    counter = scenarios["admission_counterexample"]
    assert counter["y_started"] is False
    assert counter["a_serves_after"] is True
    assert second["holder"] == "a"

    assert "abandon_after_s" in scenarios["abandoned_sleep"]
    assert scenarios["abandoned_sleep"]["stream"]["chunks"] > 0

    for pid in pids.values():
        assert process_group(pid) == []  # --stop-engines left nothing running
    assert (tmp / "out" / "more-nvml.json").is_file()


def test_a_run_out_of_time_skips_and_says_so(tmp: Path) -> None:
    done, summary = _bench(tmp, "bench", "--deadline-s", "5", "--estimate-scale", "10")
    assert done.returncode == 1
    startup = summary["scenarios"]["startup"]
    assert startup["skipped"] is True
    assert "next stage" in startup["reason"]
    assert summary["scenarios_done"] == []


def test_a_state_from_another_boot_is_refused(tmp: Path) -> None:
    state = tmp / "state" / "state.json"
    state.write_text(BenchState(boot_id="another-boot", gpu_uuid="GPU-x").model_dump_json())
    done, summary = _bench(tmp, "more", "--scenarios", "next", timeout=60)
    assert done.returncode == 1
    assert "another boot" in summary["error"]


def test_sigterm_stops_the_run_keeps_its_results_and_stops_the_engines(tmp: Path) -> None:
    command = [sys.executable, "-m", "e2e.bench.gpu", "--engine", "vllm",
               "--launcher", "simulator", "--fake-nvml", "h200", "--stage", "bench",
               "--out", str(tmp / "out"), "--state-dir", str(tmp / "state"),
               "--models", str(tmp / "models"), "--handoffs", "400", "--deadline-s", "200"]
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    state = tmp / "state" / "state.json"
    try:
        eventually(lambda: "main" in _partial(tmp), timeout=120, what="the handoffs running")
        run.terminate()
        stdout, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 1
    summary = json.loads((tmp / "out" / "bench.json").read_text())
    assert "stopped by a signal" in summary["error"]
    assert summary["scenarios"]["startup"]["ok"]
    assert json.loads(stdout.strip().splitlines()[-1])["error"] == summary["error"]
    pids = [r.pid for r in BenchState.model_validate_json(state.read_text()).engines.values()]
    assert pids
    assert all(process_group(pid) == [] for pid in pids)


def _partial(tmp: Path) -> dict[str, Any]:
    """What the run has written so far (it rewrites its result after every handoff)."""
    try:
        return dict(json.loads((tmp / "out" / "bench.json").read_text()))
    except (OSError, ValueError):
        return {}
