"""The one wait on an engine's work in flight (drain and coalescing)."""

from __future__ import annotations

import asyncio

import pytest

from controller.lease.engines.base import EngineAdapter
from controller.lease.in_flight import until_idle

pytestmark = pytest.mark.controller


class _InFlightSimulator:
    """Answers a scripted series of in-flight counts (the last one repeats)."""

    def __init__(self, *counts: int | None) -> None:
        self.counts = list(counts)
        self.reads = 0

    async def in_flight(self) -> int | None:
        self.reads += 1
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def _engine(sim: _InFlightSimulator) -> EngineAdapter:
    return sim  # type: ignore[return-value]


async def test_it_ends_when_the_work_does() -> None:
    sim = _InFlightSimulator(3, 2, 1, 0)
    loop = asyncio.get_running_loop()
    assert await until_idle(_engine(sim), deadline=loop.time() + 30, clock=loop.time) == 0
    assert sim.reads == 4


async def test_an_engine_without_the_metric_is_not_waited_for() -> None:
    sim = _InFlightSimulator(None)
    loop = asyncio.get_running_loop()
    assert await until_idle(_engine(sim), deadline=loop.time() + 30, clock=loop.time) is None
    assert sim.reads == 1


async def test_the_deadline_ends_it_with_the_work_left() -> None:
    sim = _InFlightSimulator(5)
    loop = asyncio.get_running_loop()
    assert await until_idle(_engine(sim), deadline=loop.time() + 0.05, clock=loop.time) == 5


async def test_a_stop_ends_it_at_once() -> None:
    sim = _InFlightSimulator(5)
    stop = asyncio.Event()
    stop.set()
    loop = asyncio.get_running_loop()
    assert await until_idle(_engine(sim), deadline=loop.time() + 30, clock=loop.time,
                            stop=stop) == 5
    assert sim.reads == 1
