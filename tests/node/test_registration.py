"""The real node: a kubelet that authenticated as system:node:<name>, and rota's driver,
started by the DaemonSet, registered by the kubelet's plugin watcher and publishing the
fake GPU's ResourceSlice."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.cluster.realnode import RealNode
from e2e.harness.objects import node_slices
from e2e.harness.rota_node import RotaOnNodes
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]


def test_the_node_runs_the_pinned_versions(kube_api: client.ApiClient,
                                           real_node: RealNode) -> None:
    node = client.CoreV1Api(kube_api).read_node(real_node.name)
    info = node.status.node_info
    assert info.kubelet_version == "v1.37.2"
    assert info.container_runtime_version == "containerd://2.4.2"
    assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
    addresses = {a.type: a.address for a in node.status.addresses}
    assert addresses == {"InternalIP": real_node.node_ip, "Hostname": real_node.name}


def test_the_kubelet_registered_the_driver_and_slices_appear(
        kube_api: client.ApiClient, rota_node: RotaOnNodes) -> None:
    node = rota_node.node()
    pod = rota_node.driver_pod()
    registry = node.path("/var/lib/kubelet/plugins_registry")
    assert (registry / f"gpu.rota.dev-{pod.metadata.uid}-reg.sock").exists()
    # NotifyRegistrationStatus(true) comes from the kubelet alone; `kubectl logs` goes
    # through the apiserver to the kubelet.
    log = client.CoreV1Api(kube_api).read_namespaced_pod_log(
        pod.metadata.name, "rota-system", container="driver")
    assert "kubelet registered the plugin" in log
    (slice_,) = node_slices(kube_api, node.name)
    (device,) = slice_["spec"]["devices"]
    assert device["name"] == "gpu-0"
    assert device["attributes"]["productName"]["string"].startswith("NVIDIA H200")
