"""HttpAdapter (paths from config) and the adapter registry, against a real simulator."""

from __future__ import annotations

import aiohttp
import pytest

from controller.lease.engines import (
    EngineProtocolError,
    EngineRejected,
    EngineStateUnknown,
    HttpAdapter,
    ProbeMode,
    Timeouts,
    make_adapter,
)
from controller.lease.engines.probe import probe_payload
from rota.api.engine_config import EngineConfig, HttpAdapterConfig, parse_engine_config
from tests.controller.conftest import EngineSim


def config(adapter: str, **extra: object) -> EngineConfig:
    return parse_engine_config({
        "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
        "model": "sim/adapter-model", "awakeMemory": "10Gi", "adapter": adapter} | extra)


async def test_default_paths_drive_a_vllm_engine(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    adapter = make_adapter(config("http"), engine_sim.endpoint(), engine_session, Timeouts())
    assert isinstance(adapter, HttpAdapter)
    slept = await adapter.sleep(1)
    assert slept.freed_bytes is None
    assert engine_sim.engine.sleeps[-1]["mode"] == "wait"
    assert await adapter.is_sleeping()
    woke = await adapter.wake(1)
    assert [s.name for s in woke.steps] == ["wake_up"]
    assert not await adapter.is_sleeping()
    assert (await adapter.probe()).ok
    assert await adapter.in_flight() == 0
    assert await adapter.health()


async def test_configured_paths_are_used(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    paths = HttpAdapterConfig(sleep_path="/engine/sleep", wake_path="/wake_up",
                              is_sleeping_path="/is_sleeping")
    adapter = HttpAdapter(engine_sim.endpoint(), engine_session, Timeouts(), config=paths)
    with pytest.raises(EngineRejected) as caught:  # the simulator has no /engine/sleep
        await adapter.sleep(1)
    assert (caught.value.status, caught.value.reason, caught.value.step) == (404, "rejected",
                                                                             "sleep")
    assert engine_sim.engine.sleep_count == 0


async def test_is_sleeping_path_must_answer_is_sleeping(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    parsed = config("http", http={"isSleepingPath": "/is_paused"})
    adapter = make_adapter(parsed, engine_sim.endpoint(), engine_session, Timeouts())
    with pytest.raises(EngineProtocolError):
        await adapter.sleep(1)
    assert engine_sim.engine.sleep_count == 1  # the sleep went out; its proof did not parse


async def test_a_sleep_without_an_answer_in_time_is_state_unknown(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """The generic adapter's sleep is vLLM's /sleep?mode=wait: abandoned, it still fires."""
    adapter = make_adapter(config("http"), engine_sim.endpoint(), engine_session,
                           Timeouts(sleep_s=0.3))
    await engine_sim.faults(stall_generation=True)
    url = engine_sim.base_url + "/v1/chat/completions"
    async with engine_session.post(url, json=probe_payload(engine_sim.settings.model)) as resp:
        await engine_sim.until(lambda: engine_sim.engine.running == 1)
        with pytest.raises(EngineStateUnknown):
            await adapter.sleep(1)
        await engine_sim.faults(stall_generation=False)
        await resp.read()
    await engine_sim.until(lambda: engine_sim.engine.state.is_sleeping)


async def test_the_probe_section_of_the_claim_reaches_every_adapter(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    structure = {"mode": "structure", "prompt": "Tell me something."}
    for name in ("vllm", "http"):
        adapter = make_adapter(config(name, probe=structure), engine_sim.endpoint(),
                               engine_session, Timeouts())
        result = await adapter.probe()
        assert (result.ok, result.mode) == (True, ProbeMode.STRUCTURE), name
        assert result.content != "7"
