"""The switch protocol: hand one GPU from the engine that is awake to another.

The order is the reference experiment's, each step bounded and measured:

1. close admission: the GPU Lease says ``switching`` (its fencing number goes up in the
   same compare-and-swap write), so gateways hold new requests for both models;
2. drain: wait until the holder reports no running or waiting requests (bounded);
3. sleep the holder (``mode=wait``) and confirm with ``/is_sleeping``;
4. read the GPU: the holder is down to its resident footprint, no unknown process holds
   memory, free memory covers the target's awake budget (steps 3 and 4 end together:
   the sleep's confirmation and the GPU read run at once, and the wake waits for both);
5. wake the target (level 1, or the level-2 sequence);
6. the correctness request (streamed; content, ``[DONE]`` and usage), beside the wake's
   confirmation with ``/is_sleeping``;
7. record the target as holder and open admission.

Fencing: before every engine call that can change who is awake (every sleep and wake)
the GPU Lease is read again from the API server, and the call is refused (:class:`Fenced`)
unless the Lease still carries this switch's fencing number and this instance still leads
the node. A writer that moved the Lease (a newer instance's reconciliation, another
switch) stops this one before its next such call. Reads (``/is_sleeping``, the load
metrics) and the correctness probe, a generation that changes nothing, need only the
leadership check.

Failure keeps one owner: a target that fails to wake or to answer correctly is put back to
sleep, and the GPU is read again, before the old holder is woken; an engine whose memory
is not handed back is never followed by another wake. A sleep whose outcome is unknown (it
timed out, or its answer was lost) may still fire later (vLLM keeps a ``mode=wait`` sleep
registered): such an engine is never woken by this switch; it is returned as
*unsettled*, and the caller confirms through ``/is_sleeping`` and the GPU that it really
slept before anyone is woken (reconciliation does, in :mod:`controller.lease.gpu`).

**The preemptive switch** (``preempt``, the policy's choice): where the holder keeps its
requests (:func:`~rota.api.engine_config.keeps_requests`: vLLM at level 1 on one GPU, by
default) and its engine serves the calls (:meth:`EngineAdapter.can_keep`), step 2 is
skipped and step 3 puts the holder to sleep with its requests kept (``keep=True``): they
stay with the sleeping engine, frozen, and continue at its next wake. How many were kept
is read from the engine's own gauges just before the sleep (vLLM's gauges stand still
while it sleeps) and recorded (:class:`Freezes`, :attr:`SwitchResult.kept`). The Lease
still opens ``switching`` (its fencing number must go up before the holder's sleep), the
GPU is read and the target woken and proven as in every switch, and a keep sleep that
fails takes the paths every failed sleep takes: known, the old holder is restored;
unknown, it is unsettled. A holder that cannot keep (a gang, level 2, vLLM-Omni, an engine
without the calls) is drained as before.

**An awake set** (``--awake-set``, :mod:`controller.lease.awake_set`): the members that
stay awake beside the target (``stay``) are named in the Lease from the write that opens
the switch, and every GPU read measures them against their awake budgets instead of their
resident footprints; the holder put to sleep is the member the newcomer displaces (none:
it fits beside them all), further displaced members are drained and put to sleep first
(``also_sleep``). Whatever the outcome, the members that stay are still named.

Pure protocol over injected ports (:class:`Ports`), so it is tested without Kubernetes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.device import (
    FootprintWatch,
    GpuSnapshot,
    HandbackProblem,
    check_before_wake,
)
from controller.lease.engines.base import EngineAdapter
from controller.lease.engines.errors import (
    EngineError,
    EngineLied,
    EngineRejected,
    EngineUnreachable,
)
from controller.lease.errors import LeaseControllerError
from controller.lease.in_flight import until_idle
from controller.lease.settings import StepTimeouts
from rota.api import naming
from rota.api.engine_config import keeps_requests
from rota.api.gpu_lease import AwakeMember, GpuLease
from rota.kit.aio import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")

GONE_S = 10.0
"""How long a switch waits for the GPU to show that an engine that stopped answering is
gone (its process exited) before it counts the engine as unsettled."""
SLEEP_MARGIN_S = 5.0
"""The switch waits this much longer for a sleep than the adapter does, so that a slow
sleep ends with the adapter's own timeout (a known "state unknown"), not a cancelled call."""


_TRANSIENT = frozenset({"memory_not_returned", "unknown_process", "insufficient_memory"})
"""Problems of a GPU read that an exiting process clears by itself."""


def member_of(claimant: Claimant) -> AwakeMember:
    """``claimant`` as a member of a Lease's awake set."""
    return AwakeMember(claimant.ref, claimant.claim_uid, claimant.model)


def staying(lease: GpuLease, claimants: Sequence[Claimant]) -> list[Claimant]:
    """The claimants ``lease`` names awake beside its holder (an awake set's members that
    a switch leaves awake): measured against their awake budgets by every GPU read."""
    uids = {m.uid for m in lease.companions}
    return [c for c in claimants if c.claim_uid in uids]


def gang_of(claimant: Claimant) -> str:
    """The :data:`naming.GANG` annotation of a Lease ``claimant`` holds ("" for one GPU)."""
    return ",".join(claimant.gpus) if claimant.spans_gpus else ""


class Fenced(LeaseControllerError):
    """Another writer changed the GPU Lease, or this instance lost the node: stop now."""


class SwitchObserver(Protocol):
    """What a switch measures, told as it happens (:class:`metrics.SwitchMetrics` turns
    it into the controller's series; a test can record it)."""

    def step(self, name: str, seconds: float) -> None: ...
    def fenced(self) -> None: ...
    def drained(self, model: str, seconds: float) -> None: ...
    def slept(self, model: str, level: int, first: bool, seconds: float) -> None: ...
    def woke(self, model: str, level: int, seconds: float) -> None: ...
    def recovered(self, model: str, seconds: float) -> None: ...
    def handed_off(self, model: str, seconds: float) -> None: ...
    def switched(self, reason: str | None) -> None: ...
    def started(self, outcome: str) -> None: ...
    def start_took(self, model: str, seconds: float) -> None: ...
    def froze(self, frozen: Frozen) -> None: ...
    def thawed(self, frozen: Frozen, seconds: float) -> None: ...
    def forgot(self, frozen: Frozen) -> None: ...


@dataclass(frozen=True)
class Frozen:
    """An engine a preemptive switch put to sleep with its requests kept.

    Attributes:
        claim: the claim (``namespace/name``).
        model: its served model name.
        gpu: the GPU it sleeps on.
        kept: requests running or waiting by its gauges just before the sleep.
        since: when the sleep was sent (the switch's monotonic clock).
    """

    claim: str
    model: str
    gpu: str
    kept: int
    since: float


class Freezes:
    """The engines of a GPU that sleep with requests kept, by claim uid: what the policy
    weighs (their requests wait for the next wake) and what the metrics show. Shared by
    every switcher of the worker (a gang switch wakes them too)."""

    def __init__(self) -> None:
        self._frozen: dict[str, Frozen] = {}

    def froze(self, claim_uid: str, frozen: Frozen) -> None:
        self._frozen[claim_uid] = frozen

    def thaw(self, claim_uid: str) -> Frozen | None:
        """The freeze a wake of ``claim_uid`` ends, if it was frozen."""
        return self._frozen.pop(claim_uid, None)

    def get(self, claim_uid: str) -> Frozen | None:
        return self._frozen.get(claim_uid)

    def all(self) -> dict[str, Frozen]:
        return dict(self._frozen)

    def keep_only(self, claim_uids: set[str]) -> list[Frozen]:
        """Forget the freezes of claims that left (their engines, and requests, are gone);
        returns what was forgotten."""
        gone = [uid for uid in self._frozen if uid not in claim_uids]
        return [self._frozen.pop(uid) for uid in gone]


class LeasePort(Protocol):
    async def read(self) -> GpuLease:
        """The API server's copy of the GPU Lease, read now."""

    async def write(self, lease: GpuLease) -> GpuLease:
        """Compare-and-swap write; raises :class:`Fenced` when the Lease moved on."""


class DevicePort(Protocol):
    async def snapshot(self, device: str) -> GpuSnapshot: ...


@dataclass
class Ports:
    lease: LeasePort
    device: DevicePort
    engine: Callable[[Claimant], EngineAdapter]
    guard: Callable[[], None]
    """Raises :class:`Fenced` when this instance may no longer act (leadership lost)."""
    clock: Callable[[], float] = time.monotonic
    observer: SwitchObserver = field(default_factory=metrics.SwitchMetrics)
    """Told of every measurement (Prometheus series by default)."""
    freezes: Freezes = field(default_factory=Freezes)
    """The engines sleeping with requests kept."""
    footprint: FootprintWatch = field(default_factory=FootprintWatch)
    """Told of every GPU read before a wake: notices footprints creeping toward their
    budgets before a wake is refused for them."""


@dataclass(frozen=True)
class Limits:
    tolerance_bytes: int
    unknown_limit_bytes: int
    timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    restore_wait_s: float = GONE_S
    """How long waking an old holder back waits for the GPU to show memory handed back
    (a failed target's processes still exiting) before it gives up."""


@dataclass
class SwitchResult:
    ok: bool
    lease: GpuLease
    reason: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    unsettled: tuple[Claimant, ...] = ()
    """Engines whose state this switch could not establish (a sleep that may still fire):
    possibly awake, never to be woken before :meth:`Switcher.settle` confirms them."""
    kept: int = 0
    """Requests the old holder keeps asleep (a preemptive switch), by its gauges before
    its sleep; 0 when it was drained."""
    resumed: int = 0
    """Requests the target's wake brought back (kept by an earlier preemptive switch away
    from it): its probe queued behind their recompute."""

    @property
    def holder(self) -> str:
        return self.lease.holder


class SwitchFailed(LeaseControllerError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SleepUnknown(LeaseControllerError):
    """A sleep whose outcome is not known; the engine is unsettled."""

    def __init__(self, claimant: Claimant, cause: BaseException) -> None:
        super().__init__(f"the sleep of {claimant.ref} may still take effect: "
                         f"{str(cause) or type(cause).__name__}")
        self.claimant = claimant
        self.reason = cause.reason if isinstance(cause, EngineError) else "state_unknown"


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, EngineError | SwitchFailed | SleepUnknown):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    return type(exc).__name__.lower()


def connection_broke(exc: BaseException) -> bool:
    """Whether ``exc`` (a :class:`SleepUnknown`) came of a connection that broke, not of a
    call that ran out of time: the engine could not be reached, or the connection closed
    before any answer. A kept-alive connection that the engine's server (uvicorn, 5 s)
    closes just as a call reuses it fails so, as a close or, as often, as a reset, and the
    call never reached the engine; an engine that went away fails so too."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, EngineUnreachable):
            return True
        cause = cause.__cause__
    return False


def _sleep_outcome_known(exc: BaseException) -> bool:
    """True when a failed sleep cannot still take effect: the engine answered it with an
    error, or answered success and then contradicted itself."""
    return isinstance(exc, EngineRejected | EngineLied) and exc.reason != "engine_dead"


class Switcher:
    """Runs switches for one GPU. Not re-entrant: the caller serialises."""

    def __init__(self, *, ports: Ports, limits: Limits, identity: str) -> None:
        self.ports = ports
        self.limits = limits
        self.identity = identity
        self._slept_before: set[str] = set()
        self._told_drained: set[str] = set()
        """Claims already told (once) that they are drained though they ask to keep."""

    # -- steps with timeouts and metrics -------------------------------------------------

    async def _step(self, name: str, coro: Awaitable[T], timeout_s: float,
                    timings: dict[str, float]) -> T:
        start = self.ports.clock()
        try:
            return await asyncio.wait_for(coro, timeout_s)
        finally:
            elapsed = self.ports.clock() - start
            timings[name] = timings.get(name, 0.0) + elapsed
            self.ports.observer.step(name, elapsed)

    async def fenced_engine(self, claimant: Claimant, fence: int, timings: dict[str, float]
                      ) -> EngineAdapter:
        """The adapter, once the API server's copy of the Lease proves that this switch
        still owns the GPU: the fencing check before every engine call. The adapter's
        control calls carry the fence (:data:`~rota.api.engine_guard.FENCE_HEADER`):
        this instance may be paused between the check and the call for longer than a
        newer instance takes to move the Lease and call the engine, and the engine guard
        then refuses the late call."""
        self.ports.guard()
        current = await self._step("fence", self.ports.lease.read(),
                                   self.limits.timeouts.lease_s, timings)
        if current.fence != fence:
            self.ports.observer.fenced()
            raise Fenced(f"fence {fence} is stale: the GPU Lease {current.name} carries "
                         f"{current.fence} (written by {current.controller or 'unknown'})")
        self.ports.guard()
        return self.ports.engine(claimant).fenced({current.name: fence})

    async def write(self, lease: GpuLease, timings: dict[str, float]) -> GpuLease:
        self.ports.guard()
        return await self._step("lease", self.ports.lease.write(lease),
                                self.limits.timeouts.lease_s, timings)

    async def drain(self, claimant: Claimant, fence: int, timings: dict[str, float]
                    ) -> None:
        """Wait (bounded) until ``claimant`` has no work; reads only, so leadership is
        the only check (the sleep that follows is fenced)."""
        self.ports.guard()
        start = self.ports.clock()
        busy = await until_idle(self.ports.engine(claimant), clock=self.ports.clock,
                                deadline=start + self.limits.timeouts.drain_s)
        elapsed = self.ports.clock() - start
        timings["drain"] = elapsed
        self.ports.observer.drained(claimant.model, elapsed)
        if busy:
            log.warning("drain timed out; sleeping with mode=wait lets the rest finish",
                        extra={"claim": claimant.ref, "in_flight": busy})

    async def sleep(self, claimant: Claimant, fence: int, timings: dict[str, float]
                     ) -> None:
        """Sleep and confirm. Raises :class:`SleepUnknown` when the sleep may still
        fire later (never retried, never followed by a wake of this engine)."""
        await self._sleep_beside(claimant, fence, timings, None)

    async def hand_back(self, holder: Claimant | None, target: Claimant,
                        claimants: Sequence[Claimant], fence: int,
                        timings: dict[str, float], *, starting: bool = False,
                        kept: int | None = None, awake: Sequence[Claimant] = ()
                        ) -> HandbackProblem | None:
        """Sleep ``holder`` (when there is one) and read the GPU for ``target``: what
        stands between a holder and a wake (or a ``starting`` engine's start) of
        ``target``. The holder's sleep confirmation and the GPU read run at once: both are
        reads, and the wake waits for both. ``kept`` (a count, not None): the holder
        sleeps with its requests kept, that many by its gauges. ``awake``: the members of
        an awake set that stay awake beside ``target``."""
        read = functools.partial(self.check_device, target, claimants, timings,
                                 starting=starting, awake=awake)
        if holder is None:
            return await read()
        return await self._sleep_beside(holder, fence, timings, read, kept=kept)

    async def _sleep_beside(self, claimant: Claimant, fence: int, timings: dict[str, float],
                            beside: Callable[[], Awaitable[T]] | None, *,
                            kept: int | None = None) -> T | None:
        """The sleep of :meth:`sleep`, its confirmation run together with ``beside()`` (a
        read); returns what ``beside`` read. The confirmation's error comes first.
        ``kept`` not None: a sleep that keeps requests."""
        engine = await self.fenced_engine(claimant, fence, timings)
        level = claimant.sleep_level
        read: T | BaseException | None = None
        call = (engine.sleep(level, confirm=False) if kept is None
                else engine.sleep(level, confirm=False, keep=True))
        try:
            outcome = await self._step("sleep", call,
                                       self.limits.timeouts.sleep_s + SLEEP_MARGIN_S, timings)

            async def confirm() -> None:
                # made inside, so that a cancellation before it starts creates no call
                await self._step("sleep_confirm", engine.confirm_asleep(level),
                                 self.limits.timeouts.confirm_s, timings)

            if beside is None:
                await confirm()
            else:
                confirmed, read = await asyncio.gather(confirm(), beside(),
                                                       return_exceptions=True)
                if isinstance(confirmed, BaseException):
                    raise confirmed
        except Exception as exc:
            if _sleep_outcome_known(exc):
                raise
            raise SleepUnknown(claimant, exc) from exc
        first = self.record_sleep(claimant, outcome.sleep_s)
        timings["first_sleep" if first else "later_sleep"] = outcome.sleep_s
        if isinstance(read, BaseException):
            raise read
        return read

    def record_freeze(self, claimant: Claimant, kept: int, *, since: float) -> None:
        frozen = Frozen(claim=claimant.ref, model=claimant.model, gpu=claimant.gpu,
                        kept=kept, since=since)
        self.ports.freezes.froze(claimant.claim_uid, frozen)
        self.ports.observer.froze(frozen)
        log.info("holder asleep with its requests kept", extra={
            "claim": claimant.ref, "model": claimant.model, "device": claimant.gpu,
            "pod": claimant.pod_name, "kept": kept})

    def record_thaw(self, claimant: Claimant) -> None:
        """A wake of ``claimant`` succeeded: its kept requests run again."""
        frozen = self.ports.freezes.thaw(claimant.claim_uid)
        if frozen is None:
            return
        seconds = max(0.0, self.ports.clock() - frozen.since)
        self.ports.observer.thawed(frozen, seconds)
        log.info("kept requests resumed", extra={
            "claim": claimant.ref, "model": claimant.model, "device": claimant.gpu,
            "pod": claimant.pod_name, "kept": frozen.kept,
            "frozen_s": round(seconds, 4)})

    async def keeps(self, holder: Claimant) -> bool:
        """Whether a preemptive switch may keep ``holder``'s requests: its claim keeps
        them (:func:`keeps_requests`; a gang never) and its engine serves the calls. A
        claim that asks to keep and is drained all the same is told so once."""
        asked = holder.config.keep_requests is True
        if not keeps_requests(holder.config, gang=holder.spans_gpus):
            if asked and holder.spans_gpus:
                self._tell_drained(holder, "a tensor-parallel engine is drained, never "
                                   "kept (vLLM #45520: sleeping mid-decode at TP > 1)")
            return False
        if await self.ports.engine(holder).can_keep(holder.sleep_level):
            return True
        self._tell_drained(holder, "its engine does not serve a sleep that keeps requests "
                           "(/pause?mode=keep, /resume, /is_paused)")
        return False

    def _tell_drained(self, holder: Claimant, why: str) -> None:
        if holder.claim_uid in self._told_drained:
            return
        self._told_drained.add(holder.claim_uid)
        log.warning("switches drain this engine instead of keeping its requests",
                    extra={"claim": holder.ref, "model": holder.model,
                           "device": holder.gpu, "pod": holder.pod_name, "why": why})

    async def count_kept(self, holder: Claimant, timings: dict[str, float]) -> int:
        """The holder's requests running and waiting by its own gauges, read just before
        a sleep that keeps them (vLLM's gauges stand still while it sleeps); 0 when the
        engine exports none or cannot be read (the sleep's own calls say what is wrong)."""
        self.ports.guard()
        try:
            busy = await self._step("kept", self.ports.engine(holder).in_flight(),
                                    self.limits.timeouts.confirm_s, timings)
        except (EngineError, TimeoutError) as exc:
            log.warning("kept requests not counted: the holder's gauges could not be read",
                        extra={"claim": holder.ref, "device": holder.gpu,
                               "error": str(exc) or type(exc).__name__})
            return 0
        return busy or 0

    def record_sleep(self, claimant: Claimant, sleep_s: float) -> bool:
        """Measure one sleep of ``claimant`` (also those reconciliation makes); True when it
        was the engine's first, which is slow (pinned host buffers are allocated)."""
        first = claimant.claim_uid not in self._slept_before
        self._slept_before.add(claimant.claim_uid)
        self.ports.observer.slept(claimant.model, claimant.sleep_level, first, sleep_s)
        return first

    async def snapshot(self, gpu: str, timings: dict[str, float]) -> GpuSnapshot:
        self.ports.guard()
        return await self._step("inspect", self.ports.device.snapshot(gpu),
                                self.limits.timeouts.inspect_s, timings)

    async def check_device(self, target: Claimant, claimants: Sequence[Claimant],
                            timings: dict[str, float], *, starting: bool = False,
                            awake: Sequence[Claimant] = ()) -> HandbackProblem | None:
        """The NVML check before a wake of ``target``, on every GPU it holds (one read
        each, in GPU order): the first problem found, or None. The same read tells the
        footprint watch (a notice before a footprint's creep refuses a wake). ``awake``:
        the members of an awake set that stay awake beside it."""
        for gpu in target.gpus:
            snapshot = await self.snapshot(gpu, timings)
            self.ports.footprint.observe(snapshot, target=target, claimants=claimants,
                                         tolerance_bytes=self.limits.tolerance_bytes,
                                         starting=starting, awake=awake)
            problem = check_before_wake(snapshot, target=target, claimants=claimants,
                                        tolerance_bytes=self.limits.tolerance_bytes,
                                        unknown_limit_bytes=self.limits.unknown_limit_bytes,
                                        starting=starting, awake=awake)
            if problem is not None:
                return problem
        return None

    async def wake_and_probe(self, target: Claimant, fence: int,
                              timings: dict[str, float]) -> float:
        """Wake and prove it; returns the monotonic time of the first token. The wake's
        confirmation (``/is_sleeping``) runs beside the probe: a generation changes
        nothing, and the switch counts the target awake only once both are in. A
        confirmation that fails wins over the probe's error (it says why) and ends the
        probe at once: an engine still asleep after a wake it answered with success holds
        the probe's request until its first-token bound (30 s by default), and the
        back-out that wakes the old holder again must not wait for that."""
        engine = await self.fenced_engine(target, fence, timings)
        t = self.limits.timeouts
        outcome = await self._step("wake", engine.wake(target.sleep_level, confirm=False),
                                   t.wake_s, timings)
        wake_s = outcome.wake_s
        timings["wake_call"] = wake_s
        self.ports.observer.woke(target.model, target.sleep_level, wake_s)
        self.record_thaw(target)
        # not rota.kit.aio.both: a probe that fails first still waits for the confirmation
        probing = asyncio.ensure_future(self.probe(target, fence, timings, wake_s=wake_s))
        try:
            await self._step("wake_confirm", engine.confirm_awake(), t.confirm_s, timings)
            return await probing
        finally:
            # ended, or its end collected: its error is the switch's only when the wake
            # was confirmed
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)

    async def probe(self, target: Claimant, fence: int, timings: dict[str, float], *,
                     wake_s: float = 0.0) -> float:
        self.ports.guard()  # a generation changes nothing: leadership is enough
        engine = self.ports.engine(target)
        probe_start = self.ports.clock()
        result = await self._step("probe", engine.probe(), self.limits.timeouts.probe_s,
                                  timings)
        if not result.ok:
            raise SwitchFailed(f"probe_{result.reason or 'failed'}",
                               f"{target.ref} woke but the correctness request failed: "
                               f"{result.detail or result.reason}")
        ttft = float(result.ttft_s or 0.0)
        timings["probe_ttft"] = ttft
        timings["recovery_to_first_token"] = wake_s + ttft
        self.ports.observer.recovered(target.model, wake_s + ttft)
        return probe_start + ttft

    # -- the protocol --------------------------------------------------------------------

    async def begin(self, lease: GpuLease, state: naming.LeaseState, *,
                    holder: Claimant | None,
                    target: Claimant, timings: dict[str, float],
                    stay: Sequence[Claimant] = ()) -> GpuLease:
        """Open a switch (``switching``) or a start (``starting``) under a new fencing
        number: admission closed, the Lease names who drains and who comes, and ``stay``,
        the members of an awake set the switch leaves awake (none: one awake). Every later
        step reads them from the Lease (:func:`staying`)."""
        return await self.write(lease.opening(
            state, controller=self.identity, target_model=target.model,
            draining_model=holder.model if holder else "",
            companions=tuple(member_of(c) for c in stay)), timings)

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Sequence[Claimant], preempt: bool = False,
                     stay: Sequence[Claimant] = (), also_sleep: Sequence[Claimant] = ()
                     ) -> SwitchResult:
        """Make ``target`` the awake engine of the GPU that ``lease`` describes.
        ``preempt``: put the holder to sleep with its requests kept instead of draining
        it, where it keeps requests (:meth:`keeps`); drained otherwise.

        An awake set (:mod:`controller.lease.awake_set`): ``stay`` are the members that
        stay awake beside ``target`` (the Lease's holder among them when it is not put to
        sleep), ``holder`` the member put to sleep for it (None: it fits beside them all),
        ``also_sleep`` further members put to sleep (drained) before ``holder``. The wake
        check measures ``stay`` against their awake budgets."""
        timings: dict[str, float] = {}
        begin = self.ports.clock()
        for gone in self.ports.freezes.keep_only({c.claim_uid for c in claimants}):
            self.ports.observer.forgot(gone)  # its claim left the GPU, its requests too
        keep = preempt and holder is not None and await self.keeps(holder)
        lease = await self.begin(lease, naming.LeaseState.SWITCHING, holder=holder, target=target,
                                 timings=timings, stay=stay)
        fence = lease.fence
        if also_sleep:
            failed = await self.sleep_also(lease, holder, also_sleep, timings)
            if failed is not None:
                return failed
        log.info("switch started", extra={"device": lease.device, "fence": fence,
                                          "from": holder.ref if holder else None,
                                          "to": target.ref, "preempt": keep})
        handoff_start = self.ports.clock()
        kept: int | None = None
        try:
            if holder is not None and keep:
                kept = await self.count_kept(holder, timings)
            elif holder is not None:
                await self.drain(holder, fence, timings)
                handoff_start = self.ports.clock()
            sent = self.ports.clock()
            problem = await self.hand_back(holder, target, claimants, fence, timings,
                                           kept=kept, awake=staying(lease, claimants))
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
            if holder is not None and kept is not None:
                # asleep by its own word and by the GPU's: only now a freeze (a keep
                # sleep that failed either way is not; the holder is restored or unsettled)
                self.record_freeze(holder, kept, since=sent)
        except Fenced:
            raise
        except SleepUnknown as exc:
            return await self.unsettled(lease, exc, timings)
        except Exception as exc:
            return await self.restore(lease, holder, exc, timings, claimants)
        frozen = self.ports.freezes.get(target.claim_uid)
        try:
            first_token_at = await self.wake_and_probe(target, fence, timings)
        except Fenced:
            raise
        except Exception as exc:
            return await self._back_out(lease, holder, target, claimants, exc, timings)
        handoff = first_token_at - handoff_start
        timings["handoff_to_first_token"] = handoff
        self.ports.observer.handed_off(target.model, handoff)
        lease = await self.write(self.serving(lease, target, companions=lease.companions),
                                 timings)
        timings["total"] = self.ports.clock() - begin
        self.ports.observer.switched(None)
        log.info("switch done", extra={"device": lease.device, "fence": fence,
                                       "holder": target.ref, "kept": kept,
                                       "timings": {k: round(v, 4) for k, v in timings.items()}})
        return SwitchResult(True, lease, timings=timings, kept=kept or 0,
                            resumed=frozen.kept if frozen is not None else 0)

    async def sleep_also(self, lease: GpuLease, holder: Claimant | None,
                          members: Sequence[Claimant], timings: dict[str, float]
                          ) -> SwitchResult | None:
        """Drain and put to sleep the members of an awake set a switch displaces before
        its holder, one after the other; None when all sleep. A sleep that fails ends the
        switch with nobody woken: ``holder`` and every member not yet asleep are still
        awake and named so again; one whose sleep's outcome is unknown is unsettled."""
        for index, member in enumerate(members):
            try:
                await self.drain(member, lease.fence, timings)
                await self.sleep(member, lease.fence, timings)
            except Fenced:
                raise
            except Exception as exc:
                unknown = isinstance(exc, SleepUnknown)
                awake = [*members[index + (1 if unknown else 0):],
                         *([holder] if holder is not None else [])]
                message = f"putting {member.ref} to sleep to make room failed: {exc}"
                return await self.fail(
                    lease, reason_of(exc), message, restored=None, timings=timings,
                    unsettled=(member,) if unknown else (),
                    companions=(*lease.companions, *(member_of(c) for c in awake)))
        return None

    @staticmethod
    def serving(lease: GpuLease, claimant: Claimant, *, controller: str | None = None,
                last_error: str = "", companions: tuple[AwakeMember, ...] = ()) -> GpuLease:
        """``lease`` naming ``claimant`` as its awake holder (``companions`` awake beside
        it: an awake set)."""
        return lease.serving(holder=claimant.ref, model=claimant.model,
                             claim_uid=claimant.claim_uid, gang=gang_of(claimant),
                             controller=controller, last_error=last_error,
                             companions=companions)

    async def fail(self, lease: GpuLease, reason: str, message: str, *,
                    restored: Claimant | None, timings: dict[str, float],
                    unsettled: tuple[Claimant, ...] = (),
                    companions: tuple[AwakeMember, ...] | None = None) -> SwitchResult:
        """End a switch that failed: ``restored`` is awake again as holder, or nobody is
        (``failed``); ``companions`` (default: the Lease's) stay awake beside."""
        self.ports.observer.switched(reason)
        beside = lease.companions if companions is None else companions
        if restored is not None:
            lease = self.serving(lease, restored, last_error=f"{reason}: {message}",
                                 companions=beside)
        else:
            lease = lease.failed(f"{reason}: {message}", companions=beside)
        lease = await self.write(lease, timings)
        log.error("switch failed", extra={"device": lease.device, "fence": lease.fence,
                                          "reason": reason, "error": message,
                                          "holder": lease.holder or None,
                                          "unsettled": [c.ref for c in unsettled] or None})
        return SwitchResult(False, lease, reason, message, timings, unsettled)

    async def unsettled(self, lease: GpuLease, exc: SleepUnknown,
                         timings: dict[str, float]) -> SwitchResult:
        """The holder's sleep may still fire: nobody is woken, the GPU has no holder, and
        the engine stays unsettled until :meth:`settle` confirms where it is."""
        return await self.fail(lease, exc.reason, str(exc), restored=None, timings=timings,
                                unsettled=(exc.claimant,))

    async def restore(self, lease: GpuLease, holder: Claimant | None, exc: BaseException,
                       timings: dict[str, float], claimants: Sequence[Claimant]
                       ) -> SwitchResult:
        """Give the GPU back to the old holder, whose sleep completed (or was refused: it
        never began), once the GPU is read again: like every wake, this one follows an
        NVML check of every GPU the holder holds (a third engine or a stranger that made
        the switch fail keeps the holder asleep, and the Lease says ``failed``)."""
        reason, message = reason_of(exc), str(exc) or type(exc).__name__
        if holder is None:
            return await self.fail(lease, reason, message, restored=None, timings=timings)
        problem = await self.check_restore(holder, claimants, timings,
                                           awake=staying(lease, claimants))
        if problem is not None:
            return await self.fail(lease, reason, f"{message}; the old holder stays asleep: "
                                    f"{problem.message}", restored=None, timings=timings)
        try:
            await self.wake_and_probe(holder, lease.fence, timings)
        except Fenced:
            raise
        except Exception as again:
            return await self.fail(lease, reason, f"{message}; waking {holder.ref} back "
                                    f"failed too: {again}", restored=None, timings=timings)
        return await self.fail(lease, reason, message, restored=holder, timings=timings)

    async def check_restore(self, holder: Claimant, claimants: Sequence[Claimant],
                            timings: dict[str, float], *, awake: Sequence[Claimant] = ()
                            ) -> HandbackProblem | None:
        """:meth:`check_device` for waking an old holder back (a failed read is a
        problem, never a pass), read again with pauses for up to ``restore_wait_s`` while
        memory is not yet handed back: a failed engine's processes may still be exiting
        (on the H200, a vLLM engine core SIGKILLed mid-wake still held 1.4 GiB, and its
        environment could no longer be read, at the first read after its server died)."""
        pauses = Backoff(first_s=0.05, max_s=1.0)
        deadline = self.ports.clock() + self.limits.restore_wait_s
        while True:
            try:
                problem = await self.check_device(holder, claimants, timings, awake=awake)
            except Fenced:
                raise
            except Exception as read_exc:
                return HandbackProblem("inspect_failed",
                                       str(read_exc) or type(read_exc).__name__)
            if problem is None or problem.reason not in _TRANSIENT or (
                    self.ports.clock() >= deadline):
                return problem
            await pauses.sleep()

    async def _back_out(self, lease: GpuLease, holder: Claimant | None, target: Claimant,
                        claimants: Sequence[Claimant], exc: BaseException,
                        timings: dict[str, float]) -> SwitchResult:
        """The target was (maybe partly) woken and failed: sleep it, confirm, then restore."""
        reason, message = reason_of(exc), str(exc) or type(exc).__name__
        try:
            await self.sleep(target, lease.fence, timings)
        except Fenced:
            raise
        except SleepUnknown as unknown:
            if not await self.asleep_or_gone(unknown, lease.fence, timings):
                return await self.fail(lease, reason, f"{message}; {unknown}", restored=None,
                                       timings=timings, unsettled=(target,))
            log.warning("the failed target's sleep lost its connection; it is asleep or "
                        "gone after all", extra={"claim": target.ref, "device": target.gpu})
        except Exception as sleep_exc:
            log.warning("could not put the failed target back to sleep",
                        extra={"claim": target.ref, "error": str(sleep_exc)})
        # Never wake the old holder while the target's memory is not handed back: restore
        # reads the GPU first.
        return await self.restore(lease, holder, exc, timings, claimants)

    async def asleep_or_gone(self, unknown: SleepUnknown, fence: int,
                             timings: dict[str, float]) -> bool:
        """True when an engine whose sleep's outcome is unknown is known not to be awake
        after all, so that a back-out may wake the old holder. Only when the sleep's
        connection broke (:func:`connection_broke`): the sleep is sent once more
        (:meth:`settle`); one that completes proves the engine asleep, and one that cannot
        reach an engine with no process on the GPU proves it gone (not running: neither
        awake nor able to fire a sleep later). False: it stays unsettled. A sleep that
        ran out of time is not sent again (a second one would wait as long)."""
        return connection_broke(unknown) and await self.settle(unknown.claimant, fence,
                                                               timings)

    async def gone(self, claimant: Claimant, timings: dict[str, float],
                   within_s: float = GONE_S) -> bool:
        """True once no GPU of ``claimant`` shows a process of its pod (an engine that
        does not answer and holds nothing is not running: it cannot be awake, nor wake
        later); waits up to ``within_s`` for a dying process to let go."""
        pauses = Backoff(first_s=0.05, max_s=1.0)
        deadline = self.ports.clock() + within_s
        while True:
            snapshots = [await self.snapshot(gpu, timings) for gpu in claimant.gpus]
            if not any(snap.processes_of(claimant, ()) for snap in snapshots):
                return True
            if self.ports.clock() >= deadline:
                return False
            await pauses.sleep()

    async def settle(self, claimant: Claimant, fence: int, timings: dict[str, float]
                     ) -> bool:
        """Settle an engine a switch left unsettled: a sleep of ours that completes
        (engines handle control calls in order, so whatever was sent before has been
        done, and the engine is asleep), or no process of it on the GPU. False: it is
        still unsettled (never wake anyone beside it)."""
        try:
            await self.sleep(claimant, fence, timings)
            return True
        except Fenced:
            raise
        except (SleepUnknown, EngineError) as exc:
            if isinstance(exc.__cause__ or exc, EngineUnreachable):
                return await self.gone(claimant, timings)
            return False

    async def sleep_holder(self, lease: GpuLease, holder: Claimant, *, reason: str
                           ) -> SwitchResult:
        """Put the holder to sleep and leave the GPU idle (idle TTL, or a vanished target);
        in an awake set, the member woken last becomes the holder."""
        timings: dict[str, float] = {}
        lease = await self.write(lease.opening(naming.LeaseState.SWITCHING,
                                               controller=self.identity,
                                               target_model="", draining_model=holder.model,
                                               companions=lease.companions),
                                 timings)
        try:
            await self.drain(holder, lease.fence, timings)
            await self.sleep(holder, lease.fence, timings)
        except Fenced:
            raise
        except SleepUnknown as exc:
            return await self.unsettled(lease, exc, timings)
        except Exception as exc:
            return await self.fail(lease, reason_of(exc), str(exc) or type(exc).__name__,
                                    restored=holder, timings=timings)
        log.info("holder put to sleep", extra={"device": lease.device, "claim": holder.ref,
                                               "reason": reason})
        if lease.companions:  # an awake set: the member woken last holds the GPU now
            *rest, last = lease.companions
            lease = lease.serving(holder=last.claim, model=last.model, claim_uid=last.uid,
                                  gang="", companions=tuple(rest))
        else:
            lease = lease.idle()
        lease = await self.write(lease, timings)
        return SwitchResult(True, lease, timings=timings)
