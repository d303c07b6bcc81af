"""The claims of this node's pods, fetched one by one instead of watched cluster-wide.

No field or label selector says "allocated on this node", so a watch of ResourceClaims
would carry every claim write of the cluster to every node's controller: the one stream
whose cost grows with the fleet. The node's pods say the same thing already: a pod bound
to the node names its claims (``spec.resourceClaims[].resourceClaimName``, and the claims
made for it from a template in ``status.resourceClaimStatuses``), and the scheduler
allocates a claim and reserves it for the pod before it binds the pod. So the controller
learns its claims from the pod watch it has anyway, with one GET per claim when a pod
first names it.

A fetched claim is kept while a pod of the node names it, and is not read again while
every pod that names it is in its ``reservedFor``: what the controller reads of a claim
(its allocation, its opaque engine config) does not change while a pod holds it. A claim
that is not there yet, not allocated, or not reserved for a pod that names it (a claim
deleted and made again under the same name, a second pod sharing it) is read again on the
one retry schedule (:class:`rota.kit.aio.Backoff`, bounded); after the last attempt the next
change of the node's pods tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from rota.kit.aio import Backoff
from rota.kit.errors import KubeError, KubeNotFoundError
from rota.kit.listwatch import Obj

__all__ = ["ClaimKey", "PodClaims", "claim_names_of"]

log = logging.getLogger(__name__)

ClaimKey = tuple[str, str]
"""A claim's namespace and name."""


def claim_names_of(pod: Obj) -> set[str]:
    """The names of the claims ``pod`` uses (in its own namespace)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    names = {str(ref["resourceClaimName"]) for ref in spec.get("resourceClaims") or []
             if ref.get("resourceClaimName")}
    names |= {str(ref["resourceClaimName"])
              for ref in status.get("resourceClaimStatuses") or []
              if ref.get("resourceClaimName")}
    extended = status.get("extendedResourceClaimStatus") or {}
    if extended.get("resourceClaimName"):
        names.add(str(extended["resourceClaimName"]))
    return names


def _reserved_uids(claim: Obj) -> set[str]:
    return {str(ref.get("uid", "")) for ref in (claim.get("status") or {}).get("reservedFor")
            or [] if ref.get("resource") == "pods"}


def _complete(claim: Obj, pod_uids: set[str]) -> bool:
    """Allocated and reserved for every pod of the node that names it."""
    status = claim.get("status") or {}
    return bool(status.get("allocation")) and pod_uids <= _reserved_uids(claim)


class PodClaims:
    """The claims named by a set of pods, kept current from the pods alone.

    Call :meth:`pods_changed` (on the event loop) with every pod of the node whenever they
    change; :attr:`items` holds the fetched claims by uid. ``on_change`` is called when it
    changes. ``get(namespace, name)`` reads one claim (a GET with a timeout).
    """

    def __init__(self, get: Callable[[str, str], Awaitable[Obj]], *,
                 on_change: Callable[[], None],
                 backoff: Callable[[], Backoff] = lambda: Backoff(first_s=0.5, max_s=30.0,
                                                                  attempts=10)) -> None:
        self._get = get
        self._on_change = on_change
        self._backoff = backoff
        self._wanted: dict[ClaimKey, set[str]] = {}
        self._held: dict[ClaimKey, Obj] = {}
        self._fetching: dict[ClaimKey, asyncio.Task[None]] = {}
        self._first_tries: set[ClaimKey] = set()
        self._tried = asyncio.Event()
        self._tried.set()
        self.gets = 0
        """GETs sent so far (each attempt counts)."""

    @property
    def items(self) -> dict[str, Obj]:
        return {str((c.get("metadata") or {}).get("uid", "")): c for c in self._held.values()}

    def pods_changed(self, pods: Mapping[str, Obj]) -> None:
        wanted: dict[ClaimKey, set[str]] = {}
        for uid, pod in pods.items():
            namespace = str((pod.get("metadata") or {}).get("namespace", ""))
            for name in claim_names_of(pod):
                wanted.setdefault((namespace, name), set()).add(uid)
        self._wanted = wanted
        dropped = [key for key in self._held if key not in wanted]
        for key in dropped:
            del self._held[key]
        for key in [k for k in self._fetching if k not in wanted]:
            self._fetching.pop(key).cancel()
            self._tried_once(key)
        for key, uids in wanted.items():
            held = self._held.get(key)
            if (held is None or not _complete(held, uids)) and key not in self._fetching:
                self._first_tries.add(key)
                self._tried.clear()
                self._fetching[key] = asyncio.get_running_loop().create_task(
                    self._fetch(key), name=f"claim-{key[0]}-{key[1]}")
        if dropped:
            self._on_change()

    async def wait_tried(self) -> None:
        """Until every claim named so far has been read at least once (or given up on)."""
        await self._tried.wait()

    async def stop(self) -> None:
        tasks = list(self._fetching.values())
        self._fetching.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _tried_once(self, key: ClaimKey) -> None:
        self._first_tries.discard(key)
        if not self._first_tries:
            self._tried.set()

    async def _fetch(self, key: ClaimKey) -> None:
        namespace, name = key
        pauses = self._backoff().delays()
        try:
            while key in self._wanted:
                self.gets += 1
                claim: Obj | None = None
                try:
                    claim = await self._get(namespace, name)
                except KubeNotFoundError:
                    pass
                except KubeError as exc:
                    log.warning("could not read a claim of a pod on this node",
                                extra={"claim": f"{namespace}/{name}", "error": str(exc)})
                uids = self._wanted.get(key)
                if uids is None:
                    return
                if claim is not None:
                    changed = self._held.get(key) != claim
                    self._held[key] = claim
                    if changed:
                        self._on_change()
                    if _complete(claim, uids):
                        return
                self._tried_once(key)
                pause = next(pauses, None)
                if pause is None:
                    log.warning("a claim of a pod on this node is not allocated and reserved "
                                "for it; read again when the node's pods change",
                                extra={"claim": f"{namespace}/{name}"})
                    return
                await asyncio.sleep(pause)
        finally:
            self._tried_once(key)
            if self._fetching.get(key) is asyncio.current_task():
                del self._fetching[key]
