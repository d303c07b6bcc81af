"""The turn loop with an awake set in effect (``--awake-set``): a newcomer that fits
beside the members joins without the policy being asked and without anyone put to sleep,
a caller of a member is answered at once, a newcomer that does not fit displaces the
member chosen for it (idle, woken longest ago) and nobody else, and a GPU with an engine
that spans GPUs keeps one awake. Fakes stand in for the Lease, the engines and the
switch; the GPU is 20 GiB and every engine's awake budget 8 GiB (two fit, three do not)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from controller.claimants import Claimant
from controller.lease.device import GpuSnapshot
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.switch import Switcher, SwitchResult, member_of
from rota.api.gpu_lease import GpuLease
from tests.controller.worker_kit import FakeEngine, FakeLeasePort, caller_queued, claimant

GIB = 1 << 30


class _Limits:
    unknown_limit_bytes = GIB // 2


class _FakeSwitcher:
    """Switches at once and records whom each switch puts to sleep and keeps awake."""

    limits = _Limits()

    def __init__(self, port: FakeLeasePort) -> None:
        self.port = port
        self.seen: list[tuple[str | None, str, tuple[str, ...], tuple[str, ...]]] = []

    async def snapshot(self, gpu: str, timings: dict[str, float]) -> GpuSnapshot:
        return GpuSnapshot(uuid="GPU-0", device=gpu, total_bytes=20 * GIB, used_bytes=0,
                           free_bytes=20 * GIB, processes=())

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Any, preempt: bool = False,
                     stay: tuple[Claimant, ...] = (),
                     also_sleep: tuple[Claimant, ...] = ()) -> SwitchResult:
        self.seen.append((holder.ref if holder else None, target.ref,
                          tuple(c.ref for c in stay), tuple(c.ref for c in also_sleep)))
        self.port.lease = Switcher.serving(lease.with_(fence=lease.fence + 1), target,
                                           companions=tuple(member_of(c) for c in stay))
        return SwitchResult(True, self.port.lease, timings={"wake_call": 0.1})


class _Gpu:
    def __init__(self, *, awake_set: bool = True, claimants: list[Claimant] | None = None,
                 companions: tuple[Claimant, ...] = (),
                 in_flight: dict[str, int] | None = None) -> None:
        self.now = 1000.0
        self.claimants = claimants or [claimant("a"), claimant("b"), claimant("c")]
        self.a, self.b, self.c = self.claimants[:3]
        lease = Switcher.serving(GpuLease(name="l", node="n", device="gpu-0", fence=1),
                                 self.a, companions=tuple(member_of(c) for c in companions))
        self.port = FakeLeasePort(lease)
        self.switcher = _FakeSwitcher(self.port)
        unused: Any = self.switcher
        self.worker = GpuWorker(gpu="gpu-0", lease_port=self.port,  # type: ignore[arg-type]
                                switcher=unused, claimants=lambda: list(self.claimants),
                                engine=lambda c: FakeEngine(  # type: ignore[arg-type,return-value]
                                    (in_flight or {}).get(c.claim_name, 0)),
                                policy=Policy(awake_set=awake_set), clock=lambda: self.now)
        self.worker.state.lease = lease
        self.worker.state.accepting = True
        self.worker.work.holder_since = self.now - 100.0

    async def ask(self, claimant: Claimant) -> asyncio.Task[Any]:
        self.worker.state.dirty = True  # queue it (activate answers some at once otherwise)
        return await caller_queued(self.worker.queue, claimant,
                                   self.worker.activate(claimant))

    async def serve(self, claimant: Claimant) -> Any:
        task = await self.ask(claimant)
        self.worker.state.dirty = False
        await self.worker.turns.serve_next(asyncio.Event())
        return await task


async def test_a_newcomer_that_fits_joins_without_the_policy_and_nobody_sleeps() -> None:
    gpu = _Gpu()
    task = await gpu.ask(gpu.b)
    gpu.worker.state.dirty = False
    assert await gpu.worker.turns.pick(asyncio.Event()) == ("uid-b", None)
    await gpu.worker.turns.serve_next(asyncio.Event())
    assert (await task).switched
    assert gpu.switcher.seen == [(None, "ns/b", ("ns/a",), ())]
    assert [m.claim for m in gpu.port.lease.awake_set] == ["ns/b", "ns/a"]


async def test_a_caller_of_a_member_is_answered_at_once() -> None:
    gpu = _Gpu(companions=(claimant("b"),))
    answer = await gpu.serve(gpu.b)
    assert answer.ok
    assert not answer.switched
    assert gpu.switcher.seen == []


async def test_a_newcomer_that_does_not_fit_displaces_one_member_only() -> None:
    gpu = _Gpu(companions=(claimant("b"),))  # b woken first, a (the holder) last
    answer = await gpu.serve(gpu.c)
    assert answer.ok
    assert gpu.switcher.seen == [("ns/b", "ns/c", ("ns/a",), ())], (
        "the member woken longest ago sleeps; the holder stays awake beside the newcomer")
    assert [m.claim for m in gpu.port.lease.awake_set] == ["ns/c", "ns/a"]


async def test_with_the_set_off_every_switch_puts_the_holder_to_sleep() -> None:
    gpu = _Gpu(awake_set=False)
    answer = await gpu.serve(gpu.b)
    assert answer.ok
    assert gpu.switcher.seen == [("ns/a", "ns/b", (), ())]
    assert [m.claim for m in gpu.port.lease.awake_set] == ["ns/b"]


async def test_an_engine_that_spans_gpus_keeps_its_gpus_to_one_awake() -> None:
    gang = dataclasses.replace(claimant("g"),
                               resident_on_gpu=(("gpu-0", GIB), ("gpu-1", GIB)))
    gpu = _Gpu(claimants=[claimant("a"), claimant("b"), claimant("c"), gang])
    assert not gpu.worker.sets.in_effect()
    gpu.claimants.pop()
    assert gpu.worker.sets.in_effect()


async def test_a_member_is_answered_without_queueing_but_not_while_a_switch_runs() -> None:
    gpu = _Gpu(companions=(claimant("b"),))
    answer = await gpu.worker.activate(gpu.b)
    assert answer.ok
    assert not answer.switched
    assert not gpu.worker.queue
    gpu.worker.state.switching = True  # the Lease in hand may still name one it displaces
    task = await caller_queued(gpu.worker.queue, gpu.b, gpu.worker.activate(gpu.b))
    assert not task.done()
    gpu.worker.close("stopping", "the test is over")
    assert (await task).reason == "stopping"


async def test_the_policy_weighs_the_member_displaced_not_a_busy_holder_that_stays() -> None:
    # a (the holder) is busy, b (awake beside it) idle: c displaces b at once; the policy
    # does not hold c for a's quantum, as it would if it weighed the holder
    gpu = _Gpu(companions=(claimant("b"),), in_flight={"a": 3})
    task = await gpu.ask(gpu.c)
    gpu.worker.state.dirty = False
    picked = await gpu.worker.turns.pick(asyncio.Event())
    assert picked is not None
    assert picked[1] is not None
    assert picked[1].rule == "holder_idle"
    await gpu.worker.turns.serve_next(asyncio.Event())
    assert (await task).switched
    assert gpu.switcher.seen == [("ns/b", "ns/c", ("ns/a",), ())]
