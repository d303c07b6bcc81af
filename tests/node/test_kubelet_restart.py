"""A kubelet restart on the real node: the kubelet deletes the node's ResourceSlices and
registers the driver again from its socket; the driver publishes the slices again; running
engines are left alone; a new pod of an already prepared claim is answered from the
ledger, with no second CDI spec."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.harness.objects import node_slices, read_claim
from e2e.harness.rota_node import RotaOnNodes
from e2e.harness.waiting import eventually
from tests.node.test_claims import cdi_specs, ledger
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]

REGISTERED = "kubelet registered the plugin"


def _containers(api: client.ApiClient, namespace: str, names: list[str]
                ) -> dict[str, list[tuple[str, int]]]:
    core = client.CoreV1Api(api)
    return {n: [(c.container_id, c.restart_count) for c in
                core.read_namespaced_pod(n, namespace).status.container_statuses]
            for n in names}


def test_kubelet_restart(kube_api: client.ApiClient, rota_node: RotaOnNodes,
                         namespace: str) -> None:
    node = rota_node.node()
    engines = rota_node.deploy_engines(namespace)
    driver_pod = rota_node.driver_pod()
    controller_pod = rota_node.controller_pod()
    before = _containers(kube_api, namespace, [e.name for e in engines])
    rota_pods = [driver_pod.metadata.name, controller_pod.metadata.name]
    rota_before = _containers(kube_api, "rota-system", rota_pods)
    (slice_before,) = node_slices(kube_api, node.name)
    # Other tests' claims may come and go meanwhile: compare this test's alone.
    mine = {read_claim(kube_api, namespace, e.claim)["metadata"]["uid"] for e in engines}
    specs_before = {u: s for u, s in cdi_specs(node).items() if u in mine}
    records_before = {u: r for u, r in ledger(node).items() if u in mine}
    assert set(specs_before) == set(records_before) == mine
    registrations = rota_node.logs(driver_pod, "driver").count(REGISTERED)

    node.restart_kubelet()

    eventually(lambda: rota_node.logs(driver_pod, "driver").count(REGISTERED) > registrations,
               timeout=120, what="the driver registered again")

    def slice_recreated() -> bool:
        slices = node_slices(kube_api, node.name)
        return len(slices) == 1 and slices[0]["metadata"]["uid"] != \
            slice_before["metadata"]["uid"]

    eventually(slice_recreated, timeout=120, what="the node's slice deleted and published again")

    # A new pod sharing an already prepared claim: the kubelet (its checkpoint reloaded as
    # unprepared) asks again; the driver answers from its ledger.
    claim = engines[0].claim
    reuse = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "reuse"},
             "spec": {"nodeSelector": {"kubernetes.io/hostname": node.name},
                      "containers": [{"name": "idle", "image": "ghcr.io/rota-dev/rota:0.1.0",
                                      "command": ["python", "-c",
                                                  "import time; time.sleep(3600)"],
                                      "resources": {"claims": [{"name": "gpu"}]}}],
                      "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}}
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(namespace, reuse)
    eventually(lambda: core.read_namespaced_pod("reuse", namespace).status.phase == "Running",
               timeout=180, what="a second pod of a prepared claim running")
    assert {u: r for u, r in ledger(node).items() if u in mine} == records_before
    assert {u: s for u, s in cdi_specs(node).items() if u in mine} == specs_before
    spec_files = list(node.path("/var/run/cdi").glob("*.json"))
    assert len([f for f in spec_files if any(u in f.name for u in mine)]) == len(mine)

    # Nothing that ran was restarted.
    assert _containers(kube_api, namespace, [e.name for e in engines]) == before
    assert _containers(kube_api, "rota-system", rota_pods) == rota_before
