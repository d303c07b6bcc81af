"""Smoke test of the gateway scale benchmark at a tiny fleet: it runs, prints a line per N
and its JSON last, with every figure. Timing targets are not asserted here."""

from __future__ import annotations

import json

import pytest

from e2e.bench import gateway_scale as bench_gateway_scale

pytestmark = [pytest.mark.gateway, pytest.mark.slow]


def test_bench_gateway_scale_runs_and_prints_its_json(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert bench_gateway_scale.main(["--nodes", "0,2", "--seconds", "1",
                                     "--latency-requests", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == ["N=0", "N=2"]
    result = json.loads(lines[-1])
    assert (result["gpus_per_node"], result["engines_per_gpu"], result["clients"]) == (8, 4, 16)
    empty, two = result["results"]
    assert (empty["nodes"], two["nodes"], two["claims"]) == (0, 2, 2 * 8 * 4 + 1)
    assert set(two["update_us"]) == {"controller_renewal", "gpu_lease", "pod_label",
                                     "claim_status"}
    for row in (empty, two):
        assert row["throughput"]["requests"] > 0
        assert row["throughput"]["failed"] == 0
        assert row["latency"]["n"] > 0
        assert row["rss_loaded_mib"] > 0
        assert row["cpu_ms_per_request"] > 0
    assert two["events_fed"] > 0, "renewals fed while measured"
