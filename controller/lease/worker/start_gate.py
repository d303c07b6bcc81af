"""Start-up admission at one GPU's worker: the engines waiting at their start gates (one
long poll each), which of them really starts (a gate asks once per run of its
container), the back-off between the starts of one claim, and the start itself (see
:mod:`controller.lease.admission`)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from controller.claimants import Claimant
from controller.lease.admission import StartLimits, StartTicket
from controller.lease.gang import holders_of
from controller.lease.switch import SwitchResult
from rota.api import naming
from rota.kit.aio import Backoff

if TYPE_CHECKING:
    from controller.lease.gpu import GpuWorker

log = logging.getLogger("controller.lease.gpu.starts")

START_QUIET_S = 600.0
"""A claim with no start for this long (after its back-off allowed one) starts its
back-off over."""


def start_backoff() -> Backoff:
    """After each start of a claim, failed or not, its next start waits this long
    (growing, jittered): a crash-looping engine, or a tenant that restarts its container
    again and again, must not keep the holder asleep; the holder serves its waiters
    between. Starts over after :data:`START_QUIET_S` without a start."""
    return Backoff(first_s=5.0, max_s=300.0)


def run_of(claimant: Claimant) -> tuple[str | None, int]:
    """Which run of the claimant's container this is: its pod and the restarts of the
    pod's containers. A start gate is granted once per run: the gate asks again only
    when its container (re)starts, so a question from a run whose engine came up is not
    an engine starting (it is a tenant asking with its own token)."""
    return claimant.pod_uid, claimant.restarts


class StartGate:
    """The start gates waiting at one GPU's worker, and their starts."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self.state = worker.state
        self.tickets: dict[str, StartTicket] = {}
        self.backoff: dict[str, tuple[float, Backoff]] = {}
        """Claims started before: their next start not before this time, and its pauses."""
        self.started: dict[str, tuple[str | None, int]] = {}
        """The run (:func:`run_of`) of each claim's container whose engine came up in a
        start: its gate is not granted again in that run."""

    # -- the gates' polls --------------------------------------------------------------

    async def request(self, claimant: Claimant, *, hold_s: float) -> bool:
        """One long poll of ``claimant``'s start gate: True when it may start now; False
        when it should ask again (held up to ``hold_s``)."""
        if not self.state.accepting or self.worker.starter is None:
            return False
        now = self.state.clock()
        ticket = self.tickets.get(claimant.claim_uid)
        if ticket is not None and ticket.granted:
            # Its container was granted a start and asks again: it exited and restarted.
            ticket.restarted.set()
            ticket = None
        if ticket is None:
            ticket = self._arrived(claimant, now)
        poll = ticket.attach(now)
        done, _ = await asyncio.wait({poll}, timeout=hold_s)
        if not done:
            if ticket.poll is poll:
                ticket.poll = None
            poll.cancel()
            return False
        return poll.result()

    def _arrived(self, claimant: Claimant, now: float) -> StartTicket:
        ticket = StartTicket(claimant.claim_uid, created=now, last_poll=now)
        self.tickets[claimant.claim_uid] = ticket
        extra = {"device": self.state.gpu, "claim": claimant.ref}
        if not self.really_starting(claimant.claim_uid):
            log.warning("a start gate asks again in the run of its container whose "
                        "engine came up; held until its container restarts",
                        extra={**extra, "restarts": claimant.restarts})
        log.info("engine waiting at the start gate", extra={**extra, "model": claimant.model})
        if self.worker.visibility is not None:
            lease = self.state.lease
            self.worker.visibility.start_waiting(claimant, lease.holder if lease else "")
        self.state.wakeup.set()
        return ticket

    def refuse_all(self) -> None:
        for ticket in self.tickets.values():
            ticket.refuse()

    # -- which starts wait, and when they may go ---------------------------------------

    def forget(self) -> None:
        """Drop the start spacing and the started runs of claims that are no longer
        claimants (a reconcile follows every change of them): without this, both maps
        grew with every claim the node ever had."""
        current = {c.claim_uid for c in self.worker.claimants()} | set(self.tickets)
        for uid in [u for u in self.backoff if u not in current]:
            del self.backoff[uid]
        for uid in [u for u in self.started if u not in current]:
            del self.started[uid]

    def allowed_at(self, uid: str) -> float:
        return self.backoff[uid][0] if uid in self.backoff else 0.0

    def really_starting(self, uid: str) -> bool:
        """Whether the claim's container is in a run (:func:`run_of`) whose engine has not
        come up in a start yet: only then does its gate's question mean an engine waits
        to start (a gate asks once per run of its container)."""
        claimant = next((c for c in self.worker.claimants() if c.claim_uid == uid), None)
        return claimant is None or self.started.get(uid) != run_of(claimant)

    def at_gate(self, uid: str) -> bool:
        """The claim's container waits at its start gate, asking this instance: no engine
        of it runs."""
        ticket = self.tickets.get(uid)
        return ticket is not None and not ticket.granted and self.really_starting(uid)

    def ready(self) -> str | None:
        """The first waiting start of an engine really starting that its back-off lets
        through now."""
        now = self.state.clock()
        return next((uid for uid in self.tickets if self.allowed_at(uid) <= now
                     and self.really_starting(uid)), None)

    def next_at(self) -> float:
        """When the next waiting start may be served (a container that restarts changes
        the claimants, which wakes the worker)."""
        return min((self.allowed_at(uid) for uid in self.tickets
                    if self.really_starting(uid)), default=float("inf"))

    def limit_s(self) -> float:
        """How long after its grant a start may still bring its engine up: the grant's
        wait for the gate's poll and the start's own limit."""
        starter = self.worker.starter
        limits = starter.limits if starter is not None else StartLimits()
        return limits.grant_s + limits.start_s

    # -- a start -----------------------------------------------------------------------

    async def serve(self) -> None:
        """Serve the first start :meth:`ready` lets through (or refuse it: its gate or
        claim went away, or engines in an unknown state stand in the way)."""
        worker = self.worker
        assert worker.starter is not None
        uid = self.ready()
        assert uid is not None
        ticket = self.tickets[uid]
        newcomer = next((c for c in worker.claimants() if c.claim_uid == uid), None)
        stale = self.state.clock() - ticket.last_poll > 2 * worker.starter.limits.grant_s
        if newcomer is None or newcomer.gpu != worker.gpu or (stale and ticket.poll is None):
            self.tickets.pop(uid, None)  # the gate went away, or so did the claim
            ticket.refuse()
            return
        blockers = self.state.blockers(uid)
        if blockers:
            self.held(uid, ticket, newcomer, blockers, device=worker.gpu)
            return
        if self.state.lease is None:
            self.state.lease = await worker.lease_port.read()
        leases = {gpu: await worker.lease_of(gpu) for gpu in newcomer.gpus}
        gang_holders = holders_of(newcomer, leases, worker.claimants())
        if worker.gang_needed(newcomer, gang_holders):
            await worker.gangs.start(ticket, newcomer, gang_holders)
            return
        await self._start(ticket, newcomer)

    async def _start(self, ticket: StartTicket, newcomer: Claimant) -> None:
        """A start on this GPU alone: the holder (if awake) sleeps while it comes up."""
        worker, state, uid = self.worker, self.state, newcomer.claim_uid
        assert worker.starter is not None
        assert state.lease is not None
        lease = state.lease
        on_gpu = [c for c in worker.on_gpu() if c.claim_uid != uid]
        holder = next((c for c in on_gpu if c.ref == lease.holder), None)
        if lease.state != naming.STATE_AWAKE:
            holder = None
        stay: tuple[Claimant, ...] = ()
        also: tuple[Claimant, ...] = ()
        if worker.sets.in_effect([*on_gpu, newcomer]):
            # an awake set: only the members it needs room for sleep while it comes up
            planned = await worker.sets.plan(newcomer, lease, [*on_gpu, newcomer])
            holder = planned.sleep[-1] if planned.sleep else None
            stay, also = planned.stay, planned.sleep[:-1]
        state.switching, state.switching_to = True, uid
        if worker.visibility is not None:
            worker.visibility.switching(holder, newcomer, starting=True)
            worker.visibility.displacing(also)
        result: SwitchResult | None = None
        try:
            result = await worker.starter.start(
                lease, holder=holder, newcomer=newcomer, claimants=on_gpu, ticket=ticket,
                wanted=lambda: uid in worker.queue, stay=stay, also_sleep=also)
        finally:
            state.switching = False
            self.ended(uid, ticket, refused=result is None)
        worker.outcomes.switched(result, holder, newcomer, start=True, also_slept=also)
        self.done(newcomer, ok=result.ok, reason=result.reason,
                  came_up="start" in result.timings)

    def held(self, uid: str, ticket: StartTicket, newcomer: Claimant, blockers: list[str],
             *, device: str) -> None:
        """Refuse a start while engines in an unknown state stand in its way."""
        self.tickets.pop(uid, None)
        ticket.refuse()
        log.warning("start held: engines on the GPU are in an unknown state",
                    extra={"device": device, "claim": newcomer.ref, "blockers": blockers})

    def ended(self, uid: str, ticket: StartTicket, *, refused: bool) -> None:
        """A start's ticket is done; one cut short (fenced, failed or cancelled) is
        refused, and the GPU reconciles."""
        if self.tickets.get(uid) is ticket:
            self.tickets.pop(uid)
        if refused:
            ticket.refuse()
            self.state.dirty = True

    def done(self, newcomer: Claimant, *, ok: bool, reason: str, came_up: bool) -> None:
        """After a start of ``newcomer``: its run is not granted again once its engine
        came up, and its next start waits (:func:`start_backoff`), whatever the outcome:
        a start puts the holder to sleep, and a successful one must not buy the next."""
        uid = newcomer.claim_uid
        now = self.state.clock()
        if came_up:
            self.started[uid] = run_of(newcomer)
        allowed_at, pauses = self.backoff.get(uid, (now, start_backoff()))
        if now - allowed_at > START_QUIET_S:
            pauses.reset()
        pause = pauses.next_delay()
        self.backoff[uid] = (now + pause, pauses)
        log.log(logging.INFO if ok else logging.WARNING,
                "start done; the claim's next start waits" if ok
                else "start failed; its next attempt waits",
                extra={"device": self.state.gpu, "claim": newcomer.ref,
                       "reason": reason or None, "pause_s": round(pause, 1)})
