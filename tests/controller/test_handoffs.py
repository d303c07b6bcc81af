"""The reference experiment in miniature, on the local cluster: two simulated engines on
one fake H200, 19 handoffs through the activation API, never two engines awake."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import AwakeMonitor, Engine, activate, ask_seven
from e2e.harness.waiting import eventually_async
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

A, B = MODEL_A, MODEL_B


async def test_nineteen_handoffs_with_one_engine_awake_at_a_time(
        engine_node: GpuNode, two_engines: list[Engine]) -> None:
    node, engines = engine_node, two_engines
    node.start_controller()
    url = node.controller_url()
    async with aiohttp.ClientSession() as session:
        # Both simulators start awake, as vLLM does; the controller's reconciliation puts
        # one to sleep before it serves anything.
        async def first() -> bool:
            status, _ = await activate(session, url, A.model)
            return status == 200

        await eventually_async(first, timeout=60, what="controller serving")
        with AwakeMonitor(node.dirs.inspect_socket, engines) as monitor:
            switched = 0
            for i in range(19):
                target = (B, A)[i % 2]
                status, body = await activate(session, url, target.model)
                assert status == 200, body
                assert body["switched"] is True
                switched += 1
                assert await ask_seven(session, body["endpoint"], target.model) == "7"
                # The GPU is read at least once with every engine as holder.
                await asyncio.to_thread(monitor.wait_next)
    assert switched == 19
    assert monitor.samples >= 19
    assert monitor.violations == []
