"""The local cluster runs real DRA: the real scheduler allocates shared devices with
consumable capacity, kube-controller-manager turns templates into claims."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import ClusterOptions, LocalCluster, create_node
from e2e.harness.waiting import eventually

pytestmark = pytest.mark.cluster

GROUP, VERSION = "resource.k8s.io", "v1"
GI = 1024**3


def _objects(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def _device_class(api: client.ApiClient, driver: str) -> str:
    name = f"dc-{uuid.uuid4().hex[:8]}"
    _objects(api).create_cluster_custom_object(GROUP, VERSION, "deviceclasses", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    })
    return name


def _shared_slice(node: str, driver: str, memory_gi: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver, "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{
                "name": "gpu-0",
                "allowMultipleAllocations": True,
                "attributes": {"productName": {"string": "test"}},
                "capacity": {"memory": {
                    "value": f"{memory_gi}Gi",
                    "requestPolicy": {"default": "1Gi",
                                      "validRange": {"min": "1Gi", "step": "1Gi"}},
                }},
            }],
        },
    }


def _claim(name: str, device_class: str, memory: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{
            "name": "gpu",
            "exactly": {"deviceClassName": device_class,
                        "capacity": {"requests": {"memory": memory}}},
        }]}},
    }


def _pod(name: str, node_selector: str, claim: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node_selector},
            "containers": [{"name": "engine", "image": "rota/engine-simulator",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", **claim}],
        },
    }


@pytest.fixture
def dra_node(kube_api: client.ApiClient) -> Iterator[tuple[str, str, str]]:
    """A fresh Node with one shared 40Gi device of a fresh driver, and its DeviceClass."""
    suffix = uuid.uuid4().hex[:8]
    node, driver = f"node-{suffix}", f"gpu-{suffix}.test.rota.dev"
    create_node(kube_api, node)
    _objects(kube_api).create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", _shared_slice(node, driver, 40))
    yield node, driver, _device_class(kube_api, driver)
    client.CoreV1Api(kube_api).delete_node(node)


def _read_claim(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return dict(_objects(api).get_namespaced_custom_object(GROUP, VERSION, ns,
                                                           "resourceclaims", name))


def test_two_claims_share_one_device_and_a_third_does_not_fit(
        kube_api: client.ApiClient, namespace: str, dra_node: tuple[str, str, str]) -> None:
    node, driver, device_class = dra_node
    objects, core = _objects(kube_api), client.CoreV1Api(kube_api)
    for claim, memory in (("a", "16Gi"), ("b", "20Gi"), ("c", "8Gi")):
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "resourceclaims",
                                                _claim(claim, device_class, memory))
    for pod, claim in (("pod-a", "a"), ("pod-b", "b")):
        core.create_namespaced_pod(namespace, _pod(pod, node, {"resourceClaimName": claim}))

    def both_bound() -> bool:
        return all(core.read_namespaced_pod(p, namespace).spec.node_name == node
                   for p in ("pod-a", "pod-b"))

    eventually(both_bound, timeout=60, what="both pods bound")
    results = {}
    for claim, gib in (("a", 16), ("b", 20)):
        status = _read_claim(kube_api, namespace, claim)["status"]
        (result,) = status["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (driver, node, "gpu-0")
        assert result["consumedCapacity"] == {"memory": f"{gib}Gi"}
        assert status["reservedFor"][0]["name"] == f"pod-{claim}"
        results[claim] = result
    assert results["a"]["shareID"]
    assert results["b"]["shareID"]
    assert results["a"]["shareID"] != results["b"]["shareID"]

    # 16Gi + 20Gi are taken from 40Gi: an 8Gi claim cannot be placed.
    core.create_namespaced_pod(namespace, _pod("pod-c", node, {"resourceClaimName": "c"}))

    def scheduler_said_why() -> str:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=pod-c,reason=FailedScheduling")
        return " ".join(e.message or "" for e in events.items)

    reason = eventually(scheduler_said_why, timeout=60, what="FailedScheduling event for pod-c")
    assert "cannot allocate all claims" in reason, reason
    assert core.read_namespaced_pod("pod-c", namespace).status.phase == "Pending"
    assert "allocation" not in _read_claim(kube_api, namespace, "c").get("status", {})


def test_claim_template_generates_a_claim_and_the_pod_is_scheduled(
        kube_api: client.ApiClient, namespace: str, dra_node: tuple[str, str, str]) -> None:
    node, _, device_class = dra_node
    objects, core = _objects(kube_api), client.CoreV1Api(kube_api)
    template = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "engine-gpu"},
        "spec": {"spec": _claim("unused", device_class, "4Gi")["spec"]},
    }
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace,
                                            "resourceclaimtemplates", template)
    core.create_namespaced_pod(
        namespace, _pod("templated", node, {"resourceClaimTemplateName": "engine-gpu"}))

    def generated_claim() -> str:
        pod = core.read_namespaced_pod("templated", namespace)
        statuses = pod.status.resource_claim_statuses or []
        return str(statuses[0].resource_claim_name) if statuses else ""

    claim_name = eventually(generated_claim, timeout=60, what="generated claim name on pod")
    eventually(lambda: core.read_namespaced_pod("templated", namespace).spec.node_name == node,
               timeout=60, what="templated pod bound")
    claim = _read_claim(kube_api, namespace, claim_name)
    assert claim["metadata"]["ownerReferences"][0]["name"] == "templated"
    assert claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] == {
        "memory": "4Gi"}


@pytest.fixture(scope="module")
def gate_off_api() -> Iterator[client.ApiClient]:
    """A second control plane (etcd + apiserver only) with DRAConsumableCapacity off."""
    options = ClusterOptions(feature_gates={"DRAConsumableCapacity": False},
                             run_scheduler=False, run_controller_manager=False)
    local = LocalCluster(options=options)
    try:
        local.start()
        api = local.api_client()
        yield api
        api.close()
    finally:
        local.cleanup()


def test_gate_off_apiserver_drops_consumable_capacity_fields(
        gate_off_api: client.ApiClient) -> None:
    create_node(gate_off_api, "gate-off-node")
    body = _shared_slice("gate-off-node", "gpu.test.rota.dev", 40)
    stored = _objects(gate_off_api).create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", body)
    (device,) = stored["spec"]["devices"]
    assert "allowMultipleAllocations" not in device
    assert "requestPolicy" not in device["capacity"]["memory"]
    assert device["capacity"]["memory"]["value"] == "40Gi"
