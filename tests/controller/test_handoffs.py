"""The reference experiment in miniature, on the local cluster: two simulated engines on
one fake H200, 19 handoffs through the activation API, never two engines awake."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import aiohttp
import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness import GpuNode
from e2e.scenario import AwakeMonitor, EngineSpec, activate, ask_seven, deploy
from e2e.waiting import eventually_async

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

A = EngineSpec("engine-a", "org/model-a", resident="2Gi", awake="60Gi")
B = EngineSpec("engine-b", "org/model-b", resident="1Gi", awake="20Gi")


@pytest.fixture
def node(cluster: LocalCluster, kube_api: client.ApiClient, device_class: str
         ) -> Iterator[GpuNode]:
    gpu = GpuNode(cluster=cluster, api=kube_api, name=f"gpu-{uuid.uuid4().hex[:8]}")
    try:
        gpu.start_driver()
        gpu.start_agent()
        yield gpu
    finally:
        gpu.close()


async def test_nineteen_handoffs_with_one_engine_awake_at_a_time(
        node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    engines = deploy(kube_api, namespace, node.name, [A, B])
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
    assert switched == 19
    assert monitor.samples > 50
    assert monitor.violations == []
