"""The gateway asks a controller again when the answer's error code says so, whatever the
status it came with (review R10): a controller of an earlier release answered a stopping
or closed worker's waiters with 503, and every controller rollout then failed the requests
waiting for a switch on that node."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.gateway.activation import ActivationFailed, Activator
from controller.gateway.metrics import GatewayMetrics
from rota.api.activation import ERRORS
from tests.gateway.conftest import MODEL_B, Failure, RigFactory, contract_error

pytestmark = pytest.mark.gateway


class _Controller:
    def __init__(self) -> None:
        self.answer: tuple[int, str] = (503, "gpu_oom")

    async def activate(self, request: web.Request) -> web.Response:
        status, kind = self.answer
        return web.json_response({"error": {"type": kind, "message": f"said {kind}"}},
                                 status=status, headers={"Retry-After": "1"})


@pytest.fixture
async def controller() -> AsyncIterator[tuple[_Controller, str]]:
    answers = _Controller()
    app = web.Application()
    app.router.add_post("/v1/activate", answers.activate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield answers, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def _failure(url: str) -> ActivationFailed:
    async with aiohttp.ClientSession() as session:
        activator = Activator(session, None, timeout_s=10, connect_timeout_s=10, attempts=1,
                              retry_after=1.0, metrics=GatewayMetrics(dict))
        loop_time = asyncio.get_running_loop().time
        try:
            with pytest.raises(ActivationFailed) as failed:
                await activator.activate(url, "org/m", "prod/m", deadline=loop_time() + 10)
        finally:
            await activator.close()
    return failed.value


@pytest.mark.parametrize("status", [409, 503])
@pytest.mark.parametrize("kind", ["not_leader", "stopping", "interrupted"])
async def test_the_next_leader_is_asked_again(controller: tuple[_Controller, str],
                                              kind: str, status: int) -> None:
    answers, url = controller
    answers.answer = (status, kind)
    failed = await _failure(url)
    assert failed.refused, failed
    assert failed.code == kind
    assert failed.retry_after == 1.0


@pytest.mark.parametrize(("status", "kind"), [
    (503, "gpu_oom"), (503, "memory_not_returned"), (503, "engine_unauthorized"),
    (404, "unknown_model"), (400, "invalid_request"), (401, "unauthorized"),
    (413, "request_too_large"), (503, "reason_nobody_knows"),
])
async def test_a_failure_is_not_asked_again(controller: tuple[_Controller, str],
                                            status: int, kind: str) -> None:
    answers, url = controller
    answers.answer = (status, kind)
    failed = await _failure(url)
    assert not failed.refused, failed


async def test_an_unknown_code_with_409_is_still_asked_again(
        controller: tuple[_Controller, str]) -> None:
    """A reason a newer controller adds: its 409 still means "ask again"."""
    answers, url = controller
    answers.answer = (409, "reason_of_a_newer_release")
    failed = await _failure(url)
    assert failed.refused
    assert failed.code == "other"


@pytest.mark.parametrize("code", ["not_leader", "stopping", "interrupted"])
async def test_a_controller_rollout_does_not_fail_the_waiting_request(
        make_rig: RigFactory, code: str) -> None:
    """The fake controller answers as a stopping (or standby, or fenced) controller does,
    once; the gateway asks again after Retry-After and the request is served."""
    rig = await make_rig()
    rig.controller.failure = Failure(409, code, retry_after=1, times=1)
    assert await rig.answer(MODEL_B) == "7"
    assert rig.controller.calls == 2
    assert rig.controller.switches == 1


@pytest.mark.parametrize("code", sorted(ERRORS))
def test_the_rigs_fake_controller_answers_by_the_table(code: str) -> None:
    row = ERRORS[code]
    fake = contract_error(code, "said so")
    retry_after = str(row.retry_after_s) if row.retry_after_s else None
    assert (fake.status, fake.headers.get("Retry-After")) == (row.status, retry_after)
    assert Failure(row.status, code, retry_after=1).reason == code
    with pytest.raises(AssertionError):
        Failure(row.status + 1, code, retry_after=1)
