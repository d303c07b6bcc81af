"""Small asyncio helpers shared by rota's processes, and the one retry schedule.

Every retry in rota is bounded, backs off exponentially and is jittered, through
:class:`Backoff` (a plain iterator of pauses, so threads and the stdlib-only start gate
use it too) and :func:`retry` (the asyncio loop around it, interruptible by an event).
This module imports nothing outside the standard library.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Backoff:
    """A bounded, jittered, exponential schedule of pauses between attempts.

    Attributes:
        initial_s: the pause after the first failed attempt (before jitter).
        max_s: no pause is longer than this.
        factor: each pause is this many times the previous one (until ``max_s``).
        jitter: each pause is drawn uniformly from ``[pause * (1 - jitter), pause]``, so
            that many clients that failed together do not retry together.
        attempts: how many attempts in all (None: no bound on the count; then a
            ``deadline_s`` or the caller's stop must bound the retries).
        deadline_s: no pause starts later than this many seconds after the schedule began
            (None: no bound on the time).
    """

    initial_s: float = 0.2
    max_s: float = 10.0
    factor: float = 2.0
    jitter: float = 0.5
    attempts: int | None = None
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s < self.initial_s or self.factor < 1:
            raise ValueError(f"not a usable backoff: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be within [0, 1], not {self.jitter}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")

    def pauses(self, *, rng: random.Random | None = None,
               clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
        """The pause before each further attempt; ends when the attempts or the deadline
        are used up (so ``attempts=3`` yields two pauses)."""
        draw = (rng or random).uniform
        began = clock()
        pause = self.initial_s
        made = 1
        while self.attempts is None or made < self.attempts:
            jittered = draw(pause * (1 - self.jitter), pause)
            if self.deadline_s is not None:
                left = self.deadline_s - (clock() - began)
                if left <= 0:
                    return
                jittered = min(jittered, left)
            yield jittered
            made += 1
            pause = min(pause * self.factor, self.max_s)


class RetriesExhausted(Exception):
    """Every attempt of :func:`retry` failed; the last error is the cause."""


async def retry(attempt: Callable[[], Awaitable[T]], *, backoff: Backoff,
                retry_on: tuple[type[BaseException], ...],
                stop: asyncio.Event | None = None,
                on_failure: Callable[[BaseException, float], None] | None = None) -> T:
    """Call ``attempt`` until it returns, pausing per ``backoff`` after each error of the
    ``retry_on`` kinds (any other error propagates at once).

    ``on_failure(error, pause)`` is told of every failure that is retried (for a log
    line). A set ``stop`` ends the pause early and the retries with them.

    Raises:
        RetriesExhausted: the schedule ran out or ``stop`` was set; the cause is the last
            error.
    """
    pauses = backoff.pauses()
    while True:
        try:
            return await attempt()
        except retry_on as exc:
            pause = next(pauses, None)
            if pause is None or (stop is not None and stop.is_set()):
                raise RetriesExhausted(str(exc) or type(exc).__name__) from exc
            if on_failure is not None:
                on_failure(exc, pause)
            if stop is not None:
                if await wait_any(stop, timeout_s=pause):
                    raise RetriesExhausted(str(exc) or type(exc).__name__) from exc
            else:
                await asyncio.sleep(pause)
