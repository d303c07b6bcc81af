"""rota deployed from ``manifests/`` as an admin deploys it, onto a cluster with real nodes.

What the README's "without Helm" steps do, with server-side apply (``kubectl apply
--server-side``): ``namespace.yaml``, the activation token's Secret (a random token), then
every other file of ``manifests/`` in name order, and the GPU nodes labelled
``gpu.rota.dev/enabled=true``. The files are read as they are; what an admin would set is
changed in memory: the gateway's model binding (which namespaces may serve models), and,
on nodes without a GPU, the driver DaemonSet switched to the fake NVML backend
(:func:`with_fake_gpu`: the chart's ``nvml.fakeFixture`` setting, plus the node's fake
device nodes and process registry mounted at their node paths, which the driver's CDI
specs then name; the host's NVML library is not mounted). Engines come from
``manifests/examples`` the same way.
"""

from __future__ import annotations

import copy
import datetime as dt
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, dynamic

from e2e.harness.objects import MANIFESTS, ROTA_NAMESPACE
from e2e.harness.waiting import eventually

NAMESPACE = ROTA_NAMESPACE
EXAMPLES = MANIFESTS / "examples"
FIELD_MANAGER = "rota-e2e"
DRIVER, CONTROLLER, GATEWAY = "rota-driver", "rota-controller", "rota-gateway"
SECRET, MODEL_BINDING = "rota-activation-token", "rota-gateway-model-binding"
NODE_LABEL = ("gpu.rota.dev/enabled", "true")
"""What an admin labels the nodes rota runs on with (the chart's default selection)."""


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
    """Every object of ``manifests/`` (not the examples), the Namespace first, then the
    files in name order, as ``kubectl apply -f manifests/`` takes them."""
    first = directory / "namespace.yaml"
    docs = read(first) if first.exists() else []
    for path in sorted(directory.glob("*.yaml")):
        if path != first:
            docs += read(path)
    return docs


def secret(token: str) -> dict[str, Any]:
    """``kubectl -n rota-system create secret generic rota-activation-token``."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": SECRET, "namespace": NAMESPACE},
            "stringData": {"token": token}}


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
    """The driver DaemonSet on the fake NVML backend: what the chart renders with
    ``nvml.fakeFixture`` (no NVML library mounted), plus the fake GPU's process registry
    and device nodes."""
    out = copy.deepcopy(dict(daemonset))
    pod = out["spec"]["template"]["spec"]
    driver = next(c for c in pod["containers"] if c["name"] == "driver")
    library = {m["name"] for m in driver.get("volumeMounts", [])
               if "libnvidia-ml" in m["mountPath"]}
    driver["env"] = [e for e in driver.get("env", []) if e["name"] != "LD_LIBRARY_PATH"]
    _set_env(driver, {"ROTA_NVML_BACKEND": "fake", "ROTA_FAKE_NVML_FIXTURE": fake.fixture,
                      "ROTA_FAKE_NVML_PROC_DIR": fake.proc_dir, "ROTA_DEV_ROOT": fake.dev_root,
                      # mounted below at its own path, live
                      "ROTA_DEV_ROOT_MOUNT": fake.dev_root})
    mounts = {"fake-nvml": fake.proc_dir, "fake-gpu-dev": fake.dev_root}
    drop = library | set(mounts)
    driver["volumeMounts"] = [m for m in driver.get("volumeMounts", [])
                              if m["name"] not in drop] + [
        {"name": name, "mountPath": path} for name, path in mounts.items()]
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in drop] + [
        {"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
        for name, path in mounts.items()]
    return out


def with_model_binding(config_map: Mapping[str, Any], namespaces: Sequence[str]
                       ) -> dict[str, Any]:
    """The gateway's binding with ``namespaces`` serving any model (``*``: all)."""
    out = copy.deepcopy(dict(config_map))
    out["data"] = {"binding.yaml": yaml.safe_dump({"models": {},
                                                   "namespaces": list(namespaces)})}
    return out


RESTARTED_AT = "rota.dev/restarted-at"
"""The pod-template annotation :func:`restarted` sets (``kubectl rollout restart`` sets
its own)."""


def restarted(workload: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a DaemonSet or Deployment whose pod template changed: applied, it rolls
    every pod."""
    updated = copy.deepcopy(dict(workload))
    notes = updated["spec"]["template"]["metadata"].setdefault("annotations", {})
    notes[RESTARTED_AT] = dt.datetime.now(dt.UTC).isoformat()
    return updated


def pinned_to(workload: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    """A workload whose pods may run only on ``nodes`` (node affinity on the hostname)."""
    out = copy.deepcopy(dict(workload))
    pod = out["spec"]["template"]["spec"]
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}]}]}}}
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

    def daemonset(self, name: str = DRIVER) -> dict[str, Any]:
        return _named(self.docs, "DaemonSet", name)

    def apply(self) -> None:
        self.applier.apply(self.docs)

    def pods(self, component: str, node: str | None = None) -> list[client.V1Pod]:
        """rota's pods of one component (``driver``, ``controller``, ``gateway``)."""
        pods = client.CoreV1Api(self.api).list_namespaced_pod(
            NAMESPACE, label_selector=f"app.kubernetes.io/component={component}",
            _request_timeout=10).items
        return [p for p in pods if node is None or p.spec.node_name == node]

    def driver_pods(self, node: str | None = None) -> list[client.V1Pod]:
        return self.pods("driver", node)

    def controller_pods(self, node: str | None = None) -> list[client.V1Pod]:
        return self.pods("controller", node)

    def gateway_pods(self) -> list[client.V1Pod]:
        return self.pods("gateway")

    def wait_ready(self, nodes: Sequence[str], *, timeout: float = 300.0) -> None:
        """Until a driver and a controller pod are Ready on each node and every gateway
        replica is."""
        replicas = int(_named(self.docs, "Deployment", GATEWAY)["spec"].get("replicas", 1))

        def ready() -> bool:
            drivers = {p.spec.node_name for p in self.driver_pods() if is_ready(p)}
            controllers = {p.spec.node_name for p in self.controller_pods() if is_ready(p)}
            gateways = [p for p in self.gateway_pods() if is_ready(p)]
            return set(nodes) <= drivers & controllers and len(gateways) >= replicas

        eventually(ready, timeout=timeout, max_interval=2.0, what="rota's pods Ready")


def is_ready(pod: client.V1Pod) -> bool:
    return pod.status is not None and pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def label_nodes(api: client.ApiClient, nodes: Iterable[str]) -> None:
    """``kubectl label node <node> gpu.rota.dev/enabled=true``."""
    key, value = NODE_LABEL
    for node in nodes:
        client.CoreV1Api(api).patch_node(node, {"metadata": {"labels": {key: value}}},
                                         _request_timeout=10)


def deploy(api: client.ApiClient, *, nodes: Sequence[str] = (),
           fake_gpu: FakeGpu | None = FakeGpu(), token: str | None = None,
           serving_namespaces: Sequence[str] = ("*",), gateway_nodes: Sequence[str] = (),
           directory: Path = MANIFESTS) -> RotaDeployment:
    """Apply rota's manifests and label ``nodes`` as rota's GPU nodes.

    ``serving_namespaces`` goes into the gateway's model binding (any model from these).
    ``gateway_nodes`` keeps the gateway on those nodes (a test cluster may also have Node
    objects no kubelet serves).
    """
    token = token or secrets.token_hex(16)
    docs = read_manifests(directory)
    for i, doc in enumerate(docs):
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "DaemonSet" and name == DRIVER and fake_gpu:
            docs[i] = with_fake_gpu(doc, fake_gpu)
        elif kind == "ConfigMap" and name == MODEL_BINDING:
            docs[i] = with_model_binding(doc, serving_namespaces)
        elif kind == "Deployment" and name == GATEWAY and gateway_nodes:
            docs[i] = pinned_to(doc, gateway_nodes)
    first = 1 if docs and docs[0]["kind"] == "Namespace" else 0
    docs.insert(first, secret(token))
    deployment = RotaDeployment(api=api, token=token, docs=docs)
    deployment.apply()
    label_nodes(api, nodes)
    return deployment


def deploy_examples(api: client.ApiClient, namespace: str, path: Path = EXAMPLES /
                    "two-models.yaml") -> list[dict[str, Any]]:
    """Apply an example (claims and engine pods) in ``namespace``; its objects."""
    docs = read(path)
    Applier(api).apply(docs, namespace)
    return docs
