"""Engines that hold requests while asleep, as vLLM 0.26 does (200 headers for a stream, then
nothing until woken; never a 503). A request the gateway sends to one — a replica that has
not yet seen the Lease move — is completed after a wake or answered in bounded time."""

from __future__ import annotations

import asyncio

import pytest

from controller.gateway import keys
from rota.api import naming
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    RigFactory,
    content_of,
    eventually,
    read_events,
)

pytestmark = pytest.mark.gateway

HOLDS = {"faults": {"refuse_while_asleep": False}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_held_by_an_engine_put_to_sleep_is_served_after_a_wake(
        make_rig: RigFactory, stream: bool) -> None:
    rig = await make_rig(sim_a=HOLDS, sim_b=HOLDS, stream_keepalive_s=0)
    # The controller puts A to sleep; this replica has not seen the Lease change yet.
    async with rig.a.client.post("/sleep?level=1&mode=wait") as resp:
        assert resp.status == 200
    rig.controller.holder = None
    request = asyncio.create_task(rig.chat(MODEL_A, stream=stream))
    await eventually(lambda: rig.a.engine.waiting == 1, "the engine holding the request")
    assert not request.done()
    # The watch catches up: the GPU settled with nobody awake, under a newer fence.
    rig.controller.fence += 1
    rig.apply("lease", "MODIFIED", rig.controller.lease_now())
    async with asyncio.timeout(DEADLINE):
        resp = await request
        assert resp.status == 200, await resp.text()
        if stream:
            events, _ = await read_events(resp)
            assert content_of(events) == "7"
        else:
            assert (await resp.json())["choices"][0]["message"]["content"] == "7"
    assert rig.controller.switches == 1  # woken again for it
    await eventually(lambda: rig.a.engine.waiting == 0, "the held request let go")
    metrics = rig.app[keys.METRICS].registry
    assert metrics.get_sample_value("rota_gateway_engine_refusals_total",
                                    {"model_name": MODEL_A, "reason": "lost_gpu"}) == 1.0


async def test_a_request_held_while_the_lease_never_moves_is_answered_in_bounded_time(
        make_rig: RigFactory) -> None:
    rig = await make_rig(sim_a=HOLDS, upstream_read_timeout_s=0.5)
    async with rig.a.client.post("/sleep?level=1") as resp:
        assert resp.status == 200  # and nobody ever tells the gateway
    resp = await rig.chat(MODEL_A)
    assert resp.status == 504, await resp.text()
    assert (await resp.json())["error"]["code"] == "upstream_timeout"
    assert rig.controller.calls == 0


async def test_a_generation_longer_than_the_read_timeout_is_not_run_again(
        make_rig: RigFactory) -> None:
    rig = await make_rig(upstream_read_timeout_s=0.5)
    await rig.a.faults(stall_generation=True)
    resp = await rig.chat(MODEL_A)
    assert resp.status == 504, await resp.text()
    body = await resp.json()
    assert body["error"]["code"] == "upstream_timeout"
    assert rig.a.engine.generations_started == 1


async def test_an_activation_answer_is_not_a_licence_to_forward(make_rig: RigFactory) -> None:
    """The controller says "done", but the Lease this gateway sees has moved on (a switch
    away from the model began): the request waits for the Lease, not for the answer."""
    rig = await make_rig()
    gate = rig.app[keys.PLACES].gate("sim/model-b")

    def switch_away_at_once() -> None:
        rig.controller.after_switch = None
        rig.controller.fence += 1
        rig.apply("lease", "MODIFIED", rig.controller.lease_now(
            state=naming.STATE_SWITCHING, target=MODEL_A, draining="sim/model-b"))

    rig.controller.after_switch = switch_away_at_once
    request = asyncio.create_task(rig.answer("sim/model-b"))
    await eventually(lambda: rig.controller.switches == 1, "the switch to B done")
    await eventually(lambda: gate.running == 1, "the request holding its place")
    assert gate.in_flight == 0
    assert rig.b.engine.generations_started == 0, "sent to an engine being drained"
    rig.apply("lease", "MODIFIED", rig.controller.lease_now())  # the switch away backed out
    async with asyncio.timeout(DEADLINE):
        assert await request == "7"
    assert rig.b.engine.generations_started == 1


async def test_an_engine_that_lost_its_gpu_on_every_attempt_is_not_called_unreachable(
        make_rig: RigFactory) -> None:
    """The engine was reached every time but gave its GPU up before it answered (a busy
    GPU switching back and forth); the refusal says so (on the old code: 503
    ``upstream_unreachable``, 'the engine cannot be reached', which sends an operator to
    the network)."""
    rig = await make_rig(sim_a=HOLDS, stream_keepalive_s=0, upstream_attempts=1)
    async with rig.a.client.post("/sleep?level=1&mode=wait") as resp:
        assert resp.status == 200
    rig.controller.holder = None
    request = asyncio.create_task(rig.chat(MODEL_A))
    await eventually(lambda: rig.a.engine.waiting == 1, "the engine holding the request")
    rig.controller.fence += 1
    rig.apply("lease", "MODIFIED", rig.controller.lease_now())
    async with asyncio.timeout(DEADLINE):
        resp = await request
    assert resp.status == 503, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == "lost_gpu"
    assert "cannot be reached" not in error["message"]
    assert resp.headers.get("Retry-After")
