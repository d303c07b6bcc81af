"""Level-2 switches (weights discarded, reloaded, prefix cache reset) and vLLM-Omni
switches (stage-aware sleep with ACKs), end to end on the local cluster."""

from __future__ import annotations

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import (
    AwakeMonitor,
    Engine,
    EngineSpec,
    activate,
    ask_seven,
    deploy,
    sim_state,
)
from e2e.harness.waiting import eventually_async

pytestmark = [pytest.mark.cluster, pytest.mark.controller]


async def _handoffs(node: GpuNode, engines: list[Engine], models: list[str], count: int
                    ) -> None:
    node.start_controller()
    url = node.controller_url()
    async with aiohttp.ClientSession() as session:
        async def serving() -> bool:
            status, _ = await activate(session, url, models[0])
            return status == 200

        await eventually_async(serving, timeout=60, what="controller serving")
        with AwakeMonitor(node.dirs.inspect_socket, engines) as monitor:
            for i in range(count):
                model = models[(i + 1) % 2]
                status, body = await activate(session, url, model)
                assert status == 200, body
                assert body["switched"] is True
                assert await ask_seven(session, body["endpoint"], model) == "7"
        states = [await sim_state(session, e) for e in engines]
    assert monitor.violations == []
    assert sum(1 for s in states if not s["sleeping"]) == 1


async def test_level_two_switches(engine_node: GpuNode, kube_api: client.ApiClient,
                                  namespace: str) -> None:
    engines = deploy(kube_api, namespace, engine_node.name, [
        EngineSpec("l2-a", "org/level2-a", resident="1Gi", awake="30Gi", sleep_level=2),
        EngineSpec("l2-b", "org/level2-b", resident="1Gi", awake="30Gi", sleep_level=2)])
    await _handoffs(engine_node, engines, ["org/level2-a", "org/level2-b"], 4)


async def test_omni_switches(engine_node: GpuNode, kube_api: client.ApiClient,
                             namespace: str) -> None:
    # vLLM-Omni wakes only from level 1 (its level-2 wake is not implemented: the driver
    # refuses sleepLevel 2 for it), and its stage ids come from the claim.
    omni = ("--omni", "--omni-stages", "2")
    stages = (("omniStageIds", [0, 1]),)
    engines = deploy(kube_api, namespace, engine_node.name, [
        EngineSpec("omni-a", "org/omni-a", resident="1Gi", awake="24Gi", sleep_level=1,
                   adapter="vllm-omni", args=omni, config=stages),
        EngineSpec("omni-b", "org/omni-b", resident="1Gi", awake="24Gi", sleep_level=1,
                   adapter="vllm-omni", args=omni, config=stages)])
    await _handoffs(engine_node, engines, ["org/omni-a", "org/omni-b"], 4)
