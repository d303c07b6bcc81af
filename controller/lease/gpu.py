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
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from controller.claimants import Claimant
from controller.lease import metrics, tenants
from controller.lease import policy as switch_policy
from controller.lease.admission import StartLimits, StartSwitch, StartTicket
from controller.lease.engines.base import EngineAdapter
from controller.lease.engines.errors import EngineError
from controller.lease.gang import (
    GangResult,
    GangSwitch,
    gang_set,
    holder_timings,
    holders_of,
    needs_gang,
)
from controller.lease.gpu_locks import GpuLocks
from controller.lease.in_flight import until_idle
from controller.lease.kube import ControllerKube
from controller.lease.reconcile import Seen, classify, plan
from controller.lease.switch import Fenced, Switcher, SwitchResult
from controller.lease.visibility import GpuVisibility
from rota.api import naming
from rota.api.engine_config import EngineConfig
from rota.api.gpu_lease import GpuLease, lease_body
from rota.kit.aio import Backoff, wait_any
from rota.kit.errors import KubeConflictError, KubeNotFoundError

log = logging.getLogger(__name__)

HOLDERS = metrics.SeriesSet(metrics.HOLDER)
USAGE_DECAY_S = 300.0
"""The fair share looks at roughly the last five minutes of who was awake."""
ANSWERED_GRACE_S = 1.0
"""How long the callers an activation answered count as the holder's work while its
engine's metrics show none (their requests are on their way)."""
BUSY_HOLDER_POLL_S = 0.25
"""While somebody waits and the policy keeps a busy holder awake, how often the holder's
work is read again: it gives way (``holder_idle``) soon after its last request ends, not
at the end of its quantum."""


def _unsettled_backoff() -> Backoff:
    """How soon reconciliation looks again at engines in an unknown state."""
    return Backoff(first_s=0.2, max_s=5.0)


def _failed_step_backoff() -> Backoff:
    return Backoff(first_s=0.2, max_s=10.0)


def _start_backoff() -> Backoff:
    """After each start of a claim, failed or not, its next start waits this long
    (growing, jittered): a crash-looping engine, or a tenant that restarts its container
    again and again, must not keep the holder asleep; the holder serves its waiters
    between. Starts over after :data:`START_QUIET_S` without a start."""
    return Backoff(first_s=5.0, max_s=300.0)


START_QUIET_S = 600.0
"""A claim with no start for this long (after its back-off allowed one) starts its
back-off over."""


def _run_of(claimant: Claimant) -> tuple[str | None, int]:
    """Which run of the claimant's container this is: its pod and the restarts of the
    pod's containers. A start gate is granted once per run: the gate asks again only
    when its container (re)starts, so a question from a run whose engine came up is not
    an engine starting (it is a tenant asking with its own token)."""
    return claimant.pod_uid, claimant.restarts


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Activation:
    ok: bool
    claimant: Claimant
    switched: bool
    fence: int
    reason: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)


def confirmed(known: GpuLease | None, seen: str | None) -> GpuLease | None:
    """``known`` (the Lease as a worker last wrote or read it) when a watch has seen that
    very version since (``seen``), so nobody wrote after it; None when it must be read."""
    if known is not None and known.resource_version and seen == known.resource_version:
        return known
    return None


class KubeLeasePort:
    """The GPU Lease of one physical GPU, read and written with compare-and-swap."""

    def __init__(self, kube: ControllerKube, namespace: str, node: str, gpu: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.node = node
        self.gpu = gpu
        self.name = naming.gpu_lease_name(node, gpu)

    async def read(self) -> GpuLease:
        try:
            return GpuLease.from_object(await self.kube.get_lease(self.namespace, self.name))
        except KubeNotFoundError:
            fresh = GpuLease(name=self.name, node=self.node, device=self.gpu)
            body = lease_body(fresh, self.namespace, labels_node=self.node,
                              labels_device=self.gpu)
            try:
                return GpuLease.from_object(await self.kube.create_lease(self.namespace, body))
            except KubeConflictError:
                return GpuLease.from_object(await self.kube.get_lease(self.namespace,
                                                                      self.name))

    async def write(self, lease: GpuLease) -> GpuLease:
        body = lease_body(lease, self.namespace, labels_node=self.node,
                          labels_device=self.gpu)
        try:
            return GpuLease.from_object(await self.kube.replace_lease(self.namespace, body))
        except KubeConflictError as exc:
            raise Fenced(f"GPU lease {self.name} changed under this switch: {exc}") from exc


@dataclass
class _Waiting:
    claimant: Claimant
    futures: list[asyncio.Future[Activation]]
    fenced: int = 0
    """How often its switch was fenced off before it began."""
    since: float = 0.0
    """When its first request arrived."""
    home: bool = False
    """The return of the GPU's home model (nobody waits; never cancelled)."""

    def waiting(self) -> int:
        return sum(1 for f in self.futures if not f.done())


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
    priority_ceilings: tenants.Binding = field(default_factory=dict)
    """The admin's binding: what the claims of each namespace may take (names or shell
    patterns; see :mod:`controller.lease.tenants`); empty: only the wait's floor."""


class GpuWorker:
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
        self.lease_seen = lease_seen
        """The resourceVersion of this GPU's Lease as the node's Lease watch last saw it
        (None: not known); lets reconciliation confirm its Lease without a GET."""
        self.locks = locks or GpuLocks()
        self._domain = domain or (lambda: (gpu,))
        """The GPUs whose locks every step of this worker holds (see the module doc)."""
        self._sibling = sibling
        self.visibility = visibility
        """Events, pod labels and claim conditions (None: nothing is shown)."""
        self.lease_port = lease_port
        self.switcher = switcher
        self.starter = starter
        self._starts: dict[str, StartTicket] = {}
        self._start_backoff: dict[str, tuple[float, Backoff]] = {}
        """Claims started before: their next start not before this time, and its pauses."""
        self._started: dict[str, tuple[str | None, int]] = {}
        """The run (:func:`_run_of`) of each claim's container whose engine came up in a
        start: its gate is not granted again in that run."""
        self.claimants = claimants
        self.engine = engine
        self.policy = policy
        self.clock = clock
        self.identity = identity
        self.lease: GpuLease | None = None
        self._answered: tuple[str, int, float] | None = None
        """The claim uid an activation last answered ok, how many callers, and when."""
        self.reconciliations = 0
        """Reconciliations begun (each has its Lease in hand)."""
        self.last_switch: dict[str, object] = {}
        """Outcome and timings of the latest switch, for /v1/state."""
        self.unsettled: dict[str, Claimant] = {}
        """Engines that may be awake although nobody woke them under this fence (a sleep
        that may still fire, an engine that did not answer): no wake on this GPU until
        reconciliation knows them again."""
        self._queue: dict[str, _Waiting] = {}
        self._wakeup = asyncio.Event()
        self._switching = False
        self._switching_to = ""
        """The claim uid of the switch in flight (while ``_switching``)."""
        self._accepting = False
        self._closed = ("not_leader", "this instance does not act for the node")
        self._dirty = False
        self._new_term = False
        self._next_reconcile = clock()
        self._unsettled_pauses = _unsettled_backoff()
        self.lock = self.locks.lock(gpu)
        """Held by every switch and by reconciliation of this GPU (and by every step of
        its domain's other workers): one actor at a time."""
        self._holder_since = clock()
        self._last_busy = clock()
        self._costs: dict[str, switch_policy.SwitchCost] = {}
        """Measured switch costs per claimant (from this controller's SwitchResult timings)."""
        self._drains: dict[str, float] = {}
        self._usage: dict[str, float] = {}
        """Awake seconds per claimant, decaying (time constant USAGE_DECAY_S): the fair
        share's measure of who had the GPU lately."""
        self._usage_at = clock()
        self._rule = ""
        """The policy rule behind the switch in flight (its log line, metric and Event)."""

    @property
    def device(self) -> str:
        return self.gpu

    # -- what a switch is expected to cost (for /v1/state) -----------------------------

    def switch_cost(self, holder: str | None, target: str | None) -> float:
        """The expected cost of a switch from ``holder`` (None: nobody awake) to ``target``
        (None: a claimant not known yet): the holder's sleep and drain, the target's wake and
        probe, as this worker measured them (the policy's defaults otherwise)."""
        default = switch_policy.SwitchCost()
        costs = self._costs
        sleep = 0.0 if holder is None else (costs.get(holder, default).sleep_s
                                            + self._drains.get(holder, 0.0))
        woken = costs.get(target, default) if target is not None else default
        return sleep + woken.wake_s + woken.probe_s

    def expectation(self, claimant: Claimant) -> tuple[float, int, float]:
        """``(expected_switch_s, queue_position, expected_wait_s)`` of a switch to
        ``claimant`` on this GPU now (see
        :class:`rota.api.activation.ClaimantState`)."""
        lease = self.lease
        holder = lease.holder if lease is not None and lease.state == naming.STATE_AWAKE \
            and lease.holder else None
        if holder == claimant.ref and not self._switching:
            return 0.0, 0, 0.0
        if self._switching and self._switching_to == claimant.claim_uid:
            own = round(self.switch_cost(holder, claimant.ref), 3)
            return own, 0, own  # its own switch is the one in flight
        wait = 0.0
        position = 0
        current: str | None = holder
        if self._switching:  # a switch in flight, to another claimant
            wait += self.switch_cost(current, None)
            position += 1
            current = None
        for queued in self._queue.values():
            if queued.claimant.claim_uid == claimant.claim_uid:
                break
            if queued.home or queued.waiting():
                wait += self.switch_cost(current, queued.claimant.ref)
                position += 1
                current = queued.claimant.ref
        own = self.switch_cost(holder, claimant.ref)
        return round(own, 3), position, round(wait + self.switch_cost(current, claimant.ref), 3)

    # -- opening and closing -----------------------------------------------------------

    def open(self) -> None:
        """Take work (this instance now leads the node): reconcile first."""
        self._accepting = True
        self._new_term = True
        self.mark_dirty()

    def close(self, reason: str, message: str) -> None:
        """Refuse new work and answer every waiter now; the step in flight goes on."""
        self._accepting = False
        self._closed = (reason, message)
        self._fail_all(reason, message)
        for ticket in self._starts.values():
            ticket.refuse()
        self.lease = None
        self._wakeup.set()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def mark_dirty(self) -> None:
        """Reconcile before the next switch (claimants changed, or a new term)."""
        self._dirty = True
        self._wakeup.set()

    # -- callers ---------------------------------------------------------------------------

    async def activate(self, claimant: Claimant) -> Activation:
        if not self._accepting:
            return Activation(False, claimant, switched=False, fence=0,
                              reason=self._closed[0], message=self._closed[1])
        lease = self.lease
        if (lease is not None and lease.holder == claimant.ref and not self._dirty
                and lease.state == naming.STATE_AWAKE and not self._switching):
            # The holder serves now, even while a switch away waits for its residency.
            return Activation(True, claimant, switched=False, fence=lease.fence)
        future: asyncio.Future[Activation] = asyncio.get_running_loop().create_future()
        self._queue.setdefault(claimant.claim_uid, _Waiting(claimant, [], since=self.clock())
                               ).futures.append(future)
        self._wakeup.set()
        return await future

    def pending(self) -> int:
        return sum(len(w.futures) for w in self._queue.values())

    async def request_start(self, claimant: Claimant, *, hold_s: float) -> bool:
        """One long poll of ``claimant``'s start gate: True when it may start now; False
        when it should ask again (held up to ``hold_s``)."""
        if not self._accepting or self.starter is None:
            return False
        now = self.clock()
        ticket = self._starts.get(claimant.claim_uid)
        if ticket is not None and ticket.granted:
            # Its container was granted a start and asks again: it exited and restarted.
            ticket.restarted.set()
            ticket = None
        if ticket is None:
            ticket = StartTicket(claimant.claim_uid, created=now, last_poll=now)
            self._starts[claimant.claim_uid] = ticket
            if not self._really_starting(claimant.claim_uid):
                log.warning("a start gate asks again in the run of its container whose "
                            "engine came up; held until its container restarts", extra={
                                "device": self.gpu, "claim": claimant.ref,
                                "restarts": claimant.restarts})
            log.info("engine waiting at the start gate", extra={
                "device": self.gpu, "claim": claimant.ref, "model": claimant.model})
            if self.visibility is not None:
                self.visibility.start_waiting(claimant, self.lease.holder if self.lease else "")
            self._wakeup.set()
        poll = ticket.attach(now)
        done, _ = await asyncio.wait({poll}, timeout=hold_s)
        if not done:
            if ticket.poll is poll:
                ticket.poll = None
            poll.cancel()
            return False
        return poll.result()

    # -- the loop --------------------------------------------------------------------------

    def _reconcile_due(self) -> bool:
        return self._dirty or self.clock() >= self._next_reconcile

    def _due(self, domain: tuple[str, ...]) -> list[GpuWorker]:
        """The workers of ``domain`` (this one first) that take work and should reconcile
        now: a step reconciles every GPU of its domain that needs it before it acts, so
        that a gang switch never starts from a GPU Lease nobody has checked this term."""
        workers = [self, *(self.sibling(g) for g in domain if g != self.gpu)]
        return [w for w in workers
                if (w is self or w.accepting) and w._reconcile_due()]

    async def run(self, stop: asyncio.Event) -> None:
        failures = _failed_step_backoff()
        while not stop.is_set():
            if not self._accepting or not (self._queue or self._start_ready()
                                           or self._reconcile_due()):
                wait = max(0.0, min(self._next_reconcile, self._next_start()) - self.clock())
                await wait_any(self._wakeup, stop, timeout_s=wait if self._accepting else None)
                self._wakeup.clear()
            if stop.is_set() or not self._accepting:
                continue
            domain = self._domain()
            try:
                async with self.locks.hold(domain, timeout_s=self.policy.lock_wait_s):
                    if not self._accepting:
                        continue
                    if not set(self._domain()) <= set(domain):
                        continue  # claimants joined more GPUs meanwhile: take them too
                    for worker in self._due(domain):
                        await worker.reconcile()
                    if self._start_ready():
                        await self._serve_start()
                    elif self._queue:
                        await self._serve_next(stop)
                    elif self.policy.idle_sleep_s > 0 or self._idle_rules():
                        await self._idle_check()
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
                self.lease = None
                self._dirty = True
                await failures.sleep(stop)
            except Exception as exc:
                log.exception("GPU worker step failed", extra={"device": self.gpu})
                self._dirty = True
                self._fail_all(type(exc).__name__.lower(), str(exc))
                await failures.sleep(stop)
        self._fail_all("stopping", "the controller is stopping")

    def _fail_all(self, reason: str, message: str) -> None:
        for waiting in self._queue.values():
            self._resolve(waiting, Activation(False, waiting.claimant, switched=False,
                                              fence=self.lease.fence if self.lease else 0,
                                              reason=reason, message=message))
        self._queue.clear()

    def _resolve(self, waiting: _Waiting, activation: Activation) -> None:
        answered = 0
        for future in waiting.futures:
            if not future.done():
                future.set_result(activation)
                answered += 1
        if activation.ok and answered:
            self._answered = (activation.claimant.claim_uid, answered, self.clock())

    def _in_flight_seen(self, holder: Claimant, measured: int) -> int:
        """The holder's work in flight: what its engine reports, or, until the engine shows
        work or :data:`ANSWERED_GRACE_S` has passed, the callers an activation just
        answered for it. Their requests are on their way: an engine's metrics count them
        only once they arrive, and a policy that read the holder as idle meanwhile would
        put it to sleep under the requests it was woken for."""
        if self._answered is None or self._answered[0] != holder.claim_uid:
            return measured
        _, callers, at = self._answered
        if measured > 0 or self.clock() - at > ANSWERED_GRACE_S:
            self._answered = None
            return measured
        return callers

    def _on_gpu(self) -> list[Claimant]:
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
        worker = self.sibling(gpu)
        if worker.lease is None:
            worker.lease = await worker.lease_port.read()
        return worker.lease

    # -- reconciliation --------------------------------------------------------------------

    async def _sleeping(self, claimant: Claimant, lease: GpuLease) -> bool | None:
        """The claimant's ``/is_sleeping``, asked under ``lease``'s fence: the engine guard
        learns the fence from it (see :meth:`reconcile`)."""
        if self._at_gate(claimant.claim_uid):
            return None  # held at its start gate: no engine runs yet
        try:
            return await self.engine(claimant).fenced({lease.name: lease.fence}).is_sleeping()
        except (EngineError, TimeoutError, ValueError) as exc:
            log.warning("claimant did not say whether it sleeps",
                        extra={"claim": claimant.ref, "device": self.gpu, "error": str(exc)})
            return None

    async def reconcile(self) -> None:
        """At most one engine awake on this GPU, a Lease that says who, and every engine
        whose state is unknown remembered as possibly awake. Call with the lock held.

        Taking over (a new term, or a switch its controller never finished), the new
        fencing number is written before the engines are read, and the reads carry it
        (``X-Rota-Fence``): from its read on, each engine's guard refuses what an earlier
        instance still sends under the old number (one paused between its fencing check
        and its call). What remains is the time between this write and an engine's read:
        a stale call the guard let through before the read is answered before it, or, if
        it is a wake still running, belongs to a switch that was never finished, whose
        engines are suspects and are put to sleep (the engine handles the sleep after the
        wake). Engines without the guard never check the number."""
        timings: dict[str, float] = {}
        self._dirty = False
        self._forget_start_state()
        lease = self.lease = await self._lease_now()
        self.reconciliations += 1
        on_gpu = self._on_gpu()
        unfinished = lease.state in (naming.STATE_SWITCHING, naming.STATE_STARTING)
        if unfinished:
            # Nobody switches while this worker's lock is held: a switch was cut short by
            # the crash (or the loss of leadership) of the instance that ran it; the
            # calls it sent may still land.
            metrics.FAILURES.labels("controller_crash").inc()
            log.warning("found a switch its controller never finished",
                        extra={"device": self.gpu, "fence": lease.fence,
                               "controller": lease.controller or None,
                               "target": lease.target_model or None})
        termed = self._new_term or unfinished
        if termed:
            # A new fencing number before the reads, which carry it: see the docstring.
            lease = await self.switcher.write(lease.new_term(self.identity), timings)
            self._new_term = False
        snapshot = await self.switcher.snapshot(self.gpu, timings)
        answers = await asyncio.gather(*(self._sleeping(c, lease) for c in on_gpu))
        seen = {c.claim_uid: classify(answer, used_bytes=snapshot.held_by(c, on_gpu),
                                      has_process=bool(snapshot.processes_of(c, on_gpu)),
                                      resident_bytes=c.resident_on(self.gpu),
                                      tolerance_bytes=self.policy.tolerance_bytes)
                for c, answer in zip(on_gpu, answers, strict=True)}
        coming = self._coming_up(lease, on_gpu, answers)
        suspects = {c.claim_uid for c in on_gpu if unfinished and c.model and c.model in (
            lease.target_model, lease.draining_model)} | set(self.unsettled)
        if coming is not None:
            suspects.add(coming.claim_uid)
        decision = plan(on_gpu, seen, lease.holder, suspects=suspects,
                        may_not_keep=await self._gangs_held_elsewhere(on_gpu))
        asleep_holding = (decision.keep is not None and decision.keep.ref == lease.holder
                          and seen[decision.keep.claim_uid] is Seen.UNKNOWN
                          and answers[on_gpu.index(decision.keep)] is True)
        if not termed and (decision.put_to_sleep or asleep_holding):
            # A new fencing number first: whatever an earlier instance was doing is over,
            # and its next engine call is refused.
            lease = await self.switcher.write(lease.new_term(self.identity), timings)
        for extra in decision.put_to_sleep:
            seen[extra.claim_uid] = await self._put_to_sleep(extra, lease.fence,
                                                             seen[extra.claim_uid])
            for gpu in extra.gpus:  # its other GPUs' Leases may still name it
                if gpu != self.gpu:
                    self.sibling(gpu).mark_dirty()
        keep = decision.keep
        if keep is not None and asleep_holding:
            seen[keep.claim_uid] = await self._wake_back(keep, lease.fence, on_gpu, seen)
        # A suspect stays unsettled until a sleep of ours completed (it is then ASLEEP);
        # an engine granted a start that may still come up, until it is known.
        self.unsettled = {c.claim_uid: c for c in on_gpu if c is not keep and (
            seen[c.claim_uid] is Seen.UNKNOWN or c is coming
            or (c.claim_uid in suspects and c not in decision.put_to_sleep
                and seen[c.claim_uid] is not Seen.ABSENT))}
        wanted = (keep.ref if keep else "", naming.STATE_AWAKE if keep else naming.STATE_IDLE)
        start = ((lease.start_claim_uid, lease.start_granted) if coming is not None
                 else ("", None))
        if ((lease.holder, lease.state) != wanted or unfinished
                or (lease.start_claim_uid, lease.start_granted) != start):
            if keep:
                lease = Switcher.serving(lease, keep, controller=self.identity)
            else:
                lease = lease.idle(controller=self.identity)
            if coming is not None and start[1] is not None:
                # Kept on the Lease until it is known: a next instance must know it too.
                lease = lease.granted(start[0], start[1])
            lease = await self.switcher.write(lease, timings)
            log.info("lease reconciled", extra={"device": self.gpu, "holder": wanted[0],
                                                "state": wanted[1], "fence": lease.fence})
        self.lease = lease
        if self.visibility is not None:
            self.visibility.settled(on_gpu, lease, unknown=self.unsettled.keys())
        HOLDERS.set(self.gpu, {(self.gpu, snapshot.uuid, c.ref, c.model): 1.0 if keep is c
                               else 0.0 for c in on_gpu})
        if self.unsettled:
            self._next_reconcile = self.clock() + self._unsettled_pauses.next_delay()
            log.warning("engines in an unknown state; no wake on this GPU until they are "
                        "known", extra={"device": self.gpu,
                                        "claims": sorted(c.ref for c in self.unsettled.values())})
        else:
            self._unsettled_pauses = _unsettled_backoff()
            self._next_reconcile = self.clock() + self.policy.resync_s

    def _start_limit_s(self) -> float:
        """How long after its grant a start may still bring its engine up: the grant's
        wait for the gate's poll and the start's own limit."""
        limits = self.starter.limits if self.starter is not None else StartLimits()
        return limits.grant_s + limits.start_s

    def _coming_up(self, lease: GpuLease, on_gpu: list[Claimant],
                   answers: Sequence[bool | None]) -> Claimant | None:
        """The engine whose start gate the Lease says was given its go, if it may still
        come up awake (as every engine starts) beside whoever is woken next: it does not
        answer yet (a real vLLM imports for seconds before it holds GPU memory or
        listens), its container does not ask its start gate again (a restart: nothing of
        it runs), and the start's limit since the grant has not passed. An instance that
        takes over after another one granted a start finds it so."""
        uid, granted = lease.start_claim_uid, lease.start_granted
        if not uid or granted is None:
            return None
        newcomer = next((c for c in on_gpu if c.claim_uid == uid), None)
        if newcomer is None or answers[on_gpu.index(newcomer)] is not None:
            return None
        if self._at_gate(uid):
            return None
        if _utc_now() >= granted + dt.timedelta(seconds=self._start_limit_s()):
            log.warning("a start granted earlier did not come up within its limit; its "
                        "engine is judged by what the GPU shows", extra={
                            "device": self.gpu, "claim": newcomer.ref,
                            "granted": granted.isoformat()})
            return None
        log.warning("an engine granted a start may still come up; no wake on this GPU "
                    "until it answers, its container restarts or its start's limit passes",
                    extra={"device": self.gpu, "claim": newcomer.ref,
                           "granted": granted.isoformat()})
        return newcomer

    async def _wake_back(self, holder: Claimant, fence: int, on_gpu: list[Claimant],
                         seen: dict[str, Seen]) -> Seen:
        """The Lease's holder says it sleeps but still holds more than its resident
        memory (a sleep nobody waited for fired and handed nothing back): vLLM then holds
        every request, and a sleep changes nothing, so no other engine can ever be woken
        beside it. Wake it back, as a switch would, once every other engine is known
        asleep and the GPU is read (its own memory counts as reused): it is then the
        awake holder its Lease names, and the next switch away sleeps it again."""
        if any(seen[c.claim_uid] in (Seen.AWAKE, Seen.UNKNOWN) for c in on_gpu
               if c is not holder):
            return Seen.UNKNOWN
        timings: dict[str, float] = {}
        try:
            problem = await self.switcher.check_device(holder, on_gpu, timings)
            if problem is None:
                await self.switcher.wake_and_probe(holder, fence, timings)
        except Fenced:
            raise
        except Exception as exc:
            log.error("could not wake back a holder that sleeps holding its memory",
                      extra={"claim": holder.ref, "device": self.gpu, "error": str(exc)})
            return Seen.UNKNOWN
        if problem is not None:
            log.warning("a holder sleeps holding its memory; not woken back",
                        extra={"claim": holder.ref, "device": self.gpu,
                               "reason": problem.reason, "error": problem.message})
            return Seen.UNKNOWN
        metrics.RECONCILES.labels("woken_back").inc()
        log.warning("the holder slept without handing its memory back; woken back",
                    extra={"claim": holder.ref, "device": self.gpu, "model": holder.model})
        return Seen.AWAKE

    async def _gangs_held_elsewhere(self, on_gpu: list[Claimant]) -> set[str]:
        """Claim uids of the engines on this GPU that span GPUs and that the Lease of one
        of their other GPUs does not name: such an engine may not keep this GPU (it is
        awake only as the holder of all of them), and is put to sleep if awake."""
        barred: set[str] = set()
        for claimant in on_gpu:
            for gpu in claimant.gpus:
                if gpu != self.gpu and (await self.lease_of(gpu)).holder != claimant.ref:
                    barred.add(claimant.claim_uid)
                    break
        return barred

    async def _put_to_sleep(self, claimant: Claimant, fence: int, was: Seen) -> Seen:
        log.warning("engine awake (or possibly awake) beside the holder; putting it to sleep",
                    extra={"device": self.gpu, "claim": claimant.ref, "seen": str(was)})
        if not await self.switcher.settle(claimant, fence, {}):
            log.error("could not put an engine to sleep; it stays possibly awake",
                      extra={"claim": claimant.ref, "device": self.gpu})
            return Seen.UNKNOWN
        metrics.RECONCILES.labels("two_awake" if was is Seen.AWAKE else str(was)).inc()
        return Seen.ASLEEP

    # -- start-up admission ----------------------------------------------------------------

    def _forget_start_state(self) -> None:
        """Drop the start spacing and the started runs of claims that are no longer
        claimants (a reconcile follows every change of them): without this, both maps
        grew with every claim the node ever had."""
        current = {c.claim_uid for c in self.claimants()} | set(self._starts)
        for uid in [u for u in self._start_backoff if u not in current]:
            del self._start_backoff[uid]
        for uid in [u for u in self._started if u not in current]:
            del self._started[uid]

    def _start_allowed_at(self, uid: str) -> float:
        return self._start_backoff[uid][0] if uid in self._start_backoff else 0.0

    def _really_starting(self, uid: str) -> bool:
        """Whether the claim's container is in a run (:func:`_run_of`) whose engine has not
        come up in a start yet: only then does its gate's question mean an engine waits
        to start (a gate asks once per run of its container)."""
        claimant = next((c for c in self.claimants() if c.claim_uid == uid), None)
        return claimant is None or self._started.get(uid) != _run_of(claimant)

    def _at_gate(self, uid: str) -> bool:
        """The claim's container waits at its start gate, asking this instance: no engine
        of it runs."""
        ticket = self._starts.get(uid)
        return ticket is not None and not ticket.granted and self._really_starting(uid)

    def _start_ready(self) -> str | None:
        """The first waiting start of an engine really starting that its back-off lets
        through now."""
        now = self.clock()
        return next((uid for uid in self._starts if self._start_allowed_at(uid) <= now
                     and self._really_starting(uid)), None)

    def _next_start(self) -> float:
        """When the next waiting start may be served (a container that restarts changes
        the claimants, which wakes the worker)."""
        return min((self._start_allowed_at(uid) for uid in self._starts
                    if self._really_starting(uid)), default=float("inf"))

    async def _serve_start(self) -> None:
        assert self.starter is not None
        uid = self._start_ready()
        assert uid is not None
        ticket = self._starts[uid]
        newcomer = next((c for c in self.claimants() if c.claim_uid == uid), None)
        stale = self.clock() - ticket.last_poll > 2 * self.starter.limits.grant_s
        if newcomer is None or newcomer.gpu != self.gpu or (stale and ticket.poll is None):
            self._starts.pop(uid, None)  # the gate went away, or so did the claim
            ticket.refuse()
            return
        blockers = [c.ref for c in self.unsettled.values() if c.claim_uid != uid]
        if blockers:
            self._starts.pop(uid, None)
            ticket.refuse()
            log.warning("start held: engines on the GPU are in an unknown state",
                        extra={"device": self.gpu, "claim": newcomer.ref, "blockers": blockers})
            return
        lease = self.lease if self.lease is not None else await self.lease_port.read()
        self.lease = lease
        leases = {gpu: await self.lease_of(gpu) for gpu in newcomer.gpus}
        gang_holders = holders_of(newcomer, leases, self.claimants())
        if needs_gang(newcomer, gang_holders):
            await self._serve_gang_start(ticket, newcomer, gang_holders)
            return
        on_gpu = [c for c in self._on_gpu() if c.claim_uid != uid]
        holder = next((c for c in on_gpu if c.ref == lease.holder), None)
        if lease.state != naming.STATE_AWAKE:
            holder = None
        self._switching, self._switching_to = True, uid
        if self.visibility is not None:
            self.visibility.switching(holder, newcomer, starting=True)
        result: SwitchResult | None = None
        try:
            result = await self.starter.start(
                lease, holder=holder, newcomer=newcomer, claimants=on_gpu, ticket=ticket,
                wanted=lambda: uid in self._queue)
        finally:
            self._switching = False
            if self._starts.get(uid) is ticket:
                self._starts.pop(uid)
            if result is None:
                ticket.refuse()
                self._dirty = True
        self._switched(result, holder, newcomer, start=True)
        self._start_done(newcomer, ok=result.ok, reason=result.reason,
                         came_up="start" in result.timings)

    def _start_done(self, newcomer: Claimant, *, ok: bool, reason: str, came_up: bool
                    ) -> None:
        """After a start of ``newcomer``: its run is not granted again once its engine
        came up, and its next start waits (:func:`_start_backoff`), whatever the outcome:
        a start puts the holder to sleep, and a successful one must not buy the next."""
        uid = newcomer.claim_uid
        now = self.clock()
        if came_up:
            self._started[uid] = _run_of(newcomer)
        allowed_at, pauses = self._start_backoff.get(uid, (now, _start_backoff()))
        if now - allowed_at > START_QUIET_S:
            pauses.reset()
        pause = pauses.next_delay()
        self._start_backoff[uid] = (now + pause, pauses)
        log.log(logging.INFO if ok else logging.WARNING,
                "start done; the claim's next start waits" if ok
                else "start failed; its next attempt waits",
                extra={"device": self.gpu, "claim": newcomer.ref, "reason": reason or None,
                       "pause_s": round(pause, 1)})

    async def _serve_gang_start(self, ticket: StartTicket, newcomer: Claimant,
                                holders: tuple[Claimant, ...]) -> None:
        """Start-up admission of an engine that spans GPUs, or whose GPUs' holders do:
        across every GPU of the set (see :meth:`controller.lease.gang.GangSwitch.start`)."""
        assert self.starter is not None
        uid = newcomer.claim_uid
        leases = {gpu: await self.lease_of(gpu)
                  for gpu in {*newcomer.gpus, *(g for h in holders for g in h.gpus)}}
        gpus = gang_set(newcomer, holders, leases)
        blockers = self._gang_blockers(gpus, uid)
        if blockers:
            self._starts.pop(uid, None)
            ticket.refuse()
            log.warning("start held: engines on the GPUs are in an unknown state",
                        extra={"device": ",".join(gpus), "claim": newcomer.ref,
                               "blockers": blockers})
            return
        claimants = [c for c in self.claimants() if c.pod_ip and set(c.gpus) & set(gpus)]
        self._gang_begins(gpus, newcomer)
        if self.visibility is not None:
            self.visibility.switching(holders[0] if holders else None, newcomer,
                                      starting=True)
        result: GangResult | None = None
        try:
            result = await self._gang(gpus).start(
                {g: leases[g] for g in gpus}, holders=holders, newcomer=newcomer,
                claimants=claimants, ticket=ticket, starter=self.starter,
                wanted=lambda: uid in self._queue)
        finally:
            self._gang_ends(gpus, cut_short=result is None)
            if self._starts.get(uid) is ticket:
                self._starts.pop(uid)
            if result is None:
                ticket.refuse()
        self._gang_switched(result, holders, newcomer, start=True)
        self._start_done(newcomer, ok=result.ok, reason=result.reason, came_up=result.ok)

    # -- activations -----------------------------------------------------------------------

    async def _serve_next(self, stop: asyncio.Event) -> None:
        picked = await self._pick(stop)
        if picked is None:
            return
        uid = picked
        waiting = self._queue[uid]
        by_uid = {c.claim_uid: c for c in self.claimants()}
        target = by_uid.get(uid)
        if target is None or not target.serving:
            self._queue.pop(uid)
            self._resolve(waiting, Activation(False, waiting.claimant, False, 0,
                                              "not_serving", f"{waiting.claimant.ref} has no "
                                              "running, ready pod on this node"))
            return
        # The Lease as this worker last wrote or read it: a writer that moved it since
        # makes the switch's first compare-and-swap fail (Fenced: reconcile, then retry).
        lease = self.lease if self.lease is not None else await self.lease_port.read()
        self.lease = lease
        on_gpu = self._on_gpu()
        holder = next((c for c in on_gpu if c.ref == lease.holder), None)
        leases = {gpu: await self.lease_of(gpu) for gpu in target.gpus}
        if all(v.holder == target.ref and v.state == naming.STATE_AWAKE
               for v in leases.values()):
            # Already the awake holder: nothing is woken, so engines in an unknown state
            # elsewhere on the GPU do not stand in its way.
            self._queue.pop(uid)
            self._resolve(waiting, Activation(True, target, False, lease.fence))
            return
        blockers = [c.ref for c in self.unsettled.values() if c.claim_uid != uid]
        if blockers:
            self._queue.pop(uid)
            self._resolve(waiting, Activation(
                False, target, False, lease.fence, "state_unknown",
                f"engines on {self.gpu} are in an unknown state (possibly awake): "
                f"{', '.join(blockers)}; no wake until they are known"))
            return
        gang_holders = holders_of(target, leases, self.claimants())
        if needs_gang(target, gang_holders):
            await self._serve_gang(waiting, target, gang_holders, stop)
            return
        if holder is not None and lease.state == naming.STATE_AWAKE:
            remaining = self._holder_since + self.policy.min_residency_s - self.clock()
            if remaining > 0:
                log.info("holding the switch for minimum residency", extra={
                    "device": self.gpu, "holder": holder.ref, "wait_s": round(remaining, 3)})
                if await wait_any(stop, timeout_s=remaining):
                    return
            if self.policy.coalesce_window_s > 0 and await self._coalesce(holder, stop):
                return
        if not waiting.home and waiting.waiting() == 0:
            self._queue.pop(uid)
            self._decided("cancelled", target, "every request for it left before its wake")
            return
        self._queue.pop(uid)
        self._switching, self._switching_to = True, uid
        if self.visibility is not None:
            self.visibility.switching(holder if lease.state != naming.STATE_IDLE else None,
                                      target)
        result: SwitchResult | None = None
        try:
            result = await self.switcher.switch(
                lease, holder=holder if lease.state != naming.STATE_IDLE else None,
                target=target, claimants=on_gpu)
            self._measured(result, holder if lease.state != naming.STATE_IDLE else None,
                           target)
        finally:
            self._switching = False
            if result is None:  # fenced, failed or cancelled: reconcile, then again
                self._fenced_off(waiting, target, lease.fence)
        self._switched(result, holder, target)
        self._resolve(waiting, Activation(result.ok, target, switched=result.ok,
                                          fence=result.lease.fence, reason=result.reason,
                                          message=result.message, timings=result.timings))

    def _fenced_off(self, waiting: _Waiting, target: Claimant, fence: int) -> None:
        """A switch ended by fencing (another writer moved a Lease, or leadership went):
        its waiters queue again, at the front, to be served after reconciliation, a
        bounded number of times; then (or when this worker no longer takes work) they
        are answered."""
        self._dirty = True
        if self._accepting and waiting.fenced < self.policy.fenced_retries:
            waiting.fenced += 1
            # Callers who asked for the same engine while the switch ran queued under its
            # claim: they join these, in their order (a second entry would replace this
            # one, and its callers would wait for ever).
            came_meanwhile = self._queue.pop(target.claim_uid, None)
            if came_meanwhile is not None:
                waiting.futures.extend(came_meanwhile.futures)
            self._queue = {target.claim_uid: waiting, **self._queue}
            return
        reason, message = (("interrupted", "the switch was cut short (fenced off, or the "
                            "controller stopping)") if self._accepting else self._closed)
        self._resolve(waiting, Activation(False, target, False, fence, reason, message))

    # -- policy ------------------------------------------------------------------------

    def _defaults(self) -> switch_policy.ModelPolicy:
        """The node's default model policy; the old idle TTL is the default keep-alive."""
        models = self.policy.models
        if math.isinf(models.keep_alive_s) and self.policy.idle_sleep_s > 0:
            return dataclasses.replace(models, keep_alive_s=self.policy.idle_sleep_s)
        return models

    def _home(self) -> Claimant | None:
        """The GPU's home model's claimant (queued at this worker), if any."""
        here = [c for c in self._on_gpu() if c.gpu == self.gpu and c.serving]
        if self.policy.home_model:
            return next((c for c in here if c.model == self.policy.home_model), None)
        return next((c for c in here if self._bounded(c).home), None)

    def _idle_rules(self) -> bool:
        """Whether keep-alive or the home return can act on this GPU."""
        return (self._home() is not None or math.isfinite(self._defaults().keep_alive_s)
                or any(self._bounded(c).keep_alive_seconds is not None
                       for c in self._on_gpu()))

    def _bounded(self, c: Claimant) -> EngineConfig:
        """The claim's EngineConfig within the admin's binding: all the policy reads."""
        return tenants.bounded(c, self._defaults(), self.policy.priority_ceilings)

    def _policy_input(self, holder: Claimant | None, in_flight: int
                      ) -> switch_policy.PolicyInput:
        """What :func:`controller.lease.policy.decide` needs, gathered from this worker."""
        defaults = self._defaults()
        home = self._home()
        queues = tuple(switch_policy.ClaimQueue(w.claimant.ref, max(w.waiting(), int(w.home)),
                                                w.since) for w in self._queue.values())
        return switch_policy.PolicyInput(
            gpu=switch_policy.GpuView(
                now=self.clock(), holder=holder.ref if holder else None,
                awake_since=self._holder_since, last_request=self._last_busy,
                in_flight=in_flight, idle_since=self._last_busy,
                drain_estimate_s=self._drains.get(holder.ref, 0.0) if holder else 0.0),
            queues=queues,
            policies={c.ref: switch_policy.policy_for(self._bounded(c), defaults)
                      for c in self.claimants()},
            costs=dict(self._costs), default_policy=defaults,
            home=home.ref if home else None, home_idle_s=self.policy.home_idle_s,
            usage_s=self._usage_now(holder))

    def _usage_now(self, holder: Claimant | None) -> dict[str, float]:
        """Recent awake seconds per claimant, the holder's current tenure included."""
        self._used("", 0.0)
        usage = dict(self._usage)
        if holder is not None:
            usage[holder.ref] = usage.get(holder.ref, 0.0) + max(
                0.0, self.clock() - self._holder_since)
        return usage

    def _used(self, ref: str, seconds: float) -> None:
        """Count ``seconds`` awake for ``ref``; everyone's count decays meanwhile."""
        now = self.clock()
        decay = math.exp(-max(0.0, now - self._usage_at) / USAGE_DECAY_S)
        self._usage = {k: v * decay for k, v in self._usage.items() if v * decay > 1e-3}
        self._usage_at = now
        if seconds > 0:
            self._usage[ref] = self._usage.get(ref, 0.0) + seconds

    def _decided(self, rule: str, claimant: Claimant, reason: str) -> None:
        metrics.POLICY_DECISIONS.labels(rule).inc()
        log.info("switch policy decided", extra={
            "device": self.gpu, "claim": claimant.ref, "model": claimant.model,
            "rule": rule, "reason": reason})

    async def _pick(self, stop: asyncio.Event) -> str | None:
        """The queued claimant to serve now, as the policy decides; None when the
        policy holds (this waits until its next look, or until news)."""
        for uid, w in list(self._queue.items()):
            if not w.home and w.waiting() == 0:  # every caller left: no switch for them
                self._queue.pop(uid)
                self._decided("cancelled", w.claimant, "every request for it left")
        if not self._queue:
            return None
        serving = {c.claim_uid for c in self.claimants() if c.serving}
        lease = self.lease
        holder_ref = lease.holder if lease is not None and lease.state == naming.STATE_AWAKE \
            else ""
        for uid, w in self._queue.items():
            if uid not in serving or w.claimant.ref == holder_ref:
                return uid  # answered at once (not serving, or already awake)
        holder = next((c for c in self._on_gpu() if c.ref == holder_ref), None)
        in_flight = 0
        if holder is not None:
            try:
                in_flight = self._in_flight_seen(holder,
                                                 await self.engine(holder).in_flight() or 0)
            except EngineError as exc:  # the drain step will find out what is going on
                log.info("holder's load unknown; counted as idle",
                         extra={"device": self.gpu, "error": str(exc)})
        if in_flight:
            self._last_busy = self.clock()
        decision = switch_policy.decide(self._policy_input(holder, in_flight))
        if decision.action is switch_policy.Action.SWITCH:
            chosen = next((w for w in self._queue.values()
                           if w.claimant.ref == decision.target), None)
            if chosen is not None:
                self._rule = "home_return" if chosen.home else decision.rule
                self._decided(self._rule, chosen.claimant, decision.reason)
                return chosen.claimant.claim_uid
        now = self.clock()
        wait = (decision.recheck_at - now if decision.recheck_at is not None
                else self.policy.resync_s)
        if in_flight:  # its work can end any moment: look again soon
            wait = min(wait, BUSY_HOLDER_POLL_S)
        wait = max(0.01, min(wait, self._next_reconcile - now, self.policy.resync_s))
        log.debug("switch policy holds", extra={"device": self.gpu, "rule": decision.rule,
                                                "reason": decision.reason,
                                                "wait_s": round(wait, 3)})
        if self._dirty:  # news (a claimant changed): reconcile now, then decide again
            return None
        self._wakeup.clear()
        await wait_any(self._wakeup, stop, timeout_s=wait)
        return None

    def _measured(self, result: SwitchResult, holder: Claimant | None, target: Claimant
                  ) -> None:
        """Keep the measured costs of a finished switch per claimant."""
        if result.ok:
            self._keep_costs(result.timings, holder, target)

    def _keep_costs(self, t: Mapping[str, float], holder: Claimant | None,
                    target: Claimant) -> None:
        if holder is not None:
            cost = self._costs.get(holder.ref, switch_policy.SwitchCost())
            if "later_sleep" in t:
                cost = dataclasses.replace(cost, sleep_s=t["later_sleep"])
            self._costs[holder.ref] = cost
            if "drain" in t:
                self._drains[holder.ref] = t["drain"]
        cost = self._costs.get(target.ref, switch_policy.SwitchCost())
        if "wake_call" in t:
            cost = dataclasses.replace(cost, wake_s=t["wake_call"])
        if "probe_ttft" in t:
            cost = dataclasses.replace(cost, probe_s=t["probe_ttft"])
        self._costs[target.ref] = cost

    def _home_return(self, holder: Claimant | None) -> bool:
        """Queue the home model's return when the policy says so (nobody waits)."""
        decision = switch_policy.decide(self._policy_input(holder, 0))
        home = self._home()
        if (decision.action is not switch_policy.Action.SWITCH or home is None
                or decision.rule != "home_return"):
            return False
        self._queue.setdefault(home.claim_uid, _Waiting(home, [], since=self.clock(),
                                                        home=True))
        self._wakeup.set()
        return True

    # -- gang switches -----------------------------------------------------------------

    def _gang_blockers(self, gpus: tuple[str, ...], uid: str) -> list[str]:
        return sorted(c.ref for gpu in gpus for c in self.sibling(gpu).unsettled.values()
                      if c.claim_uid != uid)

    def _gang_begins(self, gpus: tuple[str, ...], target: Claimant) -> None:
        for gpu in gpus:
            worker = self.sibling(gpu)
            worker._switching, worker._switching_to = True, target.claim_uid

    def _gang_ends(self, gpus: tuple[str, ...], *, cut_short: bool) -> None:
        """The set's workers take work again; after a switch cut short (fenced, failed
        or cancelled) each reads its Lease anew and reconciles."""
        for gpu in gpus:
            worker = self.sibling(gpu)
            worker._switching = False
            if cut_short:
                worker.lease = None
                worker.mark_dirty()

    def _gang(self, gpus: tuple[str, ...]) -> GangSwitch:
        return GangSwitch(self.switcher, {g: self.sibling(g).lease_port for g in gpus})

    async def _serve_gang(self, waiting: _Waiting, target: Claimant,
                          holders: tuple[Claimant, ...], stop: asyncio.Event) -> None:
        """A switch that changes several GPU Leases (see :mod:`controller.lease.gang`)."""
        uid = target.claim_uid
        leases = {gpu: await self.lease_of(gpu)
                  for gpu in {*target.gpus, *(g for h in holders for g in h.gpus)}}
        gpus = gang_set(target, holders, leases)
        blockers = self._gang_blockers(gpus, uid)
        if blockers:
            self._queue.pop(uid)
            self._resolve(waiting, Activation(
                False, target, False, leases[self.gpu].fence if self.gpu in leases else 0,
                "state_unknown", f"engines on {', '.join(gpus)} are in an unknown state "
                f"(possibly awake): {', '.join(blockers)}; no wake until they are known"))
            return
        residency = [self.sibling(g)._holder_since for g in gpus
                     if leases[g].state == naming.STATE_AWAKE]
        if holders and residency:
            remaining = max(residency) + self.policy.min_residency_s - self.clock()
            if remaining > 0 and await wait_any(stop, timeout_s=remaining):
                return
        if not waiting.home and waiting.waiting() == 0:
            self._queue.pop(uid)
            self._decided("cancelled", target, "every request for it left before its wake")
            return
        self._queue.pop(uid)
        claimants = [c for c in self.claimants() if c.pod_ip and set(c.gpus) & set(gpus)]
        self._gang_begins(gpus, target)
        if self.visibility is not None:
            self.visibility.switching(holders[0] if holders else None, target)
        result: GangResult | None = None
        try:
            result = await self._gang(gpus).switch({g: leases[g] for g in gpus},
                                                   holders=holders, target=target,
                                                   claimants=claimants)
        finally:
            self._gang_ends(gpus, cut_short=result is None)
            if result is None:
                self._fenced_off(waiting, target, leases[gpus[0]].fence)
        self._gang_switched(result, holders, target)
        home = result.leases.get(self.gpu) or next(iter(result.leases.values()))
        self._resolve(waiting, Activation(result.ok, target, switched=result.ok,
                                          fence=home.fence, reason=result.reason,
                                          message=result.message, timings=result.timings))

    def _gang_switched(self, result: GangResult, holders: tuple[Claimant, ...],
                       target: Claimant, *, start: bool = False) -> None:
        """Every worker of the set takes its GPU's new Lease and shows it, and keeps the
        measured costs of the holders it had and of the target."""
        for gpu, lease in result.leases.items():
            worker = self.sibling(gpu)
            if result.ok and lease.holder == target.ref:
                # The target's own wake (a start that kept the old holders woke them,
                # not the target: their steps are not its costs).
                target_steps = {k: v for k, v in result.timings.items() if ":" not in k}
                worker._keep_costs(target_steps, None, target)
            if result.ok:
                for holder in holders:
                    if gpu in holder.gpus:
                        worker._keep_costs(holder_timings(result.timings, holder), holder,
                                           target)
            previous = worker.lease.holder if worker.lease is not None else ""
            if lease.holder != previous:
                worker._holder_since = worker._last_busy = self.clock()
            worker.lease = lease
            worker.unsettled.update({c.claim_uid: c for c in result.unsettled
                                     if gpu in c.gpus})
            if worker.unsettled:
                worker._next_reconcile = self.clock() + worker._unsettled_pauses.next_delay()
            worker.last_switch = {"ok": result.ok, "from": [h.ref for h in holders],
                                  "to": target.ref, "reason": result.reason,
                                  "fence": lease.fence, "gang": list(result.leases),
                                  "timings": {k: round(v, 6)
                                              for k, v in result.timings.items()}}
            if worker.visibility is not None:
                worker.visibility.settled(worker._on_gpu(), lease,
                                          unknown=worker.unsettled.keys())
        if self.visibility is not None:
            home = result.leases.get(self.gpu) or next(iter(result.leases.values()))
            self.visibility.switched(
                SwitchResult(result.ok, home, result.reason, result.message, result.timings,
                             result.unsettled), holders[0] if holders else None, target,
                start=start)

    def _switched(self, result: SwitchResult, holder: Claimant | None, target: Claimant,
                  *, start: bool = False) -> None:
        self.lease = result.lease
        self.last_switch = {"ok": result.ok, "from": holder.ref if holder else None,
                            "to": target.ref, "reason": result.reason,
                            "fence": result.lease.fence,
                            "timings": {k: round(v, 6) for k, v in result.timings.items()}}
        if result.lease.holder != (holder.ref if holder else ""):
            if holder is not None:
                self._used(holder.ref, self.clock() - self._holder_since)
            self._holder_since = self.clock()
            self._last_busy = self.clock()
        if result.unsettled:
            self.unsettled.update({c.claim_uid: c for c in result.unsettled})
            self._next_reconcile = self.clock() + self._unsettled_pauses.next_delay()
        if self.visibility is not None:
            self.visibility.switched(result, holder, target, start=start, rule=self._rule)
            self.visibility.settled(self._on_gpu(), result.lease, unknown=self.unsettled.keys())
        self._rule = ""

    async def _coalesce(self, holder: Claimant, stop: asyncio.Event) -> bool:
        """Let the holder finish what it is serving (up to the window) before its
        admission closes; True when the controller is stopping."""
        if self.policy.coalesce_window_s <= 0:
            return False
        try:
            busy = await until_idle(self.engine(holder), clock=self.clock, stop=stop,
                                    deadline=self.clock() + self.policy.coalesce_window_s)
        except EngineError as exc:  # the drain step will find out what is going on
            log.info("holder's load unknown; not waiting for it",
                     extra={"device": self.gpu, "error": str(exc)})
            return False
        if stop.is_set():
            return True
        if busy:
            log.info("coalescing window over; switching with work in flight",
                     extra={"device": self.gpu, "holder": holder.ref})
        return False

    async def _lease_now(self) -> GpuLease:
        """The GPU Lease now: what this worker last wrote or read when the node's Lease
        watch has seen that very version since (nobody wrote after it; no GET), else read
        from the API server. Fencing does not rest on this: every write is a
        compare-and-swap."""
        seen = self.lease_seen() if self.lease_seen is not None else None
        return confirmed(self.lease, seen) or await self.lease_port.read()

    async def _idle_check(self) -> None:
        lease = self.lease = await self._lease_now()
        if not lease.holder or lease.state != naming.STATE_AWAKE:
            if lease.state == naming.STATE_IDLE:
                self._home_return(None)
            return
        holder = next((c for c in self._on_gpu() if c.ref == lease.holder), None)
        if holder is None or holder.gpu != self.gpu:
            return  # an engine that spans GPUs is timed by the worker of its first GPU
        try:
            busy = self._in_flight_seen(holder, await self.engine(holder).in_flight() or 0)
        except EngineError as exc:
            log.info("holder's load unknown; not putting it to sleep",
                     extra={"device": self.gpu, "error": str(exc)})
            return
        if busy:
            self._last_busy = self.clock()
            return
        if self._home_return(holder):
            return
        decision = switch_policy.decide(self._policy_input(holder, 0))
        if decision.action is switch_policy.Action.SLEEP:
            self._rule = decision.rule
            self._decided(decision.rule, holder, decision.reason)
            self._switching = True
            try:
                result = await self.switcher.sleep_holder(lease, holder, reason="idle")
            finally:
                self._switching = False
            self._switched(result, holder, holder)
            for gpu in holder.gpus[1:]:  # its other GPUs' Leases still name it
                self.sibling(gpu).mark_dirty()
