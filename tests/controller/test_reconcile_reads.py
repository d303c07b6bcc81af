"""Reconciliation confirms its GPU Lease from the node's Lease watch instead of a GET each
time (every GPU reconciles at least every ``resync_s``, 10 s by default: on a node of 8
GPUs that was 48 GETs a minute with nothing happening). On an in-memory node: real
simulators, the controller's own workers and switch code, a Lease port that counts reads."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controller.lease.gpu import GpuWorker
from e2e.harness.gang_node import GangNode, gang_node
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0
RECONCILES = 5


async def _reconcile(node: GangNode, worker: GpuWorker) -> None:
    done = worker.reconciliations
    worker.mark_dirty()
    async with asyncio.timeout(DEADLINE_S):
        await node.until(lambda: worker.reconciliations > done, what="reconciled")


async def test_reconciliation_reads_the_lease_only_when_the_watch_saw_another_write(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)], gpus=1,
                           awake=("a",))
    a, _ = node.engines
    port, worker = node.leases["gpu-0"], node.workers["gpu-0"]
    try:
        async with asyncio.timeout(DEADLINE_S):
            await node.until(lambda: worker.lease is not None, what="first reconciliation")
        reads = port.reads
        for _ in range(RECONCILES):
            await _reconcile(node, worker)
        assert port.reads == reads, "each reconciliation read the Lease again"

        moved = port.move()  # another writer: the watch sees a version this worker did not
        await _reconcile(node, worker)
        assert port.reads == reads + 1
        assert worker.lease is not None
        assert worker.lease.fence >= moved.fence
        assert node.holders() == {"gpu-0": a.claimant.ref}
    finally:
        await node.close()
