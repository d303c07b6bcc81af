"""The adapter for vLLM's OpenAI server with sleep mode, on vLLM's exact wire behaviour.

vLLM serves its sleep controls only with ``VLLM_SERVER_DEV_MODE=1`` (and sleep needs
``--enable-sleep-mode``). Its traps, and what this adapter does about them:

- ``POST /sleep`` reads the query only: a JSON body or a misspelt parameter is ignored and
  the engine sleeps at level 1 with ``mode=abort``. The adapter sends
  ``/sleep?level=N&mode=wait`` and no body. (The controller drains at the gateway first;
  ``wait`` is the second line of defence: ``abort`` races in-flight CUDA work.)
- ``/sleep`` and ``/wake_up`` answer 200 with an empty body, even from an engine that is
  about to crash: every sleep and wake is confirmed with ``GET /is_sleeping``.
- A level-2 wake is four calls: ``wake_up?tags=weights``, ``collective_rpc
  reload_weights``, ``wake_up?tags=kv_cache``, ``reset_prefix_cache``. Skipping the reload
  gives garbage; skipping the reset gives stale cached answers. Only the probe can tell.
- A wake that finds no room answers 500 with ``CUDA Error: out of memory``: that is
  :class:`~controller.engines.errors.EngineRejected` with reason ``gpu_oom``.
"""

from __future__ import annotations

import logging
import time

from controller.engines.base import SleepOutcome, WakeOutcome, check_level
from controller.engines.common import HttpEngineAdapter, Step

__all__ = ["LEVEL1_WAKE", "LEVEL2_WAKE", "VllmAdapter"]

log = logging.getLogger(__name__)

LEVEL1_WAKE: tuple[Step, ...] = (Step("wake_up", "/wake_up"),)
"""Level 1: one call brings weights (from host memory) and KV cache back."""

LEVEL2_WAKE: tuple[Step, ...] = (
    Step("wake_up_weights", "/wake_up", params=(("tags", "weights"),)),
    Step("reload_weights", "/collective_rpc", json_body={"method": "reload_weights"}),
    Step("wake_up_kv_cache", "/wake_up", params=(("tags", "kv_cache"),)),
    Step("reset_prefix_cache", "/reset_prefix_cache"),
)
"""Level 2: map the weights, load them from disk, map the KV cache, drop stale hashes."""


class VllmAdapter(HttpEngineAdapter):
    """Drives a vLLM engine (levels 1 and 2)."""

    async def sleep(self, level: int) -> SleepOutcome:
        check_level(level)
        began = time.monotonic()
        await self._http.request(
            "sleep", "POST", "/sleep", timeout_s=self.timeouts.sleep_s, control=True,
            params=(("level", str(level)), ("mode", "wait")),
        )
        sleep_s = time.monotonic() - began
        await self._confirm(sleeping=True, after="sleep")
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6)})
        return SleepOutcome(level=level, sleep_s=sleep_s)

    async def wake(self, level: int) -> WakeOutcome:
        steps = LEVEL1_WAKE if check_level(level) == 1 else LEVEL2_WAKE
        wake_s, timings, _ = await self._run_steps(steps, budget_s=self.timeouts.wake_s(level))
        await self._confirm(sleeping=False, after="wake")
        log.info("engine awake", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(wake_s, 6),
            "steps": {t.name: round(t.seconds, 6) for t in timings}})
        return WakeOutcome(level=level, wake_s=wake_s, steps=tuple(timings))
