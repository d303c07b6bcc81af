"""The routing state, fed directly: what a request for each model does in each Lease state."""

from __future__ import annotations

import asyncio

import pytest

from controller import naming
from controller.gateway.routing import Action, RoutingState
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease, pod_obj

pytestmark = pytest.mark.gateway

A, B = "org/a", "org/b"
URL = "http://10.0.0.9:8085"


def _state(*, lease: dict[str, object] | None = None, with_controller: bool = True,
           synced: bool = True) -> RoutingState:
    state = RoutingState()
    state.replace("claim", [claim_obj("ca", model=A, port=8000, pod_uid="pa"),
                            claim_obj("cb", model=B, port=8001, pod_uid="pb")])
    state.replace("pod", [pod_obj("pod-ca", uid="pa", ip="10.1.0.1"),
                          pod_obj("pod-cb", uid="pb", ip="10.1.0.2")])
    leases = [lease] if lease else []
    if with_controller:
        leases.append(controller_lease(URL + "/"))
    state.replace("lease", leases)
    if synced:
        state.mark_synced()
    return state


def _a_awake(**changes: object) -> dict[str, object]:
    values: dict[str, object] = {"holder": "engines/ca", "state": naming.STATE_AWAKE,
                                 "model": A, "endpoint": "http://10.1.0.1:8000"}
    return gpu_lease(**(values | changes))  # type: ignore[arg-type]


def test_the_awake_model_is_forwarded_to_the_leases_endpoint() -> None:
    state = _state(lease=_a_awake(endpoint="http://10.1.0.1:9999"))
    decision = state.decide(A)
    assert decision.action is Action.FORWARD
    assert decision.endpoint == "http://10.1.0.1:9999"
    assert decision.claim == "engines/ca"


def test_a_sleeping_model_is_activated_through_its_nodes_controller() -> None:
    state = _state(lease=_a_awake())
    decision = state.decide(B)
    assert decision.action is Action.ACTIVATE
    assert (decision.claim, decision.activation_url) == ("engines/cb", URL)


def test_during_a_switch_both_models_wait() -> None:
    state = _state(lease=_a_awake(state=naming.STATE_SWITCHING, target=B, draining=A))
    assert state.decide(A).action is Action.WAIT
    assert state.decide(A).reason == "draining"
    assert state.decide(B).action is Action.WAIT
    assert {i.model: i.state for i in state.model_infos()} == {A: "switching", B: "switching"}


def test_unknown_models_and_not_yet_synced() -> None:
    assert _state(synced=False).decide("nope").reason == "not_ready"
    assert _state().decide("nope").action is Action.UNKNOWN


def test_without_a_controller_lease_nothing_can_wake_a_model() -> None:
    decision = _state(lease=_a_awake(), with_controller=False).decide(B)
    assert (decision.action, decision.reason) == (Action.UNAVAILABLE, "no_controller")


def test_a_stale_holder_claim_uid_is_not_routed_to() -> None:
    state = _state(lease=_a_awake())
    lease = _a_awake()
    lease["metadata"]["annotations"][naming.HOLDER_CLAIM_UID] = "some-older-claim"  # type: ignore[index]
    state.apply("lease", "MODIFIED", lease)
    assert state.decide(A).action is Action.ACTIVATE


def test_model_states_and_failures() -> None:
    state = _state(lease=_a_awake())
    assert {i.model: i.state for i in state.model_infos()} == {A: "awake", B: "asleep"}
    state.apply("lease", "MODIFIED", gpu_lease(holder=None, state=naming.STATE_FAILED,
                                               target=B, last_error="gpu_oom: no room"))
    infos = {i.model: i for i in state.model_infos()}
    assert infos[B].state == "failed"
    assert infos[B].last_error == "gpu_oom: no room"
    assert infos[A].state == "asleep"
    assert infos[A].gpus == ("node-1/gpu-0",)


def test_claims_of_other_drivers_and_deleted_objects_are_dropped() -> None:
    state = _state(lease=_a_awake())
    other = claim_obj("cx", model="org/x", port=8000, pod_uid="px")
    other["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"
    state.apply("claim", "ADDED", other)
    assert not state.knows("org/x")
    state.apply("claim", "DELETED", claim_obj("cb", model=B, port=8001, pod_uid="pb"))
    assert state.models() == [A]
    assert state.claim_namespaces() == {"engines"}


def test_a_pod_not_ready_is_not_woken() -> None:
    state = _state(lease=_a_awake())
    state.apply("pod", "MODIFIED", pod_obj("pod-cb", uid="pb", ip="10.1.0.2", ready=False))
    decision = state.decide(B)
    assert (decision.action, decision.reason) == (Action.UNAVAILABLE, "no_serving_engine")


async def test_waiters_wake_on_change_and_time_out_without_one() -> None:
    state = _state()
    version = state.version
    assert not await state.wait_changed(version, 0.01)
    waiter = asyncio.create_task(state.wait_changed(version, 10))
    await asyncio.sleep(0)
    state.apply("lease", "ADDED", _a_awake())
    assert await waiter
    assert await state.wait_changed(version, 0)  # already changed: no wait at all
