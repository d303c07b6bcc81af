"""A request that asks for an activation just after the last one waiting for it left (its
call cancelled, not yet finished) gets an answer of its own, never the cancellation of a
call it did not give up (a lost request). Real HTTP: a controller that takes a moment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.gateway.activation import Activator
from controller.gateway.metrics import GatewayMetrics
from rota.api.activation import PATH, ActivateAnswer

pytestmark = pytest.mark.gateway


@pytest.fixture
async def slow_controller() -> AsyncIterator[tuple[str, list[str], asyncio.Event]]:
    calls: list[str] = []
    asked = asyncio.Event()

    async def activate(request: web.Request) -> web.Response:
        calls.append("asked")
        asked.set()
        await asyncio.sleep(0.3)
        body = await request.json()
        return web.json_response(ActivateAnswer(model=body["model"], claim=body["claim"],
                                                switched=True, fence=2).model_dump())

    app = web.Application()
    app.router.add_post(PATH, activate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), calls, asked
    finally:
        await server.close()


async def test_a_request_arriving_as_the_last_waiter_leaves_gets_its_answer(
        slow_controller: tuple[str, list[str], asyncio.Event]) -> None:
    url, calls, asked = slow_controller
    async with aiohttp.ClientSession() as session:
        activator = Activator(session, None, timeout_s=5, connect_timeout_s=1, attempts=1,
                              retry_after=1.0, metrics=GatewayMetrics(dict))
        deadline = asyncio.get_running_loop().time() + 10
        first = asyncio.create_task(activator.activate(url, "org/m", "prod/m",
                                                       deadline=deadline))
        async with asyncio.timeout(5):
            await asked.wait()  # its call is at the controller
        first.cancel()  # its client left: the call is cancelled ...
        await asyncio.sleep(0)  # ... and the cancellation has run, the call not finished
        async with asyncio.timeout(5):
            answer = await activator.activate(url, "org/m", "prod/m", deadline=deadline)
        await asyncio.gather(first, return_exceptions=True)
        await activator.close()
    assert answer.switched
    assert calls == ["asked", "asked"]
