"""Every rota process names itself to the API server and limits its own request rate.

The requests go to a real HTTP listener on port 0 that records what it was sent; the
clients are the official client's, built as the processes build them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from importlib import metadata

import pytest
from aiohttp import web
from kubernetes import client

from controller.gateway import settings as gateway_settings
from controller.lease import settings as lease_settings
from driver import settings as driver_settings
from rota.kit import kube_client
from rota.kit.kube import Kube

pytestmark = pytest.mark.controller


@pytest.fixture
async def listener() -> AsyncIterator[tuple[str, list[str]]]:
    seen: list[str] = []

    async def node(request: web.Request) -> web.Response:
        seen.append(request.headers.get("User-Agent", ""))
        return web.json_response({"kind": "Node", "metadata": {"name": "n"}})

    app = web.Application()
    app.router.add_get("/api/v1/nodes/{name}", node)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def _api(host: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = host
    return client.ApiClient(configuration)


@pytest.mark.parametrize("component", ["rota-driver", "rota-controller", "rota-gateway",
                                       "kubectl-rota"])
async def test_each_component_sends_its_user_agent_with_the_package_version(
        listener: tuple[str, list[str]], component: str) -> None:
    host, seen = listener
    api = kube_client.apply(_api(host), kube_client.ClientAgent(component=component))
    await Kube(api, timeout_s=5).get_node("n")
    assert seen == [f"{component}/{metadata.version('rota')}"]


async def test_the_process_agent_is_used_when_none_is_given(
        listener: tuple[str, list[str]]) -> None:
    host, seen = listener
    before = kube_client.process_agent()
    kube_client.use(kube_client.ClientAgent(component="rota-controller"))
    try:
        api = kube_client.apply(_api(host))
    finally:
        kube_client.use(before)
    await Kube(api, timeout_s=5).get_node("n")
    assert seen[0].startswith("rota-controller/")


async def test_requests_beyond_the_burst_wait_for_tokens(
        listener: tuple[str, list[str]]) -> None:
    host, seen = listener
    api = kube_client.apply(_api(host), kube_client.ClientAgent(
        component="rota-driver", qps=20.0, burst=2))
    kube = Kube(api, timeout_s=5)
    started = time.monotonic()
    for _ in range(6):
        await kube.get_node("n")
    elapsed = time.monotonic() - started
    assert len(seen) == 6
    assert elapsed >= (6 - 2) / 20.0 * 0.9  # four requests waited a twentieth of a second


def test_the_bucket_refills_at_qps_up_to_burst() -> None:
    now = [0.0]
    bucket = kube_client.TokenBucket(qps=5.0, burst=10, clock=lambda: now[0])
    waits = [bucket.reserve() for _ in range(12)]
    assert waits[:10] == [0.0] * 10
    assert waits[10:] == [pytest.approx(0.2), pytest.approx(0.4)]
    now[0] = 100.0  # a quiet spell refills to the burst, not beyond
    assert [bucket.reserve() for _ in range(10)] == [0.0] * 10
    assert bucket.reserve() > 0


def test_the_limits_are_settings_with_env_vars() -> None:
    env = {"ROTA_API_QPS": "7.5", "ROTA_API_BURST": "15", "NODE_NAME": "n",
           "ROTA_GATEWAY_API_QPS": "7.5", "ROTA_GATEWAY_API_BURST": "15"}
    lease = lease_settings.load([], env)
    driver = driver_settings.load([], env)
    gateway = gateway_settings.load([], env)
    assert (lease.api_qps, lease.api_burst) == (7.5, 15)
    assert (driver.api_qps, driver.api_burst) == (7.5, 15)
    assert (gateway.api_qps, gateway.api_burst) == (7.5, 15)
