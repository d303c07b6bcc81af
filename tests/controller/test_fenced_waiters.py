"""A switch fenced off queues its callers again, to be served after reconciliation; callers
who asked for the same engine while it ran are queued under the same claim. Both kinds are
answered: none is dropped when the two meet in the queue (on the in-memory node: real
simulators over HTTP, the controller's own workers, in-memory Leases)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from e2e.harness.gang_node import gang_node
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0


async def test_callers_of_a_fenced_switch_and_those_who_came_during_it_are_all_answered(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)], gpus=1,
                           awake=("a",))
    worker = node.workers["gpu-0"]
    _, b = node.engines
    later: list[asyncio.Future[object]] = []

    def during_the_switch() -> None:
        # While the switch to B reads the GPU: another caller asks for B, and another
        # writer moves the Lease, so that the switch is fenced off at its next step.
        if later or not worker._switching:
            return
        later.append(asyncio.ensure_future(node.activate(b)))
        node.leases["gpu-0"].move()

    try:
        await node.until(lambda: worker.reconciliations > 0 and not worker.unsettled,
                         within_s=DEADLINE_S, what="the GPU reconciled")
        node.device.on_read.append(during_the_switch)
        async with asyncio.timeout(DEADLINE_S):
            first = await node.activate(b)
        assert later, "the switch never read the GPU"
        async with asyncio.timeout(DEADLINE_S):
            second = await later[0]
        assert first.ok, first.message
        assert getattr(second, "ok", False), second
        assert node.watch.violations == []
    finally:
        await node.close()
