"""Leadership per node: a standby judges the holder's Lease by when *it* saw the record
change, on its own monotonic clock, never by the holder's ``renewTime`` (review R15).

The apiserver is a dict with compare-and-swap on ``resourceVersion``; the other instance
writes its renewals straight into it, stamped by a wall clock that is skewed or stepped.
The standby's monotonic clock is a number the test moves.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any, cast

import pytest

from controller.lease.election import Election
from controller.lease.kube import ControllerKube
from rota.api import naming
from rota.api.controller_lease import ControllerLease
from rota.kit.errors import KubeConflictError, KubeNotFoundError

pytestmark = pytest.mark.controller

NS, NODE = "rota-system", "node-1"
DURATION = 15.0
NAME = naming.controller_lease_name(NODE)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeLeases:
    """Leases by name; a write whose ``resourceVersion`` is not the stored one is a 409."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self._version = 0
        self.calls: list[str] = []

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self._version)
        self.objects[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append("get")
        if name not in self.objects:
            raise KubeNotFoundError(f"lease {name}", status=404)
        return copy.deepcopy(self.objects[name])

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        if body["metadata"]["name"] in self.objects:
            raise KubeConflictError("exists", status=409)
        return self._store(body)

    async def replace_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("update")
        name = body["metadata"]["name"]
        if name not in self.objects:
            raise KubeNotFoundError(f"lease {name}", status=404)
        if body["metadata"].get("resourceVersion") != self.objects[name]["metadata"][
                "resourceVersion"]:
            raise KubeConflictError("conflict", status=409)
        return self._store(body)

    def renew_as(self, identity: str, instance: str, renew_time: dt.datetime) -> None:
        """The other instance renews, stamping ``renew_time`` from its own wall clock."""
        current = self.objects.get(NAME)
        lease = ControllerLease(
            name=NAME, node=NODE, holder=identity, instance=instance,
            activation_url="http://10.0.0.1:8090", renew_time=renew_time,
            duration_s=DURATION,
            transitions=0 if current is None else int(current["spec"]["leaseTransitions"]),
            resource_version="" if current is None else current["metadata"]["resourceVersion"])
        self._store(lease.body(NS))

    def holder(self) -> str:
        return str(self.objects[NAME]["spec"].get("holderIdentity") or "")


def _standby(leases: FakeLeases, clock: FakeClock | None = None,
             identity: str = "ctl-b") -> Election:
    extra: dict[str, Any] = {} if clock is None else {"clock": clock}
    return Election(kube=cast(ControllerKube, leases), namespace=NS, node=NODE,
                    identity=identity, duration_s=DURATION,
                    activation_url="http://10.0.0.2:8090", **extra)


SKEWS = [pytest.param(-3600.0, id="renewTime-an-hour-behind"),
         pytest.param(+3600.0, id="renewTime-an-hour-ahead"),
         pytest.param(-10.0, id="renewTime-10s-behind"),
         pytest.param(+10.0, id="renewTime-10s-ahead")]


@pytest.mark.parametrize("skew_s", SKEWS)
async def test_a_standby_does_not_take_over_while_the_record_keeps_changing(
        skew_s: float) -> None:
    """The holder's wall clock is off by ``skew_s`` (or was stepped): it renews; the standby
    asks between renewals and never takes over. No time passes on any clock here: every
    read sees a record it has not seen before."""
    leases = FakeLeases()
    holder_wall = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=skew_s)
    standby = _standby(leases)
    for i in range(5):
        leases.renew_as("ctl-a", "instance-a", holder_wall + dt.timedelta(seconds=5 * i))
        assert not await standby.try_acquire_or_renew()
        assert not standby.is_leader()
    assert leases.holder() == "ctl-a"


@pytest.mark.parametrize("skew_s", SKEWS)
async def test_a_standby_takes_over_once_the_record_stops_changing_for_its_duration(
        skew_s: float) -> None:
    leases = FakeLeases()
    clock = FakeClock()
    holder_wall = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=skew_s)
    standby = _standby(leases, clock)
    # The holder renews every 5 s for a minute; the standby asks every 3 s.
    for second in range(0, 60, 3):
        clock.now = 1000.0 + second
        if second % 5 < 3:
            leases.renew_as("ctl-a", "instance-a",
                            holder_wall + dt.timedelta(seconds=second - second % 5))
        assert not await standby.try_acquire_or_renew(), f"took over at {second}s"
    # The holder stops. The standby saw its last renewal at its own 57 s (1057.0).
    last_seen = clock.now
    for step in (3.0, 9.0, DURATION):
        clock.now = last_seen + step
        assert not await standby.try_acquire_or_renew(), f"took over {step}s after"
    assert leases.holder() == "ctl-a"
    clock.now = last_seen + DURATION + 0.5
    assert await standby.try_acquire_or_renew()
    assert standby.is_leader()
    assert leases.holder() == "ctl-b"
    assert leases.objects[NAME]["spec"]["leaseTransitions"] == 1


async def test_a_relisted_record_that_did_not_change_does_not_keep_its_holder_alive() -> None:
    """Reading the same record again (same resourceVersion) is no renewal."""
    leases = FakeLeases()
    clock = FakeClock()
    leases.renew_as("ctl-a", "instance-a", dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    standby = _standby(leases, clock)
    for step in range(0, 16, 3):
        clock.now = 1000.0 + step
        assert not await standby.try_acquire_or_renew()
    clock.now = 1000.0 + DURATION + 0.5
    assert await standby.try_acquire_or_renew()


async def test_own_leadership_lasts_two_thirds_of_the_duration_from_the_request() -> None:
    leases = FakeLeases()
    clock = FakeClock()
    election = _standby(leases, clock, identity="ctl-a")
    assert await election.try_acquire_or_renew()  # created
    assert election.is_leader()
    clock.now += DURATION * 2 / 3 - 0.1
    assert election.is_leader()
    clock.now += 0.2
    assert not election.is_leader()
    assert await election.try_acquire_or_renew()  # its own Lease: renewed at once
    assert election.is_leader()


async def test_a_restarted_process_of_the_same_identity_waits_like_any_other() -> None:
    leases = FakeLeases()
    clock = FakeClock()
    first = _standby(leases, clock, identity="ctl-a")
    assert await first.try_acquire_or_renew()
    second = _standby(leases, clock, identity="ctl-a")  # a new instance id
    assert not await second.try_acquire_or_renew()
    clock.now += DURATION
    assert not await second.try_acquire_or_renew()
    clock.now += 0.5
    assert await second.try_acquire_or_renew()
    assert leases.objects[NAME]["metadata"]["annotations"][naming.INSTANCE] == second.instance


async def test_a_released_lease_is_taken_at_once() -> None:
    leases = FakeLeases()
    clock = FakeClock()
    first = _standby(leases, clock, identity="ctl-a")
    assert await first.try_acquire_or_renew()
    await first.release()
    assert leases.holder() == ""
    second = _standby(leases, clock)
    assert await second.try_acquire_or_renew()
    assert leases.holder() == "ctl-b"


async def test_the_holder_renews_without_a_get() -> None:
    """client-go's fast path: the holder writes over the Lease it last wrote (its
    resourceVersion makes the write a compare-and-swap) and reads only after a conflict."""
    leases = FakeLeases()
    clock = FakeClock()
    election = _standby(leases, clock, identity="ctl-a")
    assert await election.try_acquire_or_renew()
    for _ in range(10):
        clock.now += DURATION / 3
        assert await election.try_acquire_or_renew()
    assert leases.calls == ["get", "create"] + ["update"] * 10


async def test_a_renewal_that_conflicts_reads_the_lease_and_yields_to_the_new_holder() -> None:
    leases = FakeLeases()
    clock = FakeClock()
    election = _standby(leases, clock, identity="ctl-a")
    assert await election.try_acquire_or_renew()
    leases.renew_as("ctl-b", "instance-b", dt.datetime.now(dt.UTC))  # someone else wrote
    leases.calls.clear()
    clock.now += DURATION / 3
    assert not await election.try_acquire_or_renew()
    assert leases.calls == ["update", "get"]
    assert not election.is_leader()
    assert leases.holder() == "ctl-b"
