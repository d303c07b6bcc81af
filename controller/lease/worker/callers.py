"""The callers waiting on one GPU: one entry per claim, in the order its first request
arrived; every caller of an entry shares its one switch (coalescing), and an entry whose
callers all left is dropped before its wake."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.worker.state import Activation


@dataclass
class Waiting:
    claimant: Claimant
    futures: list[asyncio.Future[Activation]]
    fenced: int = 0
    """How often its switch was fenced off before it began."""
    since: float = 0.0
    """When its first request arrived."""
    home: bool = False
    """The return of the GPU's home model (nobody waits; never cancelled)."""
    kept: bool = False
    """An engine sleeping with requests kept (a preemptive switch froze them): its wake
    serves those requests, whether or not a caller asks for it too."""

    def waiting(self) -> int:
        return sum(1 for f in self.futures if not f.done())

    def wanted(self) -> bool:
        """Whether a switch for it still serves somebody (the home return and the kept
        requests of a frozen engine always do)."""
        return self.home or self.kept or self.waiting() > 0


class CallerQueue:
    """The waiting callers of one GPU, answered one entry at a time."""

    def __init__(self, *, clock: Callable[[], float], wakeup: asyncio.Event,
                 answered: Callable[[str, int], None]) -> None:
        self.clock = clock
        self.wakeup = wakeup
        """Set when somebody queues: the worker's loop serves them."""
        self.answered = answered
        """Told of each activation answered ok: its claim uid and how many callers."""
        self.entries: dict[str, Waiting] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __contains__(self, uid: object) -> bool:
        return uid in self.entries

    async def wait(self, claimant: Claimant) -> Activation:
        """Queue one caller for ``claimant`` and wait for its switch's answer."""
        future: asyncio.Future[Activation] = asyncio.get_running_loop().create_future()
        self.entries.setdefault(claimant.claim_uid, Waiting(claimant, [], since=self.clock())
                                ).futures.append(future)
        self.wakeup.set()
        return await future

    def add_home(self, home: Claimant) -> None:
        """Queue the return of the GPU's home model (nobody waits for it)."""
        self.entries.setdefault(home.claim_uid, Waiting(home, [], since=self.clock(),
                                                        home=True))
        self.wakeup.set()

    def keep_frozen(self, frozen: dict[str, tuple[Claimant, float]]) -> None:
        """Queue a wake of every engine in ``frozen`` (claim uid to its claimant and since
        when it is frozen), so that the policy can serve its kept requests when no caller
        asks; an entry queued so whose engine is no longer frozen goes (its callers, if any,
        stay)."""
        for uid, waiting in list(self.entries.items()):
            if waiting.kept and uid not in frozen:
                waiting.kept = False
                if not waiting.wanted():
                    self.entries.pop(uid)
        for uid, (claimant, since) in frozen.items():
            waiting = self.entries.setdefault(uid, Waiting(claimant, [], since=since))
            if not waiting.kept:
                waiting.kept = True
                waiting.since = min(waiting.since, since)

    def pending(self) -> int:
        return sum(len(w.futures) for w in self.entries.values())

    def abandoned(self) -> list[Waiting]:
        """Drop and return the entries every caller left (no switch for them)."""
        gone = [w for w in self.entries.values() if not w.wanted()]
        for waiting in gone:
            self.entries.pop(waiting.claimant.claim_uid)
        return gone

    def by_ref(self, ref: str | None) -> Waiting | None:
        return next((w for w in self.entries.values() if w.claimant.ref == ref), None)

    def take(self, uid: str) -> Waiting:
        """Remove the entry of ``uid``: its switch begins, or it is answered."""
        return self.entries.pop(uid)

    def ahead_of(self, uid: str) -> list[Waiting]:
        """The entries served before ``uid``'s that still serve somebody."""
        ahead: list[Waiting] = []
        for waiting in self.entries.values():
            if waiting.claimant.claim_uid == uid:
                break
            if waiting.wanted():
                ahead.append(waiting)
        return ahead

    def claim_queues(self) -> tuple[switch_policy.ClaimQueue, ...]:
        """The queue as the switch policy reads it (a home return counts one)."""
        return tuple(switch_policy.ClaimQueue(w.claimant.ref, max(w.waiting(), int(w.home)),
                                              w.since) for w in self.entries.values())

    def resolve(self, waiting: Waiting, activation: Activation) -> None:
        """Answer every caller of ``waiting`` still there."""
        answered = 0
        for future in waiting.futures:
            if not future.done():
                future.set_result(activation)
                answered += 1
        if activation.ok and answered:
            self.answered(activation.claimant.claim_uid, answered)

    def fail_all(self, reason: str, message: str, *, fence: int) -> None:
        for waiting in self.entries.values():
            self.resolve(waiting, Activation(False, waiting.claimant, switched=False,
                                             fence=fence, reason=reason, message=message))
        self.entries.clear()

    def to_front(self, waiting: Waiting) -> None:
        """Queue ``waiting`` again, first. Callers who asked for the same engine
        meanwhile queued under its claim: they join these, in their order (a second
        entry would replace this one, and its callers would wait for ever)."""
        uid = waiting.claimant.claim_uid
        came_meanwhile = self.entries.pop(uid, None)
        if came_meanwhile is not None:
            waiting.futures.extend(came_meanwhile.futures)
        self.entries = {uid: waiting, **self.entries}
