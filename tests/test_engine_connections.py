"""rota.kit.engine_connections: a connection idle past the pool's bound is not reused, so a
call is never sent into a connection an engine closes after 5 s idle (vLLM's keep-alive),
where a sleep would fail with an unknown outcome."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from rota.kit.engine_connections import IDLE_CONNECTION_S, engine_connector


async def _peer_ports(session: aiohttp.ClientSession, url: str, *, idle_s: float
                      ) -> tuple[str, str]:
    """The client ports of two calls ``idle_s`` apart, as the server saw them."""
    async with session.get(url) as first:
        before = await first.text()
    await asyncio.sleep(idle_s)
    async with session.get(url) as second:
        after = await second.text()
    return before, after


async def test_a_connection_idle_past_the_bound_is_not_reused() -> None:
    async def peer(request: web.Request) -> web.Response:
        assert request.transport is not None
        return web.Response(text=str(request.transport.get_extra_info("peername")[1]))

    app = web.Application()
    app.router.add_get("/", peer)
    # a server that would keep the connection for a minute: the pool alone decides
    server = TestServer(app, keepalive_timeout=60)
    await server.start_server()
    try:
        url = str(server.make_url("/"))
        async with aiohttp.ClientSession(connector=engine_connector()) as session:
            quick = await _peer_ports(session, url, idle_s=0.0)
            idle = await _peer_ports(session, url, idle_s=IDLE_CONNECTION_S + 0.5)
        assert quick[0] == quick[1], "a connection just used is reused"
        assert idle[0] != idle[1], "a connection idle past the bound is reused"
        assert IDLE_CONNECTION_S < 5.0, "vLLM closes connections idle for 5 s"
    finally:
        await server.close()
