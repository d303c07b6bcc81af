"""Claimants: the engines that share a GPU, found from the Kubernetes API.

A claimant is a ResourceClaim allocated by ``gpu.rota.dev``, its engine config (model,
port, sleep level, adapter, awake budget) from the claim's opaque parameters, and the pod
it is reserved for, with that pod's IP once it runs. Pod annotations may override the
model, port and sleep level (``gpu.rota.dev/model``, ``gpu.rota.dev/engine-port``,
``gpu.rota.dev/sleep-level``), for an admin who reuses one claim template for several
models.

Pure: the lease controller and the gateway feed it the objects they watch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from controller.urls import http_url
from driver.claims import engine_config_of
from driver.errors import ClaimError
from driver.opaque import EngineConfig
from driver.quantity import parse_quantity
from driver.slices import physical_device

log = logging.getLogger(__name__)

DRIVER = "gpu.rota.dev"
ANNOTATION_MODEL = "gpu.rota.dev/model"
ANNOTATION_PORT = "gpu.rota.dev/engine-port"
ANNOTATION_SLEEP_LEVEL = "gpu.rota.dev/sleep-level"


@dataclass(frozen=True)
class Claimant:
    """One engine sharing a GPU, as the controller and the gateway see it."""

    claim_uid: str
    namespace: str
    claim_name: str
    node: str
    """The pool (rota names pools after nodes)."""
    device: str
    """The allocated device as the claim names it (``gpu-0``, or ``gpu-0-share-2``)."""
    share_id: str | None
    config: EngineConfig
    model: str
    port: int
    sleep_level: int
    resident_bytes: int
    pod_name: str | None
    pod_uid: str | None
    pod_ip: str | None
    pod_ready: bool
    pod_deleting: bool

    @property
    def gpu(self) -> str:
        """The physical GPU (``gpu-<i>``) the claimant shares, whatever the sharing mode
        named its allocation: the unit of "one engine awake" and of the GPU Lease."""
        return physical_device(self.device)

    @property
    def ref(self) -> str:
        """``<namespace>/<claim name>``: the holderIdentity of the GPU Lease."""
        return f"{self.namespace}/{self.claim_name}"

    @property
    def endpoint(self) -> str | None:
        """``http://<pod ip>:<port>`` once the pod has an IP (IPv6 in brackets)."""
        return http_url(self.pod_ip, self.port) if self.pod_ip else None

    @property
    def serving(self) -> bool:
        """The pod runs, is ready and is not being deleted."""
        return bool(self.pod_ip) and self.pod_ready and not self.pod_deleting


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    for condition in pod.get("status", {}).get("conditions", []) or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _override(config: EngineConfig, pod: Mapping[str, Any] | None) -> tuple[str, int, int]:
    model, port, level = config.model, config.engine_port, int(config.sleep_level)
    annotations = (pod or {}).get("metadata", {}).get("annotations", {}) or {}
    model = annotations.get(ANNOTATION_MODEL, model)
    try:
        port = int(annotations.get(ANNOTATION_PORT, port))
        level = int(annotations.get(ANNOTATION_SLEEP_LEVEL, level))
    except ValueError:
        log.warning("ignoring an unparsable claimant annotation",
                    extra={"pod": (pod or {}).get("metadata", {}).get("name")})
    if not 1 <= port <= 65535 or level not in (1, 2):
        return config.model, config.engine_port, int(config.sleep_level)
    return model, port, level


def device_memory_of(slices: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The published ``memory`` capacity of every device of ``slices``, by device name."""
    found: dict[str, int] = {}
    for item in slices:
        for device in (item.get("spec") or {}).get("devices") or []:
            value = ((device.get("capacity") or {}).get("memory") or {}).get("value")
            if value is None:
                continue
            try:
                found[str(device.get("name"))] = parse_quantity(value)
            except ValueError:
                continue
    return found


def _reserved_pod(claim: Mapping[str, Any], pods: Mapping[str, Mapping[str, Any]], *,
                  node: str) -> Mapping[str, Any] | None:
    """The pod the claim is reserved for, only if it really is that pod: same namespace as
    the claim, the name ``reservedFor`` gives, and running on the node whose pool holds the
    allocation. ``reservedFor`` is status, which a node component may be able to write; a
    pod of another namespace or node named there must never receive the claim's traffic."""
    meta = claim.get("metadata", {})
    for ref in (claim.get("status", {}) or {}).get("reservedFor", []) or []:
        if ref.get("resource") != "pods":
            continue
        pod = pods.get(str(ref.get("uid", "")))
        if pod is None:
            continue
        pod_meta = pod.get("metadata", {}) or {}
        if (pod_meta.get("namespace") == meta.get("namespace")
                and pod_meta.get("name") == ref.get("name")
                and (pod.get("spec", {}) or {}).get("nodeName") in (node, None)):
            return pod
        log.warning("a claim's reservedFor names a pod that is not its own; ignored",
                    extra={"claim": f"{meta.get('namespace')}/{meta.get('name')}",
                           "pod": f"{pod_meta.get('namespace')}/{pod_meta.get('name')}"})
    return None


def claimants_from(claims: Iterable[Mapping[str, Any]],
                   pods: Mapping[str, Mapping[str, Any]], *,
                   node: str | None = None, driver: str = DRIVER,
                   device_memory: Mapping[str, int] | None = None) -> list[Claimant]:
    """Every claimant among ``claims`` (on ``node`` when given).

    ``pods`` maps pod uid to pod. A claim without an engine config is a plain GPU share
    and no claimant; a claim whose config is invalid is skipped with a warning (the driver
    refused to prepare it already). Sorted by (node, device, namespace, name).

    A claim's resident footprint is the memory it consumed from a shared device. A claim
    of a plain device (a fixed partition, or an exclusive GPU) holds it whole, as the
    driver counts it: its resident footprint is the device's published memory, taken from
    ``device_memory`` (device name to bytes, see :func:`device_memory_of`).
    """
    found: list[Claimant] = []
    for claim in claims:
        meta = claim.get("metadata", {})
        allocation = (claim.get("status", {}) or {}).get("allocation") or {}
        results = [r for r in allocation.get("devices", {}).get("results", []) or []
                   if r.get("driver") == driver and (node is None or r.get("pool") == node)]
        if not results:
            continue
        try:
            config = engine_config_of(claim, driver=driver)
        except ClaimError as exc:
            log.warning("claim has an invalid engine config",
                        extra={"claim": f"{meta.get('namespace')}/{meta.get('name')}",
                               "error": str(exc)})
            continue
        if config is None:
            continue
        result = results[0]
        pod = _reserved_pod(claim, pods, node=str(result.get("pool", "")))
        model, port, level = _override(config, pod)
        consumed = (result.get("consumedCapacity") or {}).get("memory")
        try:
            resident = (parse_quantity(consumed) if consumed is not None
                        else (device_memory or {}).get(str(result.get("device", "")), 0))
        except ValueError:
            resident = 0
        pod_meta = (pod or {}).get("metadata", {})
        found.append(Claimant(
            claim_uid=str(meta.get("uid", "")), namespace=str(meta.get("namespace", "")),
            claim_name=str(meta.get("name", "")), node=str(result.get("pool", "")),
            device=str(result.get("device", "")), share_id=result.get("shareID"),
            config=config, model=model, port=port, sleep_level=level,
            resident_bytes=resident,
            pod_name=pod_meta.get("name"), pod_uid=pod_meta.get("uid"),
            pod_ip=(pod or {}).get("status", {}).get("podIP") or None,
            pod_ready=_pod_ready(pod or {}),
            pod_deleting=bool(pod_meta.get("deletionTimestamp")),
        ))
    return sorted(found, key=lambda c: (c.node, c.device, c.namespace, c.claim_name))
