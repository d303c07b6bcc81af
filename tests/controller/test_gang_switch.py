"""Gang switches on an in-memory node: engines that span GPUs (tensor parallel) take
turns with one-GPU engines, and no GPU ever has two engines awake (checked at every memory
change of every engine, not sampled)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from controller.lease.policy import SwitchCost
from e2e.harness.gang_node import gang_node, node_of
from rota.api import naming
from rota.api.engine_guard import parse_fences
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0


async def test_a_two_gpu_claim_wakes_only_after_the_other_gpus_holder_sleeps(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The review's scenario: a claim on gpu-0 and gpu-1, another engine awake on gpu-1.
    Waking the two-GPU claim must first put that engine to sleep and read gpu-1."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("tp", ("gpu-0", "gpu-1"), 40), ("z", ("gpu-1",), 20)],
                           gpus=2, awake=("z",))
    tp, z = node.engines
    try:
        async with asyncio.timeout(DEADLINE_S):
            activation = await node.activate(tp)
        assert activation.ok, activation.message
        assert z.sim.engine.is_sleeping, "gpu-1's holder was put to sleep"
        assert not tp.sim.engine.is_sleeping
        assert "gpu-1" in node.device.reads, "gpu-1 was read before the wake"
        for gpu in ("gpu-0", "gpu-1"):
            lease = node.lease(gpu)
            assert (lease.holder, lease.state) == (tp.claimant.ref, naming.STATE_AWAKE)
            assert lease.gang == "gpu-0,gpu-1"
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_tp_engine_takes_turns_with_two_one_gpu_engines(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                            ("tp", ("gpu-0", "gpu-1"), 40)], gpus=2, awake=("a", "b"))
    a, b, tp = node.engines
    try:
        async with asyncio.timeout(DEADLINE_S):
            assert (await node.activate(tp)).ok
            assert a.sim.engine.is_sleeping
            assert b.sim.engine.is_sleeping
            assert node.holders() == {"gpu-0": tp.claimant.ref, "gpu-1": tp.claimant.ref}
            assert (await node.activate(a)).ok
            assert tp.sim.engine.is_sleeping, "the TP engine gave back both GPUs"
            assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": ""}
            assert node.lease("gpu-1").state == naming.STATE_IDLE
            assert (await node.activate(b)).ok
            assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref}
            assert (await node.activate(tp)).ok
        assert node.watch.violations == []
        assert node.watch.checks > 0
    finally:
        await node.close()


async def test_overlapping_gangs_both_end_and_one_holds(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """A TP=4 and a TP=2 engine both ask for gpu-2 at once: no deadlock, both switches end,
    and the later one holds its GPUs."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("four", ("gpu-0", "gpu-1", "gpu-2", "gpu-3"), 80),
                            ("two", ("gpu-2", "gpu-3"), 40), ("one", ("gpu-2",), 20)],
                           gpus=4, awake=("one",))
    four, two, one = node.engines
    try:
        async with asyncio.timeout(DEADLINE_S):
            first, second = await asyncio.gather(node.activate(four), node.activate(two))
        assert first.ok, first.message
        assert second.ok, second.message
        assert one.sim.engine.is_sleeping
        awake = [e.claimant.ref for e in node.engines if not e.sim.engine.is_sleeping]
        assert len(awake) == 1
        holders = node.holders()
        if awake == [two.claimant.ref]:
            assert holders["gpu-2"] == holders["gpu-3"] == two.claimant.ref
            assert holders["gpu-0"] == holders["gpu-1"] == ""
        else:
            assert set(holders.values()) == {four.claimant.ref}
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_gang_wake_that_cannot_fit_on_one_gpu_wakes_the_old_holders_back(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """A stranger holds memory on gpu-1: the TP engine is not woken, and each old holder
    is woken back after its own GPU is read again."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                            ("tp", ("gpu-0", "gpu-1"), 40)], gpus=2, awake=("a", "b"))
    a, b, tp = node.engines
    node.device.strangers["gpu-1"] = 4 * 2**30
    try:
        async with asyncio.timeout(DEADLINE_S):
            activation = await node.activate(tp)
        assert not activation.ok
        assert activation.reason == "unknown_process"
        assert tp.sim.engine.is_sleeping
        assert not a.sim.engine.is_sleeping, "a's GPU was clear: a is awake again"
        assert b.sim.engine.is_sleeping, "b's GPU holds the stranger: b stays asleep"
        assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": ""}
        assert node.lease("gpu-1").state == naming.STATE_FAILED
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_gang_wake_that_fails_puts_the_target_back_to_sleep_first(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("tp", ("gpu-0", "gpu-1"), 40)],
                           gpus=2, awake=("a",))
    a, tp = node.engines
    await tp.sim.faults(wake_fails=True)
    try:
        async with asyncio.timeout(DEADLINE_S):
            activation = await node.activate(tp)
        assert not activation.ok
        assert tp.sim.engine.is_sleeping
        assert not a.sim.engine.is_sleeping
        assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": ""}
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_controller_killed_mid_gang_switch_leaves_one_owner_per_gpu(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The instance dies while the holders sleep; a new instance on the same Leases
    reconciles every GPU to one owner (or a recorded unknown), and serves the TP engine."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                            ("tp", ("gpu-0", "gpu-1"), 40)], gpus=2, awake=("a", "b"))
    a, b, tp = node.engines
    sleeping = asyncio.Event()
    original = b.sim.engine.sleep

    async def slow_sleep(**kwargs: object) -> object:
        sleeping.set()
        await asyncio.sleep(0.2)
        return await original(**kwargs)  # type: ignore[arg-type]

    b.sim.engine.sleep = slow_sleep  # type: ignore[method-assign,assignment]
    pending = asyncio.create_task(node.activate(tp))
    async with asyncio.timeout(DEADLINE_S):
        await sleeping.wait()
    for task in node.tasks:
        task.cancel()
    await asyncio.gather(*node.tasks, return_exceptions=True)
    pending.cancel()
    states = {g: node.lease(g).state for g in ("gpu-0", "gpu-1")}
    assert states == {"gpu-0": naming.STATE_SWITCHING, "gpu-1": naming.STATE_SWITCHING}
    b.sim.engine.sleep = original  # type: ignore[method-assign]
    successor = node_of(node.engines, engine_session, node.leases)
    successor.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            activation = await successor.workers["gpu-0"].activate(tp.claimant)
        assert activation.ok, activation.message
        for engine in (a, b):
            assert engine.sim.engine.is_sleeping
        assert successor.holders() == {"gpu-0": tp.claimant.ref, "gpu-1": tp.claimant.ref}
        assert node.watch.violations == []
    finally:
        await successor.close()


async def test_a_tp_engine_that_dies_on_one_gpu_blocks_wakes_where_it_may_hold_memory(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The TP engine's worker on gpu-1 dies and its core with it (no answers) while its
    shard on gpu-0 stays held: gpu-1 shows nothing of it, so b may wake there; on gpu-0 it
    may still be awake, so a is not woken there until no process of it is left."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("tp", ("gpu-0", "gpu-1"), 40), ("a", ("gpu-0",), 20),
                            ("b", ("gpu-1",), 20)], gpus=2, awake=("tp",))
    tp, a, b = node.engines
    try:
        tp.gone_from.add("gpu-1")
        await tp.sim.stop()
        for worker in node.workers.values():
            worker.mark_dirty()
        async with asyncio.timeout(DEADLINE_S):
            woken = await node.activate(b)
            refused = await node.activate(a)
        assert woken.ok, woken.message
        assert not refused.ok
        assert refused.reason in ("state_unknown", "engine_unreachable"), refused.reason
        assert a.sim.engine.is_sleeping, "no wake beside an engine that may be awake"
        tp.gone_from.add("gpu-0")  # the whole process exits
        async with asyncio.timeout(DEADLINE_S):
            while not (await node.activate(a)).ok:
                node.workers["gpu-0"].mark_dirty()
                await asyncio.sleep(0.05)
        assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref}
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_the_old_holder_comes_back_once_a_leftover_process_is_gone(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """Waking the old holder back follows a GPU read (R5), and the read waits, bounded, for
    memory still held by a process that is exiting (as a SIGKILLed vLLM engine core does)."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
                           gpus=1, awake=("a",))
    a, b = node.engines
    node.device.strangers["gpu-0"] = 2 * 2**30
    reads_then_gone = len(node.device.reads) + 3

    def exits() -> None:
        if len(node.device.reads) >= reads_then_gone:
            node.device.strangers.pop("gpu-0", None)

    node.device.on_read.append(exits)
    try:
        async with asyncio.timeout(DEADLINE_S):
            activation = await node.activate(b)
        assert not activation.ok
        assert activation.reason == "unknown_process"
        assert not a.sim.engine.is_sleeping, "a came back once the process was gone"
        assert node.holders() == {"gpu-0": a.claimant.ref}
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_the_old_holder_stays_asleep_beside_a_stranger_that_stays(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
                           gpus=1, awake=("a",))
    a, b = node.engines
    node.device.strangers["gpu-0"] = 2 * 2**30
    try:
        async with asyncio.timeout(DEADLINE_S):
            activation = await node.activate(b)
        assert not activation.ok
        assert a.sim.engine.is_sleeping, "no wake beside an unknown process (R5)"
        assert node.lease("gpu-0").state == naming.STATE_FAILED
    finally:
        await node.close()


async def test_a_tp_engine_starts_only_with_its_budget_free_on_every_gpu(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """Start-up admission across the set: the holders of both GPUs sleep before the TP
    engine's gate is granted; it is proved and put to sleep once; with nobody waiting for
    it, the old holders are woken back, each after its GPU is read again."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                            ("tp", ("gpu-0", "gpu-1"), 40)], gpus=2, awake=("a", "b"))
    a, b, tp = node.engines
    try:
        async with asyncio.timeout(DEADLINE_S):
            while not await node.workers["gpu-0"].request_start(tp.claimant, hold_s=5.0):
                pass
            assert a.sim.engine.is_sleeping, "gpu-0's holder slept before the grant"
            assert b.sim.engine.is_sleeping, "gpu-1's holder slept before the grant"
            assert {node.lease(g).state for g in ("gpu-0", "gpu-1")} == {
                naming.STATE_STARTING}
            await node.adapter(tp.claimant).wake(1)  # the engine starts, awake
            await node.until(lambda: node.holders() == {
                "gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref} and {
                node.lease(g).state for g in ("gpu-0", "gpu-1")} == {naming.STATE_AWAKE})
        assert tp.sim.engine.is_sleeping, "its first sleep came before any traffic"
        assert not a.sim.engine.is_sleeping
        assert not b.sim.engine.is_sleeping
        assert node.watch.violations == []
        for gpu in ("gpu-0", "gpu-1"):  # the holders' wake-back is not the newcomer's cost
            cost = node.workers[gpu]._costs.get(tp.claimant.ref, SwitchCost())
            assert cost.wake_s == SwitchCost().wake_s
    finally:
        await node.close()


async def test_a_gang_switch_measures_each_holder_and_the_phases_wall_times(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """Two holders sleep at once for a TP engine: each holder's own sleep is kept as its
    cost (for the policy) by the worker of its GPU, and ``drain``/``sleep`` are the phases'
    wall times, not the last holder's value or a sum over holders."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                            ("tp", ("gpu-0", "gpu-1"), 40)], gpus=2, awake=("a", "b"))
    a, b, tp = node.engines
    try:
        async with asyncio.timeout(DEADLINE_S):
            for engine in (tp, a, b):  # a's and b's first sleeps are behind them
                assert (await node.activate(engine)).ok
            activation = await node.activate(tp)
        assert activation.ok, activation.message
        timings = activation.timings
        for holder, gpu in ((a, "gpu-0"), (b, "gpu-1")):
            own = timings[f"later_sleep:{holder.claimant.ref}"]
            assert node.workers[gpu]._costs[holder.claimant.ref].sleep_s == own
        assert {"drain", "sleep", "wake_call", "probe_ttft"} <= timings.keys()
        assert timings["sleep"] >= max(timings[f"sleep:{e.claimant.ref}"] for e in (a, b))
        assert node.workers["gpu-0"]._costs[tp.claimant.ref].wake_s == timings["wake_call"]
    finally:
        await node.close()


async def test_a_gang_switch_every_caller_left_during_the_residency_wait_is_not_made(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The holders keep their GPUs for the minimum residency; the only caller of the TP
    engine leaves during that wait: no switch is made (the holders stay awake, the TP
    engine asleep, each Lease naming its holder)."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-1",), 20),
                            ("tp", ("gpu-0", "gpu-1"), 40)], gpus=2, awake=("a", "b"))
    a, b, tp = node.engines
    for worker in node.workers.values():
        worker.policy = dataclasses.replace(worker.policy, min_residency_s=1.5)
    try:
        call = asyncio.create_task(node.activate(tp))
        await asyncio.sleep(0.5)  # queued, and its worker waits out the residency
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.sleep(2.0)  # past the residency: the switch would have begun
        assert tp.sim.engine.is_sleeping
        assert not a.sim.engine.is_sleeping
        assert not b.sim.engine.is_sleeping
        assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": b.claimant.ref}
        assert node.watch.violations == []
    finally:
        await node.close()


async def test_a_gang_engines_control_calls_carry_every_gpu_leases_fence(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The engine guard refuses a control call older than one it accepted (X-Rota-Fence);
    the gang switch's calls to a TP engine name the fence of each GPU Lease of its set (a
    GPU worker's own reads name its one Lease)."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("tp", ("gpu-0", "gpu-1"), 40), ("z", ("gpu-1",), 20)],
                           gpus=2, awake=("z",))
    tp, _ = node.engines
    try:
        async with asyncio.timeout(DEADLINE_S):
            assert (await node.activate(tp)).ok
        async with engine_session.get(f"{tp.sim.base_url}/sim/headers") as resp:
            sent = [parse_fences(v) for v in (await resp.json()).get("x-rota-fence", [])]
        leases = {node.lease(gpu).name for gpu in ("gpu-0", "gpu-1")}
        assert any(set(fences) == leases for fences in sent), sent
    finally:
        await node.close()
