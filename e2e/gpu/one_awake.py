"""The one-awake invariant of a node's GPUs, sampled through the driver's inspection service.

:class:`OneAwakeSampler` reads every GPU the inspection service reports (one
``DeviceReader.read``, as the controller's device port reads) every ``interval_s`` until
told to stop, and counts, per GPU, the engines above their resident footprint there
(resident plus the controller's tolerance, attributed by pod as the controller's decisions
attribute). A sample with two or more of them on one GPU is a violation. It works the same
on real and fake NVML: it sees only what the inspection API answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.claimants import Claimant
from controller.lease.device import GpuSnapshot

__all__ = ["OneAwakeSampler", "SnapshotSource", "awake_on"]

KEPT_VIOLATIONS = 20
"""Violations described in the report (all are counted)."""


def awake_on(snapshot: GpuSnapshot, claimants: Sequence[Claimant], tolerance_bytes: int
             ) -> list[Claimant]:
    """The claimants of the GPU of ``snapshot`` that hold more than their resident
    footprint there (plus ``tolerance_bytes``): awake, or possibly awake."""
    return [c for c in claimants if snapshot.device in c.gpus
            and snapshot.held_by(c, claimants) > c.resident_on(snapshot.device) + tolerance_bytes]


class SnapshotSource(Protocol):
    """What answers every GPU of the node at once (:class:`~controller.lease.device.DeviceReader`
    on the inspection socket)."""

    async def read(self) -> dict[str, GpuSnapshot]: ...


@dataclass
class OneAwakeSampler:
    reader: SnapshotSource
    claimants: Sequence[Claimant]
    tolerance_bytes: int
    interval_s: float = 0.005
    samples: int = 0
    read_errors: int = 0
    violations: int = 0
    max_awake: dict[str, int] = field(default_factory=dict)
    """The most engines seen above resident at once, per GPU."""
    described: list[dict[str, Any]] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)

    def observe(self, snapshots: Mapping[str, GpuSnapshot], at: float) -> None:
        """Judge one sample (pure but for the counters)."""
        self.samples += 1
        for gpu, snapshot in snapshots.items():
            awake = awake_on(snapshot, self.claimants, self.tolerance_bytes)
            self.max_awake[gpu] = max(self.max_awake.get(gpu, 0), len(awake))
            if len(awake) > 1:
                self.violations += 1
                if len(self.described) < KEPT_VIOLATIONS:
                    self.described.append({"gpu": gpu, "at_s": round(at, 4),
                                           "awake": [c.ref for c in awake]})

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until ``stop`` is set (a read error is counted, and sampling goes on)."""
        origin = time.monotonic()
        while not stop.is_set():
            began = time.monotonic()
            try:
                snapshots = await self.reader.read()
            except (OSError, TimeoutError, RuntimeError):
                self.read_errors += 1
            else:
                self.read_s.append(time.monotonic() - began)
                self.observe(snapshots, began - origin)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def report(self) -> dict[str, Any]:
        reads = sorted(self.read_s)
        return {"samples": self.samples, "read_errors": self.read_errors,
                "violations": self.violations, "max_awake_per_gpu": dict(self.max_awake),
                "first_violations": self.described, "interval_s": self.interval_s,
                "read_p50_s": round(reads[len(reads) // 2], 6) if reads else None,
                "source": "every GPU read through the driver's inspection service; an "
                          "engine counts as awake on a GPU above its resident footprint "
                          "there plus the tolerance"}
