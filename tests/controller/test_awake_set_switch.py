"""Switches in an awake set on engine simulators over HTTP, with the GPU read as NVML
would: a newcomer that fits joins without anyone put to sleep, a newcomer that does not
displaces only the member chosen for it, and a member grown past its awake budget gets
the next wake refused, nobody woken. The GPU is 141 GiB; every engine's awake budget is
60 GiB, so two fit awake together and three do not."""

from __future__ import annotations

import dataclasses

import aiohttp

from controller.claimants import Claimant
from rota.api import naming
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSim, EngineSimFactory
from tests.controller.switch_kit import GPU_TOTAL, Kit, make_kit

GIB = ENGINE_SIM_GIB


async def _three(factory: EngineSimFactory, session: aiohttp.ClientSession
                 ) -> tuple[Kit, list[EngineSim]]:
    sims = [await factory(model=f"m/{name}", awake_memory_bytes=60 * GIB) for name in "abc"]
    kit = make_kit(session, list(zip("abc", sims, strict=True)))
    for claimant in kit.claimants:
        await kit.switcher.ports.engine(claimant).sleep(1)
    return kit, sims


async def _a_and_b_awake(factory: EngineSimFactory, session: aiohttp.ClientSession
                         ) -> tuple[Kit, list[EngineSim]]:
    """:func:`_three` with A woken, then B beside it (the Lease names both)."""
    kit, sims = await _three(factory, session)
    a, b, _ = kit.claimants
    await kit.switcher.switch(kit.holding(None), holder=None, target=a,
                              claimants=kit.claimants)
    await kit.switcher.switch(kit.lease.current, holder=None, target=b,
                              claimants=kit.claimants, stay=(a,))
    return kit, sims


def _awake(sims: list[EngineSim]) -> list[str]:
    return [sim.settings.model for sim in sims if not sim.engine.is_sleeping]


def _used(kit: Kit, sims: list[EngineSim]) -> int:
    return sum(sim.engine.memory.used_bytes for sim in sims)


def _names(kit: Kit) -> list[str]:
    return [m.model for m in kit.lease.current.awake_set]


async def test_a_newcomer_that_fits_joins_and_one_that_does_not_displaces_one(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, sims = await _three(engine_sim_factory, engine_session)
    a, b, c = kit.claimants
    first = await kit.switcher.switch(kit.holding(None), holder=None, target=a,
                                      claimants=kit.claimants, stay=())
    assert first.ok, first.message
    # B fits beside A: nobody is put to sleep, the Lease names both
    second = await kit.switcher.switch(kit.lease.current, holder=None, target=b,
                                       claimants=kit.claimants, stay=(a,))
    assert second.ok, second.message
    assert _awake(sims) == ["m/a", "m/b"]
    assert _names(kit) == ["m/b", "m/a"]
    assert kit.lease.current.state == naming.LeaseState.AWAKE
    # C does not fit beside both: A is put to sleep for it, B stays awake throughout
    third = await kit.switcher.switch(kit.lease.current, holder=a, target=c,
                                      claimants=kit.claimants, stay=(b,))
    assert third.ok, third.message
    assert _awake(sims) == ["m/b", "m/c"]
    assert _names(kit) == ["m/c", "m/b"]
    assert _used(kit, sims) <= GPU_TOTAL


async def test_members_displaced_together_sleep_before_the_newcomer_wakes(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, sims = await _a_and_b_awake(engine_sim_factory, engine_session)
    a, b, c = kit.claimants
    big = dataclasses.replace(c, config=c.config.model_copy(
        update={"awake_memory": 120 * GIB}))
    claimants = [a, b, big]
    result = await kit.switcher.switch(kit.lease.current, holder=b, target=big,
                                       claimants=claimants, also_sleep=(a,))
    assert result.ok, result.message
    assert _awake(sims) == ["m/c"]
    assert _names(kit) == ["m/c"]


async def test_a_member_grown_past_its_awake_budget_stops_the_next_wake(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, sims = await _a_and_b_awake(engine_sim_factory, engine_session)
    a, b, c = kit.claimants
    # A's claim says 50 GiB awake; its engine holds 60: it grew past its budget + tolerance
    shrunk: Claimant = dataclasses.replace(a, config=a.config.model_copy(
        update={"awake_memory": 50 * GIB}))
    claimants = [shrunk, b, c]
    result = await kit.switcher.switch(kit.lease.current, holder=b, target=c,
                                       claimants=claimants, stay=(shrunk,))
    assert not result.ok
    assert result.reason == "awake_over_budget"
    assert "ns/a (m/a)" in result.message
    assert "holds 60.0 GiB" in result.message
    assert "awake budget 50.0 GiB" in result.message
    assert "m/c" not in _awake(sims)  # nobody woken beside a set that no longer fits
    assert kit.lease.current.names_awake(a.claim_uid)  # A was never touched: still named
    assert _used(kit, sims) <= GPU_TOTAL
