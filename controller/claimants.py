"""Claimants: the engines that share a GPU, found from the Kubernetes API.

A claimant is a ResourceClaim allocated by ``gpu.rota.dev``, its engine config (model,
port, sleep level, adapter, awake budget) from the claim's opaque parameters, and the pod
it is reserved for, with that pod's IP once it runs. Pod annotations may override the
model, port and sleep level (``gpu.rota.dev/model``, ``gpu.rota.dev/engine-port``,
``gpu.rota.dev/sleep-level``), for an admin who reuses one claim template for several
models; an override is checked by the EngineConfig's own rules, and one that fails them is
ignored (with a warning), as the driver would have refused it in the claim.

A claim may hold several GPUs of its node (a tensor-parallel engine): the claimant knows
every one (:attr:`Claimant.gpus`, with its resident footprint on each), and it is awake
only when it holds every one of them.

Pure: the lease controller and the gateway feed it the objects they watch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from controller.urls import http_url
from rota.api.claim_config import engine_config_of
from rota.api.engine_config import EngineConfig
from rota.api.errors import ClaimError
from rota.api.naming import physical_device
from rota.api.quantity import parse_quantity

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
    """The first allocated device as the claim names it (``gpu-0``, or
    ``gpu-0-share-2``)."""
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
    resident_on_gpu: tuple[tuple[str, int], ...] = ()
    """Every physical GPU the claim holds on its node with its resident footprint there,
    in GPU order; empty means the one GPU of :attr:`device` at :attr:`resident_bytes`."""
    restarts: int = 0
    """How often the containers of its pod restarted (the sum of their ``restartCount``):
    with :attr:`pod_uid`, which run of the engine's container this is. A start gate is
    granted once per run (:mod:`controller.lease.gpu`)."""

    @property
    def gpus(self) -> tuple[str, ...]:
        """Every physical GPU (``gpu-<i>``) the claimant holds, in GPU order: one for most
        engines, several for a tensor-parallel one. It is awake only as the holder of
        every one of them."""
        if not self.resident_on_gpu:
            return (physical_device(self.device),)
        return tuple(gpu for gpu, _ in self.resident_on_gpu)

    @property
    def gpu(self) -> str:
        """The first physical GPU (``gpu-<i>``) the claimant shares, whatever the sharing
        mode named its allocation: for one GPU, the unit of "one engine awake" and of the
        GPU Lease; for several, the GPU whose worker queues its activations."""
        return self.gpus[0]

    @property
    def spans_gpus(self) -> bool:
        """The claimant holds more than one GPU (a gang: switched on all at once)."""
        return len(self.gpus) > 1

    def resident_on(self, gpu: str) -> int:
        """The claimant's resident footprint on one physical GPU (0 on a GPU it does not
        hold)."""
        if not self.resident_on_gpu:
            return self.resident_bytes if gpu == physical_device(self.device) else 0
        return dict(self.resident_on_gpu).get(gpu, 0)

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


_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def _live_pod_ip(pod: Mapping[str, Any]) -> str | None:
    """The pod's IP while its containers may run; None once it finished (Succeeded, or
    Failed as when evicted). A finished pod keeps ``status.podIP``, but the kubelet has
    released the address, which another tenant's pod may now hold: the claim's control
    token and its traffic must not go there."""
    status = pod.get("status", {}) or {}
    if status.get("phase") in _FINISHED_PHASES:
        return None
    return status.get("podIP") or None


def _restarts(pod: Mapping[str, Any]) -> int:
    """The sum of the restart counts of the pod's containers (0 before any status)."""
    statuses = (pod.get("status", {}) or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses)


def _override(config: EngineConfig, pod: Mapping[str, Any] | None) -> tuple[str, int, int]:
    """The model, port and sleep level, with the pod's annotations applied when the
    EngineConfig's own rules accept them (a level-2 sleep for vLLM-Omni, a model name that
    is too long or has control characters, a port out of range: all ignored)."""
    plain = config.model, config.engine_port, int(config.sleep_level)
    annotations = (pod or {}).get("metadata", {}).get("annotations", {}) or {}
    changes: dict[str, object] = {}
    try:
        if ANNOTATION_MODEL in annotations:
            changes["model"] = str(annotations[ANNOTATION_MODEL])
        if ANNOTATION_PORT in annotations:
            changes["engine_port"] = int(annotations[ANNOTATION_PORT])
        if ANNOTATION_SLEEP_LEVEL in annotations:
            changes["sleep_level"] = int(annotations[ANNOTATION_SLEEP_LEVEL])
        if not changes:
            return plain
        checked = EngineConfig.model_validate(config.model_dump() | changes, by_name=True,
                                              by_alias=False)
    except (ValueError, ValidationError) as exc:
        log.warning("ignoring claimant annotations the engine config does not accept",
                    extra={"pod": (pod or {}).get("metadata", {}).get("name"),
                           "error": str(exc).splitlines()[0]})
        return plain
    return checked.model, checked.engine_port, int(checked.sleep_level)


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


def gpu_order(gpu: str) -> tuple[int, str]:
    """The one order of a node's GPUs (``gpu-2`` before ``gpu-10``): gang switches take
    their GPUs in it."""
    _, _, index = gpu.rpartition("-")
    return (int(index), gpu) if index.isdigit() else (1 << 30, gpu)


def _resident_on_gpus(results: Iterable[Mapping[str, Any]],
                      device_memory: Mapping[str, int] | None) -> dict[str, int]:
    """Resident bytes per physical GPU over a claim's allocation results (shares of one
    GPU add up)."""
    found: dict[str, int] = {}
    for result in results:
        device = str(result.get("device", ""))
        consumed = (result.get("consumedCapacity") or {}).get("memory")
        try:
            resident = (parse_quantity(consumed) if consumed is not None
                        else (device_memory or {}).get(device, 0))
        except ValueError:
            resident = 0
        gpu = physical_device(device)
        found[gpu] = found.get(gpu, 0) + resident
    return found


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
        on_gpu = _resident_on_gpus((r for r in results if r.get("pool") == result.get("pool")),
                                   device_memory)
        resident = on_gpu.get(physical_device(str(result.get("device", ""))), 0)
        pod_meta = (pod or {}).get("metadata", {})
        found.append(Claimant(
            claim_uid=str(meta.get("uid", "")), namespace=str(meta.get("namespace", "")),
            claim_name=str(meta.get("name", "")), node=str(result.get("pool", "")),
            device=str(result.get("device", "")), share_id=result.get("shareID"),
            config=config, model=model, port=port, sleep_level=level,
            resident_bytes=resident,
            pod_name=pod_meta.get("name"), pod_uid=pod_meta.get("uid"),
            pod_ip=_live_pod_ip(pod or {}),
            pod_ready=_pod_ready(pod or {}),
            pod_deleting=bool(pod_meta.get("deletionTimestamp")),
            resident_on_gpu=tuple(sorted(on_gpu.items(), key=lambda kv: gpu_order(kv[0]))),
            restarts=_restarts(pod or {}),
        ))
    return sorted(found, key=lambda c: (c.node, c.device, c.namespace, c.claim_name))
