"""The review's hypothesis: ``_pick`` took the first waiter without asking the policy when
the worker was dirty, which a claimant change makes it at any moment (it marks the worker
while a reconciliation runs). A busy holder then lost its quantum to whoever queued first.
The worker's own fakes from the policy tests stand in for the Lease, engines and switch."""

from __future__ import annotations

import asyncio

from controller.lease.gpu import Policy
from tests.controller.test_policy_worker import _claimant, _Node, _settle


async def test_a_claimant_change_does_not_let_a_waiter_past_the_policy() -> None:
    a, b = _claimant("a"), _claimant("b")
    node = _Node([a, b], Policy(), holder=a)
    node.engines["ns/a"].busy = 3  # the holder serves: it keeps its quantum
    task = node.ask(b)
    await _settle()
    node.worker.mark_dirty()  # a claimant changed while the worker reconciled
    stop = asyncio.Event()
    stop.set()  # a hold returns at once
    await node.worker._serve_next(stop)
    assert node.switcher.switches == [], "a waiter went past the policy"
    assert not task.done()
    node.worker._dirty = False  # reconciled
    await node.worker._serve_next(stop)
    assert node.switcher.switches == [], "the busy holder keeps its quantum"
    node.engines["ns/a"].busy = 0
    await node.worker._serve_next(stop)
    assert (await task).ok
    assert node.switcher.switches == [("ns/a", "ns/b")]
