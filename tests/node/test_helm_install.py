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
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from controller import naming
from controller.kubectl_rota import main as kubectl_rota
from controller.visible_state import LABEL_STATE, EventReason
from e2e.chaos.load import client_loop, into_tally
from e2e.chaos.tally import Answer, Tally
from e2e.chart import CHART, run_tool, tools_bin
from e2e.cluster import LocalCluster
from e2e.cluster.binaries import locate
from e2e.cluster.realnode import FAKE_GPU_DEV_ROOT, GPU_LABELS, RealNode, RealNodeOptions
from e2e.deploy import RotaDeployment, is_ready
from e2e.images import BuiltImages
from e2e.rota_node import GATEWAY_PORT, EnginePod, RotaOnNodes
from e2e.scenario import ask_seven
from e2e.waiting import WaitTimeout, eventually, eventually_async
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root, pytest.mark.slow]

NODE = "rota-helm-node"
NODE_LABEL = "rota.test/helm-node"
"""The label that selects the release's node (the session's rota selects its own)."""
PROC_DIR = "/var/lib/kubelet/plugins/gpu.rota.dev/fake-nvml"
"""The fake NVML process registry: inside the driver's plugin directory, a host path the
chart mounts at the same path."""


@dataclass
class HelmRelease:
    name: str
    namespace: str
    engines: str
    cluster: LocalCluster
    api: client.ApiClient
    node: RealNode
    bin_dir: Path
    env: dict[str, str]
    installed: bool = False
    rota: RotaOnNodes = field(init=False)
    engine_pods: list[EnginePod] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Only the node and the API of this helper are used (engines, relays).
        self.rota = RotaOnNodes(self.cluster, [self.node],
                                RotaDeployment(api=self.api, token="", docs=[]))

    @property
    def fullname(self) -> str:
        return f"{self.name}-rota"

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_tool("helm", [*args, "--kubeconfig", str(self.cluster.kubeconfig)],
                        bin_dir=self.bin_dir, env=self.env, timeout_s=300, check=check)

    def values(self, *extra: str) -> list[str]:
        """What the admin sets: the engine namespace, the node label, and (no GPU on this
        node) the fake NVML backend with the fake GPU's device nodes."""
        sets = ["deviceClass.create=false",  # the session's tests share the DeviceClass
                f"engineNamespaces={{{self.engines}}}",
                f"gateway.modelBinding.namespaces={{{self.engines}}}",
                "gateway.replicas=1",
                f"nodeSelection.label.key={NODE_LABEL}",
                "nvml.fakeFixture=h200",
                f"cdi.devRoot={FAKE_GPU_DEV_ROOT}",
                "driver.extraEnv[0].name=ROTA_FAKE_NVML_PROC_DIR",
                f"driver.extraEnv[0].value={PROC_DIR}",
                "image.pullPolicy=IfNotPresent", *extra]
        args = ["--namespace", self.namespace,
                "--set-string", f"gateway.nodeSelector.kubernetes\\.io/hostname={self.node.name}"]
        for item in sets:
            args += ["--set", item]
        return args

    def pods(self, component: str) -> list[client.V1Pod]:
        return list(client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=f"app.kubernetes.io/component={component},"
                                           f"app.kubernetes.io/instance={self.name}",
            _request_timeout=10).items)

    def ready(self, component: str) -> list[client.V1Pod]:
        return [p for p in self.pods(component) if is_ready(p)]

    def wait_ready(self) -> None:
        try:
            eventually(lambda: all(len(self.ready(c)) == 1 for c in
                                   ("driver", "controller", "gateway")),
                       timeout=300, max_interval=2.0,
                       what="driver, controller and gateway Ready")
        except WaitTimeout as exc:
            raise AssertionError(
                _kubectl(self, "-n", self.namespace, "get", "pods", "-o", "wide")
                + _kubectl(self, "-n", self.namespace, "get", "events")
                + _kubectl(self, "-n", self.namespace, "describe", "pods")[-6000:]) from exc

    def gateway_url(self) -> str:
        (pod,) = self.ready("gateway")
        return self.rota.pod_url(pod, GATEWAY_PORT)

    def holder(self) -> tuple[str, str]:
        lease = client.CoordinationV1Api(self.api).read_namespaced_lease(
            naming.gpu_lease_name(self.node.name, "gpu-0"), self.namespace,
            _request_timeout=10)
        annotations = lease.metadata.annotations or {}
        return lease.spec.holder_identity or "", annotations.get(naming.HOLDER_MODEL, "")


@pytest.fixture(scope="module")
def release(cluster: LocalCluster, kube_api: client.ApiClient, rota_images: BuiltImages,
            device_class: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[HelmRelease]:
    helm_root = tmp_path_factory.mktemp("helm")
    helm_home = {f"HELM_{kind}_HOME": str(helm_root / kind.lower())
                 for kind in ("CACHE", "CONFIG", "DATA")}
    suffix = uuid.uuid4().hex[:6]
    node = RealNode(cluster, NODE, rota_images, bin_dir=locate(),
                    options=RealNodeOptions(labels={**GPU_LABELS, NODE_LABEL: "true"}))
    rel = HelmRelease(name=f"h{suffix}", namespace=f"rota-h{suffix}",
                      engines=f"eng-h{suffix}", cluster=cluster, api=kube_api, node=node,
                      bin_dir=tools_bin(), env=helm_home)
    core = client.CoreV1Api(kube_api)
    node.start()
    try:
        # A device root other than /dev is mounted with HostToContainer propagation, which
        # needs a shared mount on the node (as systemd makes every mount).
        assert node.namespace is not None
        subprocess.run(node.namespace.enter(["mount", "--make-rshared", "/var/lib"],
                                            network=False), check=True, timeout=30)
        for ns in (rel.namespace, rel.engines):
            core.create_namespace({"metadata": {"name": ns}})
        rel.helm("install", rel.name, str(CHART), *rel.values())
        rel.installed = True
        yield rel
    finally:
        if rel.installed:
            rel.helm("uninstall", rel.name, "--namespace", rel.namespace, check=False)
        for ns in (rel.engines, rel.namespace):
            try:
                core.delete_namespace(ns)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        node.stop()


def _kubectl(release: HelmRelease, *args: str) -> str:
    done = subprocess.run([str(locate() / "kubectl"), "--kubeconfig",
                           str(release.cluster.kubeconfig), *args],
                          capture_output=True, text=True, check=False, timeout=60)
    return done.stdout + done.stderr


def _states(release: HelmRelease) -> list[str]:
    pods = client.CoreV1Api(release.api).list_namespaced_pod(release.engines,
                                                              _request_timeout=10).items
    return sorted((p.metadata.labels or {}).get(LABEL_STATE, "") for p in pods)


def _switched_in(release: HelmRelease, model_pod: str) -> bool:
    events = client.CoreV1Api(release.api).list_namespaced_event(release.engines,
                                                                 _request_timeout=10).items
    return any(e.reason == EventReason.SWITCHED_IN and e.involved_object.name == model_pod
               for e in events)


async def test_install_brings_rota_up_and_engines_switch(release: HelmRelease) -> None:
    release.wait_ready()
    release.engine_pods = release.rota.deploy_engines(release.engines)
    models = {e.model: e for e in release.engine_pods}
    holder = eventually(lambda: release.holder() if release.holder()[0]
                        .startswith(f"{release.engines}/") else None,
                        timeout=180, what="the controller holding the GPU for one engine")
    assert holder is not None
    (asleep,) = set(models) - {holder[1]}
    gateway = release.gateway_url()

    async def answered() -> str:
        async with aiohttp.ClientSession() as session:
            return await ask_seven(session, gateway, asleep)

    answer = await eventually_async(answered, timeout=180, max_interval=3.0,
                                    what=f"an answer from {asleep} through the gateway")
    assert answer.strip() == "7"
    assert release.holder()[1] == asleep
    eventually(lambda: _states(release) == ["asleep", "awake"], timeout=60,
               what="one engine awake, one asleep")
    eventually(lambda: _switched_in(release, models[asleep].name), timeout=60,
               what=f"a SwitchedIn event for {models[asleep].name}")

    status = io.StringIO()
    code = await asyncio.to_thread(kubectl_rota, [
        "--kubeconfig", str(release.cluster.kubeconfig), "-n", release.namespace,
        "--secret", f"{release.fullname}-activation-token", "status"], status)
    print("\n$ kubectl get pods -L gpu.rota.dev/state\n"
          + _kubectl(release, "-n", release.engines, "get", "pods", "-L", LABEL_STATE))
    print("$ kubectl get events\n" + _kubectl(release, "-n", release.engines, "get", "events"))
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
