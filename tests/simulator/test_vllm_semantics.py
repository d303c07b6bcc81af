"""vLLM 0.26's traps, as verified on a real H200 and read in its source, and the named
kinder faults that switch each one off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from e2e.engine_simulator import engine as engine_module
from e2e.engine_simulator.engine import SERVER_EXIT_CODE
from e2e.engine_simulator.errors import ENGINE_DEAD_MESSAGE
from tests.simulator.conftest import DEADLINE, GIB, MODEL, PID, Sim, SimFactory, next_event

STREAM = {"model": MODEL, "stream": True, "max_tokens": 5, "ignore_eos": True,
          "messages": [{"role": "user", "content": "3 + 4"}]}
DEAD = {"error": {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "param": None,
                  "code": 500}}


async def abandon_sleep(sim: Sim, **params: str) -> None:
    """Send /sleep and give up before it answers (the client closes the connection)."""
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(sim.client.make_url("/sleep"), params=params))
        await sim.until(lambda: sim.engine.pending_sleeps == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await sim.until(lambda: sim.engine.abandoned_sleeps == 1)


async def fire_an_abandoned_sleep(sim: Sim) -> None:
    """The H200 reproduction up to the trap: a long generation runs, /sleep?mode=wait is
    abandoned, a /wake_up answers 200 (is_sleeping false); when the generation ends the
    pending sleep fires anyway, with the scheduler on (the next request kills the core)."""
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=STREAM) as running:
        await next_event(running)
        await abandon_sleep(sim, level="1", mode="wait")
        assert await sim.is_sleeping()  # the scheduler is paused, nothing freed yet
        await sim.post_empty("/wake_up")  # the executor is awake: only resumes the scheduler
        assert not await sim.is_sleeping()
        assert (await sim.state())["memory_bytes"] == 10 * GIB
        await sim.faults(stall_generation=False)
        await running.read()
    await sim.until(lambda: sim.engine.pending_sleeps == 0)
    assert await sim.is_sleeping()  # it fired: the engine fell asleep with scheduling on
    state = await sim.state()
    assert state["memory_bytes"] == 1 * GIB
    assert state["scheduler"] == "running"
    assert state["sleeps"][-1]["abandoned"]


async def kill_the_core(sim: Sim, *, streamed: bool = False) -> None:
    """A request scheduled on the sleeping executor: the engine core dies. A plain request
    is answered 500; a stream already has its 200 and ends with an error event."""
    await fire_an_abandoned_sleep(sim)
    payload = STREAM if streamed else {"model": MODEL,
                                       "messages": [{"role": "user", "content": "3 + 4"}]}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        if streamed:
            assert resp.status == 200
            assert "EngineCore encountered an issue" in await resp.text()
        else:
            assert resp.status == 500
            assert await resp.json() == DEAD
    assert sim.engine.dead is not None


async def test_an_abandoned_sleep_fires_after_a_wake_and_kills_the_engine(sim: Sim) -> None:
    await kill_the_core(sim)
    for method, path in (("GET", "/is_sleeping"), ("POST", "/wake_up"), ("POST", "/sleep"),
                         ("GET", "/v1/models")):
        async with sim.client.request(method, path) as resp:
            assert resp.status == 500, path
            assert await resp.json() == DEAD
    async with sim.client.get("/health") as resp:
        assert resp.status == 503
    for path in ("/metrics", "/metrics/"):
        async with sim.client.get(path) as resp:
            assert resp.status == 200, path
    async with asyncio.timeout(DEADLINE):  # an EngineDeadError answer ends vLLM's server
        await sim.exited.wait()
    assert sim.exits == [SERVER_EXIT_CODE]


async def test_a_dead_core_frees_its_memory_and_the_watchdog_ends_the_server(
        make_sim: SimFactory, nvml_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine core process exits on its fatal error (the GPU frees its memory),
    and the API server's watchdog ends the server without any further call (the stream
    that met the death had its 200 already, so no handler of EngineDeadError ran)."""
    monkeypatch.setattr(engine_module, "WATCHDOG_SECONDS", 0.2)
    sim = await make_sim()
    await kill_the_core(sim, streamed=True)
    assert (await sim.state())["memory_bytes"] == 0
    assert not (nvml_dir / f"{PID}.json").exists()
    async with asyncio.timeout(DEADLINE):
        await sim.exited.wait()
    assert sim.exits == [SERVER_EXIT_CODE]


async def test_keep_alive_on_engine_death_keeps_the_dead_server_up(
        make_sim: SimFactory, nvml_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "WATCHDOG_SECONDS", 0.05)
    sim = await make_sim(keep_alive_on_engine_death=True)
    await kill_the_core(sim)
    looked = sim.engine.watchdog_looks
    await sim.until(lambda: sim.engine.watchdog_looks >= looked + 3)
    async with sim.client.get("/health") as resp:
        assert resp.status == 503
    assert sim.exits == []
    assert not (nvml_dir / f"{PID}.json").exists()  # the core's process is gone all the same


async def test_sleep_cancelled_with_client_is_a_named_kinder_fault(make_sim: SimFactory
                                                                   ) -> None:
    sim = await make_sim(faults={"sleep_cancelled_with_client": True})
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=STREAM) as running:
        await next_event(running)
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(session.post(sim.client.make_url("/sleep"),
                                                    params={"mode": "wait"}))
            await sim.until(lambda: sim.engine.pending_sleeps == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await sim.until(lambda: sim.engine.pending_sleeps == 0)
        assert not await sim.is_sleeping()
        await sim.faults(stall_generation=False)
        await running.read()
    assert await sim.answer() == "7"
    assert (await sim.state())["sleeps"] == []


async def test_a_sleep_still_waiting_answers_when_it_fires(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=STREAM) as running:
        await next_event(running)
        sleeping = asyncio.create_task(sim.post_empty("/sleep", mode="wait"))
        await sim.until(lambda: sim.engine.pending_sleeps == 1)
        assert not sleeping.done()
        await sim.faults(stall_generation=False)
        await running.read()
    async with asyncio.timeout(DEADLINE):
        await sleeping
    assert (await sim.state())["memory_bytes"] == 1 * GIB


async def test_a_half_done_level2_wake_cannot_be_undone_by_sleep(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    await sim.post_empty("/wake_up", tags="weights")
    assert (await sim.state())["memory_bytes"] == 7 * GIB
    await sim.post_empty("/sleep", level=2)  # "Executor is already sleeping"
    state = await sim.state()
    assert state["memory_bytes"] == 7 * GIB
    assert state["tags_asleep"] == ["kv_cache"]
    assert await sim.is_sleeping()
    await sim.reload_weights()  # finishing the wake is the way out
    await sim.post_empty("/wake_up", tags="kv_cache")
    await sim.reset_prefix_cache()
    assert await sim.answer() == "7"
    await sim.post_empty("/sleep", level=2)
    assert (await sim.state())["memory_bytes"] == 1 * GIB


async def test_requests_held_during_a_half_done_wake_wait_for_its_end(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    await sim.post_empty("/wake_up", tags="weights")
    held = asyncio.create_task(sim.answer())
    await sim.until(lambda: sim.engine.waiting == 1)
    await sim.reload_weights()
    await sim.post_empty("/wake_up", tags="kv_cache")
    async with asyncio.timeout(DEADLINE):
        assert await held in ("7", "42")  # the prefix reset raced the held request


async def test_reset_prefix_cache_fails_while_requests_run(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=STREAM) as running:
        await next_event(running)
        assert await sim.post_json("/reset_prefix_cache") == {"success": False}
        await sim.faults(stall_generation=False)
        await running.read()
    await sim.until(lambda: sim.engine.running == 0)
    assert await sim.post_json("/reset_prefix_cache") == {"success": True}


async def test_reload_weights_fails_under_dummy_weights(make_sim: SimFactory) -> None:
    sim = await make_sim(load_format="dummy")
    await sim.post_empty("/sleep", level=2)
    await sim.post_empty("/wake_up", tags="weights")
    async with sim.client.post("/collective_rpc", json={"method": "reload_weights"}) as resp:
        assert resp.status == 500
        body = await resp.json()
    assert body["error"]["message"] == ("Call to collective_rpc method failed: Model "
                                        "reloading with dummy format")


async def test_empty_rpc_answers_is_a_named_kinder_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(faults={"empty_rpc_answers": True})
    await sim.post_empty("/reset_prefix_cache")
    async with sim.client.post("/collective_rpc", json={"method": "reload_weights"}) as resp:
        assert resp.status == 200
        assert await resp.read() == b""


async def test_dev_routes_are_404_without_dev_mode(make_sim: SimFactory) -> None:
    sim = await make_sim(dev_mode=False)
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")):
        async with sim.client.request(method, path) as resp:
            assert resp.status == 404, path
    async with sim.client.get("/health") as resp:
        assert resp.status == 200
    assert await sim.answer() == "7"


async def test_idle_connections_are_closed_by_the_server(make_sim: SimFactory) -> None:
    sim = await make_sim(keep_alive_seconds=0.2)
    host, port = sim.client.host, sim.client.port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(DEADLINE):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.read() == b""  # EOF: the server closed the idle connection
    finally:
        writer.close()


async def test_drop_reused_connections_drops_the_second_request(sim: Sim) -> None:
    await sim.faults(drop_reused_connections=True)
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(sim.client.make_url("/health")) as resp:
            assert resp.status == 200
            await resp.read()
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with session.post(sim.client.make_url("/wake_up")) as resp:
                await resp.read()
        async with session.post(sim.client.make_url("/wake_up")) as resp:  # a fresh one
            assert resp.status == 200
