"""``e2e/gpu/run.sh``, the stage driver of the GPU calls, run here stage after stage.

The bundle is a stand-in (one small wheel named vllm, packed and split like the real one),
the engines are the simulator (``ROTA_BENCH_ARGS`` picks it), and the machine's paths are
temporary folders: what is checked is the driver itself, that every stage finds what the
previous one left, fails fast with a clear message when it does not, and leaves its
results under ``$OUT``.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu.models import stop_recorded_engines, write_fake_weights, write_models

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "e2e" / "gpu" / "run.sh"

pytestmark = [pytest.mark.slow]


def _wheel() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr("vllm/__init__.py", '__version__ = "0.26.0+stand-in"\n')
        info = "vllm-0.26.0.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: rota-test\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return buffer.getvalue()


def _bundle(folder: Path) -> None:
    """wheels.tar.xz in two pieces with their sums, as the bundle script writes them."""
    tar_buffer = io.BytesIO()
    with tarfile.open(fileobj=tar_buffer, mode="w") as tar:
        data = _wheel()
        member = tarfile.TarInfo("vllm-0.26.0-py3-none-any.whl")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    packed = lzma.compress(tar_buffer.getvalue())
    folder.mkdir(parents=True)
    half = len(packed) // 2
    pieces = {"wheels.tar.xz.part-00": packed[:half], "wheels.tar.xz.part-01": packed[half:]}
    for name, piece in pieces.items():
        (folder / name).write_bytes(piece)
    (folder / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(p).hexdigest()}  {n}\n" for n, p in pieces.items()))
    (folder / "WHOLE.sha256").write_text(f"{hashlib.sha256(packed).hexdigest()}  wheels.tar.xz\n")


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a call: the carried inputs, the machine's folders, $OUT."""
    inputs = tmp_path / "input"
    _bundle(inputs / "bundle")
    write_models(inputs / "models")
    write_fake_weights(tmp_path / "state" / "weights" / "model-small")
    env = dict(os.environ, ROTA_GPU_INPUT=str(inputs), ROTA_GPU_WORK=str(tmp_path / "work"),
               ROTA_GPU_SITE=str(tmp_path / "site"),
               ROTA_GPU_ROTA_SITE=str(tmp_path / "rota-site"),
               ROTA_GPU_STATE=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
               PY=sys.executable, ROTA_GPU_BUDGET_S="240",
               ROTA_BENCH_ARGS="--launcher simulator --fake-nvml h200 --handoffs 2 "
                               "--concurrency 2 --rounds 1 --max-tokens 8 --wake-cycles 3 "
                               "--level2-cycles 1 --graph-handoffs 2 --long-tokens 2000 "
                               "--abandon-after-s 0.3 --kill-delay-s 0")
    try:
        yield env
    finally:
        stop_recorded_engines(tmp_path / "state")


def _stage(env: dict[str, str], stage: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run one stage from a folder outside the checkout: the driver finds its own."""
    outside = Path(env["ROTA_GPU_STATE"]).parent
    return subprocess.run(["bash", str(RUN), stage], cwd=outside, env=env | extra,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_stages_in_order(machine: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    piece0 = _stage(machine, "piece0")
    assert piece0.returncode == 0, piece0.stdout[-3000:]
    assert (tmp_path / "work" / "chunks" / "wheels.tar.xz.part-00").is_file()
    assert not (tmp_path / "work" / "chunks" / "wheels.tar.xz.part-01").exists()
    assert json.loads((out / "prep.json").read_text())["weights"]
    assert "piece0 done" in (out / "piece0.log").read_text()

    bench = _stage(machine, "install+bench")
    assert bench.returncode in (0, 1), bench.stdout[-4000:]  # 1: a scenario was not ok
    assert (tmp_path / "site" / "vllm" / "__init__.py").is_file()
    assert "installed 1 wheels" in bench.stdout
    first = json.loads((out / "bench.json").read_text())
    assert first["ok"] is True
    assert list(first["scenarios"]) == ["startup", "main", "wake_detail", "level2"]
    assert "skipped" in (out / "pytest-gpu.log").read_text()  # no NVIDIA driver here
    second = json.loads((out / "bench2.json").read_text())
    assert list(second["scenarios"]) == ["cuda_graphs", "abandoned_sleep",
                                         "killed_mid_switch", "admission_nofit", "wake_oom",
                                         "admission_counterexample"]
    assert not any("error" in r for r in second["scenarios"].values())
    assert (bench.returncode == 0) == all(r["ok"] for r in second["scenarios"].values())
    assert "| a_to_b |" in bench.stdout  # the tables are in the call's output tail
    assert "===== engine-a.log" in (out / "bench-engines.log").read_text()
    assert (out / "bench-nvml.json").is_file()
    assert (out / "bench.log").read_text().count("benchmark exited with status") == 2
    assert len(list(out.iterdir())) <= 8 + 2  # a call brings back 8 files (piece0 left 2)

    more = _stage(machine, "more", ROTA_GPU_SCENARIOS="wake_detail")
    assert more.returncode == 0, more.stdout[-4000:]
    assert list(json.loads((out / "more.json").read_text())["scenarios"]) == ["wake_detail"]

    status = _stage(machine, "status")
    assert "a: pid" in status.stdout
    assert "alive, 1 processes" in status.stdout
    stop = _stage(machine, "stop")
    assert stop.returncode == 0, stop.stdout[-3000:]
    assert stop.stdout.count("; stopped") >= 2  # A and the engines the failures left
    assert "alive" not in _stage(machine, "status").stdout


def test_a_fresh_machine_says_which_stage_to_run(machine: dict[str, str]) -> None:
    bench = _stage(machine, "bench")
    assert bench.returncode == 1
    assert "run piece0 again" in bench.stdout
    more = _stage(machine, "more")
    assert more.returncode == 1
    assert "start again with piece0" in more.stdout


def test_a_missing_piece_is_named(machine: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "input" / "bundle" / "wheels.tar.xz.part-00").unlink()
    piece0 = _stage(machine, "piece0")
    assert piece0.returncode == 1
    assert "wheels.tar.xz.part-00 was not carried" in piece0.stdout
