"""The cluster admin's install, on a real node: ``helm install`` of ``charts/rota`` brings up
the driver, the lease controller and the gateway, the example engines switch through the
gateway, ``helm upgrade`` with a changed driver setting rolls the driver DaemonSet while a
client keeps asking through the gateway (no request left unanswered), and ``helm
uninstall`` leaves only what the admin keeps.

The release runs on a node of its own (started here), selected by a label of its own: the
session's rota (deployed from ``manifests/``) keeps its node and its names.
"""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from controller.kubectl_rota import main as kubectl_rota
from controller.lease.visible_state import LABEL_STATE, EventReason
from e2e.chaos.load import client_loop, into_tally
from e2e.chaos.tally import Answer, Tally
from e2e.cluster import LocalCluster
from e2e.harness.deploy import is_ready
from e2e.harness.waiting import eventually, eventually_async
from e2e.images import BuiltImages
from e2e.release.chart import CHART
from tests.node.helm import (
    HelmRelease,
    helm_stage,
    kubectl,
    switch_to_the_sleeping_model,
)
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root, pytest.mark.slow]

NODE = "rota-helm-node"
NODE_LABEL = "rota.test/helm-node"
"""The label that selects the release's node (the session's rota selects its own)."""


@pytest.fixture(scope="module")
def release(cluster: LocalCluster, kube_api: client.ApiClient, rota_images: BuiltImages,
            device_class: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[HelmRelease]:
    with helm_stage(cluster, kube_api, rota_images, root=tmp_path_factory.mktemp("helm"),
                    node=NODE, node_label=NODE_LABEL, prefix="h") as rel:
        rel.helm("install", rel.name, str(CHART), *rel.values())
        rel.installed = True
        yield rel


def _switched_in(release: HelmRelease, model_pod: str) -> bool:
    events = client.CoreV1Api(release.api).list_namespaced_event(release.engines,
                                                                 _request_timeout=10).items
    return any(e.reason == EventReason.SWITCHED_IN and e.involved_object.name == model_pod
               for e in events)


async def test_install_brings_rota_up_and_engines_switch(release: HelmRelease) -> None:
    release.wait_ready()
    release.engine_pods = release.rota.deploy_engines(release.engines)
    models = {e.model: e for e in release.engine_pods}
    asleep = await switch_to_the_sleeping_model(release)
    eventually(lambda: _switched_in(release, models[asleep].name), timeout=60,
               what=f"a SwitchedIn event for {models[asleep].name}")

    status = io.StringIO()
    code = await asyncio.to_thread(kubectl_rota, [
        "--kubeconfig", str(release.cluster.kubeconfig), "-n", release.namespace,
        "--secret", f"{release.fullname}-activation-token", "status"], status)
    print("\n$ kubectl get pods -L gpu.rota.dev/state\n"
          + kubectl(release, "-n", release.engines, "get", "pods", "-L", LABEL_STATE))
    print("$ kubectl get events\n" + kubectl(release, "-n", release.engines, "get", "events"))
    print(f"$ kubectl rota status  (exit {code})\n{status.getvalue()}")
    assert code == 0
    assert asleep in status.getvalue()


async def test_upgrade_rolls_the_driver_while_clients_are_answered(
        release: HelmRelease) -> None:
    if not release.engine_pods:
        pytest.fail("needs the engines of the install test")
    old = {p.metadata.uid for p in release.pods("driver")}
    models = sorted(e.model for e in release.engine_pods)
    restarts = {e.name: _restarts(e.pod(release.api)) for e in release.engine_pods}
    gateway = release.gateway_url()
    tally = Tally()
    stop = asyncio.Event()

    def rolled() -> bool:
        pods = release.pods("driver")
        return bool(pods) and all(p.metadata.uid not in old and is_ready(p) for p in pods)

    async with aiohttp.ClientSession() as session:
        loop = asyncio.create_task(client_loop(session, [gateway], models, into_tally(tally), stop,
                                               rng=random.Random(7), timeout_s=120))
        try:
            await asyncio.to_thread(release.helm, "upgrade", release.name, str(CHART),
                                    *release.values(), "--set-string",
                                    "driver.podAnnotations.rota\\.test/revision=2")
            await asyncio.to_thread(eventually, rolled, timeout=240, max_interval=2.0,
                                    what="the driver DaemonSet rolled to a new pod")
            await eventually_async(_async(lambda: tally.answers[Answer.OK] >= 4),
                                   timeout=120, what="answers after the rollout")
        finally:
            stop.set()
            await loop
    print(f"\nclient during the rollout: {dict(tally.answers)}")
    assert tally.answers[Answer.UNANSWERED] == 0, tally.unanswered_samples
    assert {e.name: _restarts(e.pod(release.api)) for e in release.engine_pods} == restarts


def _restarts(pod: client.V1Pod) -> int:
    return sum(c.restart_count for c in pod.status.container_statuses or [])


def _async(check: Callable[[], bool]) -> Callable[[], Any]:
    async def run() -> bool:
        return check()
    return run


def test_uninstall_leaves_only_what_the_admin_keeps(release: HelmRelease) -> None:
    release.helm("uninstall", release.name, "--namespace", release.namespace)
    release.installed = False
    selector = f"app.kubernetes.io/instance={release.name}"
    core = client.CoreV1Api(release.api)
    apps = client.AppsV1Api(release.api)
    rbac = client.RbacAuthorizationV1Api(release.api)
    admission = client.AdmissionregistrationV1Api(release.api)
    eventually(lambda: not core.list_namespaced_pod(release.namespace,
                                                    _request_timeout=10).items,
               timeout=600, max_interval=2.0, what="the release's pods gone")
    listings: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("pods", lambda: core.list_namespaced_pod(release.namespace)),
        ("services", lambda: core.list_namespaced_service(release.namespace)),
        ("secrets", lambda: core.list_namespaced_secret(release.namespace)),
        ("configmaps", lambda: core.list_namespaced_config_map(release.namespace,
                                                               label_selector=selector)),
        ("serviceaccounts", lambda: core.list_namespaced_service_account(
            release.namespace, label_selector=selector)),
        ("daemonsets", lambda: apps.list_namespaced_daemon_set(release.namespace)),
        ("deployments", lambda: apps.list_namespaced_deployment(release.namespace)),
        ("clusterroles", lambda: rbac.list_cluster_role(label_selector=selector)),
        ("clusterrolebindings", lambda: rbac.list_cluster_role_binding(
            label_selector=selector)),
        ("roles", lambda: rbac.list_role_for_all_namespaces(label_selector=selector)),
        ("policies", lambda: admission.list_validating_admission_policy(
            label_selector=selector)),
        ("bindings", lambda: admission.list_validating_admission_policy_binding(
            label_selector=selector)),
        ("networkpolicies", lambda: client.NetworkingV1Api(release.api)
         .list_network_policy_for_all_namespaces(label_selector=selector)))
    left = [f"{what}/{item.metadata.name}" for what, listing in listings
            for item in listing().items]
    # The Leases the controllers wrote at run time are no chart object: helm leaves them
    # in the release's namespace (printed, not asserted).
    leases = [lease.metadata.name for lease in client.CoordinationV1Api(release.api)
              .list_namespaced_lease(release.namespace).items]
    print(f"\nleft in {release.namespace} after uninstall: leases {leases}")
    assert not left
    # What the admin keeps: the namespaces, the DeviceClass, the engines.
    core.read_namespace(release.namespace)
    assert {p.metadata.name for p in core.list_namespaced_pod(release.engines).items} == \
        {e.name for e in release.engine_pods}
