"""The one wait on an engine's work in flight, for the drain before a sleep and for the
coalescing window before a switch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from controller.lease.engines.base import EngineAdapter
from rota.kit.aio import wait_any

__all__ = ["until_idle"]

FIRST_POLL_S = 0.01
LAST_POLL_S = 0.25


async def until_idle(engine: EngineAdapter, *, deadline: float, clock: Callable[[], float],
                     stop: asyncio.Event | None = None) -> int | None:
    """Read the engine's requests in flight until it has none, ``deadline`` (on ``clock``)
    passes or ``stop`` is set, polling every 10 ms at first and every 250 ms at most.

    Returns the last count read: 0 (idle), None (the engine exports no such metric: there
    is nothing to wait for), or the work still in flight at the deadline or the stop. An
    engine that cannot be read raises its
    :class:`~controller.lease.engines.errors.EngineError`.
    """
    delay = FIRST_POLL_S
    while True:
        busy = await engine.in_flight()
        if not busy or clock() >= deadline:
            return busy
        pause = min(delay, max(0.0, deadline - clock()))
        if stop is None:
            await asyncio.sleep(pause)
        elif await wait_any(stop, timeout_s=pause):
            return busy
        delay = min(delay * 2, LAST_POLL_S)
