"""Where every model lives and which engine is awake: the gateway's routing state.

A plain in-memory structure, fed with Kubernetes objects by a :class:`RoutingSource` (the
watches of :mod:`controller.gateway.kube_source`, or a test feeding it directly) and read
by the request path:

- ResourceClaims allocated by ``gpu.rota.dev`` with an engine config, and their pods, give
  every claimant (:func:`controller.claimants.claimants_from`): model, node, device, pod
  endpoint.
- GPU Leases say who is awake on each GPU and whether a switch is under way; controller
  Leases give each node's activation URL (names and annotations: :mod:`controller.naming`).

The Lease is the truth: nothing here is replica-local knowledge that another gateway
replica could contradict. Every change bumps :attr:`RoutingState.version` and wakes the
requests waiting in :meth:`RoutingState.wait_changed`. Only the event loop's thread may
touch a state (sources in threads hand their events over with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from controller import naming
from controller.claimants import DRIVER, Claimant, claimants_from

__all__ = [
    "Action",
    "Decision",
    "GpuLease",
    "ModelInfo",
    "ModelState",
    "ObjectKind",
    "RoutingSource",
    "RoutingState",
    "StaticSource",
]

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]
ObjectKind = Literal["claim", "pod", "lease"]
ModelState = Literal["awake", "asleep", "switching", "failed"]


class Action(StrEnum):
    """What a request for a model should do now."""

    FORWARD = "forward"
    """The model is awake: send the request to :attr:`Decision.endpoint`."""
    WAIT = "wait"
    """A switch to or away from the model is under way: hold the request until it ends."""
    ACTIVATE = "activate"
    """The model is asleep: ask :attr:`Decision.activation_url` to wake :attr:`Decision.claim`."""
    UNKNOWN = "unknown"
    """No claimant serves this model."""
    UNAVAILABLE = "unavailable"
    """Known, but nothing can wake it now (:attr:`Decision.reason` says why)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    model: str
    endpoint: str | None = None
    claim: str | None = None
    activation_url: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class GpuLease:
    """The parts of one GPU Lease the gateway routes by."""

    name: str
    node: str
    device: str
    holder: str | None
    state: str
    holder_model: str | None
    holder_endpoint: str | None
    holder_claim_uid: str | None
    target_model: str | None
    draining_model: str | None
    last_error: str | None
    fence: int

    @classmethod
    def from_object(cls, obj: Obj) -> GpuLease | None:
        """None when ``obj`` is not a GPU Lease (or lacks its node and device labels)."""
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(naming.LABEL_KIND) != naming.KIND_GPU:
            return None
        node, device = labels.get(naming.LABEL_NODE), labels.get(naming.LABEL_DEVICE)
        if not node or not device:
            return None
        notes = meta.get("annotations") or {}
        spec = obj.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        default_state = naming.STATE_AWAKE if holder else naming.STATE_IDLE
        return cls(
            name=str(meta.get("name", "")), node=str(node), device=str(device),
            holder=holder, state=str(notes.get(naming.STATE) or default_state),
            holder_model=notes.get(naming.HOLDER_MODEL) or None,
            holder_endpoint=notes.get(naming.HOLDER_ENDPOINT) or None,
            holder_claim_uid=notes.get(naming.HOLDER_CLAIM_UID) or None,
            target_model=notes.get(naming.TARGET_MODEL) or None,
            draining_model=notes.get(naming.DRAINING_MODEL) or None,
            last_error=notes.get(naming.LAST_ERROR) or None,
            fence=int(spec.get("leaseTransitions") or 0),
        )


@dataclass(frozen=True)
class ModelInfo:
    """One model as ``/v1/models`` shows it."""

    model: str
    state: ModelState
    gpus: tuple[str, ...]
    """``<node>/<device>`` of every GPU where a claimant serves it."""
    last_error: str | None = None


# Which GPU to wake a sleeping model on when it has claimants on several: one nobody
# holds first, one mid-switch last (the controller would queue us behind that switch).
_ACTIVATION_RANK = {naming.STATE_IDLE: 0, naming.STATE_AWAKE: 2, naming.STATE_FAILED: 3,
                    naming.STATE_SWITCHING: 4}
_NO_LEASE_RANK = 1


def _key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _namespace(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("namespace", ""))


def _ours(claim: Obj) -> bool:
    """The claim holds an allocation result of rota's driver."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return any(r.get("driver") == DRIVER for r in results)


class RoutingState:
    """Claims, pods and Leases as last seen, and the routing decisions they imply."""

    def __init__(self) -> None:
        self._objects: dict[ObjectKind, dict[str, Obj]] = {"claim": {}, "pod": {}, "lease": {}}
        self._dirty = True
        self._by_model: dict[str, list[Claimant]] = {}
        self._gpus: dict[tuple[str, str], GpuLease] = {}
        self._activation_urls: dict[str, str] = {}
        self._synced = False
        self._changed = asyncio.Event()
        self._turn = itertools.count()
        self.version = 0
        """Bumped on every change."""

    # -- feeding ------------------------------------------------------------------------

    def apply(self, kind: ObjectKind, event: str, obj: Obj) -> None:
        """One watch event (``ADDED``, ``MODIFIED`` or ``DELETED``) for one object."""
        store = self._objects[kind]
        key = _key(obj)
        if event == "DELETED" or (kind == "claim" and not _ours(obj)):
            if store.pop(key, None) is None:
                return
        else:
            store[key] = obj
        self._touch()

    def replace(self, kind: ObjectKind, objs: Iterable[Obj], *,
                namespace: str | None = None) -> None:
        """A fresh list of every object of ``kind`` (in ``namespace`` only, when given)."""
        store = self._objects[kind]
        for key in [k for k, o in store.items() if namespace is None or _namespace(o) == namespace]:
            del store[key]
        for obj in objs:
            if kind != "claim" or _ours(obj):
                store[_key(obj)] = obj
        self._touch()

    def mark_synced(self) -> None:
        """Every resource has been listed once: the gateway may answer for unknown models."""
        if not self._synced:
            self._synced = True
            self._touch()

    @property
    def synced(self) -> bool:
        return self._synced

    def claim_namespaces(self) -> set[str]:
        """Namespaces holding at least one claim allocated by rota's driver."""
        return {_namespace(o) for o in self._objects["claim"].values()}

    def _touch(self) -> None:
        self._dirty = True
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, since: int, limit_s: float) -> bool:
        """Wait until :attr:`version` differs from ``since``; False after ``limit_s``."""
        if self.version != since:
            return True
        try:
            async with asyncio.timeout(max(0.0, limit_s)):
                await self._changed.wait()
        except TimeoutError:
            return self.version != since
        return True

    # -- reading ------------------------------------------------------------------------

    def _refresh(self) -> None:
        if not self._dirty:
            return
        pods = {str((p.get("metadata") or {}).get("uid", "")): p
                for p in self._objects["pod"].values()}
        by_model: dict[str, list[Claimant]] = {}
        for claimant in claimants_from(self._objects["claim"].values(), pods):
            by_model.setdefault(claimant.model, []).append(claimant)
        gpus: dict[tuple[str, str], GpuLease] = {}
        urls: dict[str, str] = {}
        for obj in self._objects["lease"].values():
            labels = (obj.get("metadata") or {}).get("labels") or {}
            if labels.get(naming.LABEL_KIND) == naming.KIND_CONTROLLER:
                node = labels.get(naming.LABEL_NODE)
                url = ((obj.get("metadata") or {}).get("annotations") or {}).get(
                    naming.ACTIVATION_URL)
                if node and url:
                    urls[str(node)] = str(url).rstrip("/")
                continue
            lease = GpuLease.from_object(obj)
            if lease is not None:
                gpus[(lease.node, lease.device)] = lease
        self._by_model, self._gpus, self._activation_urls = by_model, gpus, urls
        self._dirty = False

    def models(self) -> list[str]:
        self._refresh()
        return sorted(self._by_model)

    def knows(self, model: str) -> bool:
        self._refresh()
        return model in self._by_model

    def gpu(self, node: str, device: str) -> GpuLease | None:
        self._refresh()
        return self._gpus.get((node, device))

    def claimants(self, model: str) -> list[Claimant]:
        self._refresh()
        return list(self._by_model.get(model, []))

    def _awake_endpoint(self, claimant: Claimant) -> str | None:
        lease = self._gpus.get((claimant.node, claimant.device))
        if lease is None or lease.state != naming.STATE_AWAKE or lease.holder != claimant.ref:
            return None
        if lease.holder_claim_uid and lease.holder_claim_uid != claimant.claim_uid:
            return None  # a claim of the same name, deleted and created again
        if claimant.pod_deleting:
            return None
        return lease.holder_endpoint or claimant.endpoint

    def _switch_touching(self, model: str) -> str | None:
        for claimant in self._by_model.get(model, []):
            lease = self._gpus.get((claimant.node, claimant.device))
            if lease is None or lease.state != naming.STATE_SWITCHING:
                continue
            if lease.target_model == model:
                return "switching"
            if lease.draining_model == model:
                return "draining"
        return None

    def decide(self, model: str) -> Decision:
        """What a request for ``model`` should do, given what is known now."""
        self._refresh()
        claimants = self._by_model.get(model, [])
        if not claimants:
            if not self._synced:
                return Decision(Action.UNAVAILABLE, model, reason="not_ready")
            return Decision(Action.UNKNOWN, model)
        awake = [(c, e) for c in claimants if (e := self._awake_endpoint(c))]
        if awake:
            claimant, endpoint = awake[next(self._turn) % len(awake)]
            return Decision(Action.FORWARD, model, endpoint=endpoint, claim=claimant.ref)
        waiting = self._switch_touching(model)
        if waiting:
            return Decision(Action.WAIT, model, reason=waiting)
        options: list[tuple[int, str, Claimant, str]] = []
        for claimant in claimants:
            url = self._activation_urls.get(claimant.node)
            if not claimant.serving or url is None:
                continue
            lease = self._gpus.get((claimant.node, claimant.device))
            rank = _NO_LEASE_RANK if lease is None else _ACTIVATION_RANK.get(lease.state, 5)
            options.append((rank, claimant.ref, claimant, url))
        if not options:
            serving = any(c.serving for c in claimants)
            return Decision(Action.UNAVAILABLE, model,
                            reason="no_controller" if serving else "no_serving_engine")
        _, ref, _, url = min(options, key=lambda o: (o[0], o[1]))
        return Decision(Action.ACTIVATE, model, claim=ref, activation_url=url)

    def model_infos(self) -> list[ModelInfo]:
        """Every known model with its state, for ``/v1/models``."""
        self._refresh()
        infos = []
        for model in sorted(self._by_model):
            claimants = self._by_model[model]
            gpus = tuple(sorted({f"{c.node}/{c.device}" for c in claimants}))
            state: ModelState = "asleep"
            last_error = None
            if any(self._awake_endpoint(c) for c in claimants):
                state = "awake"
            elif self._switch_touching(model):
                state = "switching"
            else:
                for c in claimants:
                    lease = self._gpus.get((c.node, c.device))
                    if lease is not None and lease.state == naming.STATE_FAILED and (
                            lease.target_model == model or lease.holder == c.ref):
                        state, last_error = "failed", lease.last_error
                        break
            infos.append(ModelInfo(model, state, gpus, last_error))
        return infos


class RoutingSource(Protocol):
    """Feeds a :class:`RoutingState` (Kubernetes watches, or a test)."""

    async def run(self, state: RoutingState) -> None:
        """Feed ``state`` until cancelled; may return early when it has nothing more."""


class StaticSource:
    """Feeds fixed objects once and marks the state synced (tests and local runs).

    Tests then change the state directly with :meth:`RoutingState.apply`.
    """

    def __init__(self, *, claims: Iterable[Obj] = (), pods: Iterable[Obj] = (),
                 leases: Iterable[Obj] = ()) -> None:
        self._objects: dict[ObjectKind, list[Obj]] = {
            "claim": list(claims), "pod": list(pods), "lease": list(leases)}

    async def run(self, state: RoutingState) -> None:
        for kind, objs in self._objects.items():
            state.replace(kind, objs)
        state.mark_synced()
