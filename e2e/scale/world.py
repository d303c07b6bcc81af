"""The fleet the harness measures: N kwok nodes of G GPUs with E engines on each GPU.

Each engine is a ResourceClaim for a share of one GPU (``10Gi`` of its memory, rota's
EngineConfig with its own model) and a pod that holds it, pinned to its node. The real
kube-scheduler allocates the claims against the slices the driver publishes (shared mode,
consumable capacity: E ``engines`` per GPU), and kwok makes the pods Running with an IP.
Created through the harness's own client (User-Agent :data:`USER_AGENT`), so the audit log
tells its requests apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from controller.claimants import Claimant, claimants_from
from driver.devices import GpuDevice
from e2e.cluster.nodes import node_body
from e2e.harness.objects import (
    MANIFESTS,
    apply_manifest,
    claim,
    create_namespace,
    engine_config,
    engine_pod,
)
from e2e.harness.waiting import eventually
from e2e.scale.kwok import NODE_LABEL

NAMESPACE = "engines"
LEASE_NAMESPACE = "rota-system"
USER_AGENT = "rota-scale-harness"
GPU_MEMORY = 141 * 1024**3
_WRITERS = 8


@dataclass(frozen=True)
class Shape:
    nodes: int
    gpus: int = 8
    engines: int = 4

    @property
    def claims(self) -> int:
        return self.nodes * self.gpus * self.engines


def node_name(index: int) -> str:
    return f"scale-node-{index:04d}"


def engine_name(node: str, gpu: int, engine: int) -> str:
    return f"{node}-g{gpu}-e{engine}"


def gpus_of(node: str, count: int) -> list[GpuDevice]:
    """The GPUs the driver of ``node`` publishes (H200-like, uuids unique per node)."""
    return [GpuDevice(index=i, name=f"gpu-{i}", uuid=f"GPU-{node}-{i}",
                      product_name="NVIDIA H200", brand="Nvidia", architecture="Hopper",
                      cuda_compute_capability="9.0.0", driver_version="580.95.5",
                      cuda_driver_version="13.0.0", pci_bus_id=f"0000:{i + 1:02x}:00.0",
                      numa_node=0, memory_bytes=GPU_MEMORY, mig_enabled=False, minor=i)
            for i in range(count)]


def _parallel(calls: list[Callable[[], Any]]) -> None:
    with ThreadPoolExecutor(max_workers=_WRITERS) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def _create(fn: Callable[..., Any], *args: Any) -> Callable[[], None]:
    def call() -> None:
        try:
            fn(*args)
        except client.ApiException as exc:
            if exc.status != 409:
                raise

    return call


def create_nodes(api: client.ApiClient, shape: Shape) -> list[str]:
    core = client.CoreV1Api(api)
    names = [node_name(i) for i in range(shape.nodes)]
    bodies = []
    for name in names:
        body = node_body(name, labels={NODE_LABEL: "true"}, pods="110")
        body["status"]["conditions"] = []  # kwok's node-initialize makes it Ready
        bodies.append(body)
    _parallel([_create(core.create_node, body) for body in bodies])
    return names


def prepare_cluster(api: client.ApiClient) -> None:
    apply_manifest(api, MANIFESTS / "deviceclass.yaml")
    create_namespace(api, NAMESPACE)
    create_namespace(api, LEASE_NAMESPACE)


def create_engines(api: client.ApiClient, shape: Shape, nodes: list[str]) -> None:
    """Every claim, then every pod (a pod must find its claim to be scheduled)."""
    objects = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    names = [(node, engine_name(node, g, e)) for node in nodes for g in range(shape.gpus)
             for e in range(shape.engines)]
    _parallel([_create(objects.create_namespaced_custom_object, "resource.k8s.io", "v1",
                       NAMESPACE, "resourceclaims",
                       claim(name, memory="10Gi",
                             config=engine_config(model=f"scale/{name}", awake="20Gi")))
               for _, name in names])
    _parallel([_create(core.create_namespaced_pod, NAMESPACE,
                       engine_pod(name, node=node, claim_name=name)) for node, name in names])


def _list(api: client.ApiClient, fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": 500}
        if token:
            kwargs["_continue"] = token
        page = json.loads(fn(*args, _preload_content=False, **kwargs).data)
        items.extend(page.get("items") or [])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items


def claims(api: client.ApiClient) -> list[dict[str, Any]]:
    return _list(api, client.CustomObjectsApi(api).list_namespaced_custom_object,
                 "resource.k8s.io", "v1", NAMESPACE, "resourceclaims")


def pods(api: client.ApiClient) -> list[dict[str, Any]]:
    return _list(api, client.CoreV1Api(api).list_namespaced_pod, NAMESPACE)


def wait_running(api: client.ApiClient, shape: Shape, timeout_s: float,
                 alive: Callable[[], str | None]) -> None:
    """Until every claim is allocated and every pod is Running with an IP; ``alive`` says
    what died (kwok), which ends the wait at once."""

    def ready() -> bool:
        if alive():
            return True  # no point waiting: said below
        allocated = sum(1 for c in claims(api)
                        if (c.get("status") or {}).get("allocation"))
        running = sum(1 for p in pods(api) if (p.get("status") or {}).get("phase") == "Running"
                      and (p.get("status") or {}).get("podIP"))
        assert allocated == running == shape.claims, (
            f"{allocated} claims allocated and {running} pods running of {shape.claims}")
        return True

    eventually(ready, timeout=timeout_s, interval=2.0, max_interval=5.0,
               what="every engine allocated and running")
    dead = alive()
    if dead:
        raise RuntimeError(dead)


def claimants_by_node(api: client.ApiClient) -> dict[str, list[Claimant]]:
    """Every node's claimants, as the lease controller derives them."""
    by_uid = {str(p["metadata"]["uid"]): p for p in pods(api)}
    found: dict[str, list[Claimant]] = {}
    for claimant in claimants_from(claims(api), by_uid):
        found.setdefault(claimant.node, []).append(claimant)
    return found
