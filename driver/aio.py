"""Small asyncio helpers shared by rota's processes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator


async def wait_any(*events: asyncio.Event, timeout_s: float | None = None) -> bool:
    """Wait until one of ``events`` is set or ``timeout_s`` passes; True if one was set.

    The waiter tasks are always cancelled and awaited, so nothing is left pending.
    """
    if any(event.is_set() for event in events):
        return True
    waiters = {asyncio.create_task(event.wait()) for event in events}
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    return bool(done)


def backoff(base_s: float, cap_s: float, *, rng: random.Random | None = None
            ) -> Iterator[float]:
    """The pauses between the attempts of a bounded retry: exponential from ``base_s``,
    capped at ``cap_s``, each one jittered to a uniform draw from its upper half (so
    callers that failed together do not retry together). Endless: the caller bounds the
    attempts (``zip(range(n), backoff(...))``) or the time.
    """
    draw = rng.uniform if rng is not None else random.uniform
    delay = base_s
    while True:
        yield draw(delay / 2, delay)
        delay = min(delay * 2, cap_s)
