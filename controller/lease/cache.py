"""The lease controller's view of its node, fed by watches instead of repeated lists.

Three list-then-watch streams (:class:`rota.kit.listwatch.ListWatch`), each narrowed on the
server to this node, and the claims of the node's pods:

- Pods: ``spec.nodeName=<node>``;
- ResourceClaims: no selector can say "allocated on this node", so claims are not watched;
  the pods name theirs and each is read once when a pod first names it
  (:mod:`controller.lease.pod_claims`): a claim written anywhere else in the cluster never
  reaches this controller;
- ResourceSlices: ``spec.nodeName=<node>,spec.driver=gpu.rota.dev`` (the published memory
  of plain devices is the resident footprint of their claims);
- the node's GPU Leases (with ``lease_namespace``): labels ``gpu.rota.dev/lease=gpu`` and
  ``gpu.rota.dev/node=<node>``, so that reconciliation confirms a Lease it wrote or read
  without a GET (:meth:`NodeCache.lease`).

The API server sees one list per stream at start (paginated) and after a 410 only (a lost
connection resumes the watch from its last version), then one long watch each. Claimants
are rebuilt from the cache when it changed, never from a new list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kubernetes import client

from controller.claimants import DRIVER, Claimant, claimants_from, device_memory_of
from controller.lease import metrics
from controller.lease.pod_claims import PodClaims
from rota.api import naming
from rota.kit.kube import RESOURCE_GROUP, RESOURCE_VERSION, Kube
from rota.kit.listwatch import ListWatch, Obj

__all__ = ["NodeCache"]

log = logging.getLogger(__name__)


class _Store:
    """Objects of one stream by uid, replaced by lists and edited by events."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self.items: dict[str, Obj] = {}
        self._on_change = on_change

    @staticmethod
    def _uid(obj: Obj) -> str:
        return str((obj.get("metadata") or {}).get("uid", ""))

    def replace(self, items: list[Obj]) -> None:
        self.items = {self._uid(o): o for o in items}
        self._on_change()

    def apply(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            self.items.pop(self._uid(obj), None)
        else:
            self.items[self._uid(obj)] = obj
        self._on_change()


class NodeCache:
    """Claims, pods, slices and GPU Leases of one node, current within a watch event's delay.

    :meth:`start` begins the watches; :attr:`synced` is set once each has listed and every
    claim its pods name has been read once.
    """

    def __init__(self, api: client.ApiClient, *, node: str, api_timeout_s: float = 10.0,
                 watch_timeout_s: int = 300, lease_namespace: str | None = None) -> None:
        self.api = api
        self.node = node
        self.api_timeout_s = api_timeout_s
        self.watch_timeout_s = watch_timeout_s
        self.lease_namespace = lease_namespace
        self.version = 0
        """Raised by every change; :meth:`claimants` rebuilds only when it moved."""
        self.synced = asyncio.Event()
        self._changed = asyncio.Condition()
        self._claims = PodClaims(Kube(api, timeout_s=api_timeout_s).get_claim,
                                 on_change=self._touch)
        self._pods = _Store(self._pods_changed)
        self._slices = _Store(self._touch)
        self._leases = _Store(lambda: None)
        self._lease_watch: ListWatch | None = None
        self._watches: list[ListWatch] = []
        self._built: tuple[int, list[Claimant]] = (-1, [])
        self._notify: asyncio.Task[None] | None = None

    def _pods_changed(self) -> None:
        self._claims.pods_changed(self._pods.items)
        self._touch()

    def _touch(self) -> None:
        self.version += 1
        if self._notify is None or self._notify.done():
            self._notify = asyncio.get_running_loop().create_task(self._wake_waiters(),
                                                                  name="cache-notify")

    async def _wake_waiters(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        objects = client.CustomObjectsApi(self.api)
        core = client.CoreV1Api(self.api)

        def watch(name: str, store: _Store, list_fn: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> ListWatch:
            return ListWatch(name, list_fn, *args, loop=loop, on_replace=store.replace,
                             on_event=store.apply, api_timeout_s=self.api_timeout_s,
                             watch_timeout_s=self.watch_timeout_s,
                             on_error=lambda exc: metrics.WATCH_RESTARTS.labels(name).inc(),
                             on_undecodable=lambda bad: (
                                 metrics.UNDECODABLE_OBJECTS.labels(name).inc()),
                             **kwargs)

        self._watches = [
            watch("pods", self._pods, core.list_pod_for_all_namespaces,
                  field_selector=f"spec.nodeName={self.node}"),
            watch("resourceslices", self._slices, objects.list_cluster_custom_object,
                  RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices",
                  field_selector=f"spec.nodeName={self.node},spec.driver={DRIVER}"),
        ]
        if self.lease_namespace is not None:
            self._lease_watch = watch(
                "leases", self._leases,
                client.CoordinationV1Api(self.api).list_namespaced_lease, self.lease_namespace,
                label_selector=naming.gpu_lease_selector(self.node))
            self._watches.append(self._lease_watch)
        for w in self._watches:
            w.start()

    async def wait_synced(self) -> None:
        """Until every stream has listed once and every claim its pods name was read."""
        for w in self._watches:
            await w.listed.wait()
        await self._claims.wait_tried()
        self.synced.set()

    async def stop(self) -> None:
        for w in self._watches:
            w.stop()
        await self._claims.stop()
        if self._notify is not None:
            await asyncio.gather(self._notify, return_exceptions=True)

    @property
    def claim_gets(self) -> int:
        """Claims read one by one so far (the API cost of following the pods' claims)."""
        return self._claims.gets

    # -- reading -----------------------------------------------------------------------

    def claimants(self) -> list[Claimant]:
        """The claimants on this node, from the cache (rebuilt only after a change)."""
        version, built = self._built
        if version != self.version:
            built = claimants_from(self._claims.items.values(), self._pods.items,
                                   node=self.node,
                                   device_memory=device_memory_of(self._slices.items.values()))
            self._built = (self.version, built)
        return list(built)

    def claimant(self, claim_uid: str) -> Claimant | None:
        return next((c for c in self.claimants() if c.claim_uid == claim_uid), None)

    def pod(self, uid: str) -> Obj | None:
        return self._pods.items.get(uid)

    def lease_version(self, name: str) -> str | None:
        """The resourceVersion of the node's GPU Lease ``name`` as the watch last saw it;
        None when there is no Lease watch, it has not listed yet, or it has no such Lease."""
        if self._lease_watch is None or not self._lease_watch.listed.is_set():
            return None
        meta = next((o.get("metadata") or {} for o in self._leases.items.values()
                     if (o.get("metadata") or {}).get("name") == name), {})
        return meta.get("resourceVersion")

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (bounded) until ``predicate()`` holds after a change; its last value."""
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(predicate)
                return True
        except TimeoutError:
            return predicate()
