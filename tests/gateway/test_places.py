"""Per-model gates: the limit, the bounded FIFO queue, deadlines, and places given back."""

from __future__ import annotations

import asyncio

import pytest

from controller.gateway.errors import Overloaded, Unavailable
from controller.gateway.places import ModelGate, ModelPlaces
from tests.gateway.conftest import eventually

pytestmark = pytest.mark.gateway


def _gate(limit: int = 1, queue_size: int = 2, engines: int = 1) -> ModelGate:
    return ModelGate("m", limit_per_engine=limit, engines=lambda: engines,
                     queue_size=queue_size)


def _far() -> float:
    return asyncio.get_running_loop().time() + 30


async def _until_queued(gate: ModelGate, n: int) -> None:
    await eventually(lambda: gate.waiting == n, f"{n} waiting")


async def test_places_are_handed_on_in_arrival_order() -> None:
    gate = _gate(limit=1, queue_size=3)
    await gate.acquire(_far())
    order: list[int] = []

    async def wait(i: int) -> None:
        async with gate.place(_far()):
            order.append(i)

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(wait(i)))
        await _until_queued(gate, i + 1)
    gate.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (gate.running, gate.waiting) == (0, 0)


async def test_a_full_queue_refuses_at_once() -> None:
    gate = _gate(limit=1, queue_size=1)
    await gate.acquire(_far())
    queued = asyncio.create_task(gate.acquire(_far()))
    await _until_queued(gate, 1)
    with pytest.raises(Overloaded) as refused:
        await gate.acquire(_far())
    assert refused.value.retry_after is None  # the dispatcher says, from what it measured
    gate.release()
    await queued
    gate.release()
    assert gate.running == 0


async def test_a_deadline_gives_503_and_frees_the_queue_slot() -> None:
    gate = _gate(limit=1, queue_size=1)
    await gate.acquire(_far())
    with pytest.raises(Unavailable) as late:
        await gate.acquire(asyncio.get_running_loop().time() + 0.01)
    assert late.value.code == "queue_timeout"
    assert gate.waiting == 0
    gate.release()
    assert gate.running == 0


async def test_a_cancelled_waiter_frees_its_place_even_when_handed_one() -> None:
    gate = _gate(limit=1, queue_size=2)
    await gate.acquire(_far())
    first = asyncio.create_task(gate.acquire(_far()))
    second = asyncio.create_task(gate.acquire(_far()))
    await _until_queued(gate, 2)
    gate.release()  # hands the place to ``first``...
    first.cancel()  # ...which leaves before it runs again: the place goes on to ``second``
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert (gate.running, gate.waiting) == (1, 0)
    gate.release()
    assert gate.running == 0


def test_gates_are_per_model() -> None:
    places = ModelPlaces(limit_per_engine=2, engines=lambda model: 1, queue_size=0)
    assert places.gate("a") is places.gate("a")
    assert places.gate("a") is not places.gate("b")
    assert set(places.counts()) == {"a", "b"}


async def test_the_limit_is_per_engine_that_serves_the_model() -> None:
    gate = _gate(limit=2, queue_size=1, engines=3)
    for _ in range(6):
        await gate.acquire(_far())
    assert (gate.limit, gate.running, gate.waiting) == (6, 6, 0)
    queued = asyncio.create_task(gate.acquire(_far()))
    await _until_queued(gate, 1)
    gate.release()
    await queued
    assert (gate.running, gate.waiting) == (6, 0)


async def test_a_model_without_engines_still_has_one_engines_places() -> None:
    gate = _gate(limit=2, engines=0)
    await gate.acquire(_far())
    await gate.acquire(_far())
    assert (gate.limit, gate.running) == (2, 2)


async def test_places_an_added_engine_brings_go_to_the_queue_first() -> None:
    engines = [1]
    gate = ModelGate("m", limit_per_engine=1, engines=lambda: engines[0], queue_size=4)
    await gate.acquire(_far())
    first = asyncio.create_task(gate.acquire(_far()))
    await _until_queued(gate, 1)
    engines[0] = 2  # a second engine of the model came up
    second = asyncio.create_task(gate.acquire(_far()))
    async with asyncio.timeout(5):
        await first  # the newcomer's arrival handed the new place to the oldest waiter
    assert (gate.running, gate.waiting) == (2, 1)
    engines[0] = 1
    gate.release()  # one engine again: a place given back does not go on
    assert (gate.running, gate.waiting) == (1, 1)
    gate.release()
    await second
    assert (gate.running, gate.waiting) == (1, 0)


async def test_the_places_ask_how_many_engines_serve_each_model() -> None:
    counts = {"big": 4, "small": 1}
    places = ModelPlaces(limit_per_engine=8, engines=lambda model: counts.get(model, 0),
                          queue_size=1)
    assert places.gate("big").limit == 32
    assert places.gate("small").limit == 8
    counts["small"] = 2
    assert places.gate("small").limit == 16
