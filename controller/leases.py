"""GPU Leases: the record of which claimant is awake on each GPU, written with
compare-and-swap.

:class:`GpuLease` is the parsed view; :func:`lease_body` renders one. Writers always send
the ``resourceVersion`` they read, so a write based on a stale read fails with a conflict
instead of overwriting someone else's switch. ``leaseTransitions`` is the fencing number:
every switch raises it first.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any

from controller import naming


def micro_time(moment: dt.datetime | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    moment = moment or dt.datetime.now(dt.UTC)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    text = value.replace("Z", "+00:00")
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class GpuLease:
    """The GPU Lease of one device: who is awake, and the switch in progress."""

    name: str
    node: str
    device: str
    holder: str = ""
    fence: int = 0
    state: str = naming.STATE_IDLE
    holder_model: str = ""
    holder_claim_uid: str = ""
    target_model: str = ""
    draining_model: str = ""
    last_error: str = ""
    controller: str = ""
    gpu_uuid: str = ""
    gang: str = ""
    """:data:`naming.GANG`: the holder's (or the target's) GPUs when it spans several."""
    renewed: dt.datetime | None = None
    resource_version: str | None = None
    extra_annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> GpuLease:
        meta, spec = obj.get("metadata", {}), obj.get("spec", {}) or {}
        annotations: dict[str, str] = dict(meta.get("annotations") or {})
        labels = meta.get("labels") or {}

        def pop(key: str) -> str:
            return str(annotations.pop(key, ""))

        # Written by controllers before 0.2 (traffic never follows a Lease): dropped, so
        # the next write removes it.
        annotations.pop(naming.HOLDER_ENDPOINT, None)
        return cls(
            name=meta["name"], node=str(labels.get(naming.LABEL_NODE, "")),
            device=str(labels.get(naming.LABEL_DEVICE, "")),
            holder=str(spec.get("holderIdentity") or ""),
            fence=int(spec.get("leaseTransitions") or 0),
            state=pop(naming.STATE) or naming.STATE_IDLE,
            holder_model=pop(naming.HOLDER_MODEL), holder_claim_uid=pop(naming.HOLDER_CLAIM_UID),
            target_model=pop(naming.TARGET_MODEL),
            draining_model=pop(naming.DRAINING_MODEL), last_error=pop(naming.LAST_ERROR),
            controller=pop(naming.ACTING_CONTROLLER), gpu_uuid=pop(naming.GPU_UUID),
            gang=pop(naming.GANG),
            renewed=parse_micro_time(spec.get("renewTime")),
            resource_version=meta.get("resourceVersion"), extra_annotations=annotations,
        )

    def with_(self, **changes: Any) -> GpuLease:
        return replace(self, **changes)

    @property
    def gang_gpus(self) -> tuple[str, ...]:
        """The GPUs of :attr:`gang` (empty for a one-GPU holder)."""
        return tuple(g for g in self.gang.split(",") if g)


def lease_body(lease: GpuLease, namespace: str, *, labels_node: str, labels_device: str
               ) -> dict[str, Any]:
    annotations = dict(lease.extra_annotations) | {naming.NODE_NAME: labels_node}
    for key, value in ((naming.STATE, lease.state), (naming.HOLDER_MODEL, lease.holder_model),
                       (naming.HOLDER_CLAIM_UID, lease.holder_claim_uid),
                       (naming.TARGET_MODEL, lease.target_model),
                       (naming.DRAINING_MODEL, lease.draining_model),
                       (naming.LAST_ERROR, lease.last_error[:1024]),
                       (naming.ACTING_CONTROLLER, lease.controller),
                       (naming.GPU_UUID, lease.gpu_uuid), (naming.GANG, lease.gang)):
        if value:
            annotations[key] = value
    metadata: dict[str, Any] = {
        "name": lease.name, "namespace": namespace,
        "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY, naming.LABEL_KIND: naming.KIND_GPU,
                   naming.LABEL_NODE: naming.label_value(labels_node),
                   naming.LABEL_DEVICE: naming.label_value(labels_device)},
        "annotations": annotations,
    }
    if lease.resource_version:
        metadata["resourceVersion"] = lease.resource_version
    spec: dict[str, Any] = {"leaseTransitions": lease.fence, "renewTime": micro_time()}
    if lease.holder:
        spec["holderIdentity"] = lease.holder
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": spec}
