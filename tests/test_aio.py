"""The shared backoff: bounded, growing, jittered, interruptible."""

from __future__ import annotations

import asyncio
import random

import pytest

from rota.kit.aio import Backoff, retry


def test_pauses_grow_to_the_ceiling_and_keep_a_jittered_floor() -> None:
    backoff = Backoff(first_s=0.1, max_s=0.8, jitter=0.5, attempts=6, rng=random.Random(7))
    delays = list(backoff.delays())
    ceilings = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    assert len(delays) == 6
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling


def test_reset_starts_over() -> None:
    backoff = Backoff(first_s=1.0, max_s=8.0, jitter=0.0)
    assert [backoff.next_delay() for _ in range(3)] == [1.0, 2.0, 4.0]
    backoff.reset()
    assert backoff.next_delay() == 1.0


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s=0)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=1.0)


async def test_retry_is_bounded_and_reraises_the_last_error() -> None:
    calls: list[int] = []
    seen: list[float] = []

    async def failing() -> int:
        calls.append(1)
        raise ConnectionError(f"attempt {len(calls)}")

    with pytest.raises(ConnectionError, match="attempt 3"):
        await retry(failing, retry_on=(ConnectionError,),
                    backoff=Backoff(first_s=0.001, max_s=0.002, attempts=2),
                    on_retry=lambda exc, pause: seen.append(pause))
    assert len(calls) == 3
    assert len(seen) == 2


async def test_retry_does_not_retry_other_errors() -> None:
    calls: list[int] = []

    async def wrong() -> int:
        calls.append(1)
        raise ValueError("not retried")

    with pytest.raises(ValueError, match="not retried"):
        await retry(wrong, retry_on=(ConnectionError,), backoff=Backoff(attempts=5))
    assert calls == [1]


async def test_retry_refuses_an_unbounded_backoff() -> None:
    async def ok() -> int:
        return 1

    with pytest.raises(ValueError, match="bounded"):
        await retry(ok, retry_on=(OSError,), backoff=Backoff())


async def test_a_stop_event_interrupts_the_pause() -> None:
    stop = asyncio.Event()
    stop.set()
    assert await Backoff(first_s=60.0, max_s=60.0).sleep(stop) is True
