"""What ``GET /v1/state`` says a switch to each claimant is expected to cost: the costs the
worker measured itself per claim (the holder's sleep and drain, the target's wake and
probe, from ``SwitchResult.timings``), its place in the GPU's queue, and the wait that
adds up to. A gateway puts these in its held requests' headers and ``Retry-After``.

The server runs on a real :class:`~controller.lease.gpu.GpuWorker` (its loop not running, so what
is queued stays queued); real HTTP, the contract's model reads the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.credentials import ApiKeys
from controller.lease.activation import make_app
from controller.lease.gpu import Activation
from controller.lease.node import NodeController
from controller.lease.switch import SwitchResult
from e2e.harness.waiting import eventually_async
from rota.api import naming
from rota.api.activation import STATE_PATH, ClaimantState, StateAnswer
from rota.api.gpu_lease import GpuLease
from tests.controller.activation_kit import CLAIM, RoutingNode, claimant_b, make_worker

pytestmark = pytest.mark.controller

HOLDER = "ns/claim-a"
BOUND_S = 10.0


def _other(name: str) -> Any:
    b = claimant_b()
    return dataclasses.replace(b, claim_uid=f"uid-{name}", claim_name=name,
                               model=f"org/{name}", pod_name=f"pod-{name}")


@pytest.fixture
async def rig() -> AsyncIterator[tuple[RoutingNode, TestClient[Any, Any]]]:
    claimant = claimant_b()
    node = RoutingNode(make_worker(claimant), claimant)
    node.worker.lease = GpuLease(name="gpu-lease", node="node-a", device="gpu-0",
                                 holder=HOLDER, state=naming.STATE_AWAKE, fence=3)
    app = make_app(cast(NodeController, node), callers=ApiKeys(None))
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield node, client
    finally:
        await client.close()


async def _claimant(client: TestClient[Any, Any]) -> ClaimantState:
    async with client.get(STATE_PATH) as resp:
        assert resp.status == 200
        state = StateAnswer.model_validate(await resp.json())
    return next(c for c in state.claimants if c.claim == CLAIM)


async def test_the_expected_switch_is_what_the_worker_measured(
        rig: tuple[RoutingNode, TestClient[Any, Any]]) -> None:
    node, client = rig
    holder = _other("claim-a")
    lease = node.worker.lease
    assert lease is not None
    # B's earlier switch in (wake and probe), then A's switch in, away from B (B's sleep
    # and the drain are A's now: A is the holder a switch to B puts to sleep).
    node.worker._measured(SwitchResult(True, lease, timings={
        "wake_call": 7.5, "probe_ttft": 0.5}), None, node.claimant)
    node.worker._measured(SwitchResult(True, lease, timings={
        "later_sleep": 1.25, "drain": 0.75, "wake_call": 3.0}), holder, node.claimant)
    state = await _claimant(client)
    assert state.expected_switch_s == pytest.approx(1.25 + 0.75 + 3.0 + 0.5)
    assert state.queue_position == 0
    assert state.expected_wait_s == state.expected_switch_s


async def test_an_unmeasured_claim_is_expected_at_the_policys_defaults(
        rig: tuple[RoutingNode, TestClient[Any, Any]]) -> None:
    _, client = rig
    state = await _claimant(client)
    assert state.expected_switch_s == pytest.approx(0.5 + 0.6 + 0.1)


async def test_the_awake_holder_expects_no_switch(
        rig: tuple[RoutingNode, TestClient[Any, Any]]) -> None:
    node, client = rig
    node.worker.lease = GpuLease(name="gpu-lease", node="node-a", device="gpu-0",
                                 holder=CLAIM, state=naming.STATE_AWAKE, fence=4)
    state = await _claimant(client)
    assert (state.expected_switch_s, state.queue_position, state.expected_wait_s) == (
        0.0, 0, 0.0)


async def test_a_claimant_queued_ahead_adds_its_switch_to_the_wait(
        rig: tuple[RoutingNode, TestClient[Any, Any]]) -> None:
    node, client = rig
    worker = node.worker
    ahead = _other("claim-c")
    worker._accepting = True
    calls: list[asyncio.Task[Activation]] = [
        asyncio.ensure_future(worker.activate(ahead)),
        asyncio.ensure_future(worker.activate(node.claimant))]
    try:
        async def both_queued() -> bool:
            return worker.pending() == 2

        await eventually_async(both_queued, timeout=BOUND_S, interval=0.001,
                               what="both activations queued")
        state = await _claimant(client)
        assert state.queue_position == 1
        # A sleeps for C (0.5) + C wakes (0.6 + 0.1), C sleeps for B (0.5) + B wakes.
        assert state.expected_wait_s == pytest.approx(1.2 + 1.2)
        assert state.expected_switch_s == pytest.approx(1.2)
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


def test_an_earlier_controllers_claimant_reads_without_the_new_fields() -> None:
    old = ClaimantState.model_validate({"claim": CLAIM, "model": "m", "device": "gpu-0",
                                        "gpu": "gpu-0", "serving": True, "later": 1})
    assert old.expected_switch_s is None
    assert old.queue_position is None


async def test_a_claimant_whose_own_switch_is_in_flight_is_first_and_expects_its_own_switch(
        rig: tuple[RoutingNode, TestClient[Any, Any]]) -> None:
    """The worker has taken the claimant's switch off its queue and runs it (the Lease
    still names the old holder): the claimant is next, not behind a switch to someone
    else, and its wait is its own switch."""
    node, client = rig
    worker = node.worker
    worker._switching, worker._switching_to = True, node.claimant.claim_uid
    state = await _claimant(client)
    assert state.queue_position == 0
    assert state.expected_switch_s == pytest.approx(0.5 + 0.6 + 0.1)
    assert state.expected_wait_s == state.expected_switch_s
