"""rota's listeners: ``::`` is one dual-stack socket that answers over IPv4 and IPv6 (where
asyncio's own binding of ``::`` answers IPv6 only); any other address binds exactly that."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from rota.kit.listen import split_host_port, start_site
from tests.listening import NO_IPV6_LOOPBACK, has_ipv6_loopback, status_of

needs_ipv6_loopback = pytest.mark.skipif(not has_ipv6_loopback(), reason=NO_IPV6_LOOPBACK)


@pytest.mark.parametrize(("address", "host", "port"), [
    ("[::]:8090", "::", 8090), (":::8090", "::", 8090), ("0.0.0.0:8081", "0.0.0.0", 8081),
    ("127.0.0.1:0", "127.0.0.1", 0), ("[fd00::5]:80", "fd00::5", 80), (":8080", "", 8080),
    ("localhost:9000", "localhost", 9000),
])
def test_addresses_are_split_into_host_and_port(address: str, host: str, port: int) -> None:
    assert split_host_port(address) == (host, port)


@pytest.mark.parametrize("address", ["8090", "[::8090", "host:http", "host:70000"])
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(address))):
        split_host_port(address)


@asynccontextmanager
async def listening(host: str) -> AsyncIterator[int]:
    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await start_site(runner, host, 0)
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("host", ["::", "[::]"])
async def test_the_dual_stack_address_answers_over_ipv4(host: str) -> None:
    async with listening(host) as port:
        assert await status_of("127.0.0.1", port, "/ping") == 200


@needs_ipv6_loopback
@pytest.mark.parametrize("host", ["::", "[::]"])
async def test_the_dual_stack_address_answers_over_ipv6(host: str) -> None:
    async with listening(host) as port:
        assert await status_of("::1", port, "/ping") == 200
        assert await status_of("127.0.0.1", port, "/ping") == 200


@needs_ipv6_loopback
async def test_other_addresses_bind_exactly_that_family() -> None:
    async with listening("0.0.0.0") as port:
        assert await status_of("127.0.0.1", port, "/ping") == 200
        assert await status_of("::1", port, "/ping") is None
    async with listening("::1") as port:
        assert await status_of("::1", port, "/ping") == 200
        assert await status_of("127.0.0.1", port, "/ping") is None
