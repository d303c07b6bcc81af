"""Small asyncio helpers shared by rota's processes: waiting on events, finishing work that
must not be cut off, and the one way to back off between attempts (and to repeat a step).

Every retry in rota is bounded, grows its pause, jitters it, and can be interrupted. Write
it with :class:`Backoff` (the pauses) and, for a whole retried call, :func:`retry`; never
with a hand-written ``delay = min(delay * 2, ...)`` loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["Backoff", "both", "finish_first", "retry", "run_periodically", "wait_any"]

log = logging.getLogger(__name__)


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


async def both(first: Awaitable[T], second: Awaitable[U]) -> tuple[T, U]:
    """Await two independent calls at once: both results, or the error of the one that
    failed (the other is cancelled then, and so are both when the caller is)."""
    tasks = (asyncio.ensure_future(first), asyncio.ensure_future(second))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error
    return tasks[0].result(), tasks[1].result()


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


async def run_periodically(step: Callable[[], Awaitable[object]], *, stop: asyncio.Event,
                           interval: Backoff, on_error: Backoff, what: str) -> None:
    """Run ``step`` until ``stop`` is set: after a success pause ``interval``'s next delay,
    after a failure (logged) ``on_error``'s, reset by the next success. Pauses end at once
    when ``stop`` is set. ``Backoff(first_s=T, max_s=T, jitter=0.2)`` is a period of
    0.8-1 T.
    """
    while not stop.is_set():
        try:
            await step()
        except Exception as exc:
            pause = on_error
            log.warning(f"{what} failed; trying again", extra={"error": str(exc)[:300]})
        else:
            on_error.reset()
            pause = interval
        if await pause.sleep(stop):
            return
