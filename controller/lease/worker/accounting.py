"""The holder's work and tenure on one GPU, and what its switches cost: what the switch
policy weighs (how long the holder has been awake, when it last had work, who had the GPU
lately, the measured cost of each claim's sleep, drain, wake and probe)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.engines.base import EngineAdapter
from controller.lease.switch import SwitchResult

USAGE_DECAY_S = 300.0
"""The fair share looks at roughly the last five minutes of who was awake."""
ANSWERED_GRACE_S = 1.0
"""How long the callers an activation answered count as the holder's work while its
engine's metrics show none (their requests are on their way)."""


class HolderWork:
    """The holder's work accounting on one GPU, and the measured switch costs."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.holder_since = clock()
        """When the GPU's current holder (or nobody) took it."""
        self.last_busy = clock()
        """When the holder was last seen with work."""
        self.costs: dict[str, switch_policy.SwitchCost] = {}
        """Measured switch costs per claimant (from this controller's SwitchResult timings)."""
        self.drains: dict[str, float] = {}
        self._usage: dict[str, float] = {}
        """Awake seconds per claimant, decaying (time constant USAGE_DECAY_S): the fair
        share's measure of who had the GPU lately."""
        self._usage_at = clock()
        self._answered: tuple[str, int, float] | None = None
        """The claim uid an activation last answered ok, how many callers, and when."""

    # -- the holder's work -------------------------------------------------------------

    def answered(self, uid: str, callers: int) -> None:
        """An activation of ``uid`` was answered ok for ``callers`` callers just now."""
        self._answered = (uid, callers, self.clock())

    def in_flight_seen(self, holder: Claimant, measured: int) -> int:
        """The holder's work in flight: what its engine reports, or, until the engine shows
        work or :data:`ANSWERED_GRACE_S` has passed, the callers an activation just
        answered for it. Their requests are on their way: an engine's metrics count them
        only once they arrive, and a policy that read the holder as idle meanwhile would
        put it to sleep under the requests it was woken for."""
        if self._answered is None or self._answered[0] != holder.claim_uid:
            return measured
        _, callers, at = self._answered
        if measured > 0 or self.clock() - at > ANSWERED_GRACE_S:
            self._answered = None
            return measured
        return callers

    async def load(self, holder: Claimant, engine: EngineAdapter) -> int:
        """The holder's work in flight now (see :meth:`in_flight_seen`); work seen counts
        as the holder busy now. Raises the engine's errors."""
        in_flight = self.in_flight_seen(holder, await engine.in_flight() or 0)
        if in_flight:
            self.last_busy = self.clock()
        return in_flight

    # -- tenure and usage --------------------------------------------------------------

    def new_tenure(self, ended: str | None = None) -> None:
        """The GPU changed hands now; ``ended`` (a claim ref) was awake until now."""
        if ended is not None:
            self.used(ended, self.clock() - self.holder_since)
        self.holder_since = self.last_busy = self.clock()

    def used(self, ref: str, seconds: float) -> None:
        """Count ``seconds`` awake for ``ref``; everyone's count decays meanwhile."""
        now = self.clock()
        decay = math.exp(-max(0.0, now - self._usage_at) / USAGE_DECAY_S)
        self._usage = {k: v * decay for k, v in self._usage.items() if v * decay > 1e-3}
        self._usage_at = now
        if seconds > 0:
            self._usage[ref] = self._usage.get(ref, 0.0) + seconds

    def usage_now(self, holder: Claimant | None) -> dict[str, float]:
        """Recent awake seconds per claimant, the holder's current tenure included."""
        self.used("", 0.0)
        usage = dict(self._usage)
        if holder is not None:
            usage[holder.ref] = usage.get(holder.ref, 0.0) + max(
                0.0, self.clock() - self.holder_since)
        return usage

    # -- switch costs ------------------------------------------------------------------

    def switch_cost(self, holder: str | None, target: str | None) -> float:
        """The expected cost of a switch from ``holder`` (None: nobody awake) to ``target``
        (None: a claimant not known yet): the holder's sleep and drain, the target's wake and
        probe, as this worker measured them (the policy's defaults otherwise)."""
        default = switch_policy.SwitchCost()
        costs = self.costs
        sleep = 0.0 if holder is None else (costs.get(holder, default).sleep_s
                                            + self.drains.get(holder, 0.0))
        woken = costs.get(target, default) if target is not None else default
        return sleep + woken.wake_s + woken.probe_s

    def measured(self, result: SwitchResult, holder: Claimant | None, target: Claimant
                 ) -> None:
        """Keep the measured costs of a finished switch per claimant."""
        if result.ok:
            self.keep_costs(result.timings, holder, target)

    def keep_costs(self, t: Mapping[str, float], holder: Claimant | None,
                   target: Claimant) -> None:
        if holder is not None:
            cost = self.costs.get(holder.ref, switch_policy.SwitchCost())
            if "later_sleep" in t:
                cost = dataclasses.replace(cost, sleep_s=t["later_sleep"])
            self.costs[holder.ref] = cost
            if "drain" in t:
                self.drains[holder.ref] = t["drain"]
        cost = self.costs.get(target.ref, switch_policy.SwitchCost())
        if "wake_call" in t:
            cost = dataclasses.replace(cost, wake_s=t["wake_call"])
        if "probe_ttft" in t:
            cost = dataclasses.replace(cost, probe_s=t["probe_ttft"])
        self.costs[target.ref] = cost
