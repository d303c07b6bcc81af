"""What the API server says about itself on ``/metrics``, read at the edges of each phase.

Two scrapes bound a phase; the differences give:

- watch events delivered and their bytes, by resource (``apiserver_watch_events_total``,
  ``apiserver_watch_events_sizes``): every event sent on every open watch, so one write
  watched by k clients counts k times;
- request latency p99 by the classes of the Kubernetes API call latency SLOs
  (kubernetes/community ``sig-scalability/slos/api_call_latency.md``): mutating calls 1 s,
  reads of one object 1 s, of a namespace 5 s, of the cluster 30 s. Watches and
  proxy/exec calls are not in any class. A p99 here is the upper bound of the histogram
  bucket that holds it (``apiserver_request_duration_seconds``), so it is conservative.
"""

from __future__ import annotations

import ssl
import urllib.request
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from e2e.scale.world import USER_AGENT

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY", "DELETECOLLECTION"})
SLO_S = {"mutating": 1.0, "read-resource": 1.0, "read-namespace": 5.0, "read-cluster": 30.0}

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]


def scrape(server: str, context: ssl.SSLContext, timeout_s: float = 30.0) -> Samples:
    """Every sample of ``/metrics``: metric sample name -> labels -> value."""
    request = urllib.request.Request(f"{server}/metrics",
                                     headers={"User-Agent": USER_AGENT})
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
        text = resp.read().decode()
    samples: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name][tuple(sorted(sample.labels.items()))] = float(sample.value)
    return dict(samples)


def delta(before: Samples, after: Samples, name: str) -> dict[Labels, float]:
    old = before.get(name, {})
    return {labels: value - old.get(labels, 0.0)
            for labels, value in after.get(name, {}).items()}


def slo_class(labels: Mapping[str, str]) -> str | None:
    verb = labels.get("verb", "")
    if verb in MUTATING:
        return "mutating"
    if verb == "GET" or verb == "LIST":
        scope = labels.get("scope", "")
        if scope in ("resource", "namespace", "cluster"):
            return f"read-{scope}"
    return None


@dataclass(frozen=True)
class Latency:
    requests: int
    p99_s: float | None
    """Upper bound of the bucket holding the 99th percentile; None without requests."""
    slo_s: float

    @property
    def met(self) -> bool | None:
        return None if self.p99_s is None else self.p99_s <= self.slo_s


def latency_p99(before: Samples, after: Samples) -> dict[str, Latency]:
    buckets: dict[str, dict[float, float]] = {k: defaultdict(float) for k in SLO_S}
    for labels, value in delta(before, after,
                               "apiserver_request_duration_seconds_bucket").items():
        named = dict(labels)
        cls = slo_class(named)
        if cls is None:
            continue
        buckets[cls][float(named["le"])] += value
    found: dict[str, Latency] = {}
    for cls, by_le in buckets.items():
        bounds = sorted(by_le)
        total = by_le[bounds[-1]] if bounds else 0.0
        p99: float | None = None
        if total > 0:
            p99 = next(le for le in bounds if by_le[le] >= 0.99 * total)
        found[cls] = Latency(requests=int(total), p99_s=p99, slo_s=SLO_S[cls])
    return found


def _resource(labels: Mapping[str, str]) -> str:
    resource = labels.get("resource") or labels.get("kind") or "?"
    group = labels.get("group", "")
    return f"{resource}.{group}" if group else resource


def watch_events(before: Samples, after: Samples) -> dict[str, dict[str, Any]]:
    """Resource -> events and bytes sent on watches during the phase."""
    found: dict[str, dict[str, Any]] = defaultdict(lambda: {"events": 0, "bytes": 0})
    for labels, value in delta(before, after, "apiserver_watch_events_total").items():
        found[_resource(dict(labels))]["events"] += int(value)
    for labels, value in delta(before, after, "apiserver_watch_events_sizes_sum").items():
        found[_resource(dict(labels))]["bytes"] += int(value)
    return {k: v for k, v in sorted(found.items()) if v["events"] or v["bytes"]}
