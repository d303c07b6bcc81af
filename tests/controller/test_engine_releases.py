"""The adapter on releases other than 0.26 (issue 31): an engine outside the supported
range fails the claim's first probe with a reason that says so; 0.32+'s partial wake is
not awake; an engine whose ``/sleep`` no longer handles requests (vLLM RFC #51476) is never
put to sleep under running requests. Against the engine simulator of each release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.lease.engines import EngineEndpoint, EngineRejected, Timeouts, VllmAdapter
from controller.lease.engines.probe import probe_payload
from tests.controller.conftest import EngineSim, EngineSimFactory


@pytest.fixture
async def old_vllm() -> AsyncIterator[str]:
    """A vLLM 0.25: everything works, but its release is outside the range."""
    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.25.1"})

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in ('{"choices":[{"index":0,"delta":{"content":"7"}}]}',
                     '{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,'
                     '"total_tokens":2}}', "[DONE]"):
            await response.write(f"data: {data}\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_an_unsupported_release_fails_the_first_probe_with_a_clear_reason(
        old_vllm: str, engine_session: aiohttp.ClientSession) -> None:
    endpoint = EngineEndpoint(base_url=old_vllm, model="m", claim="ns/claim")
    result = await VllmAdapter(endpoint, engine_session, Timeouts()).probe()
    assert (result.ok, result.reason) == (False, "unsupported_engine")
    assert "0.25.1" in result.detail
    assert "0.26.0-0.34.0" in result.detail


async def test_a_partial_wake_of_0_34_is_not_awake(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """0.34 answers ``{"status": "sleeping"}`` when a wake left tags asleep (here the
    fault ``wake_ignored``: the wake did nothing); the 200 is not a wake."""
    sim = await engine_sim_factory(vllm_version="0.34.0")
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    await adapter.sleep(1)
    await sim.faults(wake_ignored=True)
    with pytest.raises(EngineRejected) as caught:
        await adapter.wake(1, confirm=False)
    assert "partial wake" in str(caught.value)


async def _running_request(sim: EngineSim, session: aiohttp.ClientSession
                           ) -> asyncio.Task[int]:
    await sim.faults(stall_generation=True)

    async def send() -> int:
        async with session.post(sim.base_url + "/v1/chat/completions",
                                json=probe_payload(sim.settings.model)) as resp:
            await resp.read()
            return resp.status

    task = asyncio.ensure_future(send())
    await sim.until(lambda: sim.engine.running == 1)
    return task


async def test_a_sleep_that_ignores_requests_is_never_sent_under_running_ones(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """RFC #51476: /sleep is a pure memory step. The adapter pauses with mode=wait first:
    the running request finishes, then the engine sleeps with nothing running."""
    sim = await engine_sim_factory(vllm_version="0.34.0", sleep_ignores_requests=True)
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    request = await _running_request(sim, engine_session)
    sleeping = asyncio.ensure_future(adapter.sleep(1))
    await sim.until(lambda: sim.engine.paused or sim.engine.pending_sleeps > 0)
    await sim.faults(stall_generation=False)
    await sleeping
    assert [s["running"] for s in sim.engine.sleeps] == [0]  # nothing ran under the sleep
    assert request.done()
    assert request.result() == 200
    await adapter.wake(1)
    assert not sim.engine.paused  # resumed after the wake
    assert (await adapter.probe()).ok
