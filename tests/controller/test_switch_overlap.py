"""The reads of a switch that need not wait for each other do not: the holder's sleep
confirmation runs while the GPU is read, and the target's wake confirmation while the
probe runs. Each test makes one read wait for the other to have begun, so a switch that
runs them one after the other cannot finish; and a confirmation that contradicts the
engine's success answer still stops the switch before anyone else is woken."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controller.claimants import Claimant
from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.lease.engines.probe import ProbeResult
from controller.lease.engines.vllm import VllmAdapter
from tests.controller.conftest import EngineSimFactory
from tests.controller.switch_kit import Kit, a_awake_b_asleep

pytestmark = [pytest.mark.controller]

WAIT_S = 5.0
"""How long a gated read waits for the other one to begin before it gives up."""


class _Gated(VllmAdapter):
    """A vLLM adapter whose ``/is_sleeping`` read, once its claim is armed, waits for
    ``opened``."""

    def __init__(self, *args: object, opened: asyncio.Event, probing: asyncio.Event,
                 armed: set[str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.opened, self.probing, self.armed = opened, probing, armed

    async def is_sleeping(self) -> bool:
        if self.endpoint.claim in self.armed:
            await asyncio.wait_for(self.opened.wait(), WAIT_S)
        return await super().is_sleeping()

    async def probe(self) -> ProbeResult:
        self.probing.set()
        return await super().probe()


def _gate(kit: Kit, session: aiohttp.ClientSession, opened: asyncio.Event,
          armed: set[str]) -> asyncio.Event:
    probing = asyncio.Event()

    def engine(claimant: Claimant) -> EngineAdapter:
        endpoint = EngineEndpoint(base_url=claimant.endpoint or "", model=claimant.model,
                                  claim=claimant.ref)
        return _Gated(endpoint, session, Timeouts(), opened=opened, probing=probing,
                      armed=armed)

    kit.switcher.ports.engine = engine
    return probing


async def test_the_sleep_confirmation_runs_while_the_gpu_is_read(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, a, b = await a_awake_b_asleep(engine_sim_factory, engine_session)
    ca, cb = kit.claimants
    reading = asyncio.Event()
    armed = {ca.ref}  # the holder's sleep confirmation waits for the GPU read
    _gate(kit, engine_session, reading, armed)

    def read_began() -> None:
        reading.set()
        armed.clear()  # the wake's confirmation is not under test here

    kit.device.on_read.append(read_began)
    result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                       claimants=kit.claimants)
    assert result.ok, (result.reason, result.message)
    assert {"sleep_confirm", "inspect"} <= result.timings.keys()
    assert (a.engine.state.is_sleeping, b.engine.state.is_sleeping) == (True, False)


async def test_the_wake_confirmation_runs_beside_the_probe(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, _, b = await a_awake_b_asleep(engine_sim_factory, engine_session)
    ca, cb = kit.claimants
    armed: set[str] = set()
    opened = asyncio.Event()
    probing = _gate(kit, engine_session, opened, armed)

    def arm_after_the_gpu_read() -> None:
        armed.add(cb.ref)  # the target's wake confirmation waits for the probe

    kit.device.on_read.append(arm_after_the_gpu_read)

    async def open_when_probing() -> None:
        await probing.wait()
        opened.set()

    opener = asyncio.create_task(open_when_probing())
    try:
        result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                           claimants=kit.claimants)
    finally:
        opener.cancel()
    assert result.ok, (result.reason, result.message)
    assert {"wake_confirm", "probe"} <= result.timings.keys()
    assert b.engine.wake_count == 1


async def test_a_lying_sleep_still_stops_the_switch_while_the_gpu_is_read(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The sleep answers success, ``/is_sleeping`` then says awake: the GPU read that ran
    beside the confirmation does not let the target wake; the holder is woken back."""
    kit, a, b = await a_awake_b_asleep(engine_sim_factory, engine_session)
    await a.faults(sleep_ignored=True)
    ca, cb = kit.claimants
    result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                       claimants=kit.claimants)
    assert not result.ok
    assert result.reason == "lied"
    assert kit.device.reads >= 1, "the GPU was read beside the confirmation"
    assert b.engine.wake_count == 0
    assert result.lease.holder == ca.ref
