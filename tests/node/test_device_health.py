"""The kubelet's view of device health on the real node: the driver's health stream
(v1.DRAResourceHealth, re-sent every few seconds) keeps the engine pods'
allocatedResourcesStatus Healthy for minutes; an XID the fake NVML reports turns it
Unhealthy. The driver pod is replaced afterwards, so the GPU is healthy again for the
tests that follow."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client, watch

from driver.nvml import HealthEvent, HealthEventKind
from driver.nvml.fake import write_health_event
from e2e.harness.deploy import FakeGpu, is_ready
from e2e.harness.objects import node_slices
from e2e.harness.rota_node import RotaOnNodes
from e2e.harness.waiting import eventually
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, needs_root]

OBSERVE_S = 130


def _health(pod: Any) -> list[str]:
    """Every device health the kubelet reports in the pod's container statuses."""
    found: list[str] = []
    for status in pod.status.container_statuses or []:
        for allocated in status.allocated_resources_status or []:
            found += [str(r.health) for r in allocated.resources or []]
    return found


@pytest.mark.sampled
def test_allocated_resources_stay_healthy_then_an_xid_makes_them_unhealthy(
        kube_api: client.ApiClient, rota_node: RotaOnNodes, namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    engines = rota_node.deploy_engines(namespace)
    names = [e.name for e in engines]
    eventually(lambda: all(_health(core.read_namespaced_pod(n, namespace)) == ["Healthy"]
                           for n in names),
               timeout=120, what="both engines' devices reported Healthy")

    # Every status update the kubelet writes over two minutes says Healthy (it would say
    # Unknown 30 s after the driver's last report).
    seen: list[list[str]] = []
    stream = watch.Watch()
    for event in stream.stream(core.list_namespaced_pod, namespace,
                               timeout_seconds=OBSERVE_S, _request_timeout=OBSERVE_S + 30):
        pod = event["object"]
        if pod.metadata.name in names:
            seen.append(_health(pod))
    assert seen
    assert all(h == ["Healthy"] for h in seen), seen
    assert all(_health(core.read_namespaced_pod(n, namespace)) == ["Healthy"] for n in names)

    (slice_,) = node_slices(kube_api, rota_node.node().name)
    gpu_uuid = slice_["spec"]["devices"][0]["attributes"]["uuid"]["string"]
    write_health_event(rota_node.node().path(FakeGpu().proc_dir),
                       HealthEvent(gpu_uuid, HealthEventKind.XID, 79,
                                   "GPU has fallen off the bus"))
    eventually(lambda: all(_health(core.read_namespaced_pod(n, namespace)) == ["Unhealthy"]
                           for n in names),
               timeout=120, what="both engines' devices reported Unhealthy")

    # A new driver pod starts with the GPU healthy (nothing reports it unhealthy again).
    old = rota_node.driver_pod()
    core.delete_namespaced_pod(old.metadata.name, "rota-system")

    def replaced() -> bool:
        pods = rota_node.deployment.driver_pods(rota_node.node().name)
        return [p.metadata.uid for p in pods if is_ready(p)] not in ([], [old.metadata.uid])

    eventually(replaced, timeout=180, what="a new driver pod Ready")
    eventually(lambda: not any(d.get("taints") for d in node_slices(
        kube_api, rota_node.node().name)[0]["spec"]["devices"]),
        timeout=120, what="the GPU's devices untainted")
