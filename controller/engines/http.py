"""The generic adapter: an engine whose sleep controls live at configured paths.

For engines that copy vLLM's sleep API under other paths (a wrapper, a sidecar, another
server), the claim's ``http`` config names three paths on the engine's port:

- ``sleepPath``: ``POST`` with the query ``level=N&mode=wait`` (vLLM's parameters; an
  engine that does not know them ignores them), no body;
- ``wakePath``: one ``POST``, whatever the level (no level-2 reload sequence: use the
  ``vllm`` adapter for vLLM at level 2);
- ``isSleepingPath``: ``GET`` answering ``{"is_sleeping": bool}``.

Every sleep and wake is confirmed through ``isSleepingPath``. In-flight counts come from
vLLM's gauges on ``/metrics`` when the engine has them (else None), health from
``/health``. With the defaults the adapter drives a vLLM engine at level 1.
"""

from __future__ import annotations

import logging

import aiohttp

from controller.engines.base import (
    EngineEndpoint,
    SleepOutcome,
    Timeouts,
    WakeOutcome,
    check_level,
)
from controller.engines.common import HttpEngineAdapter, Step
from driver.opaque import HttpAdapterConfig

__all__ = ["HttpAdapter"]

log = logging.getLogger(__name__)


class HttpAdapter(HttpEngineAdapter):
    """Drives an engine through the paths of an :class:`HttpAdapterConfig`."""

    def __init__(
        self,
        endpoint: EngineEndpoint,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        *,
        config: HttpAdapterConfig | None = None,
    ) -> None:
        super().__init__(endpoint, session, timeouts)
        self.config = config if config is not None else HttpAdapterConfig()
        self.is_sleeping_path = self.config.is_sleeping_path

    async def sleep(self, level: int) -> SleepOutcome:
        step = Step("sleep", self.config.sleep_path,
                    params=(("level", str(check_level(level))), ("mode", "wait")))
        sleep_s, _, _ = await self._run_steps([step], budget_s=self.timeouts.sleep_s)
        await self._confirm(sleeping=True, after="sleep")
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6)})
        return SleepOutcome(level=level, sleep_s=sleep_s)

    async def wake(self, level: int) -> WakeOutcome:
        step = Step("wake_up", self.config.wake_path)
        wake_s, timings, _ = await self._run_steps([step], budget_s=self.timeouts.wake_s(level))
        await self._confirm(sleeping=False, after="wake")
        log.info("engine awake", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(wake_s, 6)})
        return WakeOutcome(level=level, wake_s=wake_s, steps=tuple(timings))
