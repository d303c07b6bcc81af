"""What the activation API answers, decided by the error code alone (review R10, R13).

A GPU worker that does not take work (a standby, a worker closed when its instance lost
the node or is stopping) and a switch cut short by fencing are "ask again": 409 with
``Retry-After``, whatever the moment the waiter was answered at. A body over the limit is a
413 in the contract's error shape, not aiohttp's plain text. The server runs on a real
:class:`~controller.lease.gpu.GpuWorker` behind a node that only routes to it; nothing waits on
a clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.credentials import ApiKeys
from controller.gateway.activation import ActivationFailed, Activator
from controller.gateway.metrics import GatewayMetrics
from controller.lease.activation import make_app
from controller.lease.gpu import Activation, GpuWorker, Policy
from controller.lease.node import NodeController
from controller.lease.switch import Fenced
from rota.api import naming
from rota.api.activation import PATH, STATE_PATH, ErrorBody
from rota.api.gpu_lease import GpuLease
from tests.controller.activation_kit import CLAIM, MODEL, RoutingNode, claimant_b, make_worker

pytestmark = pytest.mark.controller

BOUND_S = 10.0
"""Upper bound of every wait (a bound, not a pace)."""


@pytest.fixture
async def node() -> RoutingNode:
    claimant = claimant_b()
    return RoutingNode(make_worker(claimant), claimant)


@pytest.fixture
async def api(node: RoutingNode) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_app(cast(NodeController, node), callers=ApiKeys(None))
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def _error_of(resp: aiohttp.ClientResponse) -> tuple[int, str, str | None]:
    assert resp.content_type == "application/json", await resp.text()
    body = ErrorBody.model_validate(await resp.json())
    return resp.status, body.error.type, resp.headers.get("Retry-After")


def _activate(api: TestClient[Any, Any]) -> asyncio.Task[aiohttp.ClientResponse]:
    return asyncio.ensure_future(api.post(PATH, json={"model": MODEL, "claim": CLAIM}))


async def _queued(node: RoutingNode) -> None:
    async with asyncio.timeout(BOUND_S):
        await node.asked.wait()
    assert node.worker.pending() == 1


async def _answer(call: asyncio.Task[aiohttp.ClientResponse]) -> tuple[int, str, str | None]:
    async with asyncio.timeout(BOUND_S):
        async with await call as resp:
            return await _error_of(resp)


async def test_a_standby_worker_answers_409_not_leader(api: TestClient[Any, Any]) -> None:
    """A worker that never opened (this instance never led the node) answers at once."""
    async with await _activate(api) as resp:
        status, kind, retry_after = await _error_of(resp)
    assert (status, kind) == (409, "not_leader")
    assert retry_after is not None
    assert int(retry_after) >= 1


@pytest.mark.parametrize("reason", ["not_leader", "stopping"])
async def test_waiters_of_a_closing_worker_get_409(api: TestClient[Any, Any], node: RoutingNode,
                                                   reason: str) -> None:
    """A waiter queued when the instance loses the node or stops: the next leader
    answers, so the gateway must be told to ask again."""
    node.worker.open()
    call = _activate(api)
    await _queued(node)
    node.worker.close(reason, f"closed: {reason}")
    status, kind, retry_after = await _answer(call)
    assert (status, kind) == (409, reason)
    assert retry_after is not None


def _idle_lease(worker: GpuWorker) -> None:
    worker.lease = GpuLease(name="gpu-lease", node="node-a", device="gpu-0",
                            state=naming.STATE_IDLE, fence=3)


async def test_a_switch_fenced_once_too_often_answers_409(api: TestClient[Any, Any],
                                                          node: RoutingNode) -> None:
    """The first compare-and-swap of the switch failed and the worker has no retry left:
    the switch never began, and the caller may ask again."""
    node.worker = worker = make_worker(node.claimant, Policy(fenced_retries=0))
    worker.open()
    _idle_lease(worker)
    call = _activate(api)
    await _queued(node)
    with pytest.raises(Fenced):
        await worker._serve_next(asyncio.Event())
    status, kind, retry_after = await _answer(call)
    assert (status, kind) == (409, "interrupted")
    assert retry_after is not None


async def test_a_fenced_switch_whose_worker_then_stops_answers_409(
        api: TestClient[Any, Any], node: RoutingNode) -> None:
    """A fenced switch waits, queued, for its retry after reconciliation; the controller
    stops before it: the next leader answers."""
    worker = node.worker
    worker.open()
    _idle_lease(worker)
    call = _activate(api)
    await _queued(node)
    with pytest.raises(Fenced):
        await worker._serve_next(asyncio.Event())
    assert worker.pending() == 1, "queued again for its retry"
    worker.close("stopping", "the controller is stopping")
    status, kind, _ = await _answer(call)
    assert (status, kind) == (409, "stopping")


@pytest.mark.parametrize(("reason", "status"), [
    ("gpu_oom", 503), ("memory_not_returned", 503), ("not_serving", 503),
    ("state_unknown", 503), ("runtimeerror", 503), ("", 503),
])
async def test_a_failed_switch_answers_503_with_retry_after(
        api: TestClient[Any, Any], node: RoutingNode, reason: str, status: int) -> None:
    node.result = Activation(False, node.claimant, switched=False, fence=4, reason=reason,
                             message="it failed")
    async with await _activate(api) as resp:
        got, kind, retry_after = await _error_of(resp)
    assert got == status
    assert kind == (reason or "switch_failed")
    assert retry_after is not None
    assert int(retry_after) >= 1


async def test_an_engine_refusing_rotas_token_is_not_the_apis_401(
        api: TestClient[Any, Any], node: RoutingNode) -> None:
    """The engine's ``unauthorized`` (it refused rota's control token) is a failed switch:
    a 401 would read as "your activation token is wrong" to every caller."""
    node.result = Activation(False, node.claimant, switched=False, fence=4,
                             reason="unauthorized", message="the engine answered 401")
    async with await _activate(api) as resp:
        status, kind, retry_after = await _error_of(resp)
    assert (status, kind) == (503, "engine_unauthorized")
    assert retry_after is not None


async def test_the_gateway_asks_a_closed_worker_again(api: TestClient[Any, Any],
                                                      node: RoutingNode) -> None:
    """The real server and the gateway's real client agree: a stopping controller's answer
    is "ask again" (the gateway then waits Retry-After and calls the next leader)."""
    node.worker.open()
    url = str(api.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        activator = Activator(session, None, timeout_s=BOUND_S, connect_timeout_s=BOUND_S,
                              attempts=1, retry_after=1.0, metrics=GatewayMetrics(dict))
        loop_time = asyncio.get_running_loop().time
        call = asyncio.ensure_future(
            activator.activate(url, MODEL, CLAIM, deadline=loop_time() + BOUND_S))
        await _queued(node)
        node.worker.close("stopping", "the controller is stopping")
        with pytest.raises(ActivationFailed) as failed:
            await call
        await activator.close()
    assert failed.value.refused, failed.value
    assert failed.value.code == "stopping"


@pytest.mark.parametrize("size", [16 * 1024, 64 * 1024])
async def test_an_oversized_body_gets_the_error_shape(api: TestClient[Any, Any],
                                                      size: int) -> None:
    body = b'{"model": "' + b"m" * size + b'"}'
    async with api.post(PATH, data=body, headers={"Content-Type": "application/json"}) as resp:
        status, kind, _ = await _error_of(resp)
    assert (status, kind) == (413, "request_too_large")


async def test_a_body_under_the_limit_is_read(api: TestClient[Any, Any], node: RoutingNode) -> None:
    node.result = Activation(True, node.claimant, switched=True, fence=5)
    body = b'{"model": "' + MODEL.encode() + b'"}' + b" " * (15 * 1024)
    async with api.post(PATH, data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["fence"] == 5


async def test_the_state_keeps_its_keys(api: TestClient[Any, Any], node: RoutingNode) -> None:
    """``GET /v1/state`` as ``kubectl rota status`` and operators read it."""
    worker = node.worker
    worker.lease = GpuLease(name="gpu-lease", node="node-a", device="gpu-0", holder=CLAIM,
                            state=naming.STATE_AWAKE, fence=7, last_error="gpu_oom: earlier")
    worker.last_switch = {"ok": True, "from": None, "to": CLAIM, "reason": "", "fence": 7,
                          "timings": {"wake": 1.5}}
    async with api.get(STATE_PATH) as resp:
        assert resp.status == 200
        state = await resp.json()
    assert state == {
        "node": "node-a", "identity": "ctl-0", "leader": True,
        "leases": {"gpu-0": {"holder": CLAIM, "state": "awake", "fence": 7,
                             "last_error": "gpu_oom: earlier",
                             "last_switch": {"ok": True, "from": None, "to": CLAIM,
                                             "reason": "", "fence": 7,
                                             "timings": {"wake": 1.5}}}},
        "claimants": [{"claim": CLAIM, "model": MODEL, "device": "gpu-0", "gpu": "gpu-0",
                       "endpoint": "http://127.0.0.2:8000", "serving": True,
                       "expected_switch_s": 0.0, "queue_position": 0,
                       "expected_wait_s": 0.0}],
    }


async def test_a_worker_without_a_lease_is_left_out_of_the_state(
        api: TestClient[Any, Any]) -> None:
    async with api.get(STATE_PATH) as resp:
        state = await resp.json()
    assert state["leases"] == {}
    assert [c["claim"] for c in state["claimants"]] == [CLAIM]

