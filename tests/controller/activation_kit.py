"""What tests of the activation API's server share: a real :class:`GpuWorker` for one
claimant, behind a node that only routes activations to it (or answers them itself)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

from controller.claimants import Claimant
from controller.lease.gpu import Activation, GpuWorker, Policy
from controller.lease.settings import LeaseSettings
from controller.lease.switch import Fenced
from rota.api.engine_config import parse_engine_config
from rota.api.gpu_lease import GpuLease

MODEL = "org/model-b"
CLAIM = "ns/claim-b"


def claimant_b() -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                                  "model": MODEL, "awakeMemory": "8Gi"})
    return Claimant(claim_uid="uid-b", namespace="ns", claim_name="claim-b", node="node-a",
                    device="gpu-0", share_id=None, config=config, model=MODEL, port=8000,
                    sleep_level=1, resident_bytes=1 << 30, pod_name="pod-b",
                    pod_uid="pod-uid-b", pod_ip="127.0.0.2", pod_ready=True,
                    pod_deleting=False)


class FencedSwitcher:
    """A switch whose first compare-and-swap finds the Lease moved on."""

    async def switch(self, lease: GpuLease, **_: Any) -> None:
        raise Fenced(f"GPU lease {lease.name} changed under this switch")


class Leading:
    def is_leader(self) -> bool:
        return True


@dataclass
class RoutingNode:
    """What the activation API asks of a node's controller, routed to one real worker."""

    worker: GpuWorker
    claimant: Claimant
    settings: LeaseSettings = field(
        default_factory=lambda: LeaseSettings(node_name="node-a", identity="ctl-0"))
    election: Leading = field(default_factory=Leading)
    reconciled: bool = True
    asked: asyncio.Event = field(default_factory=asyncio.Event)
    result: Activation | None = None
    """When set, the answer of every activation (the worker is not asked)."""

    @property
    def workers(self) -> dict[str, GpuWorker]:
        return {self.worker.gpu: self.worker}

    def claimants(self) -> list[Claimant]:
        return [self.claimant]

    async def activate(self, model: str, claim: str | None = None) -> Activation:
        self.asked.set()
        if self.result is not None:
            return self.result
        # GpuWorker.activate queues its waiter before its first await: once the handler
        # waits, the waiter is in the worker's queue.
        return await self.worker.activate(self.claimant)


def make_worker(claimant: Claimant, policy: Policy | None = None) -> GpuWorker:
    unused: Any = None
    return GpuWorker(gpu="gpu-0", lease_port=unused, switcher=cast(Any, FencedSwitcher()),
                     claimants=lambda: [claimant], engine=unused, policy=policy or Policy(),
                     clock=lambda: 0.0)
