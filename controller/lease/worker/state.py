"""What the parts of one GPU's worker share: the node's policy for the GPU, the answer a
caller gets, and the GPU's facts of the moment (its Lease as last written or read,
whether the worker takes work, the switch in flight, the engines in an unknown state and
when reconciliation looks next). Every part reads and writes these under the locks of the
worker's domain, one step at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease import tenants
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.aio import Backoff


@dataclass(frozen=True)
class Activation:
    ok: bool
    claimant: Claimant
    switched: bool
    fence: int
    reason: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    min_residency_s: float = 0.0
    idle_sleep_s: float = 0.0
    coalesce_window_s: float = 0.0
    resync_s: float = 10.0
    tolerance_bytes: int = 512 * 1024**2
    lock_wait_s: float = 1800.0
    """The bound on a step's wait for the locks of its domain (longer than any step)."""
    fenced_retries: int = 2
    """How often a switch fenced off before it began (a conflicting write of its Lease)
    is tried again, after reconciliation, before its waiters are answered."""
    models: switch_policy.ModelPolicy = field(default_factory=switch_policy.ModelPolicy)
    """The node's default switch policy per model (:mod:`controller.lease.policy`); each
    claim's EngineConfig overrides its fields."""
    home_model: str = ""
    """The served model name woken on a GPU idle for ``home_idle_s`` ("": a claim with
    ``home: true``, if any)."""
    home_idle_s: float = 60.0
    awake_set: bool = False
    """More than one engine may be awake on the GPU where their awake budgets fit it
    together (:mod:`controller.lease.awake_set`); False: one awake at most."""
    priority_ceilings: tenants.Binding = field(default_factory=dict)
    """The admin's binding: what the claims of each namespace may take (names or shell
    patterns; see :mod:`controller.lease.tenants`); empty: only the wait's floor."""


def unsettled_backoff() -> Backoff:
    """How soon reconciliation looks again at engines in an unknown state."""
    return Backoff(first_s=0.2, max_s=5.0)


@dataclass(eq=False)
class GpuState:
    """The facts of one GPU that more than one part of its worker reads."""

    gpu: str
    clock: Callable[[], float]
    lease: GpuLease | None = None
    """The GPU Lease as this worker last wrote or read it (None: read it again)."""
    accepting: bool = False
    closed: tuple[str, str] = ("not_leader", "this instance does not act for the node")
    """The reason and message callers get while the worker takes no work."""
    dirty: bool = False
    """Reconcile before the next switch (claimants changed, a new term, a step cut short)."""
    new_term: bool = False
    switching: bool = False
    switching_to: str = ""
    """The claim uid of the switch in flight (while ``switching``)."""
    rule: str = ""
    """The policy rule behind the switch in flight (its log line, metric and Event)."""
    unsettled: dict[str, Claimant] = field(default_factory=dict)
    """Engines that may be awake although nobody woke them under this fence (a sleep
    that may still fire, an engine that did not answer): no wake on this GPU until
    reconciliation knows them again."""
    next_reconcile: float = 0.0
    unsettled_pauses: Backoff = field(default_factory=unsettled_backoff)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on news for the worker's loop (a caller, a start, a change of claimants)."""
    last_switch: dict[str, object] = field(default_factory=dict)
    """Outcome and timings of the latest switch, for /v1/state."""
    reconciliations: int = 0
    """Reconciliations begun (each has its Lease in hand)."""

    def __post_init__(self) -> None:
        self.next_reconcile = self.clock()

    def mark_dirty(self) -> None:
        self.dirty = True
        self.wakeup.set()

    def reconcile_due(self) -> bool:
        return self.dirty or self.clock() >= self.next_reconcile

    def awake_holder(self) -> str:
        """The claim the Lease names awake ("" when none, or no Lease in hand)."""
        lease = self.lease
        return lease.holder if lease is not None and lease.state == naming.STATE_AWAKE \
            else ""

    def blockers(self, uid: str) -> list[str]:
        """The engines in an unknown state that stand in the way of waking ``uid``."""
        return [c.ref for c in self.unsettled.values() if c.claim_uid != uid]

    def found_unsettled(self, claimants: Iterable[Claimant]) -> None:
        """Remember engines a step left in an unknown state; reconcile soon (growing
        pauses while they stay unknown)."""
        self.unsettled.update({c.claim_uid: c for c in claimants})
        if self.unsettled:
            self.next_reconcile = self.clock() + self.unsettled_pauses.next_delay()
