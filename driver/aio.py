"""Small asyncio helpers shared by rota's processes.

Waiting on events, finishing work that must not be cut off, and the one way to repeat
something: :class:`Backoff` (bounded, jittered delays) and :func:`run_periodically`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger(__name__)

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


@dataclass
class Backoff:
    """Bounded exponential delays with jitter.

    Each :meth:`next` returns the current delay spread by ``±jitter`` (a fraction), then
    grows it by ``factor`` up to ``max_s``; :meth:`reset` starts over. Jitter keeps many
    nodes from acting in step.
    """

    initial_s: float
    max_s: float
    factor: float = 2.0
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random)
    _current: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"unusable backoff {self!r}")
        self._current = self.initial_s

    def next(self) -> float:
        """The next delay in seconds (never above ``max_s * (1 + jitter)``)."""
        delay = self._current * (1 + self.rng.uniform(-self.jitter, self.jitter))
        self._current = min(self._current * self.factor, self.max_s)
        return delay

    def reset(self) -> None:
        self._current = self.initial_s


async def run_periodically(step: Callable[[], Awaitable[object]], *, stop: asyncio.Event,
                           interval: Backoff, on_error: Backoff, what: str) -> None:
    """Run ``step`` until ``stop`` is set: after a success wait ``interval.next()``, after a
    failure (logged) ``on_error.next()``, reset by the next success. Waits end at once when
    ``stop`` is set. Use ``Backoff(initial_s=T, max_s=T)`` for a jittered period ``T``.
    """
    while not stop.is_set():
        try:
            await step()
        except Exception as exc:
            delay = on_error.next()
            log.warning(f"{what} failed; trying again", extra={"error": str(exc)[:300],
                                                               "retry_in_s": round(delay, 3)})
        else:
            on_error.reset()
            delay = interval.next()
        await wait_any(stop, timeout_s=delay)
