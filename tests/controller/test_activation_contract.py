"""The activation API's one table, and everyone who answers or reads by it: the real server,
the gateway's client, and the ``kubectl rota`` simulator (the gateway rig's fake controller
is checked in ``tests/gateway/test_activation_ask_again.py``). The contract's typed
``/v1/state`` is what the server sends."""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.credentials import ApiKeys
from controller.gateway.activation import KNOWN_OUTCOMES
from controller.lease.activation import make_app
from controller.lease.engines.probe import ProbeReason
from controller.lease.gpu import Activation
from controller.lease.node import NodeController
from rota.api import naming
from rota.api.activation import (
    ENGINE_UNAUTHORIZED,
    ERRORS,
    PATH,
    PROBE_REASONS,
    STATE_PATH,
    SWITCH_FAILED,
    SWITCH_FAILURE_REASONS,
    ActivateAnswer,
    ErrorBody,
    StateAnswer,
    asks_again,
    refusal_of,
    wire_reason,
)
from rota.api.gpu_lease import GpuLease
from tests.chart.activation_simulator import ActivationApiSimulator, serving
from tests.controller.activation_kit import CLAIM, MODEL, RoutingNode, claimant_b, make_worker

pytestmark = pytest.mark.controller

ASK_AGAIN = {"not_leader", "stopping", "interrupted", "min_residency"}
"""A standby, a stopping or closed worker, a switch cut short, a policy declining for now:
another answer will come, from this node's next leader or later from this one."""
SERVER_CODES = {"not_leader", "stopping", "interrupted", "not_serving", "state_unknown",
                "switch_failed", "invalid_request", "unauthorized", "unknown_model",
                "not_found", "method_not_allowed", "request_too_large"}
"""The codes the server and the GPU workers name themselves."""


def test_the_table() -> None:
    assert {code for code, row in ERRORS.items() if row.ask_again} == ASK_AGAIN
    for code in ASK_AGAIN:
        assert ERRORS[code].status == 409, code
        assert ERRORS[code].retry_after_s, code
    assert {code: ERRORS[code].status for code in (
        "invalid_request", "unauthorized", "unknown_model", "not_found",
        "method_not_allowed", "request_too_large")} == {
        "invalid_request": 400, "unauthorized": 401, "unknown_model": 404, "not_found": 404,
        "method_not_allowed": 405, "request_too_large": 413}
    failures = {code for code, row in ERRORS.items() if row.status == 503}
    assert failures == {wire_reason(r) for r in SWITCH_FAILURE_REASONS} | {"switch_failed",
                                                                           "not_serving"}
    for code in failures:
        assert not ERRORS[code].ask_again, code
        assert ERRORS[code].retry_after_s, code
    assert set(ERRORS) >= SERVER_CODES


def test_a_code_the_table_does_not_know_is_a_failed_switch() -> None:
    assert refusal_of("runtimeerror") is SWITCH_FAILED
    assert SWITCH_FAILED.status == 503
    assert not SWITCH_FAILED.ask_again
    assert asks_again("reason_of_a_newer_release", 409)
    assert not asks_again("reason_of_a_newer_release", 503)
    assert not asks_again(None, 503)


def test_only_the_engines_unauthorized_is_renamed_on_the_wire() -> None:
    """A switch failure's code is its reason, except the one the API's 401 already names."""
    assert wire_reason("unauthorized") == ENGINE_UNAUTHORIZED
    assert wire_reason("") == "switch_failed"
    for reason in SWITCH_FAILURE_REASONS - {"unauthorized"}:
        assert wire_reason(reason) == reason
    assert ERRORS["unauthorized"].status == 401


def test_the_probe_reasons_are_the_probes() -> None:
    assert {r.value for r in ProbeReason} == PROBE_REASONS


def test_the_gateway_knows_every_code() -> None:
    assert set(ERRORS) <= KNOWN_OUTCOMES
    for code, row in ERRORS.items():
        for status in (409, 503, row.status):
            assert asks_again(code, status) is row.ask_again, (code, status)


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


@pytest.mark.parametrize("reason", sorted(SWITCH_FAILURE_REASONS | ASK_AGAIN
                                          | {"not_serving", ""}))
async def test_the_server_answers_every_reason_by_the_table(
        api: TestClient[Any, Any], node: RoutingNode, reason: str) -> None:
    node.result = Activation(False, node.claimant, switched=False, fence=1, reason=reason,
                             message="said so")
    async with api.post(PATH, json={"model": MODEL}) as resp:
        body = ErrorBody.model_validate(await resp.json())
        row = refusal_of(body.error.type)
        assert body.error.type == wire_reason(reason)
        assert resp.status == row.status
        assert resp.headers.get("Retry-After") == (
            str(row.retry_after_s) if row.retry_after_s else None)


@pytest.mark.parametrize(("method", "path", "code"), [
    ("GET", "/v1/nothing-here", "not_found"), ("GET", PATH, "method_not_allowed"),
])
async def test_the_servers_own_refusals_are_in_the_contracts_shape(
        api: TestClient[Any, Any], method: str, path: str, code: str) -> None:
    async with api.request(method, path) as resp:
        assert resp.status == ERRORS[code].status
        assert ErrorBody.model_validate(await resp.json()).error.type == code


async def test_the_server_builds_the_typed_state(api: TestClient[Any, Any],
                                                 node: RoutingNode) -> None:
    node.worker.lease = GpuLease(name="l", node="node-a", device="gpu-0", holder=CLAIM,
                                 state=naming.STATE_AWAKE, fence=2)
    node.worker.last_switch = {"ok": False, "from": "ns/other", "to": CLAIM,
                               "reason": "gpu_oom", "fence": 2, "timings": {}}
    async with api.get(STATE_PATH) as resp:
        raw = await resp.json()
    state = StateAnswer.model_validate(raw)
    assert state.model_dump(mode="json") == raw
    switch = state.leases["gpu-0"].last_switch
    assert switch is not None
    assert (switch.from_, switch.reason) == ("ns/other", "gpu_oom")
    assert [c.claim for c in state.claimants] == [CLAIM]


def test_a_state_without_a_switch_reads_and_writes_as_before() -> None:
    raw = {"node": "n", "identity": "i", "leader": False,
           "leases": {"gpu-0": {"holder": "", "state": "idle", "fence": 0, "last_error": "",
                                "last_switch": {}}},
           "claimants": []}
    state = StateAnswer.model_validate(raw)
    assert state.leases["gpu-0"].last_switch is None
    assert state.model_dump(mode="json") == raw


def _simulator_answer(url: str, body: bytes) -> tuple[int, str | None, ErrorBody]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", PATH, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Retry-After"), ErrorBody.model_validate_json(
            resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("code", sorted(ERRORS))
async def test_the_kubectl_simulator_answers_by_the_table(code: str) -> None:
    row = ERRORS[code]
    retry_after = str(row.retry_after_s) if row.retry_after_s else None
    sim = ActivationApiSimulator("127.0.0.1", None, failures={MODEL: code},
                                 serves={MODEL: ActivateAnswer(model=MODEL, claim=CLAIM)})
    with serving(sim) as url:
        status, header, body = await asyncio.to_thread(
            _simulator_answer, url, b'{"model": "' + MODEL.encode() + b'"}')
    assert (status, header, body.error.type) == (row.status, retry_after, code)


async def test_the_simulator_refuses_an_oversized_body_as_the_server_does() -> None:
    sim = ActivationApiSimulator("127.0.0.1", None)
    with serving(sim) as url:
        status, _, body = await asyncio.to_thread(
            _simulator_answer, url, b'{"model": "' + b"m" * (20 * 1024) + b'"}')
    assert (status, body.error.type) == (413, "request_too_large")


async def test_a_gang_switch_in_the_state(api: TestClient[Any, Any], node: RoutingNode) -> None:
    """A switch of an engine that spans GPUs names every holder it put to sleep and its
    GPUs; a switch of one GPU has no ``gang`` key, as before."""
    node.worker.lease = GpuLease(name="l", node="node-a", device="gpu-0", holder=CLAIM,
                                 state=naming.STATE_AWAKE, fence=4)
    gang = {"ok": True, "from": ["ns/x", "ns/y"], "to": CLAIM, "reason": "", "fence": 4,
            "gang": ["gpu-0", "gpu-1"], "timings": {"total": 2.5}}
    node.worker.last_switch = dict(gang)
    async with api.get(STATE_PATH) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.json()
    assert raw["leases"]["gpu-0"]["last_switch"] == gang
    switch = StateAnswer.model_validate(raw).leases["gpu-0"].last_switch
    assert switch is not None
    assert (switch.from_, switch.gang) == (["ns/x", "ns/y"], ["gpu-0", "gpu-1"])


def test_a_state_with_an_awake_set_names_the_engines_beside_the_holder() -> None:
    raw = {"node": "n", "identity": "i", "leader": True,
           "leases": {"gpu-0": {"holder": "ns/b", "state": "awake", "fence": 3,
                                "awake_with": ["ns/a"], "last_error": "",
                                "last_switch": {}}},
           "claimants": []}
    state = StateAnswer.model_validate(raw)
    assert state.leases["gpu-0"].awake_with == ["ns/a"]
    assert state.model_dump(mode="json") == raw
