"""What unit tests of one GPU's worker (controller/lease/worker/) share: a claimant with a
pod on the node, an engine fake that reports a fixed number of requests in flight, and a
Lease port fake that keeps the Lease in memory."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from controller.claimants import Claimant
from controller.lease.worker.callers import CallerQueue
from rota.api.engine_config import parse_engine_config
from rota.api.gpu_lease import GpuLease

T = TypeVar("T")


def claimant(name: str) -> Claimant:
    """A ready claimant of model ``name`` (claim ``ns/name``, uid ``uid-name``) on gpu-0."""
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": name, "awakeMemory": "8Gi"})
    return Claimant(claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node="n",
                    device="gpu-0", share_id=None, config=config, model=name, port=8000,
                    sleep_level=1, resident_bytes=1 << 30, pod_name=f"p-{name}",
                    pod_uid=f"pu-{name}", pod_ip="127.0.0.2", pod_ready=True,
                    pod_deleting=False)


class FakeEngine:
    """An engine whose gauge always shows ``in_flight`` requests."""

    def __init__(self, in_flight: int = 0) -> None:
        self.requests = in_flight

    async def in_flight(self) -> int:
        return self.requests


class FakeLeasePort:
    """The Lease in memory: a read returns what the last switch wrote."""

    def __init__(self, lease: GpuLease) -> None:
        self.lease = lease

    async def read(self) -> GpuLease:
        return self.lease


async def caller_queued(queue: CallerQueue, claimant: Claimant,
                        call: Awaitable[T]) -> asyncio.Task[T]:
    """Start ``call`` (a caller of ``claimant``) and return once ``queue`` holds it (one
    caller more on the claim's entry) or it was answered without queueing; bounded."""
    def callers() -> int:
        entry = queue.entries.get(claimant.claim_uid)
        return len(entry.futures) if entry else 0

    before = callers()
    task = asyncio.ensure_future(call)
    deadline = asyncio.get_running_loop().time() + 5.0
    while not task.done() and callers() <= before:
        assert asyncio.get_running_loop().time() < deadline, "the caller was never queued"
        await asyncio.sleep(0)
    return task
