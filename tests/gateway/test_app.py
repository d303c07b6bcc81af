"""The application's lifecycle and its secret files."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path

import pytest
from aiohttp import web

from controller.credentials import ApiKeys, SecretFile, bearer, reload_forever
from controller.gateway import keys
from controller.gateway.app import StartupError, make_app, serve
from controller.gateway.routing import StaticSource
from controller.gateway.settings import GatewaySettings
from e2e.harness.waiting import eventually_async
from tests.listening import free_port, has_ipv6_loopback, status_of, wait_listening

pytestmark = pytest.mark.gateway


async def test_serve_starts_and_stops_cleanly() -> None:
    settings = GatewaySettings(host="127.0.0.1", port=0)
    stop = asyncio.Event()
    server = asyncio.create_task(serve(settings, app=make_app(
        settings, routing_source=StaticSource()), stop=stop))
    stop.set()
    async with asyncio.timeout(30):
        await server


async def test_an_unreadable_secret_file_stops_startup(tmp_path: Path) -> None:
    settings = GatewaySettings(host="127.0.0.1", port=0,
                               activation_token_file=tmp_path / "missing")
    with pytest.raises(StartupError, match="missing"):
        await serve(settings, app=make_app(settings, routing_source=StaticSource()),
                    stop=asyncio.Event())


async def test_api_keys_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# clients\nalpha\n\n  beta  \n")
    secret = SecretFile(path)
    await secret.load()
    keys = ApiKeys(secret)
    assert keys.admits("Bearer alpha")
    assert keys.admits("bearer beta")
    assert not keys.admits("Bearer # clients")
    assert not keys.admits("Bearer gamma")
    assert not keys.admits(None)
    path.write_text("gamma\n")  # a rotated Secret
    await secret.load()
    assert keys.admits("Bearer gamma")
    assert not keys.admits("Bearer alpha")
    assert ApiKeys(None).admits(None)
    assert bearer("Basic abc") is None


class _CountedSecret(SecretFile):
    """A secret file that counts its reads (so a test knows a re-read happened)."""

    reads = 0

    async def load(self) -> None:
        self.reads += 1
        await super().load()


async def test_a_secret_that_is_not_utf8_keeps_the_last_value_and_the_reloader_alive(
        tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("good-token\n")
    secret = _CountedSecret(path)
    await secret.load()
    reloader = asyncio.create_task(reload_forever([secret], 0.01))
    try:
        path.write_bytes(b"\xff\xfe rotated\n")  # a Secret value that is not UTF-8
        seen = secret.reads

        async def re_read_twice() -> bool:
            return secret.reads >= seen + 2 or reloader.done()

        await eventually_async(re_read_twice, timeout=10, what="the bad Secret re-read")
        assert not reloader.done(), reloader.exception()
        assert secret.lines == ("good-token",)
        path.write_text("new-token\n")  # the admin fixes it

        async def reloaded() -> bool:
            return secret.lines == ("new-token",)

        await eventually_async(reloaded, timeout=10, what="the fixed Secret re-read")
    finally:
        reloader.cancel()
        with suppress(asyncio.CancelledError):
            await reloader


async def test_a_secret_file_that_is_not_utf8_is_a_startup_error(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_bytes(b"\xff\xfe\n")
    settings = GatewaySettings(host="127.0.0.1", port=0, api_keys_file=path)
    with pytest.raises(StartupError, match="not UTF-8"):
        await serve(settings, app=make_app(settings, routing_source=StaticSource()),
                    stop=asyncio.Event())


async def test_failed_secret_re_reads_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("alpha\n")
    settings = GatewaySettings(host="127.0.0.1", port=0, api_keys_file=path,
                               secret_reload_s=0.01)
    app = make_app(settings, routing_source=StaticSource())
    stop = asyncio.Event()
    server = asyncio.create_task(serve(settings, app=app, stop=stop))
    try:
        await eventually_async(_ready(app), timeout=30, what="the gateway started")
        path.write_bytes(b"\xff\n")
        metrics = app[keys.METRICS]

        async def counted() -> bool:
            return b'rota_gateway_secret_reload_failures_total{file="api_keys"} ' in \
                metrics.render() and b'file="api_keys"} 0.0' not in metrics.render()

        await eventually_async(counted, timeout=10, what="the failed re-read counted")
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await server


def _ready(app: web.Application) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return keys.METRICS in app and keys.DISPATCHER in app
    return check


async def test_on_the_dual_stack_address_the_gateway_answers_ipv4_and_ipv6() -> None:
    """``::`` (the chart's default) takes IPv4 connections too: the kubelet probes an
    IPv4 pod's address; on an IPv6 pod, its IPv6 one."""
    port = free_port()
    settings = GatewaySettings(host="::", port=port, shutdown_delay_s=0)
    stop = asyncio.Event()
    server = asyncio.create_task(serve(settings, app=make_app(
        settings, routing_source=StaticSource()), stop=stop))
    try:
        await wait_listening(port, host="::1" if has_ipv6_loopback() else "127.0.0.1")
        assert await status_of("127.0.0.1", port, "/healthz") == 200
        if has_ipv6_loopback():
            assert await status_of("::1", port, "/healthz") == 200
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await server
