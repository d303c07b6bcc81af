"""Smaller defects of the gateway, each with the case that showed it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import pytest

from controller.gateway import keys
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    MODEL_B,
    NAMESPACE,
    RigFactory,
    claim_obj,
    controller_lease,
    pod_obj,
    start_sim,
)

pytestmark = pytest.mark.gateway


async def test_deeply_nested_json_is_a_400(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for body in (b"[" * 200_000, b'{"model": "sim/model-a", "x": ' + b"[" * 200_000):
        async with rig.gateway.post("/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400, await resp.text()
            assert (await resp.json())["error"]["code"] == "invalid_json"
    assert await rig.answer(MODEL_A) == "7"


@contextlib.contextmanager
def _blackhole() -> Iterator[str]:
    """An address whose connects hang: a listener that never accepts, its queue full."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


async def test_an_activation_url_that_does_not_answer_fails_fast(
        make_rig: RigFactory) -> None:
    # The controller counts as lost once its calls time out; the request then waits for
    # its Lease to change (tests/gateway/test_unreachable_controller.py), here in vain.
    rig = await make_rig(activation_connect_timeout_s=0.3, activation_attempts=2,
                         max_wait_s=2.0)
    with _blackhole() as url:
        rig.apply("lease", "MODIFIED", controller_lease(url))
        resp = await rig.chat(MODEL_B)
    assert resp.status == 503, await resp.text()
    assert (await resp.json())["error"]["code"] == "controller_lost"
    assert resp.headers["Retry-After"]


async def test_series_of_models_whose_claims_are_gone_are_dropped(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    assert await rig.answer(MODEL_B) == "7"
    assert await rig.answer(MODEL_A) == "7"
    text = await (await rig.gateway.get("/metrics")).text()
    assert f'model_name="{MODEL_B}"' in text
    rig.apply("claim", "DELETED", claim_obj("claim-b", model=MODEL_B, port=rig.b.port,
                                            pod_uid="pod-b"))
    text = await (await rig.gateway.get("/metrics")).text()
    assert f'model_name="{MODEL_B}"' not in text
    assert f'rota_gateway_requests_total{{model_name="{MODEL_A}",outcome="ok"}} 1.0' in text
    assert MODEL_B not in rig.app[keys.PLACES].counts()


async def test_an_ipv6_engine_is_reached_at_its_bracketed_address(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    six = await start_sim(MODEL_A, f"{NAMESPACE}/claim-a", host="::1")
    rig.closers.append(six.client.close)
    rig.apply("claim", "MODIFIED", claim_obj("claim-a", model=MODEL_A, port=six.port,
                                             pod_uid="pod-a"))
    rig.apply("pod", "MODIFIED", pod_obj("pod-claim-a", uid="pod-a", ip="::1"))
    async with asyncio.timeout(DEADLINE):
        assert await rig.answer(MODEL_A) == "7"
    assert six.engine.generations_started == 1
    assert rig.a.engine.generations_started == 0
