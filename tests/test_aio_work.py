"""driver.aio: work that is finished before a cancellation is raised, and periodic steps."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from driver.aio import Backoff, finish_first, run_periodically


async def test_a_cancelled_caller_waits_for_the_work_then_gets_its_cancellation() -> None:
    release = threading.Event()
    finished = threading.Event()
    noticed: list[bool] = []

    def work() -> str:
        release.wait(30)
        finished.set()
        return "done"

    started = asyncio.Event()

    async def caller() -> str:
        started.set()
        return await finish_first(asyncio.to_thread(work), on_cancel=lambda: noticed.append(True))

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    cancelled_again = asyncio.get_running_loop().call_soon(task.cancel)  # a second cancel
    done, _ = await asyncio.wait({task}, timeout=0)
    assert not done
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set(), "the cancellation came before the work was done"
    assert noticed == [True]
    cancelled_again.cancel()


async def test_an_error_of_the_work_wins_over_the_cancellation() -> None:
    release = threading.Event()

    def work() -> None:
        release.wait(30)
        raise OSError("disk")

    task = asyncio.create_task(finish_first(asyncio.to_thread(work)))
    await asyncio.wait({task}, timeout=0)
    task.cancel()
    release.set()
    with pytest.raises(OSError, match="disk"):
        await task


async def test_finish_first_returns_the_result_without_cancellation() -> None:
    assert await finish_first(asyncio.to_thread(lambda: 7)) == 7


async def test_run_periodically_backs_off_after_failures_and_stops() -> None:
    stop = asyncio.Event()
    calls: list[str] = []

    async def step() -> None:
        calls.append("call")
        if len(calls) in (2, 3):
            raise RuntimeError("transient")
        if len(calls) == 5:
            stop.set()

    rng = random.Random(1)
    await run_periodically(step, stop=stop, what="test step",
                           interval=Backoff(first_s=0.001, max_s=0.001, jitter=0.2, rng=rng),
                           on_error=Backoff(first_s=0.001, max_s=0.004, rng=rng))
    assert len(calls) == 5
