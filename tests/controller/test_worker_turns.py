"""The turn loop of one GPU's worker (controller/lease/worker/turns.py): the policy's pick,
and the one place a turn's switch runs (TurnLoop.switch): the switch in flight is shown,
its callers answered, its costs kept, and a fenced-off switch queued again at the front a
bounded number of times. Fakes stand in for the Lease, the engines and the switch."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.claimants import Claimant
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.switch import Fenced, Switcher, SwitchResult
from controller.lease.worker.turns import Turn
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from tests.controller.worker_kit import FakeEngine, FakeLeasePort, caller_queued, claimant


class _FakeSwitcher:
    """Switches at once (or is fenced off ``fenced`` times first), and records what the
    worker showed while it ran."""

    def __init__(self, port: FakeLeasePort, worker: Any = None, fenced: int = 0) -> None:
        self.port = port
        self.worker: GpuWorker | None = worker
        self.fenced = fenced
        self.seen: list[tuple[str | None, str, bool, str]] = []

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Any, **_: Any) -> SwitchResult:
        assert self.worker is not None
        state = self.worker.state
        self.seen.append((holder.ref if holder else None, target.ref, state.switching,
                          state.switching_to))
        if self.fenced:
            self.fenced -= 1
            raise Fenced("the Lease moved")
        self.port.lease = Switcher.serving(lease.with_(fence=lease.fence + 1), target)
        return SwitchResult(True, self.port.lease, timings={"wake_call": 0.7})


class _Gpu:
    def __init__(self, *, fenced: int = 0, retries: int = 2) -> None:
        self.now = 1000.0
        self.a, self.b = claimant("a"), claimant("b")
        lease = Switcher.serving(GpuLease(name="l", node="n", device="gpu-0", fence=1), self.a)
        self.port = FakeLeasePort(lease)
        self.switcher = _FakeSwitcher(self.port, fenced=fenced)
        unused: Any = self.switcher
        self.worker = GpuWorker(gpu="gpu-0", lease_port=self.port,  # type: ignore[arg-type]
                                switcher=unused, claimants=lambda: [self.a, self.b],
                                engine=lambda c: FakeEngine(),  # type: ignore[arg-type,return-value]
                                policy=Policy(fenced_retries=retries), clock=lambda: self.now)
        self.switcher.worker = self.worker
        self.worker.state.lease = lease
        self.worker.state.accepting = True
        self.worker.work.holder_since = self.now - 100.0

    async def ask(self, claimant: Claimant) -> asyncio.Task[Any]:
        return await caller_queued(self.worker.queue, claimant,
                                   self.worker.activate(claimant))


async def test_pick_asks_the_policy_and_hands_its_decision_on() -> None:
    gpu = _Gpu()
    task = await gpu.ask(gpu.b)
    picked = await gpu.worker.turns.pick(asyncio.Event())
    assert picked is not None
    uid, decision = picked
    assert uid == "uid-b"
    assert decision is not None, "a switch away from an awake holder is the policy's"
    assert decision.target == "ns/b"
    assert gpu.worker.state.rule == decision.rule
    gpu.worker.close("stopping", "the controller is stopping")
    assert (await task).reason == "stopping"


async def test_the_holders_own_callers_are_served_without_asking_the_policy() -> None:
    gpu = _Gpu()
    gpu.worker.state.dirty = True  # activate() answers the holder at once otherwise
    task = await gpu.ask(gpu.a)
    assert await gpu.worker.turns.pick(asyncio.Event()) == ("uid-a", None)
    await gpu.worker.turns.serve_next(asyncio.Event())
    answer = await task
    assert answer.ok
    assert not answer.switched
    assert gpu.switcher.seen == [], "nothing to switch"


async def test_a_turns_switch_runs_shown_and_answers_its_callers() -> None:
    gpu = _Gpu()
    task = await gpu.ask(gpu.b)
    await gpu.worker.turns.serve_next(asyncio.Event())
    answer = await task
    assert answer.ok
    assert answer.switched
    assert gpu.switcher.seen == [("ns/a", "ns/b", True, "uid-b")], (
        "the switch from the awake holder, shown in flight")
    assert not gpu.worker.state.switching
    assert gpu.worker.state.lease is not None
    assert gpu.worker.state.lease.holder == "ns/b"
    assert gpu.worker.work.costs["ns/b"].wake_s == 0.7, "its cost is kept"
    assert gpu.worker.state.last_switch["to"] == "ns/b"
    assert not gpu.worker.queue


async def test_a_fenced_off_switch_queues_again_first_then_is_answered() -> None:
    gpu = _Gpu(fenced=5, retries=1)
    task = await gpu.ask(gpu.b)
    picked = await gpu.worker.turns.pick(asyncio.Event())
    assert picked is not None
    waiting = gpu.worker.queue.entries["uid-b"]
    lease = gpu.worker.state.lease
    assert lease is not None
    turn = Turn(waiting, gpu.b, picked[1], lease, gpu.a, [gpu.a, gpu.b])
    for attempt in (1, 2):
        try:
            await gpu.worker.turns.switch(turn)
        except Fenced:
            pass
        assert gpu.worker.state.dirty, "fenced off: reconcile first"
        assert not gpu.worker.state.switching
        if attempt == 1:
            assert list(gpu.worker.queue.entries) == ["uid-b"], "queued again"
            assert not task.done()
    answer = await task
    assert not answer.ok
    assert answer.reason == "interrupted", "retries are bounded"
    assert not gpu.worker.queue


async def test_a_switch_waiting_for_residency_ends_when_the_controller_stops() -> None:
    gpu = _Gpu()
    gpu.worker.policy = Policy(min_residency_s=60.0)
    gpu.worker.work.holder_since = gpu.now
    task = await gpu.ask(gpu.b)
    stop = asyncio.Event()
    stop.set()
    await gpu.worker.turns.serve_next(stop)
    assert gpu.switcher.seen == [], "no switch before the holder's residency"
    assert not task.done(), "its callers still wait"
    assert gpu.worker.state.lease is not None
    assert gpu.worker.state.lease.state == naming.STATE_AWAKE
    gpu.worker.close("stopping", "the controller is stopping")
    assert (await task).reason == "stopping"
