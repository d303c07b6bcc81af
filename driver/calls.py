"""The preparer's calls in flight: the order they arrived in, and whether one is wedged.

**Order.** The kubelet's prepare and unprepare calls of one claim may overlap (its cache
lock is not held across gRPC calls), and a prepare reads its claims from the API server
before it takes the preparer's lock, so an unprepare that arrives later can reach the
lock first. Every call therefore takes a *ticket* on arrival, before it reads anything.
Under the preparer's lock, a call of a claim for which a call of the other verb with a
later ticket already took effect does nothing for that claim (:meth:`CallBook.overtaken`)
and answers so: a later call of the same claim always wins. A later call of the same
verb is harmless (prepare answers from the ledger, unprepare of nothing succeeds). What
took effect is remembered only while an older call is still in flight.

**Watchdog.** Each call has a deadline: the caller's (the kubelet sends 45 s) or, without
one, :data:`DEFAULT_DEADLINE_S` after its arrival. Work already begun is never cut off
(:func:`rota.kit.aio.finish_first`), so a worker thread stuck in a hung disk write keeps
its call in flight, and every later call queues behind it. :meth:`CallBook.stalled` says
so once a call is still in flight ``stall_grace_s`` after its deadline; the driver's
liveness probe (``/healthz``) fails on it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_DEADLINE_S", "STALL_GRACE_S", "Call", "CallBook", "Verb"]

Verb = Literal["prepare", "unprepare", "collect"]

DEFAULT_DEADLINE_S = 45.0
"""The deadline of a call that brought none (the kubelet's own for its DRA calls)."""
STALL_GRACE_S = 15.0
"""How long past its deadline a call may stay in flight before the preparer counts as
wedged."""


@dataclass(frozen=True)
class Call:
    """One call in flight: its ticket (arrival order), verb, claims and deadline."""

    ticket: int
    verb: Verb
    uids: tuple[str, ...]
    arrived: float
    deadline: float
    """``time.monotonic()`` after which the caller no longer waits."""


class CallBook:
    """Tickets, effects and the watchdog; see the module docstring. Thread-safe: calls
    arrive on the event loop, effects are noted from worker threads."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 default_deadline_s: float = DEFAULT_DEADLINE_S,
                 stall_grace_s: float = STALL_GRACE_S) -> None:
        """``clock`` is the monotonic clock deadlines are measured on (a test moves it)."""
        self.clock = clock
        self.default_deadline_s = default_deadline_s
        self.stall_grace_s = stall_grace_s
        self._mutex = threading.Lock()
        self._tickets = itertools.count(1)
        self._calls: dict[int, Call] = {}
        self._effects: dict[str, tuple[int, Verb]] = {}  # uid -> latest effective call

    @contextlib.contextmanager
    def arrive(self, verb: Verb, uids: Collection[str], deadline: float | None = None
               ) -> Iterator[Call]:
        """Take a ticket now; the call stays in flight until the block ends."""
        now = self.clock()
        with self._mutex:
            call = Call(ticket=next(self._tickets), verb=verb, uids=tuple(uids), arrived=now,
                        deadline=now + self.default_deadline_s if deadline is None
                        else deadline)
            self._calls[call.ticket] = call
        try:
            yield call
        finally:
            with self._mutex:
                del self._calls[call.ticket]
                oldest = min(self._calls, default=None)
                # An effect matters only to calls older than it.
                self._effects = {} if oldest is None else {
                    uid: effect for uid, effect in self._effects.items() if effect[0] > oldest}

    def overtaken(self, call: Call, uid: str) -> bool:
        """True when a call of the other verb that arrived after ``call`` already took
        effect for ``uid``: ``call`` must do nothing for it."""
        with self._mutex:
            effect = self._effects.get(uid)
        if effect is None or effect[0] <= call.ticket:
            return False
        return {effect[1], call.verb} == {"prepare", "unprepare"}

    def took_effect(self, call: Call, uid: str) -> None:
        """Note that ``call`` prepared (or answered prepared) or unprepared ``uid``."""
        with self._mutex:
            effect = self._effects.get(uid)
            if effect is None or effect[0] < call.ticket:
                self._effects[uid] = (call.ticket, call.verb)

    def in_flight(self) -> list[Call]:
        """The calls in flight, oldest first."""
        with self._mutex:
            return [self._calls[t] for t in sorted(self._calls)]

    def stalled(self) -> str:
        """Empty when no call is overdue, else what is wedged (for the liveness probe)."""
        now = self.clock()
        overdue = [c for c in self.in_flight() if now > c.deadline + self.stall_grace_s]
        if not overdue:
            return ""
        call = overdue[0]
        return (f"the preparer is wedged: a {call.verb} of {len(call.uids)} claim(s) has "
                f"been in flight for {now - call.arrived:.0f} s, {now - call.deadline:.0f} s "
                f"past its deadline ({len(overdue)} call(s) overdue; a hung disk?)")
