"""Reconciliation of one GPU: at most one engine awake, a Lease that says who, and every
engine whose state is unknown remembered as possibly awake (see :meth:`Reconciler.run`)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.awake_set import room
from controller.lease.device import GpuSnapshot
from controller.lease.engines.errors import EngineError
from controller.lease.reconcile import ReconcilePlan, Seen, classify, plan
from controller.lease.switch import Fenced, Switcher, member_of
from controller.lease.worker.state import unsettled_backoff
from rota.api import naming
from rota.api.gpu_lease import GpuLease

if TYPE_CHECKING:
    from controller.lease.gpu import GpuWorker

log = logging.getLogger("controller.lease.gpu.reconcile")

HOLDERS = metrics.SeriesSet(metrics.HOLDER)


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class _Look:
    """What one reconciliation found and decided."""

    lease: GpuLease
    unfinished: bool
    termed: bool
    on_gpu: list[Claimant]
    snapshot: GpuSnapshot
    answers: list[bool | None]
    seen: dict[str, Seen]
    coming: Claimant | None = None
    suspects: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=dict)


class Reconciler:
    """Reconciles one GPU, under its worker's lock."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self.state = worker.state

    async def run(self) -> None:
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
        look = await self._look()
        in_set = self.worker.sets.in_effect(look.on_gpu)
        decision = plan(look.on_gpu, look.seen, look.lease.holder, suspects=look.suspects,
                        may_not_keep=await self._gangs_held_elsewhere(look.on_gpu),
                        companions=[m.uid for m in look.lease.companions] if in_set else ())
        decision = self._fitting(look, decision)
        keep = decision.keep
        asleep_holding = (keep is not None and keep.ref == look.lease.holder
                          and look.seen[keep.claim_uid] is Seen.UNKNOWN
                          and look.answers[look.on_gpu.index(keep)] is True)
        if not look.termed and (decision.put_to_sleep or asleep_holding):
            # A new fencing number first: whatever an earlier instance was doing is over,
            # and its next engine call is refused.
            look.lease = await self.worker.switcher.write(
                look.lease.new_term(self.worker.identity), look.timings)
        await self._settle(look, decision)
        if keep is not None and asleep_holding:
            look.seen[keep.claim_uid] = await self._wake_back(keep, look.lease.fence,
                                                              look.on_gpu, look.seen)
        # A suspect stays unsettled until a sleep of ours completed (it is then ASLEEP);
        # an engine granted a start that may still come up, until it is known.
        self.state.unsettled = {c.claim_uid: c for c in look.on_gpu if c is not keep
                                and c not in decision.keep_also and (
            look.seen[c.claim_uid] is Seen.UNKNOWN or c is look.coming
            or (c.claim_uid in look.suspects and c not in decision.put_to_sleep
                and look.seen[c.claim_uid] is not Seen.ABSENT))}
        await self._write(look, keep, decision.keep_also)
        self._done(look, keep, decision.keep_also)

    async def _look(self) -> _Look:
        """Read the Lease (a new term first when taking over) and every engine on the GPU."""
        state, worker = self.state, self.worker
        timings: dict[str, float] = {}
        state.dirty = False
        worker.starts.forget()
        lease = state.lease = await worker.lease_now()
        state.reconciliations += 1
        on_gpu = worker.on_gpu()
        unfinished = worker.taking_over(lease)
        termed = state.new_term or unfinished
        if termed:
            # A new fencing number before the reads, which carry it: see run().
            lease = await worker.switcher.write(lease.new_term(worker.identity), timings)
            state.new_term = False
        snapshot = await worker.switcher.snapshot(state.gpu, timings)
        answers = list(await asyncio.gather(*(self._sleeping(c, lease) for c in on_gpu)))
        seen = {c.claim_uid: classify(answer, used_bytes=snapshot.held_by(c, on_gpu),
                                      has_process=bool(snapshot.processes_of(c, on_gpu)),
                                      resident_bytes=c.resident_on(state.gpu),
                                      tolerance_bytes=worker.policy.tolerance_bytes)
                for c, answer in zip(on_gpu, answers, strict=True)}
        look = _Look(lease, unfinished, termed, on_gpu, snapshot, answers, seen,
                     timings=timings)
        look.coming = self._coming_up(lease, on_gpu, answers)
        look.suspects = {c.claim_uid for c in on_gpu if unfinished and c.model and c.model in (
            lease.target_model, lease.draining_model)} | set(state.unsettled)
        if look.coming is not None:
            look.suspects.add(look.coming.claim_uid)
        return look

    def _fitting(self, look: _Look, decision: ReconcilePlan) -> ReconcilePlan:
        """An awake set kept only as far as it fits: every companion at or under its
        awake budget + tolerance by the GPU's read, and the budgets of the holder and the
        companions (the ones woken last dropped first) within the GPU's memory. A
        companion that does not fit is put to sleep like any extra engine."""
        if not decision.keep_also or decision.keep is None:
            return decision
        tolerance = self.worker.policy.tolerance_bytes
        within = [c for c in decision.keep_also
                  if look.snapshot.held_by(c, look.on_gpu) <= c.config.awake_memory + tolerance]
        reserve = self.worker.switcher.limits.unknown_limit_bytes
        while within and not room(self.state.gpu, look.snapshot.total_bytes,
                                  awake=[decision.keep, *within], claimants=look.on_gpu,
                                  reserve_bytes=reserve).fits:
            within.pop()
        dropped = [c for c in decision.keep_also if c not in within]
        if not dropped:
            return decision
        log.warning("engines awake beside the holder do not fit the GPU on their budgets; "
                    "putting them to sleep", extra={"device": self.state.gpu,
                                                    "claims": [c.ref for c in dropped]})
        return dataclasses.replace(decision, keep_also=tuple(within),
                                   put_to_sleep=(*decision.put_to_sleep, *dropped))

    async def _settle(self, look: _Look, decision: ReconcilePlan) -> None:
        """Put every extra engine (or suspect) to sleep under the new fence."""
        for extra in decision.put_to_sleep:
            look.seen[extra.claim_uid] = await self._put_to_sleep(
                extra, look.lease.fence, look.seen[extra.claim_uid])
            for gpu in extra.gpus:  # its other GPUs' Leases may still name it
                if gpu != self.state.gpu:
                    self.worker.sibling(gpu).mark_dirty()

    async def _write(self, look: _Look, keep: Claimant | None,
                     beside: tuple[Claimant, ...] = ()) -> None:
        """Write the Lease when it does not say what was found (or a switch was cut short);
        ``beside``: the companions awake beside ``keep`` (an awake set)."""
        lease, identity = look.lease, self.worker.identity
        wanted = (keep.ref if keep else "", naming.STATE_AWAKE if keep else naming.STATE_IDLE)
        start = ((lease.start_claim_uid, lease.start_granted) if look.coming is not None
                 else ("", None))
        companions = tuple(member_of(c) for c in beside)
        if ((lease.holder, lease.state) != wanted or look.unfinished
                or lease.companions != companions
                or (lease.start_claim_uid, lease.start_granted) != start):
            if keep:
                lease = Switcher.serving(lease, keep, controller=identity,
                                         companions=companions)
            else:
                lease = lease.idle(controller=identity)
            if look.coming is not None and start[1] is not None:
                # Kept on the Lease until it is known: a next instance must know it too.
                lease = lease.granted(start[0], start[1])
            lease = await self.worker.switcher.write(lease, look.timings)
            log.info("lease reconciled", extra={"device": self.state.gpu, "holder": wanted[0],
                                                "state": wanted[1], "fence": lease.fence})
        look.lease = lease

    def _done(self, look: _Look, keep: Claimant | None,
              beside: tuple[Claimant, ...] = ()) -> None:
        """Take the reconciled Lease, show it, and schedule the next reconciliation."""
        state, gpu = self.state, self.state.gpu
        state.lease = look.lease
        visibility = self.worker.visibility
        if visibility is not None:
            visibility.settled(look.on_gpu, look.lease, unknown=state.unsettled.keys())
        HOLDERS.set(gpu, {(gpu, look.snapshot.uuid, c.ref, c.model):
                          1.0 if keep is c or c in beside else 0.0 for c in look.on_gpu})
        if state.unsettled:
            state.next_reconcile = state.clock() + state.unsettled_pauses.next_delay()
            log.warning("engines in an unknown state; no wake on this GPU until they are "
                        "known", extra={"device": gpu, "claims": sorted(
                            c.ref for c in state.unsettled.values())})
        else:
            state.unsettled_pauses = unsettled_backoff()
            state.next_reconcile = state.clock() + self.worker.policy.resync_s

    async def _sleeping(self, claimant: Claimant, lease: GpuLease) -> bool | None:
        """The claimant's ``/is_sleeping``, asked under ``lease``'s fence: the engine guard
        learns the fence from it (see :meth:`run`)."""
        if self.worker.starts.at_gate(claimant.claim_uid):
            return None  # held at its start gate: no engine runs yet
        try:
            return await self.worker.engine(claimant).fenced(
                {lease.name: lease.fence}).is_sleeping()
        except (EngineError, TimeoutError, ValueError) as exc:
            log.warning("claimant did not say whether it sleeps",
                        extra={"claim": claimant.ref, "device": self.state.gpu,
                               "error": str(exc)})
            return None

    def _coming_up(self, lease: GpuLease, on_gpu: list[Claimant],
                   answers: list[bool | None]) -> Claimant | None:
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
        if self.worker.starts.at_gate(uid):
            return None
        extra = {"device": self.state.gpu, "claim": newcomer.ref,
                 "granted": granted.isoformat()}
        if _utc_now() >= granted + dt.timedelta(seconds=self.worker.starts.limit_s()):
            log.warning("a start granted earlier did not come up within its limit; its "
                        "engine is judged by what the GPU shows", extra=extra)
            return None
        log.warning("an engine granted a start may still come up; no wake on this GPU "
                    "until it answers, its container restarts or its start's limit passes",
                    extra=extra)
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
        extra = {"claim": holder.ref, "device": self.state.gpu}
        switcher = self.worker.switcher
        try:
            problem = await switcher.check_device(holder, on_gpu, timings)
            if problem is None:
                await switcher.wake_and_probe(holder, fence, timings)
        except Fenced:
            raise
        except Exception as exc:
            log.error("could not wake back a holder that sleeps holding its memory",
                      extra={**extra, "error": str(exc)})
            return Seen.UNKNOWN
        if problem is not None:
            log.warning("a holder sleeps holding its memory; not woken back",
                        extra={**extra, "reason": problem.reason, "error": problem.message})
            return Seen.UNKNOWN
        metrics.RECONCILES.labels("woken_back").inc()
        log.warning("the holder slept without handing its memory back; woken back",
                    extra={**extra, "model": holder.model})
        return Seen.AWAKE

    async def _gangs_held_elsewhere(self, on_gpu: list[Claimant]) -> set[str]:
        """Claim uids of the engines on this GPU that span GPUs and that the Lease of one
        of their other GPUs does not name: such an engine may not keep this GPU (it is
        awake only as the holder of all of them), and is put to sleep if awake."""
        barred: set[str] = set()
        for claimant in on_gpu:
            for gpu in claimant.gpus:
                if gpu != self.state.gpu and (
                        await self.worker.lease_of(gpu)).holder != claimant.ref:
                    barred.add(claimant.claim_uid)
                    break
        return barred

    async def _put_to_sleep(self, claimant: Claimant, fence: int, was: Seen) -> Seen:
        log.warning("engine awake (or possibly awake) beside the holder; putting it to sleep",
                    extra={"device": self.state.gpu, "claim": claimant.ref, "seen": str(was)})
        if not await self.worker.switcher.settle(claimant, fence, {}):
            log.error("could not put an engine to sleep; it stays possibly awake",
                      extra={"claim": claimant.ref, "device": self.state.gpu})
            return Seen.UNKNOWN
        metrics.RECONCILES.labels("two_awake" if was is Seen.AWAKE else str(was)).inc()
        return Seen.ASLEEP
