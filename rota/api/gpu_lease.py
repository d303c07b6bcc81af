"""GPU Leases: the record of which claimant is awake on each GPU, written with
compare-and-swap.

:class:`GpuLease` is the parsed view; :func:`lease_body` renders one. Writers always send
the ``resourceVersion`` they read, so a write based on a stale read fails with a conflict
instead of overwriting someone else's switch. ``leaseTransitions`` is the fencing number:
every switch raises it first.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field, replace
from typing import Any

from rota.api import naming


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


def _start_granted(value: str) -> tuple[str, dt.datetime | None]:
    """The claim uid and time of :data:`naming.START_GRANTED` (("", None) when absent or
    malformed)."""
    uid, _, moment = value.partition(" ")
    at = parse_micro_time(moment)
    return (uid, at) if uid and at is not None else ("", None)


def _render_start(lease: GpuLease) -> str:
    if not lease.start_claim_uid or lease.start_granted is None:
        return ""
    return f"{lease.start_claim_uid} {micro_time(lease.start_granted)}"


def _state(value: str) -> naming.LeaseState:
    """The state a Lease carries: none is ``idle``; one this reader does not know (a newer
    writer's) is read as ``switching``, the state whose finder reconciles before anything
    else, and which gets no traffic."""
    if not value:
        return naming.LeaseState.IDLE
    try:
        return naming.LeaseState(value)
    except ValueError:
        return naming.LeaseState.SWITCHING


@dataclass(frozen=True)
class AwakeMember:
    """An engine awake beside the holder (:data:`naming.AWAKE_WITH`)."""

    claim: str
    """``namespace/name`` of its claim (as :attr:`GpuLease.holder` names the holder)."""
    uid: str
    model: str


def _members(value: str) -> tuple[AwakeMember, ...] | None:
    """The members :data:`naming.AWAKE_WITH` lists (() when absent), or None when it is
    not a list of well-formed members."""
    if not value:
        return ()
    try:
        items = json.loads(value)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    members = []
    for item in items:
        if not isinstance(item, dict):
            return None
        claim, uid, model = item.get("claim"), item.get("uid"), item.get("model")
        if not (isinstance(claim, str) and claim and isinstance(uid, str) and uid
                and isinstance(model, str)):
            return None
        members.append(AwakeMember(claim, uid, model))
    return tuple(members)


def _render_members(members: tuple[AwakeMember, ...]) -> str:
    return json.dumps([{"claim": m.claim, "uid": m.uid, "model": m.model} for m in members],
                      separators=(",", ":")) if members else ""


@dataclass(frozen=True)
class GpuLease:
    """The GPU Lease of one device: who is awake, and the switch in progress."""

    name: str
    node: str
    device: str
    holder: str = ""
    fence: int = 0
    state: naming.LeaseState = naming.LeaseState.IDLE
    holder_model: str = ""
    holder_claim_uid: str = ""
    target_model: str = ""
    draining_model: str = ""
    last_error: str = ""
    controller: str = ""
    gpu_uuid: str = ""
    gang: str = ""
    """:data:`naming.GANG`: the holder's (or the target's) GPUs when it spans several."""
    start_claim_uid: str = ""
    """:data:`naming.START_GRANTED`: the newcomer whose start gate was given its go ("":
    no start granted and unsettled)."""
    start_granted: dt.datetime | None = None
    """When that go was given (the start's limit runs from here)."""
    companions: tuple[AwakeMember, ...] = ()
    """:data:`naming.AWAKE_WITH`: the engines awake beside the holder (an awake set;
    always empty unless the admin allows one). They stay awake, and routable, whatever
    the Lease's state: a switch that displaces one removes it in the write that opens
    the switch, before its sleep."""
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
        start_uid, start_at = _start_granted(pop(naming.START_GRANTED))
        members = _members(pop(naming.AWAKE_WITH))
        state = _state(pop(naming.STATE))
        if members is None:  # unreadable: nobody is routed to, reconciliation reads it all
            members, state = (), naming.LeaseState.SWITCHING
        return cls(
            name=meta["name"], node=str(labels.get(naming.LABEL_NODE, "")),
            device=str(labels.get(naming.LABEL_DEVICE, "")),
            holder=str(spec.get("holderIdentity") or ""),
            fence=int(spec.get("leaseTransitions") or 0),
            state=state, companions=members,
            holder_model=pop(naming.HOLDER_MODEL), holder_claim_uid=pop(naming.HOLDER_CLAIM_UID),
            target_model=pop(naming.TARGET_MODEL),
            draining_model=pop(naming.DRAINING_MODEL), last_error=pop(naming.LAST_ERROR),
            controller=pop(naming.ACTING_CONTROLLER), gpu_uuid=pop(naming.GPU_UUID),
            gang=pop(naming.GANG), start_claim_uid=start_uid, start_granted=start_at,
            renewed=parse_micro_time(spec.get("renewTime")),
            resource_version=meta.get("resourceVersion"), extra_annotations=annotations,
        )

    @property
    def awake_set(self) -> tuple[AwakeMember, ...]:
        """Every engine this Lease says is awake: the holder (while ``awake``) and the
        companions, in that order."""
        holder = ((AwakeMember(self.holder, self.holder_claim_uid, self.holder_model),)
                  if self.state == naming.LeaseState.AWAKE and self.holder else ())
        return holder + self.companions

    def names_awake(self, claim_uid: str) -> bool:
        """Whether this Lease says the engine of ``claim_uid`` is awake."""
        return bool(claim_uid) and any(m.uid == claim_uid for m in self.awake_set)

    def with_(self, **changes: Any) -> GpuLease:
        """Any change of fields, for tests and tools; the controller writes only through
        the named transitions below, each of which clears what its state must not carry."""
        return replace(self, **changes)

    # -- the named transitions: every state a writer can put a Lease in -----------------

    def opening(self, state: naming.LeaseState, *, controller: str, target_model: str,
                draining_model: str, gang: str | None = None,
                companions: tuple[AwakeMember, ...] | None = None) -> GpuLease:
        """A switch or a start-up admission begins (``switching`` or ``starting``): the
        fencing number goes up first, so every older writer's next write fails. The holder
        stays named until the switch ends; ``gang`` (default: unchanged) names the set;
        ``companions`` (default: none) the engines that stay awake through the switch
        (an awake set: the holder too, when the switch does not put it to sleep)."""
        if state not in (naming.LeaseState.SWITCHING, naming.LeaseState.STARTING):
            raise ValueError(f"a switch opens as switching or starting, not {state}")
        return replace(self, state=state, fence=self.fence + 1, controller=controller,
                       target_model=target_model, draining_model=draining_model,
                       gang=self.gang if gang is None else gang, last_error="",
                       start_claim_uid="", start_granted=None,
                       companions=companions or ())

    def granted(self, claim_uid: str, at: dt.datetime) -> GpuLease:
        """The start gate of ``claim_uid`` is given its go at ``at`` (state unchanged):
        written before the go is handed over, so that whoever takes over knows an engine
        may be coming up. Also how reconciliation keeps a start that is not settled yet
        on the Lease it writes."""
        return replace(self, start_claim_uid=claim_uid, start_granted=at)

    def new_term(self, controller: str) -> GpuLease:
        """This controller takes over the GPU: a new fencing number, nothing else."""
        return replace(self, fence=self.fence + 1, controller=controller)

    def serving(self, *, holder: str, model: str, claim_uid: str, gang: str,
                controller: str | None = None, last_error: str = "",
                companions: tuple[AwakeMember, ...] = ()) -> GpuLease:
        """``holder`` is awake (``awake``), with ``companions`` beside it (an awake set;
        none by default); no switch is under way."""
        return replace(self, state=naming.LeaseState.AWAKE, holder=holder,
                       holder_model=model, holder_claim_uid=claim_uid, gang=gang,
                       companions=tuple(m for m in companions if m.uid != claim_uid),
                       target_model="", draining_model="", last_error=last_error,
                       start_claim_uid="", start_granted=None,
                       controller=self.controller if controller is None else controller)

    def idle(self, *, controller: str | None = None, last_error: str = "") -> GpuLease:
        """Nobody is awake and nothing is under way (``idle``)."""
        return replace(self, state=naming.LeaseState.IDLE, holder="", holder_model="",
                       companions=(),
                       holder_claim_uid="", gang="", target_model="", draining_model="",
                       last_error=last_error, start_claim_uid="", start_granted=None,
                       controller=self.controller if controller is None else controller)

    def failed(self, last_error: str, *, companions: tuple[AwakeMember, ...] = ()
               ) -> GpuLease:
        """The switch failed and left no holder awake (``failed``): the target model stays
        named, so that readers can tell which model did not come up. ``companions``: the
        engines of an awake set the switch did not touch, still awake."""
        return replace(self, state=naming.LeaseState.FAILED, holder="", holder_model="",
                       companions=companions,
                       holder_claim_uid="", gang="", draining_model="",
                       last_error=last_error, start_claim_uid="", start_granted=None)

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
                       (naming.GPU_UUID, lease.gpu_uuid), (naming.GANG, lease.gang),
                       (naming.AWAKE_WITH, _render_members(lease.companions)),
                       (naming.START_GRANTED, _render_start(lease))):
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
