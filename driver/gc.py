"""Ledger garbage collection: records of claims the kubelet will never unprepare.

The kubelet unprepares what it prepared, nearly always. A record can still be left behind:
a prepare answered after the kubelet had already unprepared the claim (calls overlap), a
claim deleted or moved while the driver was down, an unprepare that failed until the pod
was gone. Such a record holds its GPU budget and device for good, so new claims on that
GPU are refused. Every pass (a jittered period, :func:`rota.kit.aio.run_periodically`) the
collector:

1. reads the ledger and, when it holds completed records, lists the pods bound to this
   node (one request, however many records). A record whose claim such a pod references
   (by namespace and claim name, in ``spec.resourceClaims`` or
   ``status.resourceClaimStatuses``) is one the kubelet has not unprepared because it
   still holds it (containers running, a pod terminating, a kubelet that re-sends prepares
   after a restart): it is *held*, and not read from the API server. So a node at rest
   costs one LIST per pass, not a GET per prepared claim;
2. reads from the API server only the other records, and those that share their
   namespace and name with another record (a claim deleted and re-created under the same
   name: a pod names claims by name, so it cannot tell which uid it holds); every
   ``read_held_every``-th pass (10 by default) it reads the held ones too, because a
   re-created claim whose prepare is refused (the old record holds its budget) leaves only
   the old record under that name, held by the successor's pod. The record
   is a *suspect* when the claim is gone (404), was re-created (another uid), or is no
   longer allocated in this node's pool by this driver. An API error proves nothing: that
   record is kept. A ``replaced`` record is never held: the name is now another claim,
   the one the pod holds (a claim cannot be deleted while it is reserved for a pod, so no
   running pod holds the old uid);
3. collects a suspect once it has been one for ``grace_s`` (so, with the default, across
   two passes or more), under the preparer's locks (the same as prepare's), and not if
   the preparer answered it prepared since the pass began: the kubelet holds it then.

The same pass, under the lock, rolls back ``PrepareStarted`` records (prepares that
failed) and removes CDI specs that no record backs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from driver.ledger import ClaimRecord, LedgerState
from rota.kit.aio import Backoff, run_periodically
from rota.kit.errors import KubeError, KubeNotFoundError

log = logging.getLogger(__name__)

Verdict = Literal["live", "gone", "replaced", "elsewhere", "unknown"]


class GcKube(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def list_pods_on_node(self, node: str) -> list[dict[str, Any]]: ...


class GcPreparer(Protocol):
    def records(self) -> LedgerState: ...

    async def collect(self, uids: set[str], *, decided_at: float) -> list[str]: ...


def verdict(record: ClaimRecord, claim: Mapping[str, Any] | None, *, driver: str,
            pool: str) -> Verdict:
    """What the API server says about a recorded claim (``None``: it does not exist)."""
    if claim is None:
        return "gone"
    if claim.get("metadata", {}).get("uid") != record.uid:
        return "replaced"
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    here = [r for r in results if isinstance(r, Mapping)
            and r.get("driver") == driver and r.get("pool") == pool]
    return "live" if here else "elsewhere"


def claims_held_by_pods(pods: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(namespace, claim name) of every claim the given pods reference."""
    held: set[tuple[str, str]] = set()
    for pod in pods:
        namespace = pod.get("metadata", {}).get("namespace", "")
        spec_refs = (pod.get("spec") or {}).get("resourceClaims") or []
        status_refs = (pod.get("status") or {}).get("resourceClaimStatuses") or []
        for ref in (*spec_refs, *status_refs):
            name = ref.get("resourceClaimName") if isinstance(ref, Mapping) else None
            if name:
                held.add((namespace, name))
    return held


@dataclass
class PassResult:
    """What one pass found and did."""

    checked: int = 0
    """Completed records in the ledger."""
    read: int = 0
    """Records read from the API server (one GET each)."""
    suspects: dict[str, Verdict] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    """Records kept because a pod on this node references their claim."""
    collected: list[str] = field(default_factory=list)


class LedgerCollector:
    """Collects ledger records of claims that are gone; see the module docstring."""

    def __init__(self, *, preparer: GcPreparer, kube: GcKube, node_name: str, driver: str,
                 pool: str, interval_s: float = 60.0, grace_s: float = 120.0,
                 read_held_every: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` measures ``grace_s`` (seconds, monotonic). Every ``read_held_every``-th
        pass reads the claims of held records too: a claim deleted and created again under
        its name, whose successor cannot be prepared while the old record holds its budget,
        is named by the successor's pod, so only its uid tells the two apart."""
        if read_held_every < 1:
            raise ValueError(f"read_held_every must be at least 1, not {read_held_every}")
        self.preparer = preparer
        self.kube = kube
        self.node_name = node_name
        self.driver = driver
        self.pool = pool
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.clock = clock
        self.read_held_every = read_held_every
        self._passes = 0
        self._suspect_since: dict[str, float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop``; a failed pass is retried with backoff."""
        await run_periodically(
            self.collect_once, stop=stop, what="ledger garbage collection",
            interval=Backoff(first_s=self.interval_s, max_s=self.interval_s, jitter=0.2),
            on_error=Backoff(first_s=min(5.0, self.interval_s), max_s=self.interval_s))

    async def collect_once(self) -> PassResult:
        """One pass; see the module docstring.

        Raises:
            KubeError: the pods of this node could not be listed (nothing collected).
            LedgerError: the ledger could not be read or written.
        """
        decided_at = time.monotonic()  # the preparer's clock: answers after it win
        now = self.clock()
        state = await asyncio.to_thread(self.preparer.records)
        result = PassResult()
        completed = [r for r in state.claims.values() if r.state == "PrepareCompleted"]
        result.checked = len(completed)
        held: set[tuple[str, str]] = set()
        if completed:
            held = claims_held_by_pods(await self.kube.list_pods_on_node(self.node_name))
        names = Counter((r.namespace, r.name) for r in completed)
        self._passes += 1
        read_all = self._passes % self.read_held_every == 0
        for record in completed:
            ref = (record.namespace, record.name)
            if ref in held and names[ref] == 1 and not read_all:
                result.held.append(record.uid)
                continue
            result.read += 1
            found = await self._verdict(record)
            if found in ("live", "unknown"):
                continue
            if found != "replaced" and ref in held:
                result.held.append(record.uid)
                continue
            result.suspects[record.uid] = found
        for uid in list(self._suspect_since):
            if uid not in result.suspects:
                del self._suspect_since[uid]
        ripe = set()
        for uid in result.suspects:
            since = self._suspect_since.setdefault(uid, now)
            if now - since >= self.grace_s:
                ripe.add(uid)
        # Always taken, so stale started records and orphan specs go too.
        result.collected = await self.preparer.collect(ripe, decided_at=decided_at)
        for uid in result.collected:
            self._suspect_since.pop(uid, None)
            record = state.claims[uid]
            log.warning("collected a prepared claim that is gone from this node", extra={
                "claim_uid": uid, "claim": record.ref, "why": result.suspects[uid],
                "devices": [d.device_name for d in record.devices]})
        return result

    async def _verdict(self, record: ClaimRecord) -> Verdict:
        try:
            claim: Mapping[str, Any] | None = await self.kube.get_claim(record.namespace,
                                                                        record.name)
        except KubeNotFoundError:
            claim = None
        except KubeError as exc:
            log.info("cannot read a prepared claim; keeping it this pass",
                     extra={"claim_uid": record.uid, "claim": record.ref, "error": str(exc)})
            return "unknown"
        return verdict(record, claim, driver=self.driver, pool=self.pool)
