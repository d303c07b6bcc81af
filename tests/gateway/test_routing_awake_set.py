"""Routing with an awake set: every engine a GPU Lease names awake (the holder of an
``awake`` Lease, and the engines awake beside it, ``gpu.rota.dev/awake-with``) is routed to;
the companions also while a switch they are not part of runs. A Lease without companions
routes as one-awake always did (each case is checked that way too)."""

from __future__ import annotations

from typing import Any

import pytest

from controller.gateway.binding import ModelBinding
from controller.gateway.routing import Action, RoutingState
from rota.api import naming
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease, pod_obj

pytestmark = pytest.mark.gateway

A, B, C = "org/a", "org/b", "org/c"
URL = "http://10.0.0.9:8085"
GPU = "node-1/gpu-0"


def _state(*leases: dict[str, Any]) -> RoutingState:
    """Three engines on one GPU: ``ca`` (A), ``cb`` (B), ``cc`` (C)."""
    state = RoutingState(binding=ModelBinding(namespaces=("engines",)), clock=lambda: 100.0)
    state.replace("claim", [claim_obj("ca", model=A, port=8000, pod_uid="pa"),
                            claim_obj("cb", model=B, port=8001, pod_uid="pb"),
                            claim_obj("cc", model=C, port=8002, pod_uid="pc")])
    state.replace("pod", [pod_obj("pod-ca", uid="pa", ip="10.1.0.1"),
                          pod_obj("pod-cb", uid="pb", ip="10.1.0.2"),
                          pod_obj("pod-cc", uid="pc", ip="10.1.0.3")])
    state.replace("lease", [*leases, controller_lease(URL + "/")])
    state.mark_synced()
    return state


def _lease(**changes: Any) -> dict[str, Any]:
    """A awake (holder) under fence 4; ``awake_with`` names its companions."""
    values: dict[str, Any] = {"holder": "engines/ca", "state": naming.STATE_AWAKE,
                              "model": A, "fence": 4}
    return gpu_lease(**(values | changes))


B_BESIDE = [("engines/cb", B)]


def test_every_member_of_the_awake_set_is_forwarded_to_its_own_pod() -> None:
    state = _state(_lease(awake_with=B_BESIDE))
    a, b = state.decide(A), state.decide(B)
    assert (a.action, a.endpoint, a.fence) == (Action.FORWARD, "http://10.1.0.1:8000", 4)
    assert (b.action, b.endpoint, b.claim, b.claim_uid, b.fence) == (
        Action.FORWARD, "http://10.1.0.2:8001", "engines/cb", "uid-cb", 4)
    assert state.decide(C).action is Action.ACTIVATE
    assert state.awake(B)


def test_without_companions_only_the_holder_is_forwarded() -> None:
    state = _state(_lease())
    assert state.decide(A).action is Action.FORWARD
    assert state.decide(B).action is Action.ACTIVATE
    assert not state.awake(B)


def test_a_namesake_of_a_companion_is_not_routed_to() -> None:
    """The companion is named by ref and uid: a claim deleted and created again under the
    same name is another engine, which the Lease does not name."""
    lease = _lease()
    lease["metadata"]["annotations"][naming.AWAKE_WITH] = (
        '[{"claim":"engines/cb","uid":"uid-an-older-cb","model":"org/b"}]')
    state = _state(lease)
    assert state.decide(B).action is Action.ACTIVATE
    lease["metadata"]["annotations"][naming.AWAKE_WITH] = (
        '[{"claim":"engines/other","uid":"uid-cb","model":"org/b"}]')
    state.apply("lease", "MODIFIED", lease)
    assert state.decide(B).action is Action.ACTIVATE


def test_a_companion_is_routed_to_while_a_switch_beside_it_runs() -> None:
    """A switch from A to C that leaves B awake: B is forwarded, A and C are held."""
    state = _state(_lease(state=naming.STATE_SWITCHING, target=C, draining=A, fence=5,
                          awake_with=B_BESIDE))
    assert (state.decide(B).action, state.decide(B).fence) == (Action.FORWARD, 5)
    assert (state.decide(A).action, state.decide(A).reason) == (Action.WAIT, "draining")
    assert (state.decide(C).action, state.decide(C).reason) == (Action.WAIT, "switching")
    # One-awake: the same switch holds both, and B sleeps.
    state.apply("lease", "MODIFIED", _lease(state=naming.STATE_SWITCHING, target=C,
                                            draining=A, fence=5))
    assert state.decide(B).action is Action.ACTIVATE
    assert state.decide(A).action is Action.WAIT


def test_companions_stay_routable_in_a_starting_or_failed_lease() -> None:
    state = _state(_lease(state=naming.STATE_STARTING, target=C, fence=5,
                          awake_with=B_BESIDE))
    assert state.decide(B).action is Action.FORWARD
    assert state.decide(A).action is not Action.FORWARD, "the holder of a start is asleep"
    state.apply("lease", "MODIFIED", gpu_lease(holder=None, state=naming.STATE_FAILED,
                                               target=C, fence=6, last_error="gpu_oom: x",
                                               awake_with=B_BESIDE))
    assert state.decide(B).action is Action.FORWARD
    assert state.decide(A).action is Action.ACTIVATE


def test_an_unreadable_awake_set_routes_nobody() -> None:
    lease = _lease()
    lease["metadata"]["annotations"][naming.AWAKE_WITH] = "not json"
    state = _state(lease)
    assert all(state.decide(m).action is not Action.FORWARD for m in (A, B, C))


def test_a_companions_request_survives_switches_that_leave_it_awake() -> None:
    """Forwarded to B under fence 4: switches beside B raise the fence without putting B
    to sleep, so the request is neither refused before sending nor counted as put to
    sleep; only the Lease that settles without B is."""
    state = _state(_lease(awake_with=B_BESIDE))
    decision = state.decide(B)
    # A switch from A to C opens; B stays awake beside it.
    state.apply("lease", "MODIFIED", _lease(state=naming.STATE_SWITCHING, target=C,
                                            draining=A, fence=5, awake_with=B_BESIDE))
    assert state.still_holds(decision)
    assert state.lost(decision) is None
    # It settles with C the holder, B still beside it.
    state.apply("lease", "MODIFIED", _lease(holder="engines/cc", model=C, fence=5,
                                            awake_with=B_BESIDE))
    assert state.still_holds(decision)
    assert state.lost(decision) is None
    # A switch that displaces B: B leaves the set in the opening write; while it runs
    # B's request is held like a drained holder's, not yet lost.
    state.apply("lease", "MODIFIED", _lease(holder="engines/cc", model=C, fence=6,
                                            state=naming.STATE_SWITCHING, target=A,
                                            draining=B, awake_with=[("engines/cc", C)]))
    assert not state.still_holds(decision)
    assert state.lost(decision) is None
    assert (state.decide(B).action, state.decide(B).reason) == (Action.WAIT, "draining")
    # Settled without B: put to sleep under the request.
    state.apply("lease", "MODIFIED", _lease(fence=6, awake_with=[("engines/cc", C)]))
    assert state.lost(decision) == "put_to_sleep"
    # Woken back into the set: served again.
    state.apply("lease", "MODIFIED", _lease(fence=7, awake_with=[("engines/cc", C),
                                                                 ("engines/cb", B)]))
    assert state.lost(decision) is None
    assert state.still_holds(decision)


def test_the_holder_stays_awake_through_a_switch_as_a_companion() -> None:
    """A switch that does not put the holder to sleep lists it among the companions in
    its opening write: its requests go on and are not counted as put to sleep."""
    state = _state(_lease())
    decision = state.decide(A)
    state.apply("lease", "MODIFIED", _lease(state=naming.STATE_SWITCHING, target=C,
                                            fence=5, awake_with=[("engines/ca", A)]))
    assert state.decide(A).action is Action.FORWARD
    assert state.still_holds(decision)
    state.apply("lease", "MODIFIED", _lease(holder="engines/cc", model=C, fence=5,
                                            awake_with=[("engines/ca", A)]))
    assert state.lost(decision) is None
    assert state.decide(A).action is Action.FORWARD


def test_one_awake_a_new_fence_still_refuses_before_sending() -> None:
    """Without companions nothing changed: the holder under a later fence (a new term) is
    not sent a request decided under the old one, and a settled switch elsewhere puts it
    to sleep."""
    state = _state(_lease())
    decision = state.decide(A)
    state.apply("lease", "MODIFIED", _lease(fence=5))
    assert not state.still_holds(decision)
    assert state.lost(decision) is None
    state.apply("lease", "MODIFIED", _lease(holder="engines/cc", model=C, fence=6))
    assert state.lost(decision) == "put_to_sleep"


def test_model_infos_show_each_awake_set() -> None:
    state = _state(_lease(awake_with=B_BESIDE))
    infos = {i.model: i for i in state.model_infos()}
    assert {m: i.state for m, i in infos.items()} == {A: "awake", B: "awake", C: "asleep"}
    assert (infos[A].awake_on, infos[A].awake_with) == ((GPU,), (B,))
    assert (infos[B].awake_on, infos[B].awake_with) == ((GPU,), (A,))
    assert (infos[C].awake_on, infos[C].awake_with) == ((), ())
    # During a switch beside it, B alone is awake; A and C are switching.
    state.apply("lease", "MODIFIED", _lease(state=naming.STATE_SWITCHING, target=C,
                                            draining=A, fence=5, awake_with=B_BESIDE))
    infos = {i.model: i for i in state.model_infos()}
    assert {m: i.state for m, i in infos.items()} == {
        A: "switching", B: "awake", C: "switching"}
    assert (infos[B].awake_on, infos[B].awake_with) == ((GPU,), ())


def test_model_infos_of_one_awake() -> None:
    state = _state(_lease())
    infos = {i.model: i for i in state.model_infos()}
    assert {m: i.state for m, i in infos.items()} == {A: "awake", B: "asleep", C: "asleep"}
    assert (infos[A].awake_on, infos[A].awake_with) == ((GPU,), ())
    assert infos[B].awake_on == ()
