"""What ``kubectl`` shows of rota's switches: Events, a state label on engine pods, and
conditions on the ResourceClaims.

An admin should not need rota's HTTP endpoints to see what happened on a GPU:

- Events (``events.k8s.io/v1``) regarding the engine pod, related to its claim:
  ``SwitchedIn`` (the engine was woken and proved), ``SwitchedOut`` (put to sleep for
  another), ``SwitchFailed`` (Warning; the note starts with the CamelCase cause, e.g.
  ``GPUOutOfMemory: ...``), ``StartWaiting`` / ``StartAdmitted`` (start-up admission).
  ``SwitchFailed`` and the start-up events are also recorded regarding the claim, since a
  claim's owner may not look at pods. Repeats of one (object, reason) within
  :data:`SERIES_WINDOW_S` update one Event's ``series`` instead of creating new Events,
  as Kubernetes' own recorders do.
- The label :data:`LABEL_STATE` on engine pods: ``awake``, ``asleep``, ``switching``,
  ``starting`` or ``failed`` (``kubectl get pods -L gpu.rota.dev/state``).
- ``status.devices[]`` conditions of each claim's allocated device: ``Awake`` (its engine
  holds the GPU) and ``Ready`` (its engine is initialised and may be woken). Entries of
  other drivers are kept (:func:`merged_devices`). Server-side apply is not used: the
  API server (1.37) rejects an apply to a claim's status that the scheduler allocated
  ("status.allocation: field cannot be modified once set"), so the writer reads and
  replaces with a compare-and-swap.

This module is pure: it builds the bodies. :mod:`controller.lease.visible_state_writer` sends
them, off the switch's path.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from controller.claimants import DRIVER, Claimant
from rota.api.gpu_lease import micro_time

__all__ = [
    "FIELD_MANAGER",
    "LABEL_STATE",
    "REPORTING_CONTROLLER",
    "SERIES_WINDOW_S",
    "EngineState",
    "EventReason",
    "Occurrence",
    "camel_cause",
    "device_status",
    "event_body",
    "event_series_patch",
    "merged_devices",
    "pod_state_patch",
]

LABEL_STATE = "gpu.rota.dev/state"
REPORTING_CONTROLLER = "gpu.rota.dev/lease-controller"
FIELD_MANAGER = "gpu.rota.dev-lease-controller"
SERIES_WINDOW_S = 360.0
"""Repeats within this window join the first Event's series (client-go uses 6 minutes)."""
_NOTE_LIMIT = 1024
_MESSAGE_LIMIT = 1024


class EngineState(StrEnum):
    """The value of :data:`LABEL_STATE` on an engine pod."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    SWITCHING = "switching"
    STARTING = "starting"
    FAILED = "failed"


class EventReason(StrEnum):
    SWITCHED_IN = "SwitchedIn"
    SWITCHED_OUT = "SwitchedOut"
    SWITCH_FAILED = "SwitchFailed"
    START_WAITING = "StartWaiting"
    START_ADMITTED = "StartAdmitted"
    FOOTPRINT_CREEPING = "FootprintCreeping"


_WARNING = {EventReason.SWITCH_FAILED, EventReason.FOOTPRINT_CREEPING}
_ACTION = {EventReason.SWITCHED_IN: "Wake", EventReason.SWITCHED_OUT: "Sleep",
           EventReason.SWITCH_FAILED: "Switch", EventReason.START_WAITING: "Start",
           EventReason.START_ADMITTED: "Start", EventReason.FOOTPRINT_CREEPING: "Inspect"}

# Words that stay upper case in a CamelCase cause (metric reasons are snake_case).
_ACRONYMS = {"gpu": "GPU", "oom": "OutOfMemory", "nvml": "NVML", "api": "API",
             "http": "HTTP", "sse": "SSE", "ttft": "TTFT", "id": "ID"}


def camel_cause(reason: str) -> str:
    """A switch failure's metric reason as an Event cause: ``gpu_oom`` ->
    ``GPUOutOfMemory``, ``memory_not_returned`` -> ``MemoryNotReturned``,
    ``probe_wrong_content`` -> ``ProbeWrongContent``. Anything unusable -> ``Unknown``."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", reason) if w]
    camel = "".join(_ACRONYMS.get(w.lower(), w[:1].upper() + w[1:].lower()) for w in words)
    return camel[:64] or "Unknown"


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about (``regarding``) or related to."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    def body(self) -> dict[str, str]:
        return {"apiVersion": self.api_version, "kind": self.kind,
                "namespace": self.namespace, "name": self.name, "uid": self.uid}


def pod_ref(claimant: Claimant) -> ObjectRef | None:
    if not claimant.pod_name or not claimant.pod_uid:
        return None
    return ObjectRef("v1", "Pod", claimant.namespace, claimant.pod_name, claimant.pod_uid)


def claim_ref(claimant: Claimant) -> ObjectRef:
    return ObjectRef("resource.k8s.io/v1", "ResourceClaim", claimant.namespace,
                     claimant.claim_name, claimant.claim_uid)


@dataclass(frozen=True)
class Occurrence:
    """One thing to record: ``reason`` about ``regarding``, with a human ``note``."""

    regarding: ObjectRef
    reason: EventReason
    note: str
    related: ObjectRef | None = None

    @property
    def key(self) -> tuple[str, str]:
        """Occurrences with the same key join one Event's series: same object, reason and
        note (an Event's note cannot change once written)."""
        digest = hashlib.sha256(self.note[:_NOTE_LIMIT].encode()).hexdigest()[:16]
        return (self.regarding.uid, f"{self.reason.value}/{digest}")

    @property
    def type(self) -> str:
        return "Warning" if self.reason in _WARNING else "Normal"


def event_name(occurrence: Occurrence, now: dt.datetime) -> str:
    """``<object name>.<hash>``: unique per (object, reason, first time), <= 253 chars."""
    digest = hashlib.sha256(f"{occurrence.regarding.uid}/{occurrence.reason}/"
                            f"{now.isoformat()}".encode()).hexdigest()[:16]
    return f"{occurrence.regarding.name[:200]}.{digest}"


def event_body(occurrence: Occurrence, *, instance: str, now: dt.datetime) -> dict[str, Any]:
    """A new ``events.k8s.io/v1`` Event for ``occurrence``."""
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": event_name(occurrence, now),
                     "namespace": occurrence.regarding.namespace},
        "eventTime": micro_time(now), "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:128], "action": _ACTION[occurrence.reason],
        "reason": occurrence.reason.value, "type": occurrence.type,
        "regarding": occurrence.regarding.body(), "note": occurrence.note[:_NOTE_LIMIT],
    }
    if occurrence.related is not None:
        body["related"] = occurrence.related.body()
    return body


def event_series_patch(occurrence: Occurrence, *, count: int, now: dt.datetime
                       ) -> dict[str, Any]:
    """A merge patch that records the ``count``-th occurrence (>= 2) in the first Event (its
    note stays: the API server refuses to change it)."""
    return {"series": {"count": max(2, count), "lastObservedTime": micro_time(now)}}


def pod_state_patch(state: EngineState) -> dict[str, Any]:
    """A merge patch of an engine pod's state label."""
    return {"metadata": {"labels": {LABEL_STATE: state.value}}}


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str

    def body(self, *, since: dt.datetime, generation: int) -> dict[str, Any]:
        return {"type": self.type, "status": "True" if self.status else "False",
                "reason": self.reason, "message": self.message[:_MESSAGE_LIMIT],
                "lastTransitionTime": since.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "observedGeneration": generation}


def device_status(claimant: Claimant, conditions: list[Condition], *,
                  since: dict[str, dt.datetime], generation: int) -> dict[str, Any]:
    """The claim's ``status.devices[]`` entry for its device, with ``conditions``.

    ``since`` gives each condition type's last transition (the caller keeps it, so a
    re-write of an unchanged status does not move the time).
    """
    device: dict[str, Any] = {
        "driver": DRIVER, "pool": claimant.node, "device": claimant.device,
        "conditions": [c.body(since=since[c.type], generation=generation) for c in conditions],
    }
    if claimant.share_id:
        device["shareID"] = claimant.share_id
    return device


def _device_key(entry: dict[str, Any]) -> tuple[str, str, str, str]:
    return (str(entry.get("driver", "")), str(entry.get("pool", "")),
            str(entry.get("device", "")), str(entry.get("shareID") or ""))


def merged_devices(current: list[dict[str, Any]], ours: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """``status.devices`` with ``ours`` in place of the entries of the same device (a list
    map keyed by driver, pool, device and share id); every other entry is kept as is."""
    replaced = {_device_key(entry) for entry in ours}
    return [e for e in current if _device_key(e) not in replaced] + list(ours)


def awake_conditions(*, awake: bool, ready: bool, reason: str, message: str
                     ) -> list[Condition]:
    """The two conditions rota keeps on a claim's device."""
    return [Condition("Awake", awake, reason, message),
            Condition("Ready", ready, reason if not ready else "Initialised",
                      message if not ready else "the engine is initialised and may be woken")]
