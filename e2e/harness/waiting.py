"""Bounded waiting on conditions: the only way rota's tests and scripts wait.

``eventually`` polls a check until it passes or a deadline runs out, then fails with the
last error, so a test that times out says what it was waiting for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold before the deadline."""


class _Attempts:
    """The deadline and the growing pause between attempts, shared by both waits."""

    def __init__(self, *, timeout: float, interval: float, max_interval: float,
                 what: str) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.delay = interval
        self.max_interval = max_interval
        self.what = what

    def failed(self, error: BaseException | None) -> float:
        """Note an attempt that did not pass; the pause before the next one.

        Raises:
            WaitTimeout: the deadline has passed; it carries the last error.
        """
        now = time.monotonic()
        if now >= self.deadline:
            detail = f": {error!r}" if error else ""
            raise WaitTimeout(f"{self.what} not reached within {self.timeout:.1f}s{detail}"
                              ) from error
        pause = min(self.delay, self.deadline - now)
        self.delay = min(self.delay * 1.5, self.max_interval)
        return pause


def eventually(check: Callable[[], T], *, timeout: float, interval: float = 0.05,
               max_interval: float = 1.0, what: str = "condition") -> T:
    """Call ``check`` until it returns a truthy value without raising; return that value."""
    attempts = _Attempts(timeout=timeout, interval=interval, max_interval=max_interval,
                         what=what)
    while True:
        error: BaseException | None = None
        try:
            result = check()
            if result:
                return result
        except Exception as exc:
            error = exc
        time.sleep(attempts.failed(error))


async def eventually_async(check: Callable[[], Awaitable[T]], *, timeout: float,  # noqa: ASYNC109
                           interval: float = 0.05, max_interval: float = 1.0,
                           what: str = "condition") -> T:
    """The asyncio twin of :func:`eventually`."""
    attempts = _Attempts(timeout=timeout, interval=interval, max_interval=max_interval,
                         what=what)
    while True:
        error: BaseException | None = None
        try:
            result = await check()
            if result:
                return result
        except Exception as exc:
            error = exc
        await asyncio.sleep(attempts.failed(error))
