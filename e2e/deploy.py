"""rota deployed from ``manifests/`` as an admin deploys it, onto a cluster with real nodes.

The files are read as they are and applied in the README's order with server-side apply
(``kubectl apply --server-side``), with two changes an admin would make too: the
activation token is set in the Secret, and, on nodes without a GPU, the DaemonSet's driver
is switched to the fake NVML backend (:func:`with_fake_gpu`: the ``ROTA_NVML_BACKEND``
setting, a recorded H200, and the node's fake device nodes and process registry mounted
at the same paths as on the node, which the driver's CDI specs then name). Engines come
from ``manifests/examples`` the same way.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, dynamic

from e2e.objects import MANIFESTS
from e2e.waiting import eventually

NAMESPACE = "rota-system"
ORDER = ("namespace.yaml", "rbac.yaml", "secret.yaml", "deviceclass.yaml",
         "node-daemonset.yaml", "gateway.yaml")
EXAMPLES = MANIFESTS / "examples"
FIELD_MANAGER = "rota-e2e"
DAEMONSET, GATEWAY, SECRET = "rota-node", "rota-gateway", "rota-activation-token"


@dataclass(frozen=True)
class FakeGpu:
    """What the driver is told on a node with rota's fake GPU."""

    fixture: str = "h200"
    """A fixture bundled with the driver (``driver/nvml/fixtures``), or a file path."""
    proc_dir: str = "/var/lib/rota/fake-nvml"
    """The fake NVML process registry on the node (engines get it through CDI)."""
    dev_root: str = "/var/lib/rota/fake-gpu/dev"
    """The node's directory of the fake GPU's character devices."""


def read(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def read_manifests(directory: Path = MANIFESTS) -> list[dict[str, Any]]:
    """Every object of rota's install, in the order the README applies them."""
    docs: list[dict[str, Any]] = []
    for name in ORDER:
        docs += read(directory / name)
    return docs


def images_of(docs: Iterable[Mapping[str, Any]]) -> set[str]:
    """The container images the objects name."""
    found: set[str] = set()
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec") if "template" in spec else spec
        for key in ("containers", "initContainers"):
            for container in (pod or {}).get(key, []) or []:
                found.add(str(container["image"]))
    return found


def _named(docs: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc.get("kind") == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind} {name} in rota's manifests")


def _set_env(container: dict[str, Any], values: Mapping[str, str]) -> None:
    env = [e for e in container.get("env", []) if e["name"] not in values]
    container["env"] = env + [{"name": k, "value": v} for k, v in values.items()]


def with_fake_gpu(daemonset: Mapping[str, Any], fake: FakeGpu) -> dict[str, Any]:
    """The DaemonSet with its driver on the fake NVML backend."""
    out = copy.deepcopy(dict(daemonset))
    pod = out["spec"]["template"]["spec"]
    driver = next(c for c in pod["containers"] if c["name"] == "driver")
    _set_env(driver, {"ROTA_NVML_BACKEND": "fake", "ROTA_FAKE_NVML_FIXTURE": fake.fixture,
                      "ROTA_FAKE_NVML_PROC_DIR": fake.proc_dir, "ROTA_DEV_ROOT": fake.dev_root})
    mounts = {"fake-nvml": fake.proc_dir, "fake-gpu-dev": fake.dev_root}
    driver["volumeMounts"] = [m for m in driver.get("volumeMounts", [])
                              if m["name"] not in mounts] + [
        {"name": name, "mountPath": path} for name, path in mounts.items()]
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in mounts] + [
        {"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
        for name, path in mounts.items()]
    return out


def pinned_to(workload: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    """A workload whose pods may run only on ``nodes`` (node affinity on the hostname)."""
    out = copy.deepcopy(dict(workload))
    pod = out["spec"]["template"]["spec"]
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}]}]}}}
    return out


def with_token(secret: Mapping[str, Any], token: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(secret))
    out["stringData"] = {"token": token}
    return out


class Applier:
    """Server-side apply of manifest objects through the dynamic client."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self._dynamic: dynamic.DynamicClient | None = None

    @property
    def dynamic(self) -> dynamic.DynamicClient:
        if self._dynamic is None:
            self._dynamic = dynamic.DynamicClient(self.api)
        return self._dynamic

    def apply(self, docs: Iterable[Mapping[str, Any]], namespace: str | None = None) -> None:
        for doc in docs:
            resource = self.dynamic.resources.get(api_version=doc["apiVersion"],
                                                  kind=doc["kind"])
            target = doc.get("metadata", {}).get("namespace") or namespace
            self.dynamic.server_side_apply(
                resource, body=dict(doc), namespace=target if resource.namespaced else None,
                field_manager=FIELD_MANAGER, force_conflicts=True, _request_timeout=30)


@dataclass
class RotaDeployment:
    """rota as applied to a cluster: the objects, and waits on their pods."""

    api: client.ApiClient
    token: str
    docs: list[dict[str, Any]]
    applier: Applier = field(init=False)

    def __post_init__(self) -> None:
        self.applier = Applier(self.api)

    @property
    def daemonset(self) -> dict[str, Any]:
        return _named(self.docs, "DaemonSet", DAEMONSET)

    def apply(self) -> None:
        self.applier.apply(self.docs)

    def pods(self, selector: str) -> list[client.V1Pod]:
        return list(client.CoreV1Api(self.api).list_namespaced_pod(
            NAMESPACE, label_selector=selector, _request_timeout=10).items)

    def node_pods(self, node: str | None = None) -> list[client.V1Pod]:
        pods = self.pods(f"app.kubernetes.io/name={DAEMONSET}")
        return [p for p in pods if node is None or p.spec.node_name == node]

    def gateway_pods(self) -> list[client.V1Pod]:
        return self.pods(f"app.kubernetes.io/name={GATEWAY}")

    def wait_ready(self, nodes: Sequence[str], *, timeout: float = 300.0) -> None:
        """Until a DaemonSet pod is Ready on each node and every gateway replica is."""
        replicas = int(_named(self.docs, "Deployment", GATEWAY)["spec"].get("replicas", 1))

        def ready() -> bool:
            node_pods = {p.spec.node_name: p for p in self.node_pods() if is_ready(p)}
            gateways = [p for p in self.gateway_pods() if is_ready(p)]
            return set(nodes) <= set(node_pods) and len(gateways) >= replicas

        eventually(ready, timeout=timeout, max_interval=2.0, what="rota's pods Ready")


def is_ready(pod: client.V1Pod) -> bool:
    return pod.status is not None and pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def deploy(api: client.ApiClient, *, fake_gpu: FakeGpu | None = FakeGpu(),
           token: str | None = None, gateway_nodes: Sequence[str] = (),
           directory: Path = MANIFESTS) -> RotaDeployment:
    """Apply rota's manifests (with the token set and, by default, the fake GPU).

    ``gateway_nodes`` keeps the gateway on those nodes (a test cluster may also have Node
    objects no kubelet serves).
    """
    token = token or secrets.token_hex(16)
    docs = read_manifests(directory)
    for i, doc in enumerate(docs):
        if doc["kind"] == "Secret" and doc["metadata"]["name"] == SECRET:
            docs[i] = with_token(doc, token)
        elif doc["kind"] == "DaemonSet" and doc["metadata"]["name"] == DAEMONSET and fake_gpu:
            docs[i] = with_fake_gpu(doc, fake_gpu)
        elif doc["kind"] == "Deployment" and doc["metadata"]["name"] == GATEWAY and \
                gateway_nodes:
            docs[i] = pinned_to(doc, gateway_nodes)
    deployment = RotaDeployment(api=api, token=token, docs=docs)
    deployment.apply()
    return deployment


def deploy_examples(api: client.ApiClient, namespace: str, path: Path = EXAMPLES /
                    "two-models.yaml") -> list[dict[str, Any]]:
    """Apply an example (claims and engine pods) in ``namespace``; its objects."""
    docs = read(path)
    Applier(api).apply(docs, namespace)
    return docs
