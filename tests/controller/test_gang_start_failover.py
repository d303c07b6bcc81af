"""Review F3 for a tensor-parallel engine, on the in-memory gang node (real simulators over
HTTP, the controller's own workers, one in-memory Lease per GPU; one awake checked at every
memory change of every engine).

An instance grants a gang start (the holders of both GPUs sleep, the gate is given its go)
and dies while the newcomer imports: it answers nothing and holds no GPU memory yet. The
next instance must wake nobody on either GPU until the newcomer is known: it comes up
awake on both, as every engine starts. The go is recorded on every GPU Lease of the gang
(``gpu.rota.dev/start-granted``) before it is handed over, as a one-GPU start records it;
the old gang start recorded nothing, and the next instance woke the old holders beside
the engine coming up.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from e2e.engine_simulator import create_app
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.loopback import SimulatorServer
from e2e.harness.gang_node import Engine, GangNode, LoopbackSim, _watched, gang_node, node_of
from rota.api import naming
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0
GPUS = ("gpu-0", "gpu-1")


async def _one_gpu_engines_awake(factory: EngineSimFactory, session: aiohttp.ClientSession
                                 ) -> GangNode:
    """a awake on gpu-0, b awake on gpu-1, the TP engine asleep across both; reconciled."""
    node = await gang_node(factory, session, [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                                              ("tp", GPUS, 40)], gpus=2, awake=("a", "b"))
    await node.until(lambda: all(w.reconciliations > 0 and not w.unsettled
                                 for w in node.workers.values()),
                     within_s=DEADLINE_S, what="both GPUs reconciled")
    return node


async def _restarts_through_the_gate(engine: Engine) -> None:
    """Its container restarts: nothing listens, and NVML shows nothing of it."""
    await engine.sim.stop()
    engine.gone_from.update(engine.claimant.gpus)


async def _granted(node: GangNode, engine: Engine) -> None:
    """Its start gate asks (the worker of its first GPU) until it is given its go."""
    async with asyncio.timeout(DEADLINE_S):
        while not await node.workers[engine.claimant.gpu].request_start(engine.claimant,
                                                                       hold_s=5.0):
            pass


async def _kill(node: GangNode) -> None:
    """The instance dies (SIGKILL: nothing more of it runs)."""
    for task in node.tasks:
        task.cancel()
    await asyncio.gather(*node.tasks, return_exceptions=True)


async def _come_up_awake(node: GangNode, engine: Engine) -> LoopbackSim:
    """The engine's new process comes up on its address, awake on all its GPUs (as vLLM
    starts); the caller stops it."""
    settings = engine.sim.settings
    app = create_app(settings, exit_process=lambda code: None)
    server = SimulatorServer(app, host="127.0.0.1", port=engine.claimant.port)
    await server.start_server()
    engine.sim = LoopbackSim(server, app[ENGINE_KEY], settings)
    engine.gone_from.clear()
    _watched(engine, node.watch)
    node.watch.check()
    return engine.sim


async def _refused(successor: GangNode, engine: Engine) -> None:
    async with asyncio.timeout(DEADLINE_S):
        answer = await successor.activate(engine)
    assert not answer.ok, f"{engine.claimant.ref} was woken beside an engine coming up"
    assert answer.reason == "state_unknown", answer.message
    assert engine.sim.engine.is_sleeping


async def test_a_gang_newcomer_granted_by_a_dead_instance_keeps_both_holders_asleep(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _one_gpu_engines_awake(engine_sim_factory, engine_session)
    a, b, tp = node.engines
    successor: GangNode | None = None
    came_up: LoopbackSim | None = None
    try:
        await _restarts_through_the_gate(tp)
        await _granted(node, tp)
        assert a.sim.engine.is_sleeping, "gpu-0's holder slept before the go"
        assert b.sim.engine.is_sleeping, "gpu-1's holder slept before the go"
        assert {node.lease(g).state for g in GPUS} == {naming.STATE_STARTING}
        await _kill(node)  # the instance dies while tp imports
        successor = node_of(node.engines, engine_session, node.leases)
        successor.start()
        await _refused(successor, a)
        await _refused(successor, b)
        for gpu in GPUS:  # what told the successor, kept until tp is known
            assert node.lease(gpu).start_claim_uid == tp.claimant.claim_uid, gpu
        came_up = await _come_up_awake(node, tp)
        # tp answers (awake): reconciliation puts it to sleep; then a and b may be woken.
        for engine in (a, b):
            async with asyncio.timeout(DEADLINE_S):
                while not (await successor.activate(engine)).ok:
                    await successor.until(
                        lambda: not any(w.unsettled for w in successor.workers.values()),
                        within_s=DEADLINE_S, what="tp known")
        assert tp.sim.engine.is_sleeping
        assert not a.sim.engine.is_sleeping
        assert not b.sim.engine.is_sleeping
        assert successor.holders() == {"gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref}
        assert all(node.lease(g).start_claim_uid == "" for g in GPUS), "record cleared"
        assert node.watch.violations == []
    finally:
        if successor is not None:
            await successor.close()
        await node.close()
        if came_up is not None:
            await came_up.stop()


async def test_a_gang_start_that_comes_up_clears_the_record_on_every_gpu(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """Without a failover: the record lives from the go to the start's end, on both
    GPUs, and the old holders are woken back once the newcomer slept once."""
    node = await _one_gpu_engines_awake(engine_sim_factory, engine_session)
    a, b, tp = node.engines
    seen: list[tuple[str, ...]] = []

    def note_the_record() -> None:  # at every GPU read of the start (after the go too)
        seen.append(tuple(node.lease(g).start_claim_uid for g in GPUS))

    try:
        await _granted(node, tp)
        node.device.on_read.append(note_the_record)
        await node.adapter(tp.claimant).wake(1)  # the engine comes up, awake
        await node.until(lambda: node.holders() == {
            "gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref} and {
            node.lease(g).state for g in GPUS} == {naming.STATE_AWAKE},
            within_s=DEADLINE_S, what="tp started, a and b woken back")
        uid = tp.claimant.claim_uid
        assert (uid, uid) in seen, "the record was on both Leases while tp came up"
        assert all(node.lease(g).start_claim_uid == "" for g in GPUS)
        assert tp.sim.engine.is_sleeping
        assert node.watch.violations == []
    finally:
        await node.close()
