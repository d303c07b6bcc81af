"""Per-model gates: the limit, the bounded FIFO queue, deadlines, and places given back."""

from __future__ import annotations

import asyncio

import pytest

from controller.gateway.admission import Admission, ModelGate
from controller.gateway.errors import Overloaded, Unavailable
from tests.gateway.conftest import eventually

pytestmark = pytest.mark.gateway


def _gate(limit: int = 1, queue_size: int = 2) -> ModelGate:
    return ModelGate("m", limit=limit, queue_size=queue_size, retry_after=2)


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
    assert refused.value.retry_after == 2
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
    admission = Admission(limit=2, queue_size=0, retry_after=1)
    assert admission.gate("a") is admission.gate("a")
    assert admission.gate("a") is not admission.gate("b")
    assert set(admission.counts()) == {"a", "b"}
