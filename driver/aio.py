"""Small asyncio helpers shared by rota's processes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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


async def finish_first(work: Awaitable[T], *,
                       on_cancel: Callable[[], None] | None = None) -> T:
    """Await ``work`` to its end even when the caller is cancelled meanwhile.

    For work that cannot be stopped half-way (a worker thread that writes files): a
    cancellation of the caller is held back until ``work`` is done, then raised, so that
    whatever the caller holds (a lock) is held until then. ``on_cancel`` runs when the
    first cancellation arrives. The result of work finished after a cancellation is
    dropped; its exception is raised in place of the cancellation.
    """
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if task.cancelled():
                raise
            if cancelled is None and on_cancel is not None:
                on_cancel()
            cancelled = exc
    result = task.result()  # an error of the work comes first
    if cancelled is not None:
        raise cancelled
    return result
