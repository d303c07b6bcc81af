"""rota.kit.aio: work that is finished before a cancellation is raised, two calls at once, and
periodic steps."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from rota.kit.aio import Backoff, both, finish_first, run_periodically


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


async def test_both_runs_two_calls_at_once_and_returns_both_results() -> None:
    started: list[str] = []
    release, both_started = asyncio.Event(), asyncio.Event()

    async def call(name: str) -> str:
        started.append(name)
        if len(started) == 2:
            both_started.set()
        await release.wait()
        return name.upper()

    pair = asyncio.ensure_future(both(call("a"), call("b")))
    await asyncio.wait_for(both_started.wait(), 5)  # the second did not wait for the first
    assert sorted(started) == ["a", "b"]
    release.set()
    assert await pair == ("A", "B")


@pytest.mark.parametrize("failing", [0, 1])
async def test_both_raises_the_failed_calls_error_and_cancels_the_other(failing: int) -> None:
    cancelled: list[bool] = []
    waiting = asyncio.Event()

    async def fails() -> str:
        await waiting.wait()  # fail only once the other call is under way
        raise LookupError("no")

    async def waits() -> str:
        waiting.set()
        try:
            await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "late"

    calls = (fails(), waits()) if failing == 0 else (waits(), fails())
    async with asyncio.timeout(5):
        with pytest.raises(LookupError):
            await both(*calls)
    assert cancelled == [True]


async def test_a_cancelled_caller_of_both_cancels_both_calls() -> None:
    cancelled: list[int] = []
    running: list[int] = []
    both_running = asyncio.Event()

    async def waits(index: int) -> None:
        running.append(index)
        if len(running) == 2:
            both_running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(index)
            raise

    pair = asyncio.ensure_future(both(waits(0), waits(1)))
    await asyncio.wait_for(both_running.wait(), 5)
    pair.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pair
    assert sorted(cancelled) == [0, 1]
