"""The controller Lease contract (:mod:`rota.api.controller_lease`): one parser, one
renderer, one freshness rule on the reader's monotonic clock."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rota.api import naming
from rota.api.controller_lease import ControllerLease, LeaseObserver

NAME = naming.controller_lease_name("node-1")
T0 = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)


def _lease(**changes: Any) -> ControllerLease:
    values: dict[str, Any] = {"name": NAME, "node": "node-1", "holder": "ctl-a",
                              "instance": "i-a", "activation_url": "http://10.0.0.1:8090",
                              "renew_time": T0, "acquire_time": T0, "duration_s": 15.0,
                              "transitions": 2, "resource_version": "41"}
    return ControllerLease(**(values | changes))


def test_the_body_reads_back_as_the_same_lease() -> None:
    lease = _lease()
    body = lease.body("rota-system")
    assert body["metadata"]["labels"][naming.LABEL_KIND] == naming.KIND_CONTROLLER
    parsed = ControllerLease.from_object(body)
    assert parsed == ControllerLease(**(vars(lease) | {"node_label": "node-1"}))


def test_unknown_keys_are_ignored_and_missing_ones_read_as_empty() -> None:
    body = _lease().body("rota-system")
    body["spec"]["someFutureField"] = {"x": 1}
    body["metadata"]["annotations"]["gpu.rota.dev/some-future-note"] = "y"
    assert ControllerLease.from_object(body) == ControllerLease.from_object(
        _lease().body("rota-system"))
    bare = ControllerLease.from_object({"metadata": {"name": NAME, "labels": {
        naming.LABEL_KIND: naming.KIND_CONTROLLER}}})
    assert bare == ControllerLease(name=NAME)
    assert ControllerLease.parse({"spec": {"leaseDurationSeconds": "soon",
                                           "renewTime": "yesterday"}}).duration_s == 0.0


def test_other_leases_are_not_controller_leases() -> None:
    body = _lease().body("rota-system")
    body["metadata"]["labels"][naming.LABEL_KIND] = naming.KIND_GPU
    assert ControllerLease.from_object(body) is None
    assert ControllerLease.from_object({"metadata": {}}) is None


def test_a_lease_is_fresh_for_its_duration_after_it_was_seen_to_change() -> None:
    observer = LeaseObserver()
    observer.observe(_lease(), now=100.0)
    assert observer.fresh(NAME, 115.0)
    assert not observer.fresh(NAME, 115.1)
    observer.observe(_lease(), now=110.0)  # the same record again: no renewal
    assert not observer.fresh(NAME, 115.1)
    observer.observe(_lease(resource_version="42",
                            renew_time=T0 - dt.timedelta(hours=5)), now=112.0)
    assert observer.expires_at(NAME) == 127.0
    assert not observer.fresh("rota-controller-elsewhere", 100.0)


def test_any_change_of_the_record_counts_and_nothing_else() -> None:
    for change in ({"resource_version": "99"}, {"renew_time": T0 + dt.timedelta(seconds=5)},
                   {"holder": "ctl-b"}, {"instance": "i-b"}, {"duration_s": 20.0},
                   {"transitions": 3}):
        observer = LeaseObserver()
        observer.observe(_lease(), now=0.0)
        observer.observe(_lease(**change), now=10.0)
        assert observer.fresh(NAME, 20.0), change
    observer = LeaseObserver()
    observer.observe(_lease(resource_version=""), now=0.0)
    seen = observer.observe(_lease(resource_version="", activation_url="http://x:1"), now=10.0)
    assert seen.changed_at == 0.0
    assert seen.lease.activation_url == "http://x:1"


def test_a_lease_without_holder_or_duration_is_never_fresh() -> None:
    observer = LeaseObserver()
    observer.observe(_lease(holder=""), now=0.0)
    assert not observer.fresh(NAME, 0.0)
    observer.observe(_lease(duration_s=0.0), now=1.0)
    assert observer.expires_at(NAME) is None
    assert not observer.fresh(NAME, 1.0)


def test_forgotten_leases_start_again_at_first_sight() -> None:
    observer = LeaseObserver()
    observer.observe(_lease(), now=0.0)
    observer.forget(NAME)
    assert observer.get(NAME) is None
    observer.observe(_lease(), now=50.0)
    assert observer.fresh(NAME, 60.0)
    observer.retain([])
    assert observer.names() == []
