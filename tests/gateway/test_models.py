"""/v1/models, health, readiness and metrics."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.gateway.app import make_app
from controller.gateway.routing import RoutingState
from controller.gateway.settings import GatewaySettings
from rota.api import naming
from tests.gateway.conftest import MODEL_A, MODEL_B, RigFactory, gpu_lease

pytestmark = pytest.mark.gateway


async def test_models_list_every_model_with_its_state(make_rig: RigFactory) -> None:
    rig = await make_rig()
    body = await (await rig.gateway.get("/v1/models")).json()
    assert body["object"] == "list"
    states = {m["id"]: m["rota"]["state"] for m in body["data"]}
    assert states == {MODEL_A: "awake", MODEL_B: "asleep"}
    assert all(m["object"] == "model" and m["owned_by"] == "rota" for m in body["data"])

    rig.state.apply("lease", "MODIFIED", rig.controller.lease_now(
        state=naming.STATE_SWITCHING, target=MODEL_B, draining=MODEL_A))
    one = await (await rig.gateway.get(f"/v1/models/{MODEL_B}")).json()
    assert (one["id"], one["rota"]["state"]) == (MODEL_B, "switching")

    # An engine of B starting up (start-up admission): "starting" (it said "switching").
    rig.state.apply("lease", "MODIFIED", rig.controller.lease_now(
        state=naming.STATE_STARTING, target=MODEL_B, draining=MODEL_A))
    one = await (await rig.gateway.get(f"/v1/models/{MODEL_B}")).json()
    assert one["rota"]["state"] == "starting"

    rig.state.apply("lease", "MODIFIED", gpu_lease(
        holder=None, state=naming.STATE_FAILED, target=MODEL_B,
        last_error="gpu_oom: engines/claim-b ran out waking; prod/secret-claim holds 60Gi"))
    one = await (await rig.gateway.get(f"/v1/models/{MODEL_B}")).json()
    # The reason only: the message names other tenants' claims.
    assert one["rota"] == {"state": "failed", "gpus": ["node-1/gpu-0"], "nodes": ["node-1"],
                           "awake_on": [], "awake_with": [], "expected_wake_s": None,
                           "last_error": "gpu_oom"}
    missing = await rig.gateway.get("/v1/models/none/such")
    assert missing.status == 404


async def test_models_show_the_awake_set(make_rig: RigFactory) -> None:
    """Both engines awake on one GPU (B beside the holder A): each is ``awake`` there, with
    the other beside it; requests for either are served without asking the controller."""
    rig = await make_rig()
    async with rig.b.client.post("/wake_up") as resp:
        assert resp.status == 200
    rig.apply("lease", "MODIFIED", rig.controller.lease_now(
        awake_with=[(rig.b.claim, MODEL_B)]))
    body = await (await rig.gateway.get("/v1/models")).json()
    rota = {m["id"]: m["rota"] for m in body["data"]}
    assert {m: (r["state"], r["awake_on"], r["awake_with"]) for m, r in rota.items()} == {
        MODEL_A: ("awake", ["node-1/gpu-0"], [MODEL_B]),
        MODEL_B: ("awake", ["node-1/gpu-0"], [MODEL_A])}
    assert rota[MODEL_B]["expected_wake_s"] == 0.0
    assert await rig.answer(MODEL_B)
    assert await rig.answer(MODEL_A)
    assert rig.controller.calls == 0, "no activation for an engine already awake"


class _NeverSyncs:
    async def run(self, state: RoutingState) -> None:
        return None


async def test_ready_only_once_the_first_lists_are_in() -> None:
    settings = GatewaySettings(host="127.0.0.1", port=0)
    app = make_app(settings, routing_source=_NeverSyncs())
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        resp = await client.post("/v1/chat/completions", json={"model": "m"})
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "not_ready"
        assert resp.headers["Retry-After"]
        metrics = await (await client.get("/metrics")).text()
        assert 'rota_gateway_requests_total{model_name="(unknown)",outcome="not_ready"} 1.0' \
            in metrics
    finally:
        await client.close()


async def test_metrics_cover_queue_wait_and_first_token(make_rig: RigFactory) -> None:
    rig = await make_rig()
    resp = await rig.chat(MODEL_B, stream=True)
    await resp.read()
    text = await (await rig.gateway.get("/metrics")).text()
    for name in ("rota_gateway_queue_wait_duration_seconds_count",
                 "rota_gateway_first_byte_duration_seconds_count",
                 "rota_gateway_first_token_duration_seconds_count"):
        assert f'{name}{{model_name="{MODEL_B}"}} 1.0' in text, name
    assert f'rota_gateway_requests_in_flight{{model_name="{MODEL_B}"}} 0.0' in text
    assert f'rota_gateway_info{{version="{metadata.version("rota")}"}} 1.0' in text
    assert "\nprocess_cpu_seconds_total " in text
    assert "\npython_info{" in text
