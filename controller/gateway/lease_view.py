"""The gateway's reading of Leases and pods: what it keeps of each object. Pure.

- GPU Leases are parsed by their one contract, :class:`controller.leases.GpuLease`.
- A controller Lease (``rota-controller-<node>``, renewed by the node's acting controller)
  becomes a :class:`ControllerLease`: alive while ``renewTime + leaseDurationSeconds`` is
  ahead (the same rule the controllers' own election applies), and its activation URL.
- Pods are cut down to what routing reads (uid, annotations, deletion, IP, readiness), so
  a replica does not hold whole pod specs of every namespace it watches.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller import naming
from controller.gateway.endpoints import normalize_base_url
from controller.leases import GpuLease, parse_micro_time

__all__ = ["ControllerLease", "gpu_lease_of", "slim_pod"]

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


@dataclass(frozen=True)
class ControllerLease:
    """A node controller's own Lease, as the gateway reads it."""

    name: str
    holder: str
    renewed: dt.datetime | None
    duration_s: float
    url: str | None
    """The activation API's base URL (IPv6 bracketed), None when none is usable."""

    @property
    def expires(self) -> dt.datetime | None:
        if self.renewed is None or self.duration_s <= 0:
            return None
        return self.renewed + dt.timedelta(seconds=self.duration_s)

    def fresh(self, now: dt.datetime) -> bool:
        """Held and renewed within its duration at ``now``."""
        expires = self.expires
        return bool(self.holder) and expires is not None and now <= expires

    @classmethod
    def from_object(cls, obj: Obj) -> ControllerLease | None:
        """None when ``obj`` is no controller Lease."""
        if _labels(obj).get(naming.LABEL_KIND) != naming.KIND_CONTROLLER:
            return None
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        url = (meta.get("annotations") or {}).get(naming.ACTIVATION_URL)
        try:
            duration = float(spec.get("leaseDurationSeconds") or 0)
        except (TypeError, ValueError):
            duration = 0.0
        renewed = parse_micro_time(spec.get("renewTime"))
        if renewed is not None and renewed.tzinfo is None:
            renewed = renewed.replace(tzinfo=dt.UTC)
        return cls(name=str(meta.get("name", "")), holder=str(spec.get("holderIdentity") or ""),
                   renewed=renewed, duration_s=duration,
                   url=normalize_base_url(str(url)) if url else None)


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
