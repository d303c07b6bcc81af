"""Start-up admission across a controller failover and a dead newcomer, on the in-memory
node (real simulators over HTTP, the controller's own workers, in-memory Leases; one awake
checked at every memory change of every engine).

- F3: an instance grants a start and dies; the newcomer is still importing (it answers
  nothing and holds no GPU memory). The next instance must not wake the old holder until
  the newcomer is known: it comes up awake, as every engine starts.
- F8: a newcomer that dies during its start (unreachable, no process left) gives the GPU
  back to the old holder.
- F7: a start gate asked again by a container whose engine came up (a tenant with its own
  start token) puts nobody to sleep; every start spaces the claim's next one.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import aiohttp
import pytest

from e2e.engine_simulator import create_app
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.loopback import SimulatorServer
from e2e.harness.gang_node import Engine, GangNode, LoopbackSim, _watched, gang_node, node_of
from rota.api import naming
from rota.api.gpu_lease import GpuLease, lease_body
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0


async def _a_awake_b_asleep(factory: EngineSimFactory, session: aiohttp.ClientSession
                            ) -> GangNode:
    node = await gang_node(factory, session, [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
                           gpus=1, awake=("a",))
    worker = node.workers["gpu-0"]
    await node.until(lambda: worker.reconciliations > 0 and not worker.unsettled,
                     within_s=DEADLINE_S, what="the GPU reconciled")
    return node


def _not_running(engine: Engine) -> None:
    """The engine's process is gone from the GPU (a new container still importing, or a
    dead one): NVML shows nothing of it."""
    engine.gone_from.add("gpu-0")


async def _granted(node: GangNode, engine: Engine) -> None:
    """Its start gate asks until it is given its go."""
    async with asyncio.timeout(DEADLINE_S):
        while not await node.workers["gpu-0"].request_start(engine.claimant, hold_s=5.0):
            pass


async def _kill(node: GangNode) -> None:
    """The instance dies (SIGKILL: nothing more of it runs)."""
    for task in node.tasks:
        task.cancel()
    await asyncio.gather(*node.tasks, return_exceptions=True)


async def _come_up_awake(node: GangNode, engine: Engine) -> LoopbackSim:
    """The engine's new process comes up on its address, awake (as vLLM starts); the
    caller stops it."""
    settings = engine.sim.settings
    app = create_app(settings, exit_process=lambda code: None)
    server = SimulatorServer(app, host="127.0.0.1", port=engine.claimant.port)
    await server.start_server()
    engine.sim = LoopbackSim(server, app[ENGINE_KEY], settings)
    engine.gone_from.discard("gpu-0")
    _watched(engine, node.watch)
    node.watch.check()
    return engine.sim


async def test_a_newcomer_granted_by_a_dead_instance_keeps_the_old_holder_asleep(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    await b.sim.stop()  # its container restarts through the gate: nothing listens yet
    _not_running(b)
    await _granted(node, b)
    assert a.sim.engine.is_sleeping, "the holder slept before the grant"
    await _kill(node)  # A dies while b imports
    assert node.lease("gpu-0").state == naming.STATE_STARTING
    successor = node_of(node.engines, engine_session, node.leases)
    successor.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            refused = await successor.activate(a)
        assert not refused.ok, "the old holder was woken beside an engine coming up"
        assert refused.reason == "state_unknown", refused.message
        assert a.sim.engine.is_sleeping
        came_up = await _come_up_awake(node, b)
        # b answers (awake): reconciliation puts it to sleep; then a may be woken.
        async with asyncio.timeout(DEADLINE_S):
            while not (await successor.activate(a)).ok:
                await successor.until(lambda: not successor.workers["gpu-0"].unsettled,
                                      within_s=DEADLINE_S, what="b known")
        assert b.sim.engine.is_sleeping
        assert not a.sim.engine.is_sleeping
        assert node.watch.violations == []
        await came_up.stop()
    finally:
        await successor.close()
        await node.close()


async def test_a_start_whose_limit_passed_no_longer_holds_the_gpu(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    await b.sim.stop()
    _not_running(b)
    await _granted(node, b)
    await _kill(node)
    port = node.leases["gpu-0"]
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    port.current = port.current.granted(b.claimant.claim_uid, long_ago)
    successor = node_of(node.engines, engine_session, node.leases)
    successor.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            woken = await successor.activate(a)
        assert woken.ok, woken.message
        assert node.lease("gpu-0").start_claim_uid == ""
    finally:
        await successor.close()
        await node.close()


async def test_a_newcomer_that_dies_during_its_start_gives_the_gpu_back(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    await b.sim.stop()
    _not_running(b)
    worker = node.workers["gpu-0"]
    again: asyncio.Task[bool] | None = None
    try:
        await _granted(node, b)
        # It dies before it answers: its container asks the gate again.
        again = asyncio.create_task(worker.request_start(b.claimant, hold_s=DEADLINE_S))
        await node.until(lambda: worker.last_switch.get("to") == b.claimant.ref,
                         within_s=DEADLINE_S, what="b's start over")
        assert worker.last_switch["reason"] == "start_failed"
        assert not a.sim.engine.is_sleeping, "the old holder stays asleep beside nothing"
        assert node.holders() == {"gpu-0": a.claimant.ref}
        assert node.lease("gpu-0").state == naming.STATE_AWAKE
        assert not worker.unsettled
        assert node.watch.violations == []
    finally:
        if again is not None:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)
        await node.close()


async def test_a_gate_asked_again_by_a_running_engine_puts_nobody_to_sleep(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    worker = node.workers["gpu-0"]
    try:
        await _granted(node, b)  # b's container starts
        await node.adapter(b.claimant).wake(1)  # the engine comes up, awake
        await node.until(lambda: node.lease("gpu-0").state == naming.STATE_AWAKE
                         and worker.last_switch.get("ok") is True,
                         within_s=DEADLINE_S, what="b's start done, a woken back")
        assert not a.sim.engine.is_sleeping
        sleeps = a.sim.engine.sleep_count
        fence = node.lease("gpu-0").fence
        # The tenant asks with its own token, five times, in the same run of its container.
        for _ in range(5):
            assert not await worker.request_start(b.claimant, hold_s=0.2)
        assert a.sim.engine.sleep_count == sleeps, "the holder was put to sleep"
        assert node.lease("gpu-0").fence == fence
        assert not a.sim.engine.is_sleeping
        assert node.watch.violations == []
    finally:
        await node.close()


def test_the_grant_survives_the_api_server_and_ends_with_its_start() -> None:
    """The record of a grant is rendered and parsed back (what the next instance reads),
    kept by a new term, and cleared by every transition that ends the start."""
    at = dt.datetime(2026, 12, 6, 21, 0, 0, 123456, tzinfo=dt.UTC)
    lease = GpuLease(name="l", node="n", device="gpu-0").granted("uid-b", at)
    body = lease_body(lease, "ns", labels_node="n", labels_device="gpu-0")
    parsed = GpuLease.from_object(body)
    assert (parsed.start_claim_uid, parsed.start_granted) == ("uid-b", at)
    assert naming.START_GRANTED not in parsed.extra_annotations
    assert parsed.new_term("c2").start_claim_uid == "uid-b"
    for ended in (parsed.idle(), parsed.failed("x"),
                  parsed.serving(holder="ns/a", model="m", claim_uid="uid-a", gang=""),
                  parsed.opening(naming.LeaseState.SWITCHING, controller="c",
                                 target_model="m", draining_model="")):
        assert (ended.start_claim_uid, ended.start_granted) == ("", None)
