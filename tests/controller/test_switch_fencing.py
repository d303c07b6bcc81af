"""Fencing of the switch protocol, on in-memory ports with real simulated engines: an
engine call is refused as soon as another writer moved the GPU Lease (the API server's
copy is read before every call), and a sleep whose outcome is unknown is never followed by
a wake of that engine."""

from __future__ import annotations

import aiohttp
import pytest

from controller.lease.engines.base import Timeouts
from controller.lease.settings import StepTimeouts
from controller.lease.switch import Fenced
from tests.controller.conftest import EngineSimFactory
from tests.controller.switch_kit import make_kit

pytestmark = [pytest.mark.controller]


async def _two(engine_sim_factory: EngineSimFactory, **a_knobs: object):  # type: ignore[no-untyped-def]
    a = await engine_sim_factory(model="m/a", **a_knobs)
    b = await engine_sim_factory(model="m/b")
    return a, b


async def test_a_lease_moved_before_the_wake_stops_the_switch(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    a, b = await _two(engine_sim_factory)
    kit = make_kit(engine_session, [("a", a), ("b", b)])
    ca, cb = kit.claimants
    await kit.switcher.ports.engine(cb).sleep(1)
    lease = kit.holding(ca)
    # Another writer (a newer instance reconciling) takes the Lease over while this
    # switch reads the GPU, after the holder went to sleep and before the wake.
    kit.device.on_read.append(kit.lease.move)
    with pytest.raises(Fenced):
        await kit.switcher.switch(lease, holder=ca, target=cb, claimants=kit.claimants)
    assert a.engine.sleep_count == 1, "the sleep came before the Lease moved"
    assert b.engine.wake_count == 0, "no wake under the old fencing number"
    assert b.engine.state.is_sleeping


async def test_a_lease_moved_before_the_first_call_stops_everything(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    a, b = await _two(engine_sim_factory)
    kit = make_kit(engine_session, [("a", a), ("b", b)])
    ca, cb = kit.claimants
    await kit.switcher.ports.engine(cb).sleep(1)
    lease = kit.holding(ca)
    original = kit.lease.write

    async def write_then_lose(new):  # type: ignore[no-untyped-def]
        written = await original(new)
        kit.lease.move()  # right after the switch raised the fence, someone raised it again
        return written

    kit.lease.write = write_then_lose  # type: ignore[method-assign]
    with pytest.raises(Fenced):
        await kit.switcher.switch(lease, holder=ca, target=cb, claimants=kit.claimants)
    assert a.engine.sleep_count == 0
    assert b.engine.wake_count == 0
    assert not a.engine.state.is_sleeping, "the holder was left as it was"


async def test_a_sleep_that_timed_out_is_never_followed_by_a_wake(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    # The holder's sleep takes longer than the controller waits: its outcome is unknown
    # (vLLM keeps an abandoned mode=wait sleep registered and fires it later).
    a, b = await _two(engine_sim_factory, first_sleep_seconds=2.0)
    kit = make_kit(engine_session, [("a", a), ("b", b)],
                   engine_timeouts=Timeouts(sleep_s=0.3),
                   timeouts=StepTimeouts(sleep_s=0.3))
    ca, cb = kit.claimants
    await kit.switcher.ports.engine(cb).sleep(1)
    lease = kit.holding(ca)
    result = await kit.switcher.switch(lease, holder=ca, target=cb, claimants=kit.claimants)
    # Whatever the engine does with the sleep it got, the switch did not wake it (nor
    # anyone else) on its way out.
    assert a.engine.wake_count == 0
    assert list(a.engine.wakes) == []
    assert b.engine.wake_count == 0
    assert not result.ok
    assert [c.ref for c in getattr(result, "unsettled", ())] == [ca.ref], \
        "the holder is left unsettled, to be confirmed before anyone is woken"
    assert result.lease.holder == ""
