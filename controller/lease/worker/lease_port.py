"""The GPU Lease of one physical GPU, read and written with compare-and-swap."""

from __future__ import annotations

from controller.lease.kube import ControllerKube
from controller.lease.switch import Fenced
from rota.api import naming
from rota.api.gpu_lease import GpuLease, lease_body
from rota.kit.errors import KubeConflictError, KubeNotFoundError


def confirmed(known: GpuLease | None, seen: str | None) -> GpuLease | None:
    """``known`` (the Lease as a worker last wrote or read it) when a watch has seen that
    very version since (``seen``), so nobody wrote after it; None when it must be read."""
    if known is not None and known.resource_version and seen == known.resource_version:
        return known
    return None


class KubeLeasePort:
    """The GPU Lease of one physical GPU, read and written with compare-and-swap."""

    def __init__(self, kube: ControllerKube, namespace: str, node: str, gpu: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.node = node
        self.gpu = gpu
        self.name = naming.gpu_lease_name(node, gpu)

    async def read(self) -> GpuLease:
        try:
            return GpuLease.from_object(await self.kube.get_lease(self.namespace, self.name))
        except KubeNotFoundError:
            fresh = GpuLease(name=self.name, node=self.node, device=self.gpu)
            body = lease_body(fresh, self.namespace, labels_node=self.node,
                              labels_device=self.gpu)
            try:
                return GpuLease.from_object(await self.kube.create_lease(self.namespace, body))
            except KubeConflictError:
                return GpuLease.from_object(await self.kube.get_lease(self.namespace,
                                                                      self.name))

    async def write(self, lease: GpuLease) -> GpuLease:
        body = lease_body(lease, self.namespace, labels_node=self.node,
                          labels_device=self.gpu)
        try:
            return GpuLease.from_object(await self.kube.replace_lease(self.namespace, body))
        except KubeConflictError as exc:
            raise Fenced(f"GPU lease {self.name} changed under this switch: {exc}") from exc
