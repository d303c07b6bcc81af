"""Where every model lives and which engine is awake: the gateway's routing state.

A plain in-memory structure, fed with Kubernetes objects by a :class:`RoutingSource` (the
watches of :mod:`controller.gateway.kube_source`, or a test feeding it directly) and read
by the request path. What each kind of object may decide:

- ResourceClaims allocated by ``gpu.rota.dev`` and their pods give every claimant
  (:func:`controller.claimants.claimants_from`): model, node, GPU, and the **pod IP**, the
  only address a request is ever sent to. A claimant counts only in a namespace that the
  admin's :class:`~controller.gateway.binding.ModelBinding` binds to its model.
- GPU Leases (:class:`rota.api.gpu_lease.GpuLease`, one per physical GPU, named after
  ``(node, Claimant.gpu)`` so the shares of one GPU meet in one Lease) say **who** holds
  each GPU — the holder's claim ref and uid under a fencing number — and whether a switch
  is under way; where the admin allows an awake set, also the engines awake beside the
  holder (ref and uid each, :attr:`~rota.api.gpu_lease.GpuLease.companions`), which are
  routed to like the holder, and still while a switch on their GPU runs (it does not
  touch them). Never where to send traffic.
- Controller Leases say which node controllers are alive and where their activation API
  listens. Alive means: this gateway saw the Lease's record change within the Lease's
  duration, on the gateway's own monotonic clock
  (:class:`rota.api.controller_lease.LeaseObserver`, the rule the controllers'
  election applies too); the ``renewTime`` the node's clock stamped is never compared
  with this one. A GPU whose controller Lease expired is treated as lost: its engine gets
  no traffic, and its unfinished switch does not hold requests when another replica
  could be woken. A controller whose activation API cannot be reached at the address its
  Lease names is lost for activations until that Lease changes
  (:meth:`RoutingState.unreachable`): requests wait for the next holder, not fail.

The Leases are the truth: nothing here is replica-local knowledge that another gateway
replica could contradict. Only the event loop's thread may touch a state (sources in
threads hand their events over with ``call_soon_threadsafe``).

**Updated in place, at a cost independent of the fleet's size.** A fleet of a thousand
nodes sends a gateway hundreds of events a second (every controller renews its Lease every
few seconds), so no event may cost more than what it concerns:

- a claim or pod event derives one claimant again (the claims reserved for that pod), and
  none when nothing routing reads has changed (objects are kept slim, as compact JSON, and
  compared whole): the controller's labels and conditions, a relist of the same objects;
- a GPU Lease event replaces one GPU's entry;
- a controller Lease event changes liveness only, and a renewal changes no routing at all;
  the times at which controller Leases run out are kept on a heap, so that finding the
  next one, or those that ran out, costs nothing per node;
- a request reads its model's claimants, their GPUs' Leases and the liveness of their own
  nodes' controllers, nothing else.

Every change that may alter what a request for a model does bumps
:meth:`RoutingState.model_version` of that model, and :attr:`RoutingState.version`;
:meth:`RoutingState.wait_changed` waits for either (``model=`` for the first), so a held
request wakes only for its own model. A controller Lease running out is a change for the
models of its node. Changing the binding judges every claimant again (rare: its file).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from controller.claimants import DRIVER, Claimant, claimants_from
from controller.gateway.binding import ModelBinding
from controller.gateway.engine_keys import secret_ref
from controller.gateway.lease_view import (
    activation_url,
    controller_lease_of,
    gpu_lease_of,
    slim_claim,
    slim_pod,
)
from controller.urls import http_url
from rota.api import naming
from rota.api.controller_lease import ControllerLease, LeaseObserver
from rota.api.gpu_lease import GpuLease

__all__ = [
    "Action",
    "Decision",
    "ModelInfo",
    "ModelState",
    "ObjectKind",
    "RoutingSource",
    "RoutingState",
    "StaticSource",
    "claim_is_ours",
]

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]
ObjectKind = Literal["claim", "pod", "lease"]
ModelState = Literal["awake", "asleep", "starting", "switching", "failed"]
Clock = Callable[[], float]
"""The gateway's monotonic clock (seconds), by which controller Leases are judged."""

_TERMINAL = frozenset({naming.STATE_AWAKE, naming.STATE_IDLE, naming.STATE_FAILED})
"""Lease states in which no switch runs: the holder (if any) is awake, beside the Lease's
companions (an awake set)."""


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
    awake_on: tuple[str, ...] = ()
    """``<node>/<gpu>`` of every GPU where an engine of it is awake now (requests for it
    are sent there), every GPU of a tensor-parallel one."""
    awake_with: tuple[str, ...] = ()
    """The other models awake on those GPUs now: the rest of their awake sets (none where
    one engine is awake per GPU)."""


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


def _pack(obj: Obj) -> bytes:
    """A slim object as compact JSON (keys sorted: equal objects, equal bytes)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def claim_is_ours(claim: Obj) -> bool:
    """The claim holds an allocation result of rota's driver."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return any(r.get("driver") == DRIVER for r in results)


def _holds(lease: GpuLease, claimant: Claimant) -> bool:
    """``lease`` names ``claimant`` (ref and uid: not a namesake created again) as holder."""
    return (lease.holder == claimant.ref and bool(lease.holder_claim_uid)
            and lease.holder_claim_uid == claimant.claim_uid)


def _beside(lease: GpuLease, claimant: Claimant) -> bool:
    """``lease`` names ``claimant`` (ref and uid) among the engines awake beside its holder
    (:attr:`GpuLease.companions`): awake whatever the Lease's state."""
    return bool(claimant.claim_uid) and any(
        m.claim == claimant.ref and m.uid == claimant.claim_uid for m in lease.companions)


def _names_awake(lease: GpuLease, claimant: Claimant) -> bool:
    """``lease`` names ``claimant`` in its awake set: the holder of an ``awake`` Lease, or
    an engine awake beside the holder (in any state)."""
    return (lease.state == naming.STATE_AWAKE and _holds(lease, claimant)) or _beside(
        lease, claimant)


class RoutingState:
    """Claims, pods and Leases as last seen, and the routing decisions they imply.

    Updated in place: a watch event changes only what it concerns (see the module
    docstring), so that its cost, and a request's, does not grow with the fleet.
    """

    def __init__(self, *, binding: ModelBinding | None = None,
                 clock: Clock = time.monotonic) -> None:
        self._binding = binding if binding is not None else ModelBinding()
        self._clock = clock
        # What the watches delivered, slim, by "<namespace>/<name>".
        self._claims: dict[str, bytes] = {}
        self._pods: dict[str, bytes] = {}
        """Slim objects, held as compact JSON: a fraction of the memory of dicts, compared
        in one step, decoded only to derive a claimant again."""
        self._leases: dict[str, tuple[str, str]] = {}
        """Lease object key -> (``gpu`` or ``controller`` or ``other``, Lease name)."""
        self._pod_by_uid: dict[str, str] = {}
        self._claims_per_namespace: Counter[str] = Counter()
        # Claimants, one per claim key (the claimant's ref), and their indexes.
        self._claimants: dict[str, Claimant] = {}
        self._reserved: dict[str, tuple[str, ...]] = {}
        """Claim key -> the pod uids its ``reservedFor`` names."""
        self._claims_of_pod: dict[str, tuple[str, ...]] = {}
        self._by_model: dict[str, dict[str, Claimant]] = {}
        """Bound claimants only (the binding lets their namespace serve their model)."""
        self._sorted: dict[str, list[Claimant]] = {}
        self._by_uid: dict[str, Claimant] = {}
        self._by_gpu_lease: dict[str, set[str]] = {}
        """GPU Lease name -> keys of the claimants holding a share of that GPU."""
        self._by_controller: dict[str, set[str]] = {}
        """Controller Lease name -> keys of the claimants on its node."""
        self._ignored: set[str] = set()
        self._gpus: dict[str, GpuLease] = {}
        # Controller liveness, apart from claimants.
        self._controllers: dict[str, ControllerLease] = {}
        self._observer = LeaseObserver()
        """When this gateway saw each controller Lease change, on :attr:`clock`."""
        self._live: dict[str, bool] = {}
        """Whether each controller counted as alive when last judged."""
        self._unreached: dict[str, ControllerLease] = {}
        """Controller Leases whose activation API could not be reached at the address they
        name, as they read then: lost until the record changes (:meth:`unreachable`)."""
        self._expiry: dict[str, float] = {}
        self._expiries: list[tuple[float, str]] = []
        """A heap of (expires at, controller Lease name); an entry whose time is no longer
        that Lease's is stale and skipped (or moved) when it reaches the top."""
        self._synced = False
        self._turn = itertools.count()
        self._changed = asyncio.Event()
        self._model_versions: dict[str, int] = {}
        self._all_models = 0
        """Bumped by changes that concern every model (sync, binding)."""
        self._model_changed: dict[str, asyncio.Event] = {}
        self.binding_changed = asyncio.Event()
        """Set when :meth:`set_binding` changed it (sources re-check what they watch)."""
        self.version = 0
        """Bumped on every change of what routing decides."""
        self.claimant_builds = 0
        """Claimants derived from a claim so far (one per changed claim or pod)."""

    # -- versions and wake-ups ----------------------------------------------------------

    def model_version(self, model: str) -> int:
        """Bumped on every change that may alter what a request for ``model`` does."""
        return self._model_versions.get(model, 0) + self._all_models

    def _bump(self, models: Iterable[str]) -> None:
        bumped = False
        for model in set(models):
            bumped = True
            self._model_versions[model] = self._model_versions.get(model, 0) + 1
            if (event := self._model_changed.pop(model, None)) is not None:
                event.set()
        if bumped:
            self._bump_global()

    def _bump_all(self) -> None:
        self._all_models += 1
        for event in self._model_changed.values():
            event.set()
        self._model_changed.clear()
        self._bump_global()

    def _bump_global(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # -- feeding ------------------------------------------------------------------------

    def apply(self, kind: ObjectKind, event: str, obj: Obj) -> None:
        """One watch event (``ADDED``, ``MODIFIED`` or ``DELETED``) for one object."""
        deleted = event == "DELETED"
        if kind == "claim":
            self._put_claim(_key(obj), None if deleted or not claim_is_ours(obj) else obj)
        elif kind == "pod":
            self._put_pod(_key(obj), None if deleted else obj)
        else:
            self._put_lease(_key(obj), None if deleted else obj)

    def replace(self, kind: ObjectKind, objs: Iterable[Obj], *,
                namespace: str | None = None) -> None:
        """A fresh list of every object of ``kind`` (in ``namespace`` only, when given):
        applied as the differences from what is held."""
        held: Iterable[str]
        if kind == "claim":
            held = self._claims
        elif kind == "pod":
            held = self._pods
        else:
            held = self._leases
        gone = {k for k in held if namespace is None or k.partition("/")[0] == namespace}
        for obj in objs:
            key = _key(obj)
            gone.discard(key)
            self.apply(kind, "MODIFIED", obj)
        for key in gone:
            if kind == "claim":
                self._put_claim(key, None)
            elif kind == "pod":
                self._put_pod(key, None)
            else:
                self._put_lease(key, None)

    def _put_claim(self, key: str, obj: Obj | None) -> None:
        slim = None if obj is None else slim_claim(obj)
        packed = None if slim is None else _pack(slim)
        old = self._claims.get(key)
        if packed == old:
            return  # nothing routing reads has changed (or a relist of the same claim)
        namespace = key.partition("/")[0]
        if old is not None:
            self._claims_per_namespace[namespace] -= 1
            if not self._claims_per_namespace[namespace]:
                del self._claims_per_namespace[namespace]
        if packed is None:
            del self._claims[key]
        else:
            self._claims[key] = packed
            self._claims_per_namespace[namespace] += 1
        for uid in self._reserved.pop(key, ()):
            claims = tuple(k for k in self._claims_of_pod.get(uid, ()) if k != key)
            if claims:
                self._claims_of_pod[uid] = claims
            else:
                self._claims_of_pod.pop(uid, None)
        if slim is not None:
            uids = tuple(str(r.get("uid") or "") for r in slim["status"]["reservedFor"]
                         if r.get("resource") == "pods")
            self._reserved[key] = uids
            for uid in uids:
                self._claims_of_pod[uid] = (*self._claims_of_pod.get(uid, ()), key)
        self._bump(self._rebuild(key))

    def _put_pod(self, key: str, obj: Obj | None) -> None:
        slim = None if obj is None else slim_pod(obj)
        packed = None if slim is None else _pack(slim)
        old = self._pods.get(key)
        if packed == old:
            return  # a label, another condition, the spec: nothing routing reads
        uids = set()
        if old is not None:
            uid = str(json.loads(old)["metadata"].get("uid", ""))
            uids.add(uid)
            self._pod_by_uid.pop(uid, None)
        if slim is None or packed is None:
            del self._pods[key]
        else:
            self._pods[key] = packed
            uid = str(slim["metadata"].get("uid", ""))
            self._pod_by_uid[uid] = key
            uids.add(uid)
        touched: set[str] = set()
        for uid in uids:
            for claim in sorted(self._claims_of_pod.get(uid, ())):
                touched |= self._rebuild(claim)
        self._bump(touched)

    def _rebuild(self, key: str) -> set[str]:
        """Derive the claimant of one claim again; the models whose routing it changes."""
        ignored = len(self._ignored)
        try:
            return self._derive(key)
        finally:
            self._log_ignored(ignored)

    def _log_ignored(self, before: int) -> None:
        if len(self._ignored) != before and self._ignored:
            log.warning("claimants ignored: their namespace is not bound to their model",
                        extra={"count": len(self._ignored)})

    def _derive(self, key: str) -> set[str]:
        old = self._claimants.pop(key, None)
        if old is not None:
            self._unindex(key, old)
        claim = self._claims.get(key)
        new = None
        if claim is not None:
            pods = {uid: json.loads(self._pods[pod]) for uid in self._reserved.get(key, ())
                    if (pod := self._pod_by_uid.get(uid)) is not None}
            self.claimant_builds += 1
            found = claimants_from([json.loads(claim)], pods)
            new = found[0] if found else None
        if new is not None:
            self._claimants[key] = new
            self._index(key, new)
        if new == old:
            return set()
        return {c.model for c in (old, new) if c is not None}

    def _index(self, key: str, claimant: Claimant) -> None:
        for gpu in claimant.gpus:
            self._by_gpu_lease.setdefault(
                naming.gpu_lease_name(claimant.node, gpu), set()).add(key)
        self._by_controller.setdefault(
            naming.controller_lease_name(claimant.node), set()).add(key)
        if not self._binding.allows(claimant.model, claimant.namespace):
            self._ignored.add(key)
            return
        self._by_model.setdefault(claimant.model, {})[key] = claimant
        self._sorted.pop(claimant.model, None)
        self._by_uid[claimant.claim_uid] = claimant

    def _unindex(self, key: str, claimant: Claimant) -> None:
        for index, name in [
                *((self._by_gpu_lease, naming.gpu_lease_name(claimant.node, gpu))
                  for gpu in claimant.gpus),
                (self._by_controller, naming.controller_lease_name(claimant.node))]:
            keys = index.get(name)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del index[name]
        self._ignored.discard(key)
        model = self._by_model.get(claimant.model)
        if model is not None and model.pop(key, None) is not None:
            self._sorted.pop(claimant.model, None)
            if not model:
                del self._by_model[claimant.model]
            if self._by_uid.get(claimant.claim_uid) is claimant:
                del self._by_uid[claimant.claim_uid]

    def _models_of(self, keys: Iterable[str]) -> set[str]:
        return {c.model for key in keys if (c := self._claimants.get(key)) is not None}

    def _put_lease(self, key: str, obj: Obj | None) -> None:
        known = self._leases.pop(key, None)
        controller = controller_lease_of(obj) if obj is not None else None
        lease = gpu_lease_of(obj) if obj is not None and controller is None else None
        now: tuple[str, str] | None = None
        if controller is not None:
            now = ("controller", controller.name)
        elif lease is not None:
            now = ("gpu", lease.name)
        elif obj is not None:
            now = ("other", _name(obj))
        if known is not None and known != now:
            self._drop_lease(*known)  # gone, renamed, or no longer that kind of Lease
        if now is None:
            return
        if controller is not None:
            self._leases[key] = now
            self._put_controller(controller)
            return
        if lease is None:
            self._leases[key] = now
            return
        self._leases[key] = now
        if self._gpus.get(lease.name) == lease:
            return
        self._gpus[lease.name] = lease
        self._bump(self._models_of(self._by_gpu_lease.get(lease.name, ())))

    def _drop_lease(self, kind: str, name: str) -> None:
        if kind == "gpu":
            if self._gpus.pop(name, None) is not None:
                self._bump(self._models_of(self._by_gpu_lease.get(name, ())))
        elif kind == "controller":
            self._observer.forget(name)
            self._unreached.pop(name, None)
            self._expiry.pop(name, None)
            self._live.pop(name, None)
            if self._controllers.pop(name, None) is not None:
                self._bump(self._models_of(self._by_controller.get(name, ())))

    def _put_controller(self, lease: ControllerLease) -> None:
        """A controller Lease read now (on :attr:`clock`): a change restarts its duration.
        Its node's models change only when whether it is alive, or its activation URL,
        does (a renewal changes neither)."""
        self._expire()
        now = self._clock()
        previous = self._controllers.get(lease.name)
        unreached = self._unreached.get(lease.name)
        was = (previous is not None, self._live.get(lease.name, False),
               None if previous is None else activation_url(previous), unreached is not None)
        if unreached is not None and not unreached.same_record(lease):
            del self._unreached[lease.name]  # renewed or taken over: worth asking again
        seen = self._observer.observe(lease, now)
        self._controllers[lease.name] = lease
        self._live[lease.name] = seen.fresh(now)
        expires = seen.expires_at
        if expires is None:
            self._expiry.pop(lease.name, None)
        elif (known := self._expiry.get(lease.name)) != expires:
            if known is None or expires < known:
                heapq.heappush(self._expiries, (expires, lease.name))
            self._expiry[lease.name] = expires  # a later time: its entry moves on surfacing
        if was != (True, self._live[lease.name], activation_url(lease),
                   lease.name in self._unreached):
            self._bump(self._models_of(self._by_controller.get(lease.name, ())))

    def unreachable(self, claim: str, url: str) -> None:
        """The activation API at ``url``, to which a request for ``claim`` was sent, could
        not be reached. If the controller Lease of the claim's node still names ``url``,
        its holder counts as lost for activations until the Lease's record changes (a
        renewal, another holder or instance), and requests for the node's sleeping models
        wait for that instead of failing: a controller that stopped without releasing its
        Lease (its RBAC deleted first, on an uninstall) leaves a Lease that looks fresh for
        a whole duration to a reader that first sees it. A Lease already naming another
        address is left alone (asking again goes there)."""
        claimant = self._claimants.get(claim)
        if claimant is None:
            return
        name = naming.controller_lease_name(claimant.node)
        lease = self._controllers.get(name)
        if lease is None or activation_url(lease) != url or name in self._unreached:
            return
        self._unreached[name] = lease
        log.warning("the node's lease controller cannot be reached at the address its Lease "
                    "names; waiting for the Lease to change", extra={
                        "node": claimant.node, "upstream": url, "holder": lease.holder})
        self._bump(self._models_of(self._by_controller.get(name, ())))

    def _expire(self) -> None:
        """Judge the controllers whose Leases have run out since last judged (the clock
        moves without events): their nodes' models change."""
        now = self._clock()
        heap = self._expiries
        while heap and heap[0][0] < now:
            at, name = heapq.heappop(heap)
            current = self._expiry.get(name)
            if current != at:
                if current is not None and current > at:
                    heapq.heappush(heap, (current, name))  # renewed since: its new time
                continue
            del self._expiry[name]
            if self._live.get(name):
                self._live[name] = False
                self._bump(self._models_of(self._by_controller.get(name, ())))

    def _next_expiry(self) -> float | None:
        """Seconds until the next controller Lease runs out (None: none will)."""
        heap = self._expiries
        while heap and self._expiry.get(heap[0][1]) != heap[0][0]:
            at, name = heapq.heappop(heap)
            if (current := self._expiry.get(name)) is not None and current > at:
                heapq.heappush(heap, (current, name))
        return heap[0][0] - self._clock() if heap else None

    @property
    def clock(self) -> Clock:
        """The monotonic clock controller Leases are judged by (tests move it)."""
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._clock = clock

    def set_binding(self, binding: ModelBinding) -> None:
        """The admin's binding changed (its file was re-read): every claimant is judged
        again (rare; the one update whose cost grows with the fleet)."""
        if binding == self._binding:
            return
        self._binding = binding
        ignored = len(self._ignored)
        for key, claimant in list(self._claimants.items()):
            self._unindex(key, claimant)
            self._index(key, claimant)
        self._log_ignored(ignored)
        self.binding_changed.set()
        self._bump_all()

    @property
    def binding(self) -> ModelBinding:
        return self._binding

    def mark_synced(self) -> None:
        """Every resource has been listed once: the gateway may answer for unknown models."""
        if not self._synced:
            self._synced = True
            self._bump_all()

    @property
    def synced(self) -> bool:
        return self._synced

    def claim_namespaces(self) -> set[str]:
        """Namespaces holding a claim of rota's driver that the binding could let serve:
        the namespaces whose pods are worth watching."""
        return {ns for ns in self._claims_per_namespace
                if self._binding.may_serve_something(ns)}

    async def wait_changed(self, since: int, limit_s: float, *,
                           model: str | None = None) -> bool:
        """Wait until :attr:`version` differs from ``since`` (with ``model``: until
        :meth:`model_version` of it does); False after ``limit_s``.

        A controller Lease running out is a change too: it wakes the waiters of the
        models on its node (and those without a model).
        """
        self._expire()

        def current() -> int:
            return self.version if model is None else self.model_version(model)

        if current() != since:
            return True
        loop = asyncio.get_running_loop()
        until = loop.time() + max(0.0, limit_s)
        while True:
            if model is None:
                changed = self._changed
            else:
                changed = self._model_changed.setdefault(model, asyncio.Event())
            expiry = self._next_expiry()
            left = until - loop.time()
            step = left if expiry is None else min(left, expiry + 0.001)
            try:
                async with asyncio.timeout(max(0.0, step)):
                    await changed.wait()
                return True
            except TimeoutError:
                pass
            self._expire()
            if current() != since:
                return True
            if loop.time() >= until:
                return False

    # -- reading ------------------------------------------------------------------------

    @property
    def ignored_claimants(self) -> int:
        """Claimants in namespaces the binding does not bind to their model."""
        return len(self._ignored)

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def knows(self, model: str) -> bool:
        return model in self._by_model

    def lease_of(self, claimant: Claimant) -> GpuLease | None:
        """The GPU Lease of the physical GPU ``claimant`` shares."""
        return self._gpus.get(naming.gpu_lease_name(claimant.node, claimant.gpu))

    def _of_model(self, model: str) -> list[Claimant]:
        """``model``'s claimants in (node, device, namespace, name) order."""
        found = self._sorted.get(model)
        if found is None:
            found = sorted(self._by_model.get(model, {}).values(),
                           key=lambda c: (c.node, c.device, c.namespace, c.claim_name))
            if found:
                self._sorted[model] = found
        return found

    def claimants(self, model: str) -> list[Claimant]:
        return list(self._of_model(model))

    def awake(self, model: str) -> bool:
        """Does an engine of ``model`` hold its GPU now (a request would be forwarded)?"""
        self._expire()
        now = self._clock()
        return any(self._awake(c, now) for c in self._of_model(model))

    def engine_count(self, model: str) -> int:
        """How many engines (claimants) serve ``model``, awake or not."""
        return len(self._by_model.get(model, {}))

    def _controller(self, claimant: Claimant) -> ControllerLease | None:
        return self._controllers.get(naming.controller_lease_name(claimant.node))

    def _alive(self, claimant: Claimant, now: float) -> bool:
        """This gateway saw the node controller's Lease change within its duration."""
        controller = self._controller(claimant)
        return controller is not None and self._observer.fresh(controller.name, now)

    def _awake(self, claimant: Claimant, now: float) -> GpuLease | None:
        """The Lease under which ``claimant`` may get traffic now, if it may: the Lease of
        its first GPU, and only while the Lease of every GPU it holds names it in its awake
        set (:func:`_names_awake`: the holder of an ``awake`` Lease, or an engine awake
        beside it, whatever the Lease's state; a tensor-parallel engine is awake only
        where all of them name it)."""
        for gpu in claimant.gpus:
            held = self._gpus.get(naming.gpu_lease_name(claimant.node, gpu))
            if held is None or not _names_awake(held, claimant):
                return None
        if not claimant.serving or not self._alive(claimant, now):
            return None
        return self.lease_of(claimant)

    def _switch_touching(self, model: str, now: float, *, alive: bool) -> str | None:
        """``switching`` or ``draining`` when a switch to or from ``model`` runs on a GPU
        whose controller is (``alive``) or is not alive."""
        for claimant in self._of_model(model):
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
        self._expire()
        claimants = self._of_model(model)
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
        unreached = False
        for claimant in claimants:
            controller = self._controller(claimant)
            url = None if controller is None else activation_url(controller)
            if controller is None or not claimant.serving or url is None:
                continue
            if not self._alive(claimant, now):
                continue
            if controller.name in self._unreached:
                unreached = True
                continue
            lease = self.lease_of(claimant)
            rank = _NO_LEASE_RANK if lease is None else _ACTIVATION_RANK.get(lease.state, 5)
            options.append((rank, claimant.ref, claimant, url))
        if options:
            _, ref, _, url = min(options, key=lambda o: (o[0], o[1]))
            return Decision(Action.ACTIVATE, model, claim=ref, activation_url=url)
        lost = self._switch_touching(model, now, alive=False)
        if lost or unreached:
            # Its node's controller stopped renewing mid-switch, or cannot be reached at the
            # address its Lease names, and nothing else can be woken: a restarted (or the
            # next) controller may still finish it.
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
        """Is the claimant of a FORWARD ``decision`` still awake on its GPU under the same
        fence, as far as this gateway sees now? (Checked at forward time.) An engine awake
        beside the holder still is under a later fence: every switch on its GPU raises the
        fence, and one that leaves it awake names it again."""
        claimant = self._by_uid.get(decision.claim_uid or "")
        if claimant is None:
            return False
        lease = self._awake(claimant, self._clock())
        return lease is not None and (lease.fence == decision.fence
                                      or _beside(lease, claimant))

    def fence_of(self, claim: str) -> int | None:
        """The fencing number of the GPU Lease of the claimant ``<namespace>/<name>``."""
        claimant = self._claimants.get(claim)
        if claimant is None or claim not in self._by_model.get(claimant.model, {}):
            return None
        lease = self.lease_of(claimant)
        return None if lease is None else lease.fence

    def lost(self, decision: Decision) -> str | None:
        """Why a request forwarded under ``decision`` can no longer be served by its engine
        (None while it may): the GPU's Lease moved past the fence it was sent under and
        settled (no switch runs) without naming the engine in its awake set, so the engine
        has been put to sleep (an engine that is asleep holds requests until it is woken;
        it does not refuse them). A switch that leaves the engine awake beside another
        (an awake set) does not."""
        claimant = self._by_uid.get(decision.claim_uid or "")
        if claimant is None:
            return "claim_gone"
        lease = self.lease_of(claimant)
        if lease is None or decision.fence is None or lease.fence <= decision.fence:
            return None
        if lease.state in _TERMINAL and not ((lease.state != naming.STATE_IDLE
                                              and _holds(lease, claimant))
                                             or _beside(lease, claimant)):
            return "put_to_sleep"
        return None

    async def wait_lost(self, decision: Decision) -> str:
        """Return (with :meth:`lost`'s reason) once ``decision``'s engine is lost. Woken
        only by changes to its model (its claimants and their GPUs' Leases): :meth:`lost`
        does not depend on any controller's liveness."""
        while True:
            reason = self.lost(decision)
            if reason is not None:
                return reason
            await self._model_changed.setdefault(decision.model, asyncio.Event()).wait()

    def model_infos(self) -> list[ModelInfo]:
        """Every known model with its state, for ``/v1/models``: where it is awake, and
        which models are awake beside it there (an awake set), by the rule requests are
        routed by."""
        now = self._clock()
        awake_on: dict[str, tuple[str, ...]] = {}
        on_gpu: dict[str, set[str]] = {}
        for model in self._by_model:
            serving = {f"{c.node}/{gpu}" for c in self._of_model(model)
                       if self._awake(c, now) for gpu in c.gpus}
            awake_on[model] = tuple(sorted(serving))
            for gpu in serving:
                on_gpu.setdefault(gpu, set()).add(model)
        infos = []
        for model in sorted(self._by_model):
            claimants = self._of_model(model)
            gpus = tuple(sorted({f"{c.node}/{c.gpu}" for c in claimants}))
            state: ModelState = "asleep"
            last_error = None
            if awake_on[model]:
                state = "awake"
            elif any((lease := self.lease_of(c)) is not None
                     and lease.state == naming.STATE_STARTING and lease.target_model == model
                     for c in claimants):
                state = "starting"
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
            beside = {m for gpu in awake_on[model] for m in on_gpu[gpu]} - {model}
            infos.append(ModelInfo(model, state, gpus, last_error,
                                   awake_on=awake_on[model], awake_with=tuple(sorted(beside))))
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
