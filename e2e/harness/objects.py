"""Bodies of the Kubernetes objects rota's tests, demo and benchmarks create."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rota.api import naming
from rota.api.gpu_lease import GpuLease

GROUP, VERSION = "resource.k8s.io", "v1"
DRIVER = "gpu.rota.dev"
DEVICE_CLASS = "gpu.rota.dev"
MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
ROTA_NAMESPACE = "rota-system"
"""Where rota runs and keeps its Leases (the lease controller's default namespace)."""


def engine_config(*, model: str, awake: str, sleep_level: int = 1, port: int = 8000,
                  adapter: str = "vllm", extra: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """An EngineConfig's parameters; ``extra`` adds fields (``omniStageIds``, ``probe``...)."""
    return {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig", "model": model,
            "awakeMemory": awake, "sleepLevel": sleep_level, "enginePort": port,
            "adapter": adapter} | dict(extra or {})


def claim_spec(*, memory: str | None, config: Mapping[str, Any] | None = None,
               device_class: str = DEVICE_CLASS) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if config is not None:
        spec["devices"]["config"] = [{"requests": ["gpu"],
                                      "opaque": {"driver": DRIVER, "parameters": dict(config)}}]
    return spec


def claim(name: str, **kwargs: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
            "metadata": {"name": name}, "spec": claim_spec(**kwargs)}


def engine_pod(name: str, *, node: str, claim_name: str, args: list[str] | None = None,
               labels: Mapping[str, str] | None = None, gated: bool = False
               ) -> dict[str, Any]:
    """An engine pod; ``gated`` puts rota's start gate in front of the engine."""
    container: dict[str, Any] = {
        "name": "engine", "image": "rota/engine-simulator:latest",
        "args": list(args or []),
        "env": [{"name": "ROTA_POD_UID",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                # vLLM serves its sleep routes only in development mode.
                {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
        "resources": {"claims": [{"name": "gpu"}]},
    }
    if gated:
        container["command"] = ["rota-engine-gate", "--"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels or {"app": name})},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [container],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
        },
    }


def apply_manifest(api: client.ApiClient, path: Path, namespace: str | None = None) -> None:
    """Create every object of a YAML file (an already existing one is left as is)."""
    from kubernetes import utils

    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        try:
            utils.create_from_dict(api, doc, namespace=namespace)
        except utils.FailToCreateError as exc:
            if not all(getattr(e, "status", None) == 409 for e in exc.api_exceptions):
                raise


def create_claim(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    return dict(client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", body))


def read_claim(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return dict(client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", name))


def node_slices(api: client.ApiClient, node: str) -> list[dict[str, Any]]:
    result = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, VERSION, "resourceslices",
        field_selector=f"spec.driver={DRIVER},spec.nodeName={node}")
    return list(result["items"])


def read_gpu_lease(api: client.ApiClient, node: str, device: str, *,
                   namespace: str = ROTA_NAMESPACE, timeout_s: float = 10.0) -> GpuLease:
    """The GPU Lease of ``node``'s ``device``, read by the contract (:class:`GpuLease`)."""
    lease = client.CoordinationV1Api(api).read_namespaced_lease(
        naming.gpu_lease_name(node, device), namespace, _request_timeout=timeout_s)
    return GpuLease.from_object(api.sanitize_for_serialization(lease))


def node_gpu_leases(api: client.ApiClient, node: str, *, namespace: str = ROTA_NAMESPACE,
                    timeout_s: float = 10.0) -> list[GpuLease]:
    """Every GPU Lease of ``node``, read by the contract."""
    leases = client.CoordinationV1Api(api).list_namespaced_lease(
        namespace, label_selector=naming.gpu_lease_selector(node), _request_timeout=timeout_s)
    return [GpuLease.from_object(api.sanitize_for_serialization(lease))
            for lease in leases.items]


def create_namespace(api: client.ApiClient, name: str, *, labels: Mapping[str, str] | None = None,
                     timeout: float = 30.0) -> None:
    """Create a namespace and wait for its ``default`` ServiceAccount: with ServiceAccount
    admission on, a pod created before the service-account controller made it is refused."""
    from e2e.harness.waiting import eventually

    core = client.CoreV1Api(api)
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": name, "labels": dict(labels or {})}}
    try:
        core.create_namespace(body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise

    def has_default() -> bool:
        core.read_namespaced_service_account("default", name)
        return True

    eventually(has_default, timeout=timeout, what=f"ServiceAccount {name}/default")
