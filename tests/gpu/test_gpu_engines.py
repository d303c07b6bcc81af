"""The GPU benchmark's moving parts without a GPU: vLLM's command line, engine processes
(the simulator standing in for vLLM), and the NVML sampler's one-awake check."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml, register_process
from e2e.gpu.engines import (
    EngineProcess,
    EngineSpec,
    EngineStartError,
    SimulatorLauncher,
    VllmLauncher,
    process_group,
)
from e2e.gpu.sampler import NvmlSampler
from e2e.harness.waiting import eventually
from tests.gpu.models import write_models

GIB = 2**30
MIB = 2**20
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def models(tmp_path: Path) -> Path:
    return write_models(tmp_path / "models")


def test_vllm_gets_the_flags_and_environment_that_ran_on_the_h200(models: Path) -> None:
    spec = EngineSpec(key="a", model_dir=models / "model-14b", served_name="bench/a",
                      kv_cache_bytes=8 * GIB)
    launcher = VllmLauncher(python="/usr/bin/python3", pythonpath="/opt/site",
                            base_env={"PATH": "/bin", "ROTA_CLAIM_UID": "stale",
                                      "PYTHONPATH": "/checkout"})
    command = launcher.command(spec, 8123)
    assert command[:5] == ["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve",
                           str(models / "model-14b")]
    joined = " ".join(command)
    for flag in ("--enable-sleep-mode", "--dtype bfloat16", "--max-model-len 4096",
                 "--max-num-seqs 32", "--gpu-memory-utilization 0.3",
                 f"--kv-cache-memory-bytes {8 * GIB}", "--enforce-eager",
                 "--load-format dummy", "--port 8123", "--host 127.0.0.1",
                 "--served-model-name bench/a"):
        assert flag in joined
    env = launcher.environment(spec, "uid-1", Path("/cache/a"))
    assert env["ROTA_CLAIM_UID"] == "uid-1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["VLLM_CACHE_ROOT"] == "/cache/a"
    assert env["PYTHONPATH"] == "/opt/site"  # rota's own path does not leak into vLLM
    graphs = spec.model_copy(update={"enforce_eager": False, "load_format": "auto"})
    assert "--enforce-eager" not in launcher.command(graphs, 1)
    assert "--load-format" not in launcher.command(graphs, 1)


@pytest.fixture
def launcher(tmp_path: Path) -> SimulatorLauncher:
    return SimulatorLauncher(python=sys.executable, repo_root=REPO,
                             fake_nvml_dir=tmp_path / "nvml",
                             gpu_uuid="GPU-00000000-0000-0000-0000-000000000000",
                             base_env=dict(os.environ))


@pytest.fixture
def started(models: Path, launcher: SimulatorLauncher, tmp_path: Path
            ) -> Iterator[EngineProcess]:
    spec = EngineSpec(key="b", model_dir=models / "model-small", served_name="bench/b",
                      kv_cache_bytes=4 * GIB)
    proc = EngineProcess.start(spec, launcher, tmp_path)
    try:
        yield proc
    finally:
        proc.stop(5.0)


async def test_an_engine_outlives_its_starter_and_is_attached_from_its_record(
        started: EngineProcess) -> None:
    async with aiohttp.ClientSession() as session:
        ready = await started.wait_ready(session, deadline=time.monotonic() + 60)
        assert ready > 0
        # Its own session: not in this process group, so a command's end does not end it.
        assert os.getpgid(started.record.pid) == started.record.pid != os.getpgid(0)
        attached = EngineProcess(started.record.model_copy())  # a later command
        assert attached.alive()
        await attached.wait_ready(session, deadline=time.monotonic() + 10)
        assert process_group(started.record.pid) == [started.record.pid]
        assert attached.stop(5.0) == []
        assert not attached.alive()
        assert process_group(started.record.pid) == []


async def test_an_engine_that_dies_while_starting_is_reported_with_its_log(
        models: Path, tmp_path: Path) -> None:
    broken = SimulatorLauncher(python=sys.executable, repo_root=REPO,
                               fake_nvml_dir=tmp_path / "nvml", gpu_uuid="GPU-x",
                               base_env=dict(os.environ), resident_bytes=-1)
    spec = EngineSpec(key="c", model_dir=models / "model-small", served_name="bench/c",
                      kv_cache_bytes=GIB)
    proc = EngineProcess.start(spec, broken, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(EngineStartError, match="exited while starting") as caught:
                await proc.wait_ready(session, deadline=time.monotonic() + 60)
        assert "resident" in str(caught.value)  # the simulator's own complaint, from its log
    finally:
        proc.stop(5.0)


def test_kill_takes_the_whole_process_group(tmp_path: Path, models: Path) -> None:
    script = tmp_path / "family.py"
    script.write_text("import subprocess, sys, time\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "time.sleep(60)\n")

    class Family(SimulatorLauncher):
        def command(self, spec: EngineSpec, port: int) -> list[str]:
            return [sys.executable, str(script)]

    family = Family(python=sys.executable, repo_root=REPO, fake_nvml_dir=tmp_path,
                    gpu_uuid="GPU-x", base_env=dict(os.environ))
    spec = EngineSpec(key="f", model_dir=models / "model-small", served_name="f",
                      kv_cache_bytes=GIB)
    proc = EngineProcess.start(spec, family, tmp_path)
    eventually(lambda: len(process_group(proc.record.pid)) == 2, timeout=20,
               what="the engine and its child")
    proc.kill()
    assert proc.record.dead
    eventually(lambda: process_group(proc.record.pid) == [], timeout=20,
               what="the whole group gone")
    assert proc.proc is not None
    assert proc.proc.wait(timeout=10) == -9


# -- the sampler --------------------------------------------------------------------------


@pytest.fixture
def two_processes(tmp_path: Path) -> Iterator[tuple[FakeNvml, Path, list[int]]]:
    """Two live processes registered with the fake NVML, attributed through a fake /proc."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
                for _ in range(2)]
    try:
        nvml_dir, proc_root = tmp_path / "nvml", tmp_path / "proc"
        for i, child in enumerate(sleepers):
            (proc_root / str(child.pid)).mkdir(parents=True)
            (proc_root / str(child.pid) / "environ").write_bytes(
                f"PATH=/bin\0ROTA_CLAIM_UID=uid-{i}\0".encode())
        backend = FakeNvml.from_path(fixture_path("h200"), nvml_dir)
        backend.init()
        yield backend, proc_root, [c.pid for c in sleepers]
    finally:
        for child in sleepers:
            child.kill()
            child.wait()


def test_the_sampler_counts_engines_above_resident_per_phase(
        two_processes: tuple[FakeNvml, Path, list[int]], tmp_path: Path) -> None:
    backend, proc_root, pids = two_processes
    uuid = backend.uuid(0)
    sampler = NvmlSampler(backend, 0, proc_root=proc_root)
    sampler.watch("a", "uid-0", GIB)
    sampler.watch("b", "uid-1", GIB)
    register_process(tmp_path / "nvml", pids[0], uuid, 30 * GIB)
    register_process(tmp_path / "nvml", pids[1], uuid, 800 * MIB)
    sampler.phase("switch")
    assert sampler.sample_once() == {"a": 30 * GIB, "b": 800 * MIB}
    register_process(tmp_path / "nvml", pids[1], uuid, 6 * GIB)  # two awake: a violation
    sampler.sample_once()
    sampler.phase("start beside", allowed_above=2)
    sampler.sample_once()  # allowed in this phase
    phases = {p["label"]: p for p in sampler.phases()}
    assert phases["switch"]["samples"] == 2
    assert phases["switch"]["violations"] == 1
    assert phases["switch"]["max_engines_above_resident"] == 2
    assert phases["switch"]["first_violations"][0]["above"] == ["a", "b"]
    assert phases["start beside"]["violations"] == 0
    found = sampler.report()
    assert found["violations"] == 1
    assert found["samples"] == 3
    assert [row[2] for row in found["timeline"]] == [
        {"a": 30720, "b": 800}, {"a": 30720, "b": 6144}]  # thinned: the third repeats


def test_an_awake_set_phase_checks_the_budgets_not_only_the_count(
        two_processes: tuple[FakeNvml, Path, list[int]], tmp_path: Path) -> None:
    backend, proc_root, pids = two_processes
    uuid = backend.uuid(0)
    sampler = NvmlSampler(backend, 0, proc_root=proc_root)
    sampler.watch("a", "uid-0", GIB, awake_limit_bytes=40 * GIB)
    sampler.watch("b", "uid-1", GIB, awake_limit_bytes=40 * GIB)
    register_process(tmp_path / "nvml", pids[0], uuid, 30 * GIB)
    register_process(tmp_path / "nvml", pids[1], uuid, 30 * GIB)
    sampler.phase("set that fits", allowed_above=2, set_budget_bytes=80 * GIB)
    sampler.sample_once()  # two awake, 80 GiB of budgets: the set fits
    sampler.phase("set too big", allowed_above=2, set_budget_bytes=70 * GIB)
    sampler.sample_once()  # the same two, but their budgets exceed the set's
    sampler.phase("one over its budget", allowed_above=2, set_budget_bytes=80 * GIB)
    register_process(tmp_path / "nvml", pids[1], uuid, 41 * GIB)
    sampler.sample_once()
    phases = {p["label"]: p for p in sampler.phases()}
    assert phases["set that fits"]["violations"] == 0
    assert phases["set that fits"]["peak_set_budgets_mib"] == 80 * 1024
    assert phases["set too big"]["violations"] == 1
    assert "over the set's 71680 MiB" in phases["set too big"]["first_violations"][0]["why"][0]
    assert phases["one over its budget"]["violations"] == 1
    assert phases["one over its budget"]["first_violations"][0]["why"] == [
        "b holds 41984 MiB over its awake budget of 40960 MiB"]


def test_memory_of_no_watched_engine_is_unknown(
        two_processes: tuple[FakeNvml, Path, list[int]], tmp_path: Path) -> None:
    backend, proc_root, pids = two_processes
    sampler = NvmlSampler(backend, 0, proc_root=proc_root)
    sampler.watch("a", "uid-0", GIB)
    register_process(tmp_path / "nvml", pids[1], backend.uuid(0), 5 * GIB)
    assert sampler.sample_once() == {"a": 0}
    assert sampler.report()["timeline"][0][3] == 5120
