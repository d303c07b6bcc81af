"""A rolling update of rota's DaemonSet on the real node (maxSurge 1): the new driver pod
starts next to the old one, each with sockets named after its pod uid; prepares keep
working; the old pod, stopping, removes its own sockets and leaves the new one's."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.harness.deploy import DRIVER, is_ready, restarted
from e2e.harness.rota_node import RotaOnNodes, engine_docs
from e2e.harness.waiting import eventually
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]

PLUGIN = "/var/lib/kubelet/plugins/gpu.rota.dev"
REGISTRY = "/var/lib/kubelet/plugins_registry"


def test_rolling_update_overlaps_old_and_new_driver(
        kube_api: client.ApiClient, rota_node: RotaOnNodes, namespace: str) -> None:
    node = rota_node.node()
    old = rota_node.driver_pod()
    old_uid = old.metadata.uid
    rota_node.deploy_engines(namespace)

    rota_node.deployment.applier.apply([restarted(rota_node.deployment.daemonset(DRIVER))])

    def overlap() -> client.V1Pod | None:
        pods = rota_node.deployment.driver_pods(node.name)
        new = [p for p in pods if p.metadata.uid != old_uid and p.status.phase == "Running"]
        old_running = any(p.metadata.uid == old_uid and p.status.phase == "Running"
                          for p in pods)
        registry = node.path(REGISTRY)
        if new and old_running and (
                registry / f"gpu.rota.dev-{new[0].metadata.uid}-reg.sock").exists() and (
                registry / f"gpu.rota.dev-{old_uid}-reg.sock").exists():
            return new[0]
        return None

    new_pod = eventually(overlap, timeout=180, interval=0.2, max_interval=0.5,
                         what="old and new driver pods running side by side")
    assert new_pod is not None
    new_uid = new_pod.metadata.uid
    # A claim prepared while (or right after) the two overlap.
    rota_node.deploy_engines(namespace, docs=engine_docs("model-c", model="org/model-c",
                                                         resident="1Gi", awake="10Gi"))

    def old_gone() -> bool:
        pods = rota_node.deployment.driver_pods(node.name)
        return [p.metadata.uid for p in pods] == [new_uid] and is_ready(pods[0])

    eventually(old_gone, timeout=240, what=f"{DRIVER} rolled over to the new pod")
    plugin, registry = node.path(PLUGIN), node.path(REGISTRY)
    eventually(lambda: not (registry / f"gpu.rota.dev-{old_uid}-reg.sock").exists(),
               timeout=60, what="the old pod's registration socket removed")
    assert not (plugin / f"dra-{old_uid}.sock").exists()
    assert not (plugin / "inspect" / f"inspect-{old_uid}.sock").exists()
    assert (registry / f"gpu.rota.dev-{new_uid}-reg.sock").exists()
    assert (plugin / f"dra-{new_uid}.sock").exists()
    inspect = plugin / "inspect"
    assert (inspect / "inspect.sock").resolve() == inspect / f"inspect-{new_uid}.sock"
