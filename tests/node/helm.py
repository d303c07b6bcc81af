"""A Helm release of rota on a real node of its own, for the install tests: the release
(helm with its own homes, the values an admin sets, its pods), the node it runs on, and
its namespaces, set up and removed by :func:`helm_stage`."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from kubernetes import client

from controller.lease.visible_state import LABEL_STATE
from e2e.cluster import LocalCluster
from e2e.cluster.binaries import locate
from e2e.cluster.realnode import FAKE_GPU_DEV_ROOT, GPU_LABELS, RealNode, RealNodeOptions
from e2e.harness.deploy import RotaDeployment, is_ready
from e2e.harness.rota_node import GATEWAY_PORT, EnginePod, RotaOnNodes
from e2e.harness.scenario import ask_seven
from e2e.harness.waiting import WaitTimeout, eventually, eventually_async
from e2e.images import BuiltImages
from e2e.release.chart import run_tool, tools_bin
from rota.api import naming

PROC_DIR = "/var/lib/kubelet/plugins/gpu.rota.dev/fake-nvml"
"""The fake NVML process registry: inside the driver's plugin directory, a host path the
chart mounts at the same path."""


def helm_homes(root: Path) -> dict[str, str]:
    """Helm's cache, config and data homes under ``root`` (none of the machine's)."""
    return {f"HELM_{kind}_HOME": str(root / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}


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
    node_label: str
    """The label that selects the release's node (the session's rota selects its own)."""
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
                f"nodeSelection.label.key={self.node_label}",
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
                kubectl(self, "-n", self.namespace, "get", "pods", "-o", "wide")
                + kubectl(self, "-n", self.namespace, "get", "events")
                + kubectl(self, "-n", self.namespace, "describe", "pods")[-6000:]) from exc

    def gateway_url(self) -> str:
        (pod,) = self.ready("gateway")
        return self.rota.pod_url(pod, GATEWAY_PORT)

    def holder(self) -> tuple[str, str]:
        lease = client.CoordinationV1Api(self.api).read_namespaced_lease(
            naming.gpu_lease_name(self.node.name, "gpu-0"), self.namespace,
            _request_timeout=10)
        annotations = lease.metadata.annotations or {}
        return lease.spec.holder_identity or "", annotations.get(naming.HOLDER_MODEL, "")


async def switch_to_the_sleeping_model(release: HelmRelease) -> str:
    """Ask one model through the gateway (the controller gives it the GPU, unless it holds
    it already: engines whose pods were not yet Ready when they came up are put to sleep,
    and nobody is woken before a request asks), then the other, asleep one: it answers,
    then holds the GPU, and the engines' state labels say one awake, one asleep. The
    model switched to."""
    gateway = release.gateway_url()

    async def answered(model: str) -> str:
        async with aiohttp.ClientSession() as session:
            return await ask_seven(session, gateway, model)

    models = sorted(e.model for e in release.engine_pods)
    try:
        first = await eventually_async(lambda: answered(models[0]), timeout=180,
                                       max_interval=3.0,
                                       what=f"an answer from {models[0]} through the gateway")
    except WaitTimeout as exc:
        raise AssertionError(
            kubectl(release, "-n", release.engines, "get", "pods", "-o", "wide")
            + kubectl(release, "-n", release.engines, "get", "events")
            + kubectl(release, "-n", release.namespace, "logs", "--tail", "60",
                      "-l", "app.kubernetes.io/component=controller")[-8000:]) from exc
    assert first.strip() == "7"
    holder = release.holder()
    assert holder[0].startswith(f"{release.engines}/")
    (asleep,) = set(models) - {holder[1]}
    answer = await eventually_async(lambda: answered(asleep), timeout=180, max_interval=3.0,
                                    what=f"an answer from {asleep} through the gateway")
    assert answer.strip() == "7"
    assert release.holder()[1] == asleep
    eventually(lambda: engine_states(release) == ["asleep", "awake"], timeout=60,
               what="one engine awake, one asleep")
    return asleep


def kubectl(release: HelmRelease, *args: str) -> str:
    """kubectl's output (stdout, then stderr) against the session's cluster."""
    done = subprocess.run([str(locate() / "kubectl"), "--kubeconfig",
                           str(release.cluster.kubeconfig), *args],
                          capture_output=True, text=True, check=False, timeout=60)
    return done.stdout + done.stderr


def engine_states(release: HelmRelease) -> list[str]:
    """The ``gpu.rota.dev/state`` labels of the release's engine pods, sorted."""
    pods = client.CoreV1Api(release.api).list_namespaced_pod(release.engines,
                                                              _request_timeout=10).items
    return sorted((p.metadata.labels or {}).get(LABEL_STATE, "") for p in pods)



@contextmanager
def helm_stage(cluster: LocalCluster, api: client.ApiClient, images: BuiltImages, *,
               root: Path, node: str, node_label: str, prefix: str,
               registry_ports: Sequence[int] = ()) -> Iterator[HelmRelease]:
    """A real node labelled ``node_label`` (pulling from ``registry_ports`` on the
    loopback address), a release named after ``prefix`` with its namespace and its
    engines' namespace: uninstalled (if installed), the namespaces deleted and the node
    stopped on the way out."""
    suffix = uuid.uuid4().hex[:6]
    real = RealNode(cluster, node, images, bin_dir=locate(), options=RealNodeOptions(
        labels={**GPU_LABELS, node_label: "true"}, registry_ports=list(registry_ports)))
    release = HelmRelease(name=f"{prefix}{suffix}", namespace=f"rota-{prefix}{suffix}",
                          engines=f"eng-{prefix}{suffix}", cluster=cluster, api=api,
                          node=real, bin_dir=tools_bin(), env=helm_homes(root),
                          node_label=node_label)
    core = client.CoreV1Api(api)
    real.start()
    try:
        # A device root other than /dev is mounted with HostToContainer propagation, which
        # needs a shared mount on the node (as systemd makes every mount).
        assert real.namespace is not None
        subprocess.run(real.namespace.enter(["mount", "--make-rshared", "/var/lib"],
                                            network=False), check=True, timeout=30)
        for ns in (release.namespace, release.engines):
            core.create_namespace({"metadata": {"name": ns}})
        yield release
    finally:
        if release.installed:
            release.helm("uninstall", release.name, "--namespace", release.namespace,
                         check=False)
        for ns in (release.engines, release.namespace):
            try:
                core.delete_namespace(ns)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        real.stop()
