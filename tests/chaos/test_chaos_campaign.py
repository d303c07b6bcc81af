"""The chaos campaign, short: 500 switches with every fault in the catalogue, on the local
cluster. The full campaign (10,000 switches) is a benchmark: ``python -m e2e.chaos``."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.chaos.campaign import CampaignOptions, run_campaign
from e2e.chaos.rig import RigOptions
from e2e.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.controller, pytest.mark.slow]


@pytest.mark.sampled
async def test_five_hundred_switches_under_faults_keep_one_engine_awake(
        cluster: LocalCluster, kube_api: client.ApiClient) -> None:
    tally = await run_campaign(cluster, kube_api, CampaignOptions(
        switches=500, max_seconds=900, seed=20261201, rig=RigOptions(nodes=2)))
    report = tally.report()
    for line in tally.lines():
        print(line)
    print("unanswered:", *report["samples"]["unanswered"], sep="\n  ")
    print("without owner:", *report["samples"]["unowned"], sep="\n  ")
    assert report["switches"] >= 500, report
    assert report["double_awake_instants"] == 0, report
    assert report["requests_without_answer"] == 0, report["samples"]["unanswered"]
    assert report["gpus_without_owner"] == 0, report["samples"]["unowned"]
    assert report["gpu_samples"] > 1000, report  # the monitor really sampled
