"""The switch protocol: hand one GPU from the engine that is awake to another.

The order is the reference experiment's, each step bounded and measured:

1. close admission: the GPU Lease says ``switching`` (its fencing number goes up in the
   same compare-and-swap write), so gateways hold new requests for both models;
2. drain: wait until the holder reports no running or waiting requests (bounded);
3. sleep the holder (``mode=wait``) and confirm with ``/is_sleeping``;
4. read the GPU: the holder is down to its resident footprint, no unknown process holds
   memory, free memory covers the target's awake budget;
5. wake the target (level 1, or the level-2 sequence);
6. the correctness request (streamed; content, ``[DONE]`` and usage);
7. record the target as holder and open admission.

Failure keeps one owner: a target that fails to wake or to answer correctly is put back to
sleep, and the GPU is read again, before the old holder is woken; an engine whose memory
is not handed back is never followed by another wake. Every engine call first checks that
this instance still leads the node and that the Lease still carries this switch's fencing
number; a call under an old number is refused here, before it reaches an engine.

Pure protocol over injected ports (:class:`Ports`), so it is tested without Kubernetes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controller import metrics, naming
from controller.claimants import Claimant
from controller.device import GpuSnapshot, HandbackProblem, check_before_wake
from controller.engines.base import EngineAdapter
from controller.engines.errors import EngineError
from controller.leases import GpuLease
from controller.settings import StepTimeouts

log = logging.getLogger(__name__)


class Fenced(RuntimeError):
    """Another writer changed the GPU Lease, or this instance lost the node: stop now."""


class LeasePort(Protocol):
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


@dataclass(frozen=True)
class Limits:
    tolerance_bytes: int
    unknown_limit_bytes: int
    timeouts: StepTimeouts = field(default_factory=StepTimeouts)


@dataclass
class SwitchResult:
    ok: bool
    lease: GpuLease
    reason: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def holder(self) -> str:
        return self.lease.holder


class SwitchFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _reason(exc: BaseException) -> str:
    if isinstance(exc, EngineError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, SwitchFailed):
        return exc.reason
    return type(exc).__name__.lower()


class Switcher:
    """Runs switches for one GPU device. Not re-entrant: the caller serialises."""

    def __init__(self, *, ports: Ports, limits: Limits, identity: str) -> None:
        self.ports = ports
        self.limits = limits
        self.identity = identity
        self._slept_before: set[str] = set()

    # -- steps with timeouts and metrics -------------------------------------------------

    async def _step(self, name: str, coro: Awaitable[object], timeout_s: float,
                    timings: dict[str, float]) -> object:
        start = self.ports.clock()
        try:
            return await asyncio.wait_for(coro, timeout_s)
        finally:
            elapsed = self.ports.clock() - start
            timings[name] = timings.get(name, 0.0) + elapsed
            metrics.STEP.labels(name).observe(elapsed)

    def _engine(self, claimant: Claimant, fence: int, lease: GpuLease) -> EngineAdapter:
        """The adapter, after the fencing checks that make a stale call impossible."""
        self.ports.guard()
        if lease.fence != fence:
            raise Fenced(f"fence {fence} is stale; the Lease carries {lease.fence}")
        return self.ports.engine(claimant)

    async def _write(self, lease: GpuLease, timings: dict[str, float]) -> GpuLease:
        self.ports.guard()
        written = await self._step("lease", self.ports.lease.write(lease),
                                   self.limits.timeouts.lease_s, timings)
        assert isinstance(written, GpuLease)
        return written

    async def _drain(self, claimant: Claimant, lease: GpuLease, timings: dict[str, float]
                     ) -> None:
        engine = self._engine(claimant, lease.fence, lease)
        start = self.ports.clock()
        deadline = start + self.limits.timeouts.drain_s
        delay = 0.01
        while True:
            busy = await engine.in_flight()
            if not busy or self.ports.clock() >= deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
        elapsed = self.ports.clock() - start
        timings["drain"] = elapsed
        metrics.DRAIN.labels(claimant.model).observe(elapsed)
        if busy:
            log.warning("drain timed out; sleeping with mode=wait lets the rest finish",
                        extra={"claim": claimant.ref, "in_flight": busy})

    async def _sleep(self, claimant: Claimant, lease: GpuLease, timings: dict[str, float]
                     ) -> None:
        engine = self._engine(claimant, lease.fence, lease)
        t = self.limits.timeouts
        outcome = await self._step("sleep", engine.sleep(claimant.sleep_level), t.sleep_s,
                                   timings)
        sleep_s = float(getattr(outcome, "sleep_s", 0.0))
        first = self.record_sleep(claimant, sleep_s)
        timings["first_sleep" if first else "later_sleep"] = sleep_s

    def record_sleep(self, claimant: Claimant, sleep_s: float) -> bool:
        """Measure one sleep of ``claimant`` (also those reconciliation makes); True when it
        was the engine's first, which is slow (pinned host buffers are allocated)."""
        first = claimant.claim_uid not in self._slept_before
        self._slept_before.add(claimant.claim_uid)
        metrics.SLEEP_CALL.labels(claimant.model, str(claimant.sleep_level),
                                  str(first).lower()).observe(sleep_s)
        return first

    async def _check_device(self, target: Claimant, claimants: Sequence[Claimant],
                            lease: GpuLease, timings: dict[str, float]
                            ) -> HandbackProblem | None:
        self.ports.guard()
        snapshot = await self._step("inspect", self.ports.device.snapshot(target.device),
                                    self.limits.timeouts.inspect_s, timings)
        assert isinstance(snapshot, GpuSnapshot)
        return check_before_wake(snapshot, target=target, claimants=claimants,
                                 tolerance_bytes=self.limits.tolerance_bytes,
                                 unknown_limit_bytes=self.limits.unknown_limit_bytes)

    async def _wake_and_probe(self, target: Claimant, lease: GpuLease,
                              timings: dict[str, float]) -> float:
        """Wake and prove it; returns the monotonic time of the first token."""
        engine = self._engine(target, lease.fence, lease)
        t = self.limits.timeouts
        outcome = await self._step("wake", engine.wake(target.sleep_level), t.wake_s, timings)
        wake_s = float(getattr(outcome, "wake_s", timings["wake"]))
        timings["wake_call"] = wake_s
        metrics.WAKE_CALL.labels(target.model, str(target.sleep_level)).observe(wake_s)
        engine = self._engine(target, lease.fence, lease)
        probe_start = self.ports.clock()
        result = await self._step("probe", engine.probe(), t.probe_s, timings)
        if not getattr(result, "ok", False):
            raise SwitchFailed(f"probe_{getattr(result, 'reason', 'failed')}",
                               f"{target.ref} woke but the correctness request failed: "
                               f"{getattr(result, 'detail', '') or getattr(result, 'reason', '')}")
        ttft = float(getattr(result, "ttft_s", 0.0) or 0.0)
        timings["probe_ttft"] = ttft
        timings["recovery_to_first_token"] = wake_s + ttft
        metrics.RECOVERY_TO_FIRST_TOKEN.labels(target.model).observe(wake_s + ttft)
        return probe_start + ttft

    # -- the protocol --------------------------------------------------------------------

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Sequence[Claimant]) -> SwitchResult:
        """Make ``target`` the awake engine of the GPU that ``lease`` describes."""
        timings: dict[str, float] = {}
        begin = self.ports.clock()
        lease = await self._write(lease.with_(
            state=naming.STATE_SWITCHING, fence=lease.fence + 1, target_model=target.model,
            draining_model=holder.model if holder else "", controller=self.identity,
            last_error=""), timings)
        fence = lease.fence
        log.info("switch started", extra={"device": lease.device, "fence": fence,
                                          "from": holder.ref if holder else None,
                                          "to": target.ref})
        handoff_start = self.ports.clock()
        try:
            if holder is not None:
                await self._drain(holder, lease, timings)
                handoff_start = self.ports.clock()
                await self._sleep(holder, lease, timings)
            problem = await self._check_device(target, claimants, lease, timings)
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
        except Fenced:
            raise
        except Exception as exc:
            return await self._restore(lease, holder, target, claimants, exc, timings)
        try:
            first_token_at = await self._wake_and_probe(target, lease, timings)
        except Fenced:
            raise
        except Exception as exc:
            return await self._back_out(lease, holder, target, claimants, exc, timings)
        handoff = first_token_at - handoff_start
        timings["handoff_to_first_token"] = handoff
        metrics.HANDOFF_TO_FIRST_TOKEN.labels(target.model).observe(handoff)
        lease = await self._write(self._serving(lease, target), timings)
        timings["total"] = self.ports.clock() - begin
        metrics.SWITCHES.labels("ok").inc()
        log.info("switch done", extra={"device": lease.device, "fence": fence,
                                       "holder": target.ref,
                                       "timings": {k: round(v, 4) for k, v in timings.items()}})
        return SwitchResult(True, lease, timings=timings)

    @staticmethod
    def _serving(lease: GpuLease, claimant: Claimant) -> GpuLease:
        return lease.with_(holder=claimant.ref, holder_model=claimant.model,
                           holder_claim_uid=claimant.claim_uid,
                           holder_endpoint=claimant.endpoint or "", state=naming.STATE_AWAKE,
                           target_model="", draining_model="")

    async def _fail(self, lease: GpuLease, reason: str, message: str, *,
                    restored: Claimant | None, timings: dict[str, float]) -> SwitchResult:
        metrics.SWITCHES.labels("failed").inc()
        metrics.FAILURES.labels(reason).inc()
        if restored is not None:
            lease = self._serving(lease, restored).with_(last_error=f"{reason}: {message}")
        else:
            # target-model stays, so gateways can tell which model failed to come up.
            lease = lease.with_(holder="", holder_model="", holder_claim_uid="",
                                holder_endpoint="", state=naming.STATE_FAILED,
                                draining_model="", last_error=f"{reason}: {message}")
        lease = await self._write(lease, timings)
        log.error("switch failed", extra={"device": lease.device, "fence": lease.fence,
                                          "reason": reason, "error": message,
                                          "holder": lease.holder or None})
        return SwitchResult(False, lease, reason, message, timings)

    async def _restore(self, lease: GpuLease, holder: Claimant | None, target: Claimant,
                       claimants: Sequence[Claimant], exc: BaseException,
                       timings: dict[str, float]) -> SwitchResult:
        """The target was never woken: give the GPU back to the old holder."""
        reason, message = _reason(exc), str(exc) or type(exc).__name__
        if holder is None:
            return await self._fail(lease, reason, message, restored=None, timings=timings)
        # Even when the holder kept its memory while claiming to sleep, waking it is the
        # way back to a serving GPU: the target holds no more than its resident budget.
        try:
            await self._wake_and_probe(holder, lease, timings)
        except Fenced:
            raise
        except Exception as again:
            return await self._fail(lease, reason, f"{message}; waking {holder.ref} back "
                                    f"failed too: {again}", restored=None, timings=timings)
        return await self._fail(lease, reason, message, restored=holder, timings=timings)

    async def _back_out(self, lease: GpuLease, holder: Claimant | None, target: Claimant,
                        claimants: Sequence[Claimant], exc: BaseException,
                        timings: dict[str, float]) -> SwitchResult:
        """The target was (maybe partly) woken and failed: sleep it, confirm, then restore."""
        reason, message = _reason(exc), str(exc) or type(exc).__name__
        try:
            await self._sleep(target, lease, timings)
        except Fenced:
            raise
        except Exception as sleep_exc:
            log.warning("could not put the failed target back to sleep",
                        extra={"claim": target.ref, "error": str(sleep_exc)})
        if holder is None:
            return await self._fail(lease, reason, message, restored=None, timings=timings)
        # Never wake the old holder while the target's memory is not handed back.
        try:
            problem = await self._check_device(holder, claimants, lease, timings)
        except Exception as read_exc:
            problem = HandbackProblem("inspect_failed", str(read_exc))
        if problem is not None:
            return await self._fail(lease, reason, f"{message}; the old holder stays asleep: "
                                    f"{problem.message}", restored=None, timings=timings)
        return await self._restore(lease, holder, target, claimants, exc, timings)

    async def sleep_holder(self, lease: GpuLease, holder: Claimant, *, reason: str
                           ) -> GpuLease:
        """Put the holder to sleep and leave the GPU idle (idle TTL, or a vanished target)."""
        timings: dict[str, float] = {}
        lease = await self._write(lease.with_(state=naming.STATE_SWITCHING,
                                              fence=lease.fence + 1,
                                              draining_model=holder.model, target_model="",
                                              controller=self.identity), timings)
        await self._drain(holder, lease, timings)
        await self._sleep(holder, lease, timings)
        log.info("holder put to sleep", extra={"device": lease.device, "claim": holder.ref,
                                               "reason": reason})
        return await self._write(lease.with_(holder="", holder_model="", holder_claim_uid="",
                                             holder_endpoint="", state=naming.STATE_IDLE,
                                             draining_model=""), timings)
