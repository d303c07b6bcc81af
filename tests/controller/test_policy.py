"""Policy on the local cluster: an idle holder goes to sleep after its TTL, and a request
for it wakes it again."""

from __future__ import annotations

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import Engine, activate, ask_seven, sim_state
from e2e.harness.waiting import eventually_async
from rota.api import naming
from tests.engines_on_cluster import MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.controller]


async def test_an_idle_holder_is_put_to_sleep_and_woken_on_demand(
        engine_node: GpuNode, two_engines: list[Engine], kube_api: client.ApiClient) -> None:
    engine_node.start_controller(extra=["--idle-sleep-s=0.5", "--resync-s=0.2"])
    url = engine_node.controller_url()
    a, b = two_engines
    coordination = client.CoordinationV1Api(kube_api)
    lease_name = naming.gpu_lease_name(engine_node.name, "gpu-0")
    async with aiohttp.ClientSession() as session:
        async def b_serves() -> bool:
            status, _ = await activate(session, url, MODEL_B.model)
            return status == 200

        await eventually_async(b_serves, timeout=60, what="model B serving")

        async def gpu_idle() -> bool:
            lease = coordination.read_namespaced_lease(lease_name, "rota-system")
            states = [await sim_state(session, e) for e in (a, b)]
            return (lease.metadata.annotations.get(naming.STATE) == naming.STATE_IDLE
                    and not lease.spec.holder_identity
                    and all(s["sleeping"] for s in states))

        await eventually_async(gpu_idle, timeout=30, what="the idle holder put to sleep")
        status, body = await activate(session, url, MODEL_B.model)
        assert status == 200, body
        assert body["switched"] is True
        assert await ask_seven(session, body["endpoint"], MODEL_B.model) == "7"
