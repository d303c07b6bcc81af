"""Reconciliation of a holder that fell asleep without handing its memory back, on an
in-memory node (real simulators, the controller's own workers and switch code)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from e2e.harness.gang_node import GangNode, gang_node
from rota.api import naming
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0


async def _a_awake_b_asleep(factory: EngineSimFactory, session: aiohttp.ClientSession
                            ) -> GangNode:
    """One GPU, A awake and named by its Lease, B asleep."""
    return await gang_node(factory, session, [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
                           gpus=1, awake=("a",))


async def test_a_holder_asleep_holding_its_memory_is_woken_back(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The Lease names A awake, but a sleep nobody waited for fired and handed no memory
    back: A says it sleeps (vLLM then holds every request sent to it) and a second sleep
    changes nothing. Reconciliation wakes A back, so that its Lease and its state agree
    (on the old code A stayed asleep under a Lease that said awake, for good when nobody
    asked for another model), and the GPU switches on as usual."""
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    try:
        await a.sim.faults(sleep_lies=True)
        await node.adapter(a.claimant).sleep(1)  # as a sleep whose caller left fires
        await a.sim.faults(sleep_lies=False)
        assert a.sim.engine.is_sleeping
        assert a.sim.engine.memory.used_bytes > a.claimant.resident_on("gpu-0")
        node.workers["gpu-0"].mark_dirty()
        async with asyncio.timeout(DEADLINE_S):
            await node.until(lambda: not a.sim.engine.is_sleeping, what="a woken back")
        assert node.holders() == {"gpu-0": a.claimant.ref}
        assert node.lease("gpu-0").state == naming.STATE_AWAKE
        async with asyncio.timeout(DEADLINE_S):
            activation = await node.activate(b)
        assert activation.ok
        assert a.sim.engine.is_sleeping
        assert a.sim.engine.memory.used_bytes <= a.claimant.resident_on("gpu-0")
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_holder_asleep_holding_its_memory_stays_beside_another_unknown(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    """No wake while another engine of the GPU may be awake: both asleep by their word,
    both holding memory; neither is woken back (one awake engine at most, always)."""
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    try:
        await a.sim.faults(sleep_lies=True)
        await b.sim.faults(sleep_lies=True)
        await node.adapter(b.claimant).wake(1)  # b wakes outside rota: two hold memory
        await node.adapter(b.claimant).sleep(1)
        await node.adapter(a.claimant).sleep(1)
        assert a.sim.engine.is_sleeping
        assert b.sim.engine.is_sleeping
        wakes = (a.sim.engine.wake_count, b.sim.engine.wake_count)
        caplog.set_level(logging.WARNING, logger="controller.lease.gpu")
        node.workers["gpu-0"].mark_dirty()
        async with asyncio.timeout(DEADLINE_S):
            await node.until(lambda: any("not woken back" in r.getMessage()
                                         for r in caplog.records),
                             what="reconciliation found b's memory on the GPU")
        assert a.sim.engine.is_sleeping
        assert b.sim.engine.is_sleeping
        # (The one-awake watch counts the two holders the test itself made.)
        assert (a.sim.engine.wake_count, b.sim.engine.wake_count) == wakes, "no wake"
    finally:
        await node.close()
