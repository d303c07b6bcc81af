"""The one retry schedule: bounded, jittered, exponential; and the retry loop around it."""

from __future__ import annotations

import asyncio
import random

import pytest

from driver.aio import Backoff, RetriesExhausted, retry


def test_pauses_grow_to_the_cap_within_their_jitter() -> None:
    pauses = list(Backoff(initial_s=1, max_s=4, factor=2, jitter=0.5, attempts=6)
                  .pauses(rng=random.Random(7)))
    assert len(pauses) == 5, "six attempts have five pauses between them"
    for pause, nominal in zip(pauses, [1, 2, 4, 4, 4], strict=True):
        assert nominal / 2 <= pause <= nominal


def test_no_jitter_is_exact() -> None:
    assert list(Backoff(initial_s=0.5, max_s=1, jitter=0, attempts=4).pauses()) == [
        0.5, 1, 1]


def test_a_deadline_bounds_the_schedule() -> None:
    now = [0.0]
    pauses = Backoff(initial_s=1, max_s=1, jitter=0, deadline_s=2.5).pauses(
        clock=lambda: now[0])
    taken = []
    for pause in pauses:
        taken.append(pause)
        now[0] += pause
    assert taken == [1, 1, 0.5]


@pytest.mark.parametrize("bad", [{"initial_s": 0}, {"initial_s": 2, "max_s": 1},
                                 {"jitter": 1.5}, {"attempts": 0}, {"factor": 0.5}])
def test_unusable_schedules_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        Backoff(**bad)  # type: ignore[arg-type]


async def test_retry_returns_the_first_success() -> None:
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "ok"

    seen: list[float] = []
    result = await retry(flaky, backoff=Backoff(initial_s=0.001, max_s=0.001, attempts=5),
                         retry_on=(ConnectionError,), on_failure=lambda e, p: seen.append(p))
    assert result == "ok"
    assert len(calls) == 3
    assert len(seen) == 2


async def test_retry_gives_up_with_the_last_error() -> None:
    async def always() -> None:
        raise ConnectionError("down")

    with pytest.raises(RetriesExhausted) as info:
        await retry(always, backoff=Backoff(initial_s=0.001, max_s=0.001, attempts=3),
                    retry_on=(ConnectionError,))
    assert isinstance(info.value.__cause__, ConnectionError)


async def test_other_errors_are_not_retried() -> None:
    calls = []

    async def broken() -> None:
        calls.append(1)
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await retry(broken, backoff=Backoff(attempts=5), retry_on=(ConnectionError,))
    assert calls == [1]


async def test_stop_ends_the_retries() -> None:
    stop = asyncio.Event()

    async def fail_then_stop() -> None:
        stop.set()
        raise ConnectionError("down")

    with pytest.raises(RetriesExhausted):
        await retry(fail_then_stop, backoff=Backoff(initial_s=60, max_s=60),
                    retry_on=(ConnectionError,), stop=stop)
