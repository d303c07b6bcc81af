"""Smoke test of the gateway benchmark: a few streams direct and through the gateway on
the session cluster; the result has every figure, and sane ones. Timing targets are not
asserted here."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.bench import gateway as bench_gateway
from e2e.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.gateway, pytest.mark.slow]


def test_bench_gateway_runs_and_reports(cluster: LocalCluster, kube_api: client.ApiClient,
                                        device_class: str, namespace: str) -> None:
    load = bench_gateway.Load(requests=3, streams=4, rounds=1, max_tokens=8,
                              tokens_per_second=200.0, ttft_s=0.01)
    result = bench_gateway.run(cluster, kube_api, load=load, namespace=namespace)
    assert {"load", "streams_1", "streams_4", "streams_4_steady", "targets_met"} <= result.keys()
    assert isinstance(result["targets_met"], bool)
    for key, requests in (("streams_1", 3), ("streams_4", 4), ("streams_4_steady", 8)):
        phase = result[key]
        for side in ("direct", "gateway"):
            stats = phase[side]
            assert stats["n"] == requests
            # The simulator's time to first token is a floor.
            assert 10.0 <= stats["ttft_p50_ms"] <= stats["ttft_p99_ms"] < 30_000
            assert stats["chunks_per_s"] > 0
        assert phase["ttft_p50_ratio"] > 0
        assert phase["ttft_p99_ratio"] > 0
        assert isinstance(phase["ttft_p99_added_ms"], float)
        assert phase["chunks_ratio"] > 0
    # The gateway's own first-token histogram was read (its name is the benchmark's too).
    assert result["gateway_metric_ttft_mean_ms"] > 0
