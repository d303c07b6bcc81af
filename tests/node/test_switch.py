"""rota at work on the real node, every part a real pod: a request through the gateway for
the sleeping model makes the node's lease controller switch the GPU to it."""

from __future__ import annotations

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.rota_node import RotaOnNodes
from e2e.harness.scenario import ask_seven
from e2e.harness.waiting import WaitTimeout, eventually, eventually_async
from rota.api import naming
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]


def _holder(api: client.ApiClient, node: str) -> tuple[str, str]:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(
        naming.gpu_lease_name(node, "gpu-0"), "rota-system")
    annotations = lease.metadata.annotations or {}
    return lease.spec.holder_identity or "", annotations.get(naming.HOLDER_MODEL, "")


async def test_a_request_for_the_sleeping_model_switches_the_gpu(
        kube_api: client.ApiClient, rota_node: RotaOnNodes, namespace: str) -> None:
    node = rota_node.node().name
    engines = rota_node.deploy_engines(namespace)
    models = {e.model for e in engines}
    gateway = rota_node.gateway_url()

    async def answered(model: str) -> str:
        async with aiohttp.ClientSession() as session:
            return await ask_seven(session, gateway, model)

    def ours() -> tuple[str, str] | None:
        found = _holder(kube_api, node)
        return found if found[0].startswith(f"{namespace}/") else None

    try:
        holder = eventually(ours, timeout=60,
                            what="the controller holding the GPU for one engine")
    except WaitTimeout:
        # An engine of an earlier test (its namespace still terminating) may hold the GPU
        # still: a request for one of ours makes it the holder first.
        first = sorted(models)[0]
        await eventually_async(lambda: answered(first), timeout=180, max_interval=3.0,
                               what=f"an answer from {first} through the gateway")
        holder = eventually(ours, timeout=60, what=f"{first} holding the GPU")
    assert holder is not None
    (asleep,) = models - {holder[1]}

    # The gateway re-reads its model binding and watches claims; the first request may
    # come before it routes the new namespace.
    answer = await eventually_async(lambda: answered(asleep), timeout=180, max_interval=3.0,
                                    what=f"an answer from {asleep} through the gateway")
    assert answer.strip() == "7"
    assert _holder(kube_api, node)[1] == asleep
