"""A start gate that does not come back for its go, on the in-memory node (real simulators
over HTTP, the controller's own workers, in-memory Leases).

The go is recorded on the GPU Lease (``gpu.rota.dev/start-granted``) before it is handed
over. When the gate then never takes it (its container went away between two polls), the
start ends ``start_not_taken`` and the old holder is woken back: the start's failure
writes go on from the Leases as the record left them. They went on from the Leases as
read before the record, so every write was refused (the record had moved them), the
start ended fenced off, and reconciliation found the record and kept the newcomer, which
never started, unsettled: the old holder stayed asleep (``state_unknown``) until the
start's limit passed.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controller.lease.admission import StartLimits
from e2e.harness.gang_node import Engine, GangNode, gang_node
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0
GRANT_S = 1.0
"""How long a go waits for the gate's next poll (short: no poll comes)."""


async def _reconciled(node: GangNode) -> GangNode:
    for worker in node.workers.values():
        assert worker.starter is not None
        worker.starter.limits = StartLimits(start_s=10.0, grant_s=GRANT_S)
    await node.until(lambda: all(w.reconciliations > 0 and not w.unsettled
                                 for w in node.workers.values()),
                     within_s=DEADLINE_S, what="the GPUs reconciled")
    return node


async def _asks_once_and_leaves(node: GangNode, engine: Engine) -> None:
    """Its container (no engine runs yet) asks its gate once, then goes away; the start
    it asked for runs and ends."""
    await engine.sim.stop()
    engine.gone_from.update(engine.claimant.gpus)
    worker = node.workers[engine.claimant.gpu]
    assert not await worker.request_start(engine.claimant, hold_s=0.0)
    # Its ticket leaves the worker when the start ends, however it ends.
    await node.until(lambda: engine.claimant.claim_uid not in worker._starts
                     and not worker._switching, within_s=DEADLINE_S, what="the start over")


async def _serves(node: GangNode, engine: Engine) -> None:
    async with asyncio.timeout(DEADLINE_S):
        answer = await node.activate(engine)
    assert answer.ok, f"{engine.claimant.ref}: {answer.reason}: {answer.message}"
    assert not engine.sim.engine.is_sleeping


async def test_a_gate_that_never_takes_its_go_gives_the_gpu_back(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _reconciled(await gang_node(
        engine_sim_factory, engine_session, [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
        gpus=1, awake=("a",)))
    a, b = node.engines
    try:
        await _asks_once_and_leaves(node, b)
        await _serves(node, a)
        assert node.workers["gpu-0"].last_switch.get("reason") == "start_not_taken"
        assert node.holders() == {"gpu-0": a.claimant.ref}
        assert node.lease("gpu-0").start_claim_uid == ""
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_gang_gate_that_never_takes_its_go_gives_both_gpus_back(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _reconciled(await gang_node(
        engine_sim_factory, engine_session, [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                                             ("tp", ("gpu-0", "gpu-1"), 40)],
        gpus=2, awake=("a", "b")))
    a, b, tp = node.engines
    try:
        await _asks_once_and_leaves(node, tp)
        await _serves(node, a)
        await _serves(node, b)
        assert node.workers["gpu-0"].last_switch.get("reason") == "start_not_taken"
        assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref}
        assert all(node.lease(g).start_claim_uid == "" for g in ("gpu-0", "gpu-1"))
        assert node.watch.violations == []
    finally:
        await node.close()
