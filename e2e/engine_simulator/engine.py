"""The simulated engine at runtime: control calls, memory, history, reporting.

One :class:`Engine` per server. Control calls (sleep, wake, reload, prefix reset, pause)
are serialised by one lock, as a real engine core serialises them; the in-flight side
(admission, token pacing, aborts, drains) is :class:`~.traffic.Traffic`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from e2e.engine_simulator.errors import SimError, wake_oom_error
from e2e.engine_simulator.memory import MemoryHolder, Transfer, plan_portions
from e2e.engine_simulator.settings import Settings
from e2e.engine_simulator.state import (
    EngineState,
    MemoryAction,
    MemoryOp,
    Quality,
    StateError,
    Tag,
)
from e2e.engine_simulator.traffic import PauseMode, Traffic

__all__ = ["CRASH_EXIT_CODE", "Engine"]

log = logging.getLogger(__name__)

CRASH_EXIT_CODE = 70
"""Exit status of a simulated crash (EX_SOFTWARE)."""
_HISTORY = 1000
_GIB = float(2**30)


def _sum_copy(transfers: Sequence[Transfer]) -> float:
    return sum(t.copy_seconds for t in transfers)


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
                         tokens_per_second=settings.tokens_per_second)
        self.settings = settings
        self.memory = memory
        self.pid = pid
        self.state = EngineState(settings.omni_stages if settings.omni else 1)
        self._portion_sizes = plan_portions(settings)
        self.started_at = int(time.time())
        self._exit_process = exit_process
        self._control = asyncio.Lock()
        self._had_level1_sleep = False
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

    def _asleep(self) -> bool:
        return self.state.is_sleeping

    def _quality(self) -> Quality:
        return self.state.quality()

    async def _pause_for(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.memory.start()
        log.info("engine simulator ready", extra={"model": self.settings.model,
                                                  "memory_bytes": self.memory.used_bytes})

    async def close(self) -> None:
        await self.memory.close()

    def crash(self, reason: str) -> None:
        """Exit the process at once, as a dying engine does; nothing is cleaned up."""
        log.critical("simulated crash: exiting hard", extra={"reason": reason,
                                                             "exit_code": CRASH_EXIT_CODE})
        self._exit_process(CRASH_EXIT_CODE)

    # -- control calls -----------------------------------------------------------------

    async def sleep(
        self,
        *,
        level: int,
        mode: PauseMode = "abort",
        tags: Sequence[Tag] | None = None,
        stage_ids: Sequence[int] | None = None,
        request: web.Request | None = None,
    ) -> list[MemoryOp]:
        """vLLM's ``sleep(level, mode)``; returns the memory operations it implied."""
        try:  # refuse a bad call before anything is aborted
            copy.deepcopy(self.state).sleep(level, tags=tags, stage_ids=stage_ids)
        except StateError as exc:
            raise SimError(str(exc)) from exc
        async with self._control:
            if self.faults.sleep_ignored:
                self.ignored_calls += 1
                log.warning("sleep ignored (simulated fault sleep_ignored)")
                return []
            began = time.monotonic()
            try:
                await self._drain(mode, request, purpose="sleep")
                async with self._changed:
                    try:
                        ops = self.state.sleep(level, tags=tags, stage_ids=stage_ids)
                    except StateError as exc:
                        raise SimError(str(exc)) from exc
                    self._changed.notify_all()
                first = level == 1 and bool(ops) and not self._had_level1_sleep
                self._had_level1_sleep = self._had_level1_sleep or first
                lied = self.faults.sleep_lies
                transfers = [] if lied else await self.memory.apply(ops)
                if ops and level >= 1:
                    s = self.settings
                    await self._pause_for(s.first_sleep_seconds if first
                                          else s.later_sleep_seconds)
            finally:
                await self._end_drain()
            seconds = time.monotonic() - began
            self.sleep_count += 1
            record = {
                "level": level, "mode": mode, "tags": [t.value for t in tags or []] or None,
                "stage_ids": list(stage_ids) if stage_ids is not None else None,
                "seconds": seconds, "copy_seconds": _sum_copy(transfers), "first": first,
                "lied": lied, "noop": not ops, "transfers": [t.as_dict() for t in transfers],
            }
            self.sleeps.append(record)
            log.info("slept", extra={"sleep_level": level, "mode": mode,
                                     "seconds": round(seconds, 6), "first": first, "lied": lied,
                                     "memory_bytes": self.memory.used_bytes})
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
        async with self._control:
            if self.faults.wake_hangs:
                log.warning("wake hangs (simulated fault wake_hangs)")
                async with self._changed:
                    self.wake_hanging = True
                    self._changed.notify_all()
                try:
                    # Not given up when the caller leaves: vLLM does not stop a wake when
                    # its HTTP client goes away; the wake goes on once the fault clears.
                    await self.wait_for(lambda: not self.faults.wake_hangs or self._closing)
                finally:
                    async with self._changed:
                        self.wake_hanging = False
                        self._changed.notify_all()
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
            planned = copy.deepcopy(self.state)
            try:
                ops = planned.wake(tags=tags, stage_ids=stage_ids, reload_weights=reload_weights)
            except StateError as exc:
                raise SimError(str(exc)) from exc
            transfers = await self.memory.apply(ops)
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
                self.state = planned
                self._changed.notify_all()
            seconds = time.monotonic() - began
            self.wake_count += 1
            record = {
                "tags": [t.value for t in tags] if tags else None,
                "stage_ids": list(stage_ids) if stage_ids is not None else None,
                "from_level": 2 if MemoryAction.REALLOCATE in weights
                else (1 if MemoryAction.RESTORE in weights else None),
                "seconds": seconds, "copy_seconds": _sum_copy(transfers), "noop": not ops,
                "transfers": [t.as_dict() for t in transfers],
            }
            self.wakes.append(record)
            log.info("woke", extra={"tags": record["tags"], "seconds": round(seconds, 6),
                                    "memory_bytes": self.memory.used_bytes,
                                    "is_sleeping": self.state.is_sleeping})
            return ops

    async def reload_weights(self, rpc_timeout: float | None) -> None:
        async with self._control:
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
                self._changed.notify_all()
            log.info("weights reloaded", extra={"seconds": seconds})

    async def reset_prefix_cache(self) -> None:
        async with self._control, self._changed:
            self.state.reset_prefix_cache()
            self.prefix_cache_resets += 1
            self._changed.notify_all()

    async def pause(self, mode: PauseMode, request: web.Request | None = None) -> None:
        async with self._control:
            try:
                await self._drain(mode, request, purpose="pause")
                async with self._changed:
                    self._paused = True
                    self._changed.notify_all()
            finally:
                await self._end_drain()
            log.info("generation paused", extra={"mode": mode})

    async def resume(self) -> None:
        async with self._control, self._changed:
            self._paused = False
            self._changed.notify_all()

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
            "omni": s.omni,
            "sleeping": self.state.is_sleeping,
            "level": self.state.level,
            "tags_asleep": [t.value for t in self.state.sleeping_tags],
            "weights_valid": self.state.weights_valid,
            "prefix_cache_stale": self.state.prefix_cache_stale,
            "paused": self._paused,
            "draining": self._draining is not None,
            "closing": self._closing,
            "wake_hanging": self.wake_hanging,
            "in_flight": len(self._running) + self._waiting,
            "running": len(self._running),
            "waiting": self._waiting,
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
            "generations_started": self.generations_started,
            "generations_aborted": self.generations_aborted,
            "sleeps": list(self.sleeps),
            "wakes": list(self.wakes),
            "stages": self.state.snapshot(),
            "faults": self.faults.model_dump(),
        }

    def omni_ack(self, stage_id: int, freed: int) -> dict[str, Any]:
        return {
            "task_id": uuid.uuid4().hex,
            "status": "SUCCESS",
            "stage_id": stage_id,
            "rank": 0,
            "freed_bytes": freed,
            "metadata": {
                "source": "rota-engine-simulator",
                "total_freed_gib": round(freed / _GIB, 6),
                "rank_residual_gib": round(self.memory.used_bytes / _GIB, 6),
            },
            "error_msg": None,
        }
