"""The controller Lease (``rota-controller-<node>``): its one parser, its renderer, and the
one rule by which a reader decides that the controller it names is alive. Pure.

The node's acting lease controller (:mod:`controller.lease.election`) writes it and renews it
every third of its duration; standby instances of that node (the same module), every
gateway replica (:mod:`controller.gateway.routing`) and ``kubectl rota`` read it.

Fields (coordination.k8s.io/v1 Lease):

- ``spec.holderIdentity``: the acting instance's identity (its pod name); absent when the
  Lease was released.
- ``spec.leaseDurationSeconds``: how long after a renewal its holder may have stopped.
- ``spec.renewTime`` and ``spec.acquireTime``: stamped by the *holder's* wall clock.
- ``spec.leaseTransitions``: how many times the holder changed.
- annotations :data:`~rota.api.naming.ACTIVATION_URL` (where the holder's activation API
  listens), :data:`~rota.api.naming.INSTANCE` (the holder process's own id: a restarted
  process with the same identity is another instance) and
  :data:`~rota.api.naming.NODE_NAME`; labels :data:`~rota.api.naming.LABEL_KIND`
  (``controller``) and :data:`~rota.api.naming.LABEL_NODE`.

**Liveness: the observer's own clock, never the holder's.** A reader records, per Lease,
the time on its *own monotonic clock* at which it last saw the record change (another
``resourceVersion``, or another holder, instance, ``renewTime``, ``acquireTime``, duration
or transition count), and holds the Lease fresh until that time plus the Lease's duration
(:class:`LeaseObserver`). ``renewTime`` is only ever compared with earlier reads of
itself: never with a local clock, since it was stamped by another machine's wall clock,
which may be ahead, behind, or stepped. This is client-go's leader election rule
(``observedTime``). Its costs, accepted: a Lease first seen (a reader that starts, a Lease
created again) counts as fresh for one whole duration, whatever its ``renewTime`` says,
so a reader that starts after a holder died waits one duration before it counts it dead;
and a reader that polls (a standby instance) sees a change up to one poll late, which only
lengthens its wait. A Lease without a holder, or without a positive duration, is never
fresh. A one-shot reader (``kubectl rota``) cannot see changes and so never judges
liveness; it may show the ``renewTime`` as the node's clock stamped it.

**Compatibility.** Readers ignore keys, annotations and labels they do not know, and read
a missing field as its empty value (no holder, no duration: not fresh). Writers may add
fields and annotations; they never change the meaning of one, and every write of a
holder (every renewal) changes ``renewTime``, so that readers which do not see the
``resourceVersion`` still see the change.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rota.api import naming
from rota.api.gpu_lease import micro_time, parse_micro_time

__all__ = ["ControllerLease", "LeaseObserver", "Observed"]

Obj = Mapping[str, Any]


def _time(value: Any) -> dt.datetime | None:
    moment = parse_micro_time(value) if isinstance(value, str) else None
    if moment is not None and moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment


def _number(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class ControllerLease:
    """One read (or one write) of a node controller's Lease."""

    name: str
    node: str = ""
    """The node's name (the :data:`~rota.api.naming.NODE_NAME` annotation; the node label
    when a writer left it out)."""
    node_label: str = ""
    """The :data:`~rota.api.naming.LABEL_NODE` label: the node as GPU Leases name it."""
    holder: str = ""
    """The acting instance's identity; empty when none holds it."""
    instance: str = ""
    """The holding process's own id (see :mod:`controller.lease.election`)."""
    activation_url: str = ""
    """The activation API's base URL, as the holder advertises it (empty: none)."""
    renew_time: dt.datetime | None = None
    """As the holder's wall clock stamped it. Compared with earlier reads of itself only."""
    acquire_time: dt.datetime | None = None
    duration_s: float = 0.0
    transitions: int = 0
    resource_version: str = ""

    @classmethod
    def parse(cls, obj: Obj) -> ControllerLease:
        """Any Lease object read as a controller Lease (its labels are not checked)."""
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        node_label = str(labels.get(naming.LABEL_NODE) or "")
        return cls(
            name=str(meta.get("name") or ""),
            node=str(annotations.get(naming.NODE_NAME) or node_label),
            node_label=node_label,
            holder=str(spec.get("holderIdentity") or ""),
            instance=str(annotations.get(naming.INSTANCE) or ""),
            activation_url=str(annotations.get(naming.ACTIVATION_URL) or ""),
            renew_time=_time(spec.get("renewTime")),
            acquire_time=_time(spec.get("acquireTime")),
            duration_s=_number(spec.get("leaseDurationSeconds")),
            transitions=int(_number(spec.get("leaseTransitions"))),
            resource_version=str(meta.get("resourceVersion") or ""))

    @classmethod
    def from_object(cls, obj: Obj) -> ControllerLease | None:
        """The controller Lease ``obj`` is; None when it is labelled as no controller Lease
        or has no name."""
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(naming.LABEL_KIND) != naming.KIND_CONTROLLER:
            return None
        lease = cls.parse(obj)
        return lease if lease.name else None

    @property
    def held(self) -> bool:
        return bool(self.holder)

    def same_record(self, other: ControllerLease) -> bool:
        """``other`` is the same write of the Lease as this one: no renewal lies between."""
        if (self.resource_version and other.resource_version
                and self.resource_version != other.resource_version):
            return False
        return self._record() == other._record()

    def _record(self) -> tuple[Any, ...]:
        return (self.holder, self.instance, self.renew_time, self.acquire_time,
                self.duration_s, self.transitions)

    def body(self, namespace: str) -> dict[str, Any]:
        """The Lease object of this value (with its ``resourceVersion``, when it has one:
        a compare-and-swap write)."""
        spec: dict[str, Any] = {"leaseDurationSeconds": max(1, round(self.duration_s)),
                                "leaseTransitions": self.transitions}
        if self.holder:
            spec["holderIdentity"] = self.holder
        if self.renew_time is not None:
            spec["renewTime"] = micro_time(self.renew_time)
        if self.acquire_time is not None:
            spec["acquireTime"] = micro_time(self.acquire_time)
        metadata: dict[str, Any] = {
            "name": self.name, "namespace": namespace,
            "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
                       naming.LABEL_KIND: naming.KIND_CONTROLLER,
                       naming.LABEL_NODE: naming.label_value(self.node_label or self.node)},
            "annotations": {naming.ACTIVATION_URL: self.activation_url,
                            naming.INSTANCE: self.instance, naming.NODE_NAME: self.node},
        }
        if self.resource_version:
            metadata["resourceVersion"] = self.resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
                "spec": spec}


@dataclass(frozen=True)
class Observed:
    """A controller Lease as last read, and when (on the reader's monotonic clock) the
    reader first saw it as it is now."""

    lease: ControllerLease
    changed_at: float

    @property
    def expires_at(self) -> float | None:
        """Until when (the reader's monotonic clock) it is fresh; None: never (no holder,
        no duration)."""
        if not self.lease.held or self.lease.duration_s <= 0:
            return None
        return self.changed_at + self.lease.duration_s

    def fresh(self, now: float) -> bool:
        """Held, and seen to change within its duration before ``now``."""
        expires = self.expires_at
        return expires is not None and now <= expires


class LeaseObserver:
    """Controller Leases by name, each with the reader's monotonic time of its last change.

    Feed it every read (:meth:`observe`, with the reader's monotonic time of the read), ask
    it :meth:`fresh`. Not thread-safe: one owner.
    """

    def __init__(self) -> None:
        self._seen: dict[str, Observed] = {}

    def observe(self, lease: ControllerLease, now: float) -> Observed:
        """Record a read of ``lease`` made at ``now``: a change (or a first sight) starts
        its duration again; the same record read again does not."""
        previous = self._seen.get(lease.name)
        if previous is not None and previous.lease.same_record(lease):
            seen = Observed(lease, previous.changed_at)  # the newest copy, the same age
        else:
            seen = Observed(lease, now)
        self._seen[lease.name] = seen
        return seen

    def get(self, name: str) -> Observed | None:
        return self._seen.get(name)

    def fresh(self, name: str, now: float) -> bool:
        """The Lease ``name`` is held and was seen to change within its duration: its
        holder may be acting at ``now``. False for a Lease never observed."""
        seen = self._seen.get(name)
        return seen is not None and seen.fresh(now)

    def expires_at(self, name: str) -> float | None:
        seen = self._seen.get(name)
        return None if seen is None else seen.expires_at

    def forget(self, name: str) -> None:
        """The Lease was deleted: if it comes back, it is a first sight."""
        self._seen.pop(name, None)

    def retain(self, names: Iterable[str]) -> None:
        """Forget every Lease not in ``names`` (a fresh list of them all)."""
        keep = set(names)
        for name in [n for n in self._seen if n not in keep]:
            del self._seen[name]

    def names(self) -> list[str]:
        return sorted(self._seen)
