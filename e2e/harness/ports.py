"""Ports of the switch protocol without Kubernetes, for benchmarks and unit tests.

:class:`MemoryLeasePort` keeps a GPU Lease in memory with the API server's rules: every
write is a compare-and-swap on ``resourceVersion`` (a stale write raises
:class:`~controller.lease.switch.Fenced`, as the real port does), every read answers the current
copy, and :meth:`MemoryLeasePort.move` is another writer taking the Lease over.
:class:`ReaderDevice` is the device port on the real inspection client.
"""

from __future__ import annotations

import datetime as dt

from controller.lease.device import DeviceReader, GpuSnapshot
from controller.lease.switch import Fenced
from rota.api.gpu_lease import GpuLease

__all__ = ["MemoryLeasePort", "ReaderDevice"]


class MemoryLeasePort:
    """The GPU Lease kept in memory: compare-and-swap on ``resource_version``."""

    def __init__(self, lease: GpuLease) -> None:
        self.current = lease.with_(resource_version="0")
        self.writes = 0
        self.reads = 0

    def _store(self, lease: GpuLease) -> GpuLease:
        version = int(self.current.resource_version or "0") + 1
        self.current = lease.with_(resource_version=str(version),
                                   renewed=dt.datetime.now(dt.UTC))
        return self.current

    async def read(self) -> GpuLease:
        self.reads += 1
        return self.current

    async def write(self, lease: GpuLease) -> GpuLease:
        if lease.resource_version != self.current.resource_version:
            raise Fenced(f"lease resourceVersion {lease.resource_version} is stale; "
                         f"the lease is at {self.current.resource_version}")
        self.writes += 1
        return self._store(lease)

    def move(self, *, controller: str = "another-instance") -> GpuLease:
        """Another writer raises the fencing number (a newer instance reconciling)."""
        return self._store(self.current.with_(fence=self.current.fence + 1,
                                              controller=controller))


class ReaderDevice:
    """The switch's device port on the real inspection client."""

    def __init__(self, reader: DeviceReader) -> None:
        self.reader = reader

    async def snapshot(self, device: str) -> GpuSnapshot:
        snapshots = await self.reader.read()
        if device not in snapshots:
            raise LookupError(f"the inspection API reports no GPU {device}: "
                              f"{sorted(snapshots)}")
        return snapshots[device]
