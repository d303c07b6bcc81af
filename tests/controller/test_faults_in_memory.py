"""Faults injected into the engines during switches, on the in-memory node (real
simulators over HTTP, the controller's own workers and switch code, in-memory Leases): the
switch fails with a distinct reason, one engine at most is ever awake (checked at every
memory change of every engine), and the GPU serves again once the fault is gone. The switch's
measurements reach an injected observer."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controller.lease.metrics import SwitchMetrics
from controller.lease.settings import StepTimeouts
from e2e.harness.gang_node import Engine, GangNode, gang_node
from e2e.harness.waiting import eventually_async
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 60.0
SHORT = StepTimeouts(wake_s=3, sleep_s=5, probe_s=5, drain_s=2)


class _SwitchRecorder(SwitchMetrics):
    """The controller's series, and the end of each switch as a list."""

    def __init__(self) -> None:
        self.ends: list[str | None] = []

    def switched(self, reason: str | None) -> None:
        super().switched(reason)
        self.ends.append(reason)


async def _a_serving(factory: EngineSimFactory, session: aiohttp.ClientSession,
                     recorder: _SwitchRecorder, timeouts: StepTimeouts = SHORT) -> GangNode:
    node = await gang_node(factory, session, [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
                           gpus=1, awake=("a",), timeouts=timeouts, observer=recorder)
    worker = node.workers["gpu-0"]
    # Reconciled, every engine known (on a loaded machine an answer can come late).
    await node.until(lambda: worker.reconciliations > 0 and not worker.unsettled,
                     within_s=DEADLINE_S, what="the GPU reconciled")
    return node


async def _serves_again(node: GangNode, *engines: Engine) -> None:
    """Each of ``engines`` in turn is woken (retried while the GPU settles)."""
    for engine in engines:
        async def woken(engine: Engine = engine) -> bool:
            return bool((await node.activate(engine)).ok)

        await eventually_async(woken, timeout=DEADLINE_S, interval=0.2,
                               what=f"{engine.claimant.ref} serving again")
        assert not engine.sim.engine.is_sleeping


@pytest.mark.parametrize(("engine", "fault", "reason"), [
    ("b", "wake_fails", "gpu_oom"),
    ("a", "sleep_lies", "memory_not_returned"),
    ("a", "sleep_ignored", "lied"),
    ("b", "wake_ignored", "lied"),
])
async def test_a_failed_switch_keeps_one_owner_and_says_why(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession,
        engine: str, fault: str, reason: str) -> None:
    recorder = _SwitchRecorder()
    node = await _a_serving(engine_sim_factory, engine_session, recorder)
    a, b = node.engines
    faulty = a if engine == "a" else b
    try:
        await faulty.sim.faults(**{fault: True})
        async with asyncio.timeout(DEADLINE_S):
            failed = await node.activate(b)
        assert not failed.ok
        assert failed.reason == reason, failed.message
        assert recorder.ends == [reason]
        # The old holder serves again; the target is asleep.
        async with asyncio.timeout(DEADLINE_S):
            back = await node.activate(a)
        assert back.ok, back.message
        assert not back.switched
        assert not a.sim.engine.is_sleeping
        assert b.sim.engine.is_sleeping
        assert node.holders() == {"gpu-0": a.claimant.ref}
        await faulty.sim.faults(**{fault: False})
        await _serves_again(node, b, a)
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_wake_that_lied_is_backed_out_without_waiting_for_its_probe(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """An engine still asleep after a wake it answered with success holds the correctness
    probe (its request waits for a wake that never comes) until the probe's first-token
    bound (30 s). The failed confirmation ends the probe: the old holder serves again well
    within that bound (which the switch once waited out)."""
    recorder = _SwitchRecorder()
    patient = SHORT.model_copy(update={"probe_s": 3600.0})
    node = await _a_serving(engine_sim_factory, engine_session, recorder, patient)
    a, b = node.engines
    first_token_s = patient.engine_calls().probe_first_token_s
    try:
        await b.sim.faults(wake_ignored=True)
        async with asyncio.timeout(first_token_s * 2 / 3):
            failed = await node.activate(b)
            assert failed.reason == "lied", failed.message
            back = await node.activate(a)
        assert back.ok, back.message
        assert recorder.ends == ["lied"]
        assert node.holders() == {"gpu-0": a.claimant.ref}
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_hung_wake_keeps_every_other_engine_asleep_until_it_lands(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    recorder = _SwitchRecorder()
    node = await _a_serving(engine_sim_factory, engine_session, recorder)
    a, b = node.engines
    try:
        await b.sim.faults(wake_hangs=True)
        async with asyncio.timeout(DEADLINE_S):
            hung = await node.activate(b)
        # A wake without an answer may still complete: its outcome is unknown.
        assert not hung.ok
        assert hung.reason == "state_unknown", hung.message
        # B's wake may still land (an engine does not stop a wake whose caller left):
        # waking A now could leave two engines awake.
        async with asyncio.timeout(DEADLINE_S):
            refused = await node.activate(a)
        assert not refused.ok
        assert refused.reason == "state_unknown", refused.message
        assert a.sim.engine.is_sleeping
        await b.sim.faults(wake_hangs=False)
        await _serves_again(node, b, a)
        assert node.watch.violations == []
        assert recorder.ends[0] == "state_unknown"
    finally:
        await node.close()
