"""The fake GPU runs out: starts, wakes and allocations that do not fit fail as CUDA does.

Every simulator on a GPU registers its memory in the fake NVML's process registry; the
fake NVML publishes each GPU's total and baseline there (``gpus.json``). An allocation
that would exceed what the fake NVML shows free on the GPU fails: a start crashes the way
vLLM's does, a wake answers vLLM's out-of-memory 500 and keeps what it mapped.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from driver.nvml.fake import (
    FakeGpu,
    FakeNvml,
    GpuMemoryExhausted,
    NvmlFixture,
    publish_gpus,
    read_capacity,
    register_process,
    unregister_process,
)
from e2e.engine_simulator.engine import StartFailed
from tests.simulator.conftest import GIB, Sim, SimFactory

UUID = "GPU-cafecafe-0000-0000-0000-000000000001"
TOTAL = 16 * GIB
BASELINE = GIB // 2
WAKE_OOM = {"error": {"message": "Call to wake_up method failed: CUDA Error: out of memory at "
                                 "<path>:163", "type": "InternalServerError", "param": None,
                      "code": 500}}

LivePid = Callable[[], Awaitable[int]]


def small_gpu() -> NvmlFixture:
    gpu = FakeGpu(index=0, uuid=UUID, name="NVIDIA Small", brand=0, architecture=9,
                  cuda_compute_capability=(9, 0), pci_bus_id="00000000:01:00.0",
                  minor_number=0, memory_total=TOTAL, memory_used=BASELINE)
    return NvmlFixture(driver_version="580.0", cuda_driver_version=13000, devices=[gpu])


@pytest.fixture
def nvml(nvml_dir: Path) -> FakeNvml:
    """The fake NVML on a 16 GiB GPU; ``init`` publishes its capacity into the registry."""
    backend = FakeNvml(small_gpu(), nvml_dir)
    backend.init()
    return backend


@pytest.fixture
def live_pids() -> Iterator[list[int]]:
    """Two live processes' pids (the registry counts only live ones)."""
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE) for _ in range(2)]
    try:
        yield [c.pid for c in children]
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
            child.wait()


def used(nvml: FakeNvml) -> int:
    return nvml.memory_info(0).used


async def test_init_publishes_the_gpus_and_the_registry_ignores_that_file(
    nvml: FakeNvml, nvml_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = json.loads((nvml_dir / "gpus.json").read_text())
    assert body == {"gpus": [{"uuid": UUID, "memory_total": TOTAL, "memory_used": BASELINE}]}
    assert nvml.compute_processes(0) == []
    assert "ignoring unreadable" not in caplog.text


async def test_a_start_that_does_not_fit_crashes(
    nvml: FakeNvml, make_sim: SimFactory, live_pid: LivePid, caplog: pytest.LogCaptureFixture
) -> None:
    await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB)
    with pytest.raises(StartFailed, match="Engine core initialization failed"):
        await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=8 * GIB)
    assert "torch.OutOfMemoryError: CUDA out of memory" in caplog.text
    assert used(nvml) == BASELINE + 10 * GIB  # the crashed engine holds nothing
    assert len(nvml.compute_processes(0)) == 1


async def test_two_engines_that_fit_together_both_start(
    nvml: FakeNvml, make_sim: SimFactory, live_pid: LivePid
) -> None:
    await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB)
    await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=5 * GIB,
                   weights_bytes=2 * GIB)
    assert used(nvml) == BASELINE + 15 * GIB


async def test_a_wake_that_does_not_fit_answers_vllm_oom_and_keeps_partial_mappings(
    nvml: FakeNvml, make_sim: SimFactory, live_pid: LivePid
) -> None:
    # B: 1 GiB resident, 3 GiB weights, 6 GiB KV cache. A awake holds 10 GiB.
    b = await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB,
                       weights_bytes=3 * GIB)
    await b.post_empty("/sleep", level=1)
    a = await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB)
    assert used(nvml) == BASELINE + 11 * GIB  # 4.5 GiB free: the weights fit, the KV cache not

    async with b.client.post("/wake_up") as resp:
        assert resp.status == 500
        assert await resp.json() == WAKE_OOM
    state = await b.state()
    assert state["memory_bytes"] == 4 * GIB  # the weights stay mapped
    assert state["tags_asleep"] == ["weights", "kv_cache"]  # the executor still sleeps
    assert await b.is_sleeping()
    assert used(nvml) == BASELINE + 14 * GIB

    await b.post_empty("/sleep", level=1)  # "Executor is already sleeping": a no-op
    assert (await b.state())["memory_bytes"] == 4 * GIB
    assert used(nvml) == BASELINE + 14 * GIB

    await a.post_empty("/sleep", level=1)  # room again: finishing the wake works
    await b.post_empty("/wake_up")
    assert not await b.is_sleeping()
    assert (await b.state())["memory_bytes"] == 10 * GIB
    assert await b.answer() == "7"


async def test_sleep_undoes_partial_wake_is_a_named_kinder_fault(
    nvml: FakeNvml, make_sim: SimFactory, live_pid: LivePid
) -> None:
    b = await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB,
                       weights_bytes=3 * GIB, faults={"sleep_undoes_partial_wake": True})
    await b.post_empty("/sleep", level=1)
    await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB)
    async with b.client.post("/wake_up") as resp:
        assert resp.status == 500
    await b.post_empty("/sleep", level=1)
    assert (await b.state())["memory_bytes"] == 1 * GIB


async def test_a_level2_weights_wake_that_does_not_fit_maps_nothing(
    nvml: FakeNvml, make_sim: SimFactory, live_pid: LivePid
) -> None:
    b = await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB,
                       weights_bytes=6 * GIB)
    await b.post_empty("/sleep", level=2)
    await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID, awake_memory_bytes=10 * GIB)
    async with b.client.post("/wake_up", params={"tags": "weights"}) as resp:
        assert resp.status == 500
        assert await resp.json() == WAKE_OOM
    assert (await b.state())["memory_bytes"] == 1 * GIB


async def test_simultaneous_wakes_never_overcommit(
    nvml: FakeNvml, make_sim: SimFactory, live_pid: LivePid
) -> None:
    """Two engines whose awake footprints do not fit together wake at once, many times:
    exactly one wins each round and NVML never shows more than the GPU has."""
    sims: list[Sim] = []
    for _ in range(2):
        sim = await make_sim(nvml_pid=await live_pid(), gpu_uuid=UUID,
                             awake_memory_bytes=9 * GIB, weights_bytes=4 * GIB)
        await sim.post_empty("/sleep", level=1)
        sims.append(sim)

    async def wake(sim: Sim) -> int:
        async with sim.client.post("/wake_up") as resp:
            return resp.status

    for _ in range(10):
        statuses = await asyncio.gather(*(wake(s) for s in sims))
        assert sorted(statuses) == [200, 500]
        assert used(nvml) <= TOTAL
        for sim in sims:  # back to both asleep: finish the loser's wake later
            if await sim.is_sleeping():
                continue
            await sim.post_empty("/sleep", level=1)
        for sim in sims:
            state = await sim.state()
            if state["memory_bytes"] > 1 * GIB:  # the loser kept its weights mapped
                await sim.post_empty("/wake_up")
                await sim.post_empty("/sleep", level=1)
        assert used(nvml) == BASELINE + 2 * GIB


def test_registry_checks_are_race_free_between_writers(nvml: FakeNvml, nvml_dir: Path) -> None:
    """Six live processes ask at the same instant for more than half the GPU each: under
    the registry's lock exactly one gets it, every round."""
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE) for _ in range(6)]
    try:
        for _ in range(30):
            barrier = threading.Barrier(len(children))
            wins: list[int] = []

            def grab(pid: int, barrier: threading.Barrier = barrier,
                     wins: list[int] = wins) -> None:
                barrier.wait()
                try:
                    register_process(nvml_dir, pid, UUID, 9 * GIB, enforce_capacity=True)
                except GpuMemoryExhausted:
                    return
                wins.append(pid)

            threads = [threading.Thread(target=grab, args=(c.pid,)) for c in children]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(wins) == 1
            assert used(nvml) == BASELINE + 9 * GIB
            unregister_process(nvml_dir, wins[0])
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
            child.wait()


def test_growth_is_checked_and_shrinking_always_fits(
    nvml: FakeNvml, nvml_dir: Path, live_pids: list[int]
) -> None:
    first, second = live_pids[:2]
    register_process(nvml_dir, first, UUID, 10 * GIB, enforce_capacity=True)
    with pytest.raises(GpuMemoryExhausted) as caught:
        register_process(nvml_dir, second, UUID, 6 * GIB, enforce_capacity=True)
    assert caught.value.free_bytes == TOTAL - BASELINE - 10 * GIB
    assert caught.value.requested_bytes == 6 * GIB
    assert not (nvml_dir / f"{second}.json").exists()  # nothing written
    register_process(nvml_dir, second, UUID, 5 * GIB, enforce_capacity=True)
    register_process(nvml_dir, first, UUID, 11 * GIB, enforce_capacity=False)  # unchecked
    register_process(nvml_dir, first, UUID, 10 * GIB + 1, enforce_capacity=True)  # shrinks
    assert used(nvml) == BASELINE + 15 * GIB + 1


def test_a_gpu_nobody_describes_has_no_limit(nvml_dir: Path, live_pids: list[int]) -> None:
    register_process(nvml_dir, live_pids[0], "GPU-unknown", 10**15, enforce_capacity=True)
    with pytest.raises(GpuMemoryExhausted):
        register_process(nvml_dir, live_pids[1], "GPU-unknown", 10 * GIB,
                         enforce_capacity=True, total_bytes=8 * GIB)


async def test_the_gpu_memory_knob_limits_an_engine_without_a_registry(
    make_sim: SimFactory,
) -> None:
    with pytest.raises(StartFailed):
        await make_sim(fake_nvml_dir=None, gpu_memory_bytes=8 * GIB)
    sim = await make_sim(fake_nvml_dir=None, gpu_memory_bytes=10 * GIB)
    await sim.post_empty("/sleep", level=1)
    await sim.post_empty("/wake_up")
    assert (await sim.state())["memory_bytes"] == 10 * GIB


def test_publish_then_read_capacity(nvml_dir: Path) -> None:
    publish_gpus(nvml_dir, small_gpu())
    capacity = read_capacity(nvml_dir, UUID)
    assert capacity is not None
    assert (capacity.memory_total, capacity.memory_used) == (TOTAL, BASELINE)
    assert read_capacity(nvml_dir, "GPU-other") is None
    (nvml_dir / "gpus.json").write_text("{broken")
    assert read_capacity(nvml_dir, UUID) is None
