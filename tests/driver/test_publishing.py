"""ResourceSlices are reconciled: published as shared devices, recreated when deleted,
untouched by a restart that finds them intact, re-versioned only when content changes."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from kubernetes import client

from driver.devices import discover
from driver.metrics import REGISTRY
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.publisher import SlicePublisher
from driver.slices import SharingMode
from e2e.cluster import LocalCluster, create_node
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import GROUP, VERSION, node_slices
from e2e.harness.waiting import eventually, eventually_async
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

DEADLINE_S = 30.0
RESYNCS = 20


def test_the_gpu_is_published_as_a_shared_device(gpu_node: GpuNode,
                                                 kube_api: client.ApiClient) -> None:
    (published,) = node_slices(kube_api, gpu_node.name)
    spec = published["spec"]
    assert spec["pool"] == {"name": gpu_node.name, "generation": 0, "resourceSliceCount": 1}
    (device,) = spec["devices"]
    assert device["name"] == "gpu-0"
    assert device["allowMultipleAllocations"] is True
    assert device["attributes"]["productName"] == {"string": "NVIDIA H200"}
    assert device["attributes"]["uuid"]["string"].startswith("GPU-")
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:00:06.0"}
    memory = device["capacity"]["memory"]
    assert memory["value"] == "143771Mi"
    assert memory["requestPolicy"]["validRange"]["step"] == "1Mi"
    assert device["capacity"]["engines"]["value"] == "8"
    owner = published["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Node", gpu_node.name)


def test_a_deleted_slice_comes_back(gpu_node: GpuNode, kube_api: client.ApiClient) -> None:
    (published,) = node_slices(kube_api, gpu_node.name)
    client.CustomObjectsApi(kube_api).delete_cluster_custom_object(
        GROUP, VERSION, "resourceslices", published["metadata"]["name"])

    def recreated() -> bool:
        slices = node_slices(kube_api, gpu_node.name)
        return len(slices) == 1 and slices[0]["metadata"]["uid"] != published["metadata"]["uid"]

    eventually(recreated, timeout=30, what="slice recreated after deletion")


def test_restart_writes_nothing_and_content_change_bumps_generation(
        gpu_node: GpuNode, kube_api: client.ApiClient) -> None:
    (before,) = node_slices(kube_api, gpu_node.name)
    gpu_node.stop_driver()
    gpu_node.start_driver()
    assert gpu_node.driver_metric("rota_driver_slice_writes_total") == 0
    (after,) = node_slices(kube_api, gpu_node.name)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

    gpu_node.stop_driver()
    gpu_node.start_driver(extra=["--engines-per-gpu=4"])
    (changed,) = node_slices(kube_api, gpu_node.name)
    assert changed["spec"]["devices"][0]["capacity"]["engines"]["value"] == "4"
    assert changed["spec"]["pool"]["generation"] == before["spec"]["pool"]["generation"] + 1
    assert gpu_node.driver_metric("rota_driver_slice_writes_total") == 1


async def test_an_unhealthy_gpu_is_tainted_and_the_taint_lifted(
        cluster: LocalCluster, kube_api: client.ApiClient) -> None:
    backend = FakeNvml.from_path(fixture_path("h200"))
    backend.init()
    gpus = discover(backend)
    node = f"taint-{uuid.uuid4().hex[:6]}"
    create_node(kube_api, node)
    publisher = SlicePublisher(kube=Kube(kube_api), node_name=node, gpus=gpus,
                               mode=SharingMode.SHARED, engines=8)
    try:
        await publisher.sync_once()
        publisher.set_health(gpus[0].uuid, False, "xid-79")
        assert await publisher.sync_once() == 1
        (device,) = node_slices(kube_api, node)[0]["spec"]["devices"]
        (taint,) = device["taints"]
        assert (taint["key"], taint["value"], taint["effect"]) == (
            "gpu.rota.dev/unhealthy", "xid-79", "NoSchedule")
        assert await publisher.sync_once() == 0, "an unchanged taint must not be rewritten"
        publisher.set_health(gpus[0].uuid, True, "")
        assert await publisher.sync_once() == 1
        assert "taints" not in node_slices(kube_api, node)[0]["spec"]["devices"][0]
    finally:
        client.CoreV1Api(kube_api).delete_node(node)



class _CountingKube(Kube):
    """The real facade, counting the lists of slices it sends."""

    lists = 0

    async def list_slices(self, *, driver: str, node: str) -> list[dict[str, Any]]:
        self.lists += 1
        return await super().list_slices(driver=driver, node=node)


async def test_resyncs_of_intact_slices_ask_the_api_server_nothing(
        cluster: LocalCluster, kube_api: client.ApiClient) -> None:
    """The publisher compares with its watch's view: resyncs that find the slices intact
    list nothing (on the old code every resync listed, and every re-opened watch did too),
    and a slice deleted by hand still comes back."""
    backend = FakeNvml.from_path(fixture_path("h200"))
    backend.init()
    node = f"idle-{uuid.uuid4().hex[:6]}"
    create_node(kube_api, node)
    kube = _CountingKube(kube_api)
    publisher = SlicePublisher(kube=kube, node_name=node, gpus=discover(backend),
                               mode=SharingMode.SHARED, engines=8, resync_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    try:
        async with asyncio.timeout(DEADLINE_S):
            await publisher.synced.wait()
        syncs = _syncs()
        async def resynced() -> bool:
            return _syncs() >= syncs + RESYNCS

        await eventually_async(resynced, timeout=DEADLINE_S, what="idle resyncs")
        assert kube.lists <= 1, f"{kube.lists} lists for {RESYNCS} idle resyncs"

        (published,) = node_slices(kube_api, node)
        client.CustomObjectsApi(kube_api).delete_cluster_custom_object(
            GROUP, VERSION, "resourceslices", published["metadata"]["name"])

        async def recreated() -> bool:
            slices = node_slices(kube_api, node)
            return len(slices) == 1 and slices[0]["metadata"]["uid"] != published[
                "metadata"]["uid"]

        await eventually_async(recreated, timeout=DEADLINE_S, what="slice recreated")
    finally:
        stop.set()
        await task
        client.CoreV1Api(kube_api).delete_node(node)


def _syncs() -> float:
    return REGISTRY.get_sample_value("rota_driver_slice_syncs_total") or 0.0
