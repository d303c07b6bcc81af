"""The simulator as a tensor-parallel engine: one worker per GPU, as NVML shows vLLM's.

With ``tensor_parallel_size`` N the engine takes the first N GPUs it was given
(``NVIDIA_VISIBLE_DEVICES``, as rota's CDI spec writes a claim on several GPUs); each rank
holds 1/N of the memory knobs on its own GPU, under its own pid (rank 0: the simulator;
every other rank a worker process with the simulator's environment), and one sleep or wake
moves every shard.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from driver.inspection import process_environment
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml, NvmlFixture, load_fixture, pid_alive, register_process
from e2e.engine_simulator.engine import StartFailed
from e2e.engine_simulator.memory import shards
from e2e.engine_simulator.settings import Settings, settings_from_args
from e2e.harness.waiting import eventually_async
from tests.simulator.conftest import GIB, Sim, SimFactory
from tests.simulator.test_process import ROOT, exit_code

WAKE_OOM = "Call to wake_up method failed: CUDA Error: out of memory at <path>:163"
DEADLINE = 30.0

LivePid = Callable[[], Awaitable[int]]


def two_gpus() -> NvmlFixture:
    """The first two GPUs of the eight-GPU fake node."""
    eight = load_fixture(fixture_path("h200x8"))
    return eight.model_copy(update={"devices": eight.devices[:2]})


@pytest.fixture
def nvml(nvml_dir: Path) -> FakeNvml:
    """The fake NVML of a two-GPU node; ``init`` publishes each GPU's capacity."""
    backend = FakeNvml(two_gpus(), nvml_dir)
    backend.init()
    return backend


GPU_A, GPU_B = (gpu.uuid for gpu in two_gpus().devices)


def on_gpus(nvml: FakeNvml) -> list[dict[int, int | None]]:
    """Each GPU's processes as the fake NVML reports them: pid to used bytes."""
    return [{p.pid: p.used_bytes for p in nvml.compute_processes(i)} for i in range(2)]


async def tp_sim(make_sim: SimFactory, **overrides: object) -> Sim:
    values: dict[str, object] = {"nvml_pid": None, "gpu_uuids": (GPU_A, GPU_B),
                                 "tensor_parallel_size": 2, "awake_memory_bytes": 20 * GIB,
                                 "resident_memory_bytes": 2 * GIB, "weights_bytes": 12 * GIB}
    return await make_sim(**(values | overrides))


# -- settings ---------------------------------------------------------------------------


def test_the_gpus_come_from_the_cdi_environment() -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb", "ROTA_SIM_TENSOR_PARALLEL_SIZE": "2"}
    settings = settings_from_args([], env)
    assert settings.gpu_uuid == "GPU-aaaa"
    assert settings.gpus == settings.worker_gpus == ("GPU-aaaa", "GPU-bbbb")
    assert settings.tensor_parallel_size == 2
    # rota's CDI spec also names every GPU in ROTA_GPU_UUID, comma-separated.
    both = settings_from_args(["--tensor-parallel-size", "2"],
                              {"ROTA_GPU_UUID": "GPU-cccc,GPU-dddd"})
    assert both.worker_gpus == ("GPU-cccc", "GPU-dddd")
    assert settings_from_args(["--gpu-uuid", "GPU-x,GPU-y"], env).worker_gpus == \
        ("GPU-x", "GPU-y")


def test_a_one_gpu_engine_on_a_claim_of_two_uses_the_first() -> None:
    settings = settings_from_args([], {"ROTA_GPU_UUID": "GPU-aaaa,GPU-bbbb"})
    assert settings.gpu_uuid == "GPU-aaaa"
    assert settings.tensor_parallel_size == 1
    assert settings.worker_gpus == ("GPU-aaaa",)


def test_more_ranks_than_gpus_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(["--tensor-parallel-size", "4"],
                           {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"})
    assert "tensor_parallel_size 4 needs as many GPUs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs the fake memory backend"):
        Settings(gpu_uuids=("GPU-a", "GPU-b"), tensor_parallel_size=2, memory_backend="cuda")
    with pytest.raises(ValueError, match="not the first"):
        Settings(gpu_uuid="GPU-b", gpu_uuids=("GPU-a", "GPU-b"))


def test_shards_split_evenly_and_add_up() -> None:
    assert shards(10, 2) == [5, 5]
    assert shards(11, 4) == [5, 2, 2, 2]
    assert sum(shards(20 * GIB + 3, 3)) == 20 * GIB + 3


# -- the records ------------------------------------------------------------------------


async def test_each_rank_holds_its_shard_on_its_gpu_under_its_own_pid(
        make_sim: SimFactory, nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROTA_POD_UID", "pod-tp")
    monkeypatch.setenv("ROTA_CLAIM_UID", "claim-tp")
    sim = await tp_sim(make_sim)
    ranks = (await sim.state())["memory"]["ranks"]
    assert [r["gpu_uuid"] for r in ranks] == [GPU_A, GPU_B]
    rank0, rank1 = (r["pid"] for r in ranks)
    assert rank0 == os.getpid()
    assert rank1 != rank0
    assert pid_alive(rank1)
    assert on_gpus(nvml) == [{rank0: 10 * GIB}, {rank1: 10 * GIB}]
    # The worker is the pod's as the simulator is: the driver's inspection reads the same
    # ROTA_POD_UID and ROTA_CLAIM_UID in its environment.
    assert process_environment(rank1, Path("/proc")) == {"ROTA_POD_UID": "pod-tp",
                                                         "ROTA_CLAIM_UID": "claim-tp"}

    await sim.post_empty("/sleep", level=1)
    assert on_gpus(nvml) == [{rank0: GIB}, {rank1: GIB}]
    await sim.post_empty("/wake_up", tags="weights")
    assert on_gpus(nvml) == [{rank0: 7 * GIB}, {rank1: 7 * GIB}]
    await sim.post_empty("/wake_up", tags="kv_cache")
    assert on_gpus(nvml) == [{rank0: 10 * GIB}, {rank1: 10 * GIB}]
    await sim.post_empty("/sleep", level=2)
    assert on_gpus(nvml) == [{rank0: GIB}, {rank1: GIB}]
    state = await sim.state()
    assert state["tensor_parallel_size"] == 2
    assert state["gpu_uuids"] == [GPU_A, GPU_B]
    assert state["memory_bytes"] == 2 * GIB

    await sim.client.close()
    assert on_gpus(nvml) == [{}, {}]
    assert not pid_alive(rank1)


async def test_a_wake_that_does_not_fit_on_one_gpu_maps_nothing_on_the_other(
        make_sim: SimFactory, nvml: FakeNvml, live_pid: LivePid) -> None:
    sim = await tp_sim(make_sim)
    await sim.post_empty("/sleep", level=1)
    # A stranger takes most of the second GPU while the engine sleeps.
    free_b = nvml.memory_info(1).free
    stranger = await live_pid()
    register_process(nvml_dir_of(nvml), stranger, GPU_B, free_b - 2 * GIB)
    async with sim.client.post("/wake_up") as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == WAKE_OOM
    rank0, rank1 = (r["pid"] for r in (await sim.state())["memory"]["ranks"])
    # The weights (6 GiB a rank) fit on neither: the first GPU's shard is not left mapped.
    assert on_gpus(nvml) == [{rank0: GIB}, {rank1: GIB, stranger: free_b - 2 * GIB}]
    assert await sim.is_sleeping()


async def test_a_start_that_does_not_fit_on_one_gpu_ends_every_worker(
        make_sim: SimFactory, nvml: FakeNvml, live_pid: LivePid) -> None:
    stranger = await live_pid()
    register_process(nvml_dir_of(nvml), stranger, GPU_B, nvml.memory_info(1).free - 5 * GIB)
    with pytest.raises(StartFailed):
        await tp_sim(make_sim)
    assert on_gpus(nvml)[0] == {}
    assert set(on_gpus(nvml)[1]) == {stranger}
    assert [p for p in _children() if "rota-sim-worker" in _cmdline(p)] == []


def nvml_dir_of(nvml: FakeNvml) -> Path:
    proc_dir = nvml._proc_dir  # the registry this backend reads
    assert proc_dir is not None
    return proc_dir


def _children() -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


async def test_a_dead_worker_leaves_its_gpu(make_sim: SimFactory, nvml: FakeNvml) -> None:
    """A worker that dies frees its shard (its record goes with it), as a crashed vLLM
    worker's memory does; the other rank's stays."""
    sim = await tp_sim(make_sim)
    rank0, rank1 = (r["pid"] for r in (await sim.state())["memory"]["ranks"])
    os.kill(rank1, signal.SIGKILL)

    async def gone() -> bool:
        await asyncio.sleep(0)
        return on_gpus(nvml) == [{rank0: 10 * GIB}, {}]

    await eventually_async(gone, timeout=DEADLINE, what="the dead worker's record dropped")
    assert not (nvml_dir_of(nvml) / f"{rank1}.json").exists()
    assert (await sim.state())["memory"]["ranks"][1]["alive"] is False


# -- the real process -------------------------------------------------------------------


async def test_workers_die_with_a_simulator_killed_hard(tmp_path: Path) -> None:
    nvml_dir = tmp_path / "nvml"
    backend = FakeNvml(two_gpus(), nvml_dir)
    backend.init()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ROTA_", "VLLM_")) and k != "NVIDIA_VISIBLE_DEVICES"}
    env |= {"NVIDIA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}", "ROTA_POD_UID": "pod-child"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "e2e.engine_simulator", "--port", "0", "--tensor-parallel-size",
        "2", "--fake-nvml-dir", str(nvml_dir), "--awake-memory-bytes", "40Gi", cwd=ROOT,
        env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(DEADLINE):
            while True:
                line = await proc.stderr.readline()
                assert line, "the simulator exited before listening"
                if json.loads(line)["event"] == "engine simulator listening":
                    break
        (rank0,), (rank1,) = (list(gpu) for gpu in on_gpus(backend))
        assert rank0 == proc.pid
        assert on_gpus(backend) == [{rank0: 20 * GIB}, {rank1: 20 * GIB}]
        assert process_environment(rank1, Path("/proc"))["ROTA_POD_UID"] == "pod-child"
    finally:
        proc.kill()
        await exit_code(proc)

    async def worker_gone() -> bool:
        await asyncio.sleep(0)
        return not pid_alive(rank1)

    await eventually_async(worker_gone, timeout=DEADLINE, what="the worker ending with it")
    assert on_gpus(backend) == [{}, {}]
