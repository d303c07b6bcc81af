"""Every supported vLLM release behind the gateway: each model-bearing route the release
serves is routed to it (the routes of 0.27 and later included: Cohere's chat and its
render, the messages and responses renders, ``/v1/systemone``, ``/v1/decisions``), and a
route newer than the release reaches the engine, which answers its own 404 (the gateway
does not know which release each engine runs). Engine simulators of each release, over
real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.gateway.surface import ROUTED
from controller.lease.engines.surfaces import supported, surface_for
from e2e.harness.wire import Exchange, parse_answer, parse_sse
from tests.gateway.conftest import MODEL_A, MODEL_B, Rig, RigFactory
from tests.gateway.surface_cases import JSON_CASES, first_release, rig_for

pytestmark = pytest.mark.gateway

NEWER = [(path, body, field) for path, body, field in JSON_CASES if rig_for(path)]
"""The cases of routes that vLLM 0.26 does not serve."""
KEEPALIVE_S = 0.05


@pytest.mark.parametrize("version", supported("vllm"))
async def test_each_release_gets_every_route_it_serves_and_answers_the_newer_ones_itself(
        make_rig: RigFactory, version: str) -> None:
    release = {"vllm_version": version}
    rig = await make_rig(sim_a=release, sim_b=release)
    surface = surface_for(version)
    assert surface is not None
    for path, body, field in JSON_CASES:
        async with rig.gateway.post(path, json=body | {"model": MODEL_A}) as resp:
            answer = await resp.json()
            if surface.serves("POST", path):
                assert resp.status == 200, (version, path, answer)
                assert field in answer, (version, path)
            else:  # the engine's own answer, passed on: no such route in this release
                assert (resp.status, answer) == (404, {"detail": "Not Found"}), (version, path)
    assert rig.controller.switches == 0


def test_the_newer_routes_have_cases_and_say_their_first_release() -> None:
    newer = {route.path: route.since for route in ROUTED if route.since != "0.26.0"}
    assert {path: first_release(path) for path, _, _ in NEWER} == newer
    assert set(newer) == {"/cohere/v2/chat", "/cohere/v2/chat/render", "/v1/messages/render",
                          "/v1/responses/render", "/v1/systemone", "/v1/decisions"}


@pytest.mark.parametrize(("path", "body", "field"), NEWER)
async def test_a_newer_route_waits_for_its_switch_on_its_first_release(
        make_rig: RigFactory, path: str, body: dict[str, Any], field: str) -> None:
    rig = await make_rig(**rig_for(path))
    async with rig.gateway.post(path, json=body | {"model": MODEL_B}) as resp:
        assert resp.status == 200, await resp.text()
        assert field in await resp.json()
    assert rig.controller.switches == 1
    assert rig.controller.max_awake == 1


async def test_a_streamed_cohere_chat_is_kept_alive_while_its_model_is_switched_in(
        make_rig: RigFactory) -> None:
    path = "/cohere/v2/chat"
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, **rig_for(path))
    rig.controller.hold_switch = asyncio.Event()
    exchange = await Exchange.post(_port(rig), path, {
        "model": MODEL_B, "stream": True,
        "messages": [{"role": "user", "content": "What is 3 + 4?"}]})
    try:
        await exchange.read_until(b": rota: ")
        rig.controller.hold_switch.set()
        answer = parse_answer(await exchange.read_all())
    finally:
        await exchange.close()
    assert answer.status == 200
    events = [e.data for e in parse_sse(answer.body) if e.data is not None]
    assert events[-1] == "[DONE]"
    typed = [e for e in events if isinstance(e, dict)]
    assert typed[0]["type"] == "message-start"
    assert typed[-1]["type"] == "message-end"
    assert typed[-1]["delta"]["finish_reason"] == "COMPLETE"
    assert "".join(e["delta"]["message"]["content"]["text"] for e in typed
                   if e["type"] == "content-delta") == "7"
    assert rig.controller.switches == 1


async def test_a_cohere_chat_for_an_unknown_model_is_refused_before_any_switch(
        make_rig: RigFactory) -> None:
    rig = await make_rig(**rig_for("/cohere/v2/chat"))
    async with rig.gateway.post("/cohere/v2/chat", json={
            "model": "no/such", "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
    async with rig.gateway.post("/v1/systemone", json={
            "state": "x", "questions": {"q": {"type": "predicate"}}}) as resp:
        assert resp.status == 400  # vLLM defaults it; the gateway routes by it
        assert (await resp.json())["error"]["code"] == "missing_model"
    assert rig.controller.calls == 0


def _port(rig: Rig) -> int:
    port = rig.gateway.port
    assert port is not None
    return port

