"""The callers' queue of one GPU's worker (controller/lease/worker/callers.py): callers of
one claim share one entry, entries keep the order of their first request, an entry every
caller left is dropped, and a fenced-off entry goes back to the front with the callers who
came meanwhile."""

from __future__ import annotations

import asyncio

from controller.claimants import Claimant
from controller.lease.worker.callers import CallerQueue
from controller.lease.worker.state import Activation
from tests.controller.worker_kit import caller_queued, claimant


class _Queue:
    def __init__(self) -> None:
        self.now = 10.0
        self.answered: list[tuple[str, int]] = []
        self.wakeup = asyncio.Event()
        self.queue = CallerQueue(clock=lambda: self.now, wakeup=self.wakeup,
                                 answered=lambda uid, n: self.answered.append((uid, n)))

    async def ask(self, claimant: Claimant) -> asyncio.Task[Activation]:
        """One caller more, one second after the previous one; queued on return."""
        self.now += 1.0
        return await caller_queued(self.queue, claimant, self.queue.wait(claimant))


async def test_callers_of_one_claim_share_an_entry_in_first_request_order() -> None:
    q = _Queue()
    a, b = claimant("a"), claimant("b")
    tasks = [await q.ask(b), await q.ask(a), await q.ask(b)]
    assert q.wakeup.is_set(), "a caller wakes the worker"
    assert list(q.queue.entries) == ["uid-b", "uid-a"], "the order of first requests"
    assert q.queue.pending() == 3
    assert [(c.claim, c.length, c.oldest_since) for c in q.queue.claim_queues()] == [
        ("ns/b", 2, 11.0), ("ns/a", 1, 12.0)]
    waiting = q.queue.take("uid-b")
    q.queue.resolve(waiting, Activation(True, b, switched=True, fence=3))
    await asyncio.wait([tasks[0], tasks[2]], timeout=5.0)
    assert [t.done() for t in tasks] == [True, False, True]
    assert q.answered == [("uid-b", 2)], "one answer for both callers of b"
    q.queue.fail_all("stopping", "the controller is stopping", fence=3)
    assert (await tasks[1]).reason == "stopping"
    assert not q.queue
    assert q.answered == [("uid-b", 2)], "a refusal is not the holder's work"


async def test_an_entry_every_caller_left_is_dropped_but_not_the_home_return() -> None:
    q = _Queue()
    a, home = claimant("a"), claimant("home")
    task = await q.ask(a)
    q.queue.add_home(home)
    assert [w.claimant.ref for w in q.queue.ahead_of("uid-none")] == ["ns/a", "ns/home"]
    task.cancel()
    await asyncio.wait([task], timeout=5.0)
    assert [w.claimant.ref for w in q.queue.ahead_of("uid-none")] == ["ns/home"], (
        "nobody waits for a any more")
    gone = q.queue.abandoned()
    assert [w.claimant.ref for w in gone] == ["ns/a"]
    assert list(q.queue.entries) == ["uid-home"], "the home return waits for nobody"
    assert [c.length for c in q.queue.claim_queues()] == [1], "the home return counts one"


async def test_a_fenced_off_entry_goes_first_with_the_callers_who_came_meanwhile() -> None:
    q = _Queue()
    a, b = claimant("a"), claimant("b")
    first = await q.ask(a)
    other = await q.ask(b)
    waiting = q.queue.take("uid-a")  # its switch begins
    later = await q.ask(a)  # asks while the switch runs: queued under a's claim again
    q.queue.to_front(waiting)
    assert list(q.queue.entries) == ["uid-a", "uid-b"]
    assert q.queue.entries["uid-a"].waiting() == 2, "one entry holds both callers"
    q.queue.resolve(q.queue.take("uid-a"), Activation(True, a, switched=True, fence=4))
    assert (await first).ok
    assert (await later).ok
    q.queue.fail_all("stopping", "the controller is stopping", fence=4)
    assert not (await other).ok
