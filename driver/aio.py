"""Small asyncio helpers shared by rota's processes: waiting on events, and the one way to
back off between attempts.

Every retry in rota is bounded, grows its pause, jitters it, and can be interrupted. Write
it with :class:`Backoff` (the pauses) and, for a whole retried call, :func:`retry`; never
with a hand-written ``delay = min(delay * 2, ...)`` loop.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

__all__ = ["Backoff", "retry", "wait_any"]


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


@dataclass
class Backoff:
    """Exponentially growing, jittered pauses: ``first_s``, then times ``factor`` up to
    ``max_s``; each pause is drawn uniformly from ``[(1 - jitter) * p, p]`` ("equal
    jitter" keeps a floor, so a retry never comes at once).

    ``attempts`` bounds how many pauses :meth:`delays` yields (None: unbounded, for loops
    that run until stopped, such as watches); :meth:`reset` starts over after a success.
    Pure apart from ``rng``: tests pass a seeded ``random.Random``.
    """

    first_s: float = 0.2
    max_s: float = 10.0
    factor: float = 2.0
    jitter: float = 0.5
    attempts: int | None = None
    rng: random.Random = field(default_factory=random.Random, repr=False)
    _next_s: float = field(init=False, default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s < self.first_s or self.factor < 1:
            raise ValueError("backoff needs 0 < first_s <= max_s and factor >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        self.reset()

    def reset(self) -> None:
        self._next_s = self.first_s

    def next_delay(self) -> float:
        """The next pause, in seconds; grows the one after it."""
        ceiling = self._next_s
        self._next_s = min(self._next_s * self.factor, self.max_s)
        return self.rng.uniform((1 - self.jitter) * ceiling, ceiling)

    def delays(self) -> Iterator[float]:
        """The pauses, at most ``attempts`` of them."""
        count = 0
        while self.attempts is None or count < self.attempts:
            count += 1
            yield self.next_delay()

    async def sleep(self, stop: asyncio.Event | None = None) -> bool:
        """Pause for the next delay; True when ``stop`` was set meanwhile (stop now)."""
        delay = self.next_delay()
        if stop is None:
            await asyncio.sleep(delay)
            return False
        return await wait_any(stop, timeout_s=delay)

    def wait(self, stop: threading.Event) -> bool:
        """The same for a thread (watch loops): True when ``stop`` was set meanwhile."""
        return stop.wait(self.next_delay())


async def retry(call: Callable[[], Awaitable[T]], *, retry_on: tuple[type[BaseException], ...],
                backoff: Backoff, on_retry: Callable[[BaseException, float], None] | None = None,
                transient: Callable[[BaseException], bool] = lambda exc: True) -> T:
    """``await call()`` until it returns, retrying only the exceptions in ``retry_on`` for
    which ``transient(error)`` holds (e.g. not a 403).

    At most ``backoff.attempts`` retries (it must be bounded); the last failure is
    re-raised. ``on_retry(error, pause_s)`` is told of each retry (log it there).
    """
    if backoff.attempts is None:
        raise ValueError("retry needs a bounded Backoff (attempts=N)")
    delays = backoff.delays()
    while True:
        try:
            return await call()
        except retry_on as exc:
            pause = next(delays, None) if transient(exc) else None
            if pause is None:
                raise
            if on_retry is not None:
                on_retry(exc, pause)
            await asyncio.sleep(pause)
