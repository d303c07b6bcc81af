"""A switch cancelled at any step leaves no engine call created and never run. The reads
that run side by side (a confirmation beside the GPU read or the probe) are started
together; a cancellation that lands just before they start used to drop the engine's
confirmation coroutine unawaited, which Python reports as an error at collection time
(and pytest, where it happens, as a failure of whichever test is running)."""

from __future__ import annotations

import asyncio
import gc
import warnings

import aiohttp
import pytest

from controller.lease import metrics
from tests.controller.conftest import EngineSimFactory
from tests.controller.switch_kit import a_awake_b_asleep

pytestmark = [pytest.mark.controller]


class _CancelAfter(metrics.SwitchMetrics):
    """Cancels the switch's task as soon as the step ``name`` has been measured: the next
    thing the switch does is start the reads that run side by side."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def step(self, name: str, seconds: float) -> None:
        super().step(name, seconds)
        if name == self.name:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()


@pytest.mark.parametrize("step", ["sleep", "wake"])
async def test_a_switch_cancelled_before_its_side_by_side_reads_leaves_none_unawaited(
        step: str, engine_sim_factory: EngineSimFactory,
        engine_session: aiohttp.ClientSession) -> None:
    kit, _, _ = await a_awake_b_asleep(engine_sim_factory, engine_session)
    ca, cb = kit.claimants
    kit.switcher.ports.observer = _CancelAfter(step)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(asyncio.CancelledError):
            await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                      claimants=kit.claimants)
        gc.collect()
    unawaited = [str(w.message) for w in seen if "never awaited" in str(w.message)]
    assert unawaited == []
