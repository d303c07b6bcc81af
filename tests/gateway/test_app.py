"""The application's lifecycle and its secret files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controller.gateway.app import StartupError, make_app, serve
from controller.gateway.credentials import ApiKeys, SecretFile, bearer
from controller.gateway.routing import StaticSource
from controller.gateway.settings import GatewaySettings

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
