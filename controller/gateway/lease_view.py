"""The gateway's reading of Leases and pods: what it keeps of each object. Pure.

- GPU Leases are parsed by their one contract, :class:`rota.api.gpu_lease.GpuLease`.
- A controller Lease (``rota-controller-<node>``, renewed by the node's acting controller)
  is parsed by its one contract too,
  :class:`rota.api.controller_lease.ControllerLease`; its activation URL is made
  usable here (:func:`activation_url`). Whether its controller is alive is not read from
  the Lease alone: :mod:`controller.gateway.routing` feeds every read to a
  :class:`~rota.api.controller_lease.LeaseObserver` on the gateway's monotonic clock
  (the rule the controllers' own election applies; never ``renewTime`` against this
  machine's clock).
- Pods are cut down to what routing reads (uid, annotations, deletion, IP, readiness), so
  a replica does not hold whole pod specs of every namespace it watches.
- Claims are cut down the same way (:func:`slim_claim`): identity, rota's opaque configs,
  rota's allocation results and ``reservedFor``. Managed fields, conditions, other drivers'
  results and configs are dropped; so a write that changes only those (the controller's
  visible state, a scheduler's bookkeeping) leaves the slim claim equal, and routing
  skips it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controller.claimants import DRIVER
from controller.urls import normalize_base_url
from rota.api import naming
from rota.api.controller_lease import ControllerLease
from rota.api.gpu_lease import GpuLease

__all__ = ["activation_url", "controller_lease_of", "gpu_lease_of", "slim_claim", "slim_pod"]

Obj = Mapping[str, Any]


def _labels(obj: Obj) -> Mapping[str, Any]:
    return (obj.get("metadata") or {}).get("labels") or {}


def gpu_lease_of(obj: Obj) -> GpuLease | None:
    """The GPU Lease ``obj`` is, or None when it is no GPU Lease."""
    if _labels(obj).get(naming.LABEL_KIND) != naming.KIND_GPU:
        return None
    if not (obj.get("metadata") or {}).get("name"):
        return None
    try:
        return GpuLease.from_object(dict(obj))
    except (KeyError, TypeError, ValueError):
        return None


def controller_lease_of(obj: Obj) -> ControllerLease | None:
    """The controller Lease ``obj`` is (parsed by its one contract), or None when it is
    no controller Lease."""
    return ControllerLease.from_object(obj)


def activation_url(lease: ControllerLease) -> str | None:
    """The base URL of the activation API ``lease`` advertises, made usable (IPv6
    bracketed); None when it advertises none that is."""
    return normalize_base_url(lease.activation_url) if lease.activation_url else None


def slim_pod(pod: Obj) -> dict[str, Any]:
    """The parts of a pod that :func:`controller.claimants.claimants_from` reads."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    kept_meta = {k: meta[k] for k in ("name", "namespace", "uid", "annotations",
                                      "deletionTimestamp") if meta.get(k) is not None}
    conditions = [{"type": c.get("type"), "status": c.get("status")}
                  for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    kept_status: dict[str, Any] = {"conditions": conditions}
    if status.get("podIP"):
        kept_status["podIP"] = status["podIP"]
    return {"metadata": kept_meta, "status": kept_status}


_CLAIM_META = ("name", "namespace", "uid")
_RESULT_KEYS = ("request", "driver", "pool", "device", "shareID")


def _rota_configs(entries: Any) -> list[dict[str, Any]]:
    """Config entries whose opaque part is for rota's driver (the others never apply)."""
    kept = []
    for entry in entries if isinstance(entries, list) else []:
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if isinstance(opaque, Mapping) and opaque.get("driver") == DRIVER:
            kept.append({k: entry[k] for k in ("source", "requests", "opaque") if k in entry})
    return kept


def slim_claim(claim: Obj) -> dict[str, Any]:
    """The parts of a ResourceClaim that :func:`controller.claimants.claimants_from` reads,
    for rota's driver only."""
    meta = claim.get("metadata") or {}
    status = claim.get("status") or {}
    devices = (claim.get("spec") or {}).get("devices") or {}
    allocated = (status.get("allocation") or {}).get("devices") or {}
    results = []
    for result in allocated.get("results") or []:
        if result.get("driver") != DRIVER:
            continue
        kept = {k: result[k] for k in _RESULT_KEYS if result.get(k) is not None}
        memory = (result.get("consumedCapacity") or {}).get("memory")
        if memory is not None:
            kept["consumedCapacity"] = {"memory": memory}
        results.append(kept)
    allocation: dict[str, Any] = {"results": results}
    if configs := _rota_configs(allocated.get("config")):
        allocation["config"] = configs
    reserved = [{k: ref.get(k) for k in ("resource", "name", "uid")}
                for ref in status.get("reservedFor") or []]
    return {"metadata": {k: meta[k] for k in _CLAIM_META if meta.get(k) is not None},
            "spec": {"devices": {"config": _rota_configs(devices.get("config"))}},
            "status": {"allocation": {"devices": allocation}, "reservedFor": reserved}}
