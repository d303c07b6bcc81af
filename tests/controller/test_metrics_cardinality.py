"""The controller's per-claim series stay bounded: GPU memory is summed per claim (no pid
label), and the series of a claim that left the GPU, or of a claimant that left it, are
removed instead of staying at their last value forever."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from controller.lease import metrics
from controller.lease.device import GpuProcess, GpuSnapshot
from controller.lease.node import NodeController
from controller.lease.settings import LeaseSettings

GIB = 2**30


class InspectionSimulator:
    """The driver's inspection API as the controller's DeviceReader sees it: each read
    answers the next prepared picture of the node's GPUs."""

    def __init__(self, reads: list[list[GpuProcess]]) -> None:
        self.reads = reads

    async def read(self) -> dict[str, GpuSnapshot]:
        processes = tuple(self.reads.pop(0))
        used = sum(p.used_bytes for p in processes)
        return {"gpu-0": GpuSnapshot(uuid="GPU-card", device="gpu-0", total_bytes=141 * GIB,
                                     used_bytes=used, free_bytes=141 * GIB - used,
                                     processes=processes)}


def _series(name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_gpu_memory_is_per_claim_and_forgets_claims_that_left() -> None:
    device = InspectionSimulator([
        [GpuProcess(11, 3 * GIB, "claim-1", "pod-1"), GpuProcess(12, GIB, "claim-1", "pod-1"),
         GpuProcess(13, GIB, "", "")],
        [GpuProcess(21, 2 * GIB, "claim-2", "pod-2")],
    ])
    unused: Any = None
    node = NodeController(settings=LeaseSettings(node_name="node-a"), kube=unused,
                          election=unused, device=device, session=unused,  # type: ignore[arg-type]
                          cache=unused)
    await node.snapshot("gpu-0")
    first = _series("rota_controller_gpu_memory_bytes")
    assert first[(("claim", "claim-1"), ("gpu", "gpu-0"), ("gpu_uuid", "GPU-card"))] == 4 * GIB
    assert first[(("claim", "unknown"), ("gpu", "gpu-0"), ("gpu_uuid", "GPU-card"))] == GIB
    assert not any("pid" in dict(labels) for labels in first)
    await node.snapshot("gpu-0")
    assert _series("rota_controller_gpu_memory_bytes") == {
        (("claim", "claim-2"), ("gpu", "gpu-0"), ("gpu_uuid", "GPU-card")): 2 * GIB}


def test_a_series_set_removes_what_is_no_longer_there() -> None:
    gauge = Gauge("series_under_test", "a gauge", ["gpu", "claim"],
                  registry=CollectorRegistry())
    holders = metrics.SeriesSet(gauge)
    holders.set("gpu-0", {("gpu-0", "a"): 1.0, ("gpu-0", "b"): 0.0})
    holders.set("gpu-1", {("gpu-1", "c"): 1.0})
    holders.set("gpu-0", {("gpu-0", "b"): 1.0})
    assert sorted(tuple(s.labels.values()) for f in gauge.collect() for s in f.samples) == [
        ("gpu-0", "b"), ("gpu-1", "c")]
