"""The turn loop hands the policy's ``Decision.preempt`` to the switch (the one place it
runs a switch, ``TurnLoop.switch``): a preemptive decision makes a preemptive switch, any
other a draining one; and an engine the switch froze waits for its wake as a caller does,
so the policy wakes it by its freeze bound though no new request asks for it. Fakes stand
in for the Lease, the engines and the switch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.switch import Freezes, Frozen, Switcher, SwitchResult
from controller.lease.worker.callers import Waiting
from controller.lease.worker.turns import Turn
from rota.api.gpu_lease import GpuLease
from tests.controller.worker_kit import FakeEngine, FakeLeasePort, claimant


class _FakeSwitcher:
    """Switches at once; records whether each switch was asked to preempt, and freezes
    (and thaws) as the Switcher does."""

    def __init__(self, port: FakeLeasePort, clock: Any = lambda: 1000.0) -> None:
        self.port = port
        self.clock = clock
        self.preempts: list[bool] = []
        self.ports = SimpleNamespace(freezes=Freezes())

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Any, preempt: bool = False, **_: Any) -> SwitchResult:
        self.preempts.append(preempt)
        self.port.lease = Switcher.serving(lease.with_(fence=lease.fence + 1), target)
        freezes: Freezes = self.ports.freezes
        freezes.thaw(target.claim_uid)
        if preempt and holder is not None:
            freezes.froze(holder.claim_uid, Frozen(holder.ref, holder.model, holder.gpu, 2,
                                                   self.clock()))
        return SwitchResult(True, self.port.lease, kept=2 if preempt else 0)


def _decision(preempt: bool) -> switch_policy.Decision:
    return switch_policy.Decision(switch_policy.Action.SWITCH, "first_token_due", "due",
                                  target="ns/b", preempt=preempt)


@pytest.mark.parametrize(("decision", "preempted"), [
    (_decision(True), True), (_decision(False), False), (None, False)])
async def test_the_switch_preempts_as_the_policy_decided(
        decision: switch_policy.Decision | None, preempted: bool) -> None:
    a, b = claimant("a"), claimant("b")
    lease = Switcher.serving(GpuLease(name="l", node="n", device="gpu-0", fence=1), a)
    port = FakeLeasePort(lease)
    switcher = _FakeSwitcher(port)
    unused: Any = switcher
    worker = GpuWorker(gpu="gpu-0", lease_port=port,  # type: ignore[arg-type]
                       switcher=unused, claimants=lambda: [a, b],
                       engine=lambda c: FakeEngine(2),  # type: ignore[arg-type,return-value]
                       policy=Policy(), clock=lambda: 1000.0)
    worker.state.lease = lease
    worker.state.accepting = True
    waiting = Waiting(b, [], since=1000.0)
    worker.queue.entries[b.claim_uid] = waiting
    await worker.turns.switch(Turn(waiting, b, decision, lease, a, [a, b]))
    assert switcher.preempts == [preempted]
    assert port.lease.holder == "ns/b"


async def test_a_frozen_holder_is_woken_by_its_freeze_bound_though_nobody_asks() -> None:
    now = [1000.0]
    a, b = claimant("a"), claimant("b")
    lease = Switcher.serving(GpuLease(name="l", node="n", device="gpu-0", fence=1), a)
    port = FakeLeasePort(lease)
    switcher = _FakeSwitcher(port, clock=lambda: now[0])
    unused: Any = switcher
    worker = GpuWorker(gpu="gpu-0", lease_port=port,  # type: ignore[arg-type]
                       switcher=unused, claimants=lambda: [a, b],
                       engine=lambda c: FakeEngine(2),  # type: ignore[arg-type,return-value]
                       policy=Policy(), clock=lambda: now[0])
    worker.state.lease = lease
    worker.state.accepting = True
    worker.work.holder_since = now[0] - 100.0
    waiting = Waiting(b, [], since=now[0])
    worker.queue.entries[b.claim_uid] = waiting
    await worker.turns.switch(Turn(waiting, b, _decision(True), lease, a, [a, b]))
    worker.state.lease = port.lease
    assert switcher.ports.freezes.get(a.claim_uid) is not None
    assert a.claim_uid in worker.queue, "A's kept requests wait for its wake"
    assert worker.queue.entries[a.claim_uid].wanted()

    now[0] += 10.0  # far past A's 3 s freeze bound; nobody asked for A meanwhile
    picked = await worker.turns.pick(asyncio.Event())
    assert picked is not None
    uid, decision = picked
    assert uid == a.claim_uid
    assert decision is not None
    assert decision.rule == "freeze_bound"
    await worker.turns.serve_next(asyncio.Event())
    assert port.lease.holder == "ns/a"
    assert switcher.ports.freezes.get(a.claim_uid) is None
    assert a.claim_uid not in worker.queue, "woken: its kept requests wait no more"
