"""Injected faults, set at start or flipped at runtime through /sim/faults."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

from tests.simulator.conftest import (
    GIB,
    MODEL,
    PID,
    Sim,
    SimFactory,
    content_of,
    read_events,
)

WAKE_OOM_PREFIX = "Call to wake_up method failed: CUDA Error: out of memory at "


def registered_bytes(nvml_dir: Path) -> int:
    record = json.loads((nvml_dir / f"{PID}.json").read_text())
    return int(record["used_bytes"])


async def test_wake_fails_answers_vllm_500_and_keeps_memory_down(sim: Sim, nvml_dir: Path) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.faults(wake_fails=True)
    async with sim.client.post("/wake_up") as resp:
        assert resp.status == 500
        body = await resp.json()
    assert set(body) == {"error"}
    assert body["error"]["message"].startswith(WAKE_OOM_PREFIX)
    assert body["error"]["type"] == "InternalServerError"
    assert body["error"]["param"] is None
    assert body["error"]["code"] == 500
    assert await sim.is_sleeping()
    state = await sim.state()
    assert state["memory_bytes"] == 1 * GIB
    assert state["wake_failures"] == 1
    assert registered_bytes(nvml_dir) == 1 * GIB

    await sim.faults(wake_fails=False)
    await sim.post_empty("/wake_up")
    assert await sim.answer() == "7"


async def test_wake_hangs_until_cleared(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.faults(wake_hangs=True)
    waking = asyncio.create_task(sim.post_empty("/wake_up"))
    await sim.until(lambda: sim.engine.wake_hanging)
    assert await sim.is_sleeping()
    await sim.faults(wake_hangs=False)
    async with asyncio.timeout(10):
        await waking
    assert not await sim.is_sleeping()


async def test_wake_hang_ends_when_the_caller_leaves(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.faults(wake_hangs=True)
    url = sim.client.make_url("/wake_up")
    async with aiohttp.ClientSession() as session:
        waking = asyncio.create_task(session.post(url))
        await sim.until(lambda: sim.engine.wake_hanging)
        waking.cancel()
        try:
            await waking
        except asyncio.CancelledError:
            pass
    await sim.until(lambda: not sim.engine.wake_hanging)
    assert await sim.is_sleeping()  # the abandoned wake did nothing
    await sim.faults(wake_hangs=False)
    await sim.post_empty("/wake_up")
    assert not await sim.is_sleeping()


async def test_sleep_lies_keeps_the_memory(sim: Sim, nvml_dir: Path) -> None:
    await sim.faults(sleep_lies=True)
    await sim.post_empty("/sleep", level=1)
    assert await sim.is_sleeping()
    state = await sim.state()
    assert state["memory_bytes"] == 10 * GIB
    assert state["sleeps"][-1]["lied"]
    assert registered_bytes(nvml_dir) == 10 * GIB
    await sim.post_empty("/wake_up")
    assert (await sim.state())["memory_bytes"] == 10 * GIB
    assert await sim.answer() == "7"


async def test_crash_on_sleep_answers_200_then_exits(sim: Sim) -> None:
    await sim.faults(crash_on_sleep=True)
    await sim.post_empty("/sleep", level=1)
    async with asyncio.timeout(10):
        await sim.exited.wait()
    assert sim.exits == [70]


async def test_crash_now(sim: Sim) -> None:
    faults = await sim.faults(crash_now=True)
    assert faults["crash_now"]
    async with asyncio.timeout(10):
        await sim.exited.wait()
    assert sim.exits == [70]


async def test_refuse_while_asleep_flips_at_runtime(sim: Sim) -> None:
    async def chat_status() -> int:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "3 + 4"}]}
        async with sim.client.post("/v1/chat/completions", json=payload) as resp:
            return resp.status

    await sim.post_empty("/sleep", level=1)
    await sim.faults(refuse_while_asleep=False)
    waiting = asyncio.create_task(chat_status())
    await sim.until(lambda: sim.engine.waiting == 1)
    await sim.faults(refuse_while_asleep=True)  # the held request is refused now
    async with asyncio.timeout(10):
        assert await waiting == 503
    assert sim.engine.waiting == 0
    assert await chat_status() == 503


async def test_partial_stream_then_error(sim: Sim) -> None:
    await sim.faults(fail_mid_stream=True)
    payload = {"model": MODEL, "prompt": "3 + 4", "stream": True, "max_tokens": 5,
               "ignore_eos": True}
    async with sim.client.post("/v1/completions", json=payload) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert content_of(events) == "7"
    assert isinstance(events[-2], dict)
    assert "error" in events[-2]


async def test_faults_endpoint_validates(sim: Sim) -> None:
    async with sim.client.post("/sim/faults", json={"no_such_fault": True}) as resp:
        assert resp.status == 400
    async with sim.client.post("/sim/faults", json={"wake_fails": "sometimes"}) as resp:
        assert resp.status == 400
    async with sim.client.get("/sim/faults") as resp:
        assert (await resp.json())["wake_fails"] is False


async def test_faults_set_at_start(make_sim: SimFactory) -> None:
    sim = await make_sim(faults={"wake_fails": True})
    await sim.post_empty("/sleep", level=1)
    async with sim.client.post("/wake_up") as resp:
        assert resp.status == 500


async def test_sleep_ignored_answers_200_and_stays_awake(sim: Sim) -> None:
    await sim.faults(sleep_ignored=True)
    await sim.post_empty("/sleep", level=1)
    assert not await sim.is_sleeping()
    state = await sim.state()
    assert state["memory_bytes"] == 10 * GIB
    assert state["ignored_calls"] == 1
    assert state["sleeps"] == []
    assert await sim.answer() == "7"


async def test_wake_ignored_answers_200_and_stays_asleep(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.faults(wake_ignored=True)
    await sim.post_empty("/wake_up")
    assert await sim.is_sleeping()
    assert (await sim.state())["memory_bytes"] == 1 * GIB
    await sim.faults(wake_ignored=False)
    await sim.post_empty("/wake_up")
    assert await sim.answer() == "7"
