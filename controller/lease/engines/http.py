"""The generic adapter: an engine whose sleep controls live at configured paths.

For engines that copy vLLM's sleep API under other paths (a wrapper, a sidecar, another
server), the claim's ``http`` config names three paths on the engine's port:

- ``sleepPath``: ``POST`` with the query ``level=N&mode=wait`` (vLLM's parameters; an
  engine that does not know them ignores them), no body; ``mode=keep`` instead where the
  claim says its engine keeps requests (``keepRequests: true``) and the switch preempts;
- ``wakePath``: one ``POST``, whatever the level (no level-2 reload sequence: use the
  ``vllm`` adapter for vLLM at level 2);
- ``isSleepingPath``: ``GET`` answering ``{"is_sleeping": bool}``.

Every sleep and wake is confirmed through ``isSleepingPath``. A sleep that does not answer
in time raises :class:`~controller.lease.engines.errors.EngineStateUnknown` (it may still take
effect). In-flight counts come from vLLM's gauges on ``/metrics`` when the engine has them
(else None), health from ``/health``. With the defaults the adapter drives a vLLM engine at
level 1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import aiohttp

from controller.lease.engines.base import (
    KEEP_LEVELS,
    EngineEndpoint,
    SleepOutcome,
    Timeouts,
    check_level,
)
from controller.lease.engines.common import ALL_TAGS, HttpEngineAdapter, Step
from rota.api.engine_config import HttpAdapterConfig, ProbeConfig

__all__ = ["HttpAdapter"]

log = logging.getLogger(__name__)


class HttpAdapter(HttpEngineAdapter):
    """Drives an engine through the paths of an :class:`HttpAdapterConfig`."""

    filtered_metrics_path = None
    """An engine of any make: what its ``/metrics/`` serves is unknown, so read the page
    that vLLM's gauges would be on."""

    def __init__(
        self,
        endpoint: EngineEndpoint,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        *,
        config: HttpAdapterConfig | None = None,
        probe: ProbeConfig | None = None,
    ) -> None:
        super().__init__(endpoint, session, timeouts, probe=probe)
        self.config = config if config is not None else HttpAdapterConfig()
        self.is_sleeping_path = self.config.is_sleeping_path

    reads_sleep_gauge = False  # another engine's sleep need not record vLLM's gauge

    async def can_keep(self, level: int) -> bool:
        """At level 1: whether an engine keeps requests is the claim's word
        (``keepRequests``, :func:`~rota.api.engine_config.keeps_requests`), which the
        switch reads; the calls are vLLM's (``mode=keep``), sent to ``sleepPath``."""
        return level in KEEP_LEVELS

    async def sleep(self, level: int, *, confirm: bool = True, keep: bool = False
                    ) -> SleepOutcome:
        if keep and level not in KEEP_LEVELS:
            raise ValueError(f"requests are kept only across a level-1 sleep, not {level}")
        step = Step("sleep", self.config.sleep_path,
                    params=(("level", str(check_level(level))),
                            ("mode", "keep" if keep else "wait")))
        sleep_s, _ = await self._sleep_call(step, budget_s=self.timeouts.sleep_s)
        if confirm:
            await self.confirm_asleep(level)
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6), "confirmed": confirm,
            "kept": keep})
        return SleepOutcome(level=level, sleep_s=sleep_s)

    def _wake_steps(self, level: int) -> Sequence[Step]:
        check_level(level)
        return (Step("wake_up", self.config.wake_path, wakes=ALL_TAGS),)
