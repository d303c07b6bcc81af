"""The simulated engine at runtime: control calls, memory, history, reporting.

One :class:`Engine` per server, shaped like vLLM 0.26's engine core:

- A ``/sleep`` pauses the scheduler (see :mod:`.traffic`) and registers a **pending
  sleep** that the engine core carries out when it next goes idle: caches are reset and
  the executor sleeps. The HTTP call answers once that happened. A sleep whose client
  gave up **stays registered** and fires later anyway, even after a ``/wake_up`` came in
  between (that wake finds the executor awake, does nothing to it, and resumes the
  scheduler): the engine then falls asleep with the scheduler on, and the next request it
  runs kills the engine core, as observed on a real H200.
- A ``/wake_up`` maps the memory of the tags it names one portion at a time (an OOM
  halfway keeps what was mapped); when the executor no longer sleeps, the scheduler
  resumes and held requests run.
- The executor's own calls (a pending sleep firing, a wake, a weight reload, a prefix
  reset) are serialised by one lock, as the engine core thread serialises them; other
  calls (``/is_sleeping``, a second ``/wake_up``) are answered while a sleep waits to fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from e2e.engine_simulator.errors import SimError, engine_dead_error, wake_oom_error
from e2e.engine_simulator.memory import DeviceOutOfMemory, MemoryHolder, Transfer, plan_portions
from e2e.engine_simulator.settings import Settings
from e2e.engine_simulator.state import (
    EngineState,
    MemoryAction,
    MemoryOp,
    Quality,
    StateError,
    Tag,
)
from e2e.engine_simulator.traffic import ClientGone, PauseMode, Traffic

__all__ = ["CRASH_EXIT_CODE", "Engine", "PendingSleep", "StartFailed"]

log = logging.getLogger(__name__)

CRASH_EXIT_CODE = 70
"""Exit status of a simulated crash (EX_SOFTWARE)."""
WATCHDOG_SECONDS = 5.0
"""vLLM's API-server watchdog period (``VLLM_WATCHDOG_TIME_S`` in its launcher)."""
SERVER_EXIT_CODE = 0
"""Exit status once the server shut down because its engine core died (an ordinary end
of ``vllm serve``)."""
_HISTORY = 1000
_GIB = float(2**30)


def _sum_copy(transfers: Sequence[Transfer]) -> float:
    return sum(t.copy_seconds for t in transfers)


class StartFailed(RuntimeError):
    """The engine could not start (its memory did not fit on the GPU); the process exits
    with status 1, as vLLM's API server does when its engine core fails to initialise."""


@dataclass
class PendingSleep:
    """A sleep registered with the engine core, carried out when it next goes idle."""

    level: int
    mode: PauseMode
    registered_at: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ops: list[MemoryOp] = field(default_factory=list)
    abandoned: bool = False
    """Its HTTP client gave up; it still fires."""


class Engine(Traffic):
    def __init__(
        self,
        settings: Settings,
        memory: MemoryHolder,
        *,
        pid: int,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        super().__init__(faults=settings.faults, ttft_seconds=settings.ttft_seconds,
                         tokens_per_second=settings.tokens_per_second, omni=settings.omni,
                         prefill_tokens_per_second=settings.prefill_tokens_per_second,
                         resume_merge_tokens=settings.resume_merge_tokens,
                         keep_fault=settings.keep_fault)
        self.settings = settings
        self.memory = memory
        self.pid = pid
        self.state = EngineState(settings.omni_stages if settings.omni else 1)
        self._portion_sizes = plan_portions(settings)
        self.started_at = int(time.time())
        self._exit_process = exit_process
        self._control = asyncio.Lock()
        self._pending: list[PendingSleep] = []
        self._core_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._dead_answered = asyncio.Event()
        """A call was answered ``EngineDeadError`` (vLLM's handler of it ends the server)."""
        self.watchdog_looks = 0
        """How many times the server's watchdog looked at the engine core."""
        self._had_level1_sleep = False
        self.sleep_state_level = 0
        """``vllm:engine_sleep_state``: 0 awake, 1 weights offloaded, 2 discard all (as
        vLLM records it: after a sleep call completes, and after any wake call)."""
        self.omni_level2_latched = False
        """vLLM-Omni slept at level 2: its wakeup is not implemented, and stays so."""
        self.wake_hanging = False
        """A wake is held by the ``wake_hangs`` fault."""
        self.sleeps: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self.wakes: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self.sleep_count = 0
        self.wake_count = 0
        self.wake_failures = 0
        self.reloads = 0
        self.prefix_cache_resets = 0
        self.ignored_calls = 0
        """Sleeps and wakes answered 200 without effect (faults sleep_ignored, wake_ignored)."""
        self.abandoned_sleeps = 0

    def _executor_sleeping(self) -> bool:
        return self.state.is_sleeping

    def _quality(self) -> Quality:
        return self.state.quality()

    @property
    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: the scheduler is paused or the executor sleeps."""
        return self.paused or self.state.is_sleeping

    @property
    def pending_sleeps(self) -> int:
        return len(self._pending)

    async def _pause_for(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def _alive(self) -> None:
        if self.dead is not None:
            raise engine_dead_error()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Allocate the awake footprint; :class:`StartFailed` when it does not fit."""
        try:
            await self.memory.start()
        except DeviceOutOfMemory as exc:
            # What vLLM prints when the engine core's load or KV-cache allocation runs out.
            log.error("CUDA Error: out of memory at <path>/cumem_allocator.cpp:163",
                      extra={"model": self.settings.model})
            log.error(exc.torch_message(), extra={"model": self.settings.model,
                                                  "detail": str(exc)})
            await self.memory.close()  # the process is about to exit: the GPU frees it
            raise StartFailed("Engine core initialization failed. See root cause above. "
                              "Failed core proc(s): {'EngineCore_DP0': 1}") from exc
        self._core_task = asyncio.create_task(self._core_loop(), name="engine-core")
        self._watchdog_task = asyncio.create_task(self._watchdog(), name="server-watchdog")
        log.info("engine simulator ready", extra={"model": self.settings.model,
                                                  "memory_bytes": self.memory.used_bytes})

    async def close(self) -> None:
        for task in (self._core_task, self._watchdog_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self.memory.close()

    # -- the death of the engine core -----------------------------------------------------

    async def _core_died(self) -> None:
        """vLLM's engine core process logs the error, tells the server and exits: the GPU
        frees its memory at once, whatever the HTTP server does next."""
        await self.memory.close()

    def answered_dead(self) -> None:
        """A call was answered ``EngineDeadError`` (the dead-engine middleware says so)."""
        self._dead_answered.set()

    async def _watchdog(self) -> None:
        """vLLM's API server ends once its engine core died: its watchdog looks every
        :data:`WATCHDOG_SECONDS`, and the handler of ``EngineDeadError`` at once; uvicorn
        then finishes the answers in flight (one tick) and the process exits. With
        ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`` it stays up, ``/health`` 503, until something
        restarts its container."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCHDOG_SECONDS):
                    await self._dead_answered.wait()
            async with self._changed:
                self.watchdog_looks += 1
                self._signal()
            if self.dead is None or self.settings.keep_alive_on_engine_death:
                self._dead_answered.clear()
                continue
            await asyncio.sleep(0.1)  # uvicorn's tick: the answer in flight goes out
            log.info("the engine core is dead: the server shuts down and the process exits",
                     extra={"reason": self.dead, "exit_code": SERVER_EXIT_CODE})
            self._exit_process(SERVER_EXIT_CODE)
            return

    def crash(self, reason: str) -> None:
        """Exit the process at once, as a dying engine does; nothing is cleaned up."""
        log.critical("simulated crash: exiting hard", extra={"reason": reason,
                                                             "exit_code": CRASH_EXIT_CODE})
        self._exit_process(CRASH_EXIT_CODE)

    # -- the engine core: pending sleeps fire when idle ---------------------------------

    async def _core_loop(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: bool(self._pending) and self.dead is None and (
                        self._idle() or self.settings.sleep_ignores_requests))
                due = list(self._pending)
            await self._fire(due)

    async def _fire(self, due: list[PendingSleep]) -> None:
        async with self._control:
            for pending in due:
                began = time.monotonic()
                running = len(self._running)
                if pending not in self._pending:
                    continue  # dropped with its client (kinder fault)
                async with self._changed:
                    ops = self.state.sleep(
                        pending.level, undo_partial_wake=self.faults.sleep_undoes_partial_wake)
                    self._signal()
                first = pending.level == 1 and bool(ops) and not self._had_level1_sleep
                self._had_level1_sleep = self._had_level1_sleep or first
                lied = self.faults.sleep_lies
                transfers = [] if lied else await self.memory.apply(ops)
                if ops:
                    s = self.settings
                    await self._pause_for(s.first_sleep_seconds if first
                                          else s.later_sleep_seconds)
                seconds = time.monotonic() - began
                async with self._changed:
                    self._pending.remove(pending)
                    pending.ops = ops
                    self.sleep_state_level = pending.level
                    self.sleep_count += 1
                    self._signal()
                pending.done.set()
                self.sleeps.append({
                    "level": pending.level, "mode": pending.mode, "stage_ids": None,
                    "seconds": seconds, "copy_seconds": _sum_copy(transfers), "first": first,
                    "lied": lied, "noop": not ops, "abandoned": pending.abandoned,
                    "waited_seconds": time.monotonic() - pending.registered_at,
                    "transfers": [t.as_dict() for t in transfers], "running": running,
                })
                log.info("slept", extra={"sleep_level": pending.level, "mode": pending.mode,
                                         "seconds": round(seconds, 6), "first": first,
                                         "lied": lied, "abandoned": pending.abandoned,
                                         "memory_bytes": self.memory.used_bytes})

    # -- control calls -----------------------------------------------------------------

    async def sleep(
        self, *, level: int, mode: PauseMode = "abort", request: web.Request | None = None
    ) -> list[MemoryOp]:
        """vLLM's ``sleep(level, mode)``: pause, then sleep once idle; returns the memory
        operations it implied. Level 0 only pauses the scheduler."""
        self._alive()
        if level not in (0, 1, 2):
            raise SimError(f"sleep level must be 0, 1 or 2, not {level}")
        if self.faults.sleep_ignored:
            self.ignored_calls += 1
            log.warning("sleep ignored (simulated fault sleep_ignored)")
            return []
        if self.settings.sleep_ignores_requests:
            mode = "keep"  # RFC #51476: a memory step; running requests freeze under it
        # vLLM: pause_scheduler(mode, clear_cache=level >= 1); a keep reset preempts.
        await self._pause_scheduler(mode, for_sleep=level > 0, clear_cache=level > 0)
        if level == 0:
            return []
        pending = PendingSleep(level=level, mode=mode, registered_at=time.monotonic())
        async with self._changed:
            self._pending.append(pending)
            self._signal()
        try:
            await self.wait_for(pending.done.is_set, request=request)
        except (ClientGone, asyncio.CancelledError):  # the client left (or the server
            # cancelled the handler when it did)
            if self.faults.sleep_cancelled_with_client and not pending.done.is_set():
                async with self._changed:
                    self._pending.remove(pending)
                    self._signal()
                if not self._pending and not self.state.is_sleeping:
                    await self._resume_scheduler()
                log.warning("sleep dropped with its client (kinder fault "
                            "sleep_cancelled_with_client)")
                raise
            async with self._changed:
                pending.abandoned = True
                self.abandoned_sleeps += 1
                self._signal()
            log.warning("sleep abandoned by its client: it stays registered and fires when "
                        "the engine next goes idle", extra={"sleep_level": level})
            raise
        self._alive()
        return pending.ops

    async def omni_sleep(
        self, *, level: int, stage_ids: Sequence[int], request: web.Request | None = None
    ) -> list[MemoryOp]:
        """vLLM-Omni's stage sleep: no pause and no drain (a request running on a stage
        loses its memory under it), unless the ``omni_sleep_aborts`` fault drains first."""
        self._alive()
        try:
            copy.deepcopy(self.state).sleep(level, stage_ids=stage_ids)
        except StateError as exc:
            raise SimError(str(exc)) from exc
        if self.faults.sleep_ignored:
            self.ignored_calls += 1
            return []
        if self.faults.omni_sleep_aborts:
            await self._abort_running("omni sleep (kinder fault omni_sleep_aborts)")
        async with self._control:
            began = time.monotonic()
            async with self._changed:
                ops = self.state.sleep(level, stage_ids=stage_ids)
                if level == 2 and ops:
                    self.omni_level2_latched = True
                self._signal()
            lied = self.faults.sleep_lies
            transfers = [] if lied else await self.memory.apply(ops)
            if ops:
                await self._pause_for(self.settings.later_sleep_seconds)
            self.sleep_count += 1
            self.sleeps.append({
                "level": level, "mode": None, "stage_ids": list(stage_ids),
                "seconds": time.monotonic() - began, "copy_seconds": _sum_copy(transfers),
                "first": False, "lied": lied, "noop": not ops, "abandoned": False,
                "waited_seconds": 0.0, "transfers": [t.as_dict() for t in transfers],
            })
            return ops

    async def wake(
        self,
        *,
        tags: Sequence[Tag] | None = None,
        stage_ids: Sequence[int] | None = None,
        reload_weights: bool = False,
        request: web.Request | None = None,
    ) -> list[MemoryOp]:
        """vLLM's ``wake_up(tags)``; ``reload_weights`` is vLLM-Omni's all-in-one wake."""
        self._alive()
        async with self._control:
            if self.faults.wake_hangs:
                log.warning("wake hangs (simulated fault wake_hangs)")
                async with self._changed:
                    self.wake_hanging = True
                    self._signal()
                try:
                    # Not given up when the caller leaves: vLLM does not stop a wake when
                    # its HTTP client goes away; the wake goes on once the fault clears.
                    await self.wait_for(lambda: not self.faults.wake_hangs or self._closing)
                finally:
                    async with self._changed:
                        self.wake_hanging = False
                        self._signal()
                if self._closing:
                    raise SimError("The server is shutting down.", status=503,
                                   err_type="ServiceUnavailableError")
            if self.faults.wake_fails:
                self.wake_failures += 1
                raise wake_oom_error()
            if self.faults.wake_ignored:
                self.ignored_calls += 1
                log.warning("wake ignored (simulated fault wake_ignored)")
                return []
            began = time.monotonic()
            try:
                plan = self.state.plan_wake(tags=tags, stage_ids=stage_ids,
                                            each_tag=self.faults.wake_each_tag)
            except StateError as exc:
                raise SimError(str(exc)) from exc
            if plan.skipped:
                log.warning("wake skipped", extra={"reason": plan.skipped})
            ops = list(plan.ops)
            transfers: list[Transfer] = []
            for op in ops:  # one portion at a time: an OOM halfway keeps what was mapped
                try:
                    transfers += await self.memory.apply([op])
                except DeviceOutOfMemory as exc:
                    self.wake_failures += 1
                    log.warning("wake ran out of GPU memory", extra={
                        "portion": op.portion, "detail": str(exc),
                        "memory_bytes": self.memory.used_bytes})
                    raise wake_oom_error(simulated=False) from exc
                finally:
                    async with self._changed:
                        if self.memory.holds(op.portion):
                            self.state.mapped(op)
                        self._signal()
            weights = [op.action for op in ops if op.tag is Tag.WEIGHTS]
            delay = 0.0
            if MemoryAction.RESTORE in weights:
                delay = self.settings.wake_level1_seconds
            if MemoryAction.REALLOCATE in weights:
                delay = max(delay, self.settings.wake_level2_seconds)
                if reload_weights:
                    delay += self.settings.reload_seconds
            await self._pause_for(delay)
            async with self._changed:
                self.state.complete_wake(plan, reload_weights=reload_weights)
                if not self.state.is_sleeping:
                    # vLLM: the scheduler resumes once the executor no longer sleeps (also
                    # after a wake that found it awake); a pending sleep stays registered.
                    self.scheduler = "running"
                    self._sleep_drain = False
                self.sleep_state_level = 0
                self._signal()
            seconds = time.monotonic() - began
            self.wake_count += 1
            record = {
                "tags": [t.value for t in tags] if tags else None,
                "stage_ids": list(stage_ids) if stage_ids is not None else None,
                "from_level": 2 if MemoryAction.REALLOCATE in weights
                else (1 if MemoryAction.RESTORE in weights else None),
                "seconds": seconds, "copy_seconds": _sum_copy(transfers), "noop": not ops,
                "skipped": plan.skipped, "transfers": [t.as_dict() for t in transfers],
            }
            self.wakes.append(record)
            log.info("woke", extra={"tags": record["tags"], "seconds": round(seconds, 6),
                                    "memory_bytes": self.memory.used_bytes,
                                    "is_sleeping": self.is_sleeping})
            return ops

    async def reload_weights(self, rpc_timeout: float | None) -> None:
        self._alive()
        async with self._control:
            if self.settings.load_format != "auto":
                raise SimError(
                    f"Call to collective_rpc method failed: Model reloading with "
                    f"{self.settings.load_format} format", status=500,
                    err_type="InternalServerError")
            try:
                copy.deepcopy(self.state).reload_weights()  # a dry run: may it be done now?
            except StateError as exc:
                raise SimError(f"Call to collective_rpc method failed: {exc}", status=500,
                               err_type="InternalServerError") from exc
            seconds = self.settings.reload_seconds
            if rpc_timeout is not None and seconds > rpc_timeout:
                await self._pause_for(rpc_timeout)
                raise SimError(
                    f"Call to collective_rpc method failed: reload_weights timed out after "
                    f"{rpc_timeout} s", status=500, err_type="InternalServerError")
            await self._pause_for(seconds)
            async with self._changed:
                self.state.reload_weights()
                self.reloads += 1
                self._signal()
            log.info("weights reloaded", extra={"seconds": seconds})

    async def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache()``: False (nothing reset) while requests hold
        blocks."""
        self._alive()
        async with self._control, self._changed:
            if self._running:
                return False
            self.state.reset_prefix_cache()
            self.prefix_cache_resets += 1
            self._signal()
            return True

    async def pause(self, mode: PauseMode, request: web.Request | None = None, *,
                    clear_cache: bool = True) -> None:
        """``/pause``: hold new requests; ``wait`` returns once the running ones finished.
        ``keep`` with ``clear_cache`` (vLLM 0.26 does not ignore it) preempts them."""
        self._alive()
        await self._pause_scheduler(mode, for_sleep=False, clear_cache=clear_cache)
        if mode == "wait":
            await self.wait_for(lambda: not self._running, request=request)
        log.info("generation paused", extra={"mode": mode})

    async def resume(self) -> None:
        """``/resume``: the scheduler runs again (on a sleeping executor, the next request
        kills the engine core, as in vLLM)."""
        self._alive()
        await self._resume_scheduler()

    # -- reporting ---------------------------------------------------------------------

    def freed_bytes(self, ops: Sequence[MemoryOp]) -> int:
        """Device bytes the sleep operations hand back (as the engine believes)."""
        return sum(self._portion_sizes[op.portion] for op in ops
                   if op.action in (MemoryAction.OFFLOAD, MemoryAction.DISCARD))

    def snapshot(self) -> dict[str, Any]:
        """``GET /sim/state``."""
        s = self.settings
        return {
            "simulator": True,
            "model": s.model,
            "pid": self.pid,
            "gpu_uuid": s.gpu_uuid,
            "gpu_uuids": list(s.worker_gpus),
            "tensor_parallel_size": s.tensor_parallel_size,
            "omni": s.omni,
            "sleeping": self.is_sleeping,
            "executor_sleeping": self.state.is_sleeping,
            "scheduler": self.scheduler,
            "dead": self.dead,
            "pending_sleeps": len(self._pending),
            "level": self.state.level,
            "tags_asleep": [t.value for t in self.state.sleeping_tags],
            "weights_valid": self.state.weights_valid,
            "prefix_cache_stale": self.state.prefix_cache_stale,
            "paused": self.paused,
            "closing": self._closing,
            "wake_hanging": self.wake_hanging,
            "in_flight": len(self._running) + self._held,
            "running": len(self._running),
            "waiting": self._held,
            "memory_bytes": self.memory.used_bytes,
            "awake_memory_bytes": s.awake_memory_bytes,
            "resident_memory_bytes": s.resident_memory_bytes,
            "memory": self.memory.describe(),
            "sleep_count": self.sleep_count,
            "wake_count": self.wake_count,
            "wake_failures": self.wake_failures,
            "reloads": self.reloads,
            "prefix_cache_resets": self.prefix_cache_resets,
            "ignored_calls": self.ignored_calls,
            "abandoned_sleeps": self.abandoned_sleeps,
            "generations_started": self.generations_started,
            "generations_aborted": self.generations_aborted,
            "preemptions": self.preemptions,
            "recompute_seconds": self.recompute_seconds,
            "sleeps": list(self.sleeps),
            "wakes": list(self.wakes),
            "stages": self.state.snapshot(),
            "faults": self.faults.model_dump(),
        }

    def omni_ack(self, stage_id: int, freed: int) -> dict[str, Any]:
        """One ``OmniACK``; its GiB metadata are strings (``"12.34"``), as vLLM-Omni's."""
        total_gib: float | str = freed / _GIB
        residual_gib: float | str = self.memory.used_bytes / _GIB
        if not self.faults.omni_gib_numbers:
            total_gib, residual_gib = f"{total_gib:.2f}", f"{residual_gib:.2f}"
        return {
            "task_id": uuid.uuid4().hex,
            "status": "SUCCESS",
            "stage_id": stage_id,
            "rank": 0,
            "freed_bytes": freed,
            "metadata": {
                "source": "rota-engine-simulator",
                "total_freed_gib": total_gib,
                "rank_residual_gib": residual_gib,
            },
            "error_msg": None,
        }
