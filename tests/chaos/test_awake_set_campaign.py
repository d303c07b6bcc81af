"""The chaos campaign in awake-set mode, short: 300 switches with every fault in the
catalogue, on the local cluster, with the lease controllers started with ``--awake-set``
and three engines per GPU of which any two fit awake together, never three. The full
campaign is a benchmark: ``python -m e2e.chaos --awake-set``."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.chaos.campaign import CampaignOptions, run_campaign
from e2e.chaos.rig import RigOptions
from e2e.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.controller, pytest.mark.slow]


@pytest.mark.sampled
async def test_three_hundred_switches_under_faults_never_overcommit_the_gpu(
        cluster: LocalCluster, kube_api: client.ApiClient) -> None:
    tally = await run_campaign(cluster, kube_api, CampaignOptions(
        switches=300, max_seconds=900, seed=20261207,
        rig=RigOptions.for_awake_set(nodes=2)))
    report = tally.report()
    for line in tally.lines():
        print(line)
    print("unanswered:", *report["samples"]["unanswered"], sep="\n  ")
    print("without owner:", *report["samples"]["unowned"], sep="\n  ")
    assert report["mode"] == "awake-set"
    assert report["switches"] >= 300, report
    assert report["over_gpu_instants"] == 0, report["samples"]["over_gpu"]
    assert report["crowded_instants"] == 0, report["samples"]["crowded"]
    assert report["requests_without_answer"] == 0, report["samples"]["unanswered"]
    assert report["gpus_without_owner"] == 0, report["samples"]["unowned"]
    assert report["gpu_samples"] > 1000, report  # the monitor really sampled
    # The set was used: two engines of a GPU awake at once in many samples.
    assert report["samples_by_engines_above_resident"].get(2, 0) > 100, report
