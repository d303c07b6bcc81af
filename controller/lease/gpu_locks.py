"""The locks of a node's GPUs, always taken in one order.

Every step of a GPU worker (a switch, a start, reconciliation, the idle check) holds the
locks of its *domain*: its GPU and every GPU joined to it through engines that span GPUs
(:func:`domains`). With only one-GPU engines a domain is one GPU, and workers never wait
for each other. A tensor-parallel engine joins its GPUs, so a gang switch and the steps
of the GPUs it touches run one at a time.

No deadlock: locks are taken in GPU order (``gpu-0`` before ``gpu-1`` before ``gpu-10``)
and a step holds nothing while it waits for its first lock. No starvation: an
:class:`asyncio.Lock` wakes its waiters in the order they came, and a step that releases a
lock and asks again queues behind them. Every wait is bounded (``timeout_s``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from controller.claimants import Claimant, gpu_order


class GpuLocks:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, gpu: str) -> asyncio.Lock:
        """The lock of one GPU (made on first use)."""
        return self._locks.setdefault(gpu, asyncio.Lock())

    @asynccontextmanager
    async def hold(self, gpus: Iterable[str], *, timeout_s: float) -> AsyncIterator[None]:
        """Hold the locks of ``gpus``, taken in GPU order; raises :class:`TimeoutError`
        when they are not all had within ``timeout_s`` (holding none then)."""
        taken: list[asyncio.Lock] = []
        try:
            async with asyncio.timeout(timeout_s):
                for gpu in sorted(set(gpus), key=gpu_order):
                    lock = self.lock(gpu)
                    await lock.acquire()
                    taken.append(lock)
            yield
        finally:
            for lock in reversed(taken):
                lock.release()


def domains(claimants: Iterable[Claimant]) -> dict[str, tuple[str, ...]]:
    """Each GPU's domain: the GPUs joined to it, directly or through others, by claimants
    that hold several GPUs; in GPU order. A GPU no claimant spans is its own domain."""
    parent: dict[str, str] = {}

    def root(gpu: str) -> str:
        parent.setdefault(gpu, gpu)
        while parent[gpu] != gpu:
            parent[gpu] = parent[parent[gpu]]
            gpu = parent[gpu]
        return gpu

    for claimant in claimants:
        first, *rest = claimant.gpus
        for gpu in rest:
            parent[root(gpu)] = root(first)
        root(first)
    members: dict[str, list[str]] = {}
    for gpu in parent:
        members.setdefault(root(gpu), []).append(gpu)
    return {gpu: tuple(sorted(group, key=gpu_order))
            for group in members.values() for gpu in group}
