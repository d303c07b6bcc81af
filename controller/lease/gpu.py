"""One worker per physical GPU: the activation queue, reconciliation, policy and switches.

Everything that acts on one GPU runs in its worker, under its lock, one step at a time:
reconciliation (:mod:`controller.lease.reconcile`), switches
(:mod:`controller.lease.switch`) and the idle TTL. Reconciliation runs first whenever the
worker opens (the instance gained the node), whenever the node's claimants change, soon
after a switch left an engine unsettled, and at least every ``resync_s`` *even while
activations queue*: a steady load never starves it.

Activations are queued per GPU and served one switch at a time. Every caller waiting for
the same claimant shares one switch (coalescing), and claimants are served in the order
their first request arrived. Policy against thrash: the holder keeps the GPU for at least
``min_residency_s`` before a switch away (its requests keep flowing meanwhile), and an
optional idle TTL puts a holder without work to sleep.

Engines that span GPUs (tensor parallel) join their GPUs' workers into one *domain*
(:mod:`controller.lease.gpu_locks`): every step holds the locks of its whole domain, taken in
GPU order, so a gang switch (:mod:`controller.lease.gang`) and the steps of the GPUs it touches
never overlap. A gang engine's activations and start queue at the worker of its first GPU.

Closing (leadership lost, or the controller stopping) answers every waiter at once and
refuses new work; the step in flight is not cancelled here (a wake cannot be called back
from an engine): it ends at its next fencing check or when it is done, and its waiters
get its outcome.

:class:`GpuWorker` is a composition of parts in :mod:`controller.lease.worker`, each with
one job: the callers' queue (``callers``), the holder's work and switch costs
(``accounting``), the switch policy's view (``policy_view``), the turn loop that asks it
and runs the switch (``turns``), gang switches and starts (``gangs``), start-up admission
(``start_gate``), reconciliation (``reconciler``), keep-alive and the home return
(``idle``), and a finished switch taken in (``outcomes``). They share one
:class:`~controller.lease.worker.state.GpuState`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.admission import StartSwitch, StartTicket
from controller.lease.engines.base import EngineAdapter
from controller.lease.gang import needs_gang
from controller.lease.gpu_locks import GpuLocks
from controller.lease.policy import SwitchCost
from controller.lease.switch import Fenced, Switcher
from controller.lease.visibility import GpuVisibility
from controller.lease.worker.accounting import ANSWERED_GRACE_S, USAGE_DECAY_S, HolderWork
from controller.lease.worker.callers import CallerQueue, Waiting
from controller.lease.worker.gangs import GangEntry
from controller.lease.worker.idle import IdleRules
from controller.lease.worker.lease_port import KubeLeasePort, confirmed
from controller.lease.worker.outcomes import Outcomes
from controller.lease.worker.policy_view import PolicyView
from controller.lease.worker.reconciler import HOLDERS, Reconciler
from controller.lease.worker.sets import AwakeSets
from controller.lease.worker.start_gate import START_QUIET_S, StartGate
from controller.lease.worker.state import Activation, GpuState, Policy
from controller.lease.worker.turns import BUSY_HOLDER_POLL_S, TurnLoop
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.aio import Backoff, wait_any

__all__ = ["ANSWERED_GRACE_S", "BUSY_HOLDER_POLL_S", "HOLDERS", "START_QUIET_S",
           "USAGE_DECAY_S", "Activation", "GpuWorker", "KubeLeasePort", "Policy",
           "confirmed", "needs_gang"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Alias(Generic[T]):
    """A name read (and set) on the worker that its part ``part`` now owns as ``name``:
    the node, /v1/state and tests keep reading the worker."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, worker: Any, owner: Any = None) -> T:
        value: T = getattr(getattr(worker, self.part), self.name)
        return value

    def __set__(self, worker: Any, value: T) -> None:
        setattr(getattr(worker, self.part), self.name, value)


def _failed_step_backoff() -> Backoff:
    return Backoff(first_s=0.2, max_s=10.0)


class GpuWorker:
    """The worker of one physical GPU: its parts, and the loop that runs their steps."""

    policy = _Alias[Policy]("view", "policy")
    """The node's policy for this GPU (the policy view reads it; one copy)."""
    lease = _Alias[GpuLease | None]("state", "lease")
    unsettled = _Alias[dict[str, Claimant]]("state", "unsettled")
    last_switch = _Alias[dict[str, object]]("state", "last_switch")
    reconciliations = _Alias[int]("state", "reconciliations")
    _dirty = _Alias[bool]("state", "dirty")
    _accepting = _Alias[bool]("state", "accepting")
    _switching = _Alias[bool]("state", "switching")
    _switching_to = _Alias[str]("state", "switching_to")
    _next_reconcile = _Alias[float]("state", "next_reconcile")
    _queue = _Alias[dict[str, Waiting]]("queue", "entries")
    _holder_since = _Alias[float]("work", "holder_since")
    _last_busy = _Alias[float]("work", "last_busy")
    _costs = _Alias[dict[str, SwitchCost]]("work", "costs")
    _drains = _Alias[dict[str, float]]("work", "drains")
    _usage_now = _Alias[Callable[[Claimant | None], dict[str, float]]]("work", "usage_now")
    _measured = _Alias[Callable[..., None]]("work", "measured")
    _starts = _Alias[dict[str, StartTicket]]("starts", "tickets")
    _start_backoff = _Alias[dict[str, tuple[float, Backoff]]]("starts", "backoff")
    _started = _Alias[dict[str, tuple[str | None, int]]]("starts", "started")
    _serve_next = _Alias[Callable[..., Any]]("turns", "serve_next")
    _coalesce = _Alias[Callable[..., Any]]("turns", "coalesce")
    _idle_check = _Alias[Callable[[], Any]]("idle", "check")

    def __init__(self, *, gpu: str, lease_port: KubeLeasePort, switcher: Switcher,
                 claimants: Callable[[], list[Claimant]],
                 engine: Callable[[Claimant], EngineAdapter], policy: Policy,
                 clock: Callable[[], float], identity: str = "",
                 starter: StartSwitch | None = None,
                 visibility: GpuVisibility | None = None, locks: GpuLocks | None = None,
                 domain: Callable[[], tuple[str, ...]] | None = None,
                 sibling: Callable[[str], GpuWorker] | None = None,
                 lease_seen: Callable[[], str | None] | None = None) -> None:
        self.gpu = gpu
        self.lease_port, self.switcher, self.starter = lease_port, switcher, starter
        self.claimants, self.engine = claimants, engine
        self.clock, self.identity = clock, identity
        self.visibility = visibility
        """Events, pod labels and claim conditions (None: nothing is shown)."""
        self.lease_seen = lease_seen
        """The resourceVersion of this GPU's Lease as the node's Lease watch last saw it
        (None: not known); lets reconciliation confirm its Lease without a GET."""
        self.locks = locks or GpuLocks()
        self._domain = domain or (lambda: (gpu,))
        """The GPUs whose locks every step of this worker holds (see the module doc)."""
        self._sibling = sibling
        self.lock = self.locks.lock(gpu)
        """Held by every switch and by reconciliation of this GPU (and by every step of
        its domain's other workers): one actor at a time."""
        self.state = GpuState(gpu, clock)
        self.work = HolderWork(clock)
        self.queue = CallerQueue(clock=clock, wakeup=self.state.wakeup,
                                 answered=self.work.answered)
        self.view = PolicyView(gpu=gpu, policy=policy, clock=clock, claimants=claimants,
                               on_gpu=self.on_gpu, work=self.work, queue=self.queue,
                               # a test's stand-in switcher may have no ports
                               freezes=getattr(getattr(switcher, "ports", None), "freezes",
                                               None))
        self.outcomes = Outcomes(state=self.state, work=self.work, visibility=visibility,
                                 on_gpu=self.on_gpu)
        self.starts = StartGate(self)
        self.reconciler = Reconciler(self)
        self.sets = AwakeSets(self)
        self.turns = TurnLoop(self)
        self.gangs = GangEntry(self)
        self.idle = IdleRules(self)

    @property
    def device(self) -> str:
        return self.gpu

    @property
    def accepting(self) -> bool:
        return self.state.accepting

    # -- what a switch is expected to cost (for /v1/state) -----------------------------

    def switch_cost(self, holder: str | None, target: str | None) -> float:
        """See :meth:`controller.lease.worker.accounting.HolderWork.switch_cost`."""
        return self.work.switch_cost(holder, target)

    def expectation(self, claimant: Claimant) -> tuple[float, int, float]:
        """``(expected_switch_s, queue_position, expected_wait_s)`` of a switch to
        ``claimant`` on this GPU now (see
        :class:`rota.api.activation.ClaimantState`)."""
        state, cost = self.state, self.work.switch_cost
        holder = state.awake_holder() or None
        if holder == claimant.ref and not state.switching:
            return 0.0, 0, 0.0
        if state.switching and state.switching_to == claimant.claim_uid:
            own = round(cost(holder, claimant.ref), 3)
            return own, 0, own  # its own switch is the one in flight
        wait, position, current = 0.0, 0, holder
        if state.switching:  # a switch in flight, to another claimant
            wait, position, current = cost(current, None), 1, None
        for queued in self.queue.ahead_of(claimant.claim_uid):
            wait += cost(current, queued.claimant.ref)
            position += 1
            current = queued.claimant.ref
        own = cost(holder, claimant.ref)
        return round(own, 3), position, round(wait + cost(current, claimant.ref), 3)

    # -- opening and closing -----------------------------------------------------------

    def open(self) -> None:
        """Take work (this instance now leads the node): reconcile first."""
        self.state.accepting = True
        self.state.new_term = True
        self.mark_dirty()

    def close(self, reason: str, message: str) -> None:
        """Refuse new work and answer every waiter now; the step in flight goes on."""
        self.state.accepting = False
        self.state.closed = (reason, message)
        self._fail_all(reason, message)
        self.starts.refuse_all()
        self.state.lease = None
        self.state.wakeup.set()

    def taking_over(self, lease: GpuLease) -> bool:
        """Whether ``lease`` shows a switch its controller never finished. Nobody switches
        while this worker's lock is held: the crash (or the loss of leadership) of the
        instance that ran it cut it short, and the calls it sent may still land;
        reconciliation takes over under a new term (counted as ``controller_crash``)."""
        if lease.state not in (naming.STATE_SWITCHING, naming.STATE_STARTING):
            return False
        metrics.FAILURES.labels("controller_crash").inc()
        log.warning("found a switch its controller never finished",
                    extra={"device": self.gpu, "fence": lease.fence,
                           "controller": lease.controller or None,
                           "target": lease.target_model or None})
        return True

    def mark_dirty(self) -> None:
        """Reconcile before the next switch (claimants changed, or a new term)."""
        self.state.mark_dirty()

    # -- callers ---------------------------------------------------------------------------

    async def activate(self, claimant: Claimant) -> Activation:
        state = self.state
        if not state.accepting:
            return Activation(False, claimant, switched=False, fence=0,
                              reason=state.closed[0], message=state.closed[1])
        lease = state.lease
        if lease is not None and not state.dirty and not state.switching and (
                (lease.holder == claimant.ref and lease.state == naming.STATE_AWAKE)
                or any(m.uid == claimant.claim_uid for m in lease.companions)):
            # The holder (or an engine awake beside it) serves now, even while a switch
            # away waits for its residency.
            return Activation(True, claimant, switched=False, fence=lease.fence)
        return await self.queue.wait(claimant)

    def pending(self) -> int:
        return self.queue.pending()

    async def request_start(self, claimant: Claimant, *, hold_s: float) -> bool:
        """One long poll of ``claimant``'s start gate: True when it may start now; False
        when it should ask again (held up to ``hold_s``)."""
        return await self.starts.request(claimant, hold_s=hold_s)

    async def reconcile(self) -> None:
        """See :meth:`controller.lease.worker.reconciler.Reconciler.run`."""
        await self.reconciler.run()

    # -- the loop --------------------------------------------------------------------------

    def _due(self, domain: tuple[str, ...]) -> list[GpuWorker]:
        """The workers of ``domain`` (this one first) that take work and should reconcile
        now: a step reconciles every GPU of its domain that needs it before it acts, so
        that a gang switch never starts from a GPU Lease nobody has checked this term."""
        workers = [self, *(self.sibling(g) for g in domain if g != self.gpu)]
        return [w for w in workers if (w is self or w.accepting) and w.state.reconcile_due()]

    def _has_work(self) -> bool:
        return bool(self.queue or self.starts.ready() or self.state.reconcile_due())

    async def run(self, stop: asyncio.Event) -> None:
        state, failures = self.state, _failed_step_backoff()
        while not stop.is_set():
            if not state.accepting or not self._has_work():
                wait = max(0.0, min(state.next_reconcile, self.starts.next_at()) - self.clock())
                await self.wait(stop, timeout_s=wait if state.accepting else None)
                state.wakeup.clear()
            if stop.is_set() or not state.accepting:
                continue
            domain = self._domain()
            try:
                if await self._step(domain, stop):
                    failures.reset()
            except TimeoutError:
                log.error("the locks of the GPU's domain were not free within their bound",
                          extra={"device": self.gpu, "domain": list(domain),
                                 "wait_s": self.policy.lock_wait_s})
                await failures.sleep(stop)
            except Fenced as exc:
                log.warning("GPU step fenced off; another writer moved the lease or this "
                            "instance no longer leads", extra={"device": self.gpu,
                                                                "error": str(exc)})
                state.lease, state.dirty = None, True
                await failures.sleep(stop)
            except Exception as exc:
                log.exception("GPU worker step failed", extra={"device": self.gpu})
                state.dirty = True
                self._fail_all(type(exc).__name__.lower(), str(exc))
                await failures.sleep(stop)
        self._fail_all("stopping", "the controller is stopping")

    async def _step(self, domain: tuple[str, ...], stop: asyncio.Event) -> bool:
        """One step, under the locks of the domain: reconcile whatever of it is due, then
        a start, a turn of the queue, or a look at the idle rules. False when it did
        nothing (closed, or claimants joined more GPUs meanwhile: the next takes them)."""
        async with self.locks.hold(domain, timeout_s=self.policy.lock_wait_s):
            if not self.state.accepting or not set(self._domain()) <= set(domain):
                return False
            for worker in self._due(domain):
                await worker.reconcile()
            if self.starts.ready():
                await self.starts.serve()
            elif self.queue:
                await self.turns.serve_next(stop)
            elif self.idle.active():
                await self.idle.check()
        return True

    def _fail_all(self, reason: str, message: str) -> None:
        lease = self.state.lease
        self.queue.fail_all(reason, message, fence=lease.fence if lease else 0)

    # -- what the parts share --------------------------------------------------------------

    async def wait(self, stop: asyncio.Event, *, timeout_s: float | None,
                   news: bool = True) -> bool:
        """The one wait of the worker's steps: until ``stop``, news (its wakeup; not
        when ``news`` is False) or ``timeout_s``; True when ``stop`` or news came."""
        events = (self.state.wakeup, stop) if news else (stop,)
        return await wait_any(*events, timeout_s=timeout_s)

    def gang_needed(self, target: Claimant, holders: tuple[Claimant, ...]) -> bool:
        """Whether a switch to ``target`` changes several GPU Leases
        (:func:`controller.lease.gang.needs_gang`, looked up here where tests replace it)."""
        return needs_gang(target, holders)

    def on_gpu(self) -> list[Claimant]:
        """Claimants of this GPU whose engine may run (their pod has an address)."""
        return [c for c in self.claimants() if self.gpu in c.gpus and c.pod_ip]

    def sibling(self, gpu: str) -> GpuWorker:
        """The worker of another GPU of this node (this one for its own GPU)."""
        if gpu == self.gpu or self._sibling is None:
            if gpu != self.gpu:
                raise LookupError(f"no worker for {gpu} beside {self.gpu}")
            return self
        return self._sibling(gpu)

    async def lease_of(self, gpu: str) -> GpuLease:
        """The Lease of one GPU of this worker's domain, as its worker last wrote or read
        it (read now when it has none); call with the domain's locks held."""
        state = self.sibling(gpu).state
        if state.lease is None:
            state.lease = await self.sibling(gpu).lease_port.read()
        return state.lease

    async def lease_now(self) -> GpuLease:
        """The GPU Lease now: what this worker last wrote or read when the node's Lease
        watch has seen that very version since (nobody wrote after it; no GET), else read
        from the API server. Fencing does not rest on this: every write is a
        compare-and-swap."""
        seen = self.lease_seen() if self.lease_seen is not None else None
        return confirmed(self.state.lease, seen) or await self.lease_port.read()
