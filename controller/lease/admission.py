"""Start-up admission: an engine's start is a switch into it.

An engine that starts through rota's start gate (:mod:`controller.engine_gate`) waits
before it initialises anything on the GPU until its node's lease controller grants it a
start slot. The grant comes at the point of a switch where the target would be woken:

1. the GPU Lease says ``starting`` (its fencing number goes up), so gateways hold both
   models' requests;
2. the holder, if any, drains and sleeps, confirmed by ``/is_sleeping``;
3. the GPU is read: the holder is down to its resident footprint, no unknown process
   holds memory, and free memory covers the newcomer's awake budget;
4. the gate is told to go: the engine process starts and initialises with the GPU to
   itself (the reference experiment's order: test A, put A to sleep, then initialise B);
5. the controller waits (bounded by ``start_s``) until the engine answers ``/health``,
   and proves it with the correctness request;
6. the newcomer is put to sleep once: its first level-1 sleep pins host buffers and is
   slow (24.7 s for a 26.5 GB model on an H200), and no user-driven handoff should pay it;
7. policy decides who stays awake: the newcomer when requests already wait for it or the
   GPU had no holder, else the old holder, woken back (after the GPU read of step 3
   again) and proved.

A newcomer that does not come up (its container exits, or ``start_s`` passes) fails the
start: once the GPU shows its memory gone (or it is confirmed asleep), the old holder is
woken back. A container that restarts goes through the gate again, so an engine that
crashed never comes up awake beside the holder.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from controller.claimants import Claimant
from controller.lease.switch import (
    Fenced,
    SleepUnknown,
    Switcher,
    SwitchFailed,
    SwitchResult,
    reason_of,
    staying,
)
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.aio import Backoff

log = logging.getLogger(__name__)

LeaseWrite = Callable[[str, GpuLease], Awaitable[GpuLease]]
"""A compare-and-swap write of one GPU's Lease (:class:`Fenced` when it moved on)."""


@dataclass
class StartTicket:
    """One engine container waiting at the start gate.

    The gate long-polls; each poll is a future that the worker resolves with True (go) or
    that times out (the gate polls again). A poll that arrives after the grant was handed
    over is the container starting again: the engine that was granted is gone.
    """

    claim_uid: str
    created: float
    last_poll: float
    poll: asyncio.Future[bool] | None = None
    granted: bool = False
    restarted: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the container asked again after its grant (it exited and restarted)."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by every new poll (the grant waits for one when none is attached)."""

    def attach(self, now: float) -> asyncio.Future[bool]:
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(False)  # superseded by the newer poll of the same gate
        self.poll = asyncio.get_running_loop().create_future()
        self.last_poll = now
        self.arrived.set()
        return self.poll

    async def grant(self, timeout_s: float) -> bool:
        """Hand the go to the gate's current (or next) poll; False when no poll came."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.poll is None or self.poll.done():
                    self.arrived.clear()
                    await self.arrived.wait()
        except TimeoutError:
            return False
        assert self.poll is not None
        self.poll.set_result(True)
        self.granted = True
        return True

    def refuse(self) -> None:
        """Answer the current poll with "not now" (the gate polls again)."""
        if self.poll is not None and not self.poll.done():
            self.poll.set_result(False)


@dataclass(frozen=True)
class StartLimits:
    start_s: float = 900.0
    """From the grant until the engine answers ``/health``."""
    grant_s: float = 30.0
    """How long a grant waits for the gate's next poll."""
    gone_s: float = 60.0
    """After a failed start, how long to wait for the GPU to show the newcomer's memory
    gone before giving up on waking the old holder back."""


class StartSwitch:
    """Runs starts for one GPU on a :class:`~controller.lease.switch.Switcher`'s steps."""

    def __init__(self, switcher: Switcher, *, limits: StartLimits,
                 claimant_of: Callable[[str], Claimant | None]) -> None:
        self.sw = switcher
        self.limits = limits
        self.claimant_of = claimant_of

    async def start(self, lease: GpuLease, *, holder: Claimant | None, newcomer: Claimant,
                    claimants: Sequence[Claimant], ticket: StartTicket,
                    wanted: Callable[[], bool], stay: Sequence[Claimant] = (),
                    also_sleep: Sequence[Claimant] = ()) -> SwitchResult:
        """Admit ``newcomer`` (see the module docstring); ``wanted()`` says whether
        requests wait for it when policy decides who stays awake. An awake set: ``stay``
        are the members that stay awake through the start, ``holder`` and ``also_sleep``
        the members put to sleep for it (as in :meth:`Switcher.switch`)."""
        sw = self.sw
        timings: dict[str, float] = {}
        begin = sw.ports.clock()
        lease = await sw.begin(lease, naming.LeaseState.STARTING, holder=holder, target=newcomer,
                               timings=timings, stay=stay)
        fence = lease.fence
        if also_sleep:
            failed = await sw.sleep_also(lease, holder, also_sleep, timings)
            if failed is not None:
                ticket.refuse()
                sw.ports.observer.started("refused")
                return failed
        log.info("start-up admission", extra={"device": lease.device, "fence": fence,
                                              "claim": newcomer.ref, "model": newcomer.model,
                                              "holder": holder.ref if holder else None})
        try:
            if holder is not None:
                await sw.drain(holder, fence, timings)
            problem = await sw.hand_back(holder, newcomer, claimants, fence, timings,
                                         starting=True, awake=staying(lease, claimants))
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
            lease = await self.record_grant(sw, lease, newcomer, timings)
            await self.hand_over(newcomer, ticket)
        except Fenced:
            ticket.refuse()
            raise
        except SleepUnknown as exc:
            ticket.refuse()
            sw.ports.observer.started("refused")
            return await sw.unsettled(lease, exc, timings)
        except Exception as exc:
            ticket.refuse()
            sw.ports.observer.started("refused")
            return await sw.restore(lease, holder, exc, timings, claimants)
        granted_at = sw.ports.clock()
        timings["admit"] = granted_at - begin
        try:
            started = await self.until_up(newcomer, ticket, fence, timings)
            timings["start"] = sw.ports.clock() - granted_at
            sw.ports.observer.start_took(newcomer.model, timings["start"])
            await sw.probe(started, fence, timings)
            await sw.sleep(started, fence, timings)  # the first sleep, before any user
        except Fenced:
            raise
        except SleepUnknown as exc:
            sw.ports.observer.started("failed")
            return await sw.unsettled(lease, exc, timings)
        except Exception as exc:
            sw.ports.observer.started("failed")
            return await self._failed(lease, holder, newcomer, claimants, exc, timings)
        sw.ports.observer.started("ok")
        keeper = newcomer if holder is None or wanted() else holder
        keeper = self.claimant_of(keeper.claim_uid) or keeper
        try:
            problem = await sw.check_device(keeper, [c for c in claimants if c is not keeper]
                                            + [started], timings,
                                            awake=staying(lease, claimants))
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
            await sw.wake_and_probe(keeper, fence, timings)
        except Fenced:
            raise
        except Exception as exc:
            reason, message = reason_of(exc), str(exc) or type(exc).__name__
            return await sw.fail(lease, reason, f"{newcomer.ref} started and sleeps; waking "
                                 f"{keeper.ref} failed: {message}", restored=None,
                                 timings=timings)
        lease = await sw.write(sw.serving(lease, keeper, companions=lease.companions), timings)
        timings["total"] = sw.ports.clock() - begin
        log.info("started, slept once, and the GPU goes on", extra={
            "device": lease.device, "fence": fence, "claim": newcomer.ref,
            "holder": keeper.ref, "timings": {k: round(v, 4) for k, v in timings.items()}})
        return SwitchResult(True, lease, timings=timings)

    async def record_grant(self, sw: Switcher, lease: GpuLease, newcomer: Claimant,
                           timings: dict[str, float]) -> GpuLease:
        """:meth:`record_grants` on the one GPU of ``lease``; returns it as written."""
        async def write(_gpu: str, record: GpuLease) -> GpuLease:
            return await sw.write(record, timings)

        return (await self.record_grants({lease.device: lease}, write,
                                         newcomer))[lease.device]

    @staticmethod
    async def record_grants(leases: Mapping[str, GpuLease], write: LeaseWrite,
                            newcomer: Claimant) -> dict[str, GpuLease]:
        """Record the go of ``newcomer``'s start gate (:meth:`GpuLease.granted`, one time
        for all) on each of ``leases`` (GPU to Lease; a gang start's set, in GPU order)
        by a compare-and-swap write, which is the grant's fencing check on that GPU;
        then :meth:`hand_over`. An instance that takes over after this point learns, on
        every GPU where the engine may come up awake, that it may be coming, and wakes
        nobody beside it until the engine is known (see :mod:`controller.lease.gpu`).
        Returns the Leases as written: the start's next writes, a failed hand-over's
        included, go on from them."""
        at = dt.datetime.now(dt.UTC)
        return {gpu: await write(gpu, lease.granted(newcomer.claim_uid, at))
                for gpu, lease in leases.items()}

    async def hand_over(self, newcomer: Claimant, ticket: StartTicket) -> None:
        """Give the gate its go; :class:`SwitchFailed` when it does not come back for it
        within ``grant_s`` (it then never started its engine)."""
        if not await ticket.grant(self.limits.grant_s):
            raise SwitchFailed("start_not_taken", f"the start gate of {newcomer.ref} did not "
                               f"come back for its grant within {self.limits.grant_s:.0f} s")

    async def until_up(self, newcomer: Claimant, ticket: StartTicket, fence: int,
                        timings: dict[str, float]) -> Claimant:
        """The newcomer once it answers ``/health``; raises when it is not coming."""
        deadline = self.sw.ports.clock() + self.limits.start_s
        pauses = Backoff(first_s=0.05, max_s=2.0)
        while True:
            if ticket.restarted.is_set():
                raise SwitchFailed("start_failed", f"{newcomer.ref} exited during its start "
                                   "(its container asked the start gate again)")
            self.sw.ports.guard()
            current = self.claimant_of(newcomer.claim_uid)
            if current is None:
                raise SwitchFailed("start_failed", f"{newcomer.ref} is gone from the node")
            if current.endpoint is not None and await self.sw.ports.engine(current).health():
                return current
            left = deadline - self.sw.ports.clock()
            if left <= 0:
                raise SwitchFailed("start_timeout", f"{newcomer.ref} did not answer /health "
                                   f"within {self.limits.start_s:.0f} s of its start")
            try:
                async with asyncio.timeout(min(left, pauses.next_delay())):
                    await ticket.restarted.wait()
            except TimeoutError:
                pass

    async def _failed(self, lease: GpuLease, holder: Claimant | None, newcomer: Claimant,
                      claimants: Sequence[Claimant], exc: BaseException,
                      timings: dict[str, float]) -> SwitchResult:
        """The newcomer did not come up (or failed its probe): once the GPU shows its
        memory gone (or it confirmed a sleep), wake the old holder back."""
        sw = self.sw
        reason, message = reason_of(exc), str(exc) or type(exc).__name__
        current = self.claimant_of(newcomer.claim_uid) or newcomer
        if current.endpoint is not None:
            try:  # an engine that answers but failed its probe: put it to sleep
                await sw.sleep(current, lease.fence, timings)
            except Fenced:
                raise
            except SleepUnknown as unknown:
                # Its connection broke: asleep after a sleep sent again, or gone (the
                # switch's back-out decides it the same way).
                if not await sw.asleep_or_gone(unknown, lease.fence, timings):
                    return await sw.fail(lease, reason, f"{message}; {unknown}",
                                         restored=None, timings=timings, unsettled=(current,))
                log.info("the failed newcomer's sleep lost its connection; it is asleep "
                         "or gone after all",
                         extra={"claim": newcomer.ref, "device": lease.device})
            except Exception as sleep_exc:
                log.info("the failed newcomer does not take a sleep; waiting for its "
                         "memory to go", extra={"claim": newcomer.ref, "error": str(sleep_exc)})
        deadline = sw.ports.clock() + self.limits.gone_s
        pauses = Backoff(first_s=0.05, max_s=1.0)
        while True:
            above = await self._above_resident(current, claimants, timings)
            if above is None:
                break
            if sw.ports.clock() >= deadline:
                return await sw.fail(lease, reason, f"{message}; {newcomer.ref} still holds "
                                     f"{above}, so {holder.ref if holder else 'nobody'} "
                                     "stays asleep", restored=None, timings=timings,
                                     unsettled=(current,))
            await pauses.sleep()
        # restore reads every GPU of the old holder again before its wake.
        return await sw.restore(lease, holder, exc, timings, claimants)

    async def _above_resident(self, newcomer: Claimant, claimants: Sequence[Claimant],
                              timings: dict[str, float]) -> str | None:
        """Where the newcomer's pod holds more than its resident footprint (processes
        attributed by pod, never by what they name themselves), or None."""
        sw = self.sw
        for gpu in newcomer.gpus:
            held = (await sw.snapshot(gpu, timings)).held_by(newcomer, claimants)
            if held > newcomer.resident_on(gpu) + sw.limits.tolerance_bytes:
                return f"{held} bytes on {gpu}"
        return None
