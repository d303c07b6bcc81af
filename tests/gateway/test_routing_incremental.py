"""The routing state is updated in place: what one watch event or one request costs does
not grow with the fleet (issue 22).

Costs are counted, never timed: claim parses (calls of the engine-config parser), claimants
rebuilt (claims handed to ``claimants_from``), and which controller Leases a request asks
about.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest

from controller import claimants
from controller.gateway import routing
from controller.gateway.binding import ModelBinding
from controller.gateway.routing import Action, RoutingState
from rota.api import naming
from rota.api.controller_lease import ControllerLease, LeaseObserver
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease, pod_obj

pytestmark = pytest.mark.gateway

NODES = 20
BOUND = ModelBinding(namespaces=("engines",))


def _model(node: int) -> str:
    return f"org/model-{node}"


def _ctl(node: int, version: int) -> dict[str, Any]:
    """node-<i>'s controller Lease at its ``version``-th renewal, as its election writes it."""
    return ControllerLease(
        name=naming.controller_lease_name(f"node-{node}"), node=f"node-{node}",
        node_label=f"node-{node}", holder=f"ctl-{node}", instance=f"i-{node}",
        activation_url=f"http://10.0.{node}.1:8085",
        renew_time=dt.datetime(2026, 12, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=5 * version),
        duration_s=15.0, resource_version=str(version)).body("rota-system")


def _awake(node: int, **changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"holder": f"engines/c{node}", "state": naming.STATE_AWAKE,
                              "model": _model(node), "fence": 1, "node": f"node-{node}"}
    return gpu_lease(**(values | changes))


def _world(clock: Callable[[], float] = lambda: 100.0) -> RoutingState:
    """One claimant per node (model-<i> on node-<i>/gpu-0), each GPU awake, every
    controller alive."""
    state = RoutingState(binding=BOUND, clock=clock)
    state.replace("claim", [claim_obj(f"c{i}", model=_model(i), port=8000, pod_uid=f"p{i}",
                                      node=f"node-{i}") for i in range(NODES)])
    state.replace("pod", [pod_obj(f"pod-c{i}", uid=f"p{i}", ip=f"10.1.{i}.1")
                          for i in range(NODES)])
    state.replace("lease", [*(_awake(i) for i in range(NODES)),
                            *(_ctl(i, 1) for i in range(NODES))])
    state.mark_synced()
    for i in range(NODES):
        assert state.decide(_model(i)).action is Action.FORWARD
    return state


class Counts:
    """Claim parses and claimant rebuilds, counted around the real functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.parses = 0
        self.rebuilt = 0
        parse = getattr(claimants, "engine_config_of")  # noqa: B009 (not exported)
        build = getattr(routing, "claimants_from")  # noqa: B009

        def counting_parse(claim: Mapping[str, Any], *, driver: str) -> Any:
            self.parses += 1
            return parse(claim, driver=driver)

        def counting_build(claims: Iterable[Mapping[str, Any]], *args: Any,
                           **kwargs: Any) -> list[claimants.Claimant]:
            listed = list(claims)
            self.rebuilt += len(listed)
            built: list[claimants.Claimant] = build(listed, *args, **kwargs)
            return built

        monkeypatch.setattr(claimants, "engine_config_of", counting_parse)
        monkeypatch.setattr(routing, "claimants_from", counting_build)


def _routes_everything(state: RoutingState) -> None:
    for i in range(NODES):
        assert state.decide(_model(i)).action is Action.FORWARD


def test_a_controller_lease_renewal_rebuilds_no_claimant(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    state = _world()
    counts = Counts(monkeypatch)
    version = state.version
    for round_ in range(2, 5):
        for i in range(NODES):
            state.apply("lease", "MODIFIED", _ctl(i, round_))
            assert state.decide(_model(i)).action is Action.FORWARD
    assert (counts.parses, counts.rebuilt) == (0, 0)
    assert state.version == version, "a renewal changes no routing decision"


def test_a_gpu_lease_event_reparses_no_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _world()
    counts = Counts(monkeypatch)
    state.apply("lease", "MODIFIED", _awake(3, state=naming.STATE_SWITCHING, fence=2,
                                            draining=_model(3), target="org/other"))
    assert state.decide(_model(3)).action is Action.WAIT
    for i in (i for i in range(NODES) if i != 3):
        assert state.decide(_model(i)).action is Action.FORWARD
    assert (counts.parses, counts.rebuilt) == (0, 0)


def test_a_claim_or_pod_event_rebuilds_one_claimant(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _world()
    counts = Counts(monkeypatch)
    state.apply("claim", "MODIFIED", claim_obj("c5", model="org/renamed", port=8000,
                                               pod_uid="p5", node="node-5"))
    assert state.knows("org/renamed")
    assert not state.knows(_model(5))
    assert (counts.parses, counts.rebuilt) == (1, 1)
    state.apply("pod", "MODIFIED", pod_obj("pod-c7", uid="p7", ip="10.1.7.1", ready=False))
    assert state.decide(_model(7)).action is not Action.FORWARD
    assert counts.rebuilt == 2
    for i in (i for i in range(NODES) if i not in (5, 7)):
        assert state.decide(_model(i)).action is Action.FORWARD
    assert counts.rebuilt == 2


def test_an_event_that_changes_nothing_routing_reads_costs_no_rebuild(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller's visible state (a condition on the claim, a label on the pod) and a
    relist of what is already known."""
    state = _world()
    counts = Counts(monkeypatch)
    version = state.version
    claim = claim_obj("c2", model=_model(2), port=8000, pod_uid="p2", node="node-2")
    claim["metadata"] |= {"resourceVersion": "99", "managedFields": [{"manager": "x"}]}
    claim["status"]["devices"] = [{"driver": "gpu.rota.dev", "pool": "node-2",
                                   "device": "gpu-0", "conditions": [{"type": "Ready"}]}]
    state.apply("claim", "MODIFIED", claim)
    pod = pod_obj("pod-c2", uid="p2", ip="10.1.2.1")
    pod["metadata"]["labels"] = {"gpu.rota.dev/state": "awake"}
    state.apply("pod", "MODIFIED", pod)
    state.replace("pod", [pod_obj(f"pod-c{i}", uid=f"p{i}", ip=f"10.1.{i}.1")
                          for i in range(NODES)])
    _routes_everything(state)
    assert (counts.parses, counts.rebuilt) == (0, 0)
    assert state.version == version


async def test_a_held_request_is_woken_only_by_a_change_to_its_own_model() -> None:
    state = _world()
    a, b = _model(1), _model(2)
    waiter = asyncio.create_task(state.wait_changed(state.model_version(a), 10.0, model=a))
    await asyncio.sleep(0)
    state.apply("lease", "MODIFIED", _awake(2, state=naming.STATE_SWITCHING, fence=2,
                                            draining=b, target="org/other"))
    state.apply("pod", "MODIFIED", pod_obj("pod-c2", uid="p2", ip="10.1.2.9"))
    state.apply("lease", "MODIFIED", _ctl(2, 7))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiter.done(), f"woken by changes to {b}"
    state.apply("lease", "MODIFIED", _awake(1, state=naming.STATE_SWITCHING, fence=2,
                                            draining=a, target="org/other"))
    async with asyncio.timeout(5):
        assert await waiter
    # Without a model, any change wakes (what the source and the start-up wait use).
    anything = asyncio.create_task(state.wait_changed(state.version, 10.0))
    await asyncio.sleep(0)
    state.apply("lease", "MODIFIED", _awake(2, fence=3))
    async with asyncio.timeout(5):
        assert await anything


async def test_a_controller_running_out_wakes_the_models_of_its_node() -> None:
    now = [100.0]
    state = _world(clock=lambda: now[0])
    a, b = _model(1), _model(2)
    since_a, since_b = state.model_version(a), state.model_version(b)
    for i in range(NODES):
        if i != 1:
            now[0] = 110.0
            state.apply("lease", "MODIFIED", _ctl(i, 2))
    now[0] = 116.0  # node-1 renewed last at 100 (15 s): gone; the others renewed at 110
    assert await state.wait_changed(since_a, 5.0, model=a)
    assert not await state.wait_changed(since_b, 0.01, model=b)
    assert (state.decide(a).action, state.decide(a).reason) == (Action.WAIT, "no_controller")
    assert state.decide(b).action is Action.FORWARD


async def test_a_request_asks_only_about_its_own_nodes_controller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = _world()
    asked: set[str] = set()
    fresh, expires_at, get = LeaseObserver.fresh, LeaseObserver.expires_at, LeaseObserver.get

    def spy_fresh(self: LeaseObserver, name: str, now: float) -> bool:
        asked.add(name)
        return fresh(self, name, now)

    def spy_expires(self: LeaseObserver, name: str) -> float | None:
        asked.add(name)
        return expires_at(self, name)

    def spy_get(self: LeaseObserver, name: str) -> Any:
        asked.add(name)
        return get(self, name)

    monkeypatch.setattr(LeaseObserver, "fresh", spy_fresh)
    monkeypatch.setattr(LeaseObserver, "expires_at", spy_expires)
    monkeypatch.setattr(LeaseObserver, "get", spy_get)
    decision = state.decide(_model(4))
    assert decision.action is Action.FORWARD
    assert state.still_holds(decision)
    watcher = asyncio.create_task(state.wait_lost(decision))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not watcher.done()
    state.apply("lease", "MODIFIED", _awake(4, holder="engines/c9", holder_uid="uid-c9",
                                            model=_model(9), fence=2))
    async with asyncio.timeout(5):
        assert await watcher == "put_to_sleep"
    assert asked <= {naming.controller_lease_name("node-4")}


def test_a_gang_is_awake_only_while_every_lease_names_it_after_updates() -> None:
    tp = claim_obj("tp", model="org/tp", port=8000, pod_uid="ptp")
    results = tp["status"]["allocation"]["devices"]["results"]
    results.append(dict(results[0], device="gpu-1"))
    state = RoutingState(binding=BOUND, clock=lambda: 100.0)
    state.replace("claim", [tp])
    state.replace("pod", [pod_obj("pod-tp", uid="ptp", ip="10.1.0.1")])
    holds: dict[str, Any] = {"holder": "engines/tp", "state": naming.STATE_AWAKE, "model": "org/tp"}
    state.replace("lease", [gpu_lease(**holds, device="gpu-0"),
                            controller_lease("http://10.0.0.9:8085/")])
    state.mark_synced()
    assert state.decide("org/tp").action is not Action.FORWARD
    state.apply("lease", "ADDED", gpu_lease(**holds, device="gpu-1"))
    assert state.decide("org/tp").action is Action.FORWARD
    state.apply("lease", "MODIFIED", gpu_lease(holder="engines/x", holder_uid="uid-x",
                                               state=naming.STATE_AWAKE, device="gpu-1"))
    assert state.decide("org/tp").action is not Action.FORWARD
    state.apply("lease", "DELETED", gpu_lease(**holds, device="gpu-1"))
    assert state.decide("org/tp").action is not Action.FORWARD


def test_a_slim_claim_keeps_what_routing_reads_only() -> None:
    from controller.gateway.lease_view import slim_claim

    claim = claim_obj("c1", model="org/m", port=8000, pod_uid="p1")
    claim["metadata"] |= {"managedFields": [{"manager": "kube-scheduler"}],
                          "resourceVersion": "7", "labels": {"x": "y"}}
    claim["status"]["devices"] = [{"conditions": [{"type": "Ready"}]}]
    slim = slim_claim(claim)
    assert "managedFields" not in slim["metadata"]
    assert "devices" not in slim["status"]
    assert claimants.claimants_from([slim], {}) == claimants.claimants_from([claim], {})


def test_a_lease_that_stops_being_a_gpu_lease_stops_routing() -> None:
    """A GPU Lease modified so that it no longer is one (its kind label gone) is dropped:
    its holder gets no traffic from it any more (the rebuild-everything state dropped it;
    an in-place entry must be dropped too)."""
    state = _world()
    lease = _awake(3)
    labels = lease["metadata"]["labels"]
    del labels[naming.LABEL_KIND]
    state.apply("lease", "MODIFIED", lease)
    assert state.decide(_model(3)).action is not Action.FORWARD
    assert state.decide(_model(4)).action is Action.FORWARD
