"""The gateway's reading of Leases and pods: what it keeps of each object. Pure.

- GPU Leases are parsed by their one contract, :class:`controller.leases.GpuLease`.
- A controller Lease (``rota-controller-<node>``, renewed by the node's acting controller)
  is parsed by its one contract too,
  :class:`controller.api.controller_lease.ControllerLease`; its activation URL is made
  usable here (:func:`activation_url`). Whether its controller is alive is not read from
  the Lease alone: :mod:`controller.gateway.routing` feeds every read to a
  :class:`~controller.api.controller_lease.LeaseObserver` on the gateway's monotonic clock
  (the rule the controllers' own election applies; never ``renewTime`` against this
  machine's clock).
- Pods are cut down to what routing reads (uid, annotations, deletion, IP, readiness), so
  a replica does not hold whole pod specs of every namespace it watches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controller import naming
from controller.api.controller_lease import ControllerLease
from controller.gateway.endpoints import normalize_base_url
from controller.leases import GpuLease

__all__ = ["activation_url", "controller_lease_of", "gpu_lease_of", "slim_pod"]

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
