"""Clients that see the switch: a held request's answer says what the node's lease
controller expected of the switch (its place in the GPU's queue, the expected wait from
the costs the controller measured) and how long the gateway held it; a wait that runs out
says when to come back from that expectation, not a fixed 2 s; ``/v1/models`` gives each
model's state, where it runs and its expected wake, in a shape the OpenAI SDK still reads.

The rig's fake controller switches for real between engine simulators; a small server in
front of it adds ``GET /v1/state`` with the expectation a real controller computes (its
computation is tested in ``tests/controller/test_activation_expectation.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from controller.gateway import keys
from rota.api.activation import STATE_PATH, ClaimantState, StateAnswer
from tests.gateway.conftest import (
    DEADLINE,
    DEVICE,
    MODEL_A,
    MODEL_B,
    NODE,
    Failure,
    Rig,
    RigFactory,
    controller_lease,
    eventually,
    read_events,
)

pytestmark = pytest.mark.gateway

QUEUE_POSITION = 1
EXPECTED_WAIT_S = 9.0
EXPECTED_SWITCH_S = 4.5


def _state(rig: Rig) -> StateAnswer:
    claimants = [ClaimantState(claim=sim.claim, model=sim.model, device=DEVICE, gpu=DEVICE,
                               serving=True,
                               expected_switch_s=0.0 if sim is rig.controller.holder
                               else EXPECTED_SWITCH_S,
                               queue_position=0 if sim is rig.controller.holder
                               else QUEUE_POSITION,
                               expected_wait_s=0.0 if sim is rig.controller.holder
                               else EXPECTED_WAIT_S)
                 for sim in (rig.a, rig.b)]
    return StateAnswer(node=NODE, identity="ctl-0", leader=True, claimants=claimants)


async def _with_state(rig: Rig) -> Callable[[], Awaitable[None]]:
    """The rig's controller with ``GET /v1/state``, advertised in its controller Lease."""

    async def state(request: web.Request) -> web.Response:
        return web.json_response(_state(rig).model_dump(mode="json"))

    app = web.Application()
    app.router.add_post("/v1/activate", rig.controller.activate)
    app.router.add_get(STATE_PATH, state)
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    rig.closers.append(client.close)
    rig.apply("lease", "MODIFIED", controller_lease(str(client.make_url("")).rstrip("/")))
    return client.close


async def test_a_held_request_is_told_its_place_and_the_expected_wait(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    await _with_state(rig)
    resp = await rig.chat(MODEL_B)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Rota-Switched"] == "true"
    assert resp.headers["X-Rota-Queue-Position"] == str(QUEUE_POSITION)
    assert float(resp.headers["X-Rota-Expected-Wait-S"]) == EXPECTED_WAIT_S
    assert 0 <= float(resp.headers["X-Rota-Waited-S"]) < DEADLINE
    assert rig.controller.switches == 1


async def test_a_request_that_waited_for_nothing_says_nothing(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await _with_state(rig)
    resp = await rig.chat(MODEL_A)
    assert resp.status == 200
    assert not [h for h in resp.headers if h.lower().startswith("x-rota-")]


async def test_a_wait_that_runs_out_says_when_the_switch_is_expected_done(
        make_rig: RigFactory) -> None:
    rig = await make_rig(max_wait_s=1.5)
    await _with_state(rig)
    rig.controller.hold_switch = asyncio.Event()  # the switch is slower than the wait
    try:
        resp = await rig.chat(MODEL_B)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "switch_timeout"
        # 9 s expected, 1.5 s of it waited: come back in about 7.5 s, not in 2.
        assert 7 <= int(resp.headers["Retry-After"]) <= 8
        assert float(resp.headers["X-Rota-Expected-Wait-S"]) == EXPECTED_WAIT_S
    finally:
        rig.controller.hold_switch.set()


async def test_an_early_started_stream_carries_the_expectation(make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=0.3)
    await _with_state(rig)
    rig.controller.hold_switch = asyncio.Event()
    resp = await rig.chat(MODEL_B, stream=True)
    assert resp.status == 200
    assert resp.headers["X-Rota-Switched"] == "true"
    assert float(resp.headers["X-Rota-Expected-Wait-S"]) == EXPECTED_WAIT_S
    rig.controller.hold_switch.set()
    events, _ = await read_events(resp)
    assert events[-1] == "[DONE]"


async def test_models_say_state_place_and_expected_wake(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await _with_state(rig)
    body = await (await rig.gateway.get("/v1/models")).json()
    rota = {m["id"]: m["rota"] for m in body["data"]}
    assert rota[MODEL_A] == {"state": "awake", "gpus": [f"{NODE}/{DEVICE}"], "nodes": [NODE],
                             "awake_on": [f"{NODE}/{DEVICE}"], "awake_with": [],
                             "expected_wake_s": 0.0}
    assert rota[MODEL_B]["state"] == "asleep"
    assert rota[MODEL_B]["expected_wake_s"] is None, "no controller has said yet"

    assert (await rig.chat(MODEL_B)).status == 200
    body = await (await rig.gateway.get("/v1/models")).json()
    rota = {m["id"]: m["rota"] for m in body["data"]}
    assert rota[MODEL_B]["state"] == "awake"
    assert rota[MODEL_A]["state"] == "asleep"
    assert rota[MODEL_B]["expected_wake_s"] == 0.0

    assert (await rig.chat(MODEL_A)).status == 200
    body = await (await rig.gateway.get("/v1/models")).json()
    rota = {m["id"]: m["rota"] for m in body["data"]}
    assert rota[MODEL_B]["state"] == "asleep"
    assert rota[MODEL_B]["expected_wake_s"] == EXPECTED_SWITCH_S, "what its controller said"
    assert rota[MODEL_B]["nodes"] == [NODE]


async def test_the_openai_sdk_still_lists_the_models(make_rig: RigFactory) -> None:
    rig = await make_rig()
    sdk = AsyncOpenAI(base_url=str(rig.gateway.make_url("/v1")), api_key="unused",
                      max_retries=0, timeout=DEADLINE)
    try:
        models = [m async for m in sdk.models.list()]
        one = await sdk.models.retrieve(MODEL_B)
    finally:
        await sdk.close()
    assert sorted(m.id for m in models) == [MODEL_A, MODEL_B]
    assert {m.owned_by for m in models} == {"rota"}
    assert one.id == MODEL_B
    assert (one.model_extra or {})["rota"]["state"] == "asleep"


# -- Retry-After on every refusal, from what was measured ----------------------------------


def _seconds(resp: ClientResponse) -> int:
    return int(resp.headers["Retry-After"])


async def test_a_full_queue_says_when_the_switch_it_waits_for_is_expected_done(
        make_rig: RigFactory) -> None:
    """429 while B is switched in: come back when B's switch is expected done (9 s, as its
    controller said), not in the fixed 2 s."""
    rig = await make_rig(max_concurrency_per_engine=1, queue_size=0)
    await _with_state(rig)
    rig.controller.hold_switch = asyncio.Event()
    first = asyncio.ensure_future(rig.chat(MODEL_B))
    try:
        await eventually(rig.controller.switching.is_set, "B's switch began")
        # The controller's expectation reaches the gateway just after the switch began:
        # ask until a refusal says it (each one is a 429 that changes nothing).
        said: list[int] = []
        async with asyncio.timeout(DEADLINE):
            while not said or said[-1] <= 2:
                resp = await rig.chat(MODEL_B)
                assert resp.status == 429
                assert (await resp.json())["error"]["code"] == "queue_full"
                said.append(_seconds(resp))
        assert 7 <= said[-1] <= EXPECTED_WAIT_S
    finally:
        rig.controller.hold_switch.set()
    assert (await first).status == 200


async def test_no_place_in_time_says_when_the_switch_is_expected_done(
        make_rig: RigFactory) -> None:
    rig = await make_rig(max_concurrency_per_engine=1, queue_size=1, max_wait_s=1.5)
    await _with_state(rig)
    rig.controller.hold_switch = asyncio.Event()
    try:
        first = asyncio.ensure_future(rig.chat(MODEL_B))
        await eventually(rig.controller.switching.is_set, "B's switch began")
        queued = await rig.chat(MODEL_B)
        assert queued.status == 503
        # No place before its deadline, or a place (the first request's, given up at its
        # own deadline just before) and then the switch still running: either way,
        # 9 s expected when B's switch began, about 1.5 s of it gone.
        assert (await queued.json())["error"]["code"] in ("queue_timeout", "switch_timeout")
        assert 6 <= _seconds(queued) <= 8
        held = await first
        assert (await held.json())["error"]["code"] == "switch_timeout"
        assert 6 <= _seconds(held) <= 8
    finally:
        rig.controller.hold_switch.set()


async def test_an_engine_refusal_without_its_own_hint_says_the_expected_rest(
        make_rig: RigFactory) -> None:
    """B's switch "succeeds" but B keeps refusing (503, no Retry-After): the refusal is
    passed on with the rest of the switch the request was told to expect."""
    rig = await make_rig(lost_gpu_grace_s=0, stream_keepalive_s=0)
    await _with_state(rig)
    await rig.b.faults(wake_ignored=True, refuse_while_asleep=True)
    resp = await rig.chat(MODEL_B)
    assert resp.status == 503
    assert 7 <= _seconds(resp) <= EXPECTED_WAIT_S


async def test_the_controller_s_own_retry_after_wins(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await _with_state(rig)
    rig.controller.failure = Failure(503, "gpu_oom", retry_after=5)
    resp = await rig.chat(MODEL_B)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "gpu_oom"
    assert _seconds(resp) == 5


async def test_a_model_asleep_is_expected_back_after_its_measured_switch(
        make_rig: RigFactory) -> None:
    """With no switch under way, a refusal for a model that sleeps says what its last
    switch cost (the controller's timings); one for an awake model, whose refusal no switch
    explains, the configured fallback."""
    rig = await make_rig()
    dispatcher = rig.app[keys.DISPATCHER]
    assert dispatcher.retry_after_s(MODEL_B) == 2, "nothing measured yet"
    dispatcher.activator.learned(MODEL_B, {"drain": 0.5, "wake_call": 3.5, "probe_ttft": 0.2})
    dispatcher.activator.learned(MODEL_A, {"wake_call": 6.0})
    assert dispatcher.retry_after_s(MODEL_B) == pytest.approx(4.2)
    assert dispatcher.retry_after_s(MODEL_A) == 2  # A is awake
