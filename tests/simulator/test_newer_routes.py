"""The model-bearing routes of vLLM 0.27 and later, as unkind as each release: served only
by the releases that have them, with their request models' strictness and Cohere's error
shape; held while the engine sleeps, as any generation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.lease.engines.surfaces import supported, surface_for
from tests.simulator.conftest import DEADLINE, MODEL, SimFactory

NEWER = ("/cohere/v2/chat", "/cohere/v2/chat/render", "/v1/messages/render",
         "/v1/responses/render", "/v1/systemone", "/v1/decisions")
BODIES: dict[str, dict[str, Any]] = {
    "/cohere/v2/chat": {"model": MODEL, "messages": [{"role": "user", "content": "3 + 4"}]},
    "/cohere/v2/chat/render": {"model": MODEL,
                               "messages": [{"role": "user", "content": "3 + 4"}]},
    "/v1/messages/render": {"model": MODEL, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "3 + 4"}]},
    "/v1/responses/render": {"model": MODEL, "input": "3 + 4"},
    "/v1/systemone": {"state": "3 + 4 = 7",
                      "questions": {"ok": {"type": "predicate", "instructions": "Right?"}}},
    "/v1/decisions": {"model": MODEL, "input": "3 + 4 = 7", "questions": [
        {"type": "choice", "instructions": "Which?",
         "choices": [{"value": "right"}, {"value": "wrong"}]}]},
}


@pytest.mark.parametrize("version", supported("vllm"))
async def test_each_release_serves_exactly_its_own_newer_routes(
        make_sim: SimFactory, version: str) -> None:
    sim = await make_sim(vllm_version=version)
    surface = surface_for(version)
    assert surface is not None
    for path in NEWER:
        async with sim.client.post(path, json=BODIES[path]) as resp:
            if surface.serves("POST", path):
                assert resp.status == 200, (version, path, await resp.text())
            else:
                assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"})


async def test_the_decision_routes_refuse_fields_they_do_not_know(
        make_sim: SimFactory) -> None:
    sim = await make_sim(vllm_version="0.34.0")
    for path in ("/v1/systemone", "/v1/decisions"):
        async with sim.client.post(path, json=BODIES[path] | {"stream": True}) as resp:
            assert resp.status == 400, path
    body = dict(BODIES["/v1/decisions"])
    del body["model"]
    async with sim.client.post("/v1/decisions", json=body) as resp:
        assert resp.status == 400
    async with sim.client.post("/v1/decisions", json=BODIES["/v1/decisions"]) as resp:
        [answer] = (await resp.json())["answers"]
    assert answer["choice"] in ("right", "wrong")
    assert sum(p["probability"] for p in answer["probabilities"]) == pytest.approx(1, abs=1e-5)


async def test_cohere_errors_have_cohere_s_shape(make_sim: SimFactory) -> None:
    sim = await make_sim(vllm_version="0.34.0")
    async with sim.client.post("/cohere/v2/chat", json={
            "model": "no/such", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Request-Id": "r-1"}) as resp:
        assert resp.status == 404
        assert await resp.json() == {"message": "The model `no/such` does not exist.",
                                     "id": "r-1"}


async def test_a_cohere_chat_is_held_while_the_engine_sleeps(make_sim: SimFactory) -> None:
    sim = await make_sim(vllm_version="0.34.0")
    async with sim.client.post("/sleep?level=1") as resp:
        assert resp.status == 200
    request = asyncio.ensure_future(sim.client.post("/cohere/v2/chat",
                                                    json=BODIES["/cohere/v2/chat"]))
    await sim.until(lambda: sim.engine.waiting == 1)
    assert not request.done()
    async with sim.client.post("/wake_up") as resp:
        assert resp.status == 200
    async with asyncio.timeout(DEADLINE):
        answer = await request
    assert answer.status == 200
    assert (await answer.json())["message"]["content"][0]["text"] == "7"
    answer.release()
