"""The one-awake counter of the gang benchmark (``e2e/gpu/one_awake.py``) on snapshots made
by hand: it counts an instant with two engines above resident on one GPU, attributes by pod
(not by the claim a process names itself), and reads a tensor-parallel engine's shard on
each of its GPUs against its resident footprint there."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from controller.claimants import Claimant
from controller.lease.device import GpuProcess, GpuSnapshot
from e2e.gpu.one_awake import OneAwakeSampler, awake_on
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config

GIB = 2**30
TOLERANCE = GIB // 2


def _claimant(name: str, gpus: Sequence[str]) -> Claimant:
    config = parse_engine_config({"apiVersion": API_VERSION, "kind": KIND, "model": name,
                                  "awakeMemory": 10 * GIB, "sleepLevel": 1,
                                  "enginePort": 8000, "adapter": "vllm"})
    return Claimant(
        claim_uid=f"uid-{name}", namespace="bench", claim_name=name, node="n", device=gpus[0],
        share_id=None, config=config, model=name, port=8000, sleep_level=1,
        resident_bytes=GIB, pod_name=f"pod-{name}", pod_uid=f"pod-{name}",
        pod_ip="127.0.0.1", pod_ready=True, pod_deleting=False,
        resident_on_gpu=tuple((g, GIB) for g in gpus) if len(gpus) > 1 else ())


def _snapshot(gpu: str, held: dict[Claimant, int], *, forged: int = 0) -> GpuSnapshot:
    processes = [GpuProcess(pid=100 + i, used_bytes=n, claim_uid=c.claim_uid,
                            pod_uid=c.pod_uid or "") for i, (c, n) in enumerate(held.items())]
    if forged:  # a stranger naming a claim in its own environment, in no claimant's pod
        processes.append(GpuProcess(pid=99, used_bytes=forged, claim_uid="uid-b0",
                                    pod_uid="pod-stranger"))
    used = sum(p.used_bytes for p in processes)
    return GpuSnapshot(uuid=f"GPU-{gpu}", device=gpu, total_bytes=141 * GIB, used_bytes=used,
                       free_bytes=141 * GIB - used, processes=tuple(processes))


A = _claimant("a", ["gpu-0", "gpu-1"])
B0 = _claimant("b0", ["gpu-0"])
B1 = _claimant("b1", ["gpu-1"])
CLAIMANTS = [A, B0, B1]


class Answers:
    """Every GPU's snapshot, one list entry per read (the last one again and again); sets
    ``done`` once the last is reached."""

    def __init__(self, answers: list[dict[str, GpuSnapshot]]) -> None:
        self.answers = answers
        self.done = asyncio.Event()

    async def read(self) -> dict[str, GpuSnapshot]:
        if len(self.answers) > 1:
            return self.answers.pop(0)
        self.done.set()
        return self.answers[0]


def _sampler() -> OneAwakeSampler:
    return OneAwakeSampler(Answers([]), CLAIMANTS, TOLERANCE)


def test_the_tensor_parallel_engine_awake_on_both_gpus_is_one_awake_on_each() -> None:
    sampler = _sampler()
    sampler.observe({"gpu-0": _snapshot("gpu-0", {A: 30 * GIB, B0: GIB}),
                     "gpu-1": _snapshot("gpu-1", {A: 30 * GIB, B1: GIB})}, 0.0)
    assert sampler.violations == 0
    assert sampler.max_awake == {"gpu-0": 1, "gpu-1": 1}
    assert [c.ref for c in awake_on(_snapshot("gpu-1", {A: 30 * GIB}), CLAIMANTS,
                                    TOLERANCE)] == ["bench/a"]


def test_two_engines_above_resident_on_one_gpu_are_a_violation() -> None:
    sampler = _sampler()
    sampler.observe({"gpu-0": _snapshot("gpu-0", {A: GIB, B0: 10 * GIB}),
                     "gpu-1": _snapshot("gpu-1", {A: 30 * GIB, B1: 10 * GIB})}, 1.5)
    assert sampler.violations == 1
    assert sampler.described == [{"gpu": "gpu-1", "at_s": 1.5,
                                  "awake": ["bench/a", "bench/b1"]}]
    assert sampler.max_awake == {"gpu-0": 1, "gpu-1": 2}


def test_memory_is_attributed_by_pod_not_by_the_claim_a_process_names() -> None:
    sampler = _sampler()
    sampler.observe({"gpu-0": _snapshot("gpu-0", {A: 30 * GIB, B0: GIB}, forged=20 * GIB)},
                    0.0)
    assert sampler.violations == 0


async def test_sampling_reads_until_told_to_stop() -> None:
    answers = Answers([{"gpu-0": _snapshot("gpu-0", {A: 30 * GIB, B0: GIB})},
                       {"gpu-0": _snapshot("gpu-0", {A: 30 * GIB, B0: 10 * GIB})},
                       {"gpu-0": _snapshot("gpu-0", {A: GIB, B0: 10 * GIB})}])
    sampler = OneAwakeSampler(answers, CLAIMANTS, TOLERANCE, interval_s=0.001)
    stop = asyncio.Event()
    task = asyncio.create_task(sampler.run(stop))
    await asyncio.wait_for(answers.done.wait(), timeout=10.0)
    stop.set()
    await asyncio.wait_for(task, timeout=10.0)
    report = sampler.report()
    assert report["samples"] >= 3
    assert report["violations"] == 1  # the second answer only
    assert report["read_errors"] == 0
