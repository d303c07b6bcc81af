"""The gateway judges a node's controller alive by when *it* saw the controller Lease
change, on its own monotonic clock: never by comparing the controller's ``renewTime`` (the
GPU node's wall clock) with its own (review R3).

The controller's wall clock is the gateway's plus a skew; the gateway's monotonic clock is
a number the test moves.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from controller.gateway.binding import ModelBinding
from controller.gateway.routing import Action, RoutingState
from rota.api import naming
from rota.api.controller_lease import ControllerLease
from tests.gateway.conftest import claim_obj, gpu_lease, pod_obj

pytestmark = pytest.mark.gateway

A, B = "org/a", "org/b"
URL = "http://10.0.0.9:8085"
BOUND = ModelBinding(namespaces=("engines",))
DURATION = 15.0
PERIOD = 5.0
"""The controller renews every third of its duration."""
START = 500.0
"""The gateway's monotonic clock when the test starts."""

SKEWS = [pytest.param(+10.0, id="gateway-10s-ahead"), pytest.param(-10.0, id="gateway-10s-behind")]


class FakeClock:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _controller(renew_time: dt.datetime, version: int) -> dict[str, Any]:
    """The node controller's Lease as its election writes it, at its ``version``-th write."""
    return ControllerLease(
        name=naming.controller_lease_name("node-1"), node="node-1", holder="ctl-a",
        instance="instance-a", activation_url=URL, renew_time=renew_time,
        duration_s=DURATION, resource_version=str(version)).body("rota-system")


def _state(clock: FakeClock | None = None) -> RoutingState:
    state = RoutingState(binding=BOUND) if clock is None else RoutingState(binding=BOUND,
                                                                           clock=clock)
    state.replace("claim", [claim_obj("ca", model=A, port=8000, pod_uid="pa"),
                            claim_obj("cb", model=B, port=8001, pod_uid="pb")])
    state.replace("pod", [pod_obj("pod-ca", uid="pa", ip="10.1.0.1"),
                          pod_obj("pod-cb", uid="pb", ip="10.1.0.2")])
    state.apply("lease", "ADDED", gpu_lease(holder="engines/ca", state=naming.STATE_AWAKE,
                                            model=A, fence=4))
    state.mark_synced()
    return state


def _routes(state: RoutingState) -> bool:
    """A goes to its awake engine and B can be woken through the node's controller."""
    a, b = state.decide(A), state.decide(B)
    return (a.action, a.endpoint, b.action, b.activation_url) == (
        Action.FORWARD, "http://10.1.0.1:8000", Action.ACTIVATE, URL)


@pytest.mark.parametrize("renewed_ago_s", [
    pytest.param(15.5, id="gateway-10s-ahead-renewal-5.5s-old"),
    pytest.param(3600.0, id="renewTime-an-hour-behind"),
    pytest.param(-3600.0, id="renewTime-an-hour-ahead")])
def test_a_renewal_just_seen_routes_whatever_its_renew_time_says(renewed_ago_s: float) -> None:
    """No time passes on the gateway's clock between the renewal and the request."""
    state = _state()
    stamped = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=renewed_ago_s)
    state.apply("lease", "ADDED", _controller(stamped, 1))
    assert _routes(state)


@pytest.mark.parametrize("gateway_ahead_s", SKEWS)
async def test_a_skewed_controller_is_alive_while_renewals_arrive_and_lost_once_they_stop(
        gateway_ahead_s: float) -> None:
    clock = FakeClock()
    state = _state(clock)
    gateway_wall = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)
    controller_wall = gateway_wall - dt.timedelta(seconds=gateway_ahead_s)
    renewals = 12
    for i in range(renewals):  # a minute of renewals, each 5 s after the last
        clock.now = START + PERIOD * i
        state.apply("lease", "MODIFIED",
                    _controller(controller_wall + dt.timedelta(seconds=PERIOD * i), i + 1))
        assert _routes(state), f"renewal {i}"
        clock.now += PERIOD + 0.5  # the next renewal is half a second late
        assert _routes(state), f"half a second before renewal {i + 1}"
    # The controller stops renewing (its node died).
    last = START + PERIOD * (renewals - 1)
    clock.now = last + DURATION
    assert _routes(state)
    version = state.version
    clock.now = last + DURATION + 0.5
    assert await state.wait_changed(version, 5.0)  # running out is a change: no wait
    assert (state.decide(A).action, state.decide(A).reason) == (Action.WAIT, "no_controller")
    assert (state.decide(B).action, state.decide(B).reason) == (Action.WAIT, "no_controller")
    assert {i.model: i.state for i in state.model_infos()} == {A: "asleep", B: "asleep"}
    # It comes back: the next renewal is a change, whatever its renewTime.
    state.apply("lease", "MODIFIED", _controller(controller_wall, renewals + 1))
    assert _routes(state)


async def test_reading_the_same_record_again_is_no_renewal() -> None:
    """A relist (after a watch broke) hands over the same record: it does not restart the
    Lease's duration."""
    clock = FakeClock()
    state = _state(clock)
    lease = _controller(dt.datetime.now(dt.UTC), 7)
    state.apply("lease", "MODIFIED", lease)
    clock.now += 10
    state.replace("lease", [lease, gpu_lease(holder="engines/ca", state=naming.STATE_AWAKE,
                                             model=A, fence=4)])
    state.apply("lease", "MODIFIED", lease)
    assert _routes(state)
    clock.now = START + DURATION + 0.5
    assert state.decide(A).action is Action.WAIT


def test_a_gateway_that_starts_counts_a_lease_alive_for_one_duration() -> None:
    """The price of the rule: a gateway started after a node died sees its Lease as new."""
    clock = FakeClock()
    state = _state(clock)
    state.apply("lease", "ADDED", _controller(dt.datetime.now(dt.UTC)
                                              - dt.timedelta(days=1), 3))
    assert _routes(state)
    clock.now += DURATION + 0.5
    assert state.decide(A).action is Action.WAIT


def test_a_released_or_deleted_controller_lease_is_not_alive() -> None:
    clock = FakeClock()
    state = _state(clock)
    lease = _controller(dt.datetime.now(dt.UTC), 1)
    state.apply("lease", "ADDED", lease)
    assert _routes(state)
    released = ControllerLease.parse(lease)
    released = ControllerLease(name=released.name, node=released.node,
                               activation_url=URL, renew_time=released.renew_time,
                               duration_s=DURATION, resource_version="2")
    state.apply("lease", "MODIFIED", released.body("rota-system"))
    assert state.decide(A).action is Action.WAIT
    state.apply("lease", "MODIFIED", _controller(dt.datetime.now(dt.UTC), 3))
    assert _routes(state)
    state.apply("lease", "DELETED", lease)
    assert state.decide(A).action is Action.WAIT
