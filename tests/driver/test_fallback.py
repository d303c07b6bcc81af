"""With DRAConsumableCapacity off on the API server, the driver notices that its shared
device lost its fields, says so once, and settles on partitioned share devices."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.cluster import ClusterOptions, LocalCluster
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import GROUP, VERSION, node_slices
from e2e.harness.waiting import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.driver]


@pytest.fixture(scope="module")
def gate_off() -> Iterator[tuple[LocalCluster, client.ApiClient]]:
    local = LocalCluster(options=ClusterOptions(
        feature_gates={"DRAConsumableCapacity": False}, run_scheduler=False,
        run_controller_manager=False))
    try:
        local.start()
        api = local.api_client()
        yield local, api
        api.close()
    finally:
        local.cleanup()


def test_gate_off_falls_back_to_partitioned_and_stays_put(
        gate_off: tuple[LocalCluster, client.ApiClient]) -> None:
    cluster, api = gate_off
    node = GpuNode(cluster=cluster, api=api, name=f"off-{uuid.uuid4().hex[:6]}")
    try:
        node.start_driver()
        slices = node_slices(api, node.name)
        counters = [s for s in slices if s["spec"].get("sharedCounters")]
        devices = [d for s in slices for d in s["spec"].get("devices", [])]
        assert len(counters) == 1
        assert [d["name"] for d in devices][:2] == ["gpu-0-share-0", "gpu-0-share-1"]
        assert len(devices) == 8
        assert all("allowMultipleAllocations" not in d for d in devices)
        assert all(d["attributes"]["sharing"] == {"string": "partitioned"} for d in devices)
        assert node.driver_metric("rota_driver_sharing_mode") == 1

        writes = node.driver_metric("rota_driver_slice_writes_total")
        syncs = node.driver_metric("rota_driver_slice_syncs_total")
        # Touch a slice: the watch wakes the publisher, which must find nothing to do.
        name = slices[0]["metadata"]["name"]
        client.CustomObjectsApi(api).patch_cluster_custom_object(
            GROUP, VERSION, "resourceslices", name, {"metadata": {"labels": {"touched": "1"}}})
        eventually(lambda: node.driver_metric("rota_driver_slice_syncs_total") > syncs,
                   timeout=30, what="a reconciliation after the touch")
        assert node.driver_metric("rota_driver_slice_writes_total") == writes

        log = (node.dirs.logs / "driver.log").read_text()
        reasons = [line for line in log.splitlines() if "is not available on this cluster" in line]
        assert len(reasons) == 1, reasons
        assert "DRAConsumableCapacity" in reasons[0]
    finally:
        node.close()
