"""An engine API key that is a placeholder someone forgot to replace is refused with a 503
that says what to do, and logged; it is never sent to the engine (whose 401 would hide why).

The gateway here is the real one, fed a claim whose EngineConfig names an API key Secret
(read from an in-memory Secret store), in front of an engine simulator started with the
same key, as vLLM is with ``--api-key``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.gateway import keys
from controller.gateway.app import make_app
from controller.gateway.engine_keys import EngineKeys, StaticSecrets
from controller.gateway.errors import Unavailable
from controller.gateway.routing import RoutingState, StaticSource
from controller.gateway.settings import GatewaySettings
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    NAMESPACE,
    claim_obj,
    controller_lease,
    eventually,
    pod_obj,
    start_controller,
    start_sim,
)

pytestmark = pytest.mark.gateway

PLACEHOLDERS = ("changeme", "<your-api-key>", "replace-me-with-a-random-key", "xxxxxxxx")
REAL_KEY = "4f6c1d2e9a7b"
SECRET = "engine-key"

Gateway = Callable[[str], Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def gateway_with_engine_key() -> AsyncIterator[Gateway]:
    """A gateway whose one claimant (awake) names Secret ``engine-key`` holding a given
    value; its engine simulator demands that value as its API key."""
    closers: list[Callable[[], Awaitable[None]]] = []

    async def make(value: str) -> TestClient[Any, Any]:
        sim = await start_sim(MODEL_A, f"{NAMESPACE}/claim-a", api_key=value)
        closers.append(sim.client.close)
        states: list[RoutingState] = []
        controller, ctl = await start_controller({MODEL_A: sim}, states, holder=sim)
        closers.append(ctl.close)
        claim = claim_obj("claim-a", model=MODEL_A, port=sim.port, pod_uid="pod-a")
        config = claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        config["apiKeySecret"] = {"name": SECRET}
        source = StaticSource(claims=[claim], pods=[pod_obj("pod-claim-a", uid="pod-a")],
                              leases=[controller.lease_now(),
                                      controller_lease(str(ctl.make_url("")).rstrip("/"))])
        settings = GatewaySettings.model_validate({
            "host": "127.0.0.1", "port": 0, "max_wait_s": DEADLINE,
            "serving_namespaces": [NAMESPACE]})
        app = make_app(settings, routing_source=source,
                       secret_reader=StaticSecrets({(NAMESPACE, SECRET): {"api-key": value}}))
        states.append(app[keys.STATE])
        client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        closers.append(client.close)
        await eventually(lambda: app[keys.STATE].synced, "the gateway synced")
        return client

    try:
        yield make
    finally:
        for close in reversed(closers):
            await close()


async def _chat(gateway: TestClient[Any, Any]) -> tuple[int, dict[str, Any]]:
    async with gateway.post("/v1/chat/completions", json={
            "model": MODEL_A, "messages": [{"role": "user", "content": "hi"}]}) as resp:
        return resp.status, await resp.json()


async def test_a_real_engine_key_is_sent(gateway_with_engine_key: Gateway) -> None:
    status, body = await _chat(await gateway_with_engine_key(REAL_KEY))
    assert status == 200, body


@pytest.mark.parametrize("value", PLACEHOLDERS)
async def test_a_placeholder_engine_key_is_a_503_that_says_what_to_do(
        gateway_with_engine_key: Gateway, value: str, caplog: pytest.LogCaptureFixture) -> None:
    gateway = await gateway_with_engine_key(value)
    with caplog.at_level(logging.ERROR, logger="controller.gateway.engine_keys"):
        status, body = await _chat(gateway)
    assert status == 503, body
    error = body["error"]
    assert error["code"] == "engine_key_placeholder"
    assert error["type"] == "service_unavailable"
    assert f"Secret {NAMESPACE}/{SECRET}" in error["message"]
    assert "openssl rand -hex 32" in error["message"]  # the command that makes a real one
    assert value not in error["message"]
    logged = [r for r in caplog.records if "placeholder" in r.getMessage()]
    assert logged
    assert getattr(logged[0], "secret", None) == SECRET
    assert value not in str(vars(logged[0]))


async def test_a_placeholder_is_refused_from_the_cache_too() -> None:
    """The refusal is kept for the TTL like a key: one Secret read, then the same 503."""
    secrets = StaticSecrets({(NAMESPACE, SECRET): {"api-key": "CHANGE_ME"}})
    engine_keys = EngineKeys(secrets, ttl_s=3600)
    for _ in range(3):
        with pytest.raises(Unavailable) as refused:
            await engine_keys.key_for(NAMESPACE, (SECRET, "api-key"))
        assert refused.value.code == "engine_key_placeholder"
        assert refused.value.status == 503
    assert secrets.reads == 1
