"""Smoke test of the controller overhead benchmark: a few handoffs on the session cluster;
the result has every figure, and sane ones. Timing targets are not asserted here."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.bench import controller as bench_controller
from e2e.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.controller, pytest.mark.slow]


def test_bench_controller_runs_and_reports(cluster: LocalCluster, kube_api: client.ApiClient,
                                           device_class: str, namespace: str) -> None:
    delays = bench_controller.Delays(later_sleep_s=0.02, wake_s=0.03, ttft_s=0.01)
    result = bench_controller.run(cluster, kube_api, handoffs=4, delays=delays,
                                  namespace=namespace)
    assert {"handoffs", "warmup_handoffs", "configured_s", "controller_overhead",
            "round_trip_overhead", "step_p50_ms", "targets_met"} <= result.keys()
    assert result["handoffs"] == 4
    assert isinstance(result["targets_met"], bool)
    for key in ("controller_overhead", "round_trip_overhead"):
        stats = result[key]
        assert stats["n"] == 4
        # The configured delays are a floor: an overhead cannot be (much) below zero.
        assert -5.0 <= stats["p50_ms"] <= stats["p99_ms"] <= stats["max_ms"] < 30_000
    assert result["round_trip_overhead"]["p50_ms"] >= result["controller_overhead"]["p50_ms"]
    assert result["step_p50_ms"]["wake_call"] >= delays.wake_s * 1e3
    assert result["step_p50_ms"]["probe_ttft"] >= delays.ttft_s * 1e3
