"""Small asyncio helpers shared by rota's processes."""

from __future__ import annotations

import asyncio


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
