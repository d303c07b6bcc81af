"""The routing state, fed directly: what a request for each model does in each Lease state."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.gateway.binding import ModelBinding
from controller.gateway.routing import Action, RoutingState
from rota.api import naming
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease, pod_obj

pytestmark = pytest.mark.gateway

A, B = "org/a", "org/b"
URL = "http://10.0.0.9:8085"
BOUND = ModelBinding(namespaces=("engines",))


class FakeClock:
    """The gateway's monotonic clock, moved by the test."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _state(*, lease: dict[str, Any] | None = None, with_controller: bool = True,
           synced: bool = True, binding: ModelBinding = BOUND,
           clock: FakeClock | None = None) -> RoutingState:
    state = RoutingState(binding=binding, clock=clock or FakeClock())
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


def _a_awake(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"holder": "engines/ca", "state": naming.STATE_AWAKE,
                              "model": A, "fence": 4}
    return gpu_lease(**(values | changes))


def test_the_awake_model_is_forwarded_to_its_pod_ip_never_the_leases_endpoint() -> None:
    state = _state(lease=_a_awake(endpoint="http://203.0.113.7:9999"))
    decision = state.decide(A)
    assert decision.action is Action.FORWARD
    assert decision.endpoint == "http://10.1.0.1:8000"
    assert (decision.claim, decision.claim_uid, decision.fence) == ("engines/ca", "uid-ca", 4)
    assert decision.gpu == "node-1/gpu-0"


def test_ipv6_pod_addresses_are_bracketed() -> None:
    state = _state(lease=_a_awake())
    state.apply("pod", "MODIFIED", pod_obj("pod-ca", uid="pa", ip="fd00:10:1::5"))
    assert state.decide(A).endpoint == "http://[fd00:10:1::5]:8000"
    state.apply("lease", "MODIFIED", controller_lease("http://fd00::9:8090"))
    assert state.decide(B).activation_url == "http://[fd00::9]:8090"


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


def test_without_a_controller_lease_nothing_is_routed_or_woken() -> None:
    """Requests wait (bounded) for a controller: one may be starting or rolling over."""
    state = _state(lease=_a_awake(), with_controller=False)
    for model in (A, B):
        assert (state.decide(model).action, state.decide(model).reason) == (
            Action.WAIT, "no_controller")


def test_a_stale_holder_claim_uid_is_not_routed_to() -> None:
    state = _state(lease=_a_awake(holder_uid="some-older-claim"))
    assert state.decide(A).action is Action.ACTIVATE
    state.apply("lease", "MODIFIED", _a_awake(holder_uid=""))
    assert state.decide(A).action is Action.ACTIVATE


def test_model_states_and_failures() -> None:
    state = _state(lease=_a_awake())
    assert {i.model: i.state for i in state.model_infos()} == {A: "awake", B: "asleep"}
    state.apply("lease", "MODIFIED", gpu_lease(holder=None, state=naming.STATE_FAILED,
                                               target=B, last_error="gpu_oom: no room"))
    infos = {i.model: i for i in state.model_infos()}
    assert infos[B].state == "failed"
    assert infos[B].last_error == "gpu_oom"
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


def test_shares_of_one_gpu_meet_in_one_lease() -> None:
    """Partitioned mode: claims allocated gpu-0-share-1 and gpu-0-share-2 of one GPU."""
    state = RoutingState(binding=BOUND)
    state.replace("claim", [
        claim_obj("ca", model=A, port=8000, pod_uid="pa", device="gpu-0-share-1"),
        claim_obj("cb", model=B, port=8001, pod_uid="pb", device="gpu-0-share-2")])
    state.replace("pod", [pod_obj("pod-ca", uid="pa", ip="10.1.0.1"),
                          pod_obj("pod-cb", uid="pb", ip="10.1.0.2")])
    state.replace("lease", [_a_awake(device="gpu-0"), controller_lease(URL)])
    state.mark_synced()
    assert state.decide(A).action is Action.FORWARD
    assert state.decide(B).action is Action.ACTIVATE
    assert {i.model: i.gpus for i in state.model_infos()} == {A: ("node-1/gpu-0",),
                                                              B: ("node-1/gpu-0",)}


def test_only_bound_namespaces_serve_a_model() -> None:
    binding = ModelBinding(namespaces=("team-*",), models={A: ("engines",)})
    state = _state(lease=_a_awake(), binding=binding)
    # A tenant in a namespace allowed for other models claims model A too.
    state.apply("claim", "ADDED", claim_obj("evil", model=A, port=8000, pod_uid="pe",
                                            namespace="team-x"))
    state.apply("pod", "ADDED", pod_obj("pod-evil", uid="pe", ip="10.9.9.9",
                                        namespace="team-x"))
    state.apply("lease", "MODIFIED", _a_awake())
    for _ in range(4):
        decision = state.decide(A)
        assert (decision.action, decision.claim) == (Action.FORWARD, "engines/ca")
    assert state.ignored_claimants == 2  # team-x/evil for A, engines/cb (B is not bound)
    assert state.models() == [A]
    # With no binding at all, nothing is served.
    assert _state(binding=ModelBinding()).decide(A).action is Action.UNKNOWN


def _stops_renewing(state: RoutingState, clock: FakeClock) -> None:
    """node-1's controller renews once more (a 15 s Lease), then never again: the
    gateway's clock moves past the duration without another change."""
    state.apply("lease", "MODIFIED", controller_lease(URL, duration_s=15))
    clock.now += 15.5


def test_a_stale_switch_does_not_hold_a_model_another_replica_can_serve() -> None:
    """M4: node-1 died mid-switch to B; B also has a claimant on healthy node-2."""
    clock = FakeClock()
    state = _state(lease=_a_awake(state=naming.STATE_SWITCHING, target=B, draining=A),
                   clock=clock)
    state.apply("claim", "ADDED", claim_obj("cb2", model=B, port=8001, pod_uid="pb2",
                                            node="node-2"))
    state.apply("pod", "ADDED", pod_obj("pod-cb2", uid="pb2", ip="10.2.0.2"))
    state.apply("lease", "ADDED", controller_lease("http://10.0.0.10:8090", node="node-2"))
    assert state.decide(B).action is Action.WAIT  # node-1's controller is alive: wait
    _stops_renewing(state, clock)
    decision = state.decide(B)
    assert (decision.action, decision.claim, decision.activation_url) == (
        Action.ACTIVATE, "engines/cb2", "http://10.0.0.10:8090")
    # With no other replica, a restarted controller may still finish the switch.
    state.apply("claim", "DELETED", claim_obj("cb2", model=B, port=8001, pod_uid="pb2"))
    assert (state.decide(B).action, state.decide(B).reason) == (Action.WAIT, "controller_lost")


def test_an_awake_lease_on_a_dead_node_or_not_ready_pod_gets_no_traffic() -> None:
    clock = FakeClock()
    state = _state(lease=_a_awake(), clock=clock)
    state.apply("pod", "MODIFIED", pod_obj("pod-ca", uid="pa", ip="10.1.0.1", ready=False))
    assert state.decide(A).action is not Action.FORWARD
    state.apply("pod", "MODIFIED", pod_obj("pod-ca", uid="pa", ip="10.1.0.1"))
    assert state.decide(A).action is Action.FORWARD
    _stops_renewing(state, clock)
    assert (state.decide(A).action, state.decide(A).reason) == (Action.WAIT, "no_controller")


async def test_a_controller_lease_running_out_wakes_waiters() -> None:
    clock = FakeClock()
    state = RoutingState(binding=BOUND, clock=clock)
    state.replace("claim", [claim_obj("ca", model=A, port=8000, pod_uid="pa")])
    state.replace("pod", [pod_obj("pod-ca", uid="pa", ip="10.1.0.1")])
    state.replace("lease", [_a_awake(), controller_lease(URL, duration_s=15)])
    state.mark_synced()
    assert state.decide(A).action is Action.FORWARD
    version = state.version
    clock.now += 60.0  # the clock passes the controller Lease's end without any event
    assert await state.wait_changed(version, 5.0)
    assert state.decide(A).action is Action.WAIT


def test_a_forwarded_request_is_lost_once_the_lease_settles_elsewhere() -> None:
    state = _state(lease=_a_awake())
    decision = state.decide(A)
    assert state.still_holds(decision)
    assert state.lost(decision) is None
    state.apply("lease", "MODIFIED", _a_awake(state=naming.STATE_SWITCHING, target=B,
                                              draining=A, fence=5))
    assert not state.still_holds(decision)
    assert state.lost(decision) is None  # draining: it may still finish
    state.apply("lease", "MODIFIED", _a_awake(holder="engines/cb", model=B, fence=5))
    assert state.lost(decision) == "put_to_sleep"
    # A switch that failed and gave the GPU back: the request is served after the wake.
    state.apply("lease", "MODIFIED", _a_awake(fence=5))
    assert state.lost(decision) is None


async def test_waiters_wake_on_change_and_time_out_without_one() -> None:
    state = _state()
    version = state.version
    assert not await state.wait_changed(version, 0.01)
    waiter = asyncio.create_task(state.wait_changed(version, 10))
    await asyncio.sleep(0)
    state.apply("lease", "ADDED", _a_awake())
    assert await waiter
    assert await state.wait_changed(version, 0)  # already changed: no wait at all
