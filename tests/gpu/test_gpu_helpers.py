"""The helpers the GPU machine runs before rota's dependencies are there: the weight-file
writer (transformers and torch replaced by stand-ins here), the copy-floor measurement's
arguments and its answer without a GPU, and the ballast on the fake NVML."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from e2e.gpu import h2d, weights
from e2e.harness.waiting import eventually
from tests.gpu.models import write_models

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_transformers(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """torch and transformers stand-ins that record what they were asked to build."""
    built: list[dict[str, Any]] = []

    class Model:
        def __init__(self, config: Any, dtype: Any) -> None:
            built.append({"config": config, "dtype": dtype})

        def save_pretrained(self, folder: str) -> None:
            (Path(folder) / "model.safetensors").write_bytes(b"weights")
            (Path(folder) / "config.json").write_text('{"rewritten": true}')

    torch = types.ModuleType("torch")
    torch.bfloat16 = "bf16"  # type: ignore[attr-defined]
    torch.manual_seed = lambda seed: built.append({"seed": seed})  # type: ignore[attr-defined]
    transformers = types.ModuleType("transformers")
    transformers.AutoConfig = types.SimpleNamespace(  # type: ignore[attr-defined]
        from_pretrained=lambda path: {"path": path})
    transformers.AutoModelForCausalLM = types.SimpleNamespace(  # type: ignore[attr-defined]
        from_config=lambda config, dtype: Model(config, dtype))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    return built


def test_weights_are_written_once_beside_the_tokenizer(
        tmp_path: Path, fake_transformers: list[dict[str, Any]]) -> None:
    src = write_models(tmp_path / "models") / "model-small"
    (src / "tokenizer.json").write_text("{}")
    dst = tmp_path / "weights" / "model-small"
    first = weights.write_weights(src, dst)
    assert first["written"] is True
    # seeded first, so every machine writes the same random weights
    assert fake_transformers == [{"seed": weights.SEED},
                                 {"config": {"path": str(src)}, "dtype": "bf16"}]
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors",
                                                    "tokenizer.json"]
    assert json.loads((dst / "config.json").read_text())["model_type"] == "qwen3"  # original
    assert not (tmp_path / "weights" / "model-small.partial").exists()
    again = weights.write_weights(src, dst)
    assert again == {"dst": str(dst), "written": False, "reason": "weights already there"}
    assert len(fake_transformers) == 2


def test_byte_counts_of_the_command_lines() -> None:
    assert h2d.parse_bytes("4Gi") == 4 * 2**30
    assert h2d.parse_bytes("500M") == 500 * 10**6
    assert h2d.parse_bytes("123") == 123
    with pytest.raises(Exception, match="not a byte count"):
        h2d.parse_bytes("4 GiB")


def test_the_copy_floor_says_why_it_cannot_measure(tmp_path: Path) -> None:
    models = write_models(tmp_path / "models")
    done = subprocess.run([sys.executable, "-m", "e2e.gpu.h2d", "--model",
                           str(models / "model-14b"), "--out", str(tmp_path / "h2d.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" not in answer:
        pytest.skip("this machine has PyTorch with CUDA: the floor was measured")
    assert done.returncode == 1
    assert answer["error"] in ("torch is not installed", "torch sees no CUDA device")
    assert json.loads((tmp_path / "h2d.json").read_text()) == answer


def test_the_ballast_holds_its_bytes_on_the_fake_nvml_and_lets_go(tmp_path: Path) -> None:
    backend = FakeNvml.from_path(fixture_path("h200"), tmp_path / "nvml")
    backend.init()
    ballast = subprocess.Popen(
        [sys.executable, "-m", "e2e.gpu.ballast", "--bytes", "3Gi", "--fake-nvml-dir",
         str(tmp_path / "nvml"), "--gpu-uuid", backend.uuid(0), "--max-seconds", "60"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert ballast.stdout is not None
        ready = json.loads(ballast.stdout.readline())
        assert ready["ready"] is True
        assert [(p.pid, p.used_bytes) for p in backend.compute_processes(0)] == [
            (ballast.pid, 3 * 2**30)]
        ballast.terminate()
        assert ballast.wait(timeout=20) == 0
        eventually(lambda: backend.compute_processes(0) == [], timeout=10,
                   what="the ballast's memory released")
    finally:
        ballast.kill()
        ballast.wait()
