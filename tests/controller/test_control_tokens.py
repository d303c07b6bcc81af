"""Per-claim control credentials, from the lease controller's side (review F1).

Two claims' engines (real simulators), each behind its own engine guard that reads its
credential from the CDI environment the driver wrote for its claim; the node controller
gets tokens from a real driver inspection service over its unix socket. The controller's
calls open each engine with that engine's own token; a tenant endpoint that records what
the controller sends it learns a token that opens no other engine (on the old code one
cluster-wide token went to every engine, and the recorded one opened them all)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.claimants import Claimant
from controller.guard.app import control_credential
from controller.guard.proxy import make_app
from controller.guard.settings import GuardSettings
from controller.lease.control_tokens import ControlTokens as CachedTokens
from controller.lease.device import DeviceError, DeviceReader
from controller.lease.engines.base import EngineEndpoint, SleepStateKind, Timeouts
from controller.lease.engines.errors import EngineUnreachable
from controller.lease.engines.vllm import VllmAdapter
from controller.lease.node import NodeController
from controller.lease.settings import LeaseSettings
from driver.cdi import build_claim_spec
from driver.control_tokens import ControlTokens
from driver.inspection import InspectionService
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.startgate import KEY_BYTES
from rota.api.engine_config import parse_engine_config
from rota.api.engine_guard import CONTROL_TOKEN_HEADER
from rota.kit.sockets import UnixServer
from tests.controller.conftest import EngineSim, EngineSimFactory
from tests.driver.test_cdi import DEVICES, ENGINE, SHARED_RESULT
from tests.driver.test_control_tokens import environment, plan

pytestmark = pytest.mark.controller

KEY = bytes(reversed(range(KEY_BYTES)))
UID_A = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a0a"
UID_B = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a0b"
UID_TENANT = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a0c"


def cdi_environment(uid: str) -> dict[str, str]:
    """What the driver puts in the environment of claim ``uid``'s containers."""
    spec = build_claim_spec(plan(uid, SHARED_RESULT, config=ENGINE), DEVICES,
                            control=ControlTokens(KEY))
    return environment(spec)


def claimant(uid: str, port: int) -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": "sim/adapter-model",
                                  "awakeMemory": "8Gi"})
    return Claimant(claim_uid=uid, namespace="team", claim_name=f"claim-{uid[-1]}",
                    node="node-a", device="gpu-0", share_id=None, config=config,
                    model="sim/adapter-model", port=port, sleep_level=1,
                    resident_bytes=1 << 30, pod_name=f"engine-{uid[-1]}",
                    pod_uid=f"pod-{uid[-1]}", pod_ip="127.0.0.1", pod_ready=True,
                    pod_deleting=False)


@dataclass
class HeaderRecorder:
    """A tenant's endpoint at its claimant's address: answers like an awake vLLM and keeps
    every control token it is sent."""

    tokens: list[str] = field(default_factory=list)

    async def _answer(self, request: web.Request) -> web.Response:
        if CONTROL_TOKEN_HEADER in request.headers:
            self.tokens.append(request.headers[CONTROL_TOKEN_HEADER])
        return web.json_response({"is_sleeping": False})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        return app


@dataclass
class Node:
    controller: NodeController
    engines: dict[str, EngineSim]
    guards: dict[str, TestServer]
    recorder: HeaderRecorder
    recorder_server: TestServer

    def claimant(self, uid: str) -> Claimant:
        server = self.recorder_server if uid == UID_TENANT else self.guards[uid]
        assert server.port is not None
        return claimant(uid, server.port)

    async def replay(self, session: aiohttp.ClientSession, uid: str, token: str) -> int:
        """``POST /sleep`` on claim ``uid``'s guard with ``token``: the answer's status."""
        url = self.guards[uid].make_url("/sleep")
        async with session.post(url, headers={CONTROL_TOKEN_HEADER: token}) as resp:
            return resp.status


@pytest.fixture
async def node(short_tmp: Path, engine_sim_factory: EngineSimFactory,
               engine_session: aiohttp.ClientSession) -> AsyncIterator[Node]:
    control = ControlTokens(KEY)
    backend = FakeNvml.from_path(fixture_path("h200"), short_tmp / "procs")
    socket = short_tmp / "inspect.sock"
    driver = UnixServer(socket, [InspectionService(backend=backend, gpus=[],
                                                   proc_root=short_tmp,
                                                   control=control).handler()])
    await driver.start()
    reader = DeviceReader(socket, timeout_s=5.0)
    engines: dict[str, EngineSim] = {}
    guards: dict[str, TestServer] = {}
    recorder = HeaderRecorder()
    recorder_server = TestServer(recorder.app(), host="127.0.0.1")
    try:
        for uid in (UID_A, UID_B):
            engines[uid] = await engine_sim_factory()
            settings = GuardSettings(upstream=engines[uid].base_url)
            guard = make_app(settings, control=control_credential(cdi_environment(uid)),
                             api_key=None)
            guards[uid] = TestServer(guard, host="127.0.0.1")
            await guards[uid].start_server()
        await recorder_server.start_server()
        unused: Any = None
        controller = NodeController(settings=LeaseSettings(node_name="node-a"), kube=unused,
                                    election=unused, device=reader, session=engine_session,
                                    cache=unused)
        yield Node(controller, engines, guards, recorder, recorder_server)
    finally:
        for server in (*guards.values(), recorder_server):
            await server.close()
        await reader.close()
        await driver.stop(1)


async def test_the_controller_opens_each_engine_with_its_own_claims_token(node: Node) -> None:
    a = node.controller.engine(node.claimant(UID_A))
    b = node.controller.engine(node.claimant(UID_B))
    await a.sleep(1)
    assert (await a.sleep_state()).kind is SleepStateKind.ASLEEP
    assert (await b.sleep_state()).kind is SleepStateKind.AWAKE
    await b.sleep(1)
    await a.wake(1)
    assert (await a.sleep_state()).kind is SleepStateKind.AWAKE
    assert (await b.sleep_state()).kind is SleepStateKind.ASLEEP


async def test_a_recording_tenant_learns_nothing_that_opens_another_engine(
        node: Node, engine_session: aiohttp.ClientSession) -> None:
    tenant = node.controller.engine(node.claimant(UID_TENANT))
    assert await tenant.is_sleeping() is False
    learned = set(node.recorder.tokens)
    assert learned == {cdi_environment(UID_TENANT)["ROTA_CONTROL_TOKEN"]}, \
        "the tenant is sent its own claim's token, and only that"
    for victim in (UID_A, UID_B):
        for token in learned:
            assert await node.replay(engine_session, victim, token) == 401
        assert (await node.controller.engine(node.claimant(victim)).sleep_state()).kind \
            is SleepStateKind.AWAKE


async def test_one_engines_token_does_not_open_anothers_guard(
        node: Node, engine_session: aiohttp.ClientSession) -> None:
    token_a = cdi_environment(UID_A)["ROTA_CONTROL_TOKEN"]
    assert await node.replay(engine_session, UID_B, token_a) == 401
    assert await node.replay(engine_session, UID_A, token_a) == 200


# -- the controller's cache of tokens -------------------------------------------------------

@dataclass
class FakeDriver:
    """The driver's ControlToken, counted; ``fail`` makes the next asks fail, ``gate``
    holds every ask until set."""

    asks: list[str] = field(default_factory=list)
    fail: bool = False
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def control_token(self, claim_uid: str) -> str:
        self.asks.append(claim_uid)
        await self.gate.wait()
        if self.fail:
            raise DeviceError("inspection API: UNAVAILABLE")
        return f"token-of-{claim_uid}"


async def test_concurrent_first_calls_share_one_ask_and_a_failure_is_not_kept() -> None:
    driver = FakeDriver()
    tokens = CachedTokens(driver.control_token)
    calls = [asyncio.create_task(tokens.get("uid-a")) for _ in range(5)]
    driver.gate.set()
    assert await asyncio.gather(*calls) == ["token-of-uid-a"] * 5
    assert driver.asks == ["uid-a"]
    assert await tokens.get("uid-a") == "token-of-uid-a"
    assert driver.asks == ["uid-a"], "kept"
    driver.fail = True
    with pytest.raises(DeviceError):
        await tokens.get("uid-b")
    driver.fail = False
    assert await tokens.get("uid-b") == "token-of-uid-b", "asked again after a failure"
    tokens.keep_only({"uid-b"})
    await tokens.get("uid-a")
    assert driver.asks == ["uid-a", "uid-b", "uid-b", "uid-a"], "a claim that left is forgotten"


async def test_a_call_whose_token_cannot_be_had_is_not_sent(
        engine_session: aiohttp.ClientSession) -> None:
    recorder = HeaderRecorder()
    arrivals: list[str] = []

    @web.middleware
    async def count(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        arrivals.append(request.path)
        return await handler(request)

    app = recorder.app()
    app.middlewares.append(count)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    driver = FakeDriver(fail=True)
    driver.gate.set()
    try:
        endpoint = EngineEndpoint(base_url=str(server.make_url("")), model="m", claim="ns/c",
                                  token_source=CachedTokens(driver.control_token).source("c"))
        with pytest.raises(EngineUnreachable, match="no control token") as caught:
            await VllmAdapter(endpoint, engine_session, Timeouts()).is_sleeping()
        assert not caught.value.request_sent
        assert arrivals == []
    finally:
        await server.close()
