"""The adapters against vLLM 0.26's traps (issue 11, points 1-4 and 7), each on the
simulator that now behaves like vLLM 0.26, or on a scripted engine where the simulator
cannot misbehave in the needed way."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.lease.engines import (
    CONTROL_TOKEN_HEADER,
    EngineDead,
    EngineEndpoint,
    EngineLied,
    EngineProtocolError,
    EngineRejected,
    EngineStateUnknown,
    EngineUnsupported,
    ProbeReason,
    SleepStateKind,
    Timeouts,
    UnfinishedWake,
    VllmAdapter,
    VllmOmniAdapter,
)
from controller.lease.engines.probe import probe_payload
from driver.nvml.fake import FakeGpu, FakeNvml, NvmlFixture
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSim, EngineSimFactory

GIB = ENGINE_SIM_GIB
GPU_UUID = "GPU-5e1f0000-0000-0000-0000-00000000cafe"


def vllm(sim: EngineSim, session: aiohttp.ClientSession, *, api_key: str | None = None,
         token: str | None = None, timeouts: Timeouts | None = None) -> VllmAdapter:
    return VllmAdapter(sim.endpoint(api_key=api_key, token=token), session,
                       timeouts or Timeouts())


# -- 1. credentials ----------------------------------------------------------------------


async def test_the_probe_carries_the_engine_api_key(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """vLLM with --api-key answers 401 on /v1* without the key: every probe failed."""
    sim = await engine_sim_factory(api_key="sk-engine")
    keyed = vllm(sim, engine_session, api_key="sk-engine")
    await keyed.sleep(1)
    await keyed.wake(1)
    assert (await keyed.probe()).ok
    anonymous = await vllm(sim, engine_session).probe()
    assert (anonymous.reason, anonymous.status) == (ProbeReason.HTTP_ERROR, 401)


async def test_the_control_routes_need_no_credential_at_all(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """What rota no longer pretends: vLLM never authenticates its control routes, so an
    adapter with no key and no token still puts a keyed engine to sleep."""
    sim = await engine_sim_factory(api_key="sk-engine")
    nobody = vllm(sim, engine_session)
    await nobody.sleep(1)
    assert sim.engine.state.is_sleeping
    assert await nobody.in_flight() == 0
    await nobody.wake(1)


@dataclass
class Scripted:
    """A minimal vLLM-shaped engine that records what reached it and answers as told."""

    server: TestServer
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    sleeping: bool = False
    gauge: str | None = "awake"
    gauge_after_sleep: str | None = None
    reset_body: str = '{"success": true}'
    rpc_body: str = '{"results": [null]}'

    def endpoint(self, **extra: Any) -> EngineEndpoint:
        return EngineEndpoint(base_url=str(self.server.make_url("")), model="m",
                              claim="ns/scripted", **extra)


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    holder: list[Scripted] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        holder[0].seen.append((request.path, dict(request.headers)))
        response: web.StreamResponse = await handler(request)
        return response

    async def sleep(request: web.Request) -> web.Response:
        engine = holder[0]
        engine.sleeping = True
        level = request.query.get("level", "1")
        engine.gauge = engine.gauge_after_sleep or (
            "weights_offloaded" if level == "1" else "discard_all")
        return web.Response()

    async def wake_up(request: web.Request) -> web.Response:
        engine = holder[0]
        if request.query.get("tags", "kv_cache") == "kv_cache":
            engine.sleeping = False
        engine.gauge = "awake"
        return web.Response()

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": holder[0].sleeping})

    async def metrics(request: web.Request) -> web.Response:
        gauge = holder[0].gauge
        lines = ['vllm:num_requests_running{engine="0",model_name="m"} 0.0',
                 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0']
        if gauge is not None:
            lines += [f'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="{s}"}} '
                      f'{1.0 if s == gauge else 0.0}'
                      for s in ("awake", "weights_offloaded", "discard_all")]
        return web.Response(text="\n".join(lines) + "\n")

    async def reset(request: web.Request) -> web.Response:
        return web.Response(text=holder[0].reset_body, content_type="application/json")

    async def rpc(request: web.Request) -> web.Response:
        return web.Response(text=holder[0].rpc_body, content_type="application/json")

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in ('{"choices":[{"index":0,"delta":{"content":"7"}}]}',
                     '{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,'
                     '"total_tokens":2}}', "[DONE]"):
            await response.write(f"data: {data}\n\n".encode())
        await response.write_eof()
        return response

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.26.0"})  # every vLLM serves it

    app = web.Application(middlewares=[record])
    app.router.add_get("/version", version)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_post("/collective_rpc", rpc)
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    holder.append(Scripted(server))
    try:
        yield holder[0]
    finally:
        await server.close()


async def test_credentials_go_only_where_they_are_read(
    scripted: Scripted, engine_session: aiohttp.ClientSession
) -> None:
    """The API key on /v1* only; rota's control token in its own header on control calls
    only (the engine guard reads it; vLLM ignores it). The old adapter sent the control
    token as ``Authorization`` to the control routes and nothing to the probe."""
    adapter = VllmAdapter(scripted.endpoint(api_key="sk-engine", token="rota-control"),
                          engine_session, Timeouts())
    await adapter.sleep(2)
    await adapter.wake(2)
    assert (await adapter.probe()).ok
    paths = {path for path, _ in scripted.seen}
    assert {"/sleep", "/wake_up", "/is_sleeping", "/metrics", "/collective_rpc",
            "/reset_prefix_cache", "/v1/chat/completions"} <= paths
    for path, headers in scripted.seen:
        if path.startswith("/v1"):
            assert headers.get("Authorization") == "Bearer sk-engine", path
            assert CONTROL_TOKEN_HEADER not in headers, path
        else:
            assert "Authorization" not in headers, path
            assert headers.get(CONTROL_TOKEN_HEADER) == "rota-control", path


# -- 2. a sleep is never abandoned silently ----------------------------------------------


async def _stalled_request(sim: EngineSim, session: aiohttp.ClientSession
                           ) -> aiohttp.ClientResponse:
    await sim.faults(stall_generation=True)
    resp = await session.post(sim.base_url + "/v1/chat/completions",
                              json=probe_payload(sim.settings.model))
    await sim.until(lambda: sim.engine.running == 1)
    return resp


async def test_a_sleep_without_an_answer_in_time_is_state_unknown_and_fires_later(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session, timeouts=Timeouts(sleep_s=0.3))
    running = await _stalled_request(engine_sim, engine_session)
    with pytest.raises(EngineStateUnknown) as caught:
        await adapter.sleep(1)
    assert (caught.value.reason, caught.value.step) == ("state_unknown", "sleep")
    assert engine_sim.engine.pending_sleeps == 1  # vLLM keeps it registered
    state = await adapter.sleep_state()
    assert state.kind is SleepStateKind.UNKNOWN  # paused, not asleep yet
    assert state.is_sleeping
    await engine_sim.faults(stall_generation=False)
    await running.read()
    await engine_sim.until(lambda: engine_sim.engine.state.is_sleeping)  # it fired
    state = await adapter.sleep_state()
    assert (state.kind, state.level, state.gauge) == (SleepStateKind.ASLEEP, 1,
                                                      "weights_offloaded")


async def test_an_abandoned_sleep_then_a_wake_kills_the_engine_and_is_reported_dead(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """The H200 reproduction through the adapter: the wake after an abandoned sleep
    "succeeds" (the executor was awake), the sleep fires once the running request ends,
    and the next request kills the engine core. sleep_state says dead; so does every
    call, as EngineDead."""
    adapter = vllm(engine_sim, engine_session, timeouts=Timeouts(sleep_s=0.3))
    running = await _stalled_request(engine_sim, engine_session)
    with pytest.raises(EngineStateUnknown):
        await adapter.sleep(1)
    await adapter.wake(1)  # answers, and /is_sleeping says awake: the trap
    await engine_sim.faults(stall_generation=False)
    await running.read()
    await engine_sim.until(lambda: engine_sim.engine.state.is_sleeping)
    probe = await adapter.probe()  # the request that kills it: an error inside the 200
    assert (probe.reason, probe.status) == (ProbeReason.STREAM_ERROR, 200)
    assert (await adapter.sleep_state()).kind is SleepStateKind.DEAD
    with pytest.raises(EngineDead) as dead:
        await adapter.is_sleeping()
    assert dead.value.reason == "engine_dead"
    with pytest.raises(EngineDead):
        await adapter.wake(1)
    assert not await adapter.health()


# -- sleep_state -------------------------------------------------------------------------


async def test_sleep_state_reads_the_level_from_the_gauge(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    assert (await adapter.sleep_state()).kind is SleepStateKind.AWAKE
    await adapter.sleep(2)
    state = await adapter.sleep_state()
    assert (state.kind, state.level, state.gauge, state.is_sleeping) == (
        SleepStateKind.ASLEEP, 2, "discard_all", True)
    await adapter.wake(2)
    assert (await adapter.sleep_state()).kind is SleepStateKind.AWAKE


async def test_sleep_state_without_stats_logging_is_asleep_but_unconfirmed(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    sim = await engine_sim_factory(disable_log_stats=True)
    adapter = vllm(sim, engine_session)
    assert await adapter.in_flight() is None  # drain has nothing to watch
    await adapter.sleep(1)
    state = await adapter.sleep_state()
    assert (state.kind, state.level, state.gauge) == (SleepStateKind.ASLEEP, None, None)
    assert "unconfirmed" in state.detail


async def test_sleep_state_of_an_engine_that_is_gone_is_unknown(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session,
                   timeouts=Timeouts(connect_s=1.0, status_s=1.0))
    await engine_sim.stop()
    assert (await adapter.sleep_state()).kind is SleepStateKind.UNKNOWN


async def test_the_gauge_is_a_second_witness_of_a_sleep(
    scripted: Scripted, engine_session: aiohttp.ClientSession
) -> None:
    """/sleep answered 200 and /is_sleeping says true, but vllm:engine_sleep_state still
    says awake: the engine contradicts itself."""
    scripted.gauge_after_sleep = "awake"
    adapter = VllmAdapter(scripted.endpoint(), engine_session, Timeouts())
    with pytest.raises(EngineLied) as caught:
        await adapter.sleep(1)
    assert "vllm:engine_sleep_state" in str(caught.value)


# -- 4. wakes that stop partway ----------------------------------------------------------


@pytest.fixture
def small_gpu(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """A 16 GiB fake GPU (its capacity published in a registry) and two live pids for two
    in-process simulators to register under."""
    registry = tmp_path / "nvml"
    gpu = FakeGpu(index=0, uuid=GPU_UUID, name="NVIDIA Small", brand=0, architecture=9,
                  cuda_compute_capability=(9, 0), pci_bus_id="00000000:01:00.0",
                  minor_number=0, memory_total=16 * GIB, memory_used=GIB // 2)
    FakeNvml(NvmlFixture(driver_version="580.0", cuda_driver_version=13000, devices=[gpu]),
             registry).init()
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE) for _ in range(2)]
    try:
        yield registry, [c.pid for c in children]
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
            child.wait()


async def _two_on_one_gpu(factory: EngineSimFactory, gpu: tuple[Path, list[int]], *,
                          level: int = 1, **b: Any) -> tuple[EngineSim, EngineSim]:
    """B (10 GiB awake: 1 resident, 3 weights, 6 KV cache) asleep, then A awake (10 GiB):
    4.5 GiB stay free, room for B's weights but not its KV cache."""
    registry, pids = gpu
    common = {"fake_nvml_dir": registry, "gpu_uuid": GPU_UUID}
    sim_b = await factory(nvml_pid=pids[1], weights_bytes=3 * GIB, **common, **b)
    async with aiohttp.ClientSession() as session, session.post(sim_b.base_url + "/sleep",
                            params={"level": str(level)}) as resp:
        assert resp.status == 200
    sim_a = await factory(nvml_pid=pids[0], **common)
    return sim_a, sim_b


async def test_a_level1_wake_that_runs_out_halfway_is_reported_and_finished(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession,
    small_gpu: tuple[Path, list[int]],
) -> None:
    sim_a, sim_b = await _two_on_one_gpu(engine_sim_factory, small_gpu)
    a, b = vllm(sim_a, engine_session), vllm(sim_b, engine_session)
    with pytest.raises(EngineRejected) as caught:
        await b.wake(1)
    error = caught.value
    assert (error.reason, error.step) == ("gpu_oom", "wake_up")
    assert error.unfinished == UnfinishedWake(1, "wake_up", ("weights", "kv_cache"))
    assert sim_b.engine.memory.used_bytes == 4 * GIB  # the weights stayed mapped
    state = await b.sleep_state(error.unfinished)
    assert (state.kind, state.tags_asleep) == (SleepStateKind.PARTLY_ASLEEP,
                                               ("weights", "kv_cache"))
    await b.sleep(1)  # answers and says asleep, but frees nothing: vLLM's no-op
    assert sim_b.engine.memory.used_bytes == 4 * GIB
    await a.sleep(1)
    woke = await b.finish_wake(error.unfinished)
    assert [s.name for s in woke.steps] == ["wake_up"]
    assert sim_b.engine.memory.used_bytes == 10 * GIB
    assert (await b.probe()).ok


async def test_a_level2_wake_that_runs_out_at_the_kv_cache_is_finished_from_there(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession,
    small_gpu: tuple[Path, list[int]],
) -> None:
    sim_a, sim_b = await _two_on_one_gpu(engine_sim_factory, small_gpu, level=2)
    a, b = vllm(sim_a, engine_session), vllm(sim_b, engine_session)
    with pytest.raises(EngineRejected) as caught:
        await b.wake(2)
    error = caught.value
    assert (error.reason, error.step) == ("gpu_oom", "wake_up_kv_cache")
    assert error.unfinished == UnfinishedWake(2, "wake_up_kv_cache", ("kv_cache",))
    await a.sleep(1)
    woke = await b.finish_wake(error.unfinished)
    assert [s.name for s in woke.steps] == ["wake_up_kv_cache"]
    assert sim_b.engine.reloads == 1  # nothing done twice
    assert (await b.probe()).ok


async def test_a_half_done_level2_wake_cannot_be_slept_off(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """Under dummy weights reload_weights fails: the weights are mapped, the KV cache is
    not, and a /sleep frees nothing. The error says what is left; only a restart helps."""
    sim = await engine_sim_factory(load_format="dummy")
    adapter = vllm(sim, engine_session)
    await adapter.sleep(2)
    with pytest.raises(EngineRejected) as caught:
        await adapter.wake(2)
    assert caught.value.step == "reload_weights"
    assert caught.value.unfinished == UnfinishedWake(2, "reload_weights", ("kv_cache",))
    held = sim.engine.memory.used_bytes
    assert held == 7 * GIB
    await adapter.sleep(2)
    assert sim.engine.memory.used_bytes == held


# -- 7. vLLM 0.26's answers --------------------------------------------------------------


async def test_reset_prefix_cache_success_false_fails_the_wake(
    scripted: Scripted, engine_session: aiohttp.ClientSession
) -> None:
    adapter = VllmAdapter(scripted.endpoint(), engine_session, Timeouts())
    await adapter.sleep(2)
    scripted.reset_body = '{"success": false}'
    with pytest.raises(EngineRejected) as caught:
        await adapter.wake(2)
    assert caught.value.step == "reset_prefix_cache"
    assert caught.value.unfinished == UnfinishedWake(2, "reset_prefix_cache", ("kv_cache",))
    scripted.reset_body = '{"success": true}'
    woke = await adapter.finish_wake(caught.value.unfinished)
    assert [s.name for s in woke.steps] == ["reset_prefix_cache", "wake_up_kv_cache"]


@pytest.mark.parametrize("body", ['{"results": [null, null]}', "", '{"results": []}'])
async def test_collective_rpc_results_are_accepted(
    scripted: Scripted, engine_session: aiohttp.ClientSession, body: str
) -> None:
    scripted.rpc_body = body
    adapter = VllmAdapter(scripted.endpoint(), engine_session, Timeouts())
    await adapter.sleep(2)
    await adapter.wake(2)


async def test_a_collective_rpc_answer_of_another_shape_is_a_protocol_error(
    scripted: Scripted, engine_session: aiohttp.ClientSession
) -> None:
    scripted.rpc_body = '{"result": "ok"}'
    adapter = VllmAdapter(scripted.endpoint(), engine_session, Timeouts())
    await adapter.sleep(2)
    with pytest.raises(EngineProtocolError) as caught:
        await adapter.wake(2)
    assert caught.value.step == "reload_weights"


async def test_a_control_post_is_sent_again_once_after_the_keep_alive_race(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """uvicorn closes connections idle for 5 s; a pooled one reused at that moment fails
    before the request is read. The old adapter reported the engine unreachable."""
    adapter = vllm(engine_sim, engine_session)
    assert not await adapter.is_sleeping()  # leaves a kept-alive connection in the pool
    await engine_sim.faults(drop_reused_connections=True)
    await adapter.sleep(1)
    await adapter.wake(1)
    await engine_sim.faults(drop_reused_connections=False)
    assert engine_sim.engine.sleep_count == 1
    assert engine_sim.engine.wake_count == 1


async def test_a_control_post_sent_again_does_not_reuse_another_closed_connection(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """Two reads at once leave two kept-alive connections in the pool, which uvicorn
    closes at the same moment; a sleep sent on one, then sent again on the other, would
    fail twice. The call sent again goes on a new connection of its own."""
    adapter = vllm(engine_sim, engine_session)
    both = await asyncio.gather(adapter.is_sleeping(), adapter.is_sleeping())
    assert list(both) == [False, False]
    await engine_sim.faults(drop_reused_connections=True)
    await adapter.sleep(1)
    await engine_sim.faults(drop_reused_connections=False)
    assert engine_sim.engine.sleep_count == 1


@dataclass
class Fetched:
    path: str
    names: list[str]
    size: int


def _recording_session(fetched: list[Fetched]) -> aiohttp.ClientSession:
    """A session that notes every metrics page it fetched, and how large it was."""
    async def on_end(_session: aiohttp.ClientSession, _ctx: Any,
                     params: aiohttp.TraceRequestEndParams) -> None:
        if params.url.path.startswith("/metrics"):
            size = int(params.response.headers.get("Content-Length", "-1"))
            fetched.append(Fetched(params.url.path, params.url.query.getall("name[]", []),
                                   size))

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_end)
    return aiohttp.ClientSession(trace_configs=[trace])


async def test_the_gauges_are_read_without_rendering_the_whole_page(
    engine_sim: EngineSim
) -> None:
    """vLLM's /metrics renders every family whatever the filter (6-13 ms to serve on an
    H200 host), and a switch read it twice on its path: the drain's in-flight count and
    the sleep's second witness. The adapter asks prometheus_client's app behind it for the
    gauges it needs; the old adapter fetched the whole page each time."""
    fetched: list[Fetched] = []
    async with _recording_session(fetched) as session:
        adapter = vllm(engine_sim, session)
        assert await adapter.in_flight() == 0
        await adapter.sleep(1)
        await adapter.confirm_asleep(1)
        assert (await adapter.sleep_state()).level == 1
    assert [f.path for f in fetched] == ["/metrics/"] * 4
    assert fetched[0].names == ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    assert all(f.names == ["vllm:engine_sleep_state"] for f in fetched[1:])
    assert max(f.size for f in fetched) < 1_500


async def test_an_engine_without_the_filtered_page_is_read_whole(
    scripted: Scripted, engine_session: aiohttp.ClientSession
) -> None:
    """An engine that serves only /metrics (here 404 on /metrics/) still gives both
    gauges."""
    adapter = VllmAdapter(scripted.endpoint(), engine_session, Timeouts())
    assert await adapter.in_flight() == 0
    await adapter.sleep(2)
    assert await adapter.sleep_gauge() == "discard_all"
    paths = [path for path, _ in scripted.seen if path.startswith("/metrics")]
    assert paths[:2] == ["/metrics/", "/metrics"]


async def test_an_engine_without_dev_mode_is_told_apart(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """vLLM and vLLM-Omni serve /sleep, /is_sleeping, /reset_prefix_cache... only with
    VLLM_SERVER_DEV_MODE=1; without it every call is a bare 404."""
    sim = await engine_sim_factory(dev_mode=False)
    with pytest.raises(EngineUnsupported) as unsupported:  # its route table says so
        await vllm(sim, engine_session).sleep(1)
    assert "VLLM_SERVER_DEV_MODE=1" in str(unsupported.value)
    omni = await engine_sim_factory(dev_mode=False, omni=True, omni_stages=1)
    adapter = VllmOmniAdapter(omni.endpoint(), engine_session, Timeouts(), stage_ids=[0])
    with pytest.raises(EngineRejected) as confirm:  # /v1/omni/sleep works, /is_sleeping not
        await adapter.sleep(1)
    assert (confirm.value.step, confirm.value.status) == ("is_sleeping", 404)
    assert "VLLM_SERVER_DEV_MODE=1" in str(confirm.value)
