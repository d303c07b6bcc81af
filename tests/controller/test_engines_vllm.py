"""VllmAdapter against a real engine simulator: sleep, wake, confirmation, faults, drain."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from controller.lease.engines import (
    EngineEndpoint,
    EngineLied,
    EngineProtocolError,
    EngineRejected,
    EngineStateUnknown,
    EngineTimeout,
    EngineUnreachable,
    ProbeReason,
    Timeouts,
    UnfinishedWake,
    VllmAdapter,
)
from controller.lease.engines.errors import MAX_BODY_CHARS
from controller.lease.engines.probe import probe_payload
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSim

SHORT = Timeouts(connect_s=1.0, status_s=2.0, sleep_s=5.0, wake_level1_s=0.5,
                 wake_level2_s=0.5, probe_total_s=5.0, probe_first_token_s=5.0)


def vllm(sim: EngineSim, session: aiohttp.ClientSession, *, token: str | None = None,
         timeouts: Timeouts | None = None) -> VllmAdapter:
    return VllmAdapter(sim.endpoint(token=token), session, timeouts or Timeouts())


async def test_level1_round_trip_is_confirmed(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    assert not await adapter.is_sleeping()

    slept = await adapter.sleep(1)
    assert (slept.level, slept.freed_bytes, slept.acks) == (1, None, ())
    assert slept.sleep_s >= 0
    assert await adapter.is_sleeping()
    record = engine_sim.engine.sleeps[-1]
    assert (record["level"], record["mode"]) == (1, "wait")
    assert engine_sim.engine.memory.used_bytes == ENGINE_SIM_GIB

    woke = await adapter.wake(1)
    assert [s.name for s in woke.steps] == ["wake_up"]
    assert woke.wake_s >= woke.steps[0].seconds
    assert not await adapter.is_sleeping()
    assert engine_sim.engine.memory.used_bytes == 10 * ENGINE_SIM_GIB
    probe = await adapter.probe()
    assert probe.ok, probe


async def test_level2_sequence_then_probe_passes(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    await adapter.sleep(2)
    assert engine_sim.engine.state.level == 2  # the level went in the query and was honoured
    woke = await adapter.wake(2)
    names = [s.name for s in woke.steps]
    # The prefix reset comes before the KV cache wake: until then the scheduler is paused,
    # so no held request can hold blocks and make it answer {"success": false}.
    assert names == ["wake_up_weights", "reload_weights", "reset_prefix_cache",
                     "wake_up_kv_cache"]
    assert woke.wake_s >= sum(s.seconds for s in woke.steps)
    assert engine_sim.engine.reloads == 1
    assert engine_sim.engine.prefix_cache_resets == 1
    probe = await adapter.probe()
    assert (probe.ok, probe.content) == (True, "7")


@pytest.mark.parametrize(("skipped", "answer"), [
    ("reset_prefix_cache", "42"),
    ("reload_weights", "!!!!!!!!"),
])
async def test_skipping_a_level2_step_fails_the_probe(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession, skipped: str, answer: str
) -> None:
    adapter = vllm(engine_sim, engine_session)
    await adapter.sleep(2)
    steps = [
        ("wake_up_weights", "/wake_up", {"tags": "weights"}, None),
        ("reload_weights", "/collective_rpc", None, {"method": "reload_weights"}),
        ("wake_up_kv_cache", "/wake_up", {"tags": "kv_cache"}, None),
        ("reset_prefix_cache", "/reset_prefix_cache", None, None),
    ]
    for name, path, params, body in steps:
        if name == skipped:
            continue
        async with engine_session.post(engine_sim.base_url + path, params=params,
                                       json=body) as resp:
            assert resp.status == 200, await resp.text()
    assert not await adapter.is_sleeping()  # every control call "succeeded"
    probe = await adapter.probe()
    assert not probe.ok
    assert probe.reason is ProbeReason.WRONG_CONTENT
    assert probe.content == answer


async def test_sleep_answered_but_not_done_is_a_lie(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    await engine_sim.faults(sleep_ignored=True)
    with pytest.raises(EngineLied) as caught:
        await vllm(engine_sim, engine_session).sleep(1)
    assert (caught.value.reason, caught.value.step) == ("lied", "sleep")


async def test_wake_answered_but_not_done_is_a_lie(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    await adapter.sleep(1)
    await engine_sim.faults(wake_ignored=True)
    with pytest.raises(EngineLied) as caught:
        await adapter.wake(1)
    assert (caught.value.reason, caught.value.step) == ("lied", "wake")


async def test_memory_kept_while_saying_asleep_is_left_to_the_device_check(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """The simulator's ``sleep_lies`` keeps the memory but answers ``is_sleeping`` true:
    nothing the engine says gives it away; only NVML (the controller's next step) does."""
    await engine_sim.faults(sleep_lies=True)
    outcome = await vllm(engine_sim, engine_session).sleep(1)
    assert outcome.freed_bytes is None
    assert engine_sim.engine.memory.used_bytes == 10 * ENGINE_SIM_GIB


async def test_wake_oom_is_rejected_as_gpu_oom(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    await adapter.sleep(1)
    await engine_sim.faults(wake_fails=True)
    with pytest.raises(EngineRejected) as caught:
        await adapter.wake(1)
    error = caught.value
    assert (error.reason, error.status, error.step) == ("gpu_oom", 500, "wake_up")
    assert "out of memory" in error.body
    assert len(error.body) <= MAX_BODY_CHARS
    assert await adapter.is_sleeping()


async def test_wake_oom_in_the_level2_sequence_names_the_step(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    await adapter.sleep(2)
    await engine_sim.faults(wake_fails=True)
    with pytest.raises(EngineRejected) as caught:
        await adapter.wake(2)
    assert (caught.value.reason, caught.value.step) == ("gpu_oom", "wake_up_weights")
    assert engine_sim.engine.reloads == 0  # nothing after the failed step was sent


async def test_hanging_wake_times_out_with_its_outcome_unknown(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session, timeouts=SHORT)
    await adapter.sleep(1)
    await engine_sim.faults(wake_hangs=True)
    with pytest.raises(EngineStateUnknown) as caught:
        await adapter.wake(1)
    assert (caught.value.reason, caught.value.step) == ("state_unknown", "wake_up")
    assert isinstance(caught.value.__cause__, EngineTimeout)
    assert caught.value.unfinished == UnfinishedWake(1, "wake_up", ("weights", "kv_cache"))
    # As vLLM does, the engine does not give the wake up when its caller leaves: it is
    # still under way, and lands once whatever held it lets go.
    assert engine_sim.engine.wake_hanging
    await engine_sim.faults(wake_hangs=False)
    await engine_sim.until(lambda: not engine_sim.engine.state.is_sleeping)
    assert not await adapter.is_sleeping()


async def test_hanging_level2_wake_times_out_at_its_first_step(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session, timeouts=SHORT)
    await adapter.sleep(2)
    await engine_sim.faults(wake_hangs=True)
    with pytest.raises(EngineStateUnknown) as caught:
        await adapter.wake(2)
    assert caught.value.step == "wake_up_weights"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_nothing_listening_is_unreachable(engine_session: aiohttp.ClientSession) -> None:
    endpoint = EngineEndpoint(base_url=f"http://127.0.0.1:{_free_port()}", model="m",
                              claim="ns/claim")
    adapter = VllmAdapter(endpoint, engine_session, SHORT)
    with pytest.raises(EngineUnreachable) as caught:
        await adapter.sleep(1)
    # the first call reads the engine's release
    assert (caught.value.reason, caught.value.step) == ("unreachable", "version")
    with pytest.raises(EngineUnreachable):
        await adapter.wake(2)
    with pytest.raises(EngineUnreachable):
        await adapter.is_sleeping()
    with pytest.raises(EngineUnreachable):
        await adapter.in_flight()
    assert not await adapter.health()
    probe = await adapter.probe()
    assert probe.reason is ProbeReason.UNREACHABLE


async def test_killed_engine_is_unreachable(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session, timeouts=SHORT)
    await adapter.sleep(1)
    await engine_sim.stop()
    with pytest.raises(EngineUnreachable) as caught:
        await adapter.wake(1)
    assert caught.value.step == "wake_up"


async def test_unknown_host_is_unreachable(engine_session: aiohttp.ClientSession) -> None:
    endpoint = EngineEndpoint(base_url="http://engine.invalid:8000", model="m",
                              claim="ns/claim")
    with pytest.raises(EngineUnreachable):
        await VllmAdapter(endpoint, engine_session, SHORT).sleep(1)


async def test_in_flight_counts_a_held_request_until_it_ends(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    assert await adapter.in_flight() == 0
    await engine_sim.faults(stall_generation=True)
    url = engine_sim.base_url + "/v1/chat/completions"
    async with engine_session.post(url, json=probe_payload(engine_sim.settings.model)) as resp:
        await engine_sim.until(lambda: engine_sim.engine.running == 1)
        assert await adapter.in_flight() == 1
        await engine_sim.faults(stall_generation=False)
        await resp.read()
    await engine_sim.until(lambda: engine_sim.engine.running == 0)
    assert await adapter.in_flight() == 0


async def test_in_flight_counts_waiting_requests(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """Requests held while a drain still steps are counted (vLLM's stats come from engine
    steps: once nothing runs, held requests no longer show)."""
    adapter = vllm(engine_sim, engine_session)
    await engine_sim.faults(stall_generation=True)
    url = engine_sim.base_url + "/v1/chat/completions"
    async with engine_session.post(url, json=probe_payload(engine_sim.settings.model)) as resp:
        await engine_sim.until(lambda: engine_sim.engine.running == 1)
        pausing = asyncio.create_task(engine_session.post(engine_sim.base_url + "/pause",
                                                          params={"mode": "wait"}))
        await engine_sim.until(lambda: engine_sim.engine.paused)
        held = asyncio.create_task(adapter.probe())
        await engine_sim.until(lambda: engine_sim.engine.waiting == 1)
        assert await adapter.in_flight() == 2
        await engine_sim.faults(stall_generation=False)
        await resp.read()
    (await pausing).close()
    async with engine_session.post(engine_sim.base_url + "/resume") as resumed:
        assert resumed.status == 200
    async with asyncio.timeout(10):
        assert (await held).ok
    assert await adapter.in_flight() == 0


class _NoMetrics(VllmAdapter):
    metrics_path = "/no-metrics-here"
    filtered_metrics_path = "/no-metrics-here/"


async def test_in_flight_is_none_without_metrics(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = _NoMetrics(engine_sim.endpoint(), engine_session, Timeouts())
    assert await adapter.in_flight() is None


async def test_health_proves_nothing_about_sleep(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = vllm(engine_sim, engine_session)
    assert await adapter.health()
    await adapter.sleep(1)
    assert await adapter.health()  # 200 while asleep, as vLLM answers
    quick = VllmAdapter(engine_sim.endpoint(), engine_session,
                        Timeouts(probe_first_token_s=0.2))
    probe = await quick.probe()  # held by the sleeping engine: 200, then nothing
    assert (probe.reason, probe.status) == (ProbeReason.TIMEOUT, 200)


async def test_is_sleeping_answer_must_have_its_shape(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    class _WrongPath(VllmAdapter):
        is_sleeping_path = "/is_paused"  # answers {"is_paused": ...}

    adapter = _WrongPath(engine_sim.endpoint(), engine_session, Timeouts())
    with pytest.raises(EngineProtocolError) as caught:
        await adapter.is_sleeping()
    assert (caught.value.reason, caught.value.step) == ("bad_response", "is_sleeping")


@pytest.mark.parametrize("level", [0, 3, True])
async def test_only_levels_1_and_2(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession, level: int
) -> None:
    adapter = vllm(engine_sim, engine_session)
    with pytest.raises(ValueError, match="level"):
        await adapter.sleep(level)
    with pytest.raises(ValueError, match="level"):
        await adapter.wake(level)
    assert engine_sim.engine.sleep_count == 0


def test_endpoint_validates_and_hides_the_token_and_the_key() -> None:
    endpoint = EngineEndpoint(base_url="http://10.0.0.5:8000/", model="m", claim="ns/c",
                              token="hunter2", api_key="sk-engine")
    assert endpoint.base_url == "http://10.0.0.5:8000"
    assert endpoint.url("/sleep") == "http://10.0.0.5:8000/sleep"
    assert "hunter2" not in repr(endpoint)
    assert "sk-engine" not in repr(endpoint)
    assert "sk-engine" not in str(endpoint.log_fields())
    for bad in ("10.0.0.5:8000", "http://10.0.0.5:8000/v1", "ftp://h:1", "http://h:1/?a=b"):
        with pytest.raises(ValueError, match="base_url"):
            EngineEndpoint(base_url=bad, model="m", claim="ns/c")
