"""A switch nobody waits for is not made: a client that disconnects while its request
waits for a queued switch takes its place out of the gateway's activation call, the last
one to leave closes that call, the controller's handler is cancelled with it, and the GPU
worker's policy drops the switch (rule ``cancelled``) before any wake.

Everything is real and on real HTTP: the gateway app, the controller's activation API over
a running :class:`~controller.lease.gpu.GpuWorker` with its
:class:`~controller.lease.switch.Switcher`,
and two engine simulators (which count their wakes). The holder's minimum residency keeps
the switch queued while the client leaves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.credentials import ApiKeys
from controller.gateway import keys
from controller.gateway.app import make_app as make_gateway_app
from controller.gateway.routing import RoutingState, StaticSource
from controller.gateway.settings import GatewaySettings
from controller.lease import metrics
from controller.lease.activation import make_app as make_controller_app
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.node import NodeController
from e2e.harness.waiting import eventually_async
from rota.api import naming
from rota.api.gpu_lease import GpuLease, lease_body
from tests.controller.activation_kit import RoutingNode
from tests.controller.conftest import EngineSim, EngineSimFactory
from tests.controller.switch_kit import NODE, a_awake_b_asleep
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease, pod_obj

pytestmark = pytest.mark.controller

RESIDENCY_S = 3.0
"""How long the holder keeps the GPU: the switch to B stays queued that long."""
BOUND_S = 20.0


@dataclass
class Node:
    worker: GpuWorker
    a: EngineSim
    b: EngineSim
    gateway: TestClient[Any, Any]


def _cancelled() -> float:
    return metrics.REGISTRY.get_sample_value("rota_controller_policy_decisions_total",
                                             {"rule": "cancelled"}) or 0.0


@pytest.fixture
async def node(engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    kit, a, b = await a_awake_b_asleep(engine_sim_factory, engine_session)
    claim_a, claim_b = kit.claimants
    states: list[RoutingState] = []
    write = kit.lease.write

    async def publishing(lease: GpuLease) -> GpuLease:
        """Every write of the GPU Lease reaches the gateway, as its watch would."""
        stored = await write(lease)
        for state in states:
            state.apply("lease", "MODIFIED", lease_body(stored, "rota-system",
                                                        labels_node=NODE,
                                                        labels_device="gpu-0"))
        return stored

    monkeypatch.setattr(kit.lease, "write", publishing)
    kit.holding(claim_a)
    lease_port: Any = kit.lease
    worker = GpuWorker(gpu="gpu-0", lease_port=lease_port, switcher=kit.switcher,
                       claimants=lambda: kit.claimants, engine=kit.switcher.ports.engine,
                       policy=Policy(min_residency_s=RESIDENCY_S), clock=time.monotonic)
    stop = asyncio.Event()
    worker.open()
    running = asyncio.create_task(worker.run(stop))
    routing = RoutingNode(worker, claim_b)
    controller: TestClient[Any, Any] = TestClient(TestServer(
        make_controller_app(cast(NodeController, routing), callers=ApiKeys(None)),
        host="127.0.0.1", port=0))
    await controller.start_server()
    url = str(controller.make_url("")).rstrip("/")
    source = StaticSource(
        claims=[claim_obj(c.claim_name, model=c.model, port=c.port, pod_uid=str(c.pod_uid),
                          namespace=c.namespace, node=NODE, device="gpu-0")
                for c in kit.claimants],
        pods=[pod_obj(f"pod-{c.claim_name}", uid=str(c.pod_uid), namespace=c.namespace)
              for c in kit.claimants],
        leases=[gpu_lease(holder=claim_a.ref, state=naming.STATE_AWAKE, model=claim_a.model,
                          node=NODE, device="gpu-0", holder_uid=claim_a.claim_uid),
                controller_lease(url, node=NODE)])
    app = make_gateway_app(GatewaySettings(host="127.0.0.1", port=0, max_wait_s=BOUND_S,
                                           serving_namespaces=("ns",)),
                           routing_source=source)
    states.append(app[keys.STATE])
    gateway: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await gateway.start_server()

    async def synced() -> bool:
        return app[keys.STATE].synced

    await eventually_async(synced, timeout=BOUND_S, interval=0.01, what="the gateway synced")
    try:
        yield Node(worker, a, b, gateway)
    finally:
        await gateway.close()
        await controller.close()
        stop.set()
        await asyncio.wait_for(running, BOUND_S)


async def _ask_and_leave(node: Node, *, after_s: float) -> None:
    """A chat request for B whose client gives up (disconnects) after ``after_s``."""
    body = {"model": node.b.settings.model, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(after_s):
            await node.gateway.post("/v1/chat/completions", json=body)


async def _queued(node: Node, waiting: int) -> None:
    async def holds() -> bool:
        return sum(w.waiting() for w in node.worker._queue.values()) == waiting

    await eventually_async(holds, timeout=BOUND_S, interval=0.01,
                           what=f"{waiting} waiting in the worker's queue")


async def test_a_client_that_leaves_while_its_switch_is_queued_wakes_nothing(
        node: Node) -> None:
    before = _cancelled()
    await _ask_and_leave(node, after_s=0.5)
    # The controller saw its caller go: nobody waits in its queue any more ...
    await _queued(node, 0)

    async def dropped() -> bool:
        return _cancelled() > before

    # ... and once the holder's residency is over, the switch is dropped, not made.
    await eventually_async(dropped, timeout=BOUND_S, interval=0.02,
                           what="the switch dropped by the policy's cancelled rule")
    assert node.b.engine.wake_count == 0
    assert node.worker.lease is not None
    assert node.worker.lease.holder == "ns/a"


async def test_a_switch_someone_still_waits_for_is_made(node: Node) -> None:
    body = {"model": node.b.settings.model, "messages": [{"role": "user", "content": "hi"}]}
    staying = asyncio.ensure_future(node.gateway.post("/v1/chat/completions", json=body))
    await _queued(node, 1)
    await _ask_and_leave(node, after_s=0.5)
    async with asyncio.timeout(BOUND_S):
        resp = await staying
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Rota-Switched"] == "true"
    assert node.b.engine.wake_count == 1
