"""Where every model lives and which engine is awake: the gateway's routing state.

A plain in-memory structure, fed with Kubernetes objects by a :class:`RoutingSource` (the
watches of :mod:`controller.gateway.kube_source`, or a test feeding it directly) and read
by the request path. What each kind of object may decide:

- ResourceClaims allocated by ``gpu.rota.dev`` and their pods give every claimant
  (:func:`controller.claimants.claimants_from`): model, node, GPU, and the **pod IP**, the
  only address a request is ever sent to. A claimant counts only in a namespace that the
  admin's :class:`~controller.gateway.binding.ModelBinding` binds to its model.
- GPU Leases (:class:`controller.leases.GpuLease`, one per physical GPU, named after
  ``(node, Claimant.gpu)`` so the shares of one GPU meet in one Lease) say **who** holds
  each GPU — the holder's claim ref and uid under a fencing number — and whether a switch
  is under way. Never where to send traffic.
- Controller Leases say which node controllers are alive and where their activation API
  listens. Alive means: this gateway saw the Lease's record change within the Lease's
  duration, on the gateway's own monotonic clock
  (:class:`controller.api.controller_lease.LeaseObserver`, the rule the controllers'
  election applies too); the ``renewTime`` the node's clock stamped is never compared
  with this one. A GPU whose controller Lease expired is treated as lost: its engine gets
  no traffic, and its unfinished switch does not hold requests when another replica
  could be woken.

The Leases are the truth: nothing here is replica-local knowledge that another gateway
replica could contradict. Every change bumps :attr:`RoutingState.version` and wakes the
requests waiting in :meth:`RoutingState.wait_changed`; so does a controller Lease running
out. Only the event loop's thread may touch a state (sources in threads hand their events
over with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from controller import naming
from controller.api.controller_lease import ControllerLease, LeaseObserver
from controller.claimants import DRIVER, Claimant, claimants_from
from controller.gateway.binding import ModelBinding
from controller.gateway.engine_keys import secret_ref
from controller.gateway.lease_view import (
    activation_url,
    controller_lease_of,
    gpu_lease_of,
    slim_pod,
)
from controller.leases import GpuLease
from controller.urls import http_url

__all__ = [
    "Action",
    "Decision",
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
Clock = Callable[[], float]
"""The gateway's monotonic clock (seconds), by which controller Leases are judged."""

_TERMINAL = frozenset({naming.STATE_AWAKE, naming.STATE_IDLE, naming.STATE_FAILED})
"""Lease states in which no switch runs: the holder (if any) is the one awake engine."""


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
    """FORWARD: the claimant's pod IP and engine port, as this gateway watches them."""
    claim: str | None = None
    claim_uid: str | None = None
    namespace: str | None = None
    gpu: str | None = None
    """``<node>/<gpu>``."""
    fence: int | None = None
    """FORWARD: the GPU Lease's fencing number under which the claimant holds the GPU."""
    key_secret: tuple[str, str] | None = None
    """FORWARD: ``(name, key)`` of the Secret holding the engine's API key, if it has one."""
    activation_url: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """One model as ``/v1/models`` shows it."""

    model: str
    state: ModelState
    gpus: tuple[str, ...]
    """``<node>/<gpu>`` of every GPU where a claimant serves it."""
    last_error: str | None = None
    """The reason of the last failed switch (``gpu_oom``), never its message."""


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


def _holds(lease: GpuLease, claimant: Claimant) -> bool:
    """``lease`` names ``claimant`` (ref and uid: not a namesake created again) as holder."""
    return (lease.holder == claimant.ref and bool(lease.holder_claim_uid)
            and lease.holder_claim_uid == claimant.claim_uid)


class RoutingState:
    """Claims, pods and Leases as last seen, and the routing decisions they imply."""

    def __init__(self, *, binding: ModelBinding | None = None,
                 clock: Clock = time.monotonic) -> None:
        self._objects: dict[ObjectKind, dict[str, Obj]] = {"claim": {}, "pod": {}, "lease": {}}
        self._binding = binding if binding is not None else ModelBinding()
        self._clock = clock
        self._dirty = True
        self._by_model: dict[str, list[Claimant]] = {}
        self._by_uid: dict[str, Claimant] = {}
        self._gpus: dict[str, GpuLease] = {}
        self._controllers: dict[str, ControllerLease] = {}
        self._ignored = 0
        self._synced = False
        self._changed = asyncio.Event()
        self._turn = itertools.count()
        self._fresh_seen: dict[str, bool] = {}
        self._observer = LeaseObserver()
        """When this gateway saw each controller Lease change, on :attr:`clock`."""
        self.binding_changed = asyncio.Event()
        """Set when :meth:`set_binding` changed it (sources re-check what they watch)."""
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
            store[key] = slim_pod(obj) if kind == "pod" else obj
        if kind == "lease":
            self._observe(obj, deleted=event == "DELETED")
        self._touch()

    def replace(self, kind: ObjectKind, objs: Iterable[Obj], *,
                namespace: str | None = None) -> None:
        """A fresh list of every object of ``kind`` (in ``namespace`` only, when given)."""
        store = self._objects[kind]
        for key in [k for k, o in store.items() if namespace is None or _namespace(o) == namespace]:
            del store[key]
        for obj in objs:
            if kind == "pod":
                store[_key(obj)] = slim_pod(obj)
            elif kind != "claim" or _ours(obj):
                store[_key(obj)] = obj
            if kind == "lease":
                self._observe(obj, deleted=False)
        self._touch()

    def _observe(self, obj: Obj, *, deleted: bool) -> None:
        """A controller Lease read now (on :attr:`clock`): a change restarts its duration."""
        controller = controller_lease_of(obj)
        if controller is None:
            return
        if deleted:
            self._observer.forget(controller.name)
        else:
            self._observer.observe(controller, self._clock())

    @property
    def clock(self) -> Clock:
        """The monotonic clock controller Leases are judged by (tests move it)."""
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._clock = clock

    def set_binding(self, binding: ModelBinding) -> None:
        """The admin's binding changed (its file was re-read)."""
        if binding != self._binding:
            self._binding = binding
            self.binding_changed.set()
            self._touch()

    @property
    def binding(self) -> ModelBinding:
        return self._binding

    def mark_synced(self) -> None:
        """Every resource has been listed once: the gateway may answer for unknown models."""
        if not self._synced:
            self._synced = True
            self._touch()

    @property
    def synced(self) -> bool:
        return self._synced

    def claim_namespaces(self) -> set[str]:
        """Namespaces holding a claim of rota's driver that the binding could let serve:
        the namespaces whose pods are worth watching."""
        return {ns for o in self._objects["claim"].values()
                if self._binding.may_serve_something(ns := _namespace(o))}

    def _touch(self) -> None:
        self._dirty = True
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _next_expiry(self) -> float | None:
        """Seconds until the next fresh controller Lease runs out (None: none will)."""
        now = self._clock()
        ahead = [expires - now for name in self._controllers
                 if (expires := self._observer.expires_at(name)) is not None and expires > now]
        return min(ahead) if ahead else None

    def _expired_since_refresh(self) -> bool:
        now = self._clock()
        return any(self._fresh_seen.get(name, False) and not self._observer.fresh(name, now)
                   for name in self._controllers)

    async def wait_changed(self, since: int, limit_s: float) -> bool:
        """Wait until :attr:`version` differs from ``since``; False after ``limit_s``.

        A controller Lease running out is a change too: it wakes the waiters.
        """
        self._refresh()
        if self._expired_since_refresh():
            self._touch()
        if self.version != since:
            return True
        loop = asyncio.get_running_loop()
        until = loop.time() + max(0.0, limit_s)
        while True:
            changed = self._changed
            expiry = self._next_expiry()
            left = until - loop.time()
            step = left if expiry is None else min(left, expiry + 0.001)
            try:
                async with asyncio.timeout(max(0.0, step)):
                    await changed.wait()
                return True
            except TimeoutError:
                pass
            if self._expired_since_refresh():
                self._touch()
                return True
            if loop.time() >= until:
                return self.version != since

    # -- reading ------------------------------------------------------------------------

    def _refresh(self) -> None:
        if not self._dirty:
            return
        pods = {str((p.get("metadata") or {}).get("uid", "")): p
                for p in self._objects["pod"].values()}
        by_model: dict[str, list[Claimant]] = {}
        ignored = 0
        for claimant in claimants_from(self._objects["claim"].values(), pods):
            if not self._binding.allows(claimant.model, claimant.namespace):
                ignored += 1
                continue
            by_model.setdefault(claimant.model, []).append(claimant)
        gpus: dict[str, GpuLease] = {}
        controllers: dict[str, ControllerLease] = {}
        for obj in self._objects["lease"].values():
            controller = controller_lease_of(obj)
            if controller is not None:
                controllers[controller.name] = controller
                continue
            lease = gpu_lease_of(obj)
            if lease is not None:
                gpus[lease.name] = lease
        if ignored != self._ignored and ignored:
            log.warning("claimants ignored: their namespace is not bound to their model",
                        extra={"count": ignored})
        self._by_model, self._gpus, self._controllers = by_model, gpus, controllers
        self._by_uid = {c.claim_uid: c for cs in by_model.values() for c in cs}
        self._ignored = ignored
        self._observer.retain(controllers)
        now = self._clock()
        self._fresh_seen = {name: self._observer.fresh(name, now) for name in controllers}
        self._dirty = False

    @property
    def ignored_claimants(self) -> int:
        """Claimants in namespaces the binding does not bind to their model."""
        self._refresh()
        return self._ignored

    def models(self) -> list[str]:
        self._refresh()
        return sorted(self._by_model)

    def knows(self, model: str) -> bool:
        self._refresh()
        return model in self._by_model

    def lease_of(self, claimant: Claimant) -> GpuLease | None:
        """The GPU Lease of the physical GPU ``claimant`` shares."""
        self._refresh()
        return self._gpus.get(naming.gpu_lease_name(claimant.node, claimant.gpu))

    def claimants(self, model: str) -> list[Claimant]:
        self._refresh()
        return list(self._by_model.get(model, []))

    def _controller(self, claimant: Claimant) -> ControllerLease | None:
        return self._controllers.get(naming.controller_lease_name(claimant.node))

    def _alive(self, claimant: Claimant, now: float) -> bool:
        """This gateway saw the node controller's Lease change within its duration."""
        controller = self._controller(claimant)
        return controller is not None and self._observer.fresh(controller.name, now)

    def _awake(self, claimant: Claimant, now: float) -> GpuLease | None:
        """The Lease under which ``claimant`` may get traffic now, if it may: the Lease of
        its first GPU, and only while the Lease of every GPU it holds names it awake (a
        tensor-parallel engine is awake only as the holder of all of them)."""
        for gpu in claimant.gpus:
            held = self._gpus.get(naming.gpu_lease_name(claimant.node, gpu))
            if held is None or held.state != naming.STATE_AWAKE or not _holds(held, claimant):
                return None
        if not claimant.serving or not self._alive(claimant, now):
            return None
        return self.lease_of(claimant)

    def _switch_touching(self, model: str, now: float, *, alive: bool) -> str | None:
        """``switching`` or ``draining`` when a switch to or from ``model`` runs on a GPU
        whose controller is (``alive``) or is not alive."""
        for claimant in self._by_model.get(model, []):
            lease = self.lease_of(claimant)
            if lease is None or lease.state in _TERMINAL:
                continue
            if self._alive(claimant, now) != alive:
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
        now = self._clock()
        awake = [(c, lease) for c in claimants if (lease := self._awake(c, now))]
        if awake:
            claimant, lease = awake[next(self._turn) % len(awake)]
            return self._forward(claimant, lease)
        waiting = self._switch_touching(model, now, alive=True)
        if waiting:
            return Decision(Action.WAIT, model, reason=waiting)
        options: list[tuple[int, str, Claimant, str]] = []
        for claimant in claimants:
            controller = self._controller(claimant)
            url = None if controller is None else activation_url(controller)
            if not claimant.serving or url is None:
                continue
            if not self._alive(claimant, now):
                continue
            lease = self.lease_of(claimant)
            rank = _NO_LEASE_RANK if lease is None else _ACTIVATION_RANK.get(lease.state, 5)
            options.append((rank, claimant.ref, claimant, url))
        if options:
            _, ref, _, url = min(options, key=lambda o: (o[0], o[1]))
            return Decision(Action.ACTIVATE, model, claim=ref, activation_url=url)
        lost = self._switch_touching(model, now, alive=False)
        if lost:
            # Its node's controller stopped renewing mid-switch and nothing else can be
            # woken: a restarted controller may still finish it.
            return Decision(Action.WAIT, model, reason="controller_lost")
        if any(c.serving for c in claimants):
            # Serving engines, but no live controller to wake one (one is starting, or
            # being replaced by a rollout): wait for it, bounded.
            return Decision(Action.WAIT, model, reason="no_controller")
        return Decision(Action.UNAVAILABLE, model, reason="no_serving_engine")

    @staticmethod
    def _forward(claimant: Claimant, lease: GpuLease) -> Decision:
        assert claimant.pod_ip is not None  # serving
        return Decision(Action.FORWARD, claimant.model,
                        endpoint=http_url(claimant.pod_ip, claimant.port), claim=claimant.ref,
                        claim_uid=claimant.claim_uid, namespace=claimant.namespace,
                        gpu=f"{claimant.node}/{claimant.gpu}", fence=lease.fence,
                        key_secret=secret_ref(claimant.config))

    def still_holds(self, decision: Decision) -> bool:
        """Does the claimant of a FORWARD ``decision`` still hold its GPU under the same
        fence, as far as this gateway sees now? (Checked at forward time.)"""
        self._refresh()
        claimant = self._by_uid.get(decision.claim_uid or "")
        if claimant is None:
            return False
        lease = self._awake(claimant, self._clock())
        return lease is not None and lease.fence == decision.fence

    def fence_of(self, claim: str) -> int | None:
        """The fencing number of the GPU Lease of the claimant ``<namespace>/<name>``."""
        self._refresh()
        for claimants in self._by_model.values():
            for claimant in claimants:
                if claimant.ref == claim:
                    lease = self.lease_of(claimant)
                    return None if lease is None else lease.fence
        return None

    def lost(self, decision: Decision) -> str | None:
        """Why a request forwarded under ``decision`` can no longer be served by its engine
        (None while it may): the GPU's Lease moved past the fence it was sent under and
        settled with another holder, or none, so the engine has been put to sleep (an
        engine that is asleep holds requests until it is woken; it does not refuse them)."""
        self._refresh()
        claimant = self._by_uid.get(decision.claim_uid or "")
        if claimant is None:
            return "claim_gone"
        lease = self.lease_of(claimant)
        if lease is None or decision.fence is None or lease.fence <= decision.fence:
            return None
        if lease.state in _TERMINAL and not (lease.state != naming.STATE_IDLE
                                             and _holds(lease, claimant)):
            return "put_to_sleep"
        return None

    async def wait_lost(self, decision: Decision) -> str:
        """Return (with :meth:`lost`'s reason) once ``decision``'s engine is lost."""
        while True:
            reason = self.lost(decision)
            if reason is not None:
                return reason
            await self.wait_changed(self.version, 3600.0)

    def model_infos(self) -> list[ModelInfo]:
        """Every known model with its state, for ``/v1/models``."""
        self._refresh()
        now = self._clock()
        infos = []
        for model in sorted(self._by_model):
            claimants = self._by_model[model]
            gpus = tuple(sorted({f"{c.node}/{c.gpu}" for c in claimants}))
            state: ModelState = "asleep"
            last_error = None
            if any(self._awake(c, now) for c in claimants):
                state = "awake"
            elif self._switch_touching(model, now, alive=True):
                state = "switching"
            else:
                for c in claimants:
                    lease = self.lease_of(c)
                    if lease is not None and lease.state == naming.STATE_FAILED and (
                            lease.target_model == model or lease.holder == c.ref):
                        state = "failed"
                        last_error = lease.last_error.partition(":")[0].strip() or None
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
