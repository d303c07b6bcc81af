"""One engine awake per physical GPU whatever the sharing mode names the allocations: the
controller's handoffs with the driver in ``partitioned`` mode (share devices
``gpu-0-share-<k>``), and on a cluster without DRAConsumableCapacity, where the driver falls
back to partitioned by itself and the API server drops the claims' capacity requests."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
from kubernetes import client

from e2e.cluster import ClusterOptions, LocalCluster
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import MANIFESTS, apply_manifest, node_slices
from e2e.harness.scenario import AwakeMonitor, Engine, activate, ask_seven, deploy
from e2e.harness.waiting import eventually_async
from rota.api import naming
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

HANDOFFS = 6


@pytest.fixture(scope="module")
def gate_off_cluster() -> Iterator[tuple[LocalCluster, client.ApiClient]]:
    local = LocalCluster(options=ClusterOptions(feature_gates={"DRAConsumableCapacity": False}))
    try:
        local.start()
        api = local.api_client()
        apply_manifest(api, MANIFESTS / "deviceclass.yaml")
        yield local, api
        api.close()
    finally:
        local.cleanup()


def _namespace(api: client.ApiClient) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    return name


async def _handoffs_on_one_gpu(node: GpuNode, api: client.ApiClient,
                               engines: list[Engine]) -> None:
    node.start_controller()
    url = node.controller_url()
    coordination = client.CoordinationV1Api(api)
    async with aiohttp.ClientSession() as session:
        # Both simulators start awake; reconciliation puts one to sleep first.
        async def first() -> bool:
            status, _ = await activate(session, url, MODEL_A.model)
            return status == 200

        await eventually_async(first, timeout=60, what="controller serving")
        with AwakeMonitor(node.dirs.inspect_socket, engines) as monitor:
            for i in range(HANDOFFS):
                target = (MODEL_B, MODEL_A)[i % 2]
                status, body = await activate(session, url, target.model)
                assert status == 200, body
                assert body["switched"] is True, body
                assert await ask_seven(session, body["endpoint"], target.model) == "7"
                await asyncio.to_thread(monitor.wait_next)
    leases = coordination.list_namespaced_lease(
        "rota-system", label_selector=naming.gpu_lease_selector(node.name))
    assert [lease.metadata.name for lease in leases.items] == [
        naming.gpu_lease_name(node.name, "gpu-0")], "one GPU Lease for the one physical GPU"
    assert monitor.violations == []


def _as_driver_counts(api: client.ApiClient, node: str, engines: list[Engine]
                      ) -> list[Engine]:
    """The engines with the resident footprint the driver gives them: a claim of a plain
    device (a partition) holds all of it, and the engine sizes itself from that budget."""
    capacity = {d["name"]: d["capacity"]["memory"]["value"]
                for s in node_slices(api, node) for d in s["spec"].get("devices", [])}
    objects = client.CustomObjectsApi(api)
    out = []
    for engine in engines:
        claim = objects.get_namespaced_custom_object("resource.k8s.io", "v1", engine.namespace,
                                                     "resourceclaims", engine.spec.name)
        device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        spec = dataclasses.replace(engine.spec, resident=str(capacity[device]))
        out.append(dataclasses.replace(engine, spec=spec))
    return out


def _shares(api: client.ApiClient, engines: list[Engine]) -> set[str]:
    objects = client.CustomObjectsApi(api)
    devices = set()
    for engine in engines:
        claim = objects.get_namespaced_custom_object("resource.k8s.io", "v1", engine.namespace,
                                                     "resourceclaims", engine.spec.name)
        devices |= {r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
    return devices


async def test_partitioned_mode_keeps_one_engine_awake(
        cluster: LocalCluster, kube_api: client.ApiClient, device_class: str,
        namespace: str) -> None:
    node = GpuNode(cluster=cluster, api=kube_api, name=f"part-{uuid.uuid4().hex[:8]}",
                   sharing_mode="partitioned")
    try:
        node.start_driver()
        node.start_agent()
        engines = deploy(kube_api, namespace, node.name, [MODEL_A, MODEL_B])
        shares = _shares(kube_api, engines)
        assert len(shares) == 2, shares
        assert all(d.startswith("gpu-0-share-") for d in shares), shares
        await _handoffs_on_one_gpu(node, kube_api,
                                   _as_driver_counts(kube_api, node.name, engines))
    finally:
        node.close()


async def test_without_consumable_capacity_one_engine_stays_awake(
        gate_off_cluster: tuple[LocalCluster, client.ApiClient]) -> None:
    cluster, api = gate_off_cluster
    namespace = _namespace(api)
    node = GpuNode(cluster=cluster, api=api, name=f"off-{uuid.uuid4().hex[:8]}")
    try:
        node.start_driver()
        node.start_agent()
        engines = deploy(api, namespace, node.name, [MODEL_A, MODEL_B])
        assert all(d.startswith("gpu-0-share-") for d in _shares(api, engines))
        await _handoffs_on_one_gpu(node, api, _as_driver_counts(api, node.name, engines))
    finally:
        node.close()
