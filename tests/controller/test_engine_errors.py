"""Engines' refusals are told apart by what their answer says: GPU memory, host memory,
credentials, anything else."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.lease.engines import EngineEndpoint, Timeouts, VllmAdapter
from controller.lease.engines.errors import EngineDead, EngineRejected, is_engine_dead


def _vllm(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "InternalServerError",
                                 "param": None, "code": 500}})


@pytest.mark.parametrize(("status", "body", "reason"), [
    (500, _vllm("Call to wake_up method failed: CUDA Error: out of memory at alloc.cpp:75"),
     "gpu_oom"),
    (500, _vllm("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"),
     "gpu_oom"),
    (500, _vllm("Call to sleep method failed: DefaultCPUAllocator: can't allocate memory"),
     "host_oom"),
    (500, _vllm("RuntimeError: cannot allocate pinned memory for the weights"), "host_oom"),
    (401, '{"error": "Unauthorized"}', "unauthorized"),
    (500, _vllm("something else went wrong"), "rejected"),
    (502, "<html>bad gateway</html>", "rejected"),
])
def test_refusals_get_distinct_reasons(status: int, body: str, reason: str) -> None:
    assert EngineRejected("wake failed", step="wake", status=status, body=body).reason == reason


# The answer vLLM 0.26 gave on an H200 to the request that met its dead engine core (the
# abandoned-sleep trap; ``python -m e2e.bench.gpu --scenarios startup,dead_core``): the
# exception's name is nowhere in it.
VLLM026_DEAD_CORE = ('{"error":{"message":"EngineCore encountered an issue. See stack trace '
                     '(above) for the root cause.","type":"InternalServerError","param":null,'
                     '"code":500}}')


@pytest.mark.parametrize("body", [
    VLLM026_DEAD_CORE,
    _vllm("EngineCore encountered an issue. See stack trace (above) for the root cause."),
    json.dumps({"error": {"message": "boom", "type": "EngineDeadError"}}),
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
])
def test_a_dead_engine_core_is_told_by_vllms_answer(body: str) -> None:
    assert is_engine_dead(body)


@pytest.mark.parametrize("body", [
    _vllm("something else went wrong"),
    _vllm("the prompt mentions an EngineCore that encountered an issue"),
    '{"error": "Unauthorized"}',
    "<html>bad gateway</html>",
])
def test_other_errors_are_not_a_dead_engine(body: str) -> None:
    assert not is_engine_dead(body)


async def test_the_adapter_reports_vllms_real_dead_core_answer_as_engine_dead() -> None:
    """The transport raises EngineDead (restart the pod) for the answer real vLLM gives,
    not a plain 500 refusal."""
    async def dead(request: web.Request) -> web.Response:
        return web.Response(status=500, text=VLLM026_DEAD_CORE,
                            content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", dead)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            endpoint = EngineEndpoint(base_url=str(server.make_url("")).rstrip("/"), model="m",
                                      claim="ns/dead")
            with pytest.raises(EngineDead) as dead_error:
                await VllmAdapter(endpoint, session, Timeouts()).is_sleeping()
    finally:
        await server.close()
    assert dead_error.value.reason == "engine_dead"
