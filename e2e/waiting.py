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


def eventually(check: Callable[[], T], *, timeout: float, interval: float = 0.05,
               max_interval: float = 1.0, what: str = "condition") -> T:
    """Call ``check`` until it returns a truthy value without raising; return that value."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    delay = interval
    while True:
        try:
            result = check()
            if result:
                return result
            last = None
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f": {last!r}" if last else ""
            raise WaitTimeout(f"{what} not reached within {timeout:.1f}s{detail}") from last
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, max_interval)


async def eventually_async(check: Callable[[], Awaitable[T]], *, timeout: float,  # noqa: ASYNC109
                           interval: float = 0.05, what: str = "condition") -> T:
    """The asyncio twin of :func:`eventually`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    delay = interval
    while True:
        try:
            result = await check()
            if result:
                return result
            last = None
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f": {last!r}" if last else ""
            raise WaitTimeout(f"{what} not reached within {timeout:.1f}s{detail}") from last
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 1.0)
