"""Overload and failed switches: 429 and 503 with Retry-After, and nothing stuck after."""

from __future__ import annotations

import asyncio

import pytest

from controller.gateway import keys
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    MODEL_B,
    Failure,
    RigFactory,
    claim_obj,
    content_of,
    controller_lease,
    eventually,
    pod_obj,
    read_events,
)

pytestmark = pytest.mark.gateway


async def test_a_full_queue_answers_429_with_retry_after(make_rig: RigFactory) -> None:
    rig = await make_rig(max_concurrency_per_engine=1, queue_size=1, retry_after_s=3)
    await rig.a.faults(stall_generation=True)
    gate = rig.app[keys.PLACES].gate(MODEL_A)
    first = await rig.chat(MODEL_A, stream=True)
    assert first.status == 200
    queued = asyncio.create_task(rig.answer(MODEL_A))
    await eventually(lambda: gate.waiting == 1, "the second request queued")

    resp = await rig.chat(MODEL_A)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"]["code"] == "queue_full"

    await rig.a.faults(stall_generation=False)
    events, _ = await read_events(first)
    async with asyncio.timeout(DEADLINE):
        assert await queued == "7"
    assert content_of(events) == "7"
    await eventually(lambda: gate.running == 0 and gate.waiting == 0, "every place back")


async def test_a_model_on_more_engines_gets_more_places(make_rig: RigFactory) -> None:
    """The concurrency limit is per engine that serves the model (it was per model: a model
    on many engines got the places of one)."""
    rig = await make_rig(max_concurrency_per_engine=3)
    gate = rig.app[keys.PLACES].gate(MODEL_A)
    assert gate.limit == 3
    rig.apply("claim", "ADDED", claim_obj("claim-a2", model=MODEL_A, port=rig.a.port,
                                          pod_uid="pod-a2", node="node-2"))
    rig.apply("pod", "ADDED", pod_obj("pod-claim-a2", uid="pod-a2"))
    assert gate.limit == 6
    assert rig.app[keys.PLACES].gate(MODEL_B).limit == 3
    rig.apply("claim", "DELETED", claim_obj("claim-a2", model=MODEL_A, port=rig.a.port,
                                            pod_uid="pod-a2", node="node-2"))
    assert gate.limit == 3


async def test_waiting_too_long_for_a_place_answers_503(make_rig: RigFactory) -> None:
    rig = await make_rig(max_concurrency_per_engine=1, queue_size=4, max_wait_s=0.3)
    await rig.a.faults(stall_generation=True)
    first = await rig.chat(MODEL_A, stream=True)
    assert first.status == 200
    resp = await rig.chat(MODEL_A)
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert (await resp.json())["error"]["code"] == "queue_timeout"
    first.close()
    await rig.a.idle()


async def test_a_failed_switch_answers_503_with_the_reason(make_rig: RigFactory) -> None:
    rig = await make_rig()
    rig.controller.failure = Failure(503, "gpu_oom", retry_after=7)
    resp = await rig.chat(MODEL_B)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "7"
    error = (await resp.json())["error"]
    assert error["code"] == "gpu_oom"
    assert "gpu_oom" in error["message"]
    assert await rig.answer(MODEL_A) == "7"  # the awake model is not disturbed
    metrics = (await (await rig.gateway.get("/metrics")).read()).decode()
    assert f'rota_gateway_activations_total{{model_name="{MODEL_B}",outcome="gpu_oom"}} 1.0' \
        in metrics
    assert f'rota_gateway_requests_total{{model_name="{MODEL_B}",outcome="gpu_oom"}} 1.0' \
        in metrics


async def test_a_declined_activation_is_asked_again_after_retry_after(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    rig.controller.failure = Failure(409, "min_residency", retry_after=1, times=1)
    assert await rig.answer(MODEL_B) == "7"
    assert rig.controller.calls == 2
    assert rig.controller.switches == 1


async def test_a_declined_activation_past_the_deadline_answers_503(
        make_rig: RigFactory) -> None:
    rig = await make_rig(max_wait_s=2)
    rig.controller.failure = Failure(409, "min_residency", retry_after=30)
    resp = await rig.chat(MODEL_B)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "30"
    assert (await resp.json())["error"]["code"] == "min_residency"


async def test_a_wrong_activation_token_is_a_503_not_a_hang(make_rig: RigFactory) -> None:
    rig = await make_rig(token="wrong")
    resp = await rig.chat(MODEL_B)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "activation_unauthorized"
    assert rig.controller.switches == 0


async def test_an_unreachable_controller_is_retried_then_503(make_rig: RigFactory) -> None:
    # Then counted lost: the request waits for its Lease to change, bounded.
    rig = await make_rig(activation_attempts=2, max_wait_s=1.0)
    rig.state.apply("lease", "MODIFIED", controller_lease("http://127.0.0.1:9"))
    resp = await rig.chat(MODEL_B)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "controller_lost"
