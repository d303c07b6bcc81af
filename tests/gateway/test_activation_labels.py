"""The outcome of an activation is a metric label and an error code: it takes only values
of a fixed set, whatever a controller answers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.gateway.activation import ActivationFailed, Activator
from controller.gateway.metrics import GatewayMetrics
from controller.lease.engines import errors
from controller.lease.engines.probe import ProbeReason

pytestmark = pytest.mark.gateway


class _Answers:
    """A controller simulator that answers each activation with the next error type."""

    def __init__(self) -> None:
        self.types: list[str] = []
        self.status = 503

    async def activate(self, request: web.Request) -> web.Response:
        kind = self.types.pop(0)
        return web.json_response({"error": {"type": kind, "message": f"said {kind}"}},
                                 status=self.status, headers={"Retry-After": "1"})


@pytest.fixture
async def controller() -> AsyncIterator[tuple[_Answers, str]]:
    answers = _Answers()
    app = web.Application()
    app.router.add_post("/v1/activate", answers.activate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield answers, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _outcomes(metrics: GatewayMetrics) -> set[str]:
    return {sample.labels["outcome"] for family in metrics.activations.collect()
            for sample in family.samples if sample.name.endswith("_total")}


async def test_a_controllers_made_up_reasons_become_one_label(
        controller: tuple[_Answers, str]) -> None:
    answers, url = controller
    metrics = GatewayMetrics(dict)
    made_up = [f"reason_{uuid.uuid4().hex[:12]}" for _ in range(20)]
    answers.types = [*made_up, "gpu_oom", "Probe-Timeout!" * 10]
    codes = []
    async with aiohttp.ClientSession() as session:
        activator = Activator(session, None, timeout_s=5, connect_timeout_s=1, attempts=1,
                              retry_after=1.0, metrics=metrics)
        loop_time = asyncio.get_running_loop().time
        for _ in range(len(answers.types)):
            with pytest.raises(ActivationFailed) as failed:
                await activator.activate(url, "org/m", "prod/m", deadline=loop_time() + 10)
            codes.append(failed.value.code)
        await activator.close()
    assert _outcomes(metrics) == {"other", "gpu_oom"}
    assert set(codes) == {"other", "gpu_oom"}


async def test_the_made_up_reason_stays_in_the_message(controller: tuple[_Answers, str]
                                                       ) -> None:
    answers, url = controller
    answers.types = ["reason_nobody_knows"]
    async with aiohttp.ClientSession() as session:
        activator = Activator(session, None, timeout_s=5, connect_timeout_s=1, attempts=1,
                              retry_after=1.0, metrics=GatewayMetrics(dict))
        loop_time = asyncio.get_running_loop().time
        with pytest.raises(ActivationFailed) as failed:
            await activator.activate(url, "org/m", "prod/m", deadline=loop_time() + 10)
        await activator.close()
    assert failed.value.code == "other"
    assert "reason_nobody_knows" in str(failed.value)


def test_every_reason_the_controller_reports_is_known() -> None:
    from controller.gateway.activation import KNOWN_OUTCOMES

    engine_reasons = {cls.reason for cls in vars(errors).values()
                      if isinstance(cls, type) and issubclass(cls, errors.EngineError)
                      and isinstance(getattr(cls, "reason", None), str)}
    engine_reasons |= {"rejected", "gpu_oom", "host_oom", "unauthorized", "ack_error"}
    engine_reasons |= {f"probe_{r.value}" for r in ProbeReason}
    controller_reasons = {"memory_not_returned", "unknown_process", "insufficient_memory",
                          "inspect_failed", "controller_crash", "not_leader", "unknown_model",
                          "invalid_request", "switch_failed", "not_serving"}
    assert engine_reasons | controller_reasons <= KNOWN_OUTCOMES
    assert "other" in KNOWN_OUTCOMES


def test_every_switch_failure_reason_of_the_controller_keeps_its_label() -> None:
    """The gateway labels an activation by the same set of reasons the controller counts
    its failures by (one home: rota.api.activation); start-up admission's reasons
    were once 'other' on the gateway's side."""
    from controller.gateway.activation import KNOWN_OUTCOMES
    from controller.lease import metrics

    assert metrics.SWITCH_FAILURE_REASONS <= KNOWN_OUTCOMES
    assert {"start_failed", "start_timeout", "start_not_taken"} <= KNOWN_OUTCOMES
