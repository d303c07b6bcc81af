"""An awake set on an in-memory node: engine simulators over HTTP, the controller's own
GPU workers, switch and reconciliation, the GPU read as NVML would. The GPU is 141 GiB and
every engine's awake budget 60 GiB: two fit awake together, three never do. Asked A, B
and C in turn, the set grows to two and C displaces one; a controller that takes over
keeps the set its Lease names, and puts to sleep an engine awake that it does not."""

from __future__ import annotations

import aiohttp
import pytest

from e2e.harness.gang_node import GPU_TOTAL, GangNode, gang_node, node_of
from rota.api import naming
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller


def _awake(node: GangNode) -> set[str]:
    return {e.claimant.claim_name for e in node.engines if not e.sim.engine.is_sleeping}


def _named(node: GangNode) -> set[str]:
    return {m.claim.split("/")[1] for m in node.lease("gpu-0").awake_set}


def _used(node: GangNode) -> int:
    return sum(e.sim.engine.memory.used_bytes for e in node.engines)


async def _three(factory: EngineSimFactory, session: aiohttp.ClientSession) -> GangNode:
    return await gang_node(factory, session, [(n, ("gpu-0",), 60) for n in "abc"], gpus=1,
                           awake_set=True)


async def _a_and_b_then_gone(factory: EngineSimFactory, session: aiohttp.ClientSession
                             ) -> GangNode:
    """A and B asked in turn (both awake, the Lease names both), then the controller's
    workers stopped, as a crashed instance's."""
    node = await _three(factory, session)
    a, b, _ = node.engines
    try:
        assert (await node.activate(a)).ok
        assert (await node.activate(b)).ok
    finally:
        await node.close()
    return node


def _taking_over(node: GangNode, session: aiohttp.ClientSession, *, awake_set: bool
                 ) -> GangNode:
    """A new instance's workers on the same engines and Leases, in a new term, running."""
    new = node_of(node.engines, session, node.leases, awake_set=awake_set)
    for worker in new.workers.values():
        worker.state.new_term = True
    new.start()
    return new


async def test_the_set_grows_to_what_fits_and_a_newcomer_displaces_one(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _three(engine_sim_factory, engine_session)
    a, b, c = node.engines
    try:
        assert (await node.activate(a)).ok
        assert (await node.activate(b)).ok
        assert _awake(node) == {"a", "b"}
        assert _named(node) == {"a", "b"}
        assert (await node.activate(c)).ok
        assert "c" in _awake(node)
        assert len(_awake(node)) == 2
        assert _named(node) == _awake(node)
        assert _used(node) <= GPU_TOTAL
        # a member is served at once, nobody put to sleep for it
        member = next(e for e in (a, b) if e.claimant.claim_name in _awake(node))
        before = _awake(node)
        answer = await node.activate(member)
        assert answer.ok
        assert not answer.switched
        assert _awake(node) == before
    finally:
        await node.close()


async def test_a_controller_taking_over_keeps_the_named_set_and_sleeps_a_stranger_to_it(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_and_b_then_gone(engine_sim_factory, engine_session)
    c = node.engines[2]
    # C woken behind the controllers' backs (as a wake a crashed instance sent may land)
    await node.adapter(c.claimant).wake(1)
    assert _awake(node) == {"a", "b", "c"}
    taken_over = _taking_over(node, engine_session, awake_set=True)
    try:
        await taken_over.until(lambda: _awake(taken_over) == {"a", "b"},
                               what="the stranger to the set put to sleep")
        await taken_over.until(
            lambda: taken_over.lease("gpu-0").state == naming.STATE_AWAKE
            and _named(taken_over) == {"a", "b"}, what="the set still named")
    finally:
        await taken_over.close()


async def test_with_the_set_off_a_controller_taking_over_keeps_one(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_and_b_then_gone(engine_sim_factory, engine_session)
    one = _taking_over(node, engine_session, awake_set=False)
    try:
        await one.until(lambda: len(_awake(one)) == 1, what="one awake")
        await one.until(lambda: _named(one) == _awake(one), what="the Lease naming it")
    finally:
        await one.close()
