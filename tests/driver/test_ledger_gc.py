"""Ledger garbage collection against the real API server: records of claims that are gone
or moved to another node are collected; a live claim, and one whose pod is still on this
node, are kept; a claim the kubelet re-prepared during the pass is kept."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from driver import DRIVER_NAME
from driver.gc import LedgerCollector
from e2e.harness.objects import GROUP, VERSION, engine_pod
from e2e.harness.preparing import NodeFiles, allocated_claim, node_devices, set_allocation
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]


def _delete_claim(api: client.ApiClient, namespace: str, name: str) -> None:
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", name)


async def test_claims_gone_or_moved_are_collected_and_live_or_held_ones_kept(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    node = f"gc-{uuid.uuid4().hex[:8]}"
    refs = {name: allocated_claim(kube_api, namespace, name, pool=node, memory="4Gi",
                                  awake="20Gi")
            for name in ("live", "deleted", "moved", "held", "recreated")}
    files = NodeFiles(tmp_path)
    kube = Kube(kube_api)
    preparer = files.preparer(kube, node_devices(node), pool=node)
    answers = await preparer.prepare(list(refs.values()))
    assert all(not isinstance(a, Exception) for a in answers.values()), answers
    _delete_claim(kube_api, namespace, "deleted")
    set_allocation(kube_api, namespace, "moved", pool="another-node", memory="4Gi")
    # "held": the claim is gone, but a pod bound to this node still names it.
    _delete_claim(kube_api, namespace, "held")
    pod = engine_pod("engine", node=node, claim_name="held")
    pod["spec"]["nodeName"] = node
    client.CoreV1Api(kube_api).create_namespaced_pod(namespace, pod)
    # "recreated": deleted and created again under the same name (a new uid).
    _delete_claim(kube_api, namespace, "recreated")
    allocated_claim(kube_api, namespace, "recreated", pool=node, memory="4Gi", awake="20Gi")

    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=node,
                                driver=DRIVER_NAME, pool=node, grace_s=0)
    result = await collector.collect_once()
    gone = {refs[n].uid for n in ("deleted", "moved", "recreated")}
    assert set(result.collected) == gone
    assert result.suspects == {refs["deleted"].uid: "gone", refs["moved"].uid: "elsewhere",
                               refs["recreated"].uid: "replaced"}
    assert result.held == [refs["held"].uid]
    kept = {refs["live"].uid, refs["held"].uid}
    assert set(files.records()) == kept
    assert files.specs() == kept
    # The next pass finds nothing more to do.
    again = await collector.collect_once()
    assert again.collected == []
    assert set(files.records()) == kept


async def test_a_suspect_is_collected_only_after_the_grace_period(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    node = f"gc-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=node)
    files = NodeFiles(tmp_path)
    kube = Kube(kube_api)
    preparer = files.preparer(kube, node_devices(node), pool=node)
    await preparer.prepare([ref])
    _delete_claim(kube_api, namespace, "c")
    now = [1000.0]
    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=node,
                                driver=DRIVER_NAME, pool=node, grace_s=120,
                                clock=lambda: now[0])
    first = await collector.collect_once()
    assert first.suspects == {ref.uid: "gone"}
    assert first.collected == []
    now[0] += 119
    assert (await collector.collect_once()).collected == []
    now[0] += 1
    assert (await collector.collect_once()).collected == [ref.uid]
    assert files.records() == {}
    assert files.specs() == set()


async def test_a_claim_prepared_again_during_the_pass_is_kept(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    node = f"gc-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=node)
    files = NodeFiles(tmp_path)
    preparer = files.preparer(Kube(kube_api), node_devices(node), pool=node)
    await preparer.prepare([ref])
    decided_at = time.monotonic()  # the pass found the claim gone at this instant ...
    # ... and the kubelet, restarted, re-sends the prepare before the pass collects.
    assert not isinstance((await preparer.prepare([ref]))[ref.uid], Exception)
    assert await preparer.collect({ref.uid}, decided_at=decided_at) == []
    assert set(files.records()) == {ref.uid}
    # A later pass may collect it.
    assert await preparer.collect({ref.uid}, decided_at=time.monotonic()) == [ref.uid]
    assert files.specs() == set()


async def test_a_replaced_claim_is_collected_while_a_pod_uses_its_successor(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    """The pod names the claim by name, and that name is now another claim (another uid):
    the pod holds the new claim, never the old record's. A claim cannot be deleted while
    reserved for a pod, so nothing holds the old one."""
    node = f"gc-{uuid.uuid4().hex[:8]}"
    old = allocated_claim(kube_api, namespace, "c", pool=node, memory="4Gi", awake="20Gi")
    files = NodeFiles(tmp_path)
    kube = Kube(kube_api)
    preparer = files.preparer(kube, node_devices(node), pool=node)
    assert not isinstance((await preparer.prepare([old]))[old.uid], Exception)
    _delete_claim(kube_api, namespace, "c")
    new = allocated_claim(kube_api, namespace, "c", pool=node, memory="4Gi", awake="20Gi")
    assert not isinstance((await preparer.prepare([new]))[new.uid], Exception)
    pod = engine_pod("engine", node=node, claim_name="c")
    pod["spec"]["nodeName"] = node
    client.CoreV1Api(kube_api).create_namespaced_pod(namespace, pod)

    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=node,
                                driver=DRIVER_NAME, pool=node, grace_s=0)
    result = await collector.collect_once()
    assert result.suspects == {old.uid: "replaced"}
    assert result.held == []
    assert result.collected == [old.uid]
    assert set(files.records()) == {new.uid}
    assert files.specs() == {new.uid}
