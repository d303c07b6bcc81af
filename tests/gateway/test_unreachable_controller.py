"""A controller Lease naming an address nobody listens on is a lost controller, not an
answer: after ``helm uninstall`` the stopping controller cannot release its Lease (its RBAC
went first), so the next install's gateway first sees a Lease that looks fresh for a whole
duration and names a gone pod. A request that needs a switch waits for the next
controller's Lease within its deadline instead of failing with ``controller_unreachable``."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.gateway.conftest import DEADLINE, MODEL_B, Rig, RigFactory, controller_lease

pytestmark = pytest.mark.gateway


def _gone_address() -> str:
    """A loopback address nobody listens on (a port just given back: connections refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _gone_controller_lease() -> dict[str, Any]:
    lease = controller_lease(_gone_address())
    lease["spec"]["holderIdentity"] = "rota-controller-gone"
    return lease


async def _next_controller(rig: Rig) -> str:
    """The rig's fake controller at an address of its own (the next install's pod)."""
    app = web.Application()
    app.router.add_post("/v1/activate", rig.controller.activate)
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    rig.closers.append(client.close)
    return str(client.make_url("")).rstrip("/")


async def _until_lost_or_answered(rig: Rig, request: asyncio.Task[Any]) -> None:
    """Until the gateway counts the Lease's controller lost for ``MODEL_B``, or the request
    was answered (the old code: at once, with a 503)."""
    async with asyncio.timeout(DEADLINE):
        while not request.done() and rig.state.decide(MODEL_B).reason != "controller_lost":
            await asyncio.wait({request}, timeout=0.05)


async def test_a_request_waits_for_the_next_controller_when_the_lease_names_a_gone_one(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    rig.apply("lease", "MODIFIED", _gone_controller_lease())
    request = asyncio.create_task(rig.chat(MODEL_B))
    await _until_lost_or_answered(rig, request)

    # The next controller takes the Lease over.
    rig.apply("lease", "MODIFIED", controller_lease(await _next_controller(rig)))
    async with asyncio.timeout(DEADLINE):
        resp = await request
    assert resp.status == 200, await resp.text()  # 503 controller_unreachable on the old code
    body = await resp.json()
    assert body["model"] == MODEL_B
    assert rig.controller.calls == 1
