"""VllmOmniAdapter against a simulator in vLLM-Omni mode: stage ids, ACKs, freed bytes."""

from __future__ import annotations

import json

import aiohttp
import pytest

from controller.engines import (
    EngineLied,
    EngineRejected,
    ProbeReason,
    Timeouts,
    VllmOmniAdapter,
    make_adapter,
)
from controller.engines.errors import EngineProtocolError
from controller.engines.transport import Answer
from controller.engines.vllm_omni import DEFAULT_STAGE_IDS, parse_acks
from driver.opaque import parse_engine_config
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSimFactory

RELEASABLE = 9 * ENGINE_SIM_GIB  # awake 10 GiB, resident 1 GiB


def omni_config(**extra: object) -> dict[str, object]:
    return {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
            "model": "sim/adapter-model", "awakeMemory": "10Gi", "adapter": "vllm-omni"} | extra


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_and_wake_report_acks_and_freed_bytes(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession, level: int
) -> None:
    # kinder than vLLM-Omni until the adapter reads string GiB metadata and refuses level 2
    sim = await engine_sim_factory(omni=True, omni_stages=2,
                                   faults={"omni_gib_numbers": True, "omni_level2_wake": True})
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts())
    assert adapter.stage_ids == DEFAULT_STAGE_IDS == (0, 1)

    slept = await adapter.sleep(level)
    assert slept.freed_bytes == RELEASABLE
    assert [a.stage_id for a in slept.acks] == [0, 1]
    assert all(a.status == "SUCCESS" and a.error_msg is None for a in slept.acks)
    assert sum(a.freed_bytes for a in slept.acks) == RELEASABLE
    assert sum(a.total_freed_gib or 0.0 for a in slept.acks) == pytest.approx(9.0)
    assert slept.acks[-1].rank_residual_gib == pytest.approx(1.0)
    assert await adapter.is_sleeping()
    assert sim.engine.memory.used_bytes == ENGINE_SIM_GIB

    woke = await adapter.wake(level)
    assert [s.name for s in woke.steps] == ["omni_wakeup", "reset_prefix_cache"]
    assert [a.stage_id for a in woke.acks] == [0, 1]
    assert not await adapter.is_sleeping()
    probe = await adapter.probe()
    assert (probe.ok, probe.content) == (True, "7")


async def test_without_the_prefix_reset_an_omni_wake_answers_stale(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    """vllm-omni#6442: why the adapter resets the prefix cache after every Omni wake."""
    # kinder than vLLM-Omni 0.26, whose wake after a level-2 sleep is not implemented
    sim = await engine_sim_factory(omni=True, omni_stages=2, faults={"omni_level2_wake": True})
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts())
    await adapter.sleep(2)
    async with engine_session.post(sim.base_url + "/v1/omni/wakeup",
                                   json={"stage_ids": [0, 1]}) as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "SUCCESS"
    probe = await adapter.probe()
    assert (probe.reason, probe.content) == (ProbeReason.WRONG_CONTENT, "42")


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


async def test_default_stages_on_a_one_stage_engine_fail_loudly(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    sim = await engine_sim_factory(omni=True, omni_stages=1)
    adapter = VllmOmniAdapter(sim.endpoint(), engine_session, Timeouts())
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
    await sim.faults(wake_fails=False)
    await adapter.wake(1)

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
    with pytest.raises(EngineRejected):
        parse_acks(Answer(200, '{"status": "PARTIAL", "acks": []}'), step="s")
    with pytest.raises(EngineProtocolError):
        parse_acks(Answer(200, '{"acks": "nope"}'), step="s")
    with pytest.raises(EngineProtocolError):
        parse_acks(Answer(200, ""), step="s")
