"""VllmOmniAdapter against a simulator in vLLM-Omni mode: stage ids, ACKs, freed bytes."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from controller.lease.engines import (
    EngineEndpoint,
    EngineLied,
    EngineRejected,
    EngineTimeout,
    Timeouts,
    VllmOmniAdapter,
    make_adapter,
)
from controller.lease.engines.errors import EngineProtocolError
from controller.lease.engines.probe import probe_payload
from controller.lease.engines.transport import Answer
from controller.lease.engines.vllm_omni import parse_acks
from rota.api.engine_config import parse_engine_config
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSimFactory

RELEASABLE = 9 * ENGINE_SIM_GIB  # awake 10 GiB, resident 1 GiB


def test_gib_metadata_as_strings_or_numbers() -> None:
    acks = [_ack(0) | {"metadata": {"total_freed_gib": "12.34", "rank_residual_gib": "0.78"}},
            _ack(1) | {"metadata": {"total_freed_gib": 1.5, "rank_residual_gib": "n/a"}}]
    first, second = parse_acks(Answer(200, json.dumps({"status": "SUCCESS", "acks": acks})),
                               step="omni_sleep")
    assert (first.total_freed_gib, first.rank_residual_gib) == (12.34, 0.78)
    assert (second.total_freed_gib, second.rank_residual_gib) == (1.5, None)


def omni_config(**extra: object) -> dict[str, object]:
    return {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
            "model": "sim/adapter-model", "awakeMemory": "10Gi", "adapter": "vllm-omni"} | extra


async def test_sleep_and_wake_report_acks_freed_bytes_and_string_gib(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """vLLM-Omni sends total_freed_gib and rank_residual_gib as strings ("4.50"): the
    adapter reads them (the old one turned them into None)."""
    sim = await engine_sim_factory(omni=True, omni_stages=2)
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(), stage_ids=[0, 1])

    slept = await adapter.sleep(1)
    assert slept.freed_bytes == RELEASABLE
    assert [a.stage_id for a in slept.acks] == [0, 1]
    assert all(a.status == "SUCCESS" and a.error_msg is None for a in slept.acks)
    assert sum(a.freed_bytes for a in slept.acks) == RELEASABLE
    assert sum(a.total_freed_gib or 0.0 for a in slept.acks) == pytest.approx(9.0)
    assert slept.acks[-1].rank_residual_gib == pytest.approx(1.0)
    assert await adapter.is_sleeping()
    assert sim.engine.memory.used_bytes == ENGINE_SIM_GIB

    woke = await adapter.wake(1)
    assert [s.name for s in woke.steps] == ["omni_wakeup", "reset_prefix_cache"]
    assert [a.stage_id for a in woke.acks] == [0, 1]
    assert not await adapter.is_sleeping()
    probe = await adapter.probe()
    assert (probe.ok, probe.content) == (True, "7")


async def test_level_2_is_refused_before_anything_is_sent(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """vLLM-Omni cannot wake after a level-2 sleep (501, latched until restart)."""
    sim = await engine_sim_factory(omni=True, omni_stages=2)
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(), stage_ids=[0, 1])
    with pytest.raises(ValueError, match="level-2"):
        await adapter.sleep(2)
    with pytest.raises(ValueError, match="level-2"):
        await adapter.wake(2)
    assert not await adapter.is_sleeping()
    assert sim.engine.sleep_count == 0


async def test_stage_ids_must_be_given() -> None:
    async with aiohttp.ClientSession() as session:
        endpoint = EngineEndpoint(base_url="http://127.0.0.1:9", model="m", claim="c")
        with pytest.raises(TypeError):
            VllmOmniAdapter(endpoint, session, Timeouts())  # type: ignore[call-arg]
        with pytest.raises(ValueError, match="stage ids"):
            VllmOmniAdapter(endpoint, session, Timeouts(), stage_ids=[])


async def test_the_sleep_waits_for_running_requests_first(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """vLLM-Omni's sleep does not drain: put to sleep under a running request, it unmaps
    that request's memory. The adapter waits until the engine's gauges say it is idle and
    refuses to sleep an engine that stays busy."""
    sim = await engine_sim_factory(omni=True, omni_stages=1)
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(sleep_s=0.5),
                              stage_ids=[0])
    await sim.faults(stall_generation=True)
    url = sim.base_url + "/v1/chat/completions"
    async with engine_session.post(url, json=probe_payload(sim.settings.model)) as running:
        await sim.until(lambda: sim.engine.running == 1)
        with pytest.raises(EngineTimeout) as caught:
            await adapter.sleep(1)
        assert caught.value.step == "omni_drain"
        assert not sim.engine.state.is_sleeping  # nothing was put to sleep under it
        patient = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(),
                                  stage_ids=[0])
        sleeping = asyncio.create_task(patient.sleep(1))
        await sim.faults(stall_generation=False)
        text = (await running.read()).decode()
    assert '"error"' not in text  # the running request finished whole
    async with asyncio.timeout(10):
        await sleeping
    assert sim.engine.state.is_sleeping


async def test_the_api_key_reaches_the_omni_endpoints(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """/v1/omni/* lies under /v1: an engine with --api-key checks it there."""
    sim = await engine_sim_factory(omni=True, omni_stages=2, api_key="omni-key")
    keyed = VllmOmniAdapter(sim.endpoint(api_key="omni-key"), engine_session, Timeouts(),
                            stage_ids=[0, 1])
    await keyed.sleep(1)
    await keyed.wake(1)
    assert (await keyed.probe()).ok
    anonymous = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(), stage_ids=[0, 1])
    with pytest.raises(EngineRejected) as caught:
        await anonymous.sleep(1)
    assert (caught.value.status, caught.value.reason) == (401, "unauthorized")


async def test_stage_ids_come_from_the_claim_config(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    sim = await engine_sim_factory(omni=True, omni_stages=3)
    config = parse_engine_config(omni_config(omniStageIds=[2, 0, 1]))
    adapter = make_adapter(config, sim.endpoint(), engine_session, Timeouts())
    assert isinstance(adapter, VllmOmniAdapter)
    assert adapter.stage_ids == (2, 0, 1)
    slept = await adapter.sleep(1)
    assert sorted(a.stage_id or 0 for a in slept.acks) == [0, 1, 2]
    assert slept.freed_bytes == RELEASABLE
    await adapter.wake(1)
    assert (await adapter.probe()).ok


async def test_too_few_stage_ids_leave_memory_awake_and_too_many_fail_loudly(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """A Qwen-Omni pipeline has three stages: the old default (0, 1) kept stage 2 awake
    while the global /is_sleeping said asleep; a stage the engine lacks fails with 500."""
    sim = await engine_sim_factory(omni=True, omni_stages=3)
    two = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(), stage_ids=[0, 1])
    await two.sleep(1)
    assert await two.is_sleeping()
    assert sim.engine.memory.used_bytes > ENGINE_SIM_GIB  # stage 2 still holds its share
    await two.wake(1)
    one_stage = await engine_sim_factory(omni=True, omni_stages=1)
    adapter = VllmOmniAdapter(one_stage.endpoint(), engine_session, Timeouts(),
                              stage_ids=[0, 1])
    with pytest.raises(EngineRejected) as caught:
        await adapter.sleep(1)
    assert (caught.value.status, caught.value.reason) == (500, "rejected")
    assert "stage" in caught.value.body
    assert not await adapter.is_sleeping()


async def test_wake_oom_and_ignored_sleep(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    sim = await engine_sim_factory(omni=True, omni_stages=2)
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts(), stage_ids=[0, 1])
    await adapter.sleep(1)
    await sim.faults(wake_fails=True)
    with pytest.raises(EngineRejected) as oom:
        await adapter.wake(1)
    assert (oom.value.reason, oom.value.step) == ("gpu_oom", "omni_wakeup")
    assert oom.value.unfinished is not None
    assert oom.value.unfinished.next_step == "omni_wakeup"
    await sim.faults(wake_fails=False)
    await adapter.finish_wake(oom.value.unfinished)
    assert (await adapter.probe()).ok

    await sim.faults(sleep_ignored=True)
    with pytest.raises(EngineLied) as lied:
        await adapter.sleep(1)
    assert lied.value.step == "omni_sleep"


def _ack(stage: int, status: str = "SUCCESS", error: str | None = None) -> dict[str, object]:
    return {"task_id": f"t{stage}", "status": status, "stage_id": stage, "rank": 0,
            "freed_bytes": 0 if error else 5, "metadata": {"latency_ms": 3},
            "error_msg": error}


@pytest.mark.parametrize(("acks", "reason"), [
    ([_ack(0), _ack(1, "ERROR", "worker died")], "ack_error"),
    ([_ack(0, "ERROR", "CUDA out of memory. Tried to allocate 2.00 GiB")], "gpu_oom"),
    ([_ack(0, "ERROR")], "ack_error"),
])
def test_an_error_ack_fails_the_call(acks: list[dict[str, object]], reason: str) -> None:
    answer = Answer(200, json.dumps({"status": "SUCCESS", "acks": acks}))
    with pytest.raises(EngineRejected) as caught:
        parse_acks(answer, step="omni_sleep")
    assert (caught.value.reason, caught.value.status) == (reason, 200)


def test_ack_parsing_is_lenient_about_new_fields_but_not_about_status() -> None:
    answer = Answer(200, json.dumps({"status": "SUCCESS", "acks": [_ack(3)], "extra": 1}))
    [ack] = parse_acks(answer, step="omni_sleep")
    assert (ack.stage_id, ack.freed_bytes, ack.total_freed_gib) == (3, 5, None)
    assert parse_acks(Answer(200, '{"status": "SKIPPED", "acks": []}'), step="s") == ()
    skipped = '{"status": "SKIPPED", "reason": "Target stages are not sleeping."}'
    assert parse_acks(Answer(200, skipped), step="s") == ()  # vLLM-Omni: no acks at all
    with pytest.raises(EngineRejected):
        parse_acks(Answer(200, '{"status": "PARTIAL", "acks": []}'), step="s")
    with pytest.raises(EngineProtocolError):
        parse_acks(Answer(200, '{"acks": "nope"}'), step="s")
    with pytest.raises(EngineProtocolError):
        parse_acks(Answer(200, ""), step="s")
