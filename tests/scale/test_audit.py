"""The audit log reader and the API server metrics reader on recorded lines: a watch counts
once, a list from scratch is told from a resumed one, each request goes to the component
its User-Agent names; a p99 is the bound of the bucket that holds it."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from e2e.scale import apimetrics, audit

AT = "2026-12-06T07:00:00.000000Z"


def _entry(stage: str, verb: str, uri: str, agent: str, *, resource: str,
           namespace: str = "") -> dict[str, Any]:
    return {"kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
            "stage": stage, "verb": verb, "requestURI": uri, "userAgent": agent,
            "objectRef": {"resource": resource, "namespace": namespace},
            "responseStatus": {"code": 200}, "requestReceivedTimestamp": AT}


def test_the_reader_counts_each_request_once_by_component(tmp_path: Path) -> None:
    watch = "/api/v1/pods?fieldSelector=spec.nodeName%3Dn&resourceVersion=7&watch=true"
    lines = [
        _entry("ResponseStarted", "watch", watch, "rota-controller/0.1.0", resource="pods"),
        _entry("ResponseComplete", "watch", watch, "rota-controller/0.1.0", resource="pods"),
        _entry("ResponseComplete", "list", "/api/v1/pods?limit=500", "rota-controller/0.1.0",
               resource="pods"),
        _entry("ResponseComplete", "list", "/api/v1/pods?limit=500&resourceVersion=9",
               "rota-controller/0.1.0", resource="pods"),
        _entry("ResponseComplete", "update",
               "/apis/coordination.k8s.io/v1/namespaces/rota-system/leases/x",
               "rota-controller/0.1.0", resource="leases", namespace="rota-system"),
        _entry("ResponseComplete", "get", "/api/v1/nodes/n", "OpenAPI-Generator/35.0/python",
               resource="nodes"),
    ]
    log = tmp_path / "audit.log"
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n{\"truncated")
    requests = list(audit.read(log))
    assert [(r.component, r.verb) for r in requests] == [
        ("rota-controller", "watch"), ("rota-controller", "list"),
        ("rota-controller", "list"), ("rota-controller", "update"),
        ("OpenAPI-Generator", "get")]
    at = requests[0].at
    tally = audit.tally(requests, at, at + dt.timedelta(seconds=1))
    assert tally.by_component == {"rota-controller": 4, "OpenAPI-Generator": 1}
    assert tally.relists == {"rota-controller pods": 1}
    assert [audit.writes_rota_state(r, "rota-system") for r in requests] == [
        False, False, False, True, False]


def test_p99_is_the_bound_of_the_bucket_that_holds_it() -> None:
    def samples(counts: dict[str, float]) -> apimetrics.Samples:
        return {"apiserver_request_duration_seconds_bucket": {
            (("le", le), ("scope", "resource"), ("verb", "PUT")): n
            for le, n in counts.items()}}

    before = samples({"0.05": 10, "0.1": 10, "1.0": 10, "+Inf": 10})
    after = samples({"0.05": 100, "0.1": 150, "1.0": 210, "+Inf": 210})
    latency = apimetrics.latency_p99(before, after)["mutating"]
    assert (latency.requests, latency.p99_s, latency.met) == (200, 1.0, True)
    assert apimetrics.latency_p99(before, before)["mutating"].p99_s is None
