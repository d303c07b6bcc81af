"""Smoke test of the scale harness at a small fleet: every piece starts, every node's
controller renews its Lease, every component's requests are counted under its own
User-Agent. Only structure is asserted: how many requests, how fast, is what ``make scale``
reports, never a pass or fail here."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.scale.audit import ROTA_COMPONENTS
from e2e.scale.report import phase_line
from e2e.scale.run import Options, run

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.sampled]

NODES = 10
"""Smaller than the 20 of ``make scale``: claims, pods and the emulated processes of 20
nodes take two shared cores several minutes to bring up."""


def test_the_harness_counts_every_component_by_its_user_agent(tmp_path: Path) -> None:
    result = run(Options(nodes=NODES, idle_s=20, switch_s=20, switches_per_gpu_hour=360,
                         settle_s=5, workdir=tmp_path))
    assert result["claims"] == NODES * 8 * 4
    assert result["controller_leases_renewed"] == NODES
    assert result["controller_leases_not_renewed"] == []
    assert set(result["phases"]) == {"idle", "switching"}
    idle, switching = result["phases"]["idle"], result["phases"]["switching"]
    for figures in (idle, switching):
        print(phase_line("phase", figures))
        assert figures["requests"]["rota-controller"] > 0
        assert figures["requests"]["kwok"] > 0  # node heartbeats
        assert figures["watch_per_second"]
        assert {"mutating", "read-resource"} <= set(figures["latency_p99"])
        assert len(figures["gateways"]) == 2
        assert all(g["rss_mib"] > 0 for g in figures["gateways"])
    assert idle["switches"] == 0
    assert switching["switches"] > 0
    assert set(result["requests_per_switch"]) == {*ROTA_COMPONENTS, "rota"}
    assert set(result["targets"]) == {"idle_per_node_min", "per_switch"}
    # Every rota process named itself, nothing went out under the client's default name,
    # and what only rota writes was written by rota's processes alone.
    assert set(ROTA_COMPONENTS) <= set(result["user_agents"])
    for component in ROTA_COMPONENTS:
        assert all(agent.startswith(f"{component}/") for agent in
                   result["user_agents"][component])
    assert result["unattributed_requests"] == 0
    assert set(result["rota_state_writes_by_component"]) == {"rota-controller", "rota-driver"}
