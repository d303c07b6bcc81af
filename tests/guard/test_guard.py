"""The engine guard in front of an engine simulator listening on loopback: what it lets
through, with which credential, and how it passes answers back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.credentials import Credential, FixedCredential
from controller.guard.paths import Access, classify
from controller.guard.proxy import make_app
from controller.guard.settings import GuardSettings
from controller.lease.engines import (
    CONTROL_TOKEN_HEADER,
    EngineEndpoint,
    EngineRejected,
    SleepStateKind,
    Timeouts,
    VllmAdapter,
    VllmOmniAdapter,
)
from e2e.engine_simulator import Settings, create_app
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.settings import FaultsPatch

MODEL = "sim/guarded"
TOKEN = "rota-control-1"
KEY = "sk-engine-1"
DEADLINE = 10.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}]}


@dataclass
class Guarded:
    """A simulator on loopback and the guard in front of it."""

    engine: Engine
    upstream: TestServer
    guard: TestServer
    key_file: Path

    @property
    def url(self) -> str:
        return str(self.guard.make_url("")).rstrip("/")

    def endpoint(self, *, token: str | None = TOKEN, api_key: str | None = KEY
                 ) -> EngineEndpoint:
        return EngineEndpoint(base_url=self.url, model=MODEL, claim="ns/guarded",
                              token=token, api_key=api_key)

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(DEADLINE):
            await self.engine.wait_for(predicate)


GuardFactory = Callable[..., Awaitable[Guarded]]


@pytest.fixture
async def make_guarded(tmp_path: Path) -> AsyncIterator[GuardFactory]:
    servers: list[TestServer] = []

    async def make(*, api_key: bool = True, sim: dict[str, Any] | None = None,
                   **guard: Any) -> Guarded:
        values: dict[str, Any] = {"model": MODEL, "dev_mode": True,
                                  "shutdown_grace_seconds": 0.0} | (sim or {})
        app = create_app(Settings.model_validate(values), exit_process=lambda code: None)
        upstream = TestServer(app, host="127.0.0.1", port=0)
        await upstream.start_server()
        servers.append(upstream)
        key_file = tmp_path / "api-key"
        key_file.write_text(KEY + "\n")
        settings = GuardSettings.model_validate({
            "upstream": str(upstream.make_url("")),
            "api_key_file": key_file if api_key else None, "token_recheck_s": 0.0} | guard)
        control = FixedCredential(TOKEN)  # the claim's, from the guard's CDI environment
        key = None
        if api_key:
            key = Credential(key_file, recheck_s=settings.token_recheck_s)
            await key.load()
        server = TestServer(make_app(settings, control=control, api_key=key),
                            host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return Guarded(app[ENGINE_KEY], upstream, server, key_file)

    try:
        yield make
    finally:
        for server in reversed(servers):
            await server.close()


@pytest.fixture
async def guarded(make_guarded: GuardFactory) -> Guarded:
    return await make_guarded()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def control(token: str = TOKEN) -> dict[str, str]:
    return {CONTROL_TOKEN_HEADER: token}


def bearer(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- what goes through, with which credential --------------------------------------------


@pytest.mark.parametrize(("method", "path", "access"), [
    ("POST", "/v1/chat/completions", Access.CLIENT), ("GET", "/v1/models", Access.CLIENT),
    ("POST", "/tokenize", Access.CLIENT), ("POST", "/sleep", Access.CONTROL),
    ("POST", "/wake_up", Access.CONTROL), ("GET", "/is_sleeping", Access.CONTROL),
    ("POST", "/collective_rpc", Access.CONTROL), ("GET", "/metrics", Access.CONTROL),
    ("GET", "/metrics/", Access.CONTROL), ("GET", "/metrics/x", Access.HIDDEN),
    ("POST", "/reset_prefix_cache", Access.CONTROL), ("POST", "/v1/omni/sleep", Access.CONTROL),
    ("GET", "/health", Access.HEALTH), ("POST", "/pause", Access.CONTROL),
    ("POST", "/resume", Access.CONTROL), ("GET", "/version", Access.CONTROL),
    ("POST", "/abort_requests", Access.HIDDEN), ("GET", "/is_paused", Access.CONTROL),
    ("GET", "/sleep", Access.HIDDEN), ("GET", "/sim/state", Access.HIDDEN),
    ("POST", "/update_weights", Access.HIDDEN), ("GET", "/v1x", Access.HIDDEN),
])
def test_every_path_has_one_treatment(method: str, path: str, access: Access) -> None:
    assert classify(method, path) is access


async def test_control_calls_need_the_control_token(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    """Behind the guard, what vLLM leaves open is closed: no /sleep without rota's token,
    and the engine's API key (a client credential) does not open it either."""
    for headers in ({}, control("wrong"), bearer(), {"Authorization": f"Bearer {TOKEN}"}):
        async with session.post(f"{guarded.url}/sleep", headers=headers) as resp:
            assert resp.status == 401, headers
            assert await resp.json() == {"error": "Unauthorized"}
    assert not guarded.engine.is_sleeping
    async with session.post(f"{guarded.url}/sleep", headers=control()) as resp:
        assert resp.status == 200
    assert guarded.engine.state.is_sleeping


async def test_the_openai_surface_needs_the_api_key(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    for headers in ({}, bearer("wrong"), control()):
        async with session.post(f"{guarded.url}/v1/chat/completions", json=CHAT,
                                headers=headers) as resp:
            assert resp.status == 401, headers
    async with session.post(f"{guarded.url}/v1/chat/completions", json=CHAT,
                            headers=bearer()) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "7"


async def test_without_an_api_key_file_the_openai_surface_is_open(
    make_guarded: GuardFactory, session: aiohttp.ClientSession
) -> None:
    guarded = await make_guarded(api_key=False)
    async with session.get(f"{guarded.url}/v1/models") as resp:
        assert resp.status == 200
    async with session.post(f"{guarded.url}/sleep") as resp:
        assert resp.status == 401  # control calls never are


async def test_the_rest_of_vllm_is_not_exposed(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    for method, path in (("POST", "/abort_requests"), ("GET", "/sim/state"),
                         ("POST", "/sim/faults")):
        async with session.request(method, f"{guarded.url}{path}",
                                   headers=control() | bearer()) as resp:
            assert resp.status == 404, path
    assert not guarded.engine.paused
    async with session.get(f"{guarded.url}/health") as resp:  # open: kubelet probes
        assert resp.status == 200


async def test_a_rotated_api_key_works_at_once_and_old_and_new_overlap(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    guarded.key_file.write_text("sk-engine-2\n" + KEY + "\n")
    for key in ("sk-engine-2", KEY):
        async with session.get(f"{guarded.url}/v1/models", headers=bearer(key)) as resp:
            assert resp.status == 200, key
    guarded.key_file.write_text("sk-engine-2\n")
    async with session.get(f"{guarded.url}/v1/models", headers=bearer()) as resp:
        assert resp.status == 401


async def test_only_the_claims_own_token_opens_the_control_routes(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    for token in ("", "rota-control-2", TOKEN + "x", TOKEN[:-1], TOKEN.upper()):
        async with session.post(f"{guarded.url}/sleep", headers=control(token)) as resp:
            assert resp.status == 401, token
    async with session.post(f"{guarded.url}/sleep", headers=control()) as resp:
        assert resp.status == 200


async def test_the_control_token_never_reaches_the_engine(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"is_sleeping": False})

    upstream_app = web.Application()
    upstream_app.router.add_get("/is_sleeping", record)
    upstream_app.router.add_get("/v1/models", record)
    upstream = TestServer(upstream_app, host="127.0.0.1", port=0)
    await upstream.start_server()
    settings = GuardSettings(upstream=str(upstream.make_url("")))
    guard = TestServer(make_app(settings, control=FixedCredential(TOKEN), api_key=None),
                       host="127.0.0.1", port=0)
    await guard.start_server()
    try:
        url = str(guard.make_url("")).rstrip("/")
        async with session.get(f"{url}/is_sleeping", headers=control()) as resp:
            assert resp.status == 200
        async with session.get(f"{url}/v1/models", headers=bearer()) as resp:
            assert resp.status == 200
    finally:
        await guard.close()
        await upstream.close()
    assert [CONTROL_TOKEN_HEADER in h for h in seen] == [False, False]
    assert seen[1].get("Authorization") == f"Bearer {KEY}"  # the engine may check it too


# -- passing answers through -------------------------------------------------------------


async def test_a_stream_passes_through_unbuffered(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    """The first event reaches the client while the engine is still generating."""
    await guarded.engine.set_faults(_patch(stall_generation=True))
    payload = CHAT | {"stream": True, "max_tokens": 4, "ignore_eos": True}
    async with session.post(f"{guarded.url}/v1/chat/completions", json=payload,
                            headers=bearer()) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        async with asyncio.timeout(DEADLINE):
            first = await resp.content.readline()
        assert first.startswith(b"data: {")
        assert guarded.engine.running == 1  # still stalled: nothing was buffered
        await guarded.engine.set_faults(_patch(stall_generation=False))
        rest = (await resp.read()).decode()
    assert rest.rstrip().endswith("data: [DONE]")


async def test_a_client_that_leaves_cancels_its_request_upstream(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    await guarded.engine.set_faults(_patch(stall_generation=True))
    payload = CHAT | {"stream": True, "max_tokens": 4, "ignore_eos": True}
    resp = await session.post(f"{guarded.url}/v1/chat/completions", json=payload,
                              headers=bearer())
    await resp.content.readline()
    resp.close()  # the client goes away mid-stream
    await guarded.until(lambda: guarded.engine.running == 0)


async def test_request_bodies_are_bounded(
    make_guarded: GuardFactory, session: aiohttp.ClientSession
) -> None:
    guarded = await make_guarded(max_body_bytes=1024, max_control_body_bytes=64)
    big = CHAT | {"messages": [{"role": "user", "content": "x" * 2048}]}
    async with session.post(f"{guarded.url}/v1/chat/completions", json=big,
                            headers=bearer()) as resp:
        assert resp.status == 413
    rpc = {"method": "reload_weights", "args": ["y" * 100]}
    async with session.post(f"{guarded.url}/collective_rpc", json=rpc,
                            headers=control()) as resp:
        assert resp.status == 413
    assert guarded.engine.generations_started == 0


async def test_a_control_call_that_hangs_is_cut_at_its_timeout(
    make_guarded: GuardFactory, session: aiohttp.ClientSession
) -> None:
    guarded = await make_guarded(control_timeout_s=0.3)
    async with session.post(f"{guarded.url}/sleep", headers=control()) as resp:
        assert resp.status == 200
    await guarded.engine.set_faults(_patch(wake_hangs=True))
    async with session.post(f"{guarded.url}/wake_up", headers=control()) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["type"] == "GatewayTimeout"
    await guarded.until(lambda: not guarded.engine.wake_hanging)  # the engine saw it go


async def test_an_engine_that_is_down_is_a_502(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    await guarded.upstream.close()
    async with session.get(f"{guarded.url}/health") as resp:
        assert resp.status == 502
        body = json.loads(await resp.text())
    assert body["error"]["type"] == "BadGateway"


# -- rota's adapters through the guard ---------------------------------------------------


async def test_rotas_adapter_drives_the_engine_through_the_guard(
    guarded: Guarded, session: aiohttp.ClientSession
) -> None:
    adapter = VllmAdapter(guarded.endpoint(), session, Timeouts())
    for level in (1, 2):
        await adapter.sleep(level)
        assert (await adapter.sleep_state()).kind is SleepStateKind.ASLEEP
        await adapter.wake(level)
        assert (await adapter.probe()).ok
    assert await adapter.in_flight() == 0
    outsider = VllmAdapter(guarded.endpoint(token=None), session, Timeouts())
    with pytest.raises(EngineRejected) as caught:
        await outsider.sleep(1)
    assert (caught.value.status, caught.value.reason) == (401, "unauthorized")


async def test_vllm_omni_through_the_guard(
    make_guarded: GuardFactory, session: aiohttp.ClientSession
) -> None:
    guarded = await make_guarded(sim={"omni": True, "omni_stages": 2, "api_key": KEY})
    adapter = VllmOmniAdapter(guarded.endpoint(), session, Timeouts(), stage_ids=[0, 1])
    await adapter.sleep(1)
    await adapter.wake(1)
    assert (await adapter.probe()).ok
    for endpoint in (guarded.endpoint(token=None), guarded.endpoint(api_key=None)):
        with pytest.raises(EngineRejected) as caught:  # the guard, then vLLM-Omni refuse
            await VllmOmniAdapter(endpoint, session, Timeouts(), stage_ids=[0, 1]).sleep(1)
        assert caught.value.status == 401


def _patch(**faults: bool) -> FaultsPatch:
    return FaultsPatch.model_validate(faults)


def test_every_route_the_gateway_forwards_passes_the_guard_as_a_client_call() -> None:
    """The gateway forwards vLLM's pooling, scoring, reranking and token routes too; on
    the old guard everything outside /v1, /tokenize and /detokenize was hidden (404), so
    behind a guard those models answered nothing."""
    from controller.gateway.surface import ROUTED

    hidden = sorted(r.path for r in ROUTED if classify("POST", r.path) is not Access.CLIENT)
    assert hidden == []
