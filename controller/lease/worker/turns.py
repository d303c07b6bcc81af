"""The turn loop of one GPU: which queued claim is served next (the switch policy's
decision), what stands before its switch (answered at once, engines in an unknown state,
the holder's minimum residency and coalescing window, callers who left), and the switch
itself, run in one place: :meth:`TurnLoop.switch`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.engines.errors import EngineError
from controller.lease.gang import holders_of
from controller.lease.in_flight import until_idle
from controller.lease.switch import SwitchResult
from controller.lease.worker.callers import Waiting
from controller.lease.worker.state import Activation
from rota.api import naming
from rota.api.gpu_lease import GpuLease

if TYPE_CHECKING:
    from controller.lease.gpu import GpuWorker

log = logging.getLogger("controller.lease.gpu.turns")

BUSY_HOLDER_POLL_S = 0.25
"""While somebody waits and the policy keeps a busy holder awake, how often the holder's
work is read again: it gives way (``holder_idle``) soon after its last request ends, not
at the end of its quantum."""


@dataclass
class Turn:
    """One switch the turn loop is about to run: whom it serves, on what the policy
    decided it, and what it switches from."""

    waiting: Waiting
    target: Claimant
    decision: switch_policy.Decision | None
    """The policy's decision (None: served without asking, e.g. already its holder)."""
    lease: GpuLease
    """This GPU's Lease as the worker last wrote or read it."""
    holder: Claimant | None
    """The claim the Lease names (awake or not); see :attr:`awake_holder`."""
    on_gpu: list[Claimant]
    gpus: tuple[str, ...] = ()
    """The GPUs of a gang switch (:mod:`controller.lease.gang`); () for this GPU alone."""
    holders: tuple[Claimant, ...] = ()
    """A gang switch's holders, to be put to sleep."""
    leases: dict[str, GpuLease] = field(default_factory=dict)
    """A gang switch's Leases, per GPU."""
    in_set: bool = False
    """An awake set is in effect: ``holder`` is the member put to sleep for the target
    (None: it fits beside them all), ``stay`` the members that stay awake and
    ``also_sleep`` the further members put to sleep first."""
    stay: tuple[Claimant, ...] = ()
    also_sleep: tuple[Claimant, ...] = ()

    @property
    def awake_holder(self) -> Claimant | None:
        """The holder a switch of this GPU alone puts to sleep (None when it is idle)."""
        if self.in_set:
            return self.holder
        return self.holder if self.lease.state != naming.STATE_IDLE else None


class TurnLoop:
    """Serves the callers queued at one GPU's worker, one switch at a time."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self.state = worker.state
        self.queue = worker.queue
        self.view = worker.view

    # -- whom to serve -----------------------------------------------------------------

    async def pick(self, stop: asyncio.Event
                   ) -> tuple[str, switch_policy.Decision | None] | None:
        """The queued claim to serve now and the policy's decision for it (None when
        answered without asking it); None when the policy holds (this waits until its
        next look, or until news)."""
        self._queue_frozen()
        for gone in self.queue.abandoned():  # every caller left: no switch for them
            self.view.decided("cancelled", gone.claimant, "every request for it left")
        if not self.queue:
            return None
        serving = {c.claim_uid for c in self.worker.claimants() if c.serving}
        holder_ref = self.state.awake_holder()
        companions = {m.uid for m in self.state.lease.companions} if self.state.lease else set()
        for uid, w in self.queue.entries.items():
            if uid not in serving or w.claimant.ref == holder_ref or uid in companions:
                return uid, None  # answered at once (not serving, or already awake)
        joining = await self._fits_beside()
        if joining is not None:
            return joining, None  # an awake set has room for it: nobody is displaced
        holder = next((c for c in self.worker.on_gpu() if c.ref == holder_ref), None)
        holder = await self._displaced(serving) or holder
        in_flight = await self._holder_load(holder)
        decision = self.view.decide(holder, in_flight)
        if decision.action is switch_policy.Action.SWITCH:
            chosen = self.queue.by_ref(decision.target)
            if chosen is not None:
                self.state.rule = "home_return" if chosen.home else decision.rule
                self.view.decided(self.state.rule, chosen.claimant, decision.reason)
                return chosen.claimant.claim_uid, decision
        await self._hold(decision, in_flight, stop)
        return None

    async def _fits_beside(self) -> str | None:
        """With an awake set in effect, the first queued claim that fits awake beside
        every member (nobody is put to sleep for it, so no policy is asked); None when
        none does."""
        on_gpu = self.worker.on_gpu()
        lease = self.state.lease
        if lease is None or not self.worker.sets.in_effect(on_gpu) or self.state.unsettled:
            return None
        serving = {c.claim_uid: c for c in on_gpu if c.serving}
        for uid in self.queue.entries:
            claimant = serving.get(uid)
            if claimant is not None and await self.worker.sets.fits_beside(claimant, lease,
                                                                            on_gpu):
                return uid
        return None

    async def _displaced(self, serving: set[str]) -> Claimant | None:
        """With an awake set in effect, the member the first queued claim would put to
        sleep (the one its switch drains or preempts): the policy weighs that member's
        work, not the Lease holder's, which may stay awake beside the newcomer. None:
        no set, or nobody displaced."""
        lease, on_gpu = self.state.lease, self.worker.on_gpu()
        if lease is None or not self.worker.sets.in_effect(on_gpu):
            return None
        first = next((w.claimant for uid, w in self.queue.entries.items() if uid in serving),
                     None)
        if first is None:
            return None
        planned = await self.worker.sets.plan(first, lease, on_gpu)
        return planned.sleep[-1] if planned.sleep else None

    def _queue_frozen(self) -> None:
        """Engines of this GPU asleep with requests kept wait for their wake as callers
        do: queued, the policy wakes them by its bounds (``freeze_bound``) even when no
        new request asks for them (otherwise their streams would stay frozen until one
        did)."""
        freezes = self.view.freezes
        if freezes is None:
            return
        holder = self.state.awake_holder()
        on_gpu = {c.claim_uid: c for c in self.worker.on_gpu()}
        self.queue.keep_frozen({
            uid: (on_gpu[uid], frozen.since) for uid, frozen in freezes.all().items()
            if frozen.kept > 0 and uid in on_gpu and on_gpu[uid].serving
            and on_gpu[uid].ref != holder})

    async def _holder_load(self, holder: Claimant | None) -> int:
        if holder is None:
            return 0
        try:
            return await self.worker.work.load(holder, self.worker.engine(holder))
        except EngineError as exc:  # the drain step will find out what is going on
            log.info("holder's load unknown; counted as idle",
                     extra={"device": self.state.gpu, "error": str(exc)})
            return 0

    async def _hold(self, decision: switch_policy.Decision, in_flight: int,
                    stop: asyncio.Event) -> None:
        """The policy holds: wait until its next look (soon while the holder is busy: its
        work can end any moment), the next reconciliation, or news."""
        now = self.state.clock()
        resync_s = self.worker.policy.resync_s
        wait = decision.recheck_at - now if decision.recheck_at is not None else resync_s
        if in_flight:
            wait = min(wait, BUSY_HOLDER_POLL_S)
        wait = max(0.01, min(wait, self.state.next_reconcile - now, resync_s))
        log.debug("switch policy holds", extra={"device": self.state.gpu,
                                                "rule": decision.rule,
                                                "reason": decision.reason,
                                                "wait_s": round(wait, 3)})
        if self.state.dirty:  # news (a claimant changed): reconcile now, then decide again
            return
        self.state.wakeup.clear()
        await self.worker.wait(stop, timeout_s=wait)

    # -- what stands before the switch -------------------------------------------------

    async def serve_next(self, stop: asyncio.Event) -> None:
        """Serve the claim the policy picks: answer it, or run its switch."""
        picked = await self.pick(stop)
        if picked is None:
            return
        uid, decision = picked
        waiting = self.queue.entries[uid]
        target = next((c for c in self.worker.claimants() if c.claim_uid == uid), None)
        if target is None or not target.serving:
            self.queue.take(uid)
            self.queue.resolve(waiting, Activation(
                False, waiting.claimant, False, 0, "not_serving",
                f"{waiting.claimant.ref} has no running, ready pod on this node"))
            return
        turn = await self._turn(waiting, target, decision)
        if turn is None or await self._held_back(turn, stop):
            return
        if not waiting.wanted():
            self.queue.take(uid)
            self.view.decided("cancelled", target, "every request for it left before its wake")
            return
        await self.switch(turn)

    async def _turn(self, waiting: Waiting, target: Claimant,
                    decision: switch_policy.Decision | None) -> Turn | None:
        """The switch to ``target`` as it stands, or None when ``waiting`` was answered
        now (already the awake holder, or engines in an unknown state in the way)."""
        worker, uid = self.worker, target.claim_uid
        # The Lease as this worker last wrote or read it: a writer that moved it since
        # makes the switch's first compare-and-swap fail (Fenced: reconcile, then retry).
        if self.state.lease is None:
            self.state.lease = await worker.lease_port.read()
        lease = self.state.lease
        on_gpu = worker.on_gpu()
        holder = next((c for c in on_gpu if c.ref == lease.holder), None)
        leases = {gpu: await worker.lease_of(gpu) for gpu in target.gpus}
        if all(v.holder == target.ref and v.state == naming.STATE_AWAKE
               for v in leases.values()) or any(m.uid == uid for m in lease.companions):
            # Already the awake holder: nothing is woken, so engines in an unknown state
            # elsewhere on the GPU do not stand in its way.
            self.queue.take(uid)
            self.queue.resolve(waiting, Activation(True, target, False, lease.fence))
            return None
        blockers = self.state.blockers(uid)
        if blockers:
            self.queue.take(uid)
            self.queue.resolve(waiting, Activation(
                False, target, False, lease.fence, "state_unknown",
                f"engines on {self.state.gpu} are in an unknown state (possibly awake): "
                f"{', '.join(blockers)}; no wake until they are known"))
            return None
        if worker.sets.in_effect(on_gpu):
            planned = await worker.sets.plan(target, lease, on_gpu)
            victim = planned.sleep[-1] if planned.sleep else None
            return Turn(waiting, target, decision, lease, victim, on_gpu, in_set=True,
                        stay=planned.stay, also_sleep=planned.sleep[:-1])
        turn = Turn(waiting, target, decision, lease, holder, on_gpu)
        gang_holders = holders_of(target, leases, worker.claimants())
        if worker.gang_needed(target, gang_holders):
            return await worker.gangs.turn(turn, gang_holders)
        return turn

    async def _held_back(self, turn: Turn, stop: asyncio.Event) -> bool:
        """Wait out the holder's minimum residency, then (one GPU) let it finish what it
        serves up to the coalescing window; True when the controller is stopping."""
        worker = self.worker
        if turn.gpus:
            awake = [worker.sibling(g).work.holder_since for g in turn.gpus
                     if turn.leases[g].state == naming.STATE_AWAKE]
            since = max(awake) if turn.holders and awake else None
        elif turn.holder is not None and turn.lease.state == naming.STATE_AWAKE:
            since = worker.work.holder_since
        else:
            return False
        if since is not None:
            remaining = since + worker.policy.min_residency_s - self.state.clock()
            if remaining > 0:
                log.info("holding the switch for minimum residency", extra={
                    "device": self.state.gpu, "holder": turn.lease.holder,
                    "wait_s": round(remaining, 3)})
                if await worker.wait(stop, timeout_s=remaining, news=False):
                    return True
        if turn.gpus or turn.holder is None:
            return False
        return await self.coalesce(turn.holder, stop)

    async def coalesce(self, holder: Claimant, stop: asyncio.Event) -> bool:
        """Let the holder finish what it is serving (up to the window) before its
        admission closes; True when the controller is stopping."""
        window_s = self.worker.policy.coalesce_window_s
        if window_s <= 0:
            return False
        clock = self.state.clock
        try:
            busy = await until_idle(self.worker.engine(holder), clock=clock, stop=stop,
                                    deadline=clock() + window_s)
        except EngineError as exc:  # the drain step will find out what is going on
            log.info("holder's load unknown; not waiting for it",
                     extra={"device": self.state.gpu, "error": str(exc)})
            return False
        if stop.is_set():
            return True
        if busy:
            log.info("coalescing window over; switching with work in flight",
                     extra={"device": self.state.gpu, "holder": holder.ref})
        return False

    # -- the switch --------------------------------------------------------------------

    async def switch(self, turn: Turn) -> None:
        """Run the switch a turn decided on, and answer its callers: the one place where
        the turn loop acts on the policy's decision (``turn.decision``). A switch that
        spans GPUs runs through :meth:`controller.lease.worker.gangs.GangEntry.switch`."""
        if turn.gpus:
            await self.worker.gangs.switch(turn)
            return
        worker, state, target = self.worker, self.state, turn.target
        self.queue.take(target.claim_uid)
        state.switching, state.switching_to = True, target.claim_uid
        if worker.visibility is not None:
            worker.visibility.switching(turn.awake_holder, target)
            worker.visibility.displacing(turn.also_sleep)
        result: SwitchResult | None = None
        try:
            # preemptive only where the policy decided so (a holder that keeps requests;
            # in an awake set, the policy weighed the member put to sleep: _displaced)
            preempt = bool(turn.decision and turn.decision.preempt)
            result = await worker.switcher.switch(
                turn.lease, holder=turn.awake_holder, target=target, claimants=turn.on_gpu,
                preempt=preempt, stay=turn.stay, also_sleep=turn.also_sleep)
            worker.work.measured(result, turn.awake_holder, target)
        finally:
            state.switching = False
            if result is None:  # fenced, failed or cancelled: reconcile, then again
                self.fenced_off(turn.waiting, target, turn.lease.fence)
        worker.outcomes.switched(result, turn.holder, target, also_slept=turn.also_sleep)
        self.queue.resolve(turn.waiting, Activation(
            result.ok, target, switched=result.ok, fence=result.lease.fence,
            reason=result.reason, message=result.message, timings=result.timings))
        self._queue_frozen()  # a holder this switch froze waits for its wake from now on

    def fenced_off(self, waiting: Waiting, target: Claimant, fence: int) -> None:
        """A switch ended by fencing (another writer moved a Lease, or leadership went):
        its waiters queue again, at the front, to be served after reconciliation, a
        bounded number of times; then (or when this worker no longer takes work) they
        are answered."""
        state = self.state
        state.dirty = True
        if state.accepting and waiting.fenced < self.worker.policy.fenced_retries:
            waiting.fenced += 1
            self.queue.to_front(waiting)
            return
        reason, message = (("interrupted", "the switch was cut short (fenced off, or the "
                            "controller stopping)") if state.accepting else state.closed)
        self.queue.resolve(waiting, Activation(False, target, False, fence, reason, message))
