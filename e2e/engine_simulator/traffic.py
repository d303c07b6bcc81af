"""Generation traffic of the simulated engine: the scheduler, admission, pacing, aborts.

Every change a waiter may care about (engine state, the in-flight set, faults) goes
through :meth:`Traffic._signal`, which notifies one condition; waits are on predicates
over it, never on the clock. A wait made for an HTTP request also ends when the client
goes away (aiohttp does not cancel handlers on disconnect, so the transport is checked
every :data:`DISCONNECT_POLL_SECONDS`).

The scheduler follows vLLM 0.26's engine core:

- ``running``: requests are admitted and step;
- ``paused_new`` (a sleep or pause with ``mode=abort|wait``): running requests keep
  stepping (``abort`` ends them first), **new and waiting requests are held**, not
  refused;
- ``paused_all`` (``mode=keep``): everything stands still until resumed. At the same
  time (a sleep of level >= 1, a ``/pause`` with ``clear_cache``, its default) vLLM resets
  its caches with ``reset_running_requests``: every running request is **preempted** (KV
  freed, outputs kept) and recomputed after the wake, which costs (prompt + generated
  tokens) / ``prefill_tokens_per_second``. Its first output after the recompute carries
  ``resume_merge_tokens`` tokens in one delta (vLLM's output collector merges what the
  engine produced while the API server caught up at the wake), and it is counted in
  ``vllm:num_preemptions`` then (vLLM counts the PREEMPTED event with the request's next
  output). No token is lost or repeated, unless the ``keep_fault`` test knob says so.

A request arriving while the engine is paused or asleep is held until a wake resumes the
scheduler (streams get their 200 headers at once, then nothing). A request the scheduler
runs while the executor sleeps (a deferred sleep fired with the scheduler on) crashes the
engine core: its memory is freed, from then on every call answers 500
``EngineDeadError`` and ``/health`` 503, and within vLLM's watchdog period the server
ends and the process exits (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``). Kinder
behaviours survive only as named faults (``refuse_while_asleep``).

The in-flight gauges follow vLLM too: they are what the engine core reported at its last
step, so requests held while it is paused with nothing running, or asleep, are not counted.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from e2e.engine_simulator.errors import SimError, engine_dead_error
from e2e.engine_simulator.generation import TokenPlan
from e2e.engine_simulator.settings import Faults, FaultsPatch, KeepFault
from e2e.engine_simulator.state import Quality

__all__ = [
    "DISCONNECT_POLL_SECONDS",
    "ClientGone",
    "Delta",
    "Generation",
    "GenerationFailed",
    "PauseMode",
    "Scheduler",
    "Traffic",
]

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.25

PauseMode = Literal["abort", "wait", "keep"]
Scheduler = Literal["running", "paused_new", "paused_all"]

OMNI_ASLEEP = ("Generation rejected: Engine is partially or fully asleep. Wake up all "
               "stages before generating.")


class GenerationFailed(Exception):
    """A generation failed after it started (a fault, an Omni stage put to sleep under it,
    or an engine core that died)."""


class ClientGone(SimError):
    """The client of a waiting request closed its connection."""

    def __init__(self) -> None:
        super().__init__("client closed the connection", status=499,
                         err_type="ClientClosedRequest")


@dataclass
class Generation:
    """One running generation request."""

    id: str
    quality: Quality
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    preempted: bool = False
    """Preempted by a keep reset; recomputed before its next token."""
    preemptions: int = 0


@dataclass(frozen=True)
class Delta:
    """One output of a generation as the API server takes it: one SSE chunk.

    Attributes:
        tokens: the tokens it carries (several after a recompute: merged deltas).
        generated: tokens the engine generated so far (its usage count).
        last: the generation's final output (it carries the finish reason).
    """

    tokens: tuple[str, ...]
    generated: int
    last: bool


def _client_gone(request: web.Request | None) -> bool:
    if request is None:
        return False
    transport = request.transport
    return transport is None or transport.is_closing()


class Traffic(ABC):
    """The in-flight side of an engine; :class:`~.engine.Engine` adds the control calls."""

    def __init__(self, *, faults: Faults, ttft_seconds: float, tokens_per_second: float,
                 omni: bool = False, prefill_tokens_per_second: float = 0.0,
                 resume_merge_tokens: int = 1, keep_fault: KeepFault | None = None) -> None:
        self.faults = faults
        self._ttft_seconds = ttft_seconds
        self._tokens_per_second = tokens_per_second
        self._prefill_tokens_per_second = prefill_tokens_per_second
        self._resume_merge_tokens = max(1, resume_merge_tokens)
        self._keep_fault = keep_fault
        self.preemptions = 0
        """``vllm:num_preemptions``: preempted requests whose next output was produced."""
        self.recompute_seconds = 0.0
        """Time spent recomputing preempted requests (``/sim/state``)."""
        self._omni = omni
        self._changed = asyncio.Condition()
        self._running: dict[str, Generation] = {}
        self._held = 0
        """Requests waiting to be admitted."""
        self.scheduler: Scheduler = "running"
        self._sleep_drain = False
        """The scheduler was paused by a sleep (not by ``/pause``)."""
        self._closing = False
        self.dead: str | None = None
        """Why the engine core died; None while it lives."""
        self._gauges = (0, 0)
        self.generations_started = 0
        self.generations_aborted = 0

    @abstractmethod
    def _executor_sleeping(self) -> bool:
        """True while the executor has any tag asleep."""

    @abstractmethod
    def _quality(self) -> Quality:
        """What a generation started now would produce."""

    def _signal(self) -> None:
        """Call with ``_changed`` held after any change: refresh the gauges, wake waiters."""
        if self._stepping():
            held = 0 if self.scheduler == "running" else self._held
            self._gauges = (len(self._running), held)
        self._changed.notify_all()

    def _stepping(self) -> bool:
        """The engine core steps now (so its stats are fresh)."""
        if self.dead is not None or self._executor_sleeping():
            return False
        if self.scheduler == "running":
            return True
        return self.scheduler == "paused_new" and bool(self._running)

    async def shutdown(self, grace: float) -> None:
        """Refuse new work; let running generations finish for ``grace`` s, then abort them."""
        async with self._changed:
            self._closing = True
            self._signal()
        try:
            async with asyncio.timeout(grace):
                await self.wait_for(lambda: not self._running)
        except TimeoutError:
            await self._abort_running("shutdown")
        log.info("engine simulator drained", extra={"aborted": self.generations_aborted})

    # -- waiting -----------------------------------------------------------------------

    async def wait_for(
        self, predicate: Callable[[], bool], *, request: web.Request | None = None
    ) -> None:
        """Wait until ``predicate()`` holds. With a request, give up when its client leaves
        (:class:`ClientGone`)."""
        async with self._changed:
            while not predicate():
                if _client_gone(request):
                    raise ClientGone()
                try:
                    async with asyncio.timeout(
                        DISCONNECT_POLL_SECONDS if request is not None else None
                    ):
                        await self._changed.wait()
                except TimeoutError:
                    pass

    # -- reading -----------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests held before admission, right now (``/sim/state``)."""
        return self._held

    @property
    def gauges(self) -> tuple[int, int]:
        """``(running, waiting)`` as the engine core last reported them (``/metrics``)."""
        return self._gauges

    @property
    def paused(self) -> bool:
        return self.scheduler != "running"

    # -- admission ---------------------------------------------------------------------

    def refusal(self) -> SimError | None:
        """The error a new request gets at once (before any header), or None to go on."""
        if self.dead is not None:
            return engine_dead_error()
        if self._closing:
            return SimError("The server is shutting down.", status=503,
                            err_type="ServiceUnavailableError")
        asleep = self._executor_sleeping() or self._sleep_drain
        if asleep and self.faults.refuse_while_asleep:
            return SimError(
                "The engine is sleeping and cannot serve requests (engine simulator fault "
                "refuse_while_asleep: vLLM 0.26 holds such requests). Wake it up first.",
                status=503, err_type="ServiceUnavailableError")
        if self._omni and self._executor_sleeping():
            return SimError(OMNI_ASLEEP, status=500, err_type="InternalServerError")
        return None

    async def admit(self, request: web.Request | None = None) -> Generation:
        """Admit a generation, holding it while the scheduler is paused or the engine
        sleeps. A request the scheduler runs on a sleeping executor kills the engine core."""
        async with self._changed:
            self._held += 1
            self._signal()
        try:
            while True:
                refused = self.refusal()
                if refused is not None:
                    raise refused
                if self.scheduler == "running":
                    if self._executor_sleeping():
                        await self._die("a request was scheduled while the executor slept "
                                        "(its memory is unmapped)")
                        continue
                    break
                await self.wait_for(lambda: self.scheduler == "running"
                                    or self.refusal() is not None, request=request)
            gen = Generation(id=uuid.uuid4().hex, quality=self._quality())
            async with self._changed:
                self._running[gen.id] = gen
                self.generations_started += 1
        finally:
            async with self._changed:
                self._held -= 1
                self._signal()
        return gen

    async def finish(self, gen: Generation) -> None:
        async with self._changed:
            self._running.pop(gen.id, None)
            self._signal()

    async def _die(self, reason: str) -> None:
        """The engine core dies: every running generation fails, every call answers 500."""
        async with self._changed:
            first = self.dead is None
            if first:
                self.dead = reason
                log.critical("engine core died (EngineDeadError)", extra={"reason": reason})
            self._signal()
        if first:
            await self._core_died()

    @abstractmethod
    async def _core_died(self) -> None:
        """What follows the engine core's death beyond this side (its process is gone)."""

    async def _abort_running(self, reason: str) -> None:
        async with self._changed:
            for gen in self._running.values():
                if not gen.aborted.is_set():
                    gen.aborted.set()
                    self.generations_aborted += 1
            self._signal()
        if self._running:
            log.info("aborted running generations",
                     extra={"reason": reason, "count": len(self._running)})

    async def _interruptible_delay(self, seconds: float, gen: Generation) -> None:
        if seconds <= 0:
            return
        try:
            async with asyncio.timeout(seconds):
                await gen.aborted.wait()
        except TimeoutError:
            pass

    def _runnable(self) -> bool:
        return (self.scheduler != "paused_all" and not self.faults.stall_generation
                and (self._omni or not self._executor_sleeping()))

    async def tokens(
        self, gen: Generation, plan: TokenPlan, request: web.Request | None = None
    ) -> AsyncIterator[str]:
        """Yield the plan's tokens at the configured pace; stop early when aborted."""
        async for delta in self.deltas(gen, plan, request):
            for token in delta.tokens:
                yield token

    async def _recompute(self, gen: Generation, context_tokens: int) -> None:
        """A preempted request is prefilled again (prompt + generated) before its next
        token; its preemption is counted with that output, as vLLM counts it."""
        gen.preempted = False
        gen.preemptions += 1
        rate = self._prefill_tokens_per_second
        seconds = context_tokens / rate if rate > 0 else 0.0
        await self._interruptible_delay(seconds, gen)
        async with self._changed:
            self.preemptions += 1
            self.recompute_seconds += seconds
            self._signal()

    def _kept_fault(self, gen: Generation, index: int, plan: TokenPlan) -> list[str] | None:
        """The ``keep_fault`` test knob at a kept request's first output after its wake:
        the tokens it delivers for ``plan.tokens[index]`` (None: aborted)."""
        token = plan.tokens[index]
        if self._keep_fault == "lose-token":
            return []
        if self._keep_fault == "duplicate-token":
            return [plan.tokens[index - 1] if index > 0 else token, token]
        if self._keep_fault == "abort":
            gen.aborted.set()
            self.generations_aborted += 1
            return None
        return [token]

    async def deltas(
        self, gen: Generation, plan: TokenPlan, request: web.Request | None = None,
        *, prompt_tokens: int = 1,
    ) -> AsyncIterator[Delta]:
        """The generation's outputs, one per chunk, at the configured pace; stop early when
        aborted. One token each, except the first output after a keep-preemption's
        recompute, which merges ``resume_merge_tokens``."""
        await self._interruptible_delay(self._ttft_seconds, gen)
        tps = self._tokens_per_second
        pending: list[str] = []
        merge_left = 0
        total = len(plan.tokens)
        for index in range(total):
            if index > 0 and tps > 0:
                await self._interruptible_delay(1.0 / tps, gen)
            if pending and not self._runnable():  # frozen again: the collector is drained
                yield Delta(tuple(pending), index, last=False)
                pending, merge_left = [], 0
            await self.wait_for(lambda: gen.aborted.is_set() or self._runnable()
                                or self.dead is not None, request=request)
            if gen.aborted.is_set():
                return
            if self.dead is not None:
                raise GenerationFailed(f"EngineCore encountered an issue ({self.dead})")
            if self._omni and self._executor_sleeping():
                raise GenerationFailed(OMNI_ASLEEP)
            if self.faults.fail_mid_stream and (index > 0 or total == 1):
                raise GenerationFailed(
                    "simulated fault fail_mid_stream: the engine failed mid-generation"
                )
            produced = [plan.tokens[index]]
            if gen.preempted:
                await self._recompute(gen, prompt_tokens + index)
                merge_left = self._resume_merge_tokens
                kept = self._kept_fault(gen, index, plan)
                if kept is None:
                    return
                produced = kept
            pending += produced
            merge_left = max(0, merge_left - 1)
            last = index == total - 1
            if (merge_left == 0 and pending) or last:
                yield Delta(tuple(pending), index + 1, last=last)
                pending = []

    # -- the scheduler -----------------------------------------------------------------

    async def _pause_scheduler(self, mode: PauseMode, *, for_sleep: bool,
                               clear_cache: bool = True) -> None:
        """vLLM's ``pause_scheduler(mode, clear_cache)``: hold new requests; ``abort`` ends
        the running ones, ``keep`` freezes them (and with ``clear_cache`` preempts them:
        they are recomputed after the wake)."""
        async with self._changed:
            self.scheduler = "paused_all" if mode == "keep" else "paused_new"
            self._sleep_drain = self._sleep_drain or for_sleep
            if mode == "keep" and clear_cache:
                for gen in self._running.values():
                    gen.preempted = True
            self._signal()
        if mode == "abort":
            await self._abort_running("sleep or pause with mode=abort")

    async def _resume_scheduler(self) -> None:
        async with self._changed:
            self.scheduler = "running"
            self._sleep_drain = False
            self._signal()

    def _idle(self) -> bool:
        """Nothing the engine core must finish first (frozen requests do not count)."""
        return self.scheduler == "paused_all" or not self._running

    async def set_faults(self, patch: FaultsPatch) -> Faults:
        async with self._changed:
            self.faults = patch.apply(self.faults)
            self._signal()
        log.warning("faults changed", extra={"faults": self.faults.model_dump()})
        return self.faults
