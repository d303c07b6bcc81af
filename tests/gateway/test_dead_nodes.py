"""A node that died leaves Leases behind: they must not hold or steer traffic (review M4)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rota.api import naming
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    MODEL_B,
    NAMESPACE,
    Rig,
    RigFactory,
    Sim,
    claim_obj,
    controller_lease,
    pod_obj,
    start_controller,
    start_sim,
)

pytestmark = pytest.mark.gateway


def _node_1_dead(rig: Rig) -> None:
    """node-1's controller renewed its Lease (15 s) a last time and stopped (the node is
    gone): every replica's monotonic clock then stands 16 s later, with no change seen."""
    url = str(rig.gateway.server.make_url("")).rstrip("/")  # any address: never called
    rig.apply("lease", "MODIFIED", controller_lease(url, duration_s=15))
    later = time.monotonic() + 16.0
    for state in rig.states:
        state.clock = lambda: later


async def _replica_on_node_2(rig: Rig, model: str) -> Sim:
    """A second claimant of ``model`` on node-2, asleep, with node-2's own controller."""
    sim = await start_sim(model, f"{NAMESPACE}/claim-2")
    rig.closers.append(sim.client.close)
    async with sim.client.post("/sleep?level=1") as resp:
        assert resp.status == 200
    _, client = await start_controller({model: sim}, rig.states, node="node-2")
    rig.closers.append(client.close)
    rig.apply("claim", "ADDED", claim_obj("claim-2", model=model, port=sim.port,
                                          pod_uid="pod-2", node="node-2"))
    rig.apply("pod", "ADDED", pod_obj("pod-claim-2", uid="pod-2"))
    rig.apply("lease", "ADDED", controller_lease(str(client.make_url("")).rstrip("/"),
                                                 node="node-2"))
    return sim


async def test_a_stale_switch_does_not_hold_a_model_a_healthy_replica_can_serve(
        make_rig: RigFactory) -> None:
    rig = await make_rig(max_wait_s=DEADLINE / 2)
    second = await _replica_on_node_2(rig, MODEL_B)
    # node-1 died in the middle of a switch to B.
    rig.apply("lease", "MODIFIED", rig.controller.lease_now(
        state=naming.STATE_SWITCHING, target=MODEL_B, draining=MODEL_A, fence=3))
    _node_1_dead(rig)
    async with asyncio.timeout(DEADLINE):
        assert await rig.answer(MODEL_B) == "7"
    assert second.engine.generations_started == 1
    assert rig.controller.calls == 0  # node-1's controller is never asked


async def test_an_awake_engine_whose_pod_is_not_ready_gets_no_traffic(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    rig.apply("pod", "MODIFIED", pod_obj("pod-claim-a", uid="pod-a", ready=False))
    resp = await rig.chat(MODEL_A)
    assert resp.status == 503, await resp.text()
    assert (await resp.json())["error"]["code"] == "no_serving_engine"
    assert resp.headers["Retry-After"]
    assert rig.a.engine.generations_started == 0
    # A ready replica elsewhere is woken instead.
    second = await _replica_on_node_2(rig, MODEL_A)
    assert await rig.answer(MODEL_A) == "7"
    assert second.engine.generations_started == 1
    assert rig.a.engine.generations_started == 0


async def test_an_awake_engine_on_a_node_whose_controller_expired_gets_no_traffic(
        make_rig: RigFactory) -> None:
    rig = await make_rig(max_wait_s=1.0)
    _node_1_dead(rig)
    resp = await rig.chat(MODEL_A)  # waits for a controller to come back, bounded
    assert resp.status == 503, await resp.text()
    assert (await resp.json())["error"]["code"] == "no_controller"
    assert resp.headers["Retry-After"]
    assert rig.a.engine.generations_started == 0
