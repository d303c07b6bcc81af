"""The ledger collector's API cost at rest, against the real API server: claims that pods
on this node still hold are not read; one LIST of the node's pods per pass is the cost."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver import DRIVER_NAME
from driver.gc import LedgerCollector
from e2e.harness.objects import engine_pod
from e2e.harness.preparing import NodeFiles, allocated_claim, node_devices
from e2e.harness.waiting import eventually
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]


class CountingKube(Kube):
    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(api)
        self.calls: list[str] = []

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append("get claim")
        return await super().get_claim(namespace, name)

    async def list_pods_on_node(self, node: str) -> list[dict[str, Any]]:
        self.calls.append("list pods")
        return await super().list_pods_on_node(node)


async def test_a_pass_over_claims_held_by_pods_reads_no_claim(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    node = f"gc-{uuid.uuid4().hex[:8]}"
    names = [f"c{i}" for i in range(4)]
    refs = [allocated_claim(kube_api, namespace, name, pool=node) for name in names]
    files = NodeFiles(tmp_path)
    kube = CountingKube(kube_api)
    preparer = files.preparer(kube, node_devices(node), pool=node)
    answers = await preparer.prepare(refs)
    assert all(not isinstance(a, Exception) for a in answers.values()), answers
    for name in names:
        pod = engine_pod(f"engine-{name}", node=node, claim_name=name)
        pod["spec"]["nodeName"] = node
        client.CoreV1Api(kube_api).create_namespaced_pod(namespace, pod)
    kube.calls.clear()
    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=node,
                                driver=DRIVER_NAME, pool=node, grace_s=0)
    for _ in range(3):
        result = await collector.collect_once()
        assert result.collected == []
    assert kube.calls == ["list pods"] * 3
    assert sorted(result.held) == sorted(r.uid for r in refs)


async def test_an_empty_ledger_costs_no_request(
        kube_api: client.ApiClient, tmp_path: Path) -> None:
    node = f"gc-{uuid.uuid4().hex[:8]}"
    files = NodeFiles(tmp_path)
    kube = CountingKube(kube_api)
    preparer = files.preparer(kube, node_devices(node), pool=node)
    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=node,
                                driver=DRIVER_NAME, pool=node, grace_s=0)
    await collector.collect_once()
    assert kube.calls == []


async def test_a_leaked_record_whose_successor_cannot_be_prepared_is_collected(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    """Claim ``x`` is prepared, its unprepare never comes, and ``x`` is deleted and created
    again: the new ``x`` cannot be prepared while the old record holds the budget, and its
    pod names ``x``. Only reading the claim tells the old uid from the new one: a pass that
    reads held records too collects the old record."""
    node = f"gc-{uuid.uuid4().hex[:8]}"
    old = allocated_claim(kube_api, namespace, "x", pool=node)
    files = NodeFiles(tmp_path)
    kube = CountingKube(kube_api)
    preparer = files.preparer(kube, node_devices(node), pool=node)
    answers = await preparer.prepare([old])
    assert not isinstance(answers[old.uid], Exception), answers
    resource = client.ResourceV1Api(kube_api)
    resource.delete_namespaced_resource_claim("x", namespace, grace_period_seconds=0)

    def gone() -> bool:
        try:
            resource.read_namespaced_resource_claim("x", namespace)
        except client.ApiException as exc:
            return bool(exc.status == 404)
        return False

    eventually(gone, timeout=30, what="the old claim x deleted")
    new = allocated_claim(kube_api, namespace, "x", pool=node)
    assert new.uid != old.uid
    pod = engine_pod("engine-x", node=node, claim_name="x")
    pod["spec"]["nodeName"] = node
    client.CoreV1Api(kube_api).create_namespaced_pod(namespace, pod)
    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=node,
                                driver=DRIVER_NAME, pool=node, grace_s=0, read_held_every=2)
    first = await collector.collect_once()
    assert first.collected == []
    assert first.held == [old.uid]
    second = await collector.collect_once()
    assert second.collected == [old.uid]
