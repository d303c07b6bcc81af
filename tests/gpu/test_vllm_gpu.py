"""The switch protocol on a real GPU with real vLLM 0.26 engines: a short GPU benchmark.

Marked ``gpu`` and skipped, by condition, where NVML finds no NVIDIA driver, where no vLLM
can be imported by the engines (``ROTA_VLLM_PYTHONPATH``, else this interpreter's path), or
where the model folders are missing (``ROTA_GPU_MODELS``, default ``.vllm/models``: config
and tokenizer of model-14b and model-small). With ``ROTA_GPU_STATE`` naming the state
folder of a benchmark with at least two engines still running (``e2e/gpu/run.sh`` leaves
them up), it reuses them: two handoffs through the real Switcher, no start. Otherwise it
starts its own two engines (cold starts take minutes), with A on model-small so that a
smaller GPU fits, and stops them at the end. What it checks: both handoffs succeed, each
proved by the probe, and NVML sampled every 5 ms never shows two engines above their
resident footprint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

REPO = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("ROTA_GPU_MODELS", REPO / ".vllm" / "models"))


def _nvml_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _vllm_present() -> bool:
    paths = [p for p in os.environ.get("ROTA_VLLM_PYTHONPATH", "").split(os.pathsep) if p]
    if any((Path(p) / "vllm" / "__init__.py").is_file() for p in paths):
        return True
    return not paths and importlib.util.find_spec("vllm") is not None


def _live_state() -> str | None:
    """``ROTA_GPU_STATE`` when it records at least two engines that still run."""
    state = os.environ.get("ROTA_GPU_STATE", "")
    try:
        engines = json.loads((Path(state) / "state.json").read_text())["engines"]
    except (OSError, ValueError, KeyError):
        return None
    live = [e for e in engines.values()
            if not e.get("dead") and Path(f"/proc/{e.get('pid')}").exists()]
    return state if len(live) >= 2 else None


def _models_present() -> bool:
    return all((MODELS / m / "config.json").is_file() for m in ("model-14b", "model-small"))


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_present(), reason="no NVIDIA driver (NVML) on this machine")
@pytest.mark.skipif(not _vllm_present(), reason="vLLM is not installed for the engines "
                                                "(set ROTA_VLLM_PYTHONPATH)")
@pytest.mark.skipif(not _models_present(), reason=f"no model folders in {MODELS}")
def test_two_handoffs_between_real_vllm_engines(tmp_path: Path) -> None:
    state = _live_state()
    command = [sys.executable, "-m", "e2e.bench.gpu", "--engine", "vllm",
               "--stage", "pytest-gpu", "--out", str(tmp_path), "--models", str(MODELS),
               "--state-dir", state or str(tmp_path / "state")]
    if state:
        # Bounded well inside the 110 s the GPU stage gives this test: the benchmark must end
        # before the next stage drives the same engines.
        command += ["--scenarios", "smoke", "--keep-engines", "--deadline-s", "75"]
    else:
        command += ["--scenarios", "startup,smoke", "--stop-engines", "--a-model",
                    "model-small", "--deadline-s", "900"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=1000)
    result_file = tmp_path / "pytest-gpu.json"
    assert result_file.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(result_file.read_text())
    assert done.returncode == 0, summary.get("error") or done.stdout[-3000:]
    smoke = summary["scenarios"]["smoke"]
    assert smoke["ok"], smoke
    assert [e["ok"] for e in smoke["handoffs"]] == [True, True]
    assert all(e["probe_ttft_s"] is not None for e in smoke["handoffs"])
    assert smoke["invariant_violations"] == 0
    assert summary["sampler"]["samples"] > 0
